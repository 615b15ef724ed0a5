"""The batch-1 decode step under its alternatives, in one process (issue 27, item 2): ms per token at each context
for the decode GEMVs on Triton (``fast_decoder.CUDA_GEMV_SHAPES`` emptied) or on the CUDA GEMV (the table as
shipped), and decode attention's fewest positions per split program (``decode_attention.MIN_CHUNK``), each
variant on a fresh runner whose graphs are captured under it; then the 3.5 s clip end to end (13 tokens) for the
first and last variant.

    python -m scripts.bench.decode_variants [--model FOLDER] [--contexts 64,512,2048,8184] [--json FILE]
        [--min-chunks 256,128,64] [--int8]

``--int8``: one more row, the shipped tables with the int8 decode weights (``load(decode_weights="int8")``, a
second model in the same process).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--contexts", default="64,512,2048,8184")
    p.add_argument("--min-chunks", default="256,128,64")
    p.add_argument("--json", default=None)
    p.add_argument("--int8", action="store_true", help="also the int8 decode weights with the shipped tables")
    args = p.parse_args(argv)

    import torch

    import glmasr
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint
    from glmasr.models import fast_decoder
    from glmasr_kernels import decode_attention
    from scripts.benchmark import decode_round, decode_runner, fill_decode_state, sync_time
    from scripts.bench.workloads import noise_clip

    folder = args.model or ensure_full_size_checkpoint()
    asr = glmasr.load(folder, device="cuda")
    model, cfg = asr.model, asr.config.text
    shipped_table, shipped_chunk = fast_decoder.CUDA_GEMV_SHAPES, decode_attention.MIN_CHUNK
    contexts = [int(c) for c in args.contexts.split(",")]
    variants = [("triton GEMVs", frozenset(), shipped_chunk)]
    variants += [(f"cuda GEMVs, min chunk {c}", shipped_table, int(c)) for c in args.min_chunks.split(",")]
    rows = []
    steps = 8
    int8_model = glmasr.load(folder, device="cuda", decode_weights="int8").model if args.int8 else None
    runs = [(name, table, chunk, model) for name, table, chunk in variants]
    if int8_model is not None:
        runs.append(("cuda GEMVs, int8 weights (shipped)", shipped_table, shipped_chunk, int8_model))
    for name, table, chunk, net in runs:
        fast_decoder.CUDA_GEMV_SHAPES, decode_attention.MIN_CHUNK = table, chunk
        runner = decode_runner(net, cfg.max_position_embeddings)
        row = {"variant": name, "cuda_gemv_shapes": len(table), "min_chunk": chunk, "ms_per_token": {}}
        for ctx in contexts:
            ctx = min(ctx, runner.capacity - steps)
            fill_decode_state(runner, cfg, ctx)
            row["ms_per_token"][ctx] = round(sync_time(decode_round(runner, 1, ctx, steps), 2, 10) / steps, 4)
        del runner
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    clip = noise_clip(3.5, seed=0)
    latency = {}
    for name, table, chunk in (variants[0], variants[-1]):
        fast_decoder.CUDA_GEMV_SHAPES, decode_attention.MIN_CHUNK = table, chunk
        asr.engine.runner.drop_graphs()
        for _ in range(3):  # captures, then steady state
            glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t))
        latency[name] = round(sorted(walls)[len(walls) // 2], 2)
        print(f"3.5 s clip, 13 tokens, {name}: {latency[name]} ms (median of 10)", flush=True)
    fast_decoder.CUDA_GEMV_SHAPES, decode_attention.MIN_CHUNK = shipped_table, shipped_chunk
    asr.close()

    print("\n| variant | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for r in rows:
        print(f"| {r['variant']} | " + " | ".join(f"{v:.3f}" for v in r["ms_per_token"].values()) + " |")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "clip_3_5s_13_tokens_ms": latency}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
