"""Latency and throughput of our engine against transformers, in one process, on one GPU (the H200).

    bash benchmark.sh [--only latency,decode,encoder,throughput,coldstart,breakdown] [--quick] [--no-peers]
                      [--no-compiled-peer] [--out DIR]

Every section runs ours and the peers on the same full-size GLM-ASR checkpoint with random bf16 weights
(built on the GPU once: timing does not depend on weight values; token counts are forced with ignore_eos /
min_new_tokens). Times are medians after warm-up; GPU work is synchronised before each clock read.
Prints a table per section and writes everything to OUT/benchmark.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import glmasr  # noqa: E402
from glmasr.engine.engine import Engine, _bucket_kv  # noqa: E402
from glmasr.random_checkpoint import ensure_full_size_checkpoint  # noqa: E402

SECTIONS = ("latency", "decode", "encoder", "throughput", "breakdown", "coldstart")
# --smoke: every section at toy sizes on the tiny random checkpoint, on the CPU (Triton interpreter) or a GPU,
# so the script itself is tested without spending GPU time (tests/test_benchmark_script.py).
DEV = "cuda"
DTYPE = torch.bfloat16
SMOKE = False


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def sync_time(fn, warmup=2, runs=5):
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
        return {"copy_GBps": float("nan"), "bf16_matmul_TFLOPs": float("nan")}
    buf = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copy_ms = sync_time(lambda: dst.copy_(buf), 3, 10)
    del buf, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = sync_time(lambda: a @ b, 3, 10)
    return {"copy_GBps": 2 * 2 * 1024 ** 3 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def clip(seconds: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(int(seconds * 16000), generator=g) * 0.1).numpy()


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
    model = asr.model
    cfg = asr.config.text
    weight_bytes = sum(t.numel() * t.element_size() for lw in model.dec_layers
                       for t in (lw.w_qkv, lw.w_o, lw.w_gate_up, lw.w_down)) + model.lm_head.numel() * 2
    floor_ms = weight_bytes / (peaks["copy_GBps"] * 1e6)
    rows = []
    engine = Engine(model, max_batch=1, capacity=cfg.max_position_embeddings)
    steps = 8  # decode steps per timed call (one read-back round)
    for ctx in ((64,) if SMOKE else (64, 2048) if quick else (64, 512, 2048, 8192)):
        # the timed steps write positions ctx-1 .. ctx+6: keep them inside the cache (8192 -> 8184)
        ctx = min(ctx, engine.capacity - steps)
        engine.cache.k.normal_(0, 0.5)
        engine.cache.v.normal_(0, 0.5)
        engine.tokens.random_(0, cfg.vocab_size)
        engine.positions.fill_(ctx - 1)
        engine.active.fill_(True)
        engine.remaining.fill_(10 ** 9)
        engine.ignore_eos.fill_(True)
        kv_len = _bucket_kv(ctx + steps, engine.capacity)

        def run():
            engine.step_index.zero_()
            engine.positions.fill_(ctx - 1)
            engine._run_steps(1, kv_len, steps)

        ms = sync_time(run, 2, 10) / steps
        rows.append({"context": ctx, "ms_per_token": ms, "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms})
        print(rows[-1], flush=True)
    return rows


def encoder_flops_per_window(cfg) -> float:
    a, t, frames = cfg.audio, 1500, 3000
    conv = 2 * frames * a.num_mel_bins * a.hidden_size * 3 + 2 * t * a.hidden_size * a.hidden_size * 3
    layer = 2 * t * a.hidden_size * (4 * a.hidden_size + 2 * a.intermediate_size) + 4 * t * t * a.hidden_size
    proj = 2 * 375 * cfg.merged_width * cfg.projector_hidden + 2 * 375 * cfg.projector_hidden * cfg.text.hidden_size
    return conv + a.num_hidden_layers * layer + proj


def section_encoder(asr, peers, peaks, quick):
    rows = []
    flops = encoder_flops_per_window(asr.config)
    for w in ((1, 2) if SMOKE else (1, 32) if quick else (1, 8, 32)):
        feats = torch.randn(w, asr.config.audio.num_mel_bins, 3000, device=DEV)
        with torch.inference_mode():
            ms = sync_time(lambda: asr.model.encode_audio(feats), 2, 5) / w
        row = {"windows": w, "ours_ms_per_window": ms,
               "pct_of_bf16_peak": 100 * flops / (ms * 1e-3) / (peaks["bf16_matmul_TFLOPs"] * 1e12)}
        model = asr.model
        if hasattr(model, "encoder_sdpa") and not SMOKE:
            # the other attention backend, same run (graphs re-captured for it)
            saved = model.encoder_sdpa
            try:
                model.encoder_sdpa = ("flash", "efficient", "math")
                model.reset_encoder_graphs()
                with torch.inference_mode():
                    row["ours_flash_attention_ms_per_window"] = sync_time(lambda: model.encode_audio(feats), 2, 5) / w
            finally:
                model.encoder_sdpa = saved
                model.reset_encoder_graphs()
        if peers is not None:
            enc = peers.eager.model
            mask = torch.ones(w, 3000, dtype=torch.long, device=DEV)
            with torch.inference_mode():
                row["hf_eager_ms_per_window"] = sync_time(
                    lambda: enc.get_audio_features(feats.to(DTYPE), mask), 1, 3) / w
        rows.append(row)
        print(row, flush=True)
    return rows


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
    if peers is not None:
        # transformers eager at batch 16 on 32 windows (a rate: RTFx does not depend on the count)
        sub = audios[:32]
        t = sync_time(lambda: [peers.run(peers.eager, sub[i:i + 16], new_tokens) for i in range(0, len(sub), 16)],
                      0, 1)
        rows.append({"impl": "transformers eager, batch 16", "windows": len(sub), "wall_s": t / 1e3,
                     "RTFx": 30.0 * len(sub) / (t / 1e3)})
        print(rows[-1], flush=True)
    return rows


def throughput_stages(asr, audios, new_tokens, slots) -> dict:
    """One more run of the throughput workload with CUDA events around the engine's prefills and decode rounds:
    host stages from ``timings_ms`` (audio, features, encoder until the prompts are ready), then the engine's
    GPU time in prefill and decode; what the engine's wall time has beyond those is host time the GPU waited."""
    engine = asr._engine
    spans = {"prefill": [], "decode": []}

    def timed(kind, fn):
        def wrapper(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*a, **k)
            end.record()
            spans[kind].append((start, end))
        return wrapper

    if DEV == "cuda":
        engine._prefill = timed("prefill", engine._prefill)
        engine._run_steps = timed("decode", engine._run_steps)
    try:
        sync()
        t0 = time.perf_counter()
        res = glmasr.transcribe(audios, model=asr, sampling_rate=16000, max_new_tokens=new_tokens, ignore_eos=True,
                                max_batch=slots)
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        for name in ("_prefill", "_run_steps"):
            engine.__dict__.pop(name, None)
    t = res[-1].timings_ms
    out = {k: t[k] for k in ("audio_ms", "features_ms", "encoder_ms")}
    out["engine_wall_ms"] = max(r.timings_ms["decoder_ms"] for r in res)
    for kind, pairs in spans.items():
        out[f"{kind}_gpu_ms"] = sum(a.elapsed_time(b) for a, b in pairs)
        out[f"{kind}_calls"] = len(pairs)
    out["engine_other_ms"] = out["engine_wall_ms"] - out["prefill_gpu_ms"] - out["decode_gpu_ms"]
    out["wall_ms"] = wall_ms
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
    """Where the time goes: latency stages of the 3.5 s / 13-token case, the decode step (graph time with and
    without PDL, with cuBLAS GEMMs, and GPU time per kernel stage), the encoder per stage at 1 and 32 windows."""
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

    def step_ms(engine, steps=1 if SMOKE else 8):
        engine.cache.k.normal_(0, 0.5)
        engine.cache.v.normal_(0, 0.5)
        engine.tokens.random_(0, cfg.vocab_size)
        engine.active.fill_(True)
        engine.remaining.fill_(10 ** 9)
        engine.ignore_eos.fill_(True)

        def run():
            engine.step_index.zero_()
            engine.positions.fill_(ctx - 1)
            engine._run_steps(1, _bucket_kv(ctx + 1, engine.capacity), steps)

        return (sync_time(run, 0, 1) if SMOKE else sync_time(run, 2, 10)) / steps, run

    from dataclasses import replace

    from glmasr_kernels import skinny_gemm

    # M = 1 configs of the attention GEMVs (qkv 3072 x 2048, o 2048 x 2048: 2 K tiles each, few programs per
    # SM) with both tiles loaded before the PDL wait; the global 2-tile switch also changes the big matrices
    small_keys = [key for key in ((3072, 2048, 1, False), (2048, 2048, 1, False))
                  if skinny_gemm.CONFIGS.get(key) is not None]
    preload_small = {key: replace(skinny_gemm.CONFIGS[key], preload=2) for key in small_keys}
    variants = {}
    saved_gemm = getattr(model, "decode_gemm", None)
    saved_preload = skinny_gemm.PRELOAD_TILES
    saved_configs = dict(skinny_gemm.CONFIGS)
    try:
        for label, pdl, gemm, preload, configs in (
                ("default", None, saved_gemm, saved_preload, {}),
                ("GEMV preloads 2 tiles", None, saved_gemm, 2, {}),
                ("qkv and o GEMVs preload 2 tiles", None, saved_gemm, saved_preload, preload_small),
                ("no PDL", False, saved_gemm, saved_preload, {}),
                ("cuBLAS GEMMs, no PDL", False, "cublas", saved_preload, {})):
            _triton_utils.set_pdl(pdl)
            skinny_gemm.PRELOAD_TILES = preload
            skinny_gemm.CONFIGS.update(configs)
            if saved_gemm is not None:
                model.decode_gemm = gemm
            engine = Engine(model, max_batch=1, capacity=1024 if SMOKE else 4096)
            variants[label], _ = step_ms(engine)
            del engine
            skinny_gemm.CONFIGS.clear()
            skinny_gemm.CONFIGS.update(saved_configs)
    finally:
        _triton_utils.set_pdl(None)
        skinny_gemm.PRELOAD_TILES = saved_preload
        skinny_gemm.CONFIGS.clear()
        skinny_gemm.CONFIGS.update(saved_configs)
        if saved_gemm is not None:
            model.decode_gemm = saved_gemm
    report["decode_step_graph_ms"] = variants
    engine = Engine(model, max_batch=1, capacity=1024 if SMOKE else 4096, use_graphs=False)
    step_ms(engine, 1)

    def eager_step():
        engine.step_index.zero_()
        engine.positions.fill_(ctx - 1)
        engine._decode_step(1, _bucket_kv(ctx + 1, engine.capacity))

    report["decode_step_kernels"] = kernel_stages(eager_step, 1 if SMOKE else 5)
    del engine
    print({"decode_step_graph_ms": variants}, report["decode_step_kernels"], flush=True)

    for w in ((1,) if SMOKE else (1, 32)):
        feats = torch.randn(w, asr.config.audio.num_mel_bins, 3000, device=DEV)
        with torch.inference_mode():
            st = kernel_stages(lambda: model._encode_eager(feats) if hasattr(model, "_encode_eager")
                               else model.encode_audio(feats), 1 if SMOKE else 2)
        st = {k: ({s: v / w for s, v in val.items()} if k == "stages_ms" else
                  val / w if k == "kernel_ms" else val) for k, val in st.items()}
        report[f"encoder_{w}_windows_per_window"] = st
        print(w, st, flush=True)
    return report


COLD_SNIPPET = """
import time, sys
t0 = time.perf_counter()
import torch, glmasr
asr = glmasr.load(sys.argv[1], device=sys.argv[2])
x = (torch.randn(56000) * 0.1).numpy()
r = glmasr.transcribe(x, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True, max_batch=1)
if sys.argv[2] == "cuda":
    torch.cuda.synchronize()
print("FIRST_TRANSCRIPT_S", time.perf_counter() - t0)
"""


def section_coldstart(folder: Path):
    rows = []
    cache = Path("/tmp/glmasr-bench-cold")
    for label, fresh in (("caches cold", True), ("caches warm", False)):
        if fresh:
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        env = dict(os.environ, GLMASR_CACHE_DIR=str(cache / "cubins"), TRITON_CACHE_DIR=str(cache / "triton"))
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", COLD_SNIPPET, str(folder), DEV], env=env, capture_output=True,
                           text=True)
        wall = time.perf_counter() - t0
        # (one cold H200 run had a NUL byte instead of the space in this line: accept any separator)
        inner = [float(v) for v in re.findall(r"FIRST_TRANSCRIPT_S[^0-9]{0,4}([0-9.]+)", p.stdout)]
        rows.append({"case": label, "process_start_to_first_transcript_s": wall,
                     "in_process_s": inner[0] if inner else None, "rc": p.returncode,
                     "stderr_tail": p.stderr[-400:] if p.returncode or not inner else "",
                     "stdout_tail": "" if inner else p.stdout[-400:]})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run of every section)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--compiled-peer", dest="compiled_peer", action="store_true", default=True,
                    help="also transformers with a static cache, whose generate() compiles the decode step, on the "
                         "3.5 s clip (the default)")
    ap.add_argument("--no-compiled-peer", dest="compiled_peer", action="store_false",
                    help="leave the compiled transformers peer out (saves its compile time)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the tiny checkpoint (tests the script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
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
        from glmasr.random_checkpoint import build_checkpoint

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
                "breakdown": lambda: section_breakdown(asr, peaks)}
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
