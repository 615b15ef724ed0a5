"""``glmasr serve --data-parallel N``: one front end, N engine worker processes (one per device), behind the same
``EngineClient`` interface as the single in-process engine (``engine_client.py``). The requests policy on the
worker pool of ``glmasr.workers`` (``workers/pool.py``: spawn, ready handshake, heartbeat watchdog, death,
restart, give-up, drain); the files policy is ``workers/files.py``.

Process layout. The front end (the uvicorn process) does everything but the model: HTTP, auth, upload limits,
audio decoding (``decode_audio_bytes``), VAD pieces for ``chunking_strategy``, admission, SSE, metrics. Each
worker (``workers/process.py``, with the server's ``LocalEngineClient``) owns one loaded model on its device and
runs the single-engine server's own request path (``submit_loaded``: planning, the engine, the transcript
assembler). A request travels as its decoded 16 kHz samples + ``DecodeOptions`` + VAD pieces + its timeout and
priority class (``Priority``: the worker's engine orders and preempts by it; a preempted draft raises
``RequestPreempted`` here, its error crossing the pipe by code like every other); its
``TranscriptDelta``s come back as they are made, the last one with the finished ``Transcription``, so streaming
and results are exactly the single engine's. The workers warm up as ``warmup(mode)`` says before they are ready.

Routing: the ready worker with the fewest seconds of audio in flight (ties: fewer requests, then the one picked
least recently, so an idle pool alternates). Audio seconds, not request counts, because a worker's remaining work
grows with the audio it holds (windows to encode, ~6 tokens a second of budget): one 20-minute file and forty
30-second clips are the same load, one request and one request are not.

Failures. A worker that dies (crash, OOM kill, ``kill -9``, or killed by the watchdog: its engine made no step
for ``worker_timeout_s`` while it held requests) fails each request it held, at once, with ``EngineUnavailable``
(a 503 in the error envelope, or an ``error`` event on a stream; never a hang), and is restarted by the pool (it
loads and warms up again; ``restarts`` counts it). Requests are not retried on another worker: a request that
killed one worker would kill the next. While a worker is not ready the others take all requests; with none ready
a request gets a 503 (``no_worker``). A client that disconnects aborts its request in its worker (an ``abort``
message; the worker's ``end`` says its slots are free). ``close`` drains: each worker finishes what it holds and
exits (killed after ``drain_timeout_s``); ``stop_restarts`` (at SIGTERM) keeps a worker that exits from
restarting.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque

from ..engine.loop import check_priority
from ..engine.request import Priority
from ..errors import EngineClosed, EngineUnavailable, from_code
from .pool import Worker, WorkerPool
from .engine_client import WARMUPS, EngineClient, EngineRequest

_TEST_HOOKS: dict = {}  # test hooks for every client made without _test_hooks (tests set it in a server process)


class _Inbox:
    """Messages for one consumer coroutine, put from any thread."""

    def __init__(self):
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._waiter = None

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that event loop is closed: nobody waits any more
                pass

    async def get(self):
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            await fut


def _wake(fut) -> None:
    if not fut.done():
        fut.set_result(None)


class RemoteRequest(EngineRequest):
    """A request held by one engine worker (see ``EngineRequest``)."""

    def __init__(self, client: "DataParallelEngineClient", worker: "_Worker", rid: int, audio_s: float):
        self._client = client
        self.worker = worker
        self.rid = rid
        self.audio_s = audio_s
        self.prompt_tokens = 0
        self.first_output_at = None
        self._result = None
        self._inbox = _Inbox()
        self.finished = False  # the worker holds nothing of it any more (its end, or its death)
        self._aborted = False

    @property
    def result(self):
        return self._result

    def _deliver(self, msg) -> None:  # the pool's monitor thread
        if msg[0] == "first":
            self.first_output_at = msg[1]
            return
        if msg[0] in ("end", "died"):
            self.finished = True
        self._inbox.put(msg)

    @staticmethod
    def _error(msg) -> BaseException:
        if msg[0] == "died":
            return EngineUnavailable(msg[1], msg[2])
        return from_code(msg[1], msg[2])  # rejected or failed: (code, message)

    async def started(self) -> None:
        msg = await self._inbox.get()
        if msg[0] != "accepted":
            raise self._error(msg)
        self.prompt_tokens = msg[1]

    async def adeltas(self):
        try:
            while True:
                msg = await self._inbox.get()
                kind = msg[0]
                if kind == "delta":
                    d = msg[1]
                    if d.finished:
                        self._result = d.result
                    yield d
                elif kind == "end":
                    return
                elif kind in ("failed", "died"):
                    raise self._error(msg)
        finally:
            self.abort()  # a no-op once finished; an abandoned iteration frees its slots

    async def aresult(self):
        async for _ in self.adeltas():
            pass
        if self._result is None:  # it ended without its last output: aborted underneath us
            raise RuntimeError(f"request {self.rid} was aborted")
        return self._result

    def abort(self) -> None:
        if self.finished or self._aborted:
            return
        self._aborted = True
        self._client._abort(self)


class _Worker(Worker):
    audio_s = 0.0  # seconds of audio in flight
    picked = 0  # sequence number of its last pick (the tie-break)
    routed = 0  # requests sent to it


def pick_least_loaded(workers, picks, what: str):
    """The ready one of ``workers`` with the fewest seconds of audio in flight (ties: fewer requests, then the one
    picked longest ago), counted as picked (``routed``, ``picked`` from the counter ``picks``); an
    ``EngineUnavailable`` ("no_worker") naming each one's state when none is ready. Under the caller's lock."""
    ready = [w for w in workers if w.state == "ready"]
    if not ready:
        states = ", ".join(f"{w.slot}: {w.state}" for w in workers)
        raise EngineUnavailable(f"no {what} is ready to take the request ({states}); retry shortly", "no_worker")
    w = min(ready, key=lambda w: (w.audio_s, len(w.held), w.picked))
    w.routed += 1
    w.picked = next(picks)
    return w


class DataParallelEngineClient(WorkerPool, EngineClient):
    """N engine worker processes, one per entry of ``devices`` (e.g. ``["cuda:0", "cuda:1"]``, or ``"cpu,cpu"``;
    an entry may repeat: two engines on one GPU). model: a checkpoint folder or hub id (resolved here, once).
    engine_options: ``EngineOptions`` fields for every worker (max_batch, ...). aligner: a glm-asr-ctc head folder
    or hub id every worker loads (word times; checked here, once). threads: torch threads per worker
    (default: the cores split evenly). start_timeout_s: a worker not ready by then is given up.
    worker_timeout_s: the watchdog (None: off). The workers start with ``warmup(mode)`` (the app's lifespan calls
    it) and report ready once loaded and warmed up; ``close`` drains and stops them."""

    worker_class = _Worker

    def __init__(self, devices, model=None, dtype=None, threads: int | None = None, drain_timeout_s: float = 60.0,
                 start_timeout_s: float = 900.0, worker_timeout_s: float | None = 120.0,
                 _test_hooks: dict | None = None, decode_weights: str = "bf16", aligner=None, **engine_options):
        super().__init__(devices, model, dtype, threads=threads, start_timeout_s=start_timeout_s,
                         worker_timeout_s=worker_timeout_s, drain_timeout_s=drain_timeout_s,
                         hooks=_TEST_HOOKS if _test_hooks is None else _test_hooks, engine_options=engine_options,
                         name="glmasr-engine", decode_weights=decode_weights, aligner=aligner)
        self.slots = sum(self.options.resolved("cuda" if d.startswith("cuda") else "cpu").max_batch
                         for d in self.devices)
        self._ids = itertools.count()
        self._picks = itertools.count(1)
        self._warmup: str | None = None

    def start(self, warmup: str = "full") -> None:
        """Start every worker (each loads, warms up as ``warmup`` says, then reports ready); idempotent."""
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
        with self._cv:
            if self._closed:
                raise EngineClosed("this engine client is closed")
            if self._warmup is not None:
                return
            self._warmup = warmup
        self._start(warmup=warmup, server=True)

    def warmup(self, mode: str) -> dict:
        """Start the workers (if not yet) and wait until every one is ready. Raises if one was given up (it could
        not load the model) or one is still loading after ``start_timeout_s``."""
        self.start(mode)
        self.wait_started(self.start_timeout_s)
        with self._cv:
            gone = [w for w in self._workers if w.state != "ready"]
            if gone:
                raise RuntimeError("engine worker(s) could not start: " + "; ".join(
                    f"{w.slot} ({w.device}): {w.error or w.state}" for w in gone))
            timings = {}
            for w in self._workers:
                timings[f"worker{w.slot}_load_ms"] = w.info.get("load_ms", 0.0)
                for k, v in (w.info.get("warmup_ms") or {}).items():
                    timings[f"worker{w.slot}_{k}"] = v
            return timings

    # ---- requests ----
    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
               priority=Priority.UPLOAD) -> RemoteRequest:
        priority = check_priority(priority)  # a bad one fails here, not in the worker
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine workers are shut down")
            w = pick_least_loaded(self._workers, self._picks, "engine worker")
            rid = next(self._ids)
            req = RemoteRequest(self, w, rid, audio.duration_s)
            w.audio_s += req.audio_s
            self._hand(w, rid, req, ("submit", rid, audio, decode, t_start, audio_ms, pieces, stream, timeout,
                                     priority))
        return req

    def _abort(self, req: RemoteRequest) -> None:
        with self._cv:
            if req.worker.held.get(req.rid) is req:
                req.worker.sendq.put(("abort", req.rid))

    # ---- the pool's hooks ----
    def _job_message(self, w: _Worker, req: RemoteRequest, msg) -> None:
        if msg[0] == "end":
            w.audio_s = w.audio_s - req.audio_s if w.held else 0.0  # 0 when empty: no float drift
        req._deliver((msg[0], *msg[2:]))

    def _died(self, w: _Worker, held: dict, why: str, closing: bool) -> None:
        w.audio_s = 0.0
        if closing:
            text, code = f"the server is shutting down: engine worker {w.slot} ({w.device}) stopped ({why})", \
                "shutting_down"
        else:
            text, code = (f"the engine worker process serving this request died ({why}); worker {w.slot} "
                          f"({w.device}) is being restarted; retry the request"), "worker_died"
        for req in held.values():
            req._deliver(("died", text, code))

    # ---- state ----
    @property
    def num_pending(self) -> int:
        with self._cv:
            return sum(len(w.held) for w in self._workers)

    def workers(self) -> list[dict]:
        with self._cv:
            return [{"worker": w.slot, "device": w.device, "state": w.state,
                     "pid": w.process.pid if w.process is not None and w.state in ("starting", "ready") else None,
                     "in_flight": len(w.held), "in_flight_audio_s": round(w.audio_s, 3), "requests": w.routed,
                     "failures": w.failures, "restarts": w.restarts, "stalls": w.stalls, "error": w.error,
                     "last_exit": w.last_exit}
                    for w in self._workers]
