"""Command line: ``glmasr AUDIO...`` (installed console command) and ``python demo.py``; ``glmasr serve ...``
starts the OpenAI-compatible server (``glmasr.cli.serve``), ``glmasr transcribe FILES_OR_DIRS...`` writes
transcripts and subtitles (``glmasr.cli.transcribe``), ``glmasr compile`` builds the kernels' compile caches ahead
(``glmasr.cli.compile``). A file named ``serve``, ``transcribe`` or ``compile`` is ``./serve`` etc.
``glmasr --help`` lists the commands; ``glmasr serve`` without the ``serve`` extra exits with status 2 and names
``pip install 'glmasr[serve]'``."""

from __future__ import annotations

import argparse
import sys
import time

from .common import pick_model, positive_int

# What `glmasr serve` imports that only the serve extra installs.
_SERVE_MODULES = {"fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "prometheus_client"}
_COMMANDS = """commands:
  glmasr [AUDIO ...] [options]           print the text of files and the stage timings (options below)
  glmasr transcribe FILES_OR_DIRS ...    write txt/srt/vtt/tsv/json files for files and folders
                                         (glmasr transcribe --help)
  glmasr serve [options]                 OpenAI-compatible server (needs: pip install 'glmasr[serve]';
                                         glmasr serve --help)
  glmasr compile [--arch 90] [options]   compile the GPU kernels ahead into the local caches, no GPU needed
                                         (needs the cuda extra; glmasr compile --help)"""


def _serve(args: list[str]) -> int:
    try:
        from ..server import app  # noqa: F401 - the serve extra's packages, before anything else (even --help)
        from .serve import main as serve
    except ImportError as e:
        if (e.name or "").split(".")[0] not in _SERVE_MODULES:
            raise
        print(f"error: `glmasr serve` needs the serve extra, which is not installed (no module {e.name!r}): "
              f"pip install 'glmasr[serve]'", file=sys.stderr)
        return 2
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "serve":
        return _serve(args[1:])
    if args and args[0] == "transcribe":
        from .transcribe import main as transcribe_files

        return transcribe_files(args[1:])
    if args and args[0] == "compile":
        from .compile import main as compile_kernels

        return compile_kernels(args[1:])
    parser = argparse.ArgumentParser(
        prog="glmasr",
        usage="glmasr [AUDIO ...] [options]  |  glmasr transcribe ...  |  glmasr serve ...  |  glmasr compile ...",
        description="Transcribe speech with GLM-ASR-Nano-2512.\n\n" + _COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("audio", nargs="*",
                        help="audio files (wav, flac, ogg, mp3); default: the shipped sample speech_en.flac")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder, hub id, or 'tiny-random' (offline smoke run with random weights); "
                             "default: weights/GLM-ASR-Nano-2512 (next to the source checkout, or in the working "
                             "directory) if present, else zai-org/GLM-ASR-Nano-2512")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--prompt", default=None, help="instruction text (default: the model's transcription prompt)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                        help="token budget per 30 s-window group (default grows with the duration)")
    args = parser.parse_args(argv)

    import glmasr
    from glmasr.checkpoint.resources import sample_audio

    files = args.audio or [str(sample_audio())]
    try:
        t0 = time.perf_counter()
        asr = glmasr.load(pick_model(args.model), device=args.device, dtype=args.dtype)
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
