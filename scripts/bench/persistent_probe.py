"""The persistent decode launch (kernels/persistent_decode.py) alone, graph-timed per variant: configs, barrier
implementations, no barrier at all (a timing probe of the design's floor: its result is wrong), and the staged
launch (one launch per layer and stage). ``time_variants`` is what ``benchmark.sh --only breakdown`` reports
for the loaded model; run as a script it builds the full-size decoder's stacked weights at random (bf16, on the
GPU; timing does not depend on weight values) and writes JSON.

    python scripts/bench/persistent_probe.py [--ctx 64] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from glmasr_kernels import persistent_decode as pd  # noqa: E402
from graph_timing import graph_call_us  # noqa: E402
from glmasr_kernels.rope import build_rope_cache  # noqa: E402

# (label, config, persistent launch?)
VARIANTS = [
    ("default", pd.PersistentConfig(), True),
    ("16 warps", pd.PersistentConfig(num_warps=16), True),
    ("relaxed polls + one acquire fence", pd.PersistentConfig(barrier=3), True),
    ("Triton-atomics barrier", pd.PersistentConfig(barrier=1), True),
    ("16 warps, Triton-atomics barrier", pd.PersistentConfig(num_warps=16, barrier=1), True),
    ("4-row blocks", pd.PersistentConfig(bn_qkv=4, bn_o=4, bn_gate_up=4, bn_down=4), True),
    ("16-row blocks, 16 warps", pd.PersistentConfig(bn_qkv=16, bn_o=16, bn_gate_up=8, bn_down=16, num_warps=16), True),
    ("no barriers (wrong result: the design's floor)", pd.PersistentConfig(barrier=0), True),
    ("staged: one launch per layer and stage", pd.PersistentConfig(), False),
    # two programs per SM (their block barriers decoupled), 4-row blocks to keep the work balanced
    ("2 per SM, 4-row blocks, 128 registers", pd.PersistentConfig(4, 4, 4, 4, programs_per_sm=2, maxnreg=128), True),
    ("2 per SM, 2-row blocks, 128 registers", pd.PersistentConfig(2, 2, 2, 2, programs_per_sm=2, maxnreg=128), True),
    ("2 per SM, no barriers (wrong result)", pd.PersistentConfig(4, 4, 4, 4, programs_per_sm=2, maxnreg=128,
                                                                 barrier=0), True),
]


def time_variants(stack: pd.PersistentWeights, cos, sin, n_heads: int, n_kv: int, head_dim: int, eps: float,
                  ctx: int = 64, variants=VARIANTS, log=print) -> dict:
    """ms per launch of each variant (10 launches per graph replay, graph_timing.graph_call_us) at context
    ``ctx``, with whether its
    output equals the default's bit for bit and whether the error flag rose."""
    dev, dt = stack.wqkv.device, stack.wqkv.dtype
    n_layers, hidden = stack.wqkv.shape[0], stack.wqkv.shape[2]
    kc = torch.randn(n_layers, 1, n_kv, 1024, head_dim, device=dev).to(dt)
    vc = torch.randn_like(kc)
    lengths = torch.tensor([ctx], device=dev)
    start = torch.randn(1, hidden, device=dev).to(dt)
    out, reference = {}, None
    for label, cfg, persistent in variants:
        try:
            ws = pd.PersistentWorkspace(stack.wqkv.shape[1], n_heads, head_dim, stack.wdown.shape[2], dev, dt)
            res = start.clone()

            def launch():
                pd.persistent_decode(res, stack, kc, vc, cos, sin, lengths, ws, max_len=ctx, eps=eps, config=cfg,
                                     persistent=persistent)

            res.copy_(start)
            launch()
            torch.cuda.synchronize()
            same = reference is None or bool(torch.equal(res, reference))
            if reference is None:
                reference = res.clone()
            ms = graph_call_us([launch], repeats=10) / 1e3
            out[label] = {"config": cfg.short(), "persistent": persistent, "ms": ms, "bit_equal_to_default": same,
                          "error_flag": ws.error()}
        except Exception as e:  # noqa: BLE001  (one variant failing must not hide the others)
            out[label] = {"config": cfg.short(), "error": repr(e)[:400]}
        log(label, out[label])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("persistent_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    # the GLM-ASR-Nano decoder: 28 layers, hidden 2048, 16 + 2 x 4 heads of 128, intermediate 6144
    n_layers, hidden, nq, nk, d, inter = 28, 2048, 16, 4, 128, 6144
    dev, dt = "cuda", torch.bfloat16

    def rnd(*shape, scale):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    stack = pd.PersistentWeights(rnd(n_layers, (nq + 2 * nk) * d, hidden, scale=hidden ** -0.5),
                                 rnd(n_layers, hidden, nq * d, scale=(nq * d) ** -0.5),
                                 rnd(n_layers, 2 * inter, hidden, scale=hidden ** -0.5),
                                 rnd(n_layers, hidden, inter, scale=inter ** -0.5),
                                 1 + rnd(n_layers, hidden, scale=0.1), 1 + rnd(n_layers, hidden, scale=0.1))
    cos, sin = build_rope_cache(d, 8192, 500000.0, device=dev)
    report = {"ctx": args.ctx, "gpu": torch.cuda.get_device_name(),
              "variants": time_variants(stack, cos, sin, nq, nk, d, 1e-5, args.ctx)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
