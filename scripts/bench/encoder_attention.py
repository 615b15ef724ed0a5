"""Benchmark the encoder attention kernel (kernels/encoder_attention.py) against today's path on one GPU.

Shape: the audio encoder's self-attention, W windows x T = 1500 positions x H = 20 heads x D = 64, bf16, RoPE on
the first 32 dims, no mask; qkv is the fused projection output (W, T, 3*H*D) viewed as (W, T, 3, H, D).
For each W in --windows (default 1,32), per-call microseconds (``graph_timing.graph_call_us``: calls captured in
one CUDA graph, median over replays) of:

  rope_+sdpa-cudnn+copy   today's path (glmasr/models/fast.py): rope_ in place, SDPA with the cuDNN backend
                          on transposed views, then the transpose(1, 2).reshape copy o_proj reads
  rope_+sdpa-flash+copy   the same with SDPA's flash backend
  rope_ alone             the RoPE launch by itself (to read kernel-only times off the rope_ + ours rows)
  fused-rope[cfg]         ours with the RoPE fused (one launch, output already in o_proj's layout), per candidate
  rope_+ours[cfg]         rope_ then ours without RoPE (rope_in_kernel=False), per candidate
  rope_+fa2 / rope_+fa3   flash_attn / flash_attn_interface when importable ((W, T, H, D) in and out, no copy)

rope_ rotates qkv in place, so repeated calls keep rotating the same buffer (harmless for timing: a rotation
keeps the values' scale). TFLOP/s counts 4*T*T*D*H*W flops (QK^T and PV) for every row, RoPE and copy included
in the time. Before timing, every candidate config is compiled (all at once, on a thread pool) and checked
against the fp32 reference at W = 2; configs that fail to compile or are wrong are dropped and recorded with
the reason. Rows left when --budget-s runs out are recorded as skipped. Prints a markdown table and writes
DIR/encoder_attention.json.

Usage: PYTHONUNBUFFERED=1 python scripts/bench/encoder_attention.py --out DIR [--windows 1,32] [--budget-s 90]
       python scripts/bench/encoder_attention.py --dry-run      (no GPU needed: lists what it would time)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing.py, next to this file
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout root

T, H, D, R = 1500, 20, 64, 32
CHECK_W = 2
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def flops(w: int) -> float:
    return 4.0 * T * T * D * H * w


def optional_packages() -> dict:
    found = {}
    for name in ("flash_attn", "flash_attn_interface"):
        try:
            mod = __import__(name)
            found[name] = dict(importable=True, version=getattr(mod, "__version__", None))
        except Exception as e:  # noqa: BLE001  (ImportError, or a broken build raising anything)
            found[name] = dict(importable=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    return found


def plan(windows, candidates, packages) -> list[tuple[int, str, object]]:
    """(W, variant name, config or None) in timing order: baselines first, then the candidates."""
    from glmasr_kernels.encoder_attention import CONFIGS

    rows = []
    for w in windows:
        rows += [(w, "rope_+sdpa-cudnn+copy", None), (w, "rope_+sdpa-flash+copy", None), (w, "rope_ alone", None)]
        if packages.get("flash_attn", {}).get("importable"):
            rows.append((w, "rope_+fa2", None))
        if packages.get("flash_attn_interface", {}).get("importable"):
            rows.append((w, "rope_+fa3", None))
    # the default configs first, then the rest; every W of a config together (a budget cut drops whole configs)
    defaults = list(dict.fromkeys(c for c in CONFIGS.values() if c in candidates))
    for c in defaults + [c for c in candidates if c not in defaults]:
        for kind in ("fused-rope", "rope_+ours"):
            rows += [(w, f"{kind}[{c.short()}]", c) for w in windows]
    return rows


def make_call(variant: str, cfg, qkv, cos, sin, out, pos):
    """A closure doing one call of ``variant`` on the given buffers."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from glmasr_kernels.encoder_attention import encoder_attention
    from glmasr_kernels.rope import rope_

    w = qkv.shape[0]
    q, k, v = qkv.unbind(2)
    out2 = out.view(w, T, H * D)
    if variant.startswith("rope_+sdpa-"):
        backend = SDPBackend.CUDNN_ATTENTION if "cudnn" in variant else SDPBackend.FLASH_ATTENTION

        def call():
            rope_(q, k, pos, cos, sin)
            with sdpa_kernel([backend]):
                a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   scale=D ** -0.5)
            out2.copy_(a.transpose(1, 2).reshape(w, T, H * D))
        return call
    if variant == "rope_ alone":
        return lambda: rope_(q, k, pos, cos, sin)
    if variant in ("rope_+fa2", "rope_+fa3"):
        fn = __import__("flash_attn" if variant == "rope_+fa2" else "flash_attn_interface").flash_attn_func

        def call():
            rope_(q, k, pos, cos, sin)
            r = fn(q, k, v, softmax_scale=D ** -0.5)
            r = r[0] if isinstance(r, tuple) else r  # some FA3 builds return (out, lse)
            out.copy_(r)  # flash_attn allocates its output; the copy is contiguous-to-contiguous
        return call
    if variant.startswith("fused-rope"):
        return lambda: encoder_attention(qkv, cos, sin, out=out, config=cfg)
    if variant.startswith("rope_+ours"):
        return lambda: encoder_attention(qkv, cos, sin, out=out, config=cfg, rope_in_kernel=False)
    raise ValueError(variant)


def check_candidates(candidates, result, deadline: float) -> list:
    """Compile every candidate (both modes, in parallel), then check each against the fp32 reference at
    W = CHECK_W; returns the configs that pass and records the others in result['dropped']."""
    import torch

    from glmasr_kernels._triton_utils import compile_ahead
    from glmasr_kernels.encoder_attention import encoder_attention, encoder_attention_ref
    from glmasr_kernels.rope import build_rope_cache

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn(CHECK_W, T, 3 * H * D, generator=g).to(dev, torch.bfloat16).view(CHECK_W, T, 3, H, D)
    cos, sin = build_rope_cache(R, T, 10000.0, dev)
    ref = encoder_attention_ref(qkv, cos, sin)
    compile_errors = {}
    try:
        with compile_ahead():
            for c in candidates:
                for rik in (True, False):
                    try:
                        encoder_attention(qkv.clone(), cos, sin, config=c, rope_in_kernel=rik)
                    except Exception as e:  # noqa: BLE001
                        compile_errors[(c, rik)] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"compiled {2 * len(candidates)} kernels ({len(compile_errors)} failed to compile)")
    except Exception as e:  # noqa: BLE001  (an async compile error surfaces when the context exits)
        result["errors"].append(dict(stage="parallel compile", error=f"{type(e).__name__}: {str(e)[:500]}"))
        log(f"parallel compile raised {type(e).__name__}; the check below compiles what is left one by one")
        compile_errors = {}
    good = []
    for c in candidates:
        if time.time() > deadline:
            result["dropped"].append(dict(config=c.short(), reason="budget spent before its check"))
            continue
        why = None
        for rik in (True, False):
            if (c, rik) in compile_errors:
                why = f"compile (rope_in_kernel={rik}): {compile_errors[(c, rik)]}"
                break
            try:
                out = torch.full((CHECK_W, T, H, D), float("nan"), device=dev, dtype=torch.bfloat16)
                encoder_attention(qkv.clone(), cos, sin, out=out, config=c, rope_in_kernel=rik)
                torch.cuda.synchronize()
                if not torch.isfinite(out).all():
                    why = f"non-finite output (rope_in_kernel={rik})"
                    break
                err = (out.float() - ref.float()).abs()
                bad = err > 1e-2 + 2e-2 * ref.float().abs()
                if bad.any():
                    why = f"wrong (rope_in_kernel={rik}): max abs err {err.max().item():.3g}, {bad.sum().item()} bad"
                    break
            except Exception as e:  # noqa: BLE001
                why = f"launch (rope_in_kernel={rik}): {type(e).__name__}: {str(e)[:300]}"
                break
        if why is None:
            good.append(c)
        else:
            result["dropped"].append(dict(config=c.short(), reason=why))
            log(f"dropped {c.short()}: {why}")
    del qkv, ref
    torch.cuda.empty_cache()
    return good


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for encoder_attention.json")
    ap.add_argument("--windows", default="1,32", help="comma-separated window counts W")
    ap.add_argument("--budget-s", type=float, default=90.0, help="wall-clock budget for the whole run")
    ap.add_argument("--dry-run", action="store_true", help="list what would be timed and exit (no GPU needed)")
    args = ap.parse_args(argv)
    windows = [int(x) for x in args.windows.split(",") if x.strip()]
    if not windows or min(windows) < 1:
        ap.error("--windows must list positive window counts")

    from glmasr_kernels.encoder_attention import CANDIDATES

    packages = optional_packages()
    result = dict(shape=dict(T=T, H=H, D=D, rotary_dim=R, dtype="bfloat16"), windows=windows,
                  budget_s=args.budget_s, packages=packages, rows=[], dropped=[], skipped=[], errors=[])
    if args.dry_run:
        print(f"dry run: T={T} H={H} D={D} R={R} bf16, windows {windows}, budget {args.budget_s:.0f} s")
        print("optional packages: " + ", ".join(f"{k}={'yes' if v['importable'] else 'no'}"
                                               for k, v in packages.items()))
        for w, name, _ in plan(windows, CANDIDATES, packages):
            print(f"  W={w:3d}  {name}")
        return 0

    import torch
    import triton

    from graph_timing import graph_call_us
    from glmasr_kernels.rope import build_rope_cache

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "encoder_attention.json")

    def dump():
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run to list the plan)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    result.update(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                  cudnn=torch.backends.cudnn.version())
    log(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}; packages {packages}")
    deadline = T0 + args.budget_s
    try:
        good = check_candidates(CANDIDATES, result, T0 + 0.6 * args.budget_s)
    except Exception as e:  # noqa: BLE001
        result["errors"].append(dict(stage="check", error=traceback.format_exc()[-2000:]))
        log(f"candidate check failed: {e}")
        good = []
    dump()

    cos, sin = build_rope_cache(R, T, 10000.0, dev)
    todo = plan(windows, good, packages)
    bufs = {}
    for i, (w, name, cfg) in enumerate(todo):
        left = deadline - time.time()
        if left < 3.0 + 0.05 * w:  # a W=32 timing takes ~1-2 s with its capture
            result["skipped"].extend(dict(W=ww, variant=nn, reason="budget") for ww, nn, _ in todo[i:])
            log(f"budget spent: skipping {len(todo) - i} rows")
            break
        if w not in bufs:
            bufs.clear()
            torch.cuda.empty_cache()
            g = torch.Generator(device="cpu").manual_seed(w)
            qkv = torch.randn(w, T, 3 * H * D, generator=g).to(dev, torch.bfloat16).view(w, T, 3, H, D)
            out = torch.empty(w, T, H, D, device=dev, dtype=torch.bfloat16)
            pos = torch.arange(T, device=dev).expand(w, T)
            bufs[w] = (qkv, out, pos)
        qkv, out, pos = bufs[w]
        repeats = max(3, int(8000 / (40.0 * w)))  # ~8 ms of work per replay (today's path: ~35 us per window)
        try:
            us = graph_call_us([make_call(name, cfg, qkv, cos, sin, out, pos)], repeats=repeats)
            row = dict(W=w, variant=name, config=cfg.short() if cfg else None, us=round(us, 2),
                       tflops=round(flops(w) / (us * 1e-6) / 1e12, 1))
            result["rows"].append(row)
            log(f"W={w:3d} {name:40s} {us:9.2f} us  {row['tflops']:6.1f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            result["errors"].append(dict(W=w, variant=name, error=f"{type(e).__name__}: {str(e)[:500]}"))
            log(f"W={w} {name}: {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()
        dump()

    print()
    print("| variant | W | us per call | TFLOP/s |")
    print("|---|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['variant']} | {r['W']} | {r['us']:.1f} | {r['tflops']:.1f} |")
    for w in windows:
        rows = [r for r in result["rows"] if r["W"] == w]
        base = next((r for r in rows if r["variant"] == "rope_+sdpa-cudnn+copy"), None)
        for kind in ("fused-rope", "rope_+ours"):
            mine = [r for r in rows if r["variant"].startswith(kind)]
            if mine:
                best = min(mine, key=lambda r: r["us"])
                vs = f", {base['us'] / best['us']:.2f}x today's path" if base else ""
                result.setdefault("best", {}).setdefault(str(w), {})[kind] = best
                print(f"W={w}: best {kind}: {best['variant']} {best['us']:.1f} us ({best['tflops']:.1f} TFLOP/s{vs})")
    if result["dropped"]:
        print("dropped configs: " + "; ".join(f"{d['config']}: {d['reason'][:120]}" for d in result["dropped"]))
    print("optional packages: " + ", ".join(f"{k}={'yes' if v['importable'] else 'no'}" for k, v in packages.items()))
    result["wall_s"] = round(time.time() - T0, 1)
    dump()
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
