"""Benchmark (and autotune) the skinny decode GEMMs of kernels/skinny_gemm.py against cuBLAS on one GPU.

1. Copy peak: 1 GiB device-to-device copy (bytes read + written), measured in this run.
2. (--sweep) For each decode shape (qkv, o_proj, gate_up, down, lm_head, gate_up+SwiGLU) and M bucket: a grid
   of configs is first compiled and checked against the reference in parallel worker processes (filling
   Triton's on-disk cache; a config that fails to compile or is wrong is dropped), then each is timed; the best
   replaces the entry of ``kernels.skinny_gemm.CONFIGS`` in this process (so the rest of the run uses it) and
   the table is printed as a dict literal to paste into kernels/skinny_gemm.py (also $OUT/skinny_configs.py).
3. Per shape and M in {1, 2, 4, 8, 16}: ours vs cuBLAS (torch.mm with out=; gate_up+SwiGLU: cuBLAS + the Triton
   swiglu kernel), us per call = median over graph replays / calls, each graph cycling through enough copies of
   the weight (>= 320 MB) that L2 (50 MB) cannot hold it. GB/s over the bytes moved (W + x + y) and % of copy peak.
4. The whole decoder weight set (28 layers x qkv, o, gate_up, down + lm_head, 2.94 GB, distinct weights) captured
   in ONE CUDA graph at M = 1, 4, 16: cuBLAS, ours, cuBLAS + swiglu kernel, ours with the fused SwiGLU.

Writes $OUT/bench_skinny_gemm.json (or ./bench_skinny_gemm.json) after every stage; prints tables.
5. (--aot-check defaults|all, no GPU needed, TRITON_INTERPRET unset) compile for sm_90 with Triton's bundled
   ptxas and print registers, stack (spills), shared memory and the SASS counts of (128-bit) global loads,
   cp.async, MMA and local-memory instructions per kernel.

Usage (from the checkout root): PYTHONUNBUFFERED=1 python -m scripts.bench.bench_skinny_gemm [--sweep] [--sweep-m 1,2,4,8,16] [--budget S]
       [--workers N] [--quick] [--no-decoder] [--int8]
       python -m scripts.bench.bench_skinny_gemm --aot-check all
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback

import torch

from glmasr_kernels import skinny_gemm as sg
from glmasr_kernels.skinny_gemm import SkinnyConfig
from scripts.bench.graph_timing import graph_call_us

BF = torch.bfloat16
INT8 = False  # --int8
HIDDEN, INTER, VOCAB, LAYERS = 2048, 6144, 59264, 28
# name -> (W rows, K, swiglu)
SHAPES = {
    "qkv": (3072, 2048, False),
    "o_proj": (2048, 2048, False),
    "gate_up": (12288, 2048, False),
    "down": (2048, 6144, False),
    "lm_head": (59264, 2048, False),
    "gate_up_swiglu": (12288, 2048, True),
}
BENCH_M = [1, 2, 4, 8, 16]
ROTATE_BYTES = 320 << 20
T0 = time.time()
RESULT: dict = {"shapes": [], "sweep": [], "decoder": [], "errors": []}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def out_dir() -> str:
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    return d


def dump():
    with open(os.path.join(out_dir(), "bench_skinny_gemm.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


# ------------------------------------------------------------------------------------------------ candidates

def candidates(mb: int) -> list[SkinnyConfig]:
    """Config grid per M bucket (FMA for small M, tensor cores for larger; split-K variants)."""
    c = SkinnyConfig
    fma = [c(4, 1024), c(8, 512), c(8, 1024), c(8, 1024, num_warps=8), c(16, 512), c(16, 1024, num_warps=8),
           c(32, 256), c(32, 512, num_warps=8), c(8, 512, num_stages=3), c(16, 256, num_stages=3),
           c(8, 512, 2), c(16, 512, 2), c(8, 256, 4)]
    dot = [c(16, 256, num_stages=4, use_dot=True), c(16, 128, num_stages=4, use_dot=True),
           c(32, 256, num_stages=4, use_dot=True), c(32, 128, num_stages=3, use_dot=True),
           c(64, 128, num_stages=4, use_dot=True), c(64, 256, num_warps=8, num_stages=3, use_dot=True),
           c(16, 256, 2, num_stages=4, use_dot=True), c(32, 256, 2, num_stages=4, use_dot=True),
           c(16, 512, num_stages=3, use_dot=True), c(32, 128, num_stages=6, use_dot=True)]
    if mb <= 2:
        return fma
    if mb == 4:
        return [f for f in fma if f.block_n * f.block_k <= 8192] + dot
    if mb == 8:
        return [f for f in fma if f.block_n * f.block_k <= 4096] + dot
    return dot


# ------------------------------------------------------------------------------------------------ helpers

def gen(*shape, scale=1.0, dtype=BF, seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def weights(n: int, k: int, min_bytes: int = ROTATE_BYTES) -> list[torch.Tensor]:
    copies = max(2, math.ceil(min_bytes / (n * k * 2)))
    return [gen(n, k, scale=k ** -0.5) for _ in range(copies)]


def graph_us(calls: list, min_calls: int = 64, replays: int = 9) -> float:
    """us per call: the list of closures (one pass over the weight copies) repeated into one graph."""
    return graph_call_us(calls, repeats=max(1, math.ceil(min_calls / len(calls))), replays=replays)


def copy_peak_gbps() -> float:
    n = 1 << 29  # 1 GiB of bf16
    a = torch.empty(n, device="cuda", dtype=BF).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    ts.sort()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / ts[len(ts) // 2] / 1e9


def cublas_call(x, w, out, swiglu, tmp=None):
    """cuBLAS baseline; for SwiGLU: the GEMM into tmp (M, 2I) + the Triton swiglu kernel (the unfused path;
    the kernel allocates its output, from the graph's private pool)."""
    if swiglu:
        from glmasr_kernels.activations import swiglu as swiglu_k

        def f():
            torch.mm(x, w.t(), out=tmp)
            swiglu_k(tmp)
        return f
    return lambda: torch.mm(x, w.t(), out=out)


def ours_call(x, w, out, swiglu, cfg=None, scale=None):
    if swiglu:
        return lambda: sg.skinny_gemm_swiglu(x, w, out=out, config=cfg, scale=scale)
    return lambda: sg.skinny_gemm(x, w, out=out, config=cfg, scale=scale)


# ------------------------------------------------------------------------------------------------ sweep

def _compile_check(task):
    """Worker: run one config once at its real shape (compiles into the on-disk cache) and check it."""
    name, m, cfg = task
    try:
        n, k, swiglu = SHAPES[name]
        x = gen(m, k, seed=1)
        w = gen(n, k, scale=k ** -0.5, seed=2)
        if swiglu:
            out = sg.skinny_gemm_swiglu(x, w, config=cfg)
            ref = sg.skinny_gemm_swiglu_ref(x, w)
        else:
            out = sg.skinny_gemm(x, w, config=cfg)
            ref = sg.skinny_gemm_ref(x, w)
        torch.cuda.synchronize()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        return name, m, cfg, rel, None
    except Exception as e:  # noqa: BLE001
        return name, m, cfg, None, f"{type(e).__name__}: {str(e)[-400:]}"


def sweep(ms: list[int], budget: float, workers: int, names: list[str]):
    deadline = time.time() + budget
    tasks = [(nm, m, c) for m in ms for nm in names for c in candidates(sg.m_bucket(m))]
    log(f"sweep: {len(tasks)} (shape, M, config) combinations; compiling+checking with {workers} workers")
    ok: dict[tuple[str, int], list[SkinnyConfig]] = {}
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        futs = [ex.submit(_compile_check, t) for t in tasks]
        try:
            for fu in cf.as_completed(futs, timeout=max(10.0, 0.5 * (deadline - time.time()))):
                name, m, cfg, rel, err = fu.result()
                if err is not None or rel is None or not (rel < (2e-2 if SHAPES[name][2] else 1e-2)):
                    RESULT["sweep"].append(dict(shape=name, M=m, cfg=cfg.short(), error=err, rel=rel))
                    log(f"  drop {name} M={m} {cfg.short()}: {err if err else f'rel {rel}'}")
                    continue
                ok.setdefault((name, m), []).append(cfg)
        except cf.TimeoutError:
            log("  compile phase hit its share of the budget; timing what compiled")
            for fu in futs:
                fu.cancel()
    log(f"sweep: {sum(len(v) for v in ok.values())} configs compiled and correct")
    best_all = {}
    for name in names:
        n, k, swiglu = SHAPES[name]
        ws = weights(n, k)
        for m in ms:
            if time.time() > deadline:
                log("  sweep budget exhausted")
                break
            x = gen(m, k)
            out = torch.empty(m, n // 2 if swiglu else n, device="cuda", dtype=BF)
            tmp = torch.empty(m, n, device="cuda", dtype=BF)
            try:
                t_cublas = graph_us([cublas_call(x, w, out, swiglu, tmp) for w in ws])
            except Exception as e:  # noqa: BLE001
                RESULT["errors"].append(f"sweep {name} M={m} cuBLAS: {e}")
                t_cublas = float("nan")
            default = sg._heuristic(m, n // 2 if swiglu else n, k, swiglu)
            rows = []
            for cfg in ok.get((name, m), []):
                try:
                    t = graph_us([ours_call(x, w, out, swiglu, cfg) for w in ws], min_calls=48, replays=5)
                except Exception as e:  # noqa: BLE001
                    RESULT["errors"].append(f"sweep {name} M={m} {cfg.short()}: {e}")
                    continue
                rows.append((t, cfg))
                RESULT["sweep"].append(dict(shape=name, M=m, cfg=cfg.short(), us=t, cublas_us=t_cublas,
                                            default=cfg == default))
            if not rows:
                continue
            rows.sort(key=lambda r: r[0])
            t_best, best = rows[0]
            t_def = next((t for t, c in rows if c == default), None)
            best_all[(n, k, sg.m_bucket(m), swiglu)] = best
            sg.CONFIGS[(n, k, sg.m_bucket(m), swiglu)] = best
            log(f"  {name:15s} M={m:2d} best {t_best:7.2f} us {best.short():32s} default "
                f"{'-' if t_def is None else f'{t_def:7.2f}'} us  cuBLAS {t_cublas:7.2f} us  "
                f"(top3: {', '.join(f'{t:.2f}' for t, _ in rows[:3])})")
        del ws
        torch.cuda.empty_cache()
        dump()
    lines = ["CONFIGS: dict[tuple[int, int, int, bool], SkinnyConfig] = {"]
    for (n, k, mb, sw), c in sorted(best_all.items()):
        lines.append(f"    ({n}, {k}, {mb}, {sw}): SkinnyConfig({c.block_n}, {c.block_k}, {c.split_k}, "
                     f"num_warps={c.num_warps}, num_stages={c.num_stages}, use_dot={c.use_dot}),")
    lines.append("}")
    text = "\n".join(lines)
    with open(os.path.join(out_dir(), "skinny_configs.py"), "w") as f:
        f.write(text + "\n")
    RESULT["tuned_configs"] = text
    print(text, flush=True)
    dump()


# ------------------------------------------------------------------------------------------------ per shape

def bench_shapes(ms: list[int], names: list[str], peak: float):
    log("per-shape: ours vs cuBLAS (us per call inside a CUDA graph over rotating weights)")
    hdr = f"{'shape':15s} {'M':>3s} {'ours us':>8s} {'cuBLAS us':>9s} {'speedup':>7s} {'ours GB/s':>9s} " \
          f"{'%peak':>6s} {'cuBLAS %':>8s}  config"
    table = [hdr]
    for name in names:
        n, k, swiglu = SHAPES[name]
        ws = weights(n, k)
        ws8 = [sg.quantize_rows(w) for w in weights(n, k, ROTATE_BYTES * 2)] if INT8 and name != "lm_head" else []
        for m in ms:
            no = n // 2 if swiglu else n
            x = gen(m, k)
            out = torch.empty(m, no, device="cuda", dtype=BF)
            tmp = torch.empty(m, n, device="cuda", dtype=BF)
            cfg = sg.kernel_config(m, n, k, swiglu)
            byts = n * k * 2 + m * k * 2 + m * no * 2
            t_o = t_c = float("nan")
            try:
                t_o = graph_us([ours_call(x, w, out, swiglu) for w in ws])
            except Exception as e:  # noqa: BLE001
                RESULT["errors"].append(f"shape {name} M={m}: {e}")
                log(f"  {name} M={m}: ERROR {e}")
                traceback.print_exc()
            try:
                t_c = graph_us([cublas_call(x, w, out, swiglu, tmp) for w in ws])
            except Exception as e:  # noqa: BLE001
                RESULT["errors"].append(f"shape {name} M={m} cuBLAS: {e}")
                log(f"  {name} M={m} cuBLAS: ERROR {e}")
            gbo, gbc = byts / t_o / 1e3, byts / t_c / 1e3
            entry = dict(shape=name, M=m, N=n, K=k, swiglu=swiglu, ours_us=t_o, cublas_us=t_c,
                         ours_GBps=gbo, cublas_GBps=gbc, pct_peak=100 * gbo / peak,
                         cublas_pct_peak=100 * gbc / peak, cfg=cfg.short(), bytes=byts)
            row = (f"{name:15s} {m:3d} {t_o:8.2f} {t_c:9.2f} {t_c / t_o:7.2f} {gbo:9.0f} {100 * gbo / peak:6.1f} "
                   f"{100 * gbc / peak:8.1f}  {cfg.short()}")
            if ws8:  # the int8 weights (decode_weights="int8"): int8 W + fp32 scales streamed
                t_8 = float("nan")
                try:
                    t_8 = graph_us([ours_call(x, q, out, swiglu, scale=sc) for q, sc in ws8])
                except Exception as e:  # noqa: BLE001
                    RESULT["errors"].append(f"shape {name} M={m} int8: {e}")
                    log(f"  {name} M={m} int8: ERROR {e}")
                b8 = n * k + n * 4 + m * k * 2 + m * no * 2
                gb8 = b8 / t_8 / 1e3
                entry.update(int8_us=t_8, int8_GBps=gb8, int8_pct_peak=100 * gb8 / peak, int8_bytes=b8,
                             int8_cfg=sg.kernel_config(m, n, k, swiglu, int8=True).short())
                row += f"  | int8 {t_8:8.2f} us {100 * gb8 / peak:5.1f} % ({t_o / t_8:4.2f}x)"
            RESULT["shapes"].append(entry)
            table.append(row)
            log(row)
        del ws
        torch.cuda.empty_cache()
        dump()
    return table


# ------------------------------------------------------------------------------------------------ whole decoder

def bench_decoder(ms: list[int], peak: float):
    log("whole decoder weight set in one CUDA graph (28 x [qkv, o, gate_up, down] + lm_head)")
    layers = []
    for i in range(LAYERS):
        layers.append(dict(qkv=gen(3072, HIDDEN, scale=HIDDEN ** -0.5), o=gen(HIDDEN, 2048, scale=2048 ** -0.5),
                           gu=gen(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5), down=gen(HIDDEN, INTER, scale=INTER ** -0.5)))
    lm = gen(VOCAB, HIDDEN, scale=HIDDEN ** -0.5)
    wbytes = sum(w.numel() * 2 for L in layers for w in L.values()) + lm.numel() * 2
    log(f"  weights {wbytes / 1e9:.3f} GB, floor at copy peak {wbytes / peak / 1e6:.3f} ms")
    from glmasr_kernels.activations import swiglu as swiglu_k
    table = [f"{'variant':24s} {'M':>3s} {'ms/step':>8s} {'GB/s':>7s} {'%peak':>6s} {'vs cuBLAS':>9s}"]
    for m in ms:
        xh = gen(m, HIDDEN)
        xi = gen(m, INTER)
        yq = torch.empty(m, 3072, device="cuda", dtype=BF)
        yh = torch.empty(m, HIDDEN, device="cuda", dtype=BF)
        ygu = torch.empty(m, 2 * INTER, device="cuda", dtype=BF)
        yi = torch.empty(m, INTER, device="cuda", dtype=BF)
        ylm = torch.empty(m, VOCAB, device="cuda", dtype=BF)

        def cublas(fused_act):
            for L in layers:
                torch.mm(xh, L["qkv"].t(), out=yq)
                torch.mm(xh, L["o"].t(), out=yh)
                torch.mm(xh, L["gu"].t(), out=ygu)
                if fused_act:
                    swiglu_k(ygu)
                torch.mm(xi, L["down"].t(), out=yh)
            torch.mm(xh, lm.t(), out=ylm)

        def ours(fused_act):
            for L in layers:
                sg.skinny_gemm(xh, L["qkv"], out=yq)
                sg.skinny_gemm(xh, L["o"], out=yh)
                if fused_act:
                    sg.skinny_gemm_swiglu(xh, L["gu"], out=yi)
                else:
                    sg.skinny_gemm(xh, L["gu"], out=ygu)
                sg.skinny_gemm(xi, L["down"], out=yh)
            sg.skinny_gemm(xh, lm, out=ylm)

        variants = [("cuBLAS", lambda: cublas(False)), ("ours", lambda: ours(False)),
                    ("cuBLAS + swiglu kernel", lambda: cublas(True)), ("ours fused SwiGLU", lambda: ours(True))]
        base = None
        for vname, fn in variants:
            try:
                t_ms = graph_us([fn], min_calls=1, replays=15) * 1e-3
            except Exception as e:  # noqa: BLE001
                RESULT["errors"].append(f"decoder {vname} M={m}: {e}")
                log(f"  {vname} M={m}: ERROR {e}")
                traceback.print_exc()
                continue
            if vname == "cuBLAS":
                base = t_ms
            gbps = wbytes / t_ms / 1e6
            row = (f"{vname:24s} {m:3d} {t_ms:8.3f} {gbps:7.0f} {100 * gbps / peak:6.1f} "
                   f"{(base / t_ms if base else float('nan')):9.2f}")
            table.append(row)
            log(row)
            RESULT["decoder"].append(dict(variant=vname, M=m, ms=t_ms, GBps=gbps, pct_peak=100 * gbps / peak,
                                          weight_bytes=wbytes))
            dump()
    del layers, lm
    torch.cuda.empty_cache()
    return table


# ------------------------------------------------------------------------------------------------ AOT check (no GPU)

def aot_compile(m: int, n_w: int, k: int, cfg: SkinnyConfig, swiglu: bool, arch: int = 90) -> dict:
    """Compile one launch of _skinny_kernel for sm_<arch> without a GPU (Triton's bundled ptxas) and read the
    resource usage and SASS: registers, stack (spills), shared memory, 128-bit loads, cp.async, MMA, local mem."""
    import re

    from scripts.bench.aot import compile_for, usage

    from glmasr_kernels._triton_utils import cdiv, next_pow2
    fn = sg._skinny_kernel
    n = n_w // 2 if swiglu else n_w
    bm = sg.m_bucket(m)
    bk = max(16, min(cfg.block_k, next_pow2(k)))
    bn = max(16 if cfg.use_dot else 1, min(cfg.block_n, next_pow2(n)))
    bm = max(16, bm) if cfg.use_dot else bm
    kt = cdiv(k, bk)
    iters = cdiv(kt, cfg.split_k)
    split = cdiv(kt, iters)
    names = [p.name for p in fn.params]
    types = dict(X="*bf16", W="*bf16", Y="*bf16", WS="*fp32" if split > 1 else "*bf16",
                 M="i32", N="i32", K="i32", sx="i32", sw="i32", sy="i32", HALF="i32")
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, ITERS=iters, EVEN_N=n % bn == 0,
                 EVEN_K=k % bk == 0 and kt % iters == 0, USE_DOT=cfg.use_dot, SWIGLU=swiglu, UPCAST=False,
                 NUM_STAGES=cfg.num_stages, STATIC=False, DOT_PREC="tf32", PDL=True,
                 PRELOAD=min(1 if cfg.use_dot else sg.PRELOAD_TILES, iters))
    if m == 1:
        const["M"] = 1
    sig = {nm: ("constexpr" if nm in const else types[nm]) for nm in names}
    div = ["X", "W", "Y", "WS"] + [nm for nm, v in dict(K=k, sx=k, sw=k, sy=n, N=n).items() if v % 16 == 0]
    ck, res, sass = compile_for(fn, sig, const, div, arch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                launch_pdl=True)
    return dict(**usage(res),
                smem=ck.metadata.shared, ldg=len(re.findall(r"\bLDG", sass)),
                ldg128=len(re.findall(r"\bLDG[.A-Z]*\.128", sass)), ldgsts=len(re.findall(r"LDGSTS", sass)),
                mma=len(re.findall(r"HMMA|HGMMA", sass)), local=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                griddep=len(re.findall(r"ACQBULK|griddepcontrol|PREEXIT", sass)),
                # weight loads issued before the PDL wait (ACQBULK): the first W tile must be among them
                ldg_before_wait=_loads_before_wait(sass))


def _loads_before_wait(sass: str) -> int:
    """LDG instructions ahead of the first griddepcontrol wait (SASS ACQBULK) in the kernel's SASS."""
    import re

    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    wait = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), None)
    return -1 if wait is None else sum(1 for ln in lines[:wait] if re.search(r"\bLDG", ln))


def aot_check(all_candidates: bool) -> int:
    todo = [(nm, m, nw, k, sg.kernel_config(m, nw, k, sw), sw) for nm, (nw, k, sw) in SHAPES.items() for m in BENCH_M]
    if all_candidates:
        todo += [(nm, mb, nw, k, c, sw) for nm in ("qkv", "gate_up_swiglu") for mb in BENCH_M
                 for c in candidates(mb) for (nw, k, sw) in [SHAPES[nm]]]
    bad = 0
    for nm, m, nw, k, c, sw in todo:
        try:
            r = aot_compile(m, nw, k, c, sw)
            print(f"{nm:15s} M={m:2d} {c.short():30s} " + " ".join(f"{a}={v}" for a, v in r.items()), flush=True)
            bad += r["stack"] > 0 or r["local"] > 0
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"{nm:15s} M={m:2d} {c.short():30s} FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"aot check: {len(todo)} kernels, {bad} failed or spilling")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="autotune the config table first (parallel compile)")
    ap.add_argument("--sweep-m", default="1,2,4,8,16")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole sweep")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--quick", action="store_true", help="M in {1, 16} only, fewer shapes")
    ap.add_argument("--no-decoder", action="store_true")
    ap.add_argument("--int8", action="store_true",
                    help="per shape also the int8-weight kernel (decode_weights='int8'; not the lm head, which stays "
                         "bf16), % of copy peak over the int8 bytes")
    ap.add_argument("--aot-check", choices=["defaults", "all"], default=None,
                    help="no GPU needed: compile for sm_90 and report regs/spills/smem/128-bit loads, then exit")
    args = ap.parse_args()
    global INT8
    INT8 = args.int8
    if args.aot_check:
        return aot_check(args.aot_check == "all")
    if not torch.cuda.is_available():
        print("bench_skinny_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    RESULT["env"] = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                         sms=torch.cuda.get_device_properties(0).multi_processor_count)
    log(RESULT["env"])
    peak = copy_peak_gbps()
    RESULT["copy_peak_GBps"] = peak
    log(f"copy peak {peak:.0f} GB/s (1 GiB bf16 device-to-device, read + write)")
    dump()
    names = list(SHAPES)
    ms = [1, 16] if args.quick else BENCH_M
    if args.sweep:
        sweep([int(v) for v in args.sweep_m.split(",")], args.budget, args.workers, names)
    t_shapes = bench_shapes(ms, names, peak)
    t_dec = [] if args.no_decoder else bench_decoder([1, 4, 16], peak)
    RESULT["wall_s"] = time.time() - T0
    dump()
    print(f"\ncopy peak {peak:.0f} GB/s; errors: {len(RESULT['errors'])}")
    print("\n".join(t_shapes))
    print()
    print("\n".join(t_dec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
