"""One long recording from file to SRT (issue 12's benchmark): a 44.1 kHz stereo mp3 of speech and silences,
transcribed in both segmentations with forced token counts at a speech-like rate, with the stage breakdown.

    python -m scripts.bench.longform [--minutes 60] [--model FOLDER] [--device cuda] [--json OUT.json]
    bash benchmark.sh --only longform            # the same, as a benchmark.sh section

The recording: ``assets/speech_en.flac`` (5.7 s of espeak-ng speech) repeated with silences of 0.3-2.5 s
between utterances and a little noise, resampled to 44.1 kHz, the right channel 0.8 x the left, 160 kb/s
constant-bitrate mp3 from libsndfile's LAME, written once (cached under the cache dir) by encoding 4-minute
chunks on all cores and joining their frames. Timing does not depend on the words: each prompt decodes
exactly ceil(3 x its seconds) tokens (``ignore_eos``; ~3 tokens per second of speech).

Per mode ("vad", the CLI's default, and "windows", the reference-exact 30 s windows), the end-to-end wall time
of ``transcribe(path)`` + ``to_srt`` + writing the file (nothing cached from an earlier run: the file is decoded
again), then each stage alone, GPU synchronised: decode (libsndfile, threads), resample (soxr), VAD (Silero, our
batched torch network on the GPU), features + encoder and decode (the engine's own timings of the same call).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .segments_cost import forced_budgets

ROOT = Path(__file__).resolve().parents[2]
SPEECH = ROOT / "assets" / "speech_en.flac"
TOKENS_PER_SPEECH_S = 3.0


_MP3_KBPS = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_MP3_RATES = (44100, 48000, 32000)
CHUNK_MINUTES = 4.0  # encoded in parallel (LAME is ~1-1.5 s per minute on one core), joined frame by frame


def _frame_length(header: bytes) -> int:
    """Bytes of one MPEG-1 Layer III frame from its 4-byte header."""
    if header[0] != 0xFF or (header[1] & 0xFE) != 0xFA:
        raise ValueError(f"not an MPEG-1 Layer III frame header: {header.hex()}")
    kbps, rate = _MP3_KBPS[header[2] >> 4], _MP3_RATES[(header[2] >> 2) & 3]
    return 144000 * kbps // rate + ((header[2] >> 1) & 1)


def _encode_chunk(args) -> bytes:
    """One chunk of the recording as constant-bitrate mp3 frames, without LAME's leading Info frame (a joined
    file must not carry one chunk's frame count): speech with silences, a little noise."""
    import io

    import soundfile as sf

    from glmasr.audio import resample

    index, seconds, rate = args
    speech, sr = sf.read(str(SPEECH), dtype="float32")
    speech = resample(speech, sr, rate)
    rng = np.random.default_rng(1000 + index)
    total, pos, speech_s, parts = int(seconds * rate), 0, 0.0, []
    while pos < total:
        gap = int(rng.uniform(0.3, 2.5) * rate)
        block = np.concatenate([np.zeros(gap, np.float32), speech * np.float32(rng.uniform(0.6, 1.0))])[: total - pos]
        speech_s += max(0, block.size - gap) / rate
        parts.append(block)
        pos += block.size
    x = np.concatenate(parts)
    x += np.float32(0.002) * rng.standard_normal(x.size, dtype=np.float32)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", rate, 2, format="MP3", subtype="MPEG_LAYER_III", bitrate_mode="CONSTANT",
                      compression_level=0.5) as f:  # 160 kb/s
        f.write(np.stack([x, 0.8 * x], axis=1))
    data = buf.getvalue()
    first = _frame_length(data[:4])
    if b"Info" in data[:first] or b"Xing" in data[:first]:
        data = data[first:]
    return data, speech_s


def make_recording(path: Path, minutes: float, rate: int = 44100) -> dict:
    """Write the mp3 (see the module docstring): chunks encoded on all cores, their frames joined."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    n = max(1, math.ceil(minutes / CHUNK_MINUTES))
    sizes = [min(CHUNK_MINUTES, minutes - i * CHUNK_MINUTES) * 60 for i in range(n)]
    tmp = path.with_suffix(".part.mp3")
    with ProcessPoolExecutor(max_workers=min(n, os.cpu_count() or 1)) as pool:
        chunks = list(pool.map(_encode_chunk, [(i, s, rate) for i, s in enumerate(sizes)]))
    with open(tmp, "wb") as f:
        for data, _ in chunks:
            f.write(data)
    tmp.rename(path)
    return {"minutes": minutes, "speech_s": round(sum(s for _, s in chunks), 1)}


def recording(minutes: float) -> Path:
    from glmasr.checkpoint.resources import cache_dir

    folder = cache_dir() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"longform_{minutes:g}min_44k_stereo.mp3"
    if not path.exists():
        t = time.perf_counter()
        info = make_recording(path, minutes)
        print(f"[longform] wrote {path} ({path.stat().st_size / 2**20:.0f} MB, {info['speech_s']:.0f} s of speech) "
              f"in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def end_to_end(asr, path: Path, mode: str, out_dir: Path) -> dict:
    """transcribe(path) + SRT written: the user's path, timed as one."""
    import glmasr
    from glmasr.writers import to_srt

    _sync(asr.device)
    t = time.perf_counter()
    r = glmasr.transcribe(str(path), model=asr, segmentation=mode, ignore_eos=True)
    srt = out_dir / f"{path.stem}.{mode}.srt"
    srt.write_text(to_srt(r), encoding="utf-8")
    wall = time.perf_counter() - t
    return {"wall_s": round(wall, 3), "segments": len(r.segments), "prompts": r.num_groups,
            "tokens": len(r.token_ids), "audio_s": round(r.duration_s, 1), "rtfx": round(r.duration_s / wall, 1),
            "timings_ms": {k: round(v, 1) for k, v in r.timings_ms.items()}, "srt_bytes": srt.stat().st_size}


def stages(asr, path: Path) -> dict:
    """Each host/GPU stage alone on the same file."""
    import soundfile as sf

    from glmasr.audio import vad
    from glmasr.audio import load_audio

    out = {}
    t = time.perf_counter()
    audio = load_audio(str(path))
    out["load_audio_s"] = round(time.perf_counter() - t, 3)  # decoding, mixing and resampling stream together
    with sf.SoundFile(str(path)) as f:
        out["file"] = {"rate": f.samplerate, "channels": f.channels, "mb": round(path.stat().st_size / 2**20, 1)}
    vad.segment(audio.samples[: 16000 * 60], device=asr.device)  # warm (weights on the device, kernels)
    _sync(asr.device)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        pieces = vad.segment(audio.samples, device=asr.device)
        _sync(asr.device)
        times.append(time.perf_counter() - t)
    out["vad_s"] = round(sorted(times)[1], 4)
    out["vad_pieces"] = len(pieces)
    out["vad_speech_s"] = round(sum(e - s for s, e in pieces), 1)
    return out


def run(asr, minutes: float = 60.0, modes=("vad", "windows"), out_dir: Path | None = None) -> dict:
    path = recording(minutes)
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="glmasr-longform-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    restore = forced_budgets(TOKENS_PER_SPEECH_S)
    try:
        import glmasr

        glmasr.transcribe(str(SPEECH), model=asr, segmentation="vad", ignore_eos=True)  # warm (VAD, buckets)
        report = {"minutes": minutes, "tokens_per_second": TOKENS_PER_SPEECH_S, "stages": stages(asr, path)}
        for mode in modes:
            report[mode] = end_to_end(asr, path, mode, out_dir)
            print(f"[longform] {mode}: {report[mode]}", flush=True)
    finally:
        restore()
    report["table"] = table(report, modes)
    print(report["table"], flush=True)
    return report


def table(report: dict, modes) -> str:
    st = report["stages"]
    lines = [f"one {report['minutes']:g}-minute 44.1 kHz stereo mp3 -> SRT, {report['tokens_per_second']:g} tokens/s "
             f"forced", "", "| mode | file -> SRT s | RTFx | segments | prompts | tokens | features + encoder ms | "
             "decoder ms |", "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        r = report[m]
        tm = r["timings_ms"]
        lines.append(f"| {m} | {r['wall_s']} | {r['rtfx']} | {r['segments']} | {r['prompts']} | {r['tokens']} | "
                     f"{tm.get('features_ms', 0) + tm.get('encoder_ms', 0):.0f} | {tm.get('decoder_ms', 0):.0f} |")
    lines += ["", f"stages alone: load_audio (decode + resample) {st['load_audio_s']} s, VAD {st['vad_s']} s "
              f"({st['vad_pieces']} pieces, {st['vad_speech_s']} s)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="vad,windows")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import glmasr
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

    folder = args.model or ensure_full_size_checkpoint()
    asr = glmasr.load(folder, device=args.device)
    report = run(asr, args.minutes, tuple(args.modes.split(",")))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
