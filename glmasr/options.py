"""Options: the per-request ``DecodeOptions`` (validated before any model work) and, re-exported, the engine's
``EngineOptions`` (``glmasr/engine/options.py``) and request classes ``Priority`` (``glmasr/engine/request.py``:
LIVE_FINAL 0, UPLOAD 1, BATCH 2, DRAFT 3; a lower value runs first, DRAFT is preemptible).

Environment variables (each overrides the default; an explicit argument overrides the variable), read where they
are used:

| variable | read by | meaning |
|---|---|---|
| GLMASR_MAX_BATCH | ``EngineOptions.from_env`` | sequence slots of the engine (default 64 on CUDA, 8 on the CPU) |
| GLMASR_ENCODER_CHUNK | ``EngineOptions.from_env`` | 30 s windows per encoder call (default 32 on CUDA, 4 on the CPU) |
| GLMASR_SYNC_EVERY | ``EngineOptions.from_env`` | decode steps between two host read-backs (default 8) |
| GLMASR_BATCH_INVARIANT | ``EngineOptions.from_env`` | 1: a request's tokens never depend on the requests beside it |
| GLMASR_AUDIO_THREADS | ``audio.resampler.threads`` | threads that decode and resample long audio (default: the usable CPUs, at most 8) |
| GLMASR_API_KEY | ``glmasr serve`` | the key it requires when ``--api-key`` is not given |
| GLMASR_CACHE_DIR | ``checkpoint.resources.cache_dir`` | the cache root (default $XDG_CACHE_HOME/glmasr or ~/.cache/glmasr): generated checkpoints; the log-mel cubins in its ``cubins/`` (read by ``kernels/logmel/_build.py`` itself) |
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .engine.options import EngineOptions, check_positive_int
from .engine.repetition import check_repetition_stop
from .engine.request import Priority

__all__ = ["DecodeOptions", "EngineOptions", "Priority", "SEGMENTATIONS"]

SEGMENTATIONS = ("windows", "vad")
MIN_SEGMENT_S = 1.0  # the shortest max_segment_s: a cue shorter than a second cannot hold a phrase


@dataclass(frozen=True)
class DecodeOptions:
    """Per-request decoding options. prompt: replaces the default instruction; max_new_tokens: token budget per
    prompt (default grows with the audio's duration); ignore_eos: decode exactly max_new_tokens (timing);
    repetition_stop: opt-in runaway guard, end a prompt's text once it repeats one n-gram this many times in a
    row over at least 16 tokens (finish_reason "repetition"; ``glmasr/engine/repetition.py``).
    forced_prefix_ids: token ids forced as the start of the answer (prefilled after the prompt; decoding continues
    after them; ``max_new_tokens`` counts only the tokens generated after them). Only for audio that forms one
    prompt group (else planning raises a ValueError naming the field); ids must lie in the model's vocabulary and
    not be its audio placeholder (checked at planning). The result's text and token ids include them.
    max_segment_s: with segmentation "vad", speech-shaped segments of at most that many seconds (1-30), cut at the
    longest pauses and never merged across a pause of 1 s or more, each its own prompt; None: speech packed into
    pieces of up to 30 s (the fewest prompts). word_timestamps: each segment's ``words`` with times from the model's
    aligner (``load(..., aligner=PATH)``); without an aligner the request is refused, never given made-up times.
    diarize: label each segment (and word) with its speaker (``glmasr.diarize``: needs ``glmasr[diarize]``), run
    beside the transcription; min_speakers / max_speakers: hints (1-26); known_speakers: {name: [16 kHz clips of
    2-10 s]} (at most 4 names), checked by ``glmasr.diarize.check_known`` when the request is submitted."""

    prompt: str | None = None
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    repetition_stop: int | None = None
    segmentation: str = "windows"  # "windows" (reference-exact) or "vad" (speech regions, <= 30 s pieces)
    forced_prefix_ids: tuple[int, ...] = ()
    max_segment_s: float | None = None
    word_timestamps: bool = False
    diarize: bool = False
    min_speakers: int | None = None
    max_speakers: int | None = None
    known_speakers: dict | None = field(default=None, compare=False)  # arrays: not compared

    def __post_init__(self):
        check_positive_int("max_new_tokens", self.max_new_tokens)
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise TypeError(f"prompt must be a string, got {type(self.prompt).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        check_repetition_stop(self.repetition_stop)
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {self.segmentation!r}")
        object.__setattr__(self, "forced_prefix_ids", check_token_ids("forced_prefix_ids", self.forced_prefix_ids))
        if self.max_segment_s is not None:
            if isinstance(self.max_segment_s, bool) or not isinstance(self.max_segment_s, numbers.Real):
                raise TypeError(f"max_segment_s must be a number of seconds or None, got "
                                f"{type(self.max_segment_s).__name__}")
            if not (MIN_SEGMENT_S <= float(self.max_segment_s) <= 30.0):
                raise ValueError(f"max_segment_s must be between {MIN_SEGMENT_S:g} and 30 seconds, got "
                                 f"{self.max_segment_s!r}")
            object.__setattr__(self, "max_segment_s", float(self.max_segment_s))
        if not isinstance(self.word_timestamps, bool):
            raise TypeError(f"word_timestamps must be True or False, got {self.word_timestamps!r}")
        if not isinstance(self.diarize, bool):
            raise TypeError(f"diarize must be True or False, got {self.diarize!r}")
        for name in ("min_speakers", "max_speakers"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= 26):
                raise ValueError(f"{name} must be an int from 1 to 26 or None, got {v!r}")
        if self.min_speakers is not None and self.max_speakers is not None and self.min_speakers > self.max_speakers:
            raise ValueError(f"min_speakers ({self.min_speakers}) must not exceed max_speakers ({self.max_speakers})")
        if not self.diarize and (self.min_speakers is not None or self.max_speakers is not None
                                 or self.known_speakers):
            raise ValueError("min_speakers, max_speakers and known_speakers need diarize=True")


def check_token_ids(name: str, ids) -> tuple[int, ...]:
    """``ids`` (a tuple or list of ints >= 0) as a tuple of ints; a TypeError / ValueError naming ``name``."""
    if not isinstance(ids, (tuple, list)):
        raise TypeError(f"{name} must be a tuple or list of token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int token id, got {type(t).__name__}")
        if t < 0:
            raise ValueError(f"{name}[{i}] must be a token id >= 0, got {t}")
        out.append(int(t))
    return tuple(out)
