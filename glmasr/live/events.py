"""What a ``LiveSession`` tells its owner: protocol-agnostic events (``emit(event)``, in protocol order) and the
metrics hook (``LiveMetrics``). A protocol layer (the OpenAI Realtime endpoint) renders each event as its wire
event; nothing here knows about a wire.

Order and linkage (``session.py`` keeps them):

- A turn found by turn detection: ``SpeechStarted(item)``, then (partials on) ``TranscriptDelta(item)``s of the
  agreed text, then ``SpeechStopped(item)`` and ``Committed(item, previous_item_id)`` at once, then the final's
  ``TranscriptDelta(item)``s and one ``TranscriptCompleted(item)`` or ``TranscriptFailed(item)``.
- A manual commit: ``Committed(item, previous)`` (partial deltas of that item may have come before it), then its
  deltas and its ``TranscriptCompleted``/``TranscriptFailed``.
- ``previous_item_id`` is the item committed just before (None for the session's first); finals of one session
  complete in commit order, so an item's ``TranscriptCompleted``/``TranscriptFailed`` comes after its
  predecessor's. The partial deltas of the next (still open) item may interleave with a final's deltas.
- For each item, the ``delta``s of its ``TranscriptDelta``s concatenate to its ``TranscriptCompleted.transcript``
  exactly (see ``LiveMetrics.on_mismatch`` for the one case that could break it).
- An open turn that is cleared (``clear``) or dropped (``update`` turning detection on) is never committed: the
  partial deltas it may have had are all there is of it.
- Times (``audio_start_ms``, ``audio_end_ms``) count from the first sample appended to the session (cleared audio
  included), like OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SessionEvent:
    """Base of the events a ``LiveSession`` emits."""


@dataclass(frozen=True)
class SpeechStarted(SessionEvent):
    """Turn detection found the start of a turn; ``audio_start_ms`` includes the prefix padding."""

    item_id: str
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped(SessionEvent):
    """Turn detection ended the turn at ``audio_end_ms`` (speech end + silence duration, or a forced cut of a
    turn that reached the maximum turn length); a ``Committed`` of the same item follows at once."""

    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class TimeoutTriggered(SessionEvent):
    """Turn detection's idle timeout: nothing was said between ``audio_start_ms`` and ``audio_end_ms``; that
    audio is committed as ``item_id`` (a ``Committed`` follows at once) and transcribed like any turn."""

    item_id: str
    audio_start_ms: int
    audio_end_ms: int


@dataclass(frozen=True)
class Committed(SessionEvent):
    """The audio of ``item_id`` was committed (one engine request); ``previous_item_id``: the item committed
    before it in this session (None for the first)."""

    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class Cleared(SessionEvent):
    """The uncommitted audio was dropped (``LiveSession.clear``)."""


@dataclass(frozen=True)
class TranscriptDelta(SessionEvent):
    """More text of ``item_id``: appended to what was sent before, never revising it."""

    item_id: str
    delta: str


@dataclass(frozen=True)
class TimedWord:
    """A word of a live final and its times in seconds from the session's first sample."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class TranscriptCompleted(SessionEvent):
    """The exact transcript of ``item_id`` (the concatenation of its deltas). ``usage``:
    ``{"type": "duration", "seconds": <committed audio seconds>}``."""

    item_id: str
    transcript: str
    usage: dict = field(default_factory=dict)
    words: list[TimedWord] | None = None  # with LiveSettings.word_timestamps: the words, seconds of the session


@dataclass(frozen=True)
class TranscriptFailed(SessionEvent):
    """The engine could not transcribe ``item_id``: ``code`` is the package's stable error code
    (``glmasr.errors.error_code``: "engine_error", "worker_died", "request_timeout", "shutting_down",
    "invalid_audio", ...), ``message`` says why. The session goes on with the next turn."""

    item_id: str
    code: str
    message: str


class LiveMetrics(Protocol):
    """The metrics hook a ``LiveSession`` calls (``metrics=`` argument; every method optional to implement: the
    session calls only the methods the object has). All calls come from the session's event loop thread.

    - ``on_audio(seconds)``: audio appended (16 kHz seconds, after decoding).
    - ``on_turn()``: a turn was committed (one final engine request).
    - ``on_draft(outcome)``: a partial-transcript draft: "sent" (submitted), "skipped" (the engine was full:
      ``num_pending >= slots``), "aborted" (a newer hop, the commit, a preemption by the engine, or the session's
      close stopped it), "failed" (the engine raised something else).
    - ``on_first_delta(seconds)``: from the end of the turn (the arrival of its last sample for a turn that turn
      detection stopped, the ``commit()`` call otherwise) to the first text the final sends (or its completion,
      when partials had already sent all of it).
    - ``on_completed(seconds)``: from the same instant to ``TranscriptCompleted``.
    - ``on_timings(timings_ms)``: the final's engine result's ``Transcription.timings_ms`` (once per engine request
      of the final), for a breakdown of where its time went.
    - ``on_failed(code)``: a ``TranscriptFailed`` was emitted.
    - ``on_forcing(changed)``: the forcing audit: a final forced to start with the agreed partial text was
      compared with an unforced decode of the same samples (run at draft priority when the engine had room);
      ``changed``: their texts differ.
    - ``on_mismatch()``: a final's text did not start with the text already sent for its item, so its deltas do
      not concatenate to its transcript (not expected to happen; also logged as a warning).
    """

    def on_audio(self, seconds: float) -> None: ...

    def on_turn(self) -> None: ...

    def on_draft(self, outcome: str) -> None: ...

    def on_first_delta(self, seconds: float) -> None: ...

    def on_completed(self, seconds: float) -> None: ...

    def on_timings(self, timings_ms: dict) -> None: ...

    def on_failed(self, code: str) -> None: ...

    def on_forcing(self, changed: bool) -> None: ...

    def on_mismatch(self) -> None: ...


DRAFT_OUTCOMES = ("sent", "skipped", "aborted", "failed")
