"""Benchmark the CUDA decode GEMVs (kernels/cuda_gemv.py) against the Triton skinny kernels at M = 1 on one GPU.

1. Read peak: a read-only streaming kernel (scripts/bench/read_peak.py), measured in this run.
2. Per decoder shape (qkv, o_proj, gate_up + SwiGLU, down, lm_head): the Triton skinny kernel at its CONFIGS entry
   and every CUDA candidate (``cuda_gemv.sweep_configs``; --quick: the first 4), each first checked once against
   the reference (a wrong config is reported and skipped), then timed: us per call = median over graph replays,
   each graph cycling through enough copies of the weight (>= 320 MB; --quick 128 MB) that L2 (50 MB) cannot hold
   it (bench_skinny_gemm's helpers); % of the read peak over the bytes moved (W + x + y).
3. Chain: the 28 layers' 4 GEMVs in sequence with distinct weights per layer (qkv -> o on the first 2048 qkv
   outputs -> gate_up + SwiGLU -> down, whose output feeds the next layer's qkv: each launch depends on the one
   before), captured in ONE CUDA graph with PDL on: Triton chain, CUDA chain (best CUDA config per shape from
   stage 2), mixed (per shape the faster of the two); ms per chain (+ the CUDA chain with PDL off outside --quick).

--int8 (int8 weights with per-row fp32 scales, ``skinny_gemm.quantize_rows``; the lm head stays bf16 and is
skipped): stage 2 runs on int8 weights instead: per shape the Triton int8 skinny kernel (its ``int8_config``) vs
the CUDA int8 candidates (``sweep_configs(..., int8=True)``; --quick: the first 6, which include the I2F
conversion variant of the selected config), % of the read peak over the bytes streamed (int8 W + fp32 scales +
x + y). Stage 3 runs the bf16 chains (Triton, and CUDA with the bf16 table's configs) next to the int8 ones
(Triton int8, CUDA int8 with the best candidate per shape, mixed int8), on the same weights quantized.

Writes <--out>/bench_cuda_gemv.json after every stage (default $OUT or .); prints the tables.

Usage (from the checkout root): PYTHONUNBUFFERED=1 python3 -m scripts.bench.bench_cuda_gemv [--quick] [--int8]
       [--no-chain] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
from glmasr_kernels import cuda_gemv as cg
from glmasr_kernels import skinny_gemm as sg

from scripts.bench.bench_skinny_gemm import gen, graph_us, ours_call, weights

BF = torch.bfloat16
HIDDEN, INTER, LAYERS = 2048, 6144, 28
SHAPES = {  # name -> (W rows, K, swiglu)
    "qkv": (3072, 2048, False),
    "o_proj": (2048, 2048, False),
    "gate_up_swiglu": (12288, 2048, True),
    "down": (2048, 6144, False),
    "lm_head": (59264, 2048, False),
}
T0 = time.time()
RESULT: dict = {"shapes": [], "shapes_int8": [], "chain": [], "errors": []}
OUT_DIR = "."


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def dump():
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "bench_cuda_gemv.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def cuda_call(x, w, out, swiglu, cfg, pdl=None, scale=None):
    if swiglu:
        return lambda: cg.gemv_swiglu(x, w, out=out, config=cfg, pdl=pdl, scale=scale)
    return lambda: cg.gemv(x, w, out=out, config=cfg, pdl=pdl, scale=scale)


def rel_error(x, w, swiglu, cfg, scale=None) -> float:
    out = torch.full((1, w.shape[0] // 2 if swiglu else w.shape[0]), float("nan"), device="cuda", dtype=BF)
    cuda_call(x, w, out, swiglu, cfg, scale=scale)()
    ref = (cg.gemv_swiglu_ref if swiglu else cg.gemv_ref)(x, w, scale=scale).float()
    return ((out.float() - ref).norm() / ref.norm()).item()


def weights_int8(n: int, k: int, min_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, scale) copies of fresh random weights, enough int8 bytes that L2 cannot hold them."""
    copies = max(2, -(-min_bytes // (n * k)))
    return [sg.quantize_rows(gen(n, k, scale=k ** -0.5)) for _ in range(copies)]


def bench_shapes_int8(peak: float, quick: bool, rotate: int) -> tuple[list[str], dict]:
    log("int8 weights, per shape at M = 1: Triton int8 skinny (int8_config) vs CUDA int8 configs")
    table = [f"{'shape':15s} {'kernel':8s} {'us':>8s} {'%peak':>6s} {'vs triton':>9s}  config (int8 W + scales)"]
    best: dict[str, tuple[float, cg.GemvConfig | None, float]] = {}
    for name, (n, k, swiglu) in SHAPES.items():
        if name == "lm_head":
            continue
        ws = weights_int8(n, k, rotate)
        no = n // 2 if swiglu else n
        x = gen(1, k)
        out = torch.empty(1, no, device="cuda", dtype=BF)
        byts = n * k + n * 4 + k * 2 + no * 2
        t_tri = float("nan")
        tcfg = sg.kernel_config(1, n, k, swiglu, int8=True)
        try:
            t_tri = graph_us([ours_call(x, q, out, swiglu, scale=sc) for q, sc in ws])
        except Exception as e:
            RESULT["errors"].append(f"{name} triton int8: {e}")
            traceback.print_exc()
        row = f"{name:15s} {'triton':8s} {t_tri:8.2f} {100 * byts / t_tri / 1e3 / peak:6.1f} {1.0:9.2f}  {tcfg.short()}"
        table.append(row)
        log(row)
        RESULT["shapes_int8"].append(dict(shape=name, kernel="triton", us=t_tri, cfg=tcfg.short(), bytes=byts,
                                          pct_peak=100 * byts / t_tri / 1e3 / peak))
        cands = cg.sweep_configs(n, k, swiglu, 1, int8=True)
        if quick:
            cands = cands[:6]
        cg.prebuild(cands, sm=cg._device_sm(torch.cuda.current_device()))
        rows = []
        for cfg in cands:
            try:
                rel = rel_error(x, ws[0][0], swiglu, cfg, scale=ws[0][1])
                if not rel < (2e-2 if swiglu else 1e-2):
                    RESULT["errors"].append(f"{name} {cfg.short()}: wrong, rel error {rel}")
                    log(f"  {name} {cfg.short()}: WRONG (rel error {rel}); skipped")
                    continue
                t = graph_us([cuda_call(x, q, out, swiglu, cfg, scale=sc) for q, sc in ws])
            except Exception as e:
                RESULT["errors"].append(f"{name} {cfg.short()}: {e}")
                log(f"  {name} {cfg.short()}: ERROR {e}")
                traceback.print_exc()
                continue
            pct = 100 * byts / t / 1e3 / peak
            rows.append((t, cfg))
            row = f"{name:15s} {'cuda':8s} {t:8.2f} {pct:6.1f} {t_tri / t:9.2f}  {cfg.short()}"
            table.append(row)
            log(row)
            RESULT["shapes_int8"].append(dict(shape=name, kernel="cuda", us=t, pct_peak=pct, cfg=cfg.short(),
                                              config=cfg.__dict__, rel_error=rel, bytes=byts,
                                              selected=cfg == cg.select(n, k, swiglu, 1, int8=True)))
        rows.sort(key=lambda r: r[0])
        best[name] = (t_tri, rows[0][1] if rows else None, rows[0][0] if rows else float("nan"))
        del ws
        torch.cuda.empty_cache()
        dump()
    return table, best


def bench_shapes(peak: float, quick: bool, rotate: int) -> tuple[list[str], dict]:
    log("per shape at M = 1: Triton skinny (CONFIGS) vs CUDA configs (us per call in a CUDA graph, rotating weights)")
    table = [f"{'shape':15s} {'kernel':8s} {'us':>8s} {'%peak':>6s} {'vs triton':>9s}  config"]
    best: dict[str, tuple[float, cg.GemvConfig | None, float]] = {}
    for name, (n, k, swiglu) in SHAPES.items():
        ws = weights(n, k, rotate)
        no = n // 2 if swiglu else n
        x = gen(1, k)
        out = torch.empty(1, no, device="cuda", dtype=BF)
        byts = n * k * 2 + k * 2 + no * 2
        t_tri = float("nan")
        tcfg = sg.kernel_config(1, n, k, swiglu)
        try:
            t_tri = graph_us([ours_call(x, w, out, swiglu) for w in ws])
        except Exception as e:
            RESULT["errors"].append(f"{name} triton: {e}")
            traceback.print_exc()
        row = f"{name:15s} {'triton':8s} {t_tri:8.2f} {100 * byts / t_tri / 1e3 / peak:6.1f} {1.0:9.2f}  {tcfg.short()}"
        table.append(row)
        log(row)
        RESULT["shapes"].append(dict(shape=name, kernel="triton", us=t_tri, pct_peak=100 * byts / t_tri / 1e3 / peak,
                                     cfg=tcfg.short(), bytes=byts))
        cands = cg.sweep_configs(n, k, swiglu, 1)
        if quick:
            cands = cands[:4]
        cg.prebuild(cands, sm=cg._device_sm(torch.cuda.current_device()))
        rows = []
        for cfg in cands:
            try:
                rel = rel_error(x, ws[0], swiglu, cfg)
                if not rel < (2e-2 if swiglu else 1e-2):
                    RESULT["errors"].append(f"{name} {cfg.short()}: wrong, rel error {rel}")
                    log(f"  {name} {cfg.short()}: WRONG (rel error {rel}); skipped")
                    continue
                t = graph_us([cuda_call(x, w, out, swiglu, cfg) for w in ws])
            except Exception as e:
                RESULT["errors"].append(f"{name} {cfg.short()}: {e}")
                log(f"  {name} {cfg.short()}: ERROR {e}")
                traceback.print_exc()
                continue
            pct = 100 * byts / t / 1e3 / peak
            rows.append((t, cfg))
            row = f"{name:15s} {'cuda':8s} {t:8.2f} {pct:6.1f} {t_tri / t:9.2f}  {cfg.short()}"
            table.append(row)
            log(row)
            RESULT["shapes"].append(dict(shape=name, kernel="cuda", us=t, pct_peak=pct, cfg=cfg.short(),
                                         config=cfg.__dict__, rel_error=rel, bytes=byts,
                                         selected=cfg == cg.select(n, k, swiglu, 1)))
        rows.sort(key=lambda r: r[0])
        best[name] = (t_tri, rows[0][1] if rows else None, rows[0][0] if rows else float("nan"))
        del ws
        torch.cuda.empty_cache()
        dump()
    return table, best


def bench_chain(peak: float, best: dict, quick: bool, best8: dict | None = None) -> list[str]:
    """best: per shape (triton us, CUDA config, CUDA us) of the bf16 stage (empty: the bf16 CUDA chain uses the
    table's configs, no mixed chain); best8: the same for int8 (None: no int8 chains)."""
    log("chain: 28 x [qkv, o, gate_up + SwiGLU, down], distinct weights, one CUDA graph, PDL on")
    layers = [dict(qkv=gen(3072, HIDDEN, scale=HIDDEN ** -0.5), o=gen(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5),
                   gu=gen(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5), down=gen(HIDDEN, INTER, scale=INTER ** -0.5))
              for _ in range(LAYERS)]
    wbytes = sum(w.numel() * 2 for L in layers for w in L.values())
    layers8 = [{key: sg.quantize_rows(w) for key, w in L.items()} for L in layers] if best8 is not None else []
    wbytes8 = sum(q.numel() + s.numel() * 4 for L in layers8 for q, s in L.values())
    x0 = gen(1, HIDDEN)
    yq = torch.empty(1, 3072, device="cuda", dtype=BF)
    yo = torch.empty(1, HIDDEN, device="cuda", dtype=BF)
    ya = torch.empty(1, INTER, device="cuda", dtype=BF)
    yd = torch.empty(1, HIDDEN, device="cuda", dtype=BF)
    keys = dict(qkv="qkv", o="o_proj", gu="gate_up_swiglu", down="down")

    def chain(use_cuda: dict, pdl=None, int8=False):
        def run():
            h = x0
            for L in (layers8 if int8 else layers):
                for key, xin, out in (("qkv", h, yq), ("o", yq[:, :HIDDEN], yo), ("gu", yo, ya), ("down", ya, yd)):
                    sw = key == "gu"
                    w, sc = L[key] if int8 else (L[key], None)
                    cfg = use_cuda.get(key)
                    if cfg is not None:
                        (cg.gemv_swiglu if sw else cg.gemv)(xin, w, out=out, config=cfg, pdl=pdl, scale=sc)
                    else:
                        (sg.skinny_gemm_swiglu if sw else sg.skinny_gemm)(xin, w, out=out, scale=sc)
                h = yd
        return run

    def picks(b: dict) -> tuple[dict, dict]:
        cuda = {key: b[nm][1] for key, nm in keys.items() if b.get(nm) and b[nm][1] is not None}
        mix = {key: b[nm][1] for key, nm in keys.items()
               if b.get(nm) and b[nm][1] is not None and b[nm][2] < b[nm][0]}
        return cuda, mix

    if best:
        cuda_cfg, mixed = picks(best)
    else:  # no bf16 shape stage (--int8): the bf16 table's configs
        cuda_cfg = {key: cg.select(*SHAPES[nm][:2], SHAPES[nm][2], 1) for key, nm in keys.items()}
        mixed = None
    variants = [("triton", chain({}), {}, wbytes),
                ("cuda" if best else "cuda (table)", chain(cuda_cfg), cuda_cfg, wbytes)]
    if mixed is not None:
        variants.append(("mixed", chain(mixed), mixed, wbytes))
    if not quick:
        variants.append(("cuda pdl off", chain(cuda_cfg, pdl=False), cuda_cfg, wbytes))
    if best8 is not None:
        cuda8, mixed8 = picks(best8)
        variants += [("triton int8", chain({}, int8=True), {}, wbytes8),
                     ("cuda int8", chain(cuda8, int8=True), cuda8, wbytes8),
                     ("mixed int8", chain(mixed8, int8=True), mixed8, wbytes8)]
    table = [f"weights {wbytes / 1e9:.3f} GB, floor at read peak {wbytes / peak / 1e6:.3f} ms"
             + (f"; int8 {wbytes8 / 1e9:.3f} GB, floor {wbytes8 / peak / 1e6:.3f} ms" if layers8 else ""),
             f"{'variant':14s} {'ms/chain':>9s} {'%peak':>6s} {'vs triton':>9s}  per-shape kernels"]
    base = None
    for vname, fn, which, nbytes in variants:
        try:
            t_ms = graph_us([fn], min_calls=1, replays=7 if quick else 15) * 1e-3
        except Exception as e:
            RESULT["errors"].append(f"chain {vname}: {e}")
            log(f"  chain {vname}: ERROR {e}")
            traceback.print_exc()
            continue
        base = base or t_ms  # "vs triton": against the bf16 Triton chain
        desc = ", ".join(f"{k}:{'cuda' if k in which else 'triton'}" for k in keys)
        pct = 100 * nbytes / t_ms / 1e6 / peak
        row = f"{vname:14s} {t_ms:9.3f} {pct:6.1f} {base / t_ms:9.2f}  {desc}"
        table.append(row)
        log(row)
        RESULT["chain"].append(dict(variant=vname, ms=t_ms, pct_peak=pct, weight_bytes=nbytes,
                                    cuda={k: c.short() for k, c in which.items()}))
        dump()
    layers.clear()
    layers8.clear()
    torch.cuda.empty_cache()
    return table


def main() -> int:
    global OUT_DIR
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="4 CUDA configs per shape (--int8: 6), 128 MB rotation (< 2 min)")
    ap.add_argument("--int8", action="store_true",
                    help="int8 weights: the per-shape stage on int8 (Triton int8 vs CUDA int8 candidates), and int8 "
                         "chains next to the bf16 ones")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_cuda_gemv.json")
    ap.add_argument("--no-chain", action="store_true")
    args = ap.parse_args()
    OUT_DIR = args.out
    if not torch.cuda.is_available() or not cg.is_available():
        print("bench_cuda_gemv: needs a CUDA GPU of compute capability >= 9.0 and cuda-bindings", file=sys.stderr)
        return 2
    import triton

    from scripts.bench.read_peak import read_GBps

    RESULT["env"] = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                         sms=torch.cuda.get_device_properties(0).multi_processor_count, quick=args.quick)
    log(RESULT["env"])
    peak = read_GBps(nbytes=(1 if args.quick else 2) * 1024 ** 3, repeats=5 if args.quick else 10)
    RESULT["read_peak_GBps"] = peak
    log(f"read peak {peak:.0f} GB/s")
    dump()
    rotate = (128 if args.quick else 320) << 20
    best, best8 = {}, None
    if args.int8:
        t_shapes, best8 = bench_shapes_int8(peak, args.quick, rotate)
        RESULT["best_int8"] = {nm: dict(triton_us=t, cuda_us=tc, cuda_cfg=c.short() if c else None)
                               for nm, (t, c, tc) in best8.items()}
    else:
        t_shapes, best = bench_shapes(peak, args.quick, rotate)
        RESULT["best"] = {nm: dict(triton_us=t, cuda_us=tc, cuda_cfg=c.short() if c else None)
                          for nm, (t, c, tc) in best.items()}
    t_chain = [] if args.no_chain else bench_chain(peak, best, args.quick, best8)
    RESULT["wall_s"] = time.time() - T0
    dump()
    print(f"\nread peak {peak:.0f} GB/s; errors: {len(RESULT['errors'])}")
    print("\n".join(t_shapes))
    print()
    print("\n".join(t_chain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
