"""Latency and throughput of our engine against transformers, in one process, on one GPU (the H200).

    bash benchmark.sh [--only latency,decode,encoder,throughput,breakdown,invariant,coldstart,serve,longform,realtime]
                      [--quick] [--realtime-sessions 64,256,512] [--realtime-partial-sessions 32,128]
                      [--realtime-seconds 60] [--realtime-audio FILE...] [--realtime-server-flag=FLAG]
                      [--no-peers] [--no-compiled-peer] [--out DIR]
    (benchmark.sh runs ``python -m scripts.benchmark`` from the checkout root; the helpers are scripts/bench/*)

Every section runs ours and the peers on the same full-size GLM-ASR checkpoint with random bf16 weights
(built on the GPU once: timing does not depend on weight values; token counts are forced with ignore_eos /
min_new_tokens). Times are medians after warm-up; GPU work is synchronised before each clock read.
Prints a table per section and writes everything to OUT/benchmark.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import glmasr
from glmasr.engine import cuda_graphs
from glmasr.engine.model_runner import ModelRunner
from glmasr.options import EngineOptions
from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint
from scripts.bench.triton_hooks import triton_compiles
from scripts.bench.workloads import mixed_clips, noise_clip as clip

ROOT = Path(__file__).resolve().parent.parent

SECTIONS = ("latency", "decode", "encoder", "throughput", "breakdown", "invariant", "serve", "longform", "coldstart",
            "firstcall", "realtime")
# serve (the server under load, 20 s per concurrency level, scripts/bench/serve_load.py, ~3 min) and longform (an hour of mp3 to SRT,
# scripts/bench/longform.py, ~1-2 min) and firstcall (the mixed workload as a fresh process's first call, 3
# processes, ~1-2 min) and realtime (live sessions at N = --realtime-sessions, then with partials, ~1.5 min per N,
# scripts/bench/realtime_load.py) run when asked for (--only): with them the whole run passes one device call.
DEFAULT_SECTIONS = ("latency", "decode", "encoder", "throughput", "breakdown", "invariant", "coldstart")
# --smoke: every section at toy sizes on the tiny random checkpoint, on the CPU (Triton interpreter) or a GPU,
# so the script itself is tested without spending GPU time (tests/test_benchmark_script.py).
DEV = "cuda"
DTYPE = torch.bfloat16
SMOKE = False


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def sync_time(fn, warmup=2, runs=5):
    if SMOKE:  # the smoke run checks the plumbing: one untimed-quality call (the interpreter is slow)
        warmup, runs = 0, 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure_peaks():
    if DEV != "cuda":
        return {"copy_GBps": float("nan"), "read_GBps": float("nan"), "bf16_matmul_TFLOPs": float("nan")}
    buf = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copy_ms = sync_time(lambda: dst.copy_(buf), 3, 10)
    del buf, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = sync_time(lambda: a @ b, 3, 10)
    from scripts.bench.read_peak import read_GBps

    return {"copy_GBps": 2 * 2 * 1024 ** 3 / copy_ms / 1e6, "read_GBps": read_GBps(),
            "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}




class Peers:
    """transformers GlmAsrForConditionalGeneration: eager, and (``compiled``) static cache + torch.compile.

    The compiled peer is transformers' own path: ``generate(cache_implementation="static")`` on CUDA compiles the
    decode-step forward itself (``_valid_auto_compile_criteria``; prefill stays eager). Compiling the whole
    forward by hand fails on GLM-ASR (fullgraph: a data-dependent audio-token check; reduce-overhead without
    fullgraph: "accessing tensor output of CUDAGraphs that has been overwritten"; H200 run, transformers 5.17)."""

    def __init__(self, folder: Path, compiled: bool):
        from transformers import AutoProcessor, GlmAsrForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(folder))
        place = {"device_map": DEV} if DEV == "cuda" else {}  # device_map needs accelerate (on the H200 image)
        self.eager = GlmAsrForConditionalGeneration.from_pretrained(str(folder), dtype=DTYPE, **place).eval()
        self.compiled = compiled

    def run(self, model, audios, new_tokens, static=False):
        x = self.processor.apply_transcription_request(audios).to(DEV)
        x["input_features"] = x["input_features"].to(DTYPE)
        kwargs = {"cache_implementation": "static"} if static else {}
        with torch.inference_mode():
            out = model.generate(**x, do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                                 **kwargs)
        return self.processor.batch_decode(out[:, x["input_ids"].shape[1]:], skip_special_tokens=True)


def section_latency(asr, peers, quick):
    rows = []
    for seconds in ((3.5,) if quick or SMOKE else (1.0, 3.5, 10.0, 30.0)):
        audio = clip(seconds)
        for n in ((4,) if SMOKE else (13, 100)):
            row = {"seconds": seconds, "new_tokens": n}
            row["ours_ms"] = sync_time(lambda: glmasr.transcribe(audio, model=asr, sampling_rate=16000,
                                                                 max_new_tokens=n, ignore_eos=True, max_batch=1))
            if peers is not None:
                row["hf_eager_ms"] = sync_time(lambda: peers.run(peers.eager, [audio], n), 1, 3)
                # compiled: the 3.5 s clip only (each new static-cache length recompiles)
                if peers.compiled and seconds == 3.5:
                    try:
                        row["hf_compiled_ms"] = sync_time(lambda: peers.run(peers.eager, [audio], n, True), 3, 3)
                    except Exception as e:  # keep the other numbers of the row
                        row["hf_compiled_error"] = repr(e)[:300]
            rows.append(row)
            print(row, flush=True)
    return rows


def section_decode(asr, peaks, quick):
    """ms per token at batch 1 for each context, against the weight-streaming floors."""
    model = asr.model
    cfg = asr.config.text
    weight_bytes = model.decoder.weight_bytes()
    floor_ms = weight_bytes / (peaks["copy_GBps"] * 1e6)
    read_floor_ms = weight_bytes / (peaks["read_GBps"] * 1e6) if peaks.get("read_GBps") else None
    rows = []
    steps = 2 if SMOKE else 8  # decode steps per timed call (one read-back round)
    runner = decode_runner(model, 1024 if SMOKE else cfg.max_position_embeddings)
    for ctx in ((64,) if SMOKE else (64, 2048) if quick else (64, 512, 2048, 8192)):
        # the timed steps write positions ctx-1 .. ctx+6: keep them inside the cache (8192 -> 8184)
        ctx = min(ctx, runner.capacity - steps)
        fill_decode_state(runner, cfg, ctx)
        ms = sync_time(decode_round(runner, 1, ctx, steps), 2, 10) / steps
        rows.append({"context": ctx, "ms_per_token": ms, "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms,
                     "read_floor_ms": read_floor_ms,
                     "pct_of_read_floor": 100 * read_floor_ms / ms if read_floor_ms else None})
        print(rows[-1], flush=True)
    return rows


def section_invariant(asr):
    """What ``EngineOptions.batch_invariant`` costs, against the default in the same run: ms per decode step at
    batch 1 and 8 (context 512), the 3.5 s clip with 13 tokens, and the 300 mixed clips of 1-30 s (a second call
    in each mode, so neither pays for the other's graph captures)."""
    model, cfg = asr.model, asr.config.text
    rows = []
    steps, ctx = (1, 16) if SMOKE else (8, 512)
    reps = (1, 1) if SMOKE else (2, 10)  # warm-up and timed calls (the smoke run only checks the plumbing)
    for invariant in (False, True):
        runner = decode_runner(model, ctx + steps, max_batch=2 if SMOKE else 8, batch_invariant=invariant)
        fill_decode_state(runner, cfg, ctx)
        for b in ((1, 2) if SMOKE else (1, 8)):
            rows.append({"batch_invariant": invariant, "case": f"decode step, batch {b}, context {ctx}",
                         "ms": sync_time(decode_round(runner, b, ctx, steps), *reps) / steps})
            print(rows[-1], flush=True)
        del runner
    short, short_tokens = clip(3.5), (2 if SMOKE else 13)
    n, new_tokens = (2, 2) if SMOKE else (300, 40)
    audios = mixed_clips(n)
    total_s = float(sum(len(a) for a in audios)) / 16000
    slots = 2 if SMOKE else 128
    saved = asr.options
    try:
        for invariant in (False, True):
            asr.reconfigure(batch_invariant=invariant, max_batch=1)
            ms = sync_time(lambda: glmasr.transcribe(short, model=asr, sampling_rate=16000,
                                                     max_new_tokens=short_tokens, ignore_eos=True), *reps)
            rows.append({"batch_invariant": invariant, "case": f"3.5 s clip, {short_tokens} tokens", "ms": ms})
            print(rows[-1], flush=True)
            asr.reconfigure(batch_invariant=invariant, max_batch=slots)
            ms = sync_time(lambda: glmasr.transcribe(audios, model=asr, sampling_rate=16000,
                                                     max_new_tokens=new_tokens, ignore_eos=True), 1, 1)
            rows.append({"batch_invariant": invariant, "case": f"{n} mixed clips 1-30 s x {new_tokens} tokens, "
                         f"{slots} slots", "ms": ms, "RTFx": total_s / (ms / 1e3)})
            print(rows[-1], flush=True)
    finally:
        asr.reconfigure(batch_invariant=saved.batch_invariant, max_batch=saved.max_batch)
    return rows


def decode_runner(model, capacity: int, max_batch: int = 1, graphs: bool = True, **options):
    """The device side of an engine of ``max_batch`` slots (default one) with a KV cache of ``capacity``
    positions, for timing decode steps (``graphs`` off: eager launches, for the profiler's kernel records)."""
    runner = ModelRunner(model, EngineOptions(max_batch=max_batch, **options).resolved(DEV), graphs=graphs)
    with torch.inference_mode():
        runner.ensure_capacity(capacity)
    return runner


def decode_round(runner, batch: int, ctx: int, steps: int):
    """A callable for the timers: ``steps`` decode steps of slots [0, batch) from position ctx - 1 (the state
    ``fill_decode_state`` left), the step counter and positions reset first so every call does the same work."""
    def run():
        runner.step_index.zero_()
        runner.positions.fill_(ctx - 1)
        runner.decode(batch, ctx + steps, steps)

    return run


def fill_decode_state(runner, cfg, ctx: int) -> None:
    """Random KV contents and tokens, every slot decoding at position ctx - 1 with an unlimited budget."""
    with torch.inference_mode():
        runner.cache.k.normal_(0, 0.5)
        runner.cache.v.normal_(0, 0.5)
        runner.tokens.random_(0, cfg.vocab_size)
        runner.positions.fill_(ctx - 1)
        runner.active.fill_(True)
        runner.remaining.fill_(10 ** 9)
        runner.ignore_eos.fill_(True)


def encoder_flops_per_window(cfg) -> float:
    a, t, frames = cfg.audio, 1500, 3000
    conv = 2 * frames * a.num_mel_bins * a.hidden_size * 3 + 2 * t * a.hidden_size * a.hidden_size * 3
    layer = 2 * t * a.hidden_size * (4 * a.hidden_size + 2 * a.intermediate_size) + 4 * t * t * a.hidden_size
    proj = 2 * 375 * cfg.merged_width * cfg.projector_hidden + 2 * 375 * cfg.projector_hidden * cfg.text.hidden_size
    return conv + a.num_hidden_layers * layer + proj


def section_encoder(asr, peers, peaks, quick):
    """ms per 30 s window at 1 / 8 / 32 windows: the engine's encoder (the runner's: CUDA graphs for the counts in
    ``model_runner.ENCODER_BUCKETS``, eager above), and per count the model's eager pass against a graph of
    exactly that many windows (the evidence for which counts replay graphs)."""
    rows = []
    flops = encoder_flops_per_window(asr.config)
    model = asr.model
    runner = ModelRunner(model, EngineOptions(max_batch=1).resolved(DEV))
    for w in ((1, 2) if SMOKE else (1, 32) if quick else (1, 8, 32)):
        feats = torch.randn(w, asr.config.audio.num_mel_bins, 3000, device=DEV)
        with torch.inference_mode():
            ms = sync_time(lambda: runner.encode_audio(feats), 2, 5) / w
        row = {"windows": w, "ours_ms_per_window": ms,
               "pct_of_bf16_peak": 100 * flops / (ms * 1e-3) / (peaks["bf16_matmul_TFLOPs"] * 1e12)}
        if model.triton_encoder and DEV == "cuda":
            with torch.inference_mode():
                row["ours_eager_ms_per_window"] = sync_time(lambda: model.encode_audio(feats), 2, 5) / w
                row["ours_graphed_ms_per_window"] = graphed_ms(model.encode_audio, feats) / w
        if peers is not None:
            enc = peers.eager.model
            mask = torch.ones(w, 3000, dtype=torch.long, device=DEV)
            with torch.inference_mode():
                row["hf_eager_ms_per_window"] = sync_time(
                    lambda: enc.get_audio_features(feats.to(DTYPE), mask), 1, 3) / w
        rows.append(row)
        print(row, flush=True)
    del runner
    return rows


def graphed_ms(fn, x, warmup=2, runs=5) -> float:
    """ms per call of ``fn(x)`` replayed from a CUDA graph captured for x's shape (what the runner does for its
    encoder buckets: input copied in, graph replayed, output cloned); the graph is freed afterwards."""
    static_in = x.clone()
    graph, static_out = cuda_graphs.capture(lambda: fn(static_in), x.device)

    def call():
        static_in.copy_(x)
        graph.replay()
        return static_out.clone()

    ms = sync_time(call, warmup, runs)
    del graph, static_out
    return ms


def section_throughput(asr, peers, quick):
    n_windows = 4 if SMOKE else 64 if quick else 256
    new_tokens = 4 if SMOKE else 100
    audios = [clip(30.0, seed=i) for i in range(n_windows)]
    rows = []
    for slots in ((2,) if SMOKE else (64,) if quick else (16, 64, 128)):
        t = sync_time(lambda: glmasr.transcribe(audios, model=asr, sampling_rate=16000, max_new_tokens=new_tokens,
                                                ignore_eos=True, max_batch=slots), 1, 1)
        rows.append({"impl": f"ours, {slots} slots", "windows": n_windows, "wall_s": t / 1e3,
                     "RTFx": 30.0 * n_windows / (t / 1e3)})
        print(rows[-1], flush=True)
    rows[-1]["stages"] = throughput_stages(asr, audios, new_tokens, slots)
    print({"stages": rows[-1]["stages"]}, flush=True)
    rows += mixed_throughput(asr, slots)
    if peers is not None:
        # transformers eager at batch 16 on 32 windows (a rate: RTFx does not depend on the count)
        sub = audios[:32]
        t = sync_time(lambda: [peers.run(peers.eager, sub[i:i + 16], new_tokens) for i in range(0, len(sub), 16)],
                      0, 1)
        rows.append({"impl": "transformers eager, batch 16", "windows": len(sub), "wall_s": t / 1e3,
                     "RTFx": 30.0 * len(sub) / (t / 1e3)})
        print(rows[-1], flush=True)
    return rows


def mixed_throughput(asr, slots) -> list[dict]:
    """Issue 13's mixed workload: 300 clips of 1-30 s (uniform), 40 forced tokens each, in one transcribe()
    call: the first call on a freshly built engine (reconfigure: new KV cache, slot tensors and graphs; the
    kernels stay compiled), then the same call warm."""
    n, new_tokens = (6, 4) if SMOKE else (300, 40)
    audios = mixed_clips(n)
    total_s = float(sum(len(a) for a in audios)) / 16000
    rows = []
    for label in ("first call", "warm"):
        if label == "first call":
            asr.reconfigure(max_batch=slots)
            asr._stop_engine()  # the next request builds the engine afresh
        # the fresh engine is built here (what transcribe would do first; its time counts), so its runner can be
        # timed
        sync()
        t0 = time.perf_counter()
        asr.engine
        sync()
        build_ms = 1e3 * (time.perf_counter() - t0)
        stages = timed_call(asr, lambda: glmasr.transcribe(audios, model=asr, sampling_rate=16000,
                                                           max_new_tokens=new_tokens, ignore_eos=True))
        stages["engine_build_ms"] = build_ms
        wall = (stages["wall_ms"] + build_ms) / 1e3
        rows.append({"impl": f"ours, {slots} slots, {n} mixed clips 1-30 s x {new_tokens} tokens, {label}",
                     "windows": n, "audio_s": round(total_s, 1), "wall_s": wall, "RTFx": total_s / wall,
                     # where a first call's extra time goes: GPU time per kind, graph captures (host ms: encoder,
                     # prefill, decode), eager decode rounds
                     "stages": stages})
        print(rows[-1], flush=True)
    return rows


def throughput_stages(asr, audios, new_tokens, slots) -> dict:
    """One more run of the throughput workload with CUDA events around the engine's encoder calls, prefills and
    decode rounds: host stages from ``timings_ms`` (audio, features), then the engine's GPU time in encoder,
    prefill and decode; what the wall time has beyond those is host time the GPU waited."""
    asr.reconfigure(max_batch=slots)
    return timed_call(asr, lambda: glmasr.transcribe(audios, model=asr, sampling_rate=16000,
                                                     max_new_tokens=new_tokens, ignore_eos=True, max_batch=slots))


def timed_call(asr, call) -> dict:
    """``call()`` (one transcribe) with CUDA events around the engine runner's encoder calls, prefills and decode
    rounds: host stages from ``timings_ms`` (audio, features), the engine's GPU time per kind, the rest of the
    wall time ("other": host time the GPU waited), and the runner's counters (graph captures and their ms)."""
    runner = asr.engine.runner
    runner.stats.clear()
    spans = {"encoder": [], "prefill": [], "decode": []}

    def timed(kind, fn):
        def wrapper(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            spans[kind].append((start, end))
            return out
        return wrapper

    if DEV == "cuda":
        runner.encode = timed("encoder", runner.encode)
        runner.prefill = timed("prefill", runner.prefill)
        runner.decode = timed("decode", runner.decode)
    try:
        with triton_compiles() as compiles:
            sync()
            t0 = time.perf_counter()
            res = call()
            sync()
            wall_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        for name in ("encode", "prefill", "decode"):
            runner.__dict__.pop(name, None)
    out = {"audio_ms": sum(r.timings_ms["audio_ms"] for r in res),
           "features_host_ms": sum(r.timings_ms["features_ms"] for r in res)}
    for kind, pairs in spans.items():
        # each span is enqueued work, so the encoder spans include the host packing that the GPU waited for
        out[f"{kind}_gpu_ms"] = sum(a.elapsed_time(b) for a, b in pairs)
        out[f"{kind}_calls"] = len(pairs)
    out["wall_ms"] = wall_ms
    # Triton kernel variants built during the call (a span that waited on one includes its time)
    out["triton_compiles"] = compiles.summary()
    out["other_ms"] = wall_ms - out["audio_ms"] - out["encoder_gpu_ms"] - out["prefill_gpu_ms"] - out["decode_gpu_ms"]
    out["runner"] = {k: round(v, 1) for k, v in runner.stats.items()}
    return out


# Kernel-name patterns -> stage, for the profiler breakdowns (first match wins; names of our Triton kernels,
# cuBLAS/CUTLASS GEMMs, SDPA flash kernels, torch's own kernels).
STAGES = (("_skinny_kernel", "GEMV (skinny, Triton)"), ("_splitk_reduce", "GEMV split-K reduce"),
          ("_rmsnorm", "RMSNorm"), ("_layernorm", "LayerNorm"), ("_rope", "RoPE (+KV append)"),
          ("_decode_attn", "decode attention"), ("_combine", "decode attention"),
          ("_gelu", "GELU+bias"), ("_swiglu", "SwiGLU"),
          ("flash", "attention (SDPA)"), ("fmha", "attention (SDPA)"), ("attention", "attention (SDPA)"),
          ("conv", "conv (cuDNN)"), ("cudnn", "conv (cuDNN)"), ("implicit", "conv (cuDNN)"),
          ("gemm", "GEMM (cuBLAS)"), ("nvjet", "GEMM (cuBLAS)"), ("cutlass", "GEMM (cuBLAS)"),
          ("xmma", "GEMM (cuBLAS)"), ("argmax", "argmax"), ("reduce", "torch reductions"),
          ("copy", "copies"), ("elementwise", "torch elementwise"), ("index", "torch indexing"))


def kernel_stages(fn, iters: int) -> dict:
    """GPU time per stage (ms per call of ``fn``) from the profiler's CUDA kernel records, eager launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    # on the CPU (--smoke) the records are CPU ops: the plumbing is what is tested there
    with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync()
    stages: dict[str, float] = {}
    counts: dict[str, int] = {}
    for evt in prof.key_averages():
        t = evt.device_time_total if DEV == "cuda" else evt.self_cpu_time_total
        if not t:
            continue
        name = evt.key.lower()
        stage = next((s for pat, s in STAGES if pat in name), "other")
        stages[stage] = stages.get(stage, 0.0) + t / 1e3 / iters
        counts[stage] = counts.get(stage, 0) + evt.count // iters
    total = sum(stages.values())
    return {"kernel_ms": total, "stages_ms": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
            "kernels_per_call": counts}


def section_breakdown(asr, peaks):
    """Where the time goes: latency stages of the 3.5 s / 13-token case, the decode step (graph time at batch 1
    and 8, batch 1 without PDL, and GPU time per kernel stage), the encoder per stage at 1 and 32 windows (eager
    launches)."""
    from glmasr_kernels import _triton_utils

    report = {}
    audio = clip(3.5)
    n_new = 4 if SMOKE else 13
    runs, warm = [], (0 if SMOKE else 3)
    for i in range(warm + (1 if SMOKE else 5)):
        sync()
        t0 = time.perf_counter()
        r = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=n_new, ignore_eos=True,
                              max_batch=1)
        sync()
        if i >= warm:
            runs.append(dict(r.timings_ms, wall_ms=1e3 * (time.perf_counter() - t0)))
    report["latency_3.5s_stages_ms"] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    print(report["latency_3.5s_stages_ms"], flush=True)

    model = asr.model
    cfg = asr.config.text
    ctx = 64

    def step_ms(runner, batch=1, steps=1 if SMOKE else 8):
        fill_decode_state(runner, cfg, ctx)
        run = decode_round(runner, batch, ctx, steps)
        return (sync_time(run, 0, 1) if SMOKE else sync_time(run, 2, 10)) / steps

    # The step as shipped (graph-timed, batch 1 and 8) and, in the same run, without programmatic dependent launch
    # (the kernels' test switch, _triton_utils.set_pdl: what PDL is worth)
    variants = {}
    try:
        for label, pdl, batch in (("default", None, 1), ("default, batch 8", None, 8), ("no PDL", False, 1)):
            if SMOKE and label == "no PDL":
                continue
            _triton_utils.set_pdl(pdl)
            runner = decode_runner(model, 1024 if SMOKE else 4096, max_batch=batch)
            variants[label] = step_ms(runner, batch=batch)
            del runner
    finally:
        _triton_utils.set_pdl(None)
    report["decode_step_graph_ms"] = variants
    runner = decode_runner(model, 1024 if SMOKE else 4096, graphs=False)
    step_ms(runner, steps=1)
    report["decode_step_kernels"] = kernel_stages(decode_round(runner, 1, ctx, 1), 1 if SMOKE else 5)
    del runner
    print({"decode_step_graph_ms": variants}, report["decode_step_kernels"], flush=True)

    for w in ((1,) if SMOKE else (1, 32)):
        feats = torch.randn(w, asr.config.audio.num_mel_bins, 3000, device=DEV)
        with torch.inference_mode():
            st = kernel_stages(lambda: model.encode_audio(feats), 1 if SMOKE else 2)
        st = {k: ({s: v / w for s, v in val.items()} if k == "stages_ms" else
                  val / w if k == "kernel_ms" else val) for k, val in st.items()}
        report[f"encoder_{w}_windows_per_window"] = st
        print(w, st, flush=True)
    return report


# Cold start: one fresh process per case (scripts/bench/coldstart_child.py, the program each case runs), with the
# warm-up "on" (what a server does before it answers: asr.warmup()), "background" (load(warmup="background"): the
# one-clip path before load returns, the other graphs while the engine is idle) or "off" (the one-clip path at
# load, the rest lazily when first used), and the caches "cold" (fresh empty GLMASR_CACHE_DIR, TRITON_CACHE_DIR,
# and TORCHINDUCTOR_CACHE_DIR / CUDA_CACHE_PATH for good measure), "warm" (the same folders again, as the cold run
# of that case left them) or "compiled" (fresh folders filled by `glmasr compile` in a process that sees no GPU,
# as an install step on a new machine would: its time is reported apart). The checkpoint file is in the OS page
# cache in every case (the parent just read it).
COLDSTART_CHILD = "scripts.bench.coldstart_child"  # run as a module from the checkout root
COLDSTART_CASES = (("background", "cold"), ("background", "warm"), ("background", "compiled"), ("on", "cold"),
                   ("on", "warm"), ("off", "cold"), ("off", "warm"))  # (warm-up, caches)
# Targets (issue 27) for import glmasr + glmasr.load + warm-up + the first transcript (import torch excluded).
COLDSTART_TARGET_S = {"cold": 12.0, "compiled": 12.0, "warm": 2.5}
COLDSTART_TOTAL = ("import_glmasr", "load", "warmup", "first_request")


def _subtotal_prefixes(stages: dict) -> list[str]:
    """``weights_`` for a ``weights_total_ms`` key: the other ``weights_*`` keys are its parts (they may overlap)."""
    return [k[:-len("total_ms")] for k in stages if k.endswith("_total_ms")]


def _stage_sum(stages: dict) -> float:
    """Sum of a handle's stage dict: its top-level stages, a sub-total instead of its parts, not its own
    ``total_ms``."""
    prefixes = _subtotal_prefixes(stages)
    return sum(v for k, v in stages.items() if k not in ("total", "total_ms")
               and (k.endswith("_total_ms") or not any(k.startswith(p) for p in prefixes)))


def CHILD_BACKEND() -> str:
    """The fresh processes' backend: the product's ("triton"), except the smoke run on the CPU, which checks the
    sections' plumbing and would spend minutes per process in the Triton interpreter."""
    return "torch" if SMOKE and DEV == "cpu" else "triton"


def _cache_env(cache_dir: Path) -> dict:
    return dict(os.environ, GLMASR_CACHE_DIR=str(cache_dir / "glmasr"), TRITON_CACHE_DIR=str(cache_dir / "triton"),
                TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"), CUDA_CACHE_PATH=str(cache_dir / "cuda"))


def compile_ahead(cache_dir: Path, timeout_s: float) -> dict:
    """`glmasr compile` into ``cache_dir``'s folders in a process that sees no GPU (CUDA_VISIBLE_DEVICES=""): the
    install step of a new machine. Returns its wall time, exit status and the tail of its report."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    env = dict(_cache_env(cache_dir), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "glmasr.cli", "compile", "--arch", "90"]
    if SMOKE:  # the plumbing only: the CPU would spend minutes compiling the shipped manifest for sm_90
        empty = cache_dir / "empty-manifest.json"
        empty.write_text(json.dumps({"format": "glmasr-kernel-manifest/1", "triton": "any",
                                     "target": {"backend": "cuda", "arch": 90, "warp_size": 32}, "entries": []}))
        cmd += ["--manifest", str(empty), "--no-nvrtc"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as e:
        rc, out = f"timeout after {timeout_s:.0f} s", str(e.stdout or "")
    row = {"wall_s": round(time.monotonic() - t0, 2), "rc": rc, "report_tail": out[-1500:]}
    print(f"[coldstart] glmasr compile: {row}", flush=True)
    return row


def coldstart_case(folder: Path, warmup: str, caches: str, cache_dir: Path, timeout_s: float, seconds: float,
                   new_tokens: int, extra_args: tuple[str, ...] = ()) -> dict:
    """One fresh process: ``warmup`` "on" / "background" / "off"; ``caches`` names the state of ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    env = _cache_env(cache_dir)
    result = cache_dir / f"result-{caches}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", COLDSTART_CHILD, str(folder), str(result), "--device", DEV,
           "--dtype", str(DTYPE).replace("torch.", ""), "--backend", CHILD_BACKEND(), "--seconds", str(seconds),
           "--new-tokens", str(new_tokens), *extra_args] + {
               "on": ["--warmup"], "background": ["--warmup-background"], "off": []}[warmup]
    row = {"case": f"warm-up {warmup}, caches {caches}", "warmup": warmup, "caches": caches}
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        row["rc"], stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:  # its stderr comes as bytes even with text=True
        err = e.stderr or ""
        row["rc"], stderr = f"timeout after {timeout_s:.0f} s", err.decode(errors="replace") if isinstance(
            err, bytes) else err
    t1 = time.monotonic()
    child = json.loads(result.read_text()) if result.is_file() else {}
    st = child.get("stages_ms", {})
    row["process_wall_s"] = t1 - t0
    # the child's clock is time.monotonic() too (CLOCK_MONOTONIC): interpreter start-up and exit from the parent
    row["python_startup_ms"] = 1e3 * (child["t_start"] - t0) if "t_start" in child else None
    row["exit_ms"] = 1e3 * (t1 - child["t_end"]) if "t_end" in child and row["rc"] == 0 else None
    row["stages_ms"] = st
    for key in ("load_stages_ms", "load_values", "warmup_stages_ms", "warmup_values", "first_request_timings_ms",
                "second_request_timings_ms", "first_request_tokens", "model", "max_memory_allocated_GB",
                "warmup_error", "error", "audio_s", "first_request_RTFx", "second_request_RTFx",
                "first_request_triton_compiles", "second_request_triton_compiles", "background_warmup_done_ms",
                "load_triton_compiles", "first_request_runner_stats", "second_request_runner_stats",
                "background_warmup_stages_ms", "background_warmup_errors"):
        if key in child:
            row[key] = child[key]
    if "load" in st and row.get("load_stages_ms"):
        row["load_other_ms"] = st["load"] - _stage_sum(row["load_stages_ms"])
    if "warmup" in st and row.get("warmup_stages_ms"):
        row["warmup_other_ms"] = st["warmup"] - _stage_sum(row["warmup_stages_ms"])
    needed = [k for k in COLDSTART_TOTAL if k != "warmup" or warmup == "on"]
    complete = all(k in st for k in needed)
    row["total_s"] = sum(st[k] for k in needed) / 1e3 if complete else None
    row["load_to_first_transcript_s"] = sum(st[k] for k in needed if k != "import_glmasr") / 1e3 if complete else None
    row["target_s"] = COLDSTART_TARGET_S[caches]
    row["meets_target"] = None if row["total_s"] is None else row["total_s"] <= row["target_s"]
    if row["rc"] != 0 or not complete:
        row["stderr_tail"] = stderr[-1500:]
    return row


def coldstart_table(cases: list[dict]) -> str:
    """Stages as rows (every key the handle reported, in order), cases as columns; ms unless marked s."""
    def ms(v):
        return "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"

    def keys(field):
        seen = []
        for c in cases:
            seen += [k for k in c.get(field) or {} if k not in seen and k not in ("total", "total_ms")]
        return seen

    def short(k, field):
        name = k[:-3] if k.endswith("_ms") else k
        part = [p for c in cases for p in _subtotal_prefixes(c.get(field) or {})
                if k.startswith(p) and not k.endswith("_total_ms")]
        return f"{name} (part of {part[0]}total)" if part else name

    rows = [("python start-up", lambda c: ms(c.get("python_startup_ms"))),
            ("import torch (not in the total)", lambda c: ms(c["stages_ms"].get("import_torch"))),
            ("import glmasr", lambda c: ms(c["stages_ms"].get("import_glmasr"))),
            ("glmasr.load", lambda c: ms(c["stages_ms"].get("load")))]
    rows += [(f"  load: {short(k, 'load_stages_ms')}", lambda c, k=k: ms((c.get("load_stages_ms") or {}).get(k)))
             for k in keys("load_stages_ms")]
    rows += [("  load: other", lambda c: ms(c.get("load_other_ms"))),
             ("asr.warmup()", lambda c: ms(c["stages_ms"].get("warmup")))]
    rows += [(f"  warm-up: {short(k, 'warmup_stages_ms')}", lambda c, k=k: ms((c.get("warmup_stages_ms") or {}).get(k)))
             for k in keys("warmup_stages_ms")]
    rows += [("  warm-up: other", lambda c: ms(c.get("warmup_other_ms"))),
             ("first transcribe()", lambda c: ms(c["stages_ms"].get("first_request")))]
    rows += [(f"  first request: {short(k, 'first_request_timings_ms')}", lambda c, k=k: ms((c.get("first_request_timings_ms") or {}).get(k)))
             for k in keys("first_request_timings_ms")]
    rows += [("second transcribe() (steady state)", lambda c: ms(c["stages_ms"].get("second_request"))),
             ("background warm-up: every graph captured, ms after load",
              lambda c: ms(c.get("background_warmup_done_ms"))),
             ("**total** s: import glmasr + load + warm-up + first transcript",
              lambda c: "-" if c.get("total_s") is None else f"**{c['total_s']:.2f}**"),
             ("target s", lambda c: f"<= {c['target_s']} " + {True: "met", False: "MISSED", None: "?"}[
                 c.get("meets_target")]),
             ("process start to exit s", lambda c: f"{c['process_wall_s']:.2f}"),
             ("exit (interpreter teardown)", lambda c: ms(c.get("exit_ms"))),
             ("rc", lambda c: str(c["rc"]))]
    head = "| stage (ms) | " + " | ".join(c["case"] for c in cases) + " |"
    lines = [head, "|---|" + "---|" * len(cases)]
    lines += [f"| {label} | " + " | ".join(get(c) for c in cases) + " |" for label, get in rows]
    return "\n".join(lines)


def section_coldstart(folder: Path):
    """Process start to first transcript, per stage, in a fresh process per case (COLDSTART_CASES)."""
    import shutil
    import tempfile

    timeout_s = float(os.environ.get("GLMASR_COLDSTART_CASE_TIMEOUT_S", "240"))
    # --smoke (CPU, Triton interpreter: ~0.5-1 s per decode step): the same four cases, a 1 s clip and 2 tokens
    seconds, new_tokens = (1.0, 2) if SMOKE else (3.5, 13)
    base = Path(tempfile.mkdtemp(prefix="glmasr-coldstart-"))  # private: concurrent runs do not share caches
    cases = []
    compiled = None
    try:
        for warmup, caches in COLDSTART_CASES:
            cache_dir = base / (f"{warmup}-compiled" if caches == "compiled" else warmup)
            if caches in ("cold", "compiled"):
                shutil.rmtree(cache_dir, ignore_errors=True)
            if caches == "compiled":
                compiled = compile_ahead(cache_dir, float(os.environ.get("GLMASR_COMPILE_TIMEOUT_S", "300")))
            cases.append(coldstart_case(folder, warmup, caches, cache_dir, timeout_s, seconds, new_tokens))
            c = cases[-1]
            print({k: c.get(k) for k in ("case", "rc", "total_s", "meets_target", "process_wall_s", "stages_ms",
                                         "error", "warmup_error") if k in c}, flush=True)
            if c.get("stderr_tail"):
                print(c["stderr_tail"], flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    table = coldstart_table(cases)
    print(table, flush=True)
    return {"clip_s": seconds, "new_tokens": new_tokens, "device": DEV, "targets_s": COLDSTART_TARGET_S,
            "total_is": "import glmasr + glmasr.load + asr.warmup() (when on) + the first transcribe(), wall, GPU "
                        "synchronised; import torch and the interpreter start-up are reported apart",
            "cases": cases, "table": table, "glmasr_compile": compiled}


def section_firstcall(folder: Path) -> dict:
    """Issue 13's mixed workload (300 clips of 1-30 s, 40 tokens, 128 slots) as the first transcribe() of a fresh
    process (coldstart_child.py --mixed): caches cold (every Triton kernel compiled in the call), caches warm
    (Triton's disk cache from the previous case: what a second run of the tool sees), and caches warm after
    ``asr.warmup()``; then a second call in the same process. Then the same clips as WAV uploads to a fresh
    ``glmasr serve`` once it reports ready (``serve_load.first_mixed``), twice."""
    import shutil
    import tempfile

    timeout_s = float(os.environ.get("GLMASR_COLDSTART_CASE_TIMEOUT_S", "240"))
    n, new_tokens, slots = (6, 2, 2) if SMOKE else (300, 40, 128)
    base = Path(tempfile.mkdtemp(prefix="glmasr-firstcall-"))
    cases = []
    try:
        for warmup, caches in (("off", "cold"), ("off", "warm"), ("on", "warm")):
            row = coldstart_case(folder, warmup, caches, base, timeout_s, 1.0, new_tokens,
                                 ("--mixed", str(n), "--max-batch", str(slots)))
            keep = ("case", "rc", "stages_ms", "audio_s", "first_request_RTFx", "second_request_RTFx",
                    "first_request_triton_compiles", "second_request_triton_compiles", "warmup_stages_ms", "error",
                    "stderr_tail")
            cases.append({k: row[k] for k in keep if k in row})
            print({k: cases[-1].get(k) for k in ("case", "rc", "stages_ms", "first_request_RTFx",
                                                 "second_request_RTFx")}, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    from scripts.bench import serve_load

    # a fresh `glmasr serve` (full warm-up before it reports ready), the same clips as uploads, all at once
    server = serve_load.first_mixed(folder, DEV, n=n, new_tokens=new_tokens, slots=slots, out_dir=Path(base.parent))
    return {"clips": n, "new_tokens": new_tokens, "slots": slots, "cases": cases, "fresh_server": server}


def section_serve(asr, folder: Path, quick: bool, out: Path):
    """glmasr serve in its own process under 1-256 concurrent openai clients, beside offline on the same clips."""
    from scripts.bench import serve_load

    if SMOKE:
        return serve_load.run(asr, folder, levels=(1, 2), seconds=2.0, num_clips=2, device=DEV, grace=120.0,
                              out_dir=out)
    levels = (1, 8, 64) if quick else (1, 8, 64, 256)
    return serve_load.run(asr, folder, levels=levels, seconds=10.0 if quick else 20.0, device=DEV, out_dir=out)


def section_realtime(asr, folder: Path, args, out: Path):
    """glmasr serve in its own process under N live sessions (finals only, then partials at a 1 s hop)."""
    from scripts.bench import realtime_load

    def sizes(text):
        return tuple(int(c) for c in text.split(",") if c.strip())

    if SMOKE:
        return realtime_load.run(folder, DEV, sessions=(2,), partial_sessions=(1,), seconds=3.0, warmup="request",
                                 max_batch=asr.options.max_batch, out_dir=out, ramp_s=1.0)
    sessions, partial = sizes(args.realtime_sessions), sizes(args.realtime_partial_sessions)
    if args.quick:
        sessions, partial = sessions[:2], partial[:1]
    return realtime_load.run(folder, DEV, sessions=sessions, partial_sessions=partial,
                             seconds=20.0 if args.quick else args.realtime_seconds, max_batch=asr.options.max_batch,
                             out_dir=out, audio=tuple(args.realtime_audio),
                             server_flags=tuple(args.realtime_server_flag))


def section_longform(asr, quick: bool, out: Path):
    """An hour of 44.1 kHz stereo mp3 to SRT in both segmentations, and each stage alone."""
    from scripts.bench import longform

    minutes = 0.5 if SMOKE else (10.0 if quick else 60.0)
    return longform.run(asr, minutes=minutes)  # the SRTs go to a temporary folder: only their sizes are kept


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated subset of {SECTIONS} (default: {','.join(DEFAULT_SECTIONS)})")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run of every section)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--compiled-peer", dest="compiled_peer", action="store_true", default=True,
                    help="also transformers with a static cache, whose generate() compiles the decode step, on the "
                         "3.5 s clip (the default)")
    ap.add_argument("--no-compiled-peer", dest="compiled_peer", action="store_false",
                    help="leave the compiled transformers peer out (saves its compile time)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the tiny checkpoint (tests the script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--realtime-sessions", default="64,256,512",
                    help="realtime section: concurrent live sessions per level, finals only")
    ap.add_argument("--realtime-partial-sessions", default="32,128",
                    help="realtime section: concurrent live sessions per level with partials on ('' for none)")
    ap.add_argument("--realtime-seconds", type=float, default=60.0, help="realtime section: seconds per level")
    ap.add_argument("--realtime-server-flag", action="append", default=[], metavar="FLAG",
                    help="realtime section: a flag for its glmasr serve (repeatable, --realtime-server-flag=--x=1)")
    ap.add_argument("--realtime-audio", nargs="+", default=(), metavar="FILE",
                    help="realtime section: speech files the sessions stream (default: espeak-ng speech; a machine "
                         "without espeak-ng needs them)")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    global DEV, DTYPE, SMOKE
    SMOKE = args.smoke
    if args.smoke:
        DEV = "cuda" if torch.cuda.is_available() else "cpu"
        DTYPE = torch.float32
        if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke on the CPU needs TRITON_INTERPRET=1 (the Triton path runs in the interpreter)")
    elif not torch.cuda.is_available():
        sys.exit("benchmark.sh needs a CUDA GPU (or --smoke for a toy run of the script)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": "bash benchmark.sh " + " ".join(sys.argv[1:])}
    report["peaks"] = peaks = measure_peaks()
    if args.smoke:
        from glmasr.checkpoint.random_weights import build_checkpoint

        folder = out / "tiny-random"
        if not (folder / "model.safetensors").exists():
            build_checkpoint(folder, size="tiny", layout="shipped")
    else:
        folder = ensure_full_size_checkpoint()
    asr = glmasr.load(folder, device=DEV, dtype=DTYPE, backend="triton")
    report["model"] = repr(asr)
    needs_peers = not args.no_peers and any(s in only for s in ("latency", "encoder", "throughput"))
    peers = Peers(folder, compiled=args.compiled_peer and not args.smoke) if needs_peers else None
    if "transformers" not in report and peers is not None:
        import transformers

        report["transformers"] = transformers.__version__
    sections = {"latency": lambda: section_latency(asr, peers, args.quick),
                "decode": lambda: section_decode(asr, peaks, args.quick),
                "encoder": lambda: section_encoder(asr, peers, peaks, args.quick),
                "throughput": lambda: section_throughput(asr, peers, args.quick),
                "coldstart": lambda: section_coldstart(folder),
                "firstcall": lambda: section_firstcall(folder),
                "breakdown": lambda: section_breakdown(asr, peaks),
                "invariant": lambda: section_invariant(asr),
                "serve": lambda: section_serve(asr, folder, args.quick, out),
                "longform": lambda: section_longform(asr, args.quick, out),
                "realtime": lambda: section_realtime(asr, folder, args, out)}
    for name in SECTIONS:
        if name in only:
            t = time.perf_counter()
            try:
                report[name] = sections[name]()
            except Exception as e:  # keep the other sections' numbers
                import traceback

                report[name] = {"error": repr(e)}
                print(f"[{name}] failed: {e!r}", flush=True)
                traceback.print_exc()
            print(f"[{name}: {time.perf_counter() - t:.0f} s]", flush=True)
            (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    report["total_s"] = time.perf_counter() - t_all
    (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
