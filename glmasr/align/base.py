"""The aligner interface: what ``GlmAsr`` calls to give a finished transcript's segments their word times.

An aligner gets each segment's own samples (16 kHz mono float32, the stretch of the recording the segment's
prompt decoded), where it starts in the recording and its final text, and returns that text's words with times
in seconds of the recording, within the segment. It never invents a time: a word it cannot place is not guessed
(a segment it cannot align at all gets no words, ``[]``). Only the CTC head (``CtcAligner``) is built; a user's
own forced aligner plugs in by implementing this class and passing the instance as ``glmasr.load(...,
aligner=instance)``.

``bind(model)`` is called once by ``glmasr.load`` with the loaded model (``models.interface.AsrModel``), before
any ``align``; ``align`` may then be called from many threads at once (each job's result path runs in its
caller's thread). ``GlmAsr.close`` drops the handle's reference; jobs still finishing keep theirs, so an aligner
is freed with the last of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..results import Word


@dataclass
class AlignSegment:
    """One segment to align: ``samples`` its audio (16 kHz mono float32, may be a view into the recording),
    ``start_s`` where that audio starts in the recording, ``text`` the segment's transcript."""

    samples: np.ndarray
    start_s: float
    text: str

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / 16000


class Aligner(ABC):
    """Word times for transcribed segments; see the module docstring."""

    name: str = "aligner"

    def bind(self, model) -> None:
        """Called once with the loaded ASR model (``AsrModel``) before any ``align``; default: nothing."""

    @abstractmethod
    def align(self, segments: Sequence[AlignSegment]) -> list[list[Word]]:
        """Words of each segment (same order): times in seconds of the recording, each word inside its segment
        (``start_s <= word.start <= word.end <= start_s + duration_s``), words in order, not overlapping."""
