"""One thread owns the engine (and so the GPU); any number of callers, in any thread or in asyncio code,
submit requests to it and iterate their streams.

    loop = EngineLoop(engine)
    stream = loop.submit(plans, ignore_eos=False)     # from any thread; returns at once
    for out in stream: ...                             # SequenceOutputs of this request, then it ends
    async for out in stream: ...                       # the same from a coroutine
    stream.close()                                     # or loop.abort(stream.request_id): frees its slots
    stream = loop.submit(plans, deadline=time.monotonic() + 5, timeout_s=5)   # the engine enforces it
    stream.set_timeout(2.0)                            # a deadline from now (an earlier one stays)
    loop.call(fn)                                      # fn(engine) on the loop's thread once it is idle: a Future
    loop.run_when_idle(units)                          # background work, one unit at a time between requests

The loop sleeps while there is nothing to do. Each iteration takes the new requests and aborts, then runs one
``Engine.step`` and hands each output to its request's stream. Background work (``run_when_idle``: the
warm-up's graph captures) runs one unit at a time, only when nothing else is pending, so a request that arrives
meanwhile waits for at most one unit. A request the engine refuses (``add_request``
raises) fails alone, with that error, on its stream. An error inside a step (a device fault) fails every request
in the engine with an ``EngineError`` carrying the cause, and the engine is reset so that later requests run.
Between rounds the loop aborts the requests past their deadline (``Engine.expire``), queued or running; their
streams end with a ``RequestTimeoutError`` naming the timeout. A request's ``priority`` (``request.Priority``:
lower first, any int; default ``BATCH``) orders its encoding and admission; a running one of priority >= ``DRAFT``
that a step preempts for a better one (``Engine.take_preempted``) ends with ``errors.RequestPreempted``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import numbers
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from .engine import Engine
from .request import Priority, SequenceOutput
from ..errors import EngineClosed, EngineError, RequestPreempted, RequestTimeoutError


def check_timeout(timeout, name: str = "timeout") -> float | None:
    """``timeout`` as float seconds (None: no limit); a clear error for anything but a positive finite number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(timeout).__name__}")
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {timeout!r}")
    return t


def check_priority(priority) -> int:
    """``priority`` as an int (a ``Priority`` member or any int: lower runs first); a TypeError for anything else."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"priority must be an int (glmasr.options.Priority), got {type(priority).__name__}")
    return int(priority)


def priority_name(priority: int) -> str:
    """``Priority.DRAFT`` -> "DRAFT"; another int as itself."""
    try:
        return Priority(priority).name
    except ValueError:
        return str(priority)


log = logging.getLogger("glmasr.engine")

# How long the loop must have been idle before it runs a unit of background work (run_when_idle).
IDLE_GRACE_S = 0.05

_END = object()


class RequestStream:
    """The outputs of one request, for one consumer: iterate it (blocking) or ``async for`` it."""

    def __init__(self, request_id: int, loop: "EngineLoop"):
        self.request_id = request_id
        self._loop = loop
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.finished = False  # the engine is done with it (completed, failed or aborted)
        self._closed = False  # the consumer has taken its end (or closed it)
        self._listener = None

    # producer side (the loop's thread)
    def _put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            if item is _END or isinstance(item, BaseException):
                self.finished = True
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
            listener = self._listener
        for aloop, fut in waiters:
            aloop.call_soon_threadsafe(_wake, fut)
        if listener is not None:
            listener()

    def set_listener(self, fn) -> None:
        """Call ``fn()`` (on the engine's thread) whenever an item arrives, and once now."""
        with self._cv:
            self._listener = fn
        fn()

    def poll(self) -> list[SequenceOutput]:
        """The outputs available now, without waiting (raises the request's error once it is next)."""
        items = []
        with self._cv:
            while self._items:
                try:
                    items.append(self._take())
                except StopIteration:
                    break
                except BaseException:
                    if items:
                        break
                    raise
        return items

    @property
    def exhausted(self) -> bool:
        """The consumer has reached the end."""
        return self._closed

    # consumer side
    def __iter__(self):
        return self

    def __next__(self) -> SequenceOutput:
        with self._cv:
            while not self._items:
                self._cv.wait()
            return self._take()

    def _take(self):
        item = self._items[0]
        if item is _END or isinstance(item, BaseException):
            self._closed = True
            if isinstance(item, BaseException):
                raise item
            raise StopIteration
        self._items.popleft()
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> SequenceOutput:
        while True:
            with self._cv:
                if self._items:
                    try:
                        return self._take()
                    except StopIteration:
                        raise StopAsyncIteration from None
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append((asyncio.get_running_loop(), fut))
            await fut

    def set_timeout(self, timeout: float) -> None:
        """The engine ends this request with a ``RequestTimeoutError`` if it has not finished ``timeout`` s from
        now (an earlier deadline it has stays). Nothing happens once the engine is done with it."""
        timeout = check_timeout(timeout)
        if not self.finished:
            self._loop.set_deadline(self.request_id, time.monotonic() + timeout, timeout)

    def close(self) -> None:
        """Stop consuming: an unfinished request is aborted (its slots are freed at the next round)."""
        if not self.finished:
            self._loop.abort(self.request_id)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _timeout_error(rid: int, timeout_s: float | None, stage: str) -> RequestTimeoutError:
    limit = f"its timeout of {timeout_s:g} s" if timeout_s is not None else "its deadline"
    where = "while decoding" if stage == "running" else "before it got a slot (queued)"
    return RequestTimeoutError(f"request {rid} did not finish within {limit}: the engine dropped it {where}")


def _preempted_error(rid: int, priority: int) -> RequestPreempted:
    return RequestPreempted(f"request {rid} (priority {priority_name(priority)}) was preempted: a request of a "
                            f"better priority class needed its engine slot")


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "glmasr-engine"):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._aborts: set[int] = set()
        self._deadlines: dict[int, tuple[float, float | None]] = {}  # set after submission, for the next round
        self._streams: dict[int, RequestStream] = {}
        self._calls: deque = deque()  # (fn, Future): run on this thread once the engine is idle
        self._idle: deque = deque()  # [units, Future, results]: background work (run_when_idle)
        self._ids = itertools.count()
        self._closed = False
        self._closed_reason = "the engine loop is shut down"
        self.rounds = 0  # engine steps finished: a watchdog sees the engine move (or not) from outside
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, plans=None, *, ignore_eos: bool = False, prompt_embeds=None, max_new_tokens=None,
               repetition_stop: int | None = None, deadline: float | None = None, timeout_s: float | None = None,
               priority: int = Priority.BATCH) -> RequestStream:
        """Queue a request (``Engine.add_request``'s arguments); returns its stream at once. ``deadline``: a
        ``time.monotonic()`` instant after which the engine drops it and the stream ends with a
        ``RequestTimeoutError`` naming ``timeout_s``. ``priority``: its class (lower first); one of
        ``Priority.DRAFT`` or worse may end with ``RequestPreempted``."""
        with self._cv:
            if self._closed:
                raise EngineClosed(self._closed_reason)
            rid = next(self._ids)
            stream = RequestStream(rid, self)
            self._streams[rid] = stream
            self._inbox.append((rid, dict(plans=plans, ignore_eos=ignore_eos, prompt_embeds=prompt_embeds,
                                          max_new_tokens=max_new_tokens, repetition_stop=repetition_stop,
                                          deadline=deadline, timeout_s=timeout_s, priority=priority)))
            self._cv.notify()
        return stream

    def set_deadline(self, request_id: int, deadline: float, timeout_s: float | None = None) -> None:
        """Give a submitted request a deadline (``time.monotonic()``; an earlier one it has stays)."""
        with self._cv:
            if request_id not in self._streams:
                return  # already ended
            for rid, kwargs in self._inbox:  # not yet in the engine (e.g. held back behind a call)
                if rid == request_id:
                    if kwargs["deadline"] is None or deadline < kwargs["deadline"]:
                        kwargs["deadline"], kwargs["timeout_s"] = deadline, timeout_s
                    return
            old = self._deadlines.get(request_id)
            if old is None or deadline < old[0]:
                self._deadlines[request_id] = (deadline, timeout_s)
            self._cv.notify()

    def abort(self, request_id: int) -> None:
        with self._cv:
            if request_id in self._streams:
                self._aborts.add(request_id)
                self._cv.notify()

    def call(self, fn) -> Future:
        """Run ``fn(engine)`` on the engine's thread as soon as the engine is idle (e.g. a warm-up); new requests
        wait until it returns. The future has its result or its exception."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineClosed(self._closed_reason)
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def run_when_idle(self, units) -> Future:
        """Run each ``fn(engine)`` of ``units`` (a list of (name, fn) pairs) on the engine's thread, one at a time,
        whenever nothing else is pending (no request, call, abort or deadline), in order. The future's result,
        once every unit has run, is {name: total ms}; a unit that raises is logged and skipped (what it would
        have prepared is then done on demand) and its error is listed under "errors". Closing the loop drops the
        units not yet run (the future then holds what ran, with "dropped": their count)."""
        fut: Future = Future()
        units = list(units)
        with self._cv:
            if self._closed:
                raise EngineClosed(self._closed_reason)
            if not units:
                fut.set_result({})
                return fut
            self._idle.append([deque(units), fut, {}])
            self._cv.notify()
        return fut

    def _next_idle_unit(self):
        """(fn, work) of the next background unit, or None; under self._cv, engine idle."""
        while self._idle:
            work = self._idle[0]
            if work[0]:
                return work[0].popleft(), work
            self._idle.popleft()
            work[1].set_result(work[2])
        return None

    def _drop_idle_work(self) -> None:
        """The loop is closing: background units not yet run are dropped; each future gets what ran."""
        work, self._idle = self._idle, deque()
        for units, fut, results in work:
            if units:
                results["dropped"] = len(units)
            fut.set_result(results)

    @staticmethod
    def _run_idle_unit(engine, unit, work) -> None:
        name, fn = unit
        t0 = time.perf_counter()
        try:
            fn(engine)
        except Exception as e:  # background preparation only: the request that needs it prepares it itself
            log.warning("background warm-up step %s failed (%s: %s); it is left to the first request that needs it",
                        name, type(e).__name__, e)
            work[2].setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
        ms = work[2].get(f"{name}_ms", 0.0)
        work[2][f"{name}_ms"] = ms + 1e3 * (time.perf_counter() - t0)

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        with self._cv:
            return len(self._streams)

    def close(self, timeout: float | None = None) -> None:
        """Finish the requests in hand, then stop the thread (which then lets go of the engine); later submits
        raise ``EngineClosed``."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the loop's thread ----
    def _run(self) -> None:
        engine = self.engine
        device = engine.model.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        busy_until = time.monotonic()  # when the loop last had something else to do than background work
        was_busy = False
        while True:
            idle_unit = None
            if was_busy:
                busy_until, was_busy = time.monotonic(), False
            with self._cv:
                while not (self._inbox or self._aborts or self._calls or self._deadlines or engine.has_unfinished()
                           or self._closed):
                    if not self._idle:
                        self._cv.wait()
                        continue
                    # background work starts once the loop has been idle a moment: a caller's next request,
                    # submitted right after the last one ended, goes first
                    wait = busy_until + IDLE_GRACE_S - time.monotonic()
                    if wait <= 0:
                        idle_unit = self._next_idle_unit()
                        if idle_unit is not None:
                            break
                    else:
                        self._cv.wait(wait)
                if idle_unit is None and self._closed and not self._inbox and not self._calls \
                        and not engine.has_unfinished():
                    self._drop_idle_work()
                    self.engine = None  # streams outlive the loop: they must not keep the model alive
                    return
            if idle_unit is not None:
                unit, work = idle_unit
                self._run_idle_unit(engine, unit, work)
                with self._cv:
                    if not work[0] and self._idle and self._idle[0] is work:  # its last unit: settle it now
                        self._idle.popleft()
                        work[1].set_result(work[2])
                continue
            was_busy = True
            with self._cv:
                call = self._calls.popleft() if self._calls and not engine.has_unfinished() else None
                inbox, aborts, deadlines = deque(), set(), {}
                if call is None:  # (aborts and requests that came meanwhile wait for the next iteration)
                    aborts, self._aborts = self._aborts, set()
                    deadlines, self._deadlines = self._deadlines, {}
                    if not self._calls:  # a pending call waits for an idle engine: hold new requests back
                        inbox, self._inbox = self._inbox, deque()
            if call is not None:
                fn, fut = call
                try:
                    fut.set_result(fn(engine))
                except BaseException as e:
                    fut.set_exception(e)
                continue
            for rid, kwargs in inbox:
                if rid in aborts:
                    self._end(rid, _END)
                    continue
                try:
                    engine.add_request(request_id=rid, **kwargs)
                except Exception as e:  # this request's own problem: it fails alone
                    self._end(rid, e)
            for rid in aborts:
                engine.abort(rid)
                self._end(rid, _END)
            for rid, (deadline, timeout_s) in deadlines.items():
                engine.set_deadline(rid, deadline, timeout_s)  # False: it has ended meanwhile
            for rid, timeout_s, stage in engine.expire(time.monotonic()):
                self._end(rid, _timeout_error(rid, timeout_s, stage))
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
                self.rounds += 1
            except Exception as e:  # a device fault or a bug: fail what was in flight, keep serving
                for rid, priority in engine.take_preempted():  # dropped before the fault: preempted all the same
                    self._end(rid, _preempted_error(rid, priority))
                try:
                    failed = engine.reset()
                except Exception as reset_error:  # a sticky device fault: nothing can run on this engine again
                    self._give_up(e, reset_error)
                    return
                for rid in failed:
                    err = EngineError(f"the engine failed while decoding request {rid} ({type(e).__name__}: {e})")
                    err.__cause__ = e
                    self._end(rid, err)
                continue
            for rid, priority in engine.take_preempted():
                self._end(rid, _preempted_error(rid, priority))
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream._put(out)
                if out.request_finished:
                    self._end(out.request_id, _END)

    def _give_up(self, error: Exception, reset_error: Exception) -> None:
        """The device cannot be used any more (e.g. an illegal memory access leaves the CUDA context unusable):
        every request in hand and every pending call fails with an ``EngineError`` at once (none waits forever
        on a thread that is gone), later submits raise ``EngineClosed``, and the thread ends."""
        log.error("the engine's device failed and could not be reset (%s: %s); the engine is closed: load the "
                  "model again in a new process", type(reset_error).__name__, reset_error)
        with self._cv:
            self._closed = True
            self._closed_reason = (f"the engine stopped after a device fault it could not recover from "
                                   f"({type(error).__name__}: {error})")
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, deque()
            self._inbox.clear()
            self._drop_idle_work()
        for rid, stream in streams.items():
            err = EngineError(f"request {rid}: {self._closed_reason}")
            err.__cause__ = error
            stream._put(err)
        for _, fut in calls:
            fut.set_exception(EngineError(self._closed_reason))
        self.engine = None

    def _end(self, rid: int, item) -> None:
        with self._cv:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream._put(item)
