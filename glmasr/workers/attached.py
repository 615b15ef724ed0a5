"""``glmasr serve --frontends K``: engine processes shared by several front-end processes.

Two halves, one per side of a Unix socket:

- ``EngineHost`` (the supervisor, ``glmasr.server.frontends``): the worker pool of ``pool.py`` (spawn, ready
  handshake, heartbeat, watchdog, restart, give-up, drain), one engine process per device, each started with
  ``WorkerSpec.listen``: once loaded and warmed up it listens on ``process.engine_address(folder, slot)`` in the
  supervisor's private folder (mode 0700; the connections authenticated with a random ``authkey``) and takes jobs
  from every front-end that connects (``process.py``'s docstring). The pool holds no jobs itself: its watchdog
  reads the jobs an engine holds from the heartbeat (``("progress", rounds, held)``) and kills one whose engine
  made no step for ``worker_timeout_s`` while it held jobs. ``pending`` (a shared int64 array, one entry per
  engine) is the engine's count of jobs held, written by the engine process, read by every front-end.

- ``AttachedEngineClient`` (each front-end, behind ``create_app``): the ``EngineClient`` of ``requests.py``'s
  ``DataParallelEngineClient`` over connections instead of child processes. One thread per engine connects (every
  ``RECONNECT_S`` until the engine listens: it listens only once ready), reads its messages and hands each to its
  request (``requests.RemoteRequest``); one sender thread per connection. Routing over the engines is
  ``DataParallelEngineClient``'s (least audio seconds in flight from this front-end). A connection that breaks
  (the engine process died, or was killed by the supervisor's watchdog) fails every request this front-end had
  there at once with ``EngineUnavailable`` ("worker_died": a 503, or an error event), and the thread reconnects
  once the supervisor has restarted the engine; meanwhile requests get "no_worker" 503s. ``warmup`` waits until
  every engine is connected (``/health`` says warming_up until then). ``num_pending`` is the engines' own count
  (every front-end's requests), so a live session skips drafts when the shared engine is full, whoever filled it.
  ``close`` disconnects (the engine processes belong to the supervisor): the engine aborts what was left there.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path

from ..engine.loop import check_priority
from ..engine.request import Priority
from ..errors import EngineClosed
from .engine_client import WARMUPS, EngineClient
from .pool import Worker, WorkerPool, send_loop
from .process import engine_address
from .requests import RemoteRequest, pick_least_loaded

log = logging.getLogger(__name__)
RECONNECT_S = 0.1  # how often a front-end tries an engine that is not listening (yet, or again)
HELLO_TIMEOUT_S = 10.0  # an engine that accepted a connection says hello within this


class _HostWorker(Worker):
    engine_held = 0  # jobs the engine process holds, from its heartbeat


class EngineHost(WorkerPool):
    """The supervisor's engine processes (module docstring); the arguments are ``DataParallelEngineClient``'s.
    ``start`` names the private folder for the sockets and the authkey every front-end must know."""

    worker_class = _HostWorker

    def __init__(self, devices, model=None, dtype=None, threads: int | None = None,
                 drain_timeout_s: float = 60.0, start_timeout_s: float = 900.0,
                 worker_timeout_s: float | None = 120.0, hooks: dict | None = None, decode_weights: str = "bf16",
                 aligner=None, **engine_options):
        from multiprocessing.sharedctypes import RawArray

        super().__init__(devices, model, dtype, threads=threads, start_timeout_s=start_timeout_s,
                         worker_timeout_s=worker_timeout_s, drain_timeout_s=drain_timeout_s, hooks=hooks,
                         engine_options=engine_options, name="glmasr-engine", decode_weights=decode_weights,
                         aligner=aligner)
        self.socket_folder = ""
        self.authkey = b""
        self.pending = RawArray("q", len(self.devices))
        self.slots = sum(self.options.resolved("cuda" if d.startswith("cuda") else "cpu").max_batch
                         for d in self.devices)

    def start(self, folder: str, authkey: bytes, warmup: str = "full") -> None:
        """Spawn the engine processes: each loads, warms up as ``warmup`` says, then listens in ``folder``."""
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
        self.socket_folder, self.authkey = str(folder), bytes(authkey)
        self._start(warmup=warmup, server=True, listen=(self.socket_folder, self.authkey), pending=self.pending)

    def endpoints(self) -> list[tuple[int, str, str]]:
        """(slot, device, socket address) of every engine: what a front-end connects to."""
        return [(w.slot, w.device, engine_address(self.socket_folder, w.slot)) for w in self._workers]

    def states(self) -> list[dict]:
        with self._cv:
            return [{"worker": w.slot, "device": w.device, "state": w.state, "error": w.error,
                     "pid": w.process.pid if w.process is not None else None, "restarts": w.restarts,
                     "last_exit": w.last_exit, "ever_ready": bool(w.restarts or w.state == "ready")}
                    for w in self._workers]

    # ---- the pool's hooks ----
    def _message(self, w: _HostWorker, msg) -> None:  # with _cv held
        if msg[0] == "progress" and len(msg) > 2:
            if msg[2] and not w.engine_held:  # busy from idle: the watchdog's clock starts now
                w.progress_at = time.monotonic()
            w.engine_held = msg[2]
        super()._message(w, msg)

    def _overdue(self, w: _HostWorker, now: float) -> str | None:
        if w.engine_held and self.worker_timeout_s is not None and now - w.progress_at > self.worker_timeout_s:
            w.stalls += 1
            return f"its engine made no progress for {self.worker_timeout_s:g} s"
        return None

    def _died(self, w: _HostWorker, held: dict, why: str, closing: bool) -> None:
        w.engine_held = 0
        self.pending[w.slot] = 0  # its jobs died with it (the front-ends fail them as their connection breaks)
        if not closing:
            log.warning("engine process %d (%s) ended (%s)%s", w.slot, w.device, why,
                        "; restarting it" if w.state == "starting" else "")


class _Link(Worker):
    """One engine process, as a front-end sees it: its connection, the requests it holds for this front-end."""

    audio_s = 0.0
    picked = 0
    routed = 0
    address = ""
    conn = None
    connected_once = False


class AttachedEngineClient(EngineClient):
    """A front-end's engine client over the supervisor's engine processes (module docstring). ``endpoints``:
    ``EngineHost.endpoints()``; ``pending``: ``EngineHost.pending``; ``slots``: ``EngineHost.slots``;
    ``folder``: the checkpoint folder; ``word_timestamps``: ``EngineHost.word_timestamps``."""

    def __init__(self, endpoints, authkey: bytes, folder, slots: int, pending=None, word_timestamps: bool = False):
        self.folder = Path(folder)
        self.slots = slots
        self._word_timestamps = bool(word_timestamps)
        self._authkey = authkey
        self._pending = pending
        self._links = []
        for slot, device, address in endpoints:
            link = _Link(slot, device, 0)
            link.address = address
            link.state = "starting"
            self._links.append(link)
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._picks = itertools.count(1)
        self._closed = False
        self._started = False

    def start(self) -> None:
        """Start connecting to every engine (idempotent; ``warmup`` calls it)."""
        with self._cv:
            if self._started or self._closed:
                return
            self._started = True
        for link in self._links:
            threading.Thread(target=self._run_link, args=(link,), daemon=True,
                             name=f"glmasr-engine{link.slot}-link").start()

    def warmup(self, mode: str) -> dict:
        """Wait until every engine is connected (each engine warms up as the supervisor said before it listens);
        returns the engines' load and warm-up times."""
        if mode not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {mode!r}")
        self.start()
        with self._cv:
            while not all(link.state == "ready" for link in self._links):
                if self._closed:
                    raise EngineClosed("this engine client is closed")
                self._cv.wait(1.0)
            timings = {}
            for w in self._links:
                timings[f"worker{w.slot}_load_ms"] = w.info.get("load_ms", 0.0)
                for k, v in (w.info.get("warmup_ms") or {}).items():
                    timings[f"worker{w.slot}_{k}"] = v
            return timings

    # ---- connections ----
    def _connect(self, link: _Link):
        from multiprocessing.connection import Client

        try:
            conn = Client(link.address, family="AF_UNIX", authkey=self._authkey)
        except Exception:  # noqa: BLE001 - not listening (yet, or any more), or a stale socket file
            return None
        try:
            if not conn.poll(HELLO_TIMEOUT_S):
                raise EOFError("no hello")
            hello = conn.recv()
            if hello[0] != "hello":
                raise EOFError(f"unexpected first message {hello[0]!r}")
        except Exception:  # noqa: BLE001 - it went away during the handshake: try again
            conn.close()
            return None
        return conn, hello[1]

    def _run_link(self, link: _Link) -> None:
        while True:
            with self._cv:
                if self._closed:
                    link.state = "stopped"
                    self._cv.notify_all()
                    return
            got = self._connect(link)
            if got is None:
                time.sleep(RECONNECT_S)
                continue
            conn, info = got
            sendq = queue.SimpleQueue()
            with self._cv:
                if self._closed:
                    conn.close()
                    continue
                link.conn, link.info, link.sendq, link.state = conn, info, sendq, "ready"
                if link.connected_once:
                    link.restarts += 1
                link.connected_once = True
                self._cv.notify_all()
            threading.Thread(target=self._send_loop, args=(link, sendq, conn), daemon=True,
                             name=f"glmasr-engine{link.slot}-send").start()
            self._read(link, conn)
            sendq.put(None)
            try:
                conn.close()
            except OSError:
                pass
            self._lost(link)

    def _read(self, link: _Link, conn) -> None:
        while True:
            try:
                msg = conn.recv()
            except Exception:  # noqa: BLE001 - EOF: the engine died (or we closed), or a message cut short
                return
            with self._cv:
                req = link.held.get(msg[1]) if len(msg) > 1 else None
                if req is None:  # not (any more) ours: stale
                    continue
                if msg[0] == "end":
                    del link.held[msg[1]]
                    link.audio_s = link.audio_s - req.audio_s if link.held else 0.0
                elif msg[0] == "failed":
                    link.failures += 1
                req._deliver((msg[0], *msg[2:]))
                self._cv.notify_all()

    def _lost(self, link: _Link) -> None:
        with self._cv:
            held, link.held = link.held, {}
            link.audio_s, link.conn, link.sendq = 0.0, None, None
            closing = self._closed
            link.state = "stopped" if closing else "starting"
            if not closing:
                link.failures += len(held)
                link.last_exit = "its connection closed: the engine process ended"
            self._cv.notify_all()
        if closing:
            text, code = f"the server is shutting down: engine {link.slot} ({link.device}) disconnected", \
                "shutting_down"
        else:
            text, code = (f"the engine process serving this request died; engine {link.slot} ({link.device}) is "
                          "being restarted; retry the request"), "worker_died"
        for req in held.values():
            req._deliver(("died", text, code))

    def _send_loop(self, link: _Link, q, conn) -> None:
        def unsendable(job_id, error: str) -> None:
            with self._cv:
                req = link.held.pop(job_id, None)
                if req is not None:
                    req._deliver(("rejected", "error", error))
                    req._deliver(("end",))

        send_loop(q, conn, unsendable)

    # ---- requests ----
    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
               priority=Priority.UPLOAD) -> RemoteRequest:
        priority = check_priority(priority)
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine connections are closed")
            w = pick_least_loaded(self._links, self._picks, "engine process")
            rid = next(self._ids)
            req = RemoteRequest(self, w, rid, audio.duration_s)
            w.audio_s += req.audio_s
            w.held[rid] = req
            w.sendq.put(("submit", rid, audio, decode, t_start, audio_ms, pieces, stream, timeout, priority))
        return req

    def _abort(self, req: RemoteRequest) -> None:
        with self._cv:
            link = req.worker
            if link.held.get(req.rid) is req and link.sendq is not None:
                link.sendq.put(("abort", req.rid))

    # ---- state ----
    @property
    def word_timestamps(self) -> bool:
        return self._word_timestamps

    @property
    def num_pending(self) -> int:
        if self._pending is not None:  # every front-end's requests: the engines' own count
            return int(sum(self._pending))
        with self._cv:
            return sum(len(w.held) for w in self._links)

    def workers(self) -> list[dict]:
        with self._cv:
            return [{"worker": w.slot, "device": w.device, "state": w.state,
                     "pid": w.info.get("pid") if w.state == "ready" else None,
                     "in_flight": len(w.held), "in_flight_audio_s": round(w.audio_s, 3), "requests": w.routed,
                     "failures": w.failures, "restarts": w.restarts, "stalls": 0, "error": w.error,
                     "last_exit": w.last_exit,
                     "engine_in_flight": int(self._pending[w.slot]) if self._pending is not None else None}
                    for w in self._links]

    def close(self) -> None:
        """Disconnect from every engine (requests still held there are aborted by the engine)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            conns = [w.conn for w in self._links if w.conn is not None]
            self._cv.notify_all()
        for conn in conns:  # wakes the reader (EOF): it fails what is left and ends
            try:
                s = socket.socket(fileno=os.dup(conn.fileno()))
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
