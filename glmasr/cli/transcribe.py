"""``glmasr transcribe FILES_OR_DIRS... [options]``: transcribe files and folders into txt/srt/vtt/tsv/json files.

Folders are searched recursively for audio files (by suffix). A file that cannot be read or transcribed is reported
on stderr and skipped; the others are still written, and the exit status is 1.

Where the outputs go. Without ``--output-dir``, next to each audio file. With it, a file found under a folder
argument keeps its path relative to that folder (``glmasr transcribe coll -o out``: ``coll/A/x.wav`` ->
``out/A/x.json``); a file named on the command line goes straight into the output folder. An output is named
after its audio's stem (``x.wav`` -> ``x.srt``), except where the audio's folder holds another audio file with the
same stem (``x.wav`` and ``x.mp3``): then both are named after the whole file name (``x.wav.srt``, ``x.mp3.srt``).
The names depend only on what the folder holds, so every run maps a file to the same outputs, and a file whose
outputs all exist already is skipped unless ``--overwrite``. Two inputs that would still write the same output (two
``x.wav`` named from different folders with one ``--output-dir``) are refused before anything runs, naming both
(exit status 2). Each output is written under a temporary name in its folder and renamed into place, so no output
is ever left half-written.

Segmentation: ``vad`` unless ``--segmentation windows``. If the Silero VAD weights (the ``silero-vad``
distribution, a dependency of the package) are missing all the same, one warning says so and the run cuts files
into 30 s windows instead; an explicit ``--segmentation vad`` is an error then (exit status 2, before any work).
With VAD, ``--max-segment-s`` (1-30) is the longest segment: speech-shaped segments cut at pauses. Its default
is ``writers.SUBTITLE_MAX_SEGMENT_S`` (6 s) when srt or vtt is among the formats (cues a viewer can read), else
none (speech packed into pieces of up to 30 s, the fewest prompts); with ``--segmentation windows`` it is an error.

Word times and subtitles: ``--aligner PATH`` loads a CTC aligner head (``glmasr.load(..., aligner=PATH)``) and
turns word times on (``--word-timestamps``, which without ``--aligner`` is an error, exit status 2): json segments
carry their ``words``, tsv is written one row per word, and srt/vtt cues are cut at word times into at most
``--max-line-count`` lines (default 2) of ``--max-line-width`` characters (default 42) and at most
``--max-cue-s`` seconds (default 7); ``--highlight-words`` writes one cue per word, underlined (it needs word
times). Without word times a cue is a segment with its own times, its text wrapped at ``--max-line-width``
(``glmasr.writers``: no time is invented). With ``--devices`` every worker loads the aligner.

Speakers: ``--diarize`` labels every segment (and word) with its speaker (``glmasr.diarize``, needs
``pip install 'glmasr[diarize]'``: without it the run stops before any work, exit status 2): vtt cues carry
``<v A>`` voice spans, srt cues a ``[A] `` prefix, tsv a ``speaker`` column, json ``speaker`` fields, and no cue
spans two speakers. ``--min-speakers N`` / ``--max-speakers N`` bound the count; ``--speaker NAME=clip.wav``
(repeatable, several clips per name allowed; 2-10 s of that voice alone) names a known speaker. Each of these three
turns ``--diarize`` on. A clip that cannot be read or used is an error naming the flag and the file (exit status 2,
before any work). With ``--devices`` the options travel to the workers (each runs its own diarizer on its device).

How a run goes: ``LOADERS`` threads decode the files and find their speech (VAD) ahead of the engine, taking them
in input order, with at most ``IN_FLIGHT`` files held at once (being read or in the engine), so VAD of the next
files overlaps the decoding of the current ones. Each file goes to the engine as soon as it is ready (with its VAD
pieces, ``GlmAsr.submit_loaded(..., pieces=...)``) and its outputs are written the moment it is done.

Progress (stderr; ``--quiet`` leaves only errors, warnings and the summary): on a terminal, a status line from the
first second, refreshed twice a second: files done, seconds of audio done (finished VAD pieces count as they
finish) of the total from the file headers, elapsed time, and the time left once it can be estimated (a tenth of
the audio done); elsewhere (a log, a pipe) a line when the run starts and one per finished file.

Ctrl-C: the first stops the run: the files in progress are dropped, the outputs of finished files are kept (none
is half-written), one line says so, and the exit status is 130; a second Ctrl-C ends the process at once.

``--devices cuda:0,cuda:1`` (or ``cpu,cpu``) runs one engine process per device (``glmasr.workers``): files go
to whichever worker has room, outputs are written as each file finishes, and the files of a worker that dies are
retried on another (``--retries``), a file that kills every worker it meets being reported failed.

``--decode-weights int8`` (opt-in; default bf16): the decode step streams per-row int8 copies of the decoder's
matrices (``glmasr.load(..., decode_weights="int8")``: the CUDA Triton path, ~1.35 GB more memory for the
full-size model, slightly different logits; decode steps of one or two sequences); with ``--devices`` every worker
loads them (CUDA devices only: a ``cpu`` entry is an error, exit status 2).
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from ..writers import FORMATS, SRT_LINE_CHARS, SUBTITLE_MAX_SEGMENT_S, CueOptions, render
from .common import int_at_least, int_between, pick_model, positive_float, positive_int, seconds_between

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".webm", ".aac", ".aif",
                  ".aiff", ".wma", ".mka", ".mkv"}
IN_FLIGHT = 16  # files held at once (being read or in the engine): bounds the decoded samples in memory
LOADERS = 4  # threads that decode files and run their VAD ahead of the engine
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process ended by Ctrl-C
ETA_MIN_FRACTION = 0.1  # of the audio done before the time left is estimated (earlier guesses are mostly startup)


def parse_formats(value: str) -> list[str]:

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


def line_width(text: str) -> int:
    """argparse type of --max-line-width: 0 (no wrapping) up to ``writers.SRT_LINE_CHARS``."""

    return int_between(0, SRT_LINE_CHARS)(text)


def speaker_arg(text: str) -> tuple[str, str]:
    """argparse type of --speaker: ``NAME=PATH`` -> (name, path), both non-empty."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=CLIP (a speaker's name and an audio file), got {text!r}")
    return name.strip(), path


def known_speakers(pairs) -> dict | None:
    """--speaker NAME=CLIP flags as ``DecodeOptions.known_speakers`` ({name: [16 kHz clips]}), each clip loaded
    with glmasr's audio loader and checked (``diarize.check_known``). Raises ValueError naming the flag and the
    file."""
    if not pairs:
        return None
    from ..audio import load_audio
    from ..diarize import InvalidSpeakerReference, check_known
    from ..errors import AudioError

    clips: dict[str, list] = {}
    paths: dict[str, list[str]] = {}
    for name, path in pairs:
        try:
            audio = load_audio(path)
        except AudioError as e:
            raise ValueError(f"--speaker {name}={path}: {e}") from None
        clips.setdefault(name, []).append(audio.samples)
        paths.setdefault(name, []).append(path)
    try:
        return check_known(clips)
    except InvalidSpeakerReference as e:
        where = (f"--speaker {e.speaker}={paths[e.speaker][e.index]}" if e.speaker in paths and e.index is not None
                 else "--speaker")
        raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class InputFile:
    """An audio file to transcribe and the folder argument it was found under (None: named itself)."""

    path: Path
    root: Path | None = None


def collect_inputs(items: list[str]) -> tuple[list[InputFile], list[str]]:
    """Audio files named or found under the folders named (sorted per folder, each file once, the first folder
    argument that holds it being its root) and the problems with the rest."""
    files, problems, seen = [], [], set()
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in AUDIO_SUFFIXES)
            if not found:
                problems.append(f"{p}: no audio files in this folder")
            root = p
        elif p.exists():
            found, root = [p], None
        else:
            problems.append(f"{p}: no such file or folder")
            found, root = [], None
        for q in found:
            key = q.resolve()
            if key not in seen:
                seen.add(key)
                files.append(InputFile(q, root))
    return files, problems


def _named_in_full(paths: list[Path]) -> set[Path]:
    """The paths whose folder holds another audio file (on disk, or among ``paths``) with the same stem."""
    names: dict[Path, set[str]] = {}
    for p in paths:
        if p.parent not in names:
            try:
                names[p.parent] = {e.name for e in os.scandir(p.parent)
                                   if Path(e.name).suffix.lower() in AUDIO_SUFFIXES and e.is_file()}
            except OSError:
                names[p.parent] = set()
        names[p.parent].add(p.name)
    stems = {folder: Counter(Path(n).stem for n in found) for folder, found in names.items()}
    return {p for p in paths if stems[p.parent][p.stem] > 1}


def output_paths(item: InputFile, out_dir: Path | None, formats: list[str], full_name: bool = False
                 ) -> dict[str, Path]:
    """Where ``item``'s outputs go (see the module docstring); ``full_name``: named ``x.wav.srt``, not ``x.srt``."""
    if out_dir is None:
        folder = item.path.parent
    elif item.root is None:
        folder = out_dir
    else:
        folder = out_dir / item.path.parent.relative_to(item.root)
    base = item.path.name if full_name else item.path.stem
    return {f: folder / f"{base}.{f}" for f in formats}


def plan_outputs(files: list[InputFile], out_dir: Path | None, formats: list[str]
                 ) -> tuple[list[dict[str, Path]], list[str]]:
    """Every file's outputs (``output_paths``) and the clashes: two inputs that would write one path."""
    full = _named_in_full([f.path for f in files])
    outs = [output_paths(f, out_dir, formats, f.path in full) for f in files]
    owner: dict[str, InputFile] = {}
    clashes = []
    for f, o in zip(files, outs):
        path = next(iter(o.values()))  # the formats share folder and name: one clashes iff all do
        key = os.path.normcase(os.path.abspath(path))
        if key in owner:
            clashes.append(f"{owner[key].path} and {f.path} would both be written to {path.with_suffix('.*')}")
        else:
            owner[key] = f
    return outs, clashes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="glmasr transcribe", description="Transcribe audio files and folders into txt/srt/vtt/tsv/json files.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="outputs: next to each audio file, or under --output-dir with the folder layout below each folder "
               "argument\n  (coll/A/x.wav -> OUT/A/x.srt); x.wav and x.mp3 in one folder become x.wav.srt and "
               "x.mp3.srt;\n  two inputs that would still write one file are refused before anything runs.\n"
               "Ctrl-C: stops, keeping the outputs of finished files (exit status 130); a second Ctrl-C quits at "
               "once.")
    p.add_argument("inputs", nargs="+", help="audio files and folders (searched recursively)")
    p.add_argument("--format", "-f", default="txt", type=parse_formats,
                   help="comma-separated output formats: txt, srt, vtt, tsv, json, or all (default: txt)")
    p.add_argument("--output-dir", "-o", default=None,
                   help="where to write (default: next to each audio file); files found under a folder argument "
                        "keep their folders relative to it")
    p.add_argument("--model", default=None, help="checkpoint folder, hub id or 'tiny-random' (see `glmasr --help`)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="comma-separated devices, one engine process each (e.g. cuda:0,cuda:1; a device may "
                        "repeat; cpu,cpu splits the cores): files go to whichever has room")
    p.add_argument("--retries", type=int_at_least(0), default=2, metavar="N",
                   help="with --devices: times a file is retried after its worker died (default: 2)")
    p.add_argument("--file-timeout", type=positive_float, default=None, metavar="S",
                   help="with --devices: kill a worker holding one file longer than S seconds (then as a crash)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--decode-weights", choices=("bf16", "int8"), default="bf16",
                   help="weights the decode step streams (default bf16); int8 (opt-in, CUDA Triton path, every "
                        "worker with --devices): per-row int8 copies of the decoder's matrices, faster decoding of "
                        "one or two sequences for ~1.35 GB more GPU memory, slightly different logits (check WER "
                        "on your data)")
    p.add_argument("--segmentation", choices=("vad", "windows"), default=None,
                   help="vad (the default): speech regions in <= 30 s pieces, each a segment with its own times "
                        "(by default, if the Silero VAD weights are missing: one warning, then windows; asked for "
                        "explicitly: an error); windows: 30 s windows grouped like the reference processor "
                        "(token-exact with transformers)")
    p.add_argument("--max-segment-s", type=seconds_between(1.0, 30.0), default=None, metavar="S",
                   help=f"with vad: the longest segment, 1-30 s, speech-shaped (cut at pauses); default "
                        f"{SUBTITLE_MAX_SEGMENT_S:g} when srt or vtt is written, else speech packed into pieces of "
                        f"up to 30 s")
    p.add_argument("--word-timestamps", action="store_true",
                   help="word times from the aligner (needs --aligner): json and tsv carry the words, srt/vtt cues "
                        "are cut at word times")
    p.add_argument("--aligner", default=None, metavar="PATH",
                   help="a CTC aligner head's folder (the glm-asr-ctc layout) or hub id; turns --word-timestamps on")
    cues = CueOptions()
    p.add_argument("--max-line-width", type=line_width, default=cues.max_line_width, metavar="N",
                   help=f"srt/vtt: characters per line (default {cues.max_line_width}; 0: no wrapping, one line "
                        f"per cue)")
    p.add_argument("--max-line-count", type=positive_int, default=cues.max_line_count, metavar="N",
                   help=f"srt/vtt with word times: lines per cue (default {cues.max_line_count})")
    p.add_argument("--max-cue-s", type=positive_float, default=cues.max_cue_s, metavar="S",
                   help=f"srt/vtt with word times: the longest cue in seconds (default {cues.max_cue_s:g})")
    p.add_argument("--highlight-words", action="store_true",
                   help="srt/vtt with word times: one cue per word, the word underlined")
    p.add_argument("--diarize", action="store_true",
                   help="label segments (and words) with speakers (needs glmasr[diarize]): vtt <v A>, srt [A], tsv and "
                        "json speaker fields")
    p.add_argument("--min-speakers", type=int_between(1, 26), default=None, metavar="N",
                   help="with diarization: at least N speakers (1-26; turns --diarize on)")
    p.add_argument("--max-speakers", type=int_between(1, 26), default=None, metavar="N",
                   help="with diarization: at most N speakers (1-26; turns --diarize on)")
    p.add_argument("--speaker", action="append", type=speaker_arg, default=None, metavar="NAME=CLIP",
                   help="a known speaker: NAME for the voice of CLIP (an audio file, 2-10 s of that voice alone); "
                        "repeat it for more clips or speakers (at most 4 names); turns --diarize on")
    p.add_argument("--prompt", default=None, help="instruction text (default: the model's transcription prompt)")
    p.add_argument("--hotwords", nargs="+", default=None, metavar="WORD",
                   help="words or phrases to favour, added to the instruction")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help="token budget per prompt (default grows with the duration)")
    p.add_argument("--repetition-stop", type=int_at_least(2), default=None, metavar="N",
                   help="end a segment's text once it repeats one n-gram N times in a row (runaway guard)")
    p.add_argument("--max-batch", type=positive_int, default=None, metavar="N",
                   help="sequence slots of the engine (default 64 on CUDA, 8 on the CPU)")
    p.add_argument("--overwrite", action="store_true", help="transcribe files whose outputs exist already")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress (errors, warnings and the summary only)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = _Run(args)
    with _SigintGuard() as guard:
        run.guard = guard
        try:
            rc = run.main()
            run.shutdown(abort=False)
            return rc
        except KeyboardInterrupt:
            run.report_interrupt()
            run.shutdown(abort=True)  # a second Ctrl-C meanwhile ends the process (the guard)
            return EXIT_INTERRUPTED
        except BaseException:
            run.shutdown(abort=True)  # no engine or loader thread may outlive the call
            raise


def check_word_flags(args) -> str | None:
    """The message of flags that do not go together (None: they do): word times need an aligner, highlighted
    words need word times, --max-segment-s needs VAD segmentation."""
    if args.word_timestamps and args.aligner is None:
        return ("--word-timestamps needs an aligner: give --aligner PATH (a CTC aligner head's folder, the "
                "glm-asr-ctc layout); the model alone gives no word times")
    if args.highlight_words and not (args.word_timestamps or args.aligner is not None):
        return "--highlight-words needs word times: give --word-timestamps and --aligner PATH"
    if args.max_segment_s is not None and args.segmentation == "windows":
        return (f"--max-segment-s {args.max_segment_s:g} shapes the segments of --segmentation vad; with "
                f"--segmentation windows the segments are 30 s windows")
    return None


def max_segment_s(args, segmentation: str) -> float | None:
    """The run's ``DecodeOptions.max_segment_s``: --max-segment-s, else with VAD and srt or vtt among the formats
    the subtitle default (``writers.SUBTITLE_MAX_SEGMENT_S``), else None (30 s pieces)."""
    if segmentation != "vad":
        return None
    if args.max_segment_s is not None:
        return args.max_segment_s
    return SUBTITLE_MAX_SEGMENT_S if {"srt", "vtt"} & set(args.format) else None


class _Stopped(Exception):
    """A loader found the run stopping before it began a file."""


class _Run:
    """One ``glmasr transcribe`` run: its inputs, model, loader threads, jobs and progress."""

    def __init__(self, args):
        self.args = args
        self.guard: _SigintGuard | None = None
        self.todo: list[tuple[InputFile, dict[str, Path]]] = []
        self.decode = None
        self.cues = None  # writers.CueOptions
        self.asr = None
        self.pool = None  # DevicePool with --devices
        self.loaders: ThreadPoolExecutor | None = None
        self.running: dict = {}  # index in todo -> TranscriptionJob
        self.cancel = threading.Event()
        self.progress = _Progress([], quiet=True)
        self.problems: list[str] = []
        self.t0 = time.perf_counter()  # reset when the work starts (after the model is loaded)

    # ---- set-up ----
    def main(self) -> int:
        args = self.args
        import glmasr
        from ..checkpoint.tokenizer import build_instruction

        flag_error = check_word_flags(args)
        if flag_error is not None:
            print(f"error: {flag_error}", file=sys.stderr)
            return 2
        files, problems = collect_inputs(args.inputs)
        for msg in problems:
            print(f"error: {msg}", file=sys.stderr)
        self.problems = problems
        out_dir = Path(args.output_dir).expanduser() if args.output_dir else None
        outs, clashes = plan_outputs(files, out_dir, args.format)
        if clashes:
            for msg in clashes:
                print(f"error: output clash: {msg}; transcribe them in separate runs (another --output-dir) or "
                      f"rename one", file=sys.stderr)
            return 2
        for f, o in zip(files, outs):
            if not args.overwrite and all(p.exists() for p in o.values()):
                print(f"skipped {f.path}: its outputs exist (--overwrite to redo)", file=sys.stderr)
                continue
            self.todo.append((f, o))
        if not self.todo:
            return 1 if problems else 0
        self.progress = _Progress([_duration(f.path) for f, _ in self.todo], args.quiet)
        self.progress.begin("loading the model")
        segmentation = self._segmentation(None)
        if segmentation is None:
            return 2
        try:

            self.cues = CueOptions(max_line_width=args.max_line_width or None, max_line_count=args.max_line_count,
                                   max_cue_s=args.max_cue_s, highlight_words=args.highlight_words)
            words = args.word_timestamps or args.aligner is not None
            diarize = (args.diarize or args.min_speakers is not None or args.max_speakers is not None
                       or bool(args.speaker))
            if diarize:  # before the model: the weights and the clips
                from ..diarize import weights as diarize_weights

                for name in (diarize_weights.SEGMENTATION_FILE, diarize_weights.EMBEDDING_FILE):
                    diarize_weights.data_file(name)
            self.decode = glmasr.DecodeOptions(prompt=build_instruction(args.prompt, args.hotwords or []),
                                               max_new_tokens=args.max_new_tokens,
                                               repetition_stop=args.repetition_stop, segmentation=segmentation,
                                               max_segment_s=max_segment_s(args, segmentation),
                                               word_timestamps=words, diarize=diarize,
                                               min_speakers=args.min_speakers, max_speakers=args.max_speakers,
                                               known_speakers=known_speakers(args.speaker))
            options = {"max_batch": args.max_batch} if args.max_batch is not None else {}
            if args.aligner is not None:
                options["aligner"] = args.aligner
            if args.devices is not None:
                if args.device is not None:
                    raise ValueError("give --device or --devices, not both")
                from ..workers import DevicePool

                self.pool = DevicePool(args.devices, model=pick_model(args.model), dtype=args.dtype,
                                       decode=self.decode, retries=args.retries, file_timeout_s=args.file_timeout,
                                       decode_weights=args.decode_weights, **options)
            else:
                # the one-clip path now, the other graphs while the engine waits between files
                self.asr = glmasr.load(pick_model(args.model), device=args.device, dtype=args.dtype,
                                       decode_weights=args.decode_weights, warmup="background", **options)
        except (glmasr.CheckpointError, glmasr.ConfigError, glmasr.TokenizerError,
                glmasr.errors.DiarizationUnavailableError, ValueError, TypeError) as e:
            self.progress.close()
            print(f"error: {e}", file=sys.stderr)
            return 2
        if self.pool is not None:
            return self._run_parallel()
        if segmentation == "vad":
            segmentation = self._segmentation(self.asr.device)
            if segmentation is None:
                return 2
            if segmentation != "vad":
                import dataclasses

                self.decode = dataclasses.replace(self.decode, segmentation=segmentation, max_segment_s=None)
        return self._run_local()

    def _segmentation(self, device) -> str | None:
        """The segmentation this run uses: VAD unless asked otherwise or its weights are missing (one warning,
        windows instead; None, after an error, when VAD was asked for explicitly). With ``device``, the network is
        loaded onto it now (once, before the loader threads need it)."""
        if self.args.segmentation == "windows":
            return "windows"
        from ..audio import vad

        try:
            if device is None:
                vad.data_file()
            else:
                vad.load_vad(device)
        except (vad.VadUnavailableError, ValueError, RuntimeError, OSError) as e:
            if self.args.segmentation == "vad":
                self.progress.message(f"error: --segmentation vad: {e}")
                return None
            self.progress.message(f"warning: {e}; segmenting into 30 s windows instead (as with --segmentation "
                                  f"windows)")
            return "windows"
        return "vad"

    # ---- one engine in this process ----
    def _prepare(self, i: int):
        """On a loader thread: the audio of file i, decoded, and its VAD pieces (None with windows)."""
        from ..audio import vad
        from ..audio import load_audio
        from ..pipeline import check_duration

        if self.cancel.is_set():
            raise _Stopped()
        audio = load_audio(str(self.todo[i][0].path))
        if self.decode.segmentation != "vad":
            return audio, None
        check_duration(audio, self.asr.config.merge_factor)  # what plan_audio checks before its VAD
        if self.cancel.is_set():
            raise _Stopped()
        device = self.asr.device
        import torch

        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            return audio, vad.segment(audio.samples, device=device, cancel=self.cancel,
                                      **vad.segment_options(self.decode.max_segment_s))

    def _run_local(self) -> int:
        asr, n = self.asr, len(self.todo)
        events: queue.SimpleQueue = queue.SimpleQueue()
        wants_poll: set[int] = set()

        def wake(i: int) -> None:  # on the engine's thread: an output of job i arrived
            if i not in wants_poll:
                wants_poll.add(i)
                events.put(("job", i))

        self.loaders = ThreadPoolExecutor(LOADERS, thread_name_prefix="glmasr-load")
        loading: dict = {}  # i -> future of _prepare
        next_load = 0
        self.t0 = time.perf_counter()
        self.progress.working("reading and segmenting (VAD) the first files" if self.decode.segmentation == "vad"
                              else "reading the first files")
        while self.progress.finished + self.progress.failed < n:
            while next_load < n and len(loading) + len(self.running) < IN_FLIGHT:
                fut = self.loaders.submit(self._prepare, next_load)
                loading[next_load] = fut
                fut.add_done_callback(lambda _f, i=next_load: events.put(("loaded", i)))
                next_load += 1
            try:
                kind, i = events.get(timeout=0.5)
            except queue.Empty:
                self.guard.check()
                continue
            self.guard.check()
            if kind == "loaded":  # to the engine at once (files are read in order, the slow ones hold none back)
                try:
                    audio, pieces = loading.pop(i).result()
                    self.progress.loaded(i, audio.duration_s)
                    with self.guard.deferred():  # a job is never queued without being known here
                        self.running[i] = asr.submit_loaded(audio, self.decode, i, pieces=pieces)
                except Exception as e:  # noqa: BLE001 - reported per file, the others go on
                    self._failed(i, e)
                    continue
                self.progress.phase = ""
                self.running[i].stream.set_listener(lambda i=i: wake(i))
            else:
                wants_poll.discard(i)
                job = self.running.get(i)
                if job is None:
                    continue
                try:
                    deltas = job.poll()
                except Exception as e:  # noqa: BLE001 - the request's own error
                    del self.running[i]
                    self._failed(i, e)
                    continue
                final = next((d.result for d in deltas if d.finished), None)
                if final is not None:
                    del self.running[i]
                    self._write(i, final)
                elif job.done:
                    del self.running[i]
                    self._failed(i, RuntimeError("its engine request was aborted"))
                else:
                    self.progress.partial(i, _fraction_done(job))
        return self._summary()

    # ---- one engine process per device ----
    def _run_parallel(self) -> int:
        """--devices: one engine process per device (glmasr.workers.DevicePool), outputs written as results
        come."""
        from ..errors import WorkerStartError

        self.t0 = time.perf_counter()
        self.progress.working("starting the workers")
        try:
            for fr in self.pool.run([f.path for f, _ in self.todo]):
                self.progress.phase = ""
                if fr.ok:
                    self._write(fr.index, fr.result)
                else:
                    self._failed(fr.index, fr.error)
        except WorkerStartError as e:
            self.progress.close()
            print(f"error: {e}", file=sys.stderr)
            return 2
        return self._summary()

    # ---- results ----
    def _write(self, i: int, r) -> None:

        f, outs = self.todo[i]
        try:
            with self.guard.deferred():  # a Ctrl-C now takes effect once this file's outputs are all written
                for fmt, path in outs.items():
                    _write_atomic(path, render(r, fmt, self.cues), self.guard.temp_files)
                self.progress.done(i, r.duration_s, f.path)
        except Exception as e:  # noqa: BLE001 - this file's outputs could not be written; the others go on
            self._failed(i, e)
            return
        if r.truncated:
            self.progress.message(f"warning: {f.path}: truncated file, {r.missing_s:.2f} s of audio missing")

    def _failed(self, i: int, error) -> None:
        self.progress.failed_file(i)
        self.progress.message(f"error: {_describe(self.todo[i][0].path, error)}")

    def _summary(self) -> int:
        p = self.progress
        p.close()
        total = len(self.todo)
        failed = p.failed
        print(f"{total - failed} of {total} file(s) transcribed, {p.seconds:.1f} s of audio in "
              f"{time.perf_counter() - self.t0:.1f} s" + (f"; {failed} failed" if failed else ""), file=sys.stderr)
        return 1 if failed or self.problems else 0

    # ---- the end ----
    def report_interrupt(self) -> None:
        p = self.progress
        p.close()
        left = len(self.todo) - p.finished - p.failed
        print(f"interrupted: {p.finished} of {len(self.todo)} file(s) transcribed (their outputs are kept), "
              f"{left} not done", file=sys.stderr)

    def shutdown(self, abort: bool) -> None:
        """Stop everything this run started (abort: drop the unfinished work) and wait for its threads, so that
        none is left inside torch when the interpreter exits."""
        if abort:
            self.cancel.set()
            for job in self.running.values():
                job.abort()
        self.running = {}
        if self.loaders is not None:
            self.loaders.shutdown(wait=True, cancel_futures=True)
            self.loaders = None
        if self.asr is not None:
            self.asr.close()
            self.asr = None
        if self.pool is not None:
            self.pool.close(timeout=5.0 if abort else 30.0)
            self.pool = None
        self.progress.close()


def _fraction_done(job) -> float:
    """The share of a job's audio (its VAD pieces or window groups, by seconds) whose decoding has finished."""
    a = job.assembler
    total = sum(p.seconds for p in a.plans)
    if not total:
        return 0.0
    return sum(p.seconds for p, g in zip(a.plans, a.groups) if g.finish_reason is not None) / total


def _describe(path: Path, error) -> str:
    """``PATH: message`` for a file's error, without repeating the path where the message names it already."""
    text = str(error) or type(error).__name__
    return text if str(path) in text else f"{path}: {text}"


def _write_atomic(path: Path, text: str, temp_files: set) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, renamed into place (never a
    half-written output, whatever interrupts it). ``temp_files`` holds the temporary name meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.part")
    temp_files.add(tmp)
    try:
        # os.open with mode 0o666: the file gets the permissions the umask gives new files (mkstemp gives 0600)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        temp_files.discard(tmp)


def _duration(path: Path) -> float:
    """Seconds of audio from the file's header (for the progress total); 0 when unknown (then the decoded
    length, once the file is read)."""
    try:
        import soundfile as sf

        return float(sf.info(str(path)).duration)
    except Exception:  # noqa: BLE001 - containers soundfile cannot read
        return 0.0


class _SigintGuard:
    """Ctrl-C during a run (installed only in the main thread, and only over Python's default handler, so an
    ignored SIGINT stays ignored): the first raises KeyboardInterrupt in the main thread, at once or, inside
    ``deferred()``, when that block ends; the second removes the temporary output files and ends the process
    with status 130 at once."""

    def __init__(self):
        self.requested = False
        self.temp_files: set[str] = set()
        self._defer = 0
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            for tmp in list(self.temp_files):
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            os._exit(EXIT_INTERRUPTED)
        self.requested = True
        if not self._defer:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C came and was not acted on: the handler's own raise can be lost when
        the signal lands in code that swallows exceptions (a finalizer, a callback); the run's loop calls this
        at every wake-up."""
        if self.requested and not self._defer:
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self):
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if self.requested and not self._defer:
            raise KeyboardInterrupt


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Progress:
    """Progress over seconds of audio (see the module docstring): a status line on a terminal, refreshed by a
    thread of its own; a line per finished file elsewhere; nothing but ``message``s when quiet. Every line the
    run prints goes through ``message`` so that it does not collide with the status line."""

    def __init__(self, durations: list[float], quiet: bool, stream=None, clock=time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.n = len(durations)
        self.durations = list(durations)
        self.known = [d > 0 for d in durations]
        self.fraction = [0.0] * self.n  # of each file: 1 once done, partial while its pieces finish
        self.excluded = [False] * self.n  # failed: not part of the total any more
        self.finished = self.failed = 0
        self.seconds = 0.0  # audio transcribed (of finished files)
        self.t0 = self.clock()
        self.t_work: float | None = None
        self.phase = ""
        self.quiet = quiet
        try:
            tty = self.stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        self.tty = not quiet and tty
        self.lines = not quiet and not tty
        self._lock = threading.RLock()
        self._shown = 0  # characters of the status line on screen
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._showwarning = None  # warnings.showwarning while ours routes warnings above the status line

    # ---- state ----
    def begin(self, phase: str) -> None:
        """The run starts: the status line and its refreshing thread (a terminal), or one line (a log)."""
        self.phase = phase
        if self.lines:
            total, known = self._total()
            audio = f", {_clock(total)} of audio" if known else ""
            self.message(f"transcribing {self.n} file(s){audio}; {phase}", status=False)
        if self.tty and self._ticker is None:
            import warnings

            self._showwarning = warnings.showwarning
            warnings.showwarning = self._warning  # library warnings (a truncated file, ...) above the status line
            self._ticker = threading.Thread(target=self._tick, name="glmasr-progress", daemon=True)
            self._ticker.start()
        self._render()

    def working(self, phase: str) -> None:
        """The model is loaded, the work starts (the time left is estimated from the rate since now)."""
        self.t_work = self.clock()
        self.phase = phase

    def loaded(self, i: int, seconds: float) -> None:
        self.durations[i], self.known[i] = seconds, True

    def partial(self, i: int, fraction: float) -> None:
        self.fraction[i] = fraction

    def done(self, i: int, seconds: float, path: Path) -> None:
        self.durations[i], self.known[i] = seconds, True
        self.fraction[i] = 1.0
        self.finished += 1
        self.seconds += seconds
        if self.lines:
            self.message(f"[{self.finished + self.failed}/{self.n}] {path}: {seconds:.1f} s of audio; "
                         f"{self._status(per_file=True)}", status=False)
        self._render()

    def failed_file(self, i: int) -> None:
        self.excluded[i] = True
        self.failed += 1

    # ---- figures ----
    def _total(self) -> tuple[float, bool]:
        """(seconds of audio in the run, whether every file's length is known)."""
        keep = [i for i in range(self.n) if not self.excluded[i]]
        return sum(self.durations[i] for i in keep), all(self.known[i] for i in keep)

    def _done_s(self) -> float:
        return sum(self.durations[i] * self.fraction[i] for i in range(self.n) if not self.excluded[i])

    def eta(self) -> float | None:
        """Seconds left, once a tenth of the audio is done (at the rate since the work started)."""
        total, known = self._total()
        if not known or total <= 0 or self.t_work is None:
            return None
        frac = self._done_s() / total
        if frac < ETA_MIN_FRACTION or frac >= 1.0:
            return None
        return (self.clock() - self.t_work) * (1.0 - frac) / frac

    def _status(self, per_file: bool = False) -> str:
        total, known = self._total()
        elapsed = self.clock() - self.t0
        parts = [] if per_file else [f"{self.finished}/{self.n} files"]
        if known and total > 0:
            parts.append(f"{_clock(self._done_s())} of {_clock(total)} audio ({100 * self._done_s() / total:.0f}%)")
        parts.append(f"{_clock(elapsed)} elapsed")
        eta = self.eta()
        if eta is not None:
            parts.append(f"about {_clock(eta)} left")
        if self.phase and not per_file:
            parts.append(self.phase)
        return ", ".join(parts)

    # ---- output ----
    def message(self, text: str, status: bool = True) -> None:
        """Print a line (or lines) on the stream, above the status line."""
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)
            if status:
                self._render(locked=True)

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self._shown = 0

    def _render(self, locked: bool = False) -> None:
        if not self.tty or self._stop.is_set():
            return
        with self._lock:
            width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
            line = f"glmasr: {self._status()}"[:width]
            self.stream.write("\r" + line + " " * max(0, self._shown - len(line)))
            self.stream.flush()
            self._shown = len(line)

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        import warnings

        self.message(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._render()

    def close(self) -> None:
        """Stop refreshing and clear the status line (the summary follows)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(2.0)
            self._ticker = None
        if self._showwarning is not None:
            import warnings

            warnings.showwarning, self._showwarning = self._showwarning, None
        with self._lock:
            self._clear()
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass
