"""Latency and throughput of our engine against transformers, in one process, on one GPU (the H200).

    bash benchmark.sh [--only latency,decode,encoder,throughput,coldstart] [--quick] [--out DIR]

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import glmasr  # noqa: E402
from glmasr.engine.engine import Engine, _bucket_kv  # noqa: E402
from glmasr.random_checkpoint import ensure_full_size_checkpoint  # noqa: E402

SECTIONS = ("latency", "decode", "encoder", "throughput", "coldstart")
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
    """transformers GlmAsrForConditionalGeneration: eager, and static cache + torch.compile."""

    def __init__(self, folder: Path, compiled: bool):
        from transformers import AutoProcessor, GlmAsrForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(folder))
        place = {"device_map": DEV} if DEV == "cuda" else {}  # device_map needs accelerate (on the H200 image)
        self.eager = GlmAsrForConditionalGeneration.from_pretrained(str(folder), dtype=DTYPE, **place).eval()
        self.compiled = None
        if compiled:
            m = GlmAsrForConditionalGeneration.from_pretrained(str(folder), dtype=DTYPE, **place).eval()
            m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
            self.compiled = m

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
                if peers.compiled is not None:
                    row["hf_compiled_ms"] = sync_time(lambda: peers.run(peers.compiled, [audio], n, True), 2, 3)
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
    for ctx in ((64,) if SMOKE else (64, 2048) if quick else (64, 512, 2048, 8192)):
        ctx = min(ctx, cfg.max_position_embeddings - 1)
        engine.cache.k.normal_(0, 0.5)
        engine.cache.v.normal_(0, 0.5)
        engine.tokens.random_(0, cfg.vocab_size)
        engine.positions.fill_(ctx - 1)
        engine.active.fill_(True)
        engine.remaining.fill_(10 ** 9)
        engine.ignore_eos.fill_(True)
        kv_len = _bucket_kv(ctx + 1, engine.capacity)
        steps = 50

        def run():
            engine.step_index.zero_()
            engine.positions.fill_(ctx - 1)
            engine._run_steps(1, kv_len, min(steps, engine.sync_every))

        ms = sync_time(run, 2, 10) / min(steps, engine.sync_every)
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
    if peers is not None:
        # transformers eager at batch 16 on 32 windows (a rate: RTFx does not depend on the count)
        sub = audios[:32]
        t = sync_time(lambda: [peers.run(peers.eager, sub[i:i + 16], new_tokens) for i in range(0, len(sub), 16)],
                      0, 1)
        rows.append({"impl": "transformers eager, batch 16", "windows": len(sub), "wall_s": t / 1e3,
                     "RTFx": 30.0 * len(sub) / (t / 1e3)})
        print(rows[-1], flush=True)
    return rows


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
        inner = [float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("FIRST_TRANSCRIPT_S")]
        rows.append({"case": label, "process_start_to_first_transcript_s": wall,
                     "in_process_s": inner[0] if inner else None, "rc": p.returncode,
                     "stderr_tail": p.stderr[-400:] if p.returncode else ""})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run of every section)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--no-compile", action="store_true", help="skip transformers + torch.compile")
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
    peers = Peers(folder, compiled=not (args.no_compile or args.smoke)) if needs_peers else None
    if "transformers" not in report and peers is not None:
        import transformers

        report["transformers"] = transformers.__version__
    sections = {"latency": lambda: section_latency(asr, peers, args.quick),
                "decode": lambda: section_decode(asr, peaks, args.quick),
                "encoder": lambda: section_encoder(asr, peers, peaks, args.quick),
                "throughput": lambda: section_throughput(asr, peers, args.quick),
                "coldstart": lambda: section_coldstart(folder)}
    for name in SECTIONS:
        if name in only:
            t = time.perf_counter()
            try:
                report[name] = sections[name]()
            except Exception as e:  # keep the other sections' numbers
                report[name] = {"error": repr(e)}
                print(f"[{name}] failed: {e!r}", flush=True)
            print(f"[{name}: {time.perf_counter() - t:.0f} s]", flush=True)
            (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    report["total_s"] = time.perf_counter() - t_all
    (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
