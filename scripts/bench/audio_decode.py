"""Host audio work for one long file: decode + mono mix + resample to 16 kHz, sequential vs threaded.

    python scripts/bench/audio_decode.py [FILE] [--minutes 60] [--repeat 3]

Without FILE it makes (once, cached in /tmp) a 44.1 kHz stereo mp3 of --minutes of synthetic audio with
soundfile (libsndfile's LAME). Modes: "before" is what load_audio did until 2026-12-01 (one sf.read, one float64
channel mean, one soxr call); "sequential" is ``AUDIO_THREADS = 1`` (block reads mixed block by block, one soxr
call); "threaded" the default (blocks decoded on threads, one soxr call); "+resample" adds the opt-in threaded
resampling (``resample(..., threads=N)``). Prints wall times per stage and compares every mode's mono signal
(bit-equal?) and 16 kHz output (max abs difference) with "before".
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def make_mp3(path: Path, minutes: float, rate: int = 44100) -> None:
    import soundfile as sf

    n, block = int(minutes * 60 * rate), 60 * rate
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".part.mp3")
    with sf.SoundFile(str(tmp), "w", rate, 2, format="MP3", subtype="MPEG_LAYER_III") as f:
        for i in range(0, n, block):
            t = np.arange(i, min(n, i + block)) / rate
            x = 0.2 * np.sin(2 * np.pi * (300 + 200 * np.sin(2 * np.pi * t / 7)) * t) + 0.05 * rng.standard_normal(t.size)
            f.write(np.stack([x, 0.8 * x], axis=1).astype(np.float32))
    tmp.rename(path)


def run_before(path: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """What load_audio did before block reads and threads: one sf.read of the whole file, one float64 mean over
    the channel axis, one soxr call."""
    import soundfile as sf
    import soxr

    t0 = time.perf_counter()
    data, rate = sf.read(str(path), dtype="float32", always_2d=False)
    mono = data.mean(axis=1, dtype=np.float64).astype(np.float32) if data.ndim == 2 else data
    del data
    t1 = time.perf_counter()
    out = soxr.resample(mono, rate, 16000, quality="HQ").astype(np.float32, copy=False)
    t2 = time.perf_counter()
    return {"decode+mix": t1 - t0, "resample": t2 - t1, "total": t2 - t0}, mono, out


def run(path: Path, threads: int, resample_threads: int = 1) -> tuple[dict, np.ndarray, np.ndarray]:
    from glmasr import audio

    audio.AUDIO_THREADS = threads
    try:
        t0 = time.perf_counter()
        dec = audio._decode_path(path, mono=True)
        t1 = time.perf_counter()
        out = audio.resample(dec.data, dec.rate, threads=resample_threads)
        t2 = time.perf_counter()
    finally:
        audio.AUDIO_THREADS = None
    return {"decode+mix": t1 - t0, "resample": t2 - t1, "total": t2 - t0}, dec.data, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from glmasr import audio

    path = Path(args.file) if args.file else Path(f"/tmp/glmasr_bench_{args.minutes:g}min_44k1_stereo.mp3")
    if not path.exists():
        print(f"making {path} ...", flush=True)
        t = time.perf_counter()
        make_mp3(path, args.minutes)
        print(f"  made in {time.perf_counter() - t:.1f} s", flush=True)
    threads = audio._threads()
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB), {os.cpu_count()} CPUs, threaded = {threads} threads",
          flush=True)
    modes = (("before", None, 1), ("sequential", 1, 1), ("threaded", threads, 1),
             ("+resample", threads, threads))
    best: dict[str, dict[str, float]] = {}
    seconds = None
    for rep in range(args.repeat):
        ref = None
        for name, n, rn in modes:
            times, mono, out = run_before(path) if n is None else run(path, n, rn)
            seconds = mono.shape[0] / 44100 if seconds is None else seconds
            best[name] = {k: min(v, best.get(name, {}).get(k, v)) for k, v in times.items()}
            line = f"  run {rep} {name:10s} " + "  ".join(f"{k} {v:6.2f} s" for k, v in times.items())
            if ref is None:
                ref = (mono, out)
            else:
                same = mono.shape == ref[0].shape and np.array_equal(mono, ref[0])
                diff = float(np.abs(out - ref[1]).max()) if out.shape == ref[1].shape else float("nan")
                line += f"   mono bit-equal to before: {same}, max |16 kHz - before| = {diff:.2e}"
            print(line, flush=True)
            del mono, out
        del ref
    print(f"best of {args.repeat}, each column on its own ({seconds / 60:.1f} min of audio):")
    for name, _, _ in modes:
        b = best[name]
        print(f"  {name:10s} " + "  ".join(f"{k} {v:6.2f} s" for k, v in b.items())
              + f"   {seconds / b['total']:.0f}x real time")


if __name__ == "__main__":
    main()
