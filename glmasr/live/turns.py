"""Turn detection on a live stream's speech probabilities, as OpenAI's ``server_vad`` does it: ``TurnSettings``
(its parameters) and ``TurnDetector`` (pure logic: per-window probabilities in, ``TurnEvent``s out).

Positions are 16 kHz samples since the session started; window i (from ``VadStreams``) covers samples
[512 i, 512 (i + 1)). With ``threshold`` T and the release threshold R = max(T - 0.15, 0.01) (the hysteresis of
Silero's own ``get_speech_timestamps`` and of ``vad.speech_regions``):

- Speech starts at the first window whose probability is >= T (its first sample is the onset). Event
  ``started`` at onset - prefix_padding, but not before 0 nor before the previous turn's stop.
- A turn ends after a run of windows below R lasting ``silence_duration_ms`` (a window >= T breaks the run and
  counts as speech; one between R and T breaks the run without counting as speech). The speech end E is the
  start of the last window >= T (the network's probability lags the audio by about two windows at the end of
  speech: the rule of ``vad.speech_regions``, measured there to put ends 40 ms early to 80 ms late); event
  ``stopped`` at E + silence_duration, as OpenAI's ``audio_end_ms`` includes the silence. The turn's audio is
  [started.sample, stopped.sample); the stop is never past the audio already scored.
- A turn reaching ``max_turn_s`` (from its started sample) is cut at the start of the lowest-probability window
  in the last third of that length (a pause if there is one: inside a pause the probability falls as the pause
  goes on, so that window ends the pause, before the next word's onset): ``stopped`` then ``started`` at that
  sample, both ``forced=True``, and the turn goes on from there. So no turn's audio is longer than ``max_turn_s``
  (30 s at most: the engine transcribes a turn as one window).
- ``idle(now_sample)``: with ``idle_timeout_ms``, one ``timeout`` event per idle stretch once that long passed
  without a turn since the last turn's stop (or the session's start, or ``reset``); none while a turn is open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..audio.features import SAMPLE_RATE, WINDOW_SAMPLES
from ..audio.vad import WINDOW

HYSTERESIS = 0.15  # release threshold = threshold - HYSTERESIS (at least MIN_RELEASE)
MIN_RELEASE = 0.01
END_LAG = WINDOW  # the speech end is one window before the first window below the threshold (module docstring)
MAX_PADDING_MS = 10_000  # prefix_padding_ms and silence_duration_ms: at most this
MIN_TURN_S = 1.0
MAX_TURN_S = WINDOW_SAMPLES / SAMPLE_RATE  # 30 s: a turn is one engine window
CUT_SEARCH = 1 / 3  # a long turn is cut in the last third of max_turn_s


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _number(field: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ValueError(f"turn_detection.{field} must be a number in [{_fmt(lo)}, {_fmt(hi)}], got {value!r}")
    return value


@dataclass(frozen=True)
class TurnSettings:
    """``server_vad`` parameters (OpenAI's names and defaults) plus ``max_turn_s``; validated on creation
    (``ValueError`` naming the field): threshold in [0, 1]; prefix_padding_ms and silence_duration_ms in
    [0, 10000]; idle_timeout_ms None or in [1, 3600000]; max_turn_s in [1, 30]; prefix_padding_ms below half of
    max_turn_s."""

    threshold: float = 0.5
    prefix_padding_ms: float = 300
    silence_duration_ms: float = 500
    idle_timeout_ms: float | None = None
    max_turn_s: float = 30.0

    def __post_init__(self):
        _number("threshold", self.threshold, 0.0, 1.0)
        _number("prefix_padding_ms", self.prefix_padding_ms, 0, MAX_PADDING_MS)
        _number("silence_duration_ms", self.silence_duration_ms, 0, MAX_PADDING_MS)
        if self.idle_timeout_ms is not None:
            _number("idle_timeout_ms", self.idle_timeout_ms, 1, 3_600_000)
        _number("max_turn_s", self.max_turn_s, MIN_TURN_S, MAX_TURN_S)
        if self.prefix_padding_ms >= self.max_turn_s * 1000 / 2:
            raise ValueError(f"turn_detection.prefix_padding_ms ({self.prefix_padding_ms!r}) must be less than half "
                             f"of max_turn_s ({self.max_turn_s!r} s): a turn's padding must leave room for speech")

    @property
    def release_threshold(self) -> float:
        """Probabilities below this count as silence (threshold - 0.15, at least 0.01)."""
        return max(self.threshold - HYSTERESIS, MIN_RELEASE)


def _samples(ms: float) -> int:
    return round(ms * SAMPLE_RATE / 1000)


@dataclass(frozen=True)
class TurnEvent:
    """``kind``: "started", "stopped" or "timeout"; ``sample``: its position in 16 kHz samples since the session
    started; ``forced``: a stop/start made by the ``max_turn_s`` cut (not by silence)."""

    kind: str
    sample: int
    forced: bool = False

    @property
    def ms(self) -> int:
        """``sample`` in whole milliseconds (OpenAI's ``audio_start_ms``/``audio_end_ms``)."""
        return self.sample * 1000 // SAMPLE_RATE


class TurnDetector:
    """Turns from per-window probabilities (see the module docstring). Not thread-safe; one per session."""

    def __init__(self, settings: TurnSettings | None = None):
        self.settings = settings if settings is not None else TurnSettings()
        if not isinstance(self.settings, TurnSettings):
            raise TypeError(f"settings must be a TurnSettings, got {type(self.settings).__name__}")
        s = self.settings
        self._threshold = float(s.threshold)
        self._release = float(s.release_threshold)
        self._prefix = _samples(s.prefix_padding_ms)
        self._silence = _samples(s.silence_duration_ms)
        self._idle = None if s.idle_timeout_ms is None else _samples(s.idle_timeout_ms)
        self._max = round(s.max_turn_s * SAMPLE_RATE)
        self._next = 0  # the next window index feed expects
        self._last_stop = 0  # where the last turn stopped (or the session started, or reset)
        self._idle_fired = False
        self._start: int | None = None  # the open turn's started sample
        self._end_reset()

    def _end_reset(self) -> None:
        self._onset = 0  # the open turn's first speech sample
        self._below_from: int | None = None  # first window (sample) of the current run below threshold
        self._silence_from: int | None = None  # first window (sample) of the current run below release
        self._hist_first = 0  # window index of self._hist[0]
        self._hist: list[float] = []  # the open turn's probabilities from its onset window on

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def speaking(self) -> bool:
        """A turn is open."""
        return self._start is not None

    @property
    def turn_start(self) -> int | None:
        """The open turn's started sample, or None."""
        return self._start

    @property
    def position(self) -> int:
        """Samples scored so far (the end of the last window fed)."""
        return self._next * WINDOW

    # -- input -----------------------------------------------------------------------------------------------------
    def feed(self, first_window_index: int, probs) -> list[TurnEvent]:
        """The probabilities of windows ``first_window_index, ...`` (contiguous with what was fed before) ->
        the events they cause, in order."""
        if isinstance(first_window_index, bool) or not isinstance(first_window_index, (int, np.integer)) \
                or first_window_index != self._next:
            raise ValueError(f"feed: first_window_index must be {self._next} (the next window), "
                             f"got {first_window_index!r}")
        p = np.asarray(probs, dtype=np.float64).reshape(-1)
        if not np.isfinite(p).all():
            raise ValueError("feed: probabilities must be finite")
        events: list[TurnEvent] = []
        for k, v in enumerate(p.tolist()):
            self._step(self._next + k, v, events)
        self._next += p.shape[0]
        return events

    def _step(self, i: int, v: float, events: list[TurnEvent]) -> None:
        pos = i * WINDOW
        if self._start is None:
            if v >= self._threshold:
                self._start = max(0, pos - self._prefix, self._last_stop)
                self._end_reset()
                self._onset, self._hist_first = pos, i
                self._hist.append(v)
                events.append(TurnEvent("started", self._start))
            return
        self._hist.append(v)
        if self._speech_step(pos, v, events):
            return
        if pos + WINDOW - self._start >= self._max:
            self._cut(i, events)

    def _speech_step(self, pos: int, v: float, events: list[TurnEvent]) -> bool:
        """One window of an open turn; True if the turn stopped (on silence)."""
        if v >= self._threshold:
            self._below_from = self._silence_from = None
            return False
        if self._below_from is None:
            self._below_from = pos
        if v >= self._release:
            self._silence_from = None  # between the thresholds: the silence run is broken
            return False
        if self._silence_from is None:
            self._silence_from = pos
        if pos + WINDOW - self._silence_from < self._silence:
            return False
        end = self._below_from - END_LAG
        if end <= self._onset:
            end = self._below_from
        stop = end + self._silence
        events.append(TurnEvent("stopped", stop))
        self._close_turn(stop)
        return True

    def _close_turn(self, stop: int) -> None:
        self._start = None
        self._last_stop = stop
        self._idle_fired = False
        self._end_reset()

    def _cut(self, i: int, events: list[TurnEvent]) -> None:
        """The open turn reached max_turn_s at window i: cut at its quietest window start in the last third."""
        lo = self._start + self._max - int(self._max * CUT_SEARCH)
        j0 = max(-(-lo // WINDOW), self._hist_first + 1)  # never at the onset: the turn must not be empty
        if j0 <= i:
            probs = self._hist[j0 - self._hist_first:i + 1 - self._hist_first]
            j = j0 + int(np.argmin(probs))
        else:  # no window to choose from: a guard (validated settings leave the last third after the onset)
            j = i
        cut = j * WINDOW
        events.append(TurnEvent("stopped", cut, forced=True))
        events.append(TurnEvent("started", cut, forced=True))
        replay = self._hist[j - self._hist_first:i + 1 - self._hist_first]
        self._last_stop = cut
        self._start = cut
        self._end_reset()
        self._onset, self._hist_first = cut, j
        # the windows after the cut belong to the new turn: run them again from a clean speech state (shorter than
        # max_turn_s, and a silence run long enough to stop would have stopped the old turn already)
        for k, v in enumerate(replay):
            self._step(j + k, v, events)

    def idle(self, now_sample: int) -> list[TurnEvent]:
        """A ``timeout`` event (at the sample where the timeout was reached) if ``idle_timeout_ms`` passed since
        the last turn stopped (or the session started, or ``reset``) with no turn open, once per idle stretch;
        else nothing. ``now_sample``: the caller's clock in 16 kHz samples since the session started."""
        if self._idle is None or self._start is not None or self._idle_fired:
            return []
        at = self._last_stop + self._idle
        if now_sample < at:
            return []
        self._idle_fired = True
        return [TurnEvent("timeout", at)]

    def reset(self, sample: int) -> None:
        """The caller ended the audio at ``sample`` (a manual commit or a cleared buffer): an open turn is dropped
        without an event, the next turn starts at or after ``sample``, and the idle stretch restarts there.
        Window indexes go on (``feed`` still expects the next window)."""
        self._close_turn(max(int(sample), 0))
