"""Options: the engine's knobs (one dataclass, the one place ``GLMASR_*`` environment variables are read) and
the per-request decoding options, each validated before any model work.

Environment variables (each overrides the default; an explicit argument overrides the variable):

| variable | option | meaning |
|---|---|---|
| GLMASR_MAX_BATCH | max_batch | sequence slots of the engine (default 64 on CUDA, 8 on the CPU) |
| GLMASR_ENCODER_CHUNK | encoder_chunk | 30 s windows per encoder call (default 32 on CUDA, 4 on the CPU) |
| GLMASR_BATCH_INVARIANT | batch_invariant | 1: a request's tokens never depend on the requests beside it (slower; below) |
| GLMASR_AUDIO_THREADS | (``audio_threads()``) | threads that decode and resample long audio (default: the usable CPUs, at most 8) |
| GLMASR_API_KEY | (``api_key()``) | the key ``glmasr serve`` requires when ``--api-key`` is not given |
| GLMASR_CACHE_DIR | (``cache_dir()``) | the cache root (default $XDG_CACHE_HOME/glmasr or ~/.cache/glmasr): generated checkpoints; the log-mel cubins in its ``cubins/`` |

(The kernels, which import nothing from this package, read GLMASR_CACHE_DIR for their cubins themselves:
``kernels/logmel/_build.py``.)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .repetition import check_repetition_stop

DEFAULT_MAX_BATCH = {"cuda": 64, "cpu": 8}
DEFAULT_ENCODER_CHUNK = {"cuda": 32, "cpu": 4}
# Prompt positions prefilled in one forward pass (bounds the prefill's activation memory).
DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 65536, "cpu": 8192}
SEGMENTATIONS = ("windows", "vad")

_ENV = {"max_batch": ("GLMASR_MAX_BATCH", int), "encoder_chunk": ("GLMASR_ENCODER_CHUNK", int),
        "batch_invariant": ("GLMASR_BATCH_INVARIANT", "flag")}


def _positive_int(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs. ``None`` fields take the device's default in ``resolved``."""

    max_batch: int | None = None
    sync_every: int = 8  # decode steps between two host read-backs
    encoder_chunk: int | None = None
    max_prefill_tokens: int | None = None
    # Batch invariance: every request gets bit for bit what it would get alone, whatever runs beside it. Off, the
    # bf16 kernels pick their configs (and cuBLAS its algorithms) by the number of rows in a call, so a
    # near-tie between two tokens can go either way with the load. On: the encoder and its frontend run one
    # window per call, each prompt is prefilled alone on the path its own length picks, and the decode step runs
    # row-count-independent kernels (glmasr/models/fast_decoder.py). The cost is measured (benchmark.sh --only
    # invariant).
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("max_batch", "encoder_chunk", "max_prefill_tokens"):
            _positive_int(name, getattr(self, name))
        _positive_int("sync_every", self.sync_every, allow_none=False)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")

    @classmethod
    def from_env(cls, env=None, **overrides) -> "EngineOptions":
        """Defaults, then ``GLMASR_*`` variables, then the non-None ``overrides``."""
        env = os.environ if env is None else env
        values = {}
        for name, (var, kind) in _ENV.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            if kind == "flag":
                if raw not in ("0", "1"):
                    raise ValueError(f"environment variable {var} must be 0 or 1, got {raw!r}")
                values[name] = raw == "1"
            elif kind is int:
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"environment variable {var} must be an integer, got {raw!r}") from None
            else:
                values[name] = raw
        fields = {f.name for f in dataclasses.fields(cls)}
        for name, value in overrides.items():
            if name not in fields:
                raise TypeError(f"unknown engine option {name!r}; known: {sorted(fields)}")
            if value is not None:
                values[name] = value
        return cls(**values)

    def resolved(self, device_type: str) -> "EngineOptions":
        """These options with the device's defaults filled in."""
        kind = "cuda" if device_type == "cuda" else "cpu"
        return dataclasses.replace(
            self, max_batch=self.max_batch or DEFAULT_MAX_BATCH[kind],
            encoder_chunk=self.encoder_chunk or DEFAULT_ENCODER_CHUNK[kind],
            max_prefill_tokens=self.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS[kind])


def audio_threads() -> int | None:
    """$GLMASR_AUDIO_THREADS as a positive int, or None (unset or not a number: the audio module's default)."""
    env = os.environ.get("GLMASR_AUDIO_THREADS")
    try:
        return max(1, int(env)) if env else None
    except ValueError:
        return None


def api_key() -> str | None:
    """$GLMASR_API_KEY, or None when unset or empty."""
    return os.environ.get("GLMASR_API_KEY") or None


def cache_dir() -> Path:
    """User-writable cache root: $GLMASR_CACHE_DIR, else $XDG_CACHE_HOME/glmasr, else ~/.cache/glmasr."""
    env = os.environ.get("GLMASR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glmasr"


@dataclass(frozen=True)
class DecodeOptions:
    """Per-request decoding options. prompt: replaces the default instruction; max_new_tokens: token budget per
    prompt (default grows with the audio's duration); ignore_eos: decode exactly max_new_tokens (timing);
    repetition_stop: opt-in runaway guard, end a prompt's text once it repeats one n-gram this many times in a
    row over at least 16 tokens (finish_reason "repetition"; ``glmasr/repetition.py``)."""

    prompt: str | None = None
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    repetition_stop: int | None = None
    segmentation: str = "windows"  # "windows" (reference-exact) or "vad" (speech regions, <= 30 s pieces)

    def __post_init__(self):
        _positive_int("max_new_tokens", self.max_new_tokens)
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise TypeError(f"prompt must be a string, got {type(self.prompt).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        check_repetition_stop(self.repetition_stop)
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {self.segmentation!r}")
