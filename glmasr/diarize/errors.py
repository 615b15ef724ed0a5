"""The diarization room's errors: defined in ``glmasr.errors`` (so ``errors.from_code`` knows their codes across
process boundaries) and re-exported here."""

from __future__ import annotations

from ..errors import DiarizationCancelled, DiarizationUnavailableError, InvalidSpeakerReference

__all__ = ["DiarizationCancelled", "DiarizationUnavailableError", "InvalidSpeakerReference"]
