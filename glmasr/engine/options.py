"""The engine's options: one frozen dataclass (its knobs, each validated), ``from_env`` reading the
``GLMASR_*`` variables of the engine (GLMASR_MAX_BATCH, GLMASR_ENCODER_CHUNK, GLMASR_SYNC_EVERY,
GLMASR_BATCH_INVARIANT) under explicit arguments, and ``resolved`` filling the device's defaults."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

DEFAULT_MAX_BATCH = {"cuda": 64, "cpu": 8}
DEFAULT_ENCODER_CHUNK = {"cuda": 32, "cpu": 4}
# Prompt positions prefilled in one forward pass (bounds the prefill's activation memory).
DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 65536, "cpu": 8192}

_ENV = {"max_batch": ("GLMASR_MAX_BATCH", int), "encoder_chunk": ("GLMASR_ENCODER_CHUNK", int),
        "sync_every": ("GLMASR_SYNC_EVERY", int),
        "batch_invariant": ("GLMASR_BATCH_INVARIANT", "flag")}


def check_positive_int(name: str, value, allow_none: bool = True) -> None:
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
            check_positive_int(name, getattr(self, name))
        check_positive_int("sync_every", self.sync_every, allow_none=False)
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
