"""``glmasr transcribe FILES_OR_DIRS... [options]``: transcribe files and folders into txt/srt/vtt/tsv/json files.

Folders are searched recursively for audio files. Files are decoded on a few threads while the engine works on
the ones before them; each file's outputs are written as soon as it is done. A file that cannot be read or
transcribed is reported on stderr and skipped; the others are still written, and the exit status is 1. A file
whose outputs all exist already is skipped unless ``--overwrite``. Progress is shown over seconds of audio.

``--devices cuda:0,cuda:1`` (or ``cpu,cpu``) runs one engine process per device (``glmasr.parallel``): files go
to whichever worker has room, outputs are written as each file finishes, and the files of a worker that dies are
retried on another (``--retries``), a file that kills every worker it meets being reported failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".webm", ".aac", ".aif",
                  ".aiff", ".wma", ".mka", ".mkv"}
IN_FLIGHT = 16  # files decoded ahead of the engine (bounds the memory held in decoded samples)


def parse_formats(value: str) -> list[str]:
    from .writers import FORMATS

    if value == "all":
        return list(FORMATS)
    out = []
    for f in value.split(","):
        f = f.strip().lower()
        if f not in FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {f!r}: use {', '.join(FORMATS)} or all")
        if f not in out:
            out.append(f)
    return out


def collect_inputs(items: list[str]) -> tuple[list[Path], list[str]]:
    """Audio files named or found under the folders named (sorted, each once) and the problems with the rest."""
    files, problems, seen = [], [], set()
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in AUDIO_SUFFIXES)
            if not found:
                problems.append(f"{p}: no audio files in this folder")
        elif p.exists():
            found = [p]
        else:
            problems.append(f"{p}: no such file or folder")
            found = []
        for q in found:
            key = q.resolve()
            if key not in seen:
                seen.add(key)
                files.append(q)
    return files, problems


def output_paths(audio: Path, out_dir: Path | None, formats: list[str]) -> dict[str, Path]:
    folder = out_dir if out_dir is not None else audio.parent
    return {f: folder / f"{audio.stem}.{f}" for f in formats}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glmasr transcribe", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="audio files and folders (searched recursively)")
    p.add_argument("--format", "-f", default="txt", type=parse_formats,
                   help="comma-separated output formats: txt, srt, vtt, tsv, json, or all (default: txt)")
    p.add_argument("--output-dir", "-o", default=None, help="where to write (default: next to each audio file)")
    p.add_argument("--model", default=None, help="checkpoint folder, hub id or 'tiny-random' (see `glmasr --help`)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="comma-separated devices, one engine process each (e.g. cuda:0,cuda:1; a device may "
                        "repeat; cpu,cpu splits the cores): files go to whichever has room")
    p.add_argument("--retries", type=int, default=2, metavar="N",
                   help="with --devices: times a file is retried after its worker died (default: 2)")
    p.add_argument("--file-timeout", type=float, default=None, metavar="S",
                   help="with --devices: kill a worker holding one file longer than S seconds (then as a crash)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--segmentation", choices=("vad", "windows"), default="vad",
                   help="vad (default): speech regions in <= 30 s pieces, each a segment with its own times; "
                        "windows: 30 s windows grouped like the reference processor (token-exact with transformers)")
    p.add_argument("--prompt", default=None, help="instruction text (default: the model's transcription prompt)")
    p.add_argument("--hotwords", nargs="+", default=None, metavar="WORD",
                   help="words or phrases to favour, added to the instruction")
    p.add_argument("--max-new-tokens", type=int, default=None, help="token budget per prompt (default grows with "
                   "the duration)")
    p.add_argument("--repetition-stop", type=int, default=None, metavar="N",
                   help="end a segment's text once it repeats one n-gram N times in a row (runaway guard)")
    p.add_argument("--max-batch", type=int, default=None, help="sequence slots of the engine")
    p.add_argument("--overwrite", action="store_true", help="transcribe files whose outputs exist already")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import glmasr
    from .cli import _pick_model
    from .tokenizer import build_instruction
    from .writers import render

    files, problems = collect_inputs(args.inputs)
    for msg in problems:
        print(f"error: {msg}", file=sys.stderr)
    out_dir = Path(args.output_dir).expanduser() if args.output_dir else None
    todo = []
    for f in files:
        outs = output_paths(f, out_dir, args.format)
        if not args.overwrite and all(p.exists() for p in outs.values()):
            print(f"skipped {f}: its outputs exist (--overwrite to redo)", file=sys.stderr)
            continue
        todo.append((f, outs))
    if not todo:
        return 1 if problems else 0
    try:
        decode = glmasr.DecodeOptions(prompt=build_instruction(args.prompt, args.hotwords or []),
                                      max_new_tokens=args.max_new_tokens, repetition_stop=args.repetition_stop,
                                      segmentation=args.segmentation)
        options = {"max_batch": args.max_batch} if args.max_batch else {}
        if args.devices is not None:
            if args.device is not None:
                raise ValueError("give --device or --devices, not both")
            from .parallel import DevicePool

            pool = DevicePool(args.devices, model=_pick_model(args.model), dtype=args.dtype, decode=decode,
                              retries=args.retries, file_timeout_s=args.file_timeout, **options)
        else:
            asr = glmasr.load(_pick_model(args.model), device=args.device, dtype=args.dtype, **options)
    except (glmasr.CheckpointError, glmasr.ConfigError, glmasr.TokenizerError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.devices is not None:
        return _run_parallel(pool, args, todo, render, problems)
    failed = 0
    t0 = time.perf_counter()
    bar = _Progress(sum(_duration(f) for f, _ in todo), args.quiet)
    with ThreadPoolExecutor(4) as pool:
        loads = [pool.submit(glmasr.audio.load_audio, str(f)) for f, _ in todo[:IN_FLIGHT]]
        jobs = []
        for i, (f, outs) in enumerate(todo):
            if i + IN_FLIGHT < len(todo):
                loads.append(pool.submit(glmasr.audio.load_audio, str(todo[i + IN_FLIGHT][0])))
            try:
                audio = loads[i].result()
                jobs.append((f, outs, asr.submit_loaded(audio, decode, i)))
            except Exception as e:  # noqa: BLE001 - reported per file, the others go on
                failed += 1
                print(f"error: {f}: {e}", file=sys.stderr)
                continue
            finally:
                loads[i] = None  # its samples belong to the job now
            while len(jobs) > IN_FLIGHT:  # keep the engine fed, collect the oldest
                failed += _finish(jobs.pop(0), render, bar)
        for job in jobs:
            failed += _finish(job, render, bar)
    bar.close()
    _summary(len(todo), failed, bar, t0)
    asr.close()
    return 1 if failed or problems else 0


def _run_parallel(pool, args, todo, render, problems) -> int:
    """--devices: one engine process per device (glmasr.parallel.DevicePool), outputs written as results come."""
    from .parallel import WorkerStartError

    failed = 0
    t0 = time.perf_counter()
    bar = _Progress(sum(_duration(f) for f, _ in todo), args.quiet)
    try:
        for fr in pool.run([f for f, _ in todo]):
            f, outs = todo[fr.index]
            if fr.ok:
                failed += _write(f, outs, fr.result, render, bar)
            else:
                failed += 1
                print(f"error: {f}: {fr.error}", file=sys.stderr)
    except WorkerStartError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        pool.close()
    bar.close()
    _summary(len(todo), failed, bar, t0)
    return 1 if failed or problems else 0


def _summary(total: int, failed: int, bar, t0: float) -> None:
    print(f"{total - failed} of {total} file(s) transcribed, {bar.seconds:.1f} s of audio in "
          f"{time.perf_counter() - t0:.1f} s" + (f"; {failed} failed" if failed else ""), file=sys.stderr)


def _duration(path: Path) -> float:
    """Seconds of audio from the file's header (for the progress bar's total); 0 when unknown."""
    try:
        import soundfile as sf

        return float(sf.info(str(path)).duration)
    except Exception:  # noqa: BLE001 - containers soundfile cannot read: the total is then an estimate
        return 0.0


def _finish(item, render, bar) -> int:
    f, outs, job = item
    try:
        r = job.result()
    except Exception as e:  # noqa: BLE001
        print(f"error: {f}: {e}", file=sys.stderr)
        return 1
    return _write(f, outs, r, render, bar)


def _write(f, outs, r, render, bar) -> int:
    try:
        for fmt, path in outs.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render(r, fmt), encoding="utf-8")
    except Exception as e:  # noqa: BLE001
        print(f"error: {f}: {e}", file=sys.stderr)
        return 1
    if r.truncated:
        print(f"warning: {f}: truncated file, {r.missing_s:.2f} s of audio missing", file=sys.stderr)
    bar.update(r.duration_s)
    return 0


class _Progress:
    """Seconds of audio done out of the headers' total (tqdm on a terminal, nothing otherwise)."""

    def __init__(self, total_s: float, quiet: bool):
        self.seconds = 0.0
        self._bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=round(total_s, 1) or None, unit="s", unit_scale=True, file=sys.stderr,
                             dynamic_ncols=True, desc="audio")

    def update(self, seconds: float) -> None:
        self.seconds += seconds
        if self._bar is not None:
            self._bar.update(round(seconds, 1))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
