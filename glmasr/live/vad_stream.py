"""Incremental voice activity for many live streams at once: ``VadStreams``, one per server.

Each live session opens a stream (``VadStreams.open(on_probs)``) and pushes its 16 kHz samples into it. A ticker
task (``start``/``stop``, every ``tick_s``) takes every open stream's complete 512-sample windows (32 ms; each with
the 64 samples before it as context, zeros before the stream's first sample) and runs them through the Silero VAD
network of ``glmasr.audio.vad`` (the same weights, loaded once per device by ``vad.load_vad``) on a worker thread
(``asyncio.to_thread``), so the event loop never waits on the network:

- the front end (STFT + encoder convolutions + the LSTM's input projection) runs once over all the windows taken;
- the LSTM cell runs once per window step over the streams that have a window at that step (step t: every stream
  with more than t windows pending), each stream's (h, c) state kept in a slot of a shared state pool;
- the probabilities are decoded at once and handed to each stream's ``on_probs(first_window_index, probs)`` in
  the event loop (``first_window_index``: the stream's window count before these, so window i covers the stream's
  samples [512 i, 512 (i + 1))).

So hundreds of streams cost one batched network step per 32 ms of audio, not one per stream. A tick takes at most
``max_windows_per_tick`` windows of a stream (the rest wait for the next tick, which then comes at once).

Exactness: every batch the network sees has its row count rounded up to a multiple of ``ROW_BLOCK`` (32) with zero
rows, because the CPU kernels (oneDNN convolutions, MKL/oneDNN GEMM and GEMV) take other code paths, with another
summation order, for small or odd row counts; with fixed blocks a stream's probabilities do not depend on how many
other streams share its batch (bit-identical, held by tests/test_live_turns.py on the CPU). Against
``vad.speech_probabilities`` over the same samples (one stream, the network window by window) they agree within
1e-5 (``PROB_ATOL``): the same float32 operations, but that function runs the LSTM cell on one row (another GEMM
path, ~5e-7 per step) and the decoder over all hidden states at once; the recurrence carries the difference without
growing it (the gates saturate), and 1e-5 is ~1e4 times finer than a 0.5 threshold can notice.

Only complete windows are scored; a stream's last partial window waits for more audio. ``close()`` frees the
stream's state (its slot is reused once no batch holds it); a stream closed while its windows are in a running
batch gets no callback after ``close()``. If the network fails on a batch, each stream in it is closed and its
``on_error(exc)`` called (logged when there is none). Streams must be used from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..audio import vad

WINDOW = vad.WINDOW
CONTEXT = vad.CONTEXT
ROW_BLOCK = 32  # network batches are padded to a multiple of this many rows (see the module docstring)
PROB_ATOL = 1e-5  # per-window probabilities vs vad.speech_probabilities over the same samples (module docstring)
DEFAULT_TICK_S = 0.032  # one window
DEFAULT_MAX_WINDOWS_PER_TICK = 64  # ~2 s of one stream's audio per tick

_log = logging.getLogger(__name__)


class VadStream:
    """One live stream's VAD input (made by ``VadStreams.open``): ``push`` 16 kHz samples, ``close`` when done."""

    def __init__(self, owner: VadStreams, slot: int, on_probs: Callable, on_error: Callable | None):
        self._owner = owner
        self._slot = slot
        self._on_probs = on_probs
        self._on_error = on_error
        self._chunks: list[np.ndarray] = [np.zeros(CONTEXT, np.float32)]  # the context, then pending samples
        self._pending = 0  # samples pushed and not yet taken into a window
        self._next_window = 0  # windows taken into batches so far (the next batch's first_window_index)
        self._fresh = True  # its state slot must be zeroed before its first window
        self.closed = False

    @property
    def pending_samples(self) -> int:
        """Samples pushed but not yet taken into a batch (less than one window once the ticker has caught up)."""
        return self._pending

    @property
    def windows_taken(self) -> int:
        """Windows taken into batches so far (those delivered, plus those of a batch running now)."""
        return self._next_window

    def push(self, samples) -> None:
        """Append 16 kHz mono float32 samples (1-D)."""
        if self.closed:
            raise ValueError("push on a closed VAD stream")
        x = np.asarray(samples)
        if x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"VAD stream input must be 1-D float 16 kHz samples, got shape {x.shape}, "
                             f"dtype {x.dtype}")
        if x.shape[0]:
            self._chunks.append(np.array(x, dtype=np.float32))  # a copy: the caller may reuse its buffer
            self._pending += x.shape[0]

    def close(self) -> None:
        """Stop: no callback comes after this; the state slot is freed. Idempotent."""
        if not self.closed:
            self.closed = True
            self._chunks = []
            self._pending = 0
            self._owner._release(self)

    def _take(self, limit: int) -> np.ndarray | None:
        """Up to ``limit`` complete windows as (k, CONTEXT + WINDOW) rows, or None; keeps the rest (and the last
        CONTEXT samples taken, as the next window's context)."""
        k = min(self._pending // WINDOW, limit)
        if k == 0:
            return None
        buf = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        used = k * WINDOW
        rows = np.lib.stride_tricks.sliding_window_view(buf[:CONTEXT + used], CONTEXT + WINDOW)[::WINDOW].copy()
        self._chunks = [buf[used:].copy()]
        self._pending -= used
        return rows


@dataclass
class _Batch:
    streams: list[VadStream]  # in order of window count, most first
    counts: list[int]  # windows per stream
    first: list[int]  # first_window_index per stream
    rows: np.ndarray  # (W, CONTEXT + WINDOW): stream 0's windows, then stream 1's, ...
    fresh: list[int]  # slots to zero before the batch
    capacity: int  # state slots the pool must have


class VadStreams:
    """The Silero VAD network shared by all live streams of a process (see the module docstring).

    ``device``: where the network runs (default: CUDA if available, else the CPU). Raises ``VadUnavailableError``
    (from ``glmasr.audio.vad``) when the silero-vad weights are not installed. ``tick_s``: the ticker's period;
    ``max_windows_per_tick``: at most this many windows of one stream per batch."""

    def __init__(self, device=None, tick_s: float = DEFAULT_TICK_S,
                 max_windows_per_tick: int = DEFAULT_MAX_WINDOWS_PER_TICK):
        if not (isinstance(tick_s, (int, float)) and not isinstance(tick_s, bool) and 0 < tick_s <= 1.0):
            raise ValueError(f"tick_s must be a number in (0, 1] seconds, got {tick_s!r}")
        if isinstance(max_windows_per_tick, bool) or not isinstance(max_windows_per_tick, int) \
                or max_windows_per_tick < 1:
            raise ValueError(f"max_windows_per_tick must be an integer >= 1, got {max_windows_per_tick!r}")
        self.model = vad.load_vad(device)  # VadUnavailableError without the weights
        self.device = self.model.stft_conv_weight.device
        self.tick_s = float(tick_s)
        self.max_windows_per_tick = max_windows_per_tick
        self._streams: list[VadStream] = []  # open streams, in opening order
        self._free: list[int] = []  # state slots no stream and no batch holds
        self._closing: list[int] = []  # slots of closed streams, freed before the next batch is taken
        self._slots = 0  # slots handed out so far (the pool grows to this in the worker)
        self._h = torch.zeros(0, vad.STATE_SIZE, device=self.device)  # the state pool: touched by the worker only
        self._c = torch.zeros(0, vad.STATE_SIZE, device=self.device)
        self._inflight: asyncio.Future | None = None
        self._ticker: asyncio.Task | None = None

    # -- streams -----------------------------------------------------------------------------------------------
    def open(self, on_probs: Callable[[int, np.ndarray], None],
             on_error: Callable[[BaseException], None] | None = None) -> VadStream:
        """A new stream: ``on_probs(first_window_index, probs)`` (float32 (k,)) is called in the event loop for
        each batch of its windows, in order; ``on_error(exc)`` if the network failed on its windows (the stream is
        closed then)."""
        if not callable(on_probs):
            raise TypeError("on_probs must be callable")
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._slots
            self._slots += 1
        stream = VadStream(self, slot, on_probs, on_error)
        self._streams.append(stream)
        return stream

    def _release(self, stream: VadStream) -> None:
        self._streams.remove(stream)
        self._closing.append(stream._slot)  # a running batch may still write this slot: freed before the next one

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- the ticker --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the ticker task (in the running loop); idempotent."""
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever(), name="vad-streams")

    async def stop(self) -> None:
        """Stop the ticker and wait for a batch in flight (its callbacks run). Open streams stay open."""
        task, self._ticker = self._ticker, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self._wait_inflight()

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            try:
                more = await self.run_pending()
            except Exception:  # a bug here must not stop every session's VAD for good
                _log.exception("live VAD ticker: a batch failed")
                more = False
            # a backlog (a stream with more than max_windows_per_tick windows) goes on at once
            await asyncio.sleep(0 if more else max(0.0, self.tick_s - (loop.time() - t0)))

    async def _wait_inflight(self) -> None:
        while self._inflight is not None:
            try:
                await asyncio.shield(self._inflight)
            except Exception:
                pass  # reported by _finish to the streams

    async def run_pending(self) -> bool:
        """Score every stream's pending complete windows now (at most ``max_windows_per_tick`` each), one batch,
        waiting for a batch in flight first; the callbacks have run when it returns. Returns whether windows are
        still pending (a backlog). The ticker calls this; tests and callers that need the probabilities up to now
        may too."""
        await self._wait_inflight()  # one batch at a time: the state pool belongs to the running batch
        batch = self._take()
        if batch is None:
            return False
        fut = asyncio.ensure_future(asyncio.to_thread(self._compute, batch))
        self._inflight = fut
        fut.add_done_callback(lambda f: self._finish(batch, f))  # runs before the awaiter below resumes
        try:
            await asyncio.shield(fut)
        except Exception:
            pass  # reported by _finish to the streams
        return any(s._pending >= WINDOW for s in self._streams)

    def _take(self) -> _Batch | None:
        self._free.extend(self._closing)  # no batch runs now: closed streams' slots are free
        self._closing.clear()
        taken = []
        for s in self._streams:
            rows = s._take(self.max_windows_per_tick)
            if rows is not None:
                taken.append((s, rows))
        if not taken:
            return None
        taken.sort(key=lambda t: -t[1].shape[0])  # stable: step t's streams are a prefix of the list
        streams = [s for s, _ in taken]
        counts = [r.shape[0] for _, r in taken]
        first = []
        fresh = []
        for s, k in zip(streams, counts):
            first.append(s._next_window)
            s._next_window += k
            if s._fresh:
                fresh.append(s._slot)
                s._fresh = False
        rows = np.concatenate([r for _, r in taken]) if len(taken) > 1 else taken[0][1]
        return _Batch(streams, counts, first, rows, fresh, self._slots)

    # -- the worker ----------------------------------------------------------------------------------------------
    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        m = -(-n // ROW_BLOCK) * ROW_BLOCK
        return x if m == n else torch.cat([x, x.new_zeros(m - n, *x.shape[1:])])

    @torch.inference_mode()
    def _compute(self, batch: _Batch) -> np.ndarray:
        """The network over a batch (on the worker thread): per-window probabilities, float32 (W,), in the batch's
        row order; the streams' states updated in the pool."""
        model, dev = self.model, self.device
        if self._h.shape[0] < batch.capacity:  # grow the pool (doubling); only the worker touches it
            cap = max(batch.capacity, 2 * self._h.shape[0], ROW_BLOCK)
            grow = cap - self._h.shape[0]
            self._h = torch.cat([self._h, self._h.new_zeros(grow, vad.STATE_SIZE)])
            self._c = torch.cat([self._c, self._c.new_zeros(grow, vad.STATE_SIZE)])
        if batch.fresh:
            idx = torch.tensor(batch.fresh, device=dev)
            self._h[idx] = 0
            self._c[idx] = 0
        w = batch.rows.shape[0]
        x = torch.from_numpy(batch.rows).to(dev)
        gates = model.input_gates(model.encode(self._padded(x)))[:w]
        slots = torch.tensor([s._slot for s in batch.streams], device=dev)
        h, c = self._padded(self._h[slots]), self._padded(self._c[slots])
        counts = np.asarray(batch.counts)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        hs = gates.new_empty(w, vad.STATE_SIZE)
        g = gates.new_zeros(h.shape[0], gates.shape[1])  # padding rows stay zero
        for t in range(int(counts[0])):
            n = int(np.count_nonzero(counts > t))  # streams with a window at step t: a prefix (sorted)
            rows = torch.from_numpy(offsets[:n] + t).to(dev)
            g[:n] = gates[rows]  # rows past n (streams without a window at step t): results dropped
            h_new, c_new = model.cell(g, h, c)
            h[:n], c[:n] = h_new[:n], c_new[:n]
            hs[rows] = h_new[:n]
        self._h[slots] = h[:len(counts)]
        self._c[slots] = c[:len(counts)]
        return model.decode(self._padded(hs))[:w].float().cpu().numpy()

    def _finish(self, batch: _Batch, fut: asyncio.Future) -> None:
        """In the loop, once the batch is done: the callbacks of the streams still open."""
        self._inflight = None
        if fut.cancelled():
            exc: BaseException | None = asyncio.CancelledError("VAD batch cancelled")
        else:
            exc = fut.exception()
        if exc is not None:
            for s in batch.streams:
                if s.closed:
                    continue
                s.close()  # its window count no longer matches its audio
                if s._on_error is None:
                    _log.error("VAD network failed on a live stream's windows: %r", exc)
                else:
                    self._call(s._on_error, exc)
            return
        probs = fut.result()
        at = 0
        for s, k, first in zip(batch.streams, batch.counts, batch.first):
            if not s.closed:
                self._call(s._on_probs, first, probs[at:at + k])
            at += k

    @staticmethod
    def _call(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # one session's callback must not stop the others' VAD
            _log.exception("live VAD callback %r failed", fn)
