"""Host audio work for long files: file -> 16 kHz mono (decode, mono mix, resample), wall time and peak memory.

    python scripts/bench/audio_decode.py [FILE ...] [--minutes 60] [--repeat 3] [--baseline OLD_AUDIO_PY]

Without FILE it makes (once, cached in /tmp) --minutes of synthetic 44.1 kHz stereo audio as an MP3
(libsndfile's LAME) and as a FLAC. Every run is ``load_audio(file)`` in a fresh subprocess, which reports its wall
time and its peak RSS above what it held before the call (so imports do not count). Modes: "default" (the
module's defaults: threaded decode of long files where it applies), "sequential" (``AUDIO_THREADS = 1``) and,
with ``--baseline PATH``, the same two modes for an older, single-module ``glmasr/audio.py`` (e.g. from git history),
loaded in place of the package's module. Every mode's 16 kHz output is compared with the first mode's (bit-equal
or the max abs difference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import importlib.util, json, resource, sys, time
import numpy as np
path, baseline, threads, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if baseline:
    import glmasr
    spec = importlib.util.spec_from_file_location("glmasr.audio", baseline)
    audio = importlib.util.module_from_spec(spec)
    sys.modules["glmasr.audio"] = audio
    spec.loader.exec_module(audio)
    threads_home = audio  # a single-module audio.py holds the thread setting itself
else:
    from glmasr import audio
    from glmasr.audio import resampler as threads_home
if threads:
    threads_home.AUDIO_THREADS = threads
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
t = time.perf_counter()
a = audio.load_audio(path)
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
np.save(out, a.samples)
print(json.dumps({"wall_s": wall, "peak_mb": (peak - before) / 2**20, "out_mb": a.samples.nbytes / 2**20,
                  "seconds": a.duration_s}))
"""


def synth(minutes: float, rate: int = 44100):
    """Blocks of a minute of stereo: a wobbling tone plus noise (compresses like music, not like silence)."""
    n, block = int(minutes * 60 * rate), 60 * rate
    rng = np.random.default_rng(0)
    for i in range(0, n, block):
        t = np.arange(i, min(n, i + block)) / rate
        x = 0.2 * np.sin(2 * np.pi * (300 + 200 * np.sin(2 * np.pi * t / 7)) * t) + 0.05 * rng.standard_normal(t.size)
        yield np.stack([x, 0.8 * x], axis=1).astype(np.float32)


def make(path: Path, minutes: float, fmt: str, subtype: str, rate: int = 44100) -> None:
    import soundfile as sf

    tmp = path.with_name(path.stem + ".part" + path.suffix)
    with sf.SoundFile(str(tmp), "w", rate, 2, format=fmt, subtype=subtype) as f:
        for block in synth(minutes, rate):
            f.write(block)
    tmp.rename(path)


def run(path: Path, baseline: str, threads: int, out: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, str(path), baseline, str(threads), out],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default="", help="an older single-module glmasr/audio.py to compare with")
    args = ap.parse_args()

    files = [Path(f) for f in args.files]
    if not files:
        for ext, fmt, subtype in (("mp3", "MP3", "MPEG_LAYER_III"), ("flac", "FLAC", "PCM_16")):
            path = Path(f"/tmp/glmasr_bench_{args.minutes:g}min_44k1_stereo.{ext}")
            if not path.exists():
                print(f"making {path} ...", flush=True)
                t = time.perf_counter()
                make(path, args.minutes, fmt, subtype)
                print(f"  made in {time.perf_counter() - t:.1f} s", flush=True)
            files.append(path)
    modes = [("default", "", 0), ("sequential", "", 1)]
    if args.baseline:
        modes = [("baseline default", args.baseline, 0), ("baseline sequential", args.baseline, 1)] + modes
    print(f"{os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
            best: dict[str, dict] = {}
            for rep in range(args.repeat):
                for i, (name, baseline, threads) in enumerate(modes):
                    out = os.path.join(tmp, f"{i}.npy")
                    r = run(path, baseline, threads, out)
                    b = best.setdefault(name, dict(r))
                    b["wall_s"], b["peak_mb"] = min(b["wall_s"], r["wall_s"]), min(b["peak_mb"], r["peak_mb"])
                    print(f"  run {rep} {name:20s} {r['wall_s']:6.2f} s  peak +{r['peak_mb']:7.1f} MB", flush=True)
            ref = np.load(os.path.join(tmp, "0.npy"))
            print(f"  best of {args.repeat} ({best[modes[0][0]]['seconds'] / 60:.1f} min of audio, 16 kHz output "
                  f"{best[modes[0][0]]['out_mb']:.0f} MB):")
            for i, (name, _, _) in enumerate(modes):
                y = np.load(os.path.join(tmp, f"{i}.npy"))
                same = "bit-equal" if y.shape == ref.shape and np.array_equal(y, ref) else (
                    f"max |diff| {np.abs(y - ref).max():.1e}" if y.shape == ref.shape else f"shape {y.shape}")
                b = best[name]
                print(f"    {name:20s} {b['wall_s']:6.2f} s  peak +{b['peak_mb']:7.1f} MB  vs {modes[0][0]}: {same}")


if __name__ == "__main__":
    main()
