"""A live transcription session, protocol-agnostic: 16 kHz audio in, ``events`` out, over an ``EngineClient``.

    s = LiveSession(client, prompts, vads, LiveSettings(...), LiveLimits(...), emit, metrics=None)
    s.append(x16)            # float32 16 kHz mono samples (after ``audio.stream.StreamDecoder``)
    item_id = s.commit()     # manual commit of the uncommitted audio
    s.clear()                # drop the uncommitted audio
    s.update(settings)       # new settings (best between turns)
    await s.aclose()         # aborts every engine request the session holds

Everything runs in one asyncio event loop: call the methods from it; ``emit(event)`` is called in it, in protocol
order (``glmasr.live.events`` says the order and the linkage).

Turns. With ``settings.turn_detection`` (a ``TurnSettings``), the session feeds the audio to its ``VadStream``
and turns the ``TurnDetector``'s events into ``SpeechStarted`` / ``SpeechStopped`` + ``Committed``; a turn's audio
is [started.sample, stopped.sample). Audio outside turns is kept only as far back as the prefix padding can
reach. A manual ``commit()`` or ``clear()`` restarts turn detection at that point (``TurnDetector.reset``: its
open turn is dropped; if the person goes on speaking, a new turn starts there). With
``turn_detection=None`` only ``commit()`` ends a turn: the turn is all audio appended since the last commit.

Finals. Each committed turn is one engine request (``Priority.LIVE_FINAL``, streamed) on exactly its samples with
``DecodeOptions(prompt=live_instruction(...))``; finals of one session run one after another in commit order (the
next one's context is the previous one's transcript). Their text goes out as ``TranscriptDelta``s as the engine's
deltas arrive, trailing whitespace held back, so the deltas concatenate to the ``TranscriptCompleted`` transcript
exactly; with partials off, that transcript is what ``transcribe()`` gives for the same samples and prompt (same
engine). An engine error gives ``TranscriptFailed`` and the session goes on.

Partials (``settings.partials``). Every ``partial_hop_s`` of new audio in an open turn (of at most 30 s: one prompt
group), one ``Priority.DRAFT`` request (not streamed) on the turn so far, forced to start with the ids agreed so
far; at most one in flight per session: a newer hop aborts a stale draft, and a hop is skipped while the engine is
full (``client.num_pending >= client.slots``). Until the turn has agreed text, drafts come every half hop (the first
at one hop; a half-hop one is not sent while another is in flight): the first words need two drafts, so they show
~1.5 hops into the turn rather than ~2; from the first agreement on, a draft every hop. ``agreement.agree``
(LocalAgreement-2) over the last two drafts' token ids extends the agreed prefix; its new text goes out at once as a
``TranscriptDelta``. The final is submitted with ``forced_prefix_ids`` = the agreed ids, so what was sent is never
retracted. (A manual turn longer than 30 s with agreed text is finalized as two requests, the first 30 s forced and
the rest, joined with a space like the groups of one request.) Forcing audit: after a forced final, when a metrics
hook wants it (``on_forcing``) and the engine has room, an unforced decode of the same samples at ``Priority.DRAFT``
tells whether forcing changed the text.

Context (``settings.context``): the previous turn's transcript (its last ``CONTEXT_CHARS`` characters) goes into
the instruction, after the prompt and before the hotwords: ``{prompt}\\nContext: {text}\\nHotwords: a, b``
(``live_instruction``; the same prompt slot ``checkpoint.tokenizer.build_instruction`` fills with hotwords).

Limits (``LiveLimits``): ``append`` raises ``LiveLimitError`` past ``max_buffer_s`` of uncommitted audio
("buffer_too_large") or ``max_session_s`` of audio in all ("session_too_long"), without taking the audio;
``check_idle()`` raises it ("idle_timeout") once nothing was appended for ``idle_s`` (the owner decides what to
do: ``idle_deadline`` says when). ``commit()`` of less than 100 ms raises ``EmptyBuffer``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..audio import Audio
from ..audio.features import SAMPLE_RATE
from ..audio.vad import WINDOW as VAD_WINDOW
from ..checkpoint.tokenizer import ASSISTANT, AUDIO_TOKEN, BEGIN_AUDIO, END_AUDIO, USER, build_instruction
from ..errors import GlmAsrError, RequestPreempted, error_code
from ..options import DecodeOptions, Priority
from . import events as ev
from .agreement import agree, agreed_text
from .turns import TurnDetector, TurnSettings

log = logging.getLogger("glmasr.live")

MAX_DRAFT_S = 30.0  # drafts and forced prefixes need the audio to be one prompt group (one 30 s window)
MIN_COMMIT_MS = 100  # a manual commit needs at least this much audio (OpenAI's rule)
CONTEXT_CHARS = 200  # of the previous transcript, in the next turn's instruction
VAD_KEEP_S = 1.0  # audio kept outside turns, behind the VAD's position, beyond the prefix padding


class LiveError(GlmAsrError):
    """A live session refused a call; ``code`` says why (stable), the message names the limit or problem."""

    code = "live_error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class LiveLimitError(LiveError):
    """A ``LiveLimits`` bound was reached: "buffer_too_large", "session_too_long" or "idle_timeout"."""

    code = "live_limit"


class EmptyBuffer(LiveError):
    """``commit()`` with less than ``MIN_COMMIT_MS`` of uncommitted audio."""

    code = "input_audio_buffer_commit_empty"


class SessionClosed(LiveError):
    """The session was closed (``aclose``)."""

    code = "session_closed"


def _check_seconds(name: str, value, low: float | None = None, high: float | None = None,
                   allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must lie in [{low:g}, {high:g}] seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LiveSettings:
    """A session's settings (validated: ValueError/TypeError naming the field).

    prompt: the instruction (None: the checkpoint's default); language: an ISO-639-1 code, kept for the protocol
    (GLM-ASR has no language token: it is not given to the model); keywords: hotwords, folded into the
    instruction; turn_detection: ``TurnSettings`` (server VAD) or None (only ``commit()`` ends a turn); partials:
    send agreed partial text while a turn is open (drafts every ``partial_hop_s``, 0.1-30 s); context: give the
    previous turn's transcript to the next turn's instruction; word_timestamps: each final also gets its words
    with times in seconds of the session (the engine's aligner; the owner checks that one exists)."""

    prompt: str | None = None
    language: str | None = None
    keywords: tuple[str, ...] = ()
    turn_detection: TurnSettings | None = field(default_factory=TurnSettings)
    partials: bool = False
    partial_hop_s: float = 1.0
    context: bool = True
    word_timestamps: bool = False

    def __post_init__(self):
        for name in ("prompt", "language"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name} must be a string or None, got {type(v).__name__}")
        if isinstance(self.keywords, str) or not isinstance(self.keywords, (tuple, list)):
            raise TypeError(f"keywords must be a list of strings, got {type(self.keywords).__name__}")
        if any(not isinstance(w, str) or not w.strip() for w in self.keywords):
            raise ValueError("keywords must be non-empty strings")
        object.__setattr__(self, "keywords", tuple(self.keywords))
        if self.turn_detection is not None and not isinstance(self.turn_detection, TurnSettings):
            raise TypeError(f"turn_detection must be a TurnSettings or None, got "
                            f"{type(self.turn_detection).__name__}")
        for name in ("partials", "context", "word_timestamps"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "partial_hop_s", _check_seconds("partial_hop_s", self.partial_hop_s, 0.1, 30.0))


@dataclass(frozen=True)
class LiveLimits:
    """Bounds of one session: ``max_session_s`` of audio in all (None: none), ``max_buffer_s`` of uncommitted
    audio, ``idle_s`` without any audio appended (None: none; enforced by the owner through ``check_idle``)."""

    max_session_s: float | None = 3600.0
    max_buffer_s: float = 60.0
    idle_s: float | None = 300.0

    def __post_init__(self):
        object.__setattr__(self, "max_session_s", _check_seconds("max_session_s", self.max_session_s,
                                                                 allow_none=True))
        object.__setattr__(self, "max_buffer_s", _check_seconds("max_buffer_s", self.max_buffer_s))
        object.__setattr__(self, "idle_s", _check_seconds("idle_s", self.idle_s, allow_none=True))


_SPECIAL_TEXT = (USER, ASSISTANT, BEGIN_AUDIO, END_AUDIO, AUDIO_TOKEN)


def context_text(transcript: str | None, limit: int = CONTEXT_CHARS) -> str:
    """What of a previous transcript goes into the next instruction: its last ``limit`` characters (cut at a
    space when there is one), without the prompt's special-token strings, whitespace collapsed."""
    if not transcript:
        return ""
    text = transcript
    for s in _SPECIAL_TEXT:
        text = text.replace(s, " ")
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[-limit:]
        cut = text.find(" ")
        if 0 <= cut < len(text) - 1:
            text = text[cut + 1:]
    return text


def live_instruction(prompt: str | None, keywords, context: str | None, default_prompt: str) -> str | None:
    """The instruction of a live turn: ``prompt`` (or ``default_prompt``), then ``\\nContext: {context}`` when
    there is context (``context_text`` of the previous transcript), then the hotwords (``build_instruction``).
    None when there is nothing to add (the checkpoint's default instruction)."""
    ctx = context_text(context)
    base = prompt
    if ctx:
        base = f"{default_prompt if prompt is None else prompt}\nContext: {ctx}"
    return build_instruction(base, list(keywords), default_prompt)


class _Buffer:
    """The session's audio from absolute sample ``start`` to ``end`` (samples since the session began)."""

    def __init__(self):
        self._data = np.empty(SAMPLE_RATE * 4, np.float32)
        self._lo = 0  # index of ``start`` in _data
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, x: np.ndarray) -> None:
        n, size = x.shape[0], self.end - self.start
        if self._lo + size + n > self._data.shape[0]:
            cap = self._data.shape[0]
            while size + n > cap // 2:
                cap *= 2
            data = np.empty(cap, np.float32) if cap != self._data.shape[0] else self._data
            data[:size] = self._data[self._lo:self._lo + size]
            self._data, self._lo = data, 0
        self._data[self._lo + size:self._lo + size + n] = x
        self.end += n

    def slice(self, a: int, b: int) -> np.ndarray:
        """A copy of samples [a, b) (clamped to what is kept)."""
        a, b = max(a, self.start), min(b, self.end)
        return self._data[self._lo + a - self.start:self._lo + max(a, b) - self.start].copy()

    def drop_before(self, a: int) -> None:
        a = min(max(a, self.start), self.end)
        self._lo += a - self.start
        self.start = a
        if self.start == self.end:
            self._lo = 0


class _Item:
    """One turn: open (audio still coming), then committed (its final runs)."""

    def __init__(self, start: int):
        self.item_id = f"item_{secrets.token_hex(10)}"
        self.start = start  # absolute sample
        self.end: int | None = None  # set at commit
        self.next_hop = 0  # samples since start at which the next draft is due
        self.last_draft: list[int] | None = None  # token ids of the latest draft
        self.agreed: list[int] = []  # LocalAgreement-2's ids (the final is forced to start with them)
        self.sent = ""  # text sent as deltas so far
        self.draft: asyncio.Task | None = None
        self.t_end: float | None = None  # monotonic instant the turn ended (for the latency metrics)
        self.first_delta_measured = False


class LiveSession:
    """See the module docstring. ``client``: a ``workers.engine_client.EngineClient``; ``prompts``: the
    checkpoint's ``PromptBuilder`` (its ``decode`` and ``default_prompt``); ``vads``: the server's
    ``live.vad_stream.VadStreams`` (may be None when turn detection stays off); ``emit(event)``: called in the
    event loop for each ``events.SessionEvent``; ``metrics``: an ``events.LiveMetrics`` or None."""

    def __init__(self, client, prompts, vads, settings: LiveSettings | None = None,
                 limits: LiveLimits | None = None, emit=None, metrics=None):
        self.client = client
        self.prompts = prompts
        self.vads = vads
        self.settings = LiveSettings() if settings is None else settings
        self.limits = LiveLimits() if limits is None else limits
        if not isinstance(self.settings, LiveSettings):
            raise TypeError(f"settings must be a LiveSettings, got {type(self.settings).__name__}")
        if not isinstance(self.limits, LiveLimits):
            raise TypeError(f"limits must be a LiveLimits, got {type(self.limits).__name__}")
        self._emit_fn = emit or (lambda event: None)
        self.metrics = metrics
        self._buf = _Buffer()
        self._arrivals: deque[tuple[int, float]] = deque()  # (end sample of an append, monotonic time)
        self._commit_pos = 0  # audio before this is committed or cleared
        self._turn: _Item | None = None
        self._last_item_id: str | None = None
        self._context: str | None = None  # the previous final's transcript
        self._finals: asyncio.Task | None = None  # the last final's task (each awaits the one before)
        self._tasks: set[asyncio.Task] = set()
        self._held: set = set()  # engine requests in flight
        self._submitting: set = set()  # executor futures of submits in progress
        self._audit: asyncio.Task | None = None
        self._closed = False
        self._last_append = time.monotonic()
        self._vad_stream = None
        self._vad_token = 0
        self._vad_offset = 0
        self._vad_done = 0  # absolute sample up to which VAD probabilities have come
        self._detector = None
        self._check_vads(self.settings)
        self._open_vad()

    # ---------------------------------------------------------------- public API
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered_s(self) -> float:
        """Seconds of audio not yet committed (that the session keeps)."""
        return (self._buf.end - max(self._commit_pos, self._buf.start)) / SAMPLE_RATE

    @property
    def total_s(self) -> float:
        """Seconds of audio appended since the session began."""
        return self._buf.end / SAMPLE_RATE

    @property
    def idle_deadline(self) -> float | None:
        """``time.monotonic()`` instant at which ``check_idle`` raises (None: no idle limit)."""
        return None if self.limits.idle_s is None else self._last_append + self.limits.idle_s

    def check_idle(self, now: float | None = None) -> None:
        """Raise ``LiveLimitError("idle_timeout")`` when no audio was appended for ``limits.idle_s``."""
        deadline = self.idle_deadline
        now = time.monotonic() if now is None else now
        if deadline is not None and now >= deadline:
            raise LiveLimitError(f"no audio was received for {self.limits.idle_s:g} s (the session's idle "
                                 f"timeout)", "idle_timeout")

    def update(self, settings: LiveSettings) -> None:
        """New settings. Prompt, keywords and context apply to the next request; turning partials off aborts the
        draft in flight. A new ``turn_detection`` restarts turn detection from here: a turn that detection had
        opened is committed as it stands (``SpeechStopped`` + ``Committed``) when detection changes, and becomes
        the manual turn when it goes off; the uncommitted audio of a manual turn is left out of turn detection
        when it comes on (commit it first to keep it)."""
        self._check_open()
        if not isinstance(settings, LiveSettings):
            raise TypeError(f"settings must be a LiveSettings, got {type(settings).__name__}")
        self._check_vads(settings)
        old, self.settings = self.settings, settings
        if not settings.partials:
            self._abort_draft()
        if settings.turn_detection != old.turn_detection:
            self._close_vad()
            if settings.turn_detection is not None:
                if self._turn is not None and old.turn_detection is not None:
                    self._end_turn_here()
                self._drop_turn()
                self._commit_pos = max(self._commit_pos, self._buf.end)
                self._open_vad()

    def append(self, samples) -> None:
        """Take 16 kHz mono float32 samples. Raises ``LiveLimitError`` (the audio is not taken) past
        ``max_buffer_s`` of uncommitted audio or ``max_session_s`` in all; ValueError on samples that are not a
        1-D array of finite floats."""
        self._check_open()
        x = np.asarray(samples)
        if x.ndim != 1 or x.dtype.kind != "f":
            raise ValueError(f"audio must be a 1-D array of float samples at 16 kHz, got shape {x.shape} and "
                             f"dtype {x.dtype}")
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise ValueError("audio samples must be finite (no NaN or inf)")
        n = x.shape[0]
        if n == 0:
            return
        limits = self.limits
        if limits.max_session_s is not None and self._buf.end + n > limits.max_session_s * SAMPLE_RATE:
            raise LiveLimitError(f"the session reached its maximum length of {limits.max_session_s:g} s of audio",
                                 "session_too_long")
        uncommitted = self._buf.end - max(self._commit_pos, self._buf.start)
        if uncommitted + n > limits.max_buffer_s * SAMPLE_RATE:
            raise LiveLimitError(f"the uncommitted audio would exceed the limit of {limits.max_buffer_s:g} s "
                                 f"(max buffered audio); commit or clear it", "buffer_too_large")
        if self.settings.turn_detection is None and self._turn is None:  # the manual turn: all uncommitted audio
            self._turn = _Item(max(self._commit_pos, self._buf.start))
        self._last_append = now = time.monotonic()
        self._buf.append(x)
        self._arrivals.append((self._buf.end, now))
        self._metric("on_audio", n / SAMPLE_RATE)
        if self._vad_stream is not None:
            self._vad_stream.push(x)
        self._trim()
        self._maybe_draft()

    def commit(self) -> str:
        """Commit the uncommitted audio (an open turn's, with turn detection) as one item; returns its id. Raises
        ``EmptyBuffer`` with less than 100 ms of it."""
        self._check_open()
        start = self._turn.start if self._turn is not None else max(self._commit_pos, self._buf.start)
        n = self._buf.end - start
        if n < MIN_COMMIT_MS * SAMPLE_RATE // 1000:
            raise EmptyBuffer(f"the input audio buffer holds {1e3 * max(n, 0) / SAMPLE_RATE:.0f} ms of audio; a "
                              f"commit needs at least {MIN_COMMIT_MS} ms", "input_audio_buffer_commit_empty")
        item = self._turn or _Item(start)
        self._turn = None
        item.t_end = time.monotonic()
        self._commit(item, self._buf.end)
        self._reset_detector()
        return item.item_id

    def clear(self) -> None:
        """Drop the uncommitted audio (and an open turn: its draft is aborted, it is never committed); emits
        ``Cleared``."""
        self._check_open()
        self._drop_turn()
        self._commit_pos = self._buf.end
        self._buf.drop_before(self._buf.end)
        self._emit(ev.Cleared())
        self._reset_detector()

    async def flush(self) -> None:
        """Wait until every final committed so far has completed (or failed) and no draft or audit runs."""
        while True:
            tasks = [t for t in self._tasks if not t.done()]
            if not tasks:
                return
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Abort every engine request the session holds and stop its tasks; nothing keeps running. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_vad()
        self._drop_turn()
        for req in list(self._held):
            req.abort()
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._submitting:  # submits still in their threads: abort what they return
            await asyncio.gather(*list(self._submitting), return_exceptions=True)
        for req in list(self._held):
            req.abort()
        self._held.clear()

    # ---------------------------------------------------------------- internals: events, metrics
    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("the live session is closed", "session_closed")

    def _check_vads(self, settings: LiveSettings) -> None:
        if settings.turn_detection is not None and self.vads is None:
            raise ValueError("turn_detection needs the server's VadStreams (this session has vads=None)")

    def _emit(self, event) -> None:
        try:
            self._emit_fn(event)
        except Exception:  # the owner's problem (a closed socket, say): the session's state must stay whole
            log.exception("live session: emit(%s) failed", type(event).__name__)

    def _metric(self, name: str, *args) -> None:
        fn = getattr(self.metrics, name, None) if self.metrics is not None else None
        if fn is not None:
            try:
                fn(*args)
            except Exception:
                log.exception("live session: metrics.%s failed", name)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def _ms(sample: int) -> int:
        return sample * 1000 // SAMPLE_RATE  # whole milliseconds, as TurnEvent.ms

    def _arrival(self, sample: int) -> float:
        """When the audio up to ``sample`` had arrived (monotonic)."""
        for end, t in self._arrivals:
            if end >= sample:
                return t
        return time.monotonic()

    def _decode(self, ids: list[int]) -> str:
        return self.prompts.decode(ids)

    def _instruction(self) -> str | None:
        s = self.settings
        return live_instruction(s.prompt, s.keywords, self._context if s.context else None,
                                self.prompts.default_prompt)

    # ---------------------------------------------------------------- internals: turn detection
    def _open_vad(self) -> None:
        td = self.settings.turn_detection
        if td is None:
            return
        self._vad_token += 1
        token = self._vad_token
        self._detector = TurnDetector(td)
        self._vad_offset = self._vad_done = self._buf.end
        self._vad_stream = self.vads.open(lambda first, probs: self._on_probs(token, first, probs),
                                          lambda exc: self._on_vad_error(token, exc))

    def _close_vad(self) -> None:
        stream, self._vad_stream, self._detector = self._vad_stream, None, None
        self._vad_token += 1
        if stream is not None:
            stream.close()

    def _reset_detector(self) -> None:
        """After a manual commit or a clear: the detector's open turn is dropped (the session's is gone) and its
        next turn starts here."""
        if self._detector is not None:
            self._detector.reset(self._buf.end - self._vad_offset)

    def _on_vad_error(self, token: int, exc: BaseException) -> None:
        """The VAD network failed on this stream's windows (the stream is closed): an open turn is committed as it
        stands, and turn detection starts afresh from here."""
        if token != self._vad_token or self._closed:
            return
        log.error("live session: turn detection failed (%r); restarting it", exc)
        self._end_turn_here()
        self._close_vad()
        self._open_vad()

    def _end_turn_here(self) -> None:
        """Stop and commit the turn that detection opened at the end of the audio (a turn too short for the model
        completes with an empty transcript)."""
        item, self._turn = self._turn, None
        if item is not None:
            item.t_end = time.monotonic()
            self._emit(ev.SpeechStopped(item.item_id, self._ms(self._buf.end)))
            self._commit(item, self._buf.end)

    def _on_probs(self, token: int, first: int, probs) -> None:
        if token != self._vad_token or self._closed:
            return  # a stream closed meanwhile (commit, clear, update)
        det = self._detector
        self._vad_done = max(self._vad_done, self._vad_offset + (first + len(probs)) * VAD_WINDOW)
        events = list(det.feed(first, probs))
        events += det.idle(self._vad_done - self._vad_offset)
        for e in events:
            if token != self._vad_token or self._closed:
                return
            self._on_turn_event(e)
        self._trim()
        self._maybe_draft()

    def _on_turn_event(self, e) -> None:
        sample = min(self._vad_offset + e.sample, self._buf.end)
        if e.kind == "started":
            if self._turn is None:
                self._turn = _Item(max(sample, self._commit_pos, self._buf.start))
                self._emit(ev.SpeechStarted(self._turn.item_id, self._ms(self._turn.start)))
        elif e.kind == "stopped":
            item = self._turn
            if item is None:
                return
            self._turn = None
            end = max(sample, item.start)
            item.t_end = self._arrival(end)
            self._emit(ev.SpeechStopped(item.item_id, self._ms(end)))
            self._commit(item, end)
        elif e.kind == "timeout":  # nothing said for idle_timeout_ms: that stretch is committed (what is kept of it)
            if self._turn is not None:
                return
            idle = round(self.settings.turn_detection.idle_timeout_ms * SAMPLE_RATE / 1000)
            item = _Item(max(self._commit_pos, self._buf.start))
            end = max(sample, item.start)
            item.t_end = self._arrival(end)
            self._emit(ev.TimeoutTriggered(item.item_id, self._ms(max(0, sample - idle)), self._ms(end)))
            self._commit(item, end)

    def _trim(self) -> None:
        """Forget audio no turn can still claim."""
        if self._turn is not None:
            keep = self._turn.start
        elif self.settings.turn_detection is not None:
            reach = self.settings.turn_detection.prefix_padding_ms / 1000 + VAD_KEEP_S
            keep = max(self._commit_pos, self._vad_done - int(reach * SAMPLE_RATE))
        else:
            keep = self._commit_pos
        self._buf.drop_before(keep)
        while len(self._arrivals) > 1 and self._arrivals[1][0] <= self._buf.start:
            self._arrivals.popleft()

    def _drop_turn(self) -> None:
        if self._turn is not None:
            self._abort_draft()
            self._turn = None

    # ---------------------------------------------------------------- internals: engine requests
    async def _submit(self, samples: np.ndarray, decode: DecodeOptions, priority: int, stream: bool,
                      item_id: str):
        """Submit in a worker thread (planning is the caller's work); the request is held until ``_release``."""
        self._check_open()
        audio = Audio(samples, f"live item {item_id}")
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: self.client.submit(audio, decode, time.perf_counter(), 0.0, None,
                                                                    stream, priority=priority))
        self._submitting.add(fut)
        fut.add_done_callback(self._submitting.discard)
        try:
            req = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().abort())
            raise
        self._held.add(req)
        if self._closed:
            req.abort()
            raise asyncio.CancelledError()
        try:
            await req.started()
        except BaseException:
            self._release(req)
            raise
        return req

    def _release(self, req) -> None:
        req.abort()  # a no-op once it finished
        self._held.discard(req)

    # ---------------------------------------------------------------- internals: finals
    def _commit(self, item: _Item, end: int) -> None:
        item.end = end
        self._abort_draft(item)
        samples = self._buf.slice(item.start, end)
        self._commit_pos = max(self._commit_pos, end)
        previous, self._last_item_id = self._last_item_id, item.item_id
        self._emit(ev.Committed(item.item_id, previous))
        self._metric("on_turn")
        self._finals = self._spawn(self._run_final(item, samples, self._finals))
        self._trim()

    async def _run_final(self, item: _Item, samples: np.ndarray, before: asyncio.Task | None) -> None:
        if before is not None:
            await asyncio.wait([before])  # in commit order; its outcome is its own
        try:
            transcript = await self._final(item, samples)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's answer (timeout, dead worker, fault, shutdown)
            code = error_code(e)
            self._context = None
            log.info("live session: transcription of %s failed (%s: %s)", item.item_id, code, e)
            self._metric("on_failed", code)
            self._emit(ev.TranscriptFailed(item.item_id, code, str(e) or type(e).__name__))
            return
        self._context = transcript

    async def _final(self, item: _Item, samples: np.ndarray) -> str:
        seconds = samples.shape[0] / SAMPLE_RATE
        words: list = []
        prompt = self._instruction()
        if samples.shape[0] < MIN_COMMIT_MS * SAMPLE_RATE // 1000:
            transcript = ""  # a turn too short for the model (a detector edge case): nothing can come of it
        else:
            parts = [(samples, item.agreed)]
            limit = int(MAX_DRAFT_S * SAMPLE_RATE)
            if item.agreed and samples.shape[0] > limit:
                parts = [(samples[:limit], item.agreed), (samples[limit:], [])]
            reqs = []
            try:
                for x, prefix in parts:
                    decode = DecodeOptions(prompt=prompt, forced_prefix_ids=tuple(prefix),
                                           word_timestamps=self.settings.word_timestamps)
                    reqs.append(await self._submit(x, decode, Priority.LIVE_FINAL, True, item.item_id))
                texts: list[str] = []
                offset = item.start / SAMPLE_RATE  # the part's first sample, in seconds of the session
                for req in reqs:
                    base = " ".join(t for t in texts if t)
                    streamed, result = "", None
                    async for d in req.adeltas():
                        streamed += d.text
                        if d.finished:
                            result = d.result
                        sep = " " if base and streamed.strip() else ""
                        self._send(item, (base + sep + streamed).rstrip())
                    if result is None:
                        raise RuntimeError(f"the transcription of {item.item_id} was aborted")
                    self._metric("on_timings", result.timings_ms)
                    texts.append(result.text)
                    if self.settings.word_timestamps:
                        words += [ev.TimedWord(w.word, offset + w.start, offset + w.end)
                                  for seg in result.segments for w in (seg.words or [])]
                    offset += result.duration_s
            finally:
                for req in reqs:
                    self._release(req)
            transcript = " ".join(t for t in texts if t)
            if item.agreed and len(parts) == 1:
                self._start_audit(item, samples, prompt, transcript)
        if transcript.startswith(item.sent):
            self._send(item, transcript)
        else:
            log.warning("live session: the final transcript of %s does not start with the text already sent "
                        "(%r vs %r); its deltas do not add up to it", item.item_id, transcript, item.sent)
            self._metric("on_mismatch")
        self._first_delta(item)
        if item.t_end is not None:
            self._metric("on_completed", time.monotonic() - item.t_end)
        self._emit(ev.TranscriptCompleted(item.item_id, transcript, {"type": "duration", "seconds": seconds},
                                          words if self.settings.word_timestamps else None))
        return transcript

    def _send(self, item: _Item, text: str) -> None:
        """Send what ``text`` adds to what was sent (when it extends it; else wait for the final)."""
        if len(text) > len(item.sent) and text.startswith(item.sent):
            delta, item.sent = text[len(item.sent):], text
            if item.end is not None:
                self._first_delta(item)
            self._emit(ev.TranscriptDelta(item.item_id, delta))

    def _first_delta(self, item: _Item) -> None:
        if not item.first_delta_measured and item.t_end is not None:
            item.first_delta_measured = True
            self._metric("on_first_delta", time.monotonic() - item.t_end)

    def _start_audit(self, item: _Item, samples: np.ndarray, prompt: str | None, forced: str) -> None:
        if getattr(self.metrics, "on_forcing", None) is None or self._closed:
            return
        if self._audit is not None and not self._audit.done():
            return
        if self.client.num_pending >= self.client.slots:
            return
        self._audit = self._spawn(self._run_audit(item, samples, prompt, forced))

    async def _run_audit(self, item: _Item, samples: np.ndarray, prompt: str | None, forced: str) -> None:
        req = None
        try:
            req = await self._submit(samples, DecodeOptions(prompt=prompt), Priority.DRAFT, False, item.item_id)
            result = await req.aresult()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - preempted, or any failure: no measurement
            log.debug("live session: forcing audit of %s did not run (%s)", item.item_id, e)
            return
        finally:
            if req is not None:
                self._release(req)
        self._metric("on_forcing", result.text != forced)

    # ---------------------------------------------------------------- internals: partials
    @property
    def _hop_samples(self) -> int:
        return round(self.settings.partial_hop_s * SAMPLE_RATE)

    def _maybe_draft(self) -> None:
        item = self._turn
        if not self.settings.partials or item is None or self._closed:
            return
        n = self._buf.end - item.start
        hop = self._hop_samples
        due = max(item.next_hop, hop)
        if n < due:
            return
        # A turn's first words need two drafts that agree, so until some text is agreed drafts come every half
        # hop (the first at one hop): its first words show ~1.5 hops into the turn, not ~2; then every hop.
        step = hop if item.agreed else max(1, hop // 2)
        item.next_hop = due + ((n - due) // step + 1) * step
        if n > MAX_DRAFT_S * SAMPLE_RATE:
            return  # the turn outgrew one prompt group: its agreed prefix stays where it is
        if not item.agreed and (n // hop) * hop < due and item.draft is not None and not item.draft.done():
            return  # a half-hop draft never aborts one in flight (under load they would abort each other)
        self._abort_draft(item)
        if self.client.num_pending >= self.client.slots:
            self._metric("on_draft", "skipped")
            return
        samples = self._buf.slice(item.start, self._buf.end)
        self._metric("on_draft", "sent")
        item.draft = self._spawn(self._run_draft(item, samples, tuple(item.agreed)))

    def _abort_draft(self, item: _Item | None = None) -> None:
        item = item or self._turn
        if item is not None and item.draft is not None:
            task, item.draft = item.draft, None
            if not task.done():
                task.cancel()
                self._metric("on_draft", "aborted")

    async def _run_draft(self, item: _Item, samples: np.ndarray, prefix: tuple[int, ...]) -> None:
        req = None
        try:
            req = await self._submit(samples, DecodeOptions(prompt=self._instruction(), forced_prefix_ids=prefix),
                                     Priority.DRAFT, False, item.item_id)
            result = await req.aresult()
        except RequestPreempted:
            self._metric("on_draft", "aborted")
            return
        except Exception as e:  # noqa: BLE001 - a draft is optional work: its failure is counted, not raised
            log.debug("live session: a draft of %s failed (%s: %s)", item.item_id, error_code(e), e)
            self._metric("on_draft", "failed")
            return
        finally:
            if req is not None:
                self._release(req)
        if item.end is not None or item is not self._turn:
            return  # committed or dropped meanwhile
        previous, item.last_draft = item.last_draft, list(result.token_ids)
        if previous is None:
            return
        agreed = agree(previous, item.last_draft, item.agreed, self._decode)
        if len(agreed) > len(item.agreed):
            if not item.agreed:  # the first words: from here a draft every hop after this one's audio
                item.next_hop = max(item.next_hop, len(samples) + self._hop_samples)
            item.agreed = agreed
            self._send(item, agreed_text(agreed, self._decode))


__all__ = ["MAX_DRAFT_S", "MIN_COMMIT_MS", "EmptyBuffer", "LiveError", "LiveLimitError", "LiveLimits", "LiveSession",
           "LiveSettings", "SessionClosed", "context_text", "live_instruction"]
