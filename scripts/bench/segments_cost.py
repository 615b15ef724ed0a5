"""What speech-shaped segments cost: a minute of speech with pauses transcribed as 30 s windows (the reference
segmentation), as VAD pieces packed up to 30 s (``segmentation="vad"``), and as speech-shaped segments of at most
30, 15 and 7 s (``max_segment_s``).

    python -m scripts.bench.segments_cost [--device cpu|cuda] [--model FOLDER] [--copies N] [--runs R]
                                          [--audio FILE] [--json OUT.json]

Each VAD piece is its own prompt and its own 30 s encoder window (zero-padded: the encoder's cost does not shrink
with the piece), so a minute in 8 pieces encodes 8 windows where the reference encodes 2. Printed per mode:
encoder windows, prompts, decoded tokens, the wall time of ``transcribe`` (VAD included: the VAD on the model's
device), the VAD alone, the engine's encoder and decoder times, and RTFx (audio seconds per wall second, all
copies together).

Model: ``--device cuda`` (default when a GPU is present): the full-size GLM-ASR checkpoint with random bf16
weights (``ensure_full_size_checkpoint``, as ``scripts/benchmark.py``); ``--device cpu``: the tiny random
checkpoint (fp32; the numbers then show the plumbing's shape, not a real model's speed). Timing does not depend on
the words: every prompt decodes exactly ceil(3 x its seconds) tokens (``ignore_eos``, the budget replaced as
``scripts/bench/longform.py`` does), so the modes decode about the same number of tokens.

Audio: 14 sentences of espeak-ng speech (160 wpm) with pauses of 0.6-2.0 s between them, in low noise, ~60 s;
without espeak-ng, ``assets/speech_en.flac`` (one 5.7 s utterance) repeated with the same pauses; or ``--audio``.
``--copies N`` submits N copies in one call (throughput; the GPU's batch); times are medians of ``--runs`` runs after
one warm-up run per mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
TOKENS_PER_S = 3.0
SENTENCES = [
    "Good morning everyone, and thank you all for coming to this meeting so early in the day.",
    "Today we look at the plan for the next year.",
    "The first part is about the budget.",
    "We have to make some hard choices, and not all of them will be popular.",
    "Every team will keep its present size.",
    "The savings go into research, into training, and into the tools that our engineers asked for.",
    "Yes.",
    "The second part is about the new office near the river.",
    "It opens in the spring, if the builders finish on time and the weather stays kind to us.",
    "There will be room for two hundred people, a large kitchen, and a quiet library on the top floor.",
    "Please send your questions before Friday.",
    "We will answer all of them at the next meeting, and we will also put the answers on the website.",
    "Thank you.",
    "That is all for now, enjoy the rest of your day.",
]
PAUSES = [0.7, 0.6, 1.2, 0.8, 0.6, 2.0, 0.9, 0.7, 1.5, 0.6, 1.0, 0.8, 0.7, 1.0]
MODES = [("windows", None), ("vad", None), ("vad", 30.0), ("vad", 15.0), ("vad", 7.0)]


def _espeak(text: str, tmp: str) -> np.ndarray:
    import soundfile as sf
    import soxr

    raw = os.path.join(tmp, "s.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", raw, text], check=True, capture_output=True)
    x, sr = sf.read(raw, dtype="float32")
    x = soxr.resample(x, sr, SR).astype(np.float32) if sr != SR else x
    # cut to the speech (espeak-ng pads each clip with ~0.35 s of silence): the pauses are then the stated ones
    f = SR // 100
    rms = np.sqrt((x[: len(x) // f * f].reshape(-1, f).astype(np.float64) ** 2).mean(1) + 1e-20)
    active = np.nonzero(20 * np.log10(rms / rms.max()) > -40.0)[0]
    return x[active[0] * f: (active[-1] + 1) * f]


def make_audio() -> tuple[np.ndarray, str]:
    """~60 s of speech with pauses (see the module docstring) and a word on where it came from."""
    if shutil.which("espeak-ng"):
        with tempfile.TemporaryDirectory() as tmp:
            clips = [0.5 * _espeak(t, tmp) for t in SENTENCES]
        source = f"espeak-ng, {len(SENTENCES)} sentences"
    else:
        from glmasr.audio import load_audio

        one = load_audio(str(ROOT / "assets" / "speech_en.flac")).samples
        clips = [one] * len(PAUSES)
        source = f"assets/speech_en.flac x {len(PAUSES)} (no espeak-ng)"
    parts = [np.zeros(SR, np.float32)]
    for x, pause in zip(clips, PAUSES):
        parts += [x, np.zeros(int(pause * SR), np.float32)]
    audio = np.concatenate(parts)
    audio += np.float32(0.003) * np.random.default_rng(0).standard_normal(audio.size, dtype=np.float32)
    return audio, source


def bench_checkpoint(device: str, model=None) -> tuple[bool, Path]:
    """(on CUDA?, checkpoint folder) for a cost benchmark on ``device``: ``model``, else the full-size random
    checkpoint on CUDA, the tiny one on the CPU (whose Triton paths then run in the interpreter)."""
    import torch

    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint, ensure_tiny_checkpoint

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
    return cuda, Path(model or (ensure_full_size_checkpoint() if cuda else ensure_tiny_checkpoint()))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forced_budgets(rate: float = TOKENS_PER_S):
    """Each prompt decodes ceil(rate x its seconds) tokens (at least 1): ``pipeline.default_max_new_tokens``
    replaced in this process; returns the undo."""
    from glmasr import pipeline

    original = pipeline.default_max_new_tokens
    pipeline.default_max_new_tokens = lambda seconds: max(1, math.ceil(rate * seconds))
    return lambda: setattr(pipeline, "default_max_new_tokens", original)


def run_mode(asr, audio: np.ndarray, segmentation: str, max_segment_s, copies: int, runs: int, device: str) -> dict:
    import glmasr
    from glmasr.audio import vad

    batch = [audio] * copies

    def once():
        _sync(device)
        t = time.perf_counter()
        out = glmasr.transcribe(batch, model=asr, sampling_rate=SR, segmentation=segmentation,
                                max_segment_s=max_segment_s, ignore_eos=True)
        _sync(device)
        return out, time.perf_counter() - t

    once()  # warm-up (graphs, buckets, the VAD's first run)
    walls, results = [], None
    for _ in range(runs):
        results, wall = once()
        walls.append(wall)
    r = results[0]
    row = {"mode": segmentation if max_segment_s is None else f"{segmentation} max {max_segment_s:g} s",
           "segmentation": segmentation, "max_segment_s": max_segment_s,
           "encoder_windows": sum(x.num_windows for x in results), "prompts": sum(x.num_groups for x in results),
           "tokens": sum(len(x.token_ids) for x in results), "wall_s": statistics.median(walls),
           "segments_s": [round(s.end - s.start, 2) for s in r.segments],
           "encoder_ms": r.timings_ms.get("encoder_ms"), "decoder_ms": r.timings_ms.get("decoder_ms")}
    row["rtfx"] = copies * len(audio) / SR / row["wall_s"]
    if segmentation == "vad":
        opts = vad.segment_options(max_segment_s)
        times = []
        for _ in range(runs):
            _sync(device)
            t = time.perf_counter()
            vad.segment(audio, device=device, **opts)
            _sync(device)
            times.append(time.perf_counter() - t)
        row["vad_s_per_copy"] = statistics.median(times)
    return row


def main(argv=None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the random one for the device)")
    ap.add_argument("--copies", type=int, default=None, help="copies per call (default: 64 on CUDA, 1 on the CPU)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--audio", default=None, help="a recording instead of the synthesized minute")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import glmasr

    device = args.device
    cuda, folder = bench_checkpoint(device, args.model)
    copies = args.copies or (64 if cuda else 1)
    asr = glmasr.load(folder, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    if args.audio:
        from glmasr.audio import load_audio

        audio, source = load_audio(args.audio).samples, args.audio
    else:
        audio, source = make_audio()
    report = {"device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
              "model": str(folder), "audio": source, "audio_s": round(len(audio) / SR, 2), "copies": copies,
              "runs": args.runs, "tokens_per_s": TOKENS_PER_S, "rows": []}
    undo = forced_budgets()
    try:
        for segmentation, max_segment_s in MODES:
            row = run_mode(asr, audio, segmentation, max_segment_s, copies, args.runs, device)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        undo()
        asr.close()
    print(f"\n{report['device']}, {report['audio_s']} s of audio ({source}) x {copies}, median of {args.runs}")
    print(f"{'mode':<20} {'windows':>8} {'prompts':>8} {'tokens':>7} {'wall s':>8} {'VAD s':>7} {'RTFx':>8}"
          f"  segment lengths (s)")
    for r in report["rows"]:
        vad_s = f"{r['vad_s_per_copy']:.3f}" if "vad_s_per_copy" in r else "-"
        print(f"{r['mode']:<20} {r['encoder_windows']:>8} {r['prompts']:>8} {r['tokens']:>7} {r['wall_s']:>8.3f} "
              f"{vad_s:>7} {r['rtfx']:>8.1f}  {r['segments_s']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
