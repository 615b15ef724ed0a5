"""The batch-1 decode step under its alternatives, in one process (issue 27, item 2): ms per token at each context
for the decode GEMVs on Triton (``fast_decoder.CUDA_GEMV_SHAPES`` emptied) or on the CUDA GEMV, RoPE + KV append
in its own kernel or in the qkv CUDA GEMV (``fast_decoder.QKV_ROPE_WEIGHTS``), and decode attention's split
partials combined by a second kernel or in-kernel (the decoder's ``attn_counters`` set to None or not).
``--probe``: two more rows, timing probes with wrong results (graphs only, no clip): the shipped step with its
RMSNorm launches skipped, and with its decode attention launches skipped (what each family costs at most).
``--attention``: the forms of decode attention and of the settled inputs: positions and lengths read after the
PDL waits (``fast_decoder.SETTLED_INPUTS_EARLY`` off), that and the loop for every split
(``decode_attention.ONE_TILE_PATH`` off: the step before both), and the shipped form with every attention
program at 2 warps (the loop's too; one-tile programs have ``ONE_TILE_WARPS``).
``--kv-buckets``: the shipped step with the decode graphs' smallest KV bucket at 64 and at 128 positions instead of
``model_runner.MIN_KV_BUCKET`` (fewer, or no, empty attention splits at short contexts; more graphs to capture). Each
variant has its own runner, whose graphs are captured under that variant's settings; the variants are timed in
interleaved rounds (``--rounds``, each a median of 10 calls of 8 steps) and each figure is the median over the
rounds, so slow drifts of the clock hit every variant alike. Then the 3.5 s clip end to end (13 tokens) per
variant.

    python -m scripts.bench.decode_variants [--model FOLDER] [--contexts 64,512,2048,8184] [--rounds 3]
        [--json FILE] [--int8] [--triton] [--probe] [--attention] [--kv-buckets]

``--int8``: the int8 decode weights too (``load(decode_weights="int8")``, a second model in the same process);
``--triton``: one more row, the Triton GEMVs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--contexts", default="64,512,2048,8184")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--int8", action="store_true", help="also the int8 decode weights")
    p.add_argument("--triton", action="store_true", help="also the Triton GEMVs")
    p.add_argument("--probe", action="store_true",
                   help="also the step without its RMSNorm / decode attention launches (timing only)")
    p.add_argument("--attention", action="store_true",
                   help="also the step without the one-tile attention path / the settled inputs, and at 2 warps")
    p.add_argument("--kv-buckets", action="store_true", help="also the smallest KV bucket at 64 and at 128")
    args = p.parse_args(argv)

    import torch

    import functools

    import glmasr
    from glmasr_kernels import decode_attention as attention_kernels
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint
    from glmasr.engine import model_runner
    from glmasr.models import fast_decoder
    from scripts.benchmark import decode_round, decode_runner, fill_decode_state, sync_time
    from scripts.bench.workloads import noise_clip

    folder = args.model or ensure_full_size_checkpoint()
    asr = glmasr.load(folder, device="cuda")
    cfg = asr.config.text
    shipped = fast_decoder.CUDA_GEMV_SHAPES, fast_decoder.QKV_ROPE_WEIGHTS
    table = shipped[0]
    real = {"rms_norm": fast_decoder.rms_norm, "decode_attention": fast_decoder.decode_attention}
    contexts = [int(c) for c in args.contexts.split(",")]
    int8_asr = glmasr.load(folder, device="cuda", decode_weights="int8") if args.int8 else None
    counters = {id(asr): asr.model.decoder.attn_counters}
    every, none = frozenset({"bf16", "int8"}), frozenset()
    # (name, CUDA GEMV table, QKV_ROPE_WEIGHTS, in-kernel combine, handle)
    runs = [("triton GEMVs, separate rope, separate combine", none, none, False, asr)] if args.triton else []
    runs += [("cuda GEMVs, separate rope, separate combine", table, none, False, asr),
             ("cuda GEMVs, rope in qkv, separate combine", table, every, False, asr),
             ("cuda GEMVs, rope in qkv, in-kernel combine", table, every, True, asr)]

    def skip_norm(x, weight, eps=1e-5, residual=None):
        return x if residual is None else (x, residual)

    def skip_attention(q, *args, **kwargs):
        return q

    # fast_decoder functions replaced while a run's graphs are captured (and only then); probes give wrong results
    overrides, probes, loop_attention, late_inputs, min_kv = {}, set(), set(), set(), {}
    shipped_min_kv = model_runner.MIN_KV_BUCKET
    if args.probe:
        for attr, fn in (("rms_norm", skip_norm), ("decode_attention", skip_attention)):
            name = f"PROBE no {attr}: cuda GEMVs, rope in qkv, in-kernel combine (wrong results)"
            overrides[name] = {attr: fn}
            probes.add(name)
            runs.append((name, table, every, True, asr))
    if args.attention:
        name = "cuda GEMVs, rope in qkv, in-kernel combine, inputs after the waits"
        late_inputs.add(name)
        runs.append((name, table, every, True, asr))
        name = "cuda GEMVs, rope in qkv, in-kernel combine, inputs after the waits, attention loop for every split"
        late_inputs.add(name)
        loop_attention.add(name)
        runs.append((name, table, every, True, asr))
        name = "cuda GEMVs, rope in qkv, in-kernel combine, every attention program at 2 warps"
        overrides[name] = {"decode_attention": functools.partial(real["decode_attention"], num_warps=2)}
        runs.append((name, table, every, True, asr))
    if args.kv_buckets:
        for smallest in (64, 128):
            name = f"cuda GEMVs, rope in qkv, in-kernel combine, KV buckets from {smallest}"
            min_kv[name] = smallest
            runs.append((name, table, every, True, asr))
    if int8_asr is not None:
        counters[id(int8_asr)] = int8_asr.model.decoder.attn_counters
        runs += [("int8, separate rope, separate combine", table, none, False, int8_asr),
                 ("int8, separate rope, in-kernel combine", table, none, True, int8_asr),
                 ("int8, rope in qkv, in-kernel combine", table, every, True, int8_asr)]

    def use(table, rope, combine, handle, name=""):
        for attr, fn in real.items():
            setattr(fast_decoder, attr, overrides.get(name, {}).get(attr, fn))
        attention_kernels.ONE_TILE_PATH = name not in loop_attention
        fast_decoder.SETTLED_INPUTS_EARLY = name not in late_inputs
        model_runner.MIN_KV_BUCKET = min_kv.get(name, shipped_min_kv)
        fast_decoder.CUDA_GEMV_SHAPES, fast_decoder.QKV_ROPE_WEIGHTS = table, rope
        handle.model.decoder.attn_counters = counters[id(handle)] if combine else None

    steps = 8
    runners = [decode_runner(h.model, cfg.max_position_embeddings) for *_, h in runs]
    samples = [{c: [] for c in contexts} for _ in runs]
    for rnd in range(args.rounds):
        for (name, table_, rope, combine, handle), runner, sample in zip(runs, runners, samples):
            use(table_, rope, combine, handle, name)  # graphs are captured on first use, under these settings
            for ctx in contexts:
                ctx_ = min(ctx, runner.capacity - steps)
                fill_decode_state(runner, cfg, ctx_)
                sample[ctx].append(sync_time(decode_round(runner, 1, ctx_, steps), 2, 10) / steps)
        print(f"round {rnd + 1} of {args.rounds} done", flush=True)
    rows = []
    for (name, table_, rope, combine, _), sample in zip(runs, samples):
        row = {"variant": name, "cuda_gemv_shapes": len(table_), "qkv_rope_weights": sorted(rope),
               "in_kernel_combine": combine, "ms_per_token": {c: round(statistics.median(v), 4)
                                                               for c, v in sample.items()},
               "rounds_ms_per_token": {c: [round(x, 4) for x in v] for c, v in sample.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del runners
    torch.cuda.empty_cache()

    clip = noise_clip(3.5, seed=0)
    latency = {}
    for name, table_, rope, combine, handle in runs:
        if name in probes:
            continue
        use(table_, rope, combine, handle, name)
        handle.engine.runner.drop_graphs()
        for _ in range(3):  # captures, then steady state
            glmasr.transcribe(clip, model=handle, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            glmasr.transcribe(clip, model=handle, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t))
        latency[name] = round(sorted(walls)[len(walls) // 2], 2)
        print(f"3.5 s clip, 13 tokens, {name}: {latency[name]} ms (median of 10)", flush=True)
    fast_decoder.CUDA_GEMV_SHAPES, fast_decoder.QKV_ROPE_WEIGHTS = shipped
    attention_kernels.ONE_TILE_PATH = True
    fast_decoder.SETTLED_INPUTS_EARLY = True
    model_runner.MIN_KV_BUCKET = shipped_min_kv
    for attr, fn in real.items():
        setattr(fast_decoder, attr, fn)
    for handle in {id(h): h for *_, h in runs}.values():
        handle.model.decoder.attn_counters = counters[id(handle)]
        handle.close()

    print("\n| variant | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for r in rows:
        print(f"| {r['variant']} | " + " | ".join(f"{v:.3f}" for v in r["ms_per_token"].values()) + " |")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "rows": rows, "clip_3_5s_13_tokens_ms": latency}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
