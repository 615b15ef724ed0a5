"""``glmasr serve --data-parallel N``: one front end, N engine worker processes (one per device), behind the same
``EngineClient`` interface as the single in-process engine (``engine_client.py``).

Process layout. The front end (the uvicorn process) does everything but the model: HTTP, auth, upload limits,
audio decoding (``decode_audio_bytes``), VAD pieces for ``chunking_strategy``, admission, SSE, metrics. Each
worker (``engine_worker.py``) owns one loaded model on its device and runs the single-engine server's own
request path (``submit_loaded``: planning, the engine, the transcript assembler). A request travels as its
decoded 16 kHz samples + ``DecodeOptions`` + VAD pieces; its ``TranscriptDelta``s come back as they are made, the
last one with the finished ``Transcription``, so streaming and results are exactly the single engine's. Pipes
carry the messages (one per direction per worker, the plumbing of ``glmasr.parallel``): a worker that dies breaks
only its own pipes, and is seen at once (EOF on its pipe, its process sentinel). Per worker, one sender thread
writes the pipe (a long upload's samples never block the event loop, and aborts queue behind nothing but
earlier messages) and one reader thread reads it.

Routing: the ready worker with the fewest seconds of audio in flight (ties: fewer requests, then the one picked
least recently, so an idle pool alternates). Audio seconds, not request counts, because a worker's remaining work
grows with the audio it holds (windows to encode, ~6 tokens a second of budget): one 20-minute file and forty
30-second clips are the same load, one request and one request are not.

Failures. A worker that dies (crash, OOM kill, ``kill -9``) fails each request it held, at once, with
``EngineUnavailable`` (a 503 in the error envelope, or an ``error`` event on a stream; never a hang), and is
restarted (it loads and warms up again; ``restarts`` counts it). Requests are not retried on another worker: a
request that killed one worker would kill the next. A worker that fails to load (``start_failed``) or dies
``START_DEATHS`` times in a row while loading is given up ("gone"). While a worker is not ready the others take
all requests; with none ready a request gets a 503 (``no_worker``). A client that disconnects aborts its request in
its worker (an ``abort`` message; the worker's ``end`` says its slots are free). ``close`` drains: each worker
finishes what it holds and exits (killed after ``drain_timeout_s``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from multiprocessing.connection import wait as wait_any

from ..audio import AudioError
from ..engine.loop import EngineClosed, EngineError
from ..options import EngineOptions
from .engine_client import WARMUPS, EngineClient, EngineRequest, EngineUnavailable

log = logging.getLogger(__name__)
START_DEATHS = 3  # deaths in a row before ready, after which a worker slot is given up
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

    def _deliver(self, msg) -> None:  # the reader thread
        if msg[0] == "first":
            self.first_output_at = msg[1]
            return
        if msg[0] in ("end", "died"):
            self.finished = True
        self._inbox.put(msg)

    def _error(self, msg) -> BaseException:
        kind = msg[0]
        if kind == "died":
            return EngineUnavailable(msg[1], msg[2])
        what, text = msg[1], msg[2]
        if kind == "rejected":
            return {"audio": AudioError, "value": ValueError, "closed": EngineClosed}.get(what, EngineError)(text)
        return EngineError(text)  # failed: engine or error

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


class _Worker:
    """One device's worker process (restarted after a death) and the requests it holds."""

    def __init__(self, slot: int, device: str, threads: int):
        self.slot, self.device, self.threads = slot, device, threads
        self.state = "new"  # new | starting | ready | stopping | stopped | gone
        self.process = self.conn_in = self.conn_out = self.sendq = None
        self.requests: dict[int, RemoteRequest] = {}
        self.audio_s = 0.0
        self.picked = 0  # sequence number of its last pick (the tie-break)
        self.routed = self.failures = self.restarts = 0
        self.start_deaths = 0
        self.info: dict = {}
        self.error: str | None = None
        self.last_exit: str | None = None
        self.progress: int | None = None  # the engine's step count, from the worker's heartbeat
        self.progress_at = time.monotonic()  # when it last moved (or the worker last went from idle to busy)
        self.stalled: str | None = None  # why the watchdog killed it
        self.stalls = 0


class DataParallelEngineClient(EngineClient):
    """N engine worker processes, one per entry of ``devices`` (e.g. ``["cuda:0", "cuda:1"]``, or ``"cpu,cpu"``;
    an entry may repeat: two engines on one GPU). model: a checkpoint folder or hub id (resolved here, once).
    engine_options: ``EngineOptions`` fields for every worker (max_batch, ...). threads: torch threads per worker
    (default: the cores split evenly). The workers start with ``warmup(mode)`` (the app's lifespan calls it) and
    report ready once loaded and warmed up; ``close`` drains and stops them."""

    def __init__(self, devices, model=None, dtype=None, threads: int | None = None, drain_timeout_s: float = 60.0,
                 start_timeout_s: float = 900.0, worker_timeout_s: float | None = 120.0,
                 _test_hooks: dict | None = None, **engine_options):
        import torch.multiprocessing as tmp

        from ..parallel.pool import parse_devices
        from ..parallel.process import cores
        from ..weights import DEFAULT_MODEL_ID, read_config, resolve_checkpoint

        self.devices = parse_devices(devices)
        self.engine_options = {k: v for k, v in engine_options.items() if v is not None}
        options = EngineOptions.from_env(**self.engine_options)  # bad options fail here, not in every worker
        self.folder = resolve_checkpoint(model if model is not None else DEFAULT_MODEL_ID)
        read_config(self.folder)
        self.model = str(self.folder)
        self.dtype = None if dtype is None else str(dtype).replace("torch.", "")
        self.slots = sum(options.resolved("cuda" if d.startswith("cuda") else "cpu").max_batch for d in self.devices)
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        if worker_timeout_s is not None and not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0 (or None: no watchdog), got {worker_timeout_s!r}")
        self.worker_timeout_s = worker_timeout_s
        self._hooks = dict(_TEST_HOOKS if _test_hooks is None else _test_hooks)
        self._ctx = tmp.get_context("spawn")
        per = max(1, cores() // len(self.devices)) if threads is None else int(threads)
        self._workers = [_Worker(i, d, per) for i, d in enumerate(self.devices)]
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._picks = itertools.count(1)
        self._warmup: str | None = None
        self._closed = False
        self._no_restarts = False

    # ---- processes ----
    def _start(self, w: _Worker) -> None:  # with self._cv held
        from ..parallel.process import start_worker
        from .engine_worker import EngineWorkerSpec, engine_worker_main

        def args(device):
            return (EngineWorkerSpec(slot=w.slot, device=device, model=self.model, dtype=self.dtype,
                                     engine_options=self.engine_options, threads=w.threads, warmup=self._warmup,
                                     hooks=self._hooks),)

        p, conn_out, conn_in = start_worker(self._ctx, engine_worker_main, w.device, args,
                                            f"glmasr-engine{w.slot}")
        w.process, w.conn_out, w.conn_in = p, conn_out, conn_in
        w.sendq = queue.SimpleQueue()
        w.state, w.info = "starting", {}
        threading.Thread(target=self._send_loop, args=(w, w.sendq, conn_out), daemon=True,
                         name=f"glmasr-engine{w.slot}-send").start()
        threading.Thread(target=self._read_loop, args=(w, p, conn_in, conn_out, w.sendq), daemon=True,
                         name=f"glmasr-engine{w.slot}-read").start()

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
            for w in self._workers:
                self._start(w)
        if self.worker_timeout_s is not None:
            threading.Thread(target=self._watchdog, name="glmasr-engine-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """Kill a ready worker whose engine has made no step for ``worker_timeout_s`` while it holds requests (a
        stuck kernel, a deadlock): its death then fails them with a 503 and restarts it, so nothing hangs."""
        period = min(1.0, self.worker_timeout_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._cv:
                if self._closed:
                    return
                stuck = [w for w in self._workers if w.state == "ready" and w.requests
                         and now - w.progress_at > self.worker_timeout_s]
                for w in stuck:
                    w.stalled = f"its engine made no progress for {self.worker_timeout_s:g} s"
                    w.stalls += 1
                    w.progress_at = now  # killed once; the reader sees it die
            for w in stuck:
                log.warning("engine worker %d (%s): %s; killing it", w.slot, w.device, w.stalled)
                w.process.kill()

    def warmup(self, mode: str) -> dict:
        """Start the workers (if not yet) and wait until every one is ready. Raises if one was given up (it could
        not load the model) or none is ready after ``start_timeout_s``."""
        self.start(mode)
        deadline = time.monotonic() + self.start_timeout_s
        with self._cv:
            while any(w.state == "starting" for w in self._workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engine workers not ready after {self.start_timeout_s:g} s: "
                                       + ", ".join(f"{w.slot} ({w.device})" for w in self._workers
                                                   if w.state == "starting"))
                self._cv.wait(min(left, 1.0))
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

    def _send_loop(self, w: _Worker, q, conn) -> None:
        while True:
            msg = q.get()
            if msg is None:
                return
            try:
                conn.send(msg)
            except (OSError, EOFError):  # it died: its reader fails what it held
                return
            except Exception as e:  # noqa: BLE001 - a message that cannot be pickled fails its request alone
                if msg[0] == "submit":
                    self._finish_locally(w, msg[1], ("rejected", "error", f"{type(e).__name__}: {e}"))

    def _finish_locally(self, w: _Worker, rid: int, msg) -> None:
        with self._cv:
            req = w.requests.pop(rid, None)
            if req is not None:
                w.audio_s -= req.audio_s
        if req is not None:
            req._deliver(msg)
            req._deliver(("end",))

    def _read_loop(self, w: _Worker, proc, conn, conn_out, q) -> None:
        while True:
            try:
                ready = wait_any([conn, proc.sentinel])
                if conn not in ready and not conn.poll():
                    break  # the process ended and left nothing to read
                msg = conn.recv()
            except Exception:  # noqa: BLE001 - EOF, or a message cut short by its death
                break
            try:
                self._dispatch(w, msg)
            except Exception:  # noqa: BLE001 - a bug here must not stop this worker's reader
                log.exception("engine worker %d: cannot handle the message %r", w.slot, msg[:2])
        self._on_death(w, proc, conn, conn_out, q)

    def _dispatch(self, w: _Worker, msg) -> None:
        kind = msg[0]
        if kind == "ready":
            with self._cv:
                w.info, w.error, w.start_deaths = msg[1], None, 0
                w.progress_at = time.monotonic()
                if w.state == "starting":
                    w.state = "ready"
                self._cv.notify_all()
            return
        if kind == "start_failed":
            with self._cv:
                w.error = msg[1]
            return
        if kind == "progress":
            with self._cv:
                if msg[1] != w.progress:
                    w.progress, w.progress_at = msg[1], time.monotonic()
            return
        rid = msg[1]
        with self._cv:
            req = w.requests.get(rid)
            if req is None:
                return
            if kind == "end":
                del w.requests[rid]
                w.audio_s -= req.audio_s
                if not w.requests:
                    w.audio_s = 0.0  # no float drift
            elif kind == "failed":
                w.failures += 1
        req._deliver((kind, *msg[2:]))

    def _on_death(self, w: _Worker, proc, conn, conn_out, q) -> None:
        from ..parallel.process import describe_exit

        proc.join(5.0)
        why = describe_exit(proc.exitcode)
        q.put(None)
        for c in (conn, conn_out):
            try:
                c.close()
            except OSError:
                pass
        with self._cv:
            held, w.requests, w.audio_s = w.requests, {}, 0.0
            if w.stalled is not None:
                why, w.stalled = f"{why}: {w.stalled}", None
            w.last_exit = why
            w.progress = None
            closing = self._closed or w.state == "stopping"
            if closing:
                w.state = "stopped"
            elif w.error is not None and w.state == "starting":
                w.state = "gone"  # loading fails the same way every time: not restarted
            else:
                if w.state == "starting":
                    w.start_deaths += 1
                w.failures += len(held)
                if self._no_restarts:
                    w.state = "stopped"
                elif w.start_deaths >= START_DEATHS:
                    w.state, w.error = "gone", f"died {w.start_deaths} times while loading ({why})"
                else:
                    w.restarts += 1
                    self._start(w)
            self._cv.notify_all()
        if closing:
            text, code = f"the server is shutting down: engine worker {w.slot} ({w.device}) stopped ({why})", \
                "shutting_down"
        else:
            text, code = (f"the engine worker process serving this request died ({why}); worker {w.slot} "
                          f"({w.device}) is being restarted; retry the request"), "worker_died"
        for req in held.values():
            req._deliver(("died", text, code))

    # ---- requests ----
    def _pick(self) -> _Worker:
        ready = [w for w in self._workers if w.state == "ready"]
        if not ready:
            states = ", ".join(f"{w.slot}: {w.state}" for w in self._workers)
            raise EngineUnavailable(f"no engine worker is ready to take the request ({states}); retry shortly",
                                    "no_worker")
        return min(ready, key=lambda w: (w.audio_s, len(w.requests), w.picked))

    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False) -> RemoteRequest:
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine workers are shut down")
            w = self._pick()
            if not w.requests:  # idle until now: the watchdog's clock starts with this request
                w.progress_at = time.monotonic()
            rid = next(self._ids)
            req = RemoteRequest(self, w, rid, audio.duration_s)
            w.requests[rid] = req
            w.audio_s += req.audio_s
            w.routed += 1
            w.picked = next(self._picks)
            q = w.sendq
        q.put(("submit", rid, audio, decode, t_start, audio_ms, pieces, stream))
        return req

    def _abort(self, req: RemoteRequest) -> None:
        with self._cv:
            w = req.worker
            q = w.sendq if w.requests.get(req.rid) is req else None
        if q is not None:
            q.put(("abort", req.rid))

    # ---- state ----
    @property
    def num_pending(self) -> int:
        with self._cv:
            return sum(len(w.requests) for w in self._workers)

    def workers(self) -> list[dict]:
        with self._cv:
            return [{"worker": w.slot, "device": w.device, "state": w.state,
                     "pid": w.process.pid if w.process is not None and w.state in ("starting", "ready") else None,
                     "in_flight": len(w.requests), "in_flight_audio_s": round(w.audio_s, 3), "requests": w.routed,
                     "failures": w.failures, "restarts": w.restarts, "stalls": w.stalls, "error": w.error,
                     "last_exit": w.last_exit}
                    for w in self._workers]

    def stop_restarts(self) -> None:
        """From now on a worker that exits is not restarted (the server is shutting down: SIGTERM)."""
        with self._cv:
            self._no_restarts = True

    def close(self, timeout: float | None = None) -> None:
        """Drain: every worker finishes the requests it holds, then exits (killed after ``timeout``, default
        ``drain_timeout_s``); requests still held then fail as the worker stops."""
        timeout = self.drain_timeout_s if timeout is None else timeout
        with self._cv:
            if self._closed:
                return
            self._closed = True
            running = [w for w in self._workers if w.state in ("starting", "ready")]
            loading = [w for w in running if w.state == "starting"]
            for w in running:
                w.state = "stopping"
                w.sendq.put(("stop",))
        for w in loading:  # holds no request: nothing to drain
            w.process.kill()
        with self._cv:  # each worker's reader joins its process and marks it stopped
            done = self._cv.wait_for(lambda: all(w.state != "stopping" for w in running), timeout=timeout)
            late = [] if done else [w for w in running if w.state == "stopping"]
        for w in late:
            w.process.kill()
        with self._cv:
            self._cv.wait_for(lambda: all(w.state != "stopping" for w in running), timeout=10.0)
