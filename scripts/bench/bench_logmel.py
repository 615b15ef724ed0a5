"""Benchmark of the fused log-mel frontend (kernels/logmel) on one GPU; one device call.

CUDA-event medians over rotating fresh inputs (more input bytes than L2), against the torch.stft
recipe (glmasr.audio.features.log_mel_windows), torchaudio MelSpectrogram and PyPI flashmel when present.
Prints a table (ms, % of the measured copy peak for (input + output bytes) / time) and writes
JSON to $OUT/bench_logmel.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from glmasr.audio.features import log_mel_windows
from glmasr_kernels.logmel import MelSpectrogram, whisper_features
from glmasr_kernels.logmel import _config as C
from glmasr_kernels.logmel._build import KernelConfig, get_cubin

SWEEP = [1 << k for k in range(6, 15)]


def copy_peak_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return 2 * a.numel() / (statistics.median(ts) * 1e-3) / 1e9


def time_fn(fn, inputs, reps=30, warmup=3):
    """Median ms per call; each call gets the next input of a rotating set."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        x = inputs[i % len(inputs)]
        s.record()
        fn(x)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def time_graph(fn, inputs, calls=20, reps=10):
    """Median ms per call from CUDA-graph replays of `calls` back-to-back calls (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(inputs[i % len(inputs)])
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


def n_inputs(nbytes: int) -> int:
    return max(2, min(64, (256 << 20) // max(nbytes, 1) + 1))


def _warm(cfg):
    get_cubin(cfg)
    return repr(cfg)


def _warm_flashmel(nh):
    import flashmel

    n, hop = nh
    m = flashmel.MelSpectrogram(n_fft=n, hop_length=hop, n_mels=128)
    m(torch.randn(1, 40000, device="cuda"))
    torch.cuda.synchronize()
    return n


def prewarm_flashmel(procs: int, whisper_only: bool = False):
    """flashmel compiles one config per call serially; fill its disk cache from parallel processes."""
    import multiprocessing as mp

    jobs = [(400, 160)] + ([] if whisper_only else [(n, n // 4) for n in SWEEP])
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_warm_flashmel, jobs))


def prewarm(sm: int, procs: int, whisper_only: bool = False):
    """Compile every configuration the benchmark needs in parallel (disk cache)."""
    cfgs = []
    for n in [] if whisper_only else SWEEP:
        ept, pairs, iters = C.LAUNCH[n]
        cfgs.append(KernelConfig(n, pairs, iters, C.split_lanes(n, 128), 0, False, False, False, sm, ept))
    ept, pairs, iters = C.LAUNCH[400]
    for bf16 in (False, True):
        cfgs.append(KernelConfig(400, pairs, iters, C.split_lanes(400, 128), 0, True, False, bf16, sm, ept,
                                 C.WHISPER_DIRECT, C.WHISPER_MINB))
    with ProcessPoolExecutor(procs) as ex:
        list(ex.map(_warm, cfgs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-flashmel", action="store_true")
    ap.add_argument("--no-torchaudio", action="store_true")
    ap.add_argument("--whisper-only", action="store_true", help="skip the power mel n_fft sweep")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    prewarm(major * 100 + minor * 10, min(16, os.cpu_count() or 1), args.whisper_only)
    peak = copy_peak_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy peak {peak:.0f} GB/s", flush=True)

    flashmel = None
    if not args.no_flashmel:
        try:
            import flashmel  # noqa: F401

            prewarm_flashmel(min(11, os.cpu_count() or 1), args.whisper_only)
        except Exception as e:  # noqa: BLE001
            print(f"flashmel unavailable: {e!r}")
    torchaudio = None
    if not args.no_torchaudio:
        try:
            import torchaudio  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"torchaudio unavailable: {e!r}")

    rows = []

    def rec(case, impl, ms, nbytes, **extra):
        if callable(ms):
            try:
                ms = ms()
            except Exception as e:  # noqa: BLE001  (a failing baseline must not stop the run)
                print(f"{case}: {impl} failed: {e!r}"[:300], flush=True)
                return
        pct = 100.0 * nbytes / (ms * 1e-3) / 1e9 / peak if ms else float("nan")
        rows.append(dict(case=case, impl=impl, ms=ms, bytes=nbytes, pct_copy_peak=pct, **extra))
        print(f"{case:28s} {impl:28s} {ms:9.4f} ms  {pct:6.1f} %", flush=True)

    with torch.inference_mode():
        # ---------------------------------------------------------------- Whisper features
        for B in (1, 32, 128):
            nb_in = B * 480000 * 4
            nb_out = B * 128 * 3000 * 4 + B * 3000 * 4
            ins = [torch.randn(B, 480000, device=dev) * 0.1 for _ in range(n_inputs(nb_in))]
            case = f"whisper {B}x30s"
            f = lambda x: whisper_features(x)  # noqa: E731
            rec(case, "glmasr.logmel (events)", lambda: time_fn(f, ins), nb_in + nb_out)
            rec(case, "glmasr.logmel (graph)", lambda: time_graph(f, ins), nb_in + nb_out)
            fb = lambda x: whisper_features(x, out_dtype=torch.bfloat16)  # noqa: E731
            rec(case, "glmasr.logmel bf16 (graph)", lambda: time_graph(fb, ins), nb_in + B * 128 * 3000 * 2 + B * 3000 * 4)
            rec(case, "torch.stft recipe", lambda: time_fn(log_mel_windows, ins[:4], reps=10), nb_in + nb_out)
            if torchaudio is not None:
                ta = torchaudio.transforms.MelSpectrogram(16000, 400, hop_length=160, n_mels=128).to(dev)
                rec(case, "torchaudio power mel", lambda: time_fn(ta, ins[:4], reps=10), nb_in + nb_out)
            if flashmel is not None:
                fm = flashmel.MelSpectrogram(n_fft=400, hop_length=160, n_mels=128)
                rec(case, "flashmel power mel", lambda: time_fn(fm, ins), nb_in + nb_out)
                # like for like with ours: CUDA-graph replay (falls back to the events row if capture fails)
                rec(case, "flashmel power mel (graph)", lambda: time_graph(fm, ins), nb_in + nb_out)
            del ins

        # ---------------------------------------------------------------- power mel sweep
        B, T = 32, 160000
        for n in [] if args.whisper_only else SWEEP:
            hop = n // 4
            ins = [torch.randn(B, T, device=dev) for _ in range(n_inputs(B * T * 4))]
            nf = C.n_frames(T, n, hop, 0, True)
            nbytes = B * T * 4 + B * 128 * nf * 4
            case = f"power mel n_fft={n}"
            ours = MelSpectrogram(n_fft=n, hop_length=hop, n_mels=128)
            rec(case, "glmasr.logmel (events)", lambda: time_fn(ours, ins), nbytes)
            rec(case, "glmasr.logmel (graph)", lambda: time_graph(ours, ins), nbytes)
            if flashmel is not None:
                fm = flashmel.MelSpectrogram(n_fft=n, hop_length=hop, n_mels=128)
                rec(case, "flashmel", lambda: time_fn(fm, ins), nbytes)
            if torchaudio is not None:
                ta = torchaudio.transforms.MelSpectrogram(16000, n, hop_length=hop, n_mels=128).to(dev)
                rec(case, "torchaudio", lambda: time_fn(ta, ins[:4], reps=10), nbytes)
            del ins

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_logmel.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_peak_gbs=peak,
                                                           rows=rows), indent=1))
    print("\n| case | impl | ms | % copy peak |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r['ms']:.4f} | {r['pct_copy_peak']:.1f} |")


if __name__ == "__main__":
    main()
