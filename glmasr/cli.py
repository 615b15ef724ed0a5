"""Command line: ``glmasr AUDIO...`` (installed console command) and ``python demo.py``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_AUDIO = REPO / "assets" / "speech_en.flac"
LOCAL_WEIGHTS = REPO / "weights" / "GLM-ASR-Nano-2512"
TINY_RANDOM = REPO / "weights" / "tiny-random"


def _pick_model(arg: str | None) -> str:
    from .weights import DEFAULT_MODEL_ID

    if arg == "tiny-random":
        if not (TINY_RANDOM / "model.safetensors").exists():
            from .random_checkpoint import build_checkpoint

            print(f"building a tiny random-weight checkpoint in {TINY_RANDOM} (transcripts will be gibberish)",
                  file=sys.stderr)
            build_checkpoint(TINY_RANDOM, size="tiny", layout="shipped")
        return str(TINY_RANDOM)
    if arg is not None:
        return arg
    if (LOCAL_WEIGHTS / "config.json").exists():
        return str(LOCAL_WEIGHTS)
    return DEFAULT_MODEL_ID


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Transcribe speech with GLM-ASR-Nano-2512.")
    parser.add_argument("audio", nargs="*", help=f"audio files (wav, flac, ogg, mp3); default: {DEFAULT_AUDIO.name}")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder, hub id, or 'tiny-random' (offline smoke run with random weights); "
                             "default: weights/GLM-ASR-Nano-2512 if present, else zai-org/GLM-ASR-Nano-2512")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--prompt", default=None, help="instruction text (default: the model's transcription prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="token budget per 30 s-window group")
    args = parser.parse_args(argv)

    import glmasr

    files = args.audio or [str(DEFAULT_AUDIO)]
    try:
        t0 = time.perf_counter()
        asr = glmasr.load(_pick_model(args.model), device=args.device, dtype=args.dtype)
        t_load = time.perf_counter() - t0
        print(f"loaded {asr.folder} on {asr.device} ({str(asr.dtype).replace('torch.', '')}) in {t_load:.2f} s",
              file=sys.stderr)
        t1 = time.perf_counter()
        results = glmasr.transcribe(files, model=asr, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
        wall = time.perf_counter() - t1
    except (glmasr.CheckpointError, glmasr.AudioError, glmasr.ConfigError, glmasr.TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, r in zip(files, results):
        print(f"{path}: {r.text}")
        t = r.timings_ms
        print(f"  {r.duration_s:.2f} s audio, {r.num_windows} window(s), {r.num_audio_tokens} audio tokens, "
              f"{len(r.token_ids)} text tokens, finish_reason={r.finish_reason}", file=sys.stderr)
    t = results[0].timings_ms
    print(f"timings (ms): audio {t['audio_ms']:.1f}, features + encoder {t['encoder_ms']:.1f} (feature packing on "
          f"the host {t['features_ms']:.1f}), decoder {t['decoder_ms']:.1f}, total {wall * 1e3:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
