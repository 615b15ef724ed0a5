"""``glmasr serve --frontends K``: K front-end processes (HTTP and the Realtime WebSocket) on one port over shared
engine processes, so every session's appends, VAD and HTTP work is spread over K interpreters while the engine
still batches every front-end's requests together.

Processes. The ``glmasr serve`` process becomes a supervisor (``Supervisor``): it binds the port, starts the engine
process(es) (``glmasr.workers.attached.EngineHost``: one per device, ``--data-parallel N`` / ``--devices``; one
on ``--device`` otherwise), then K front-end processes (``spawn``; ``frontend_main``), each running uvicorn and the
same app (``app.create_app``) with an ``AttachedEngineClient``: every front-end connects to every engine process
over a Unix socket in the supervisor's private folder (mode 0700, random authkey). The supervisor serves nothing
itself.

The port. Each front-end listens on its own socket bound to the same host:port with ``SO_REUSEPORT``; the kernel
spreads new connections over the listening front-ends by a hash of the connection's addresses. Chosen over one
socket inherited by every front-end because a shared accept queue goes to whichever front-end wakes first, and
asyncio accepts up to a backlog's worth of connections per wake-up: a burst of session openings could land on one
front-end, while the hash spreads them evenly whatever each process is doing. The supervisor first binds the
port with ``SO_REUSEPORT`` (never listening, so it takes no connection) and keeps it bound: a port in use fails
at once with a clear error, ``--port 0`` resolves to one port for every front-end, and the port stays reserved
while a front-end restarts. A front-end that dies loses the connections the kernel had queued for it and not yet
accepted (reset), like its open requests.

Limits, over all front-ends together:
- ``--max-queue`` (default 4 x the engines' slots) and ``--max-realtime-sessions`` (default 8 x the slots) are
  global: each front-end counts its own in one entry of a shared array (``SharedCount``); a request or session is
  admitted when, counting it, the sum is within the limit (never more; two admitted at the same instant on two
  front-ends may refuse one early). A dead front-end's entries are zeroed by the supervisor.
- ``--max-connections`` and ``--max-uploads`` are split: front-end i gets ``n // K`` (+1 for the first ``n % K``),
  so the sum is the flag; each must be >= K.
- ``--drain-timeout``, ``--request-timeout`` and the per-session realtime limits apply per request / session as
  before; the engine watchdog is ``--worker-timeout``.

Lifecycle. Each front-end's ``/health`` says ``warming_up`` until it is connected to every engine (the engines
listen once loaded and warmed up). A front-end that dies is restarted (its requests and sessions are lost; the
new one warms up before it listens, so the others take every connection meanwhile; a
front-end that dies ``GIVE_UP_AFTER`` times in a row before it listens stops the server with status 1). An engine
process that dies fails the requests it held in every front-end at once (503 ``worker_died`` in the envelope; a
stream's or a realtime turn's error carries the same code), is restarted by the supervisor, and the front-ends
reconnect (meanwhile a request gets 503 ``no_worker``). An engine that cannot load stops the server with status 1.
SIGTERM or Ctrl-C: every front-end drains (stops accepting, open realtime sessions get ``shutting_down`` and close
1012, in-flight requests finish within ``--drain-timeout``), then the engines drain and stop; exit status 0. A
second Ctrl-C stops everything at once.

Metrics: see ``metrics.py`` (a scrape sees every front-end's series summed). Each answer carries the header
``X-Glmasr-Frontend: i`` (HTTP responses and the WebSocket handshake), and ``/health`` with the key says
``frontend: {index, pid, frontends, threads}``.

CPU threads: each front-end runs the live sessions' VAD network on the CPU with ``cores // K`` torch threads
(``frontend_threads``), so K front-ends together ask for the cores once, not K times.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

log = logging.getLogger("glmasr.server")
GIVE_UP_AFTER = 3  # front-end deaths in a row before it listened, after which the server stops
STOP_GRACE_S = 15.0  # a front-end still running this long past the drain timeout is killed
FRONTEND_HEADER = b"x-glmasr-frontend"


def share(n: int, k: int, i: int) -> int:
    """Front-end ``i``'s part of a limit ``n`` split over ``k`` front-ends (the parts sum to ``n``)."""
    return n // k + (1 if i < n % k else 0)


class SharedCount:
    """A count summed over the front-ends (``array``: a shared int64 array, one entry per front-end; this one writes
    entry ``index`` only). ``reserve`` counts one more when the total stays within ``limit``."""

    def __init__(self, array, index: int, limit: int):
        self.array, self.index, self.limit = array, index, limit
        self._lock = threading.Lock()

    def total(self) -> int:
        return int(sum(self.array))

    def reserve(self) -> bool:
        with self._lock:
            self.array[self.index] += 1  # first our own entry, then the sum: two front-ends never both pass
            if self.total() > self.limit:
                self.array[self.index] -= 1
                return False
            return True

    def release(self) -> None:
        with self._lock:
            self.array[self.index] -= 1


class Frontend:
    """What one front-end's app needs to know about the others (``app.create_app(..., frontend=)``)."""

    def __init__(self, index: int, count: int, metrics_dir: str, queue_counts, session_counts,
                 warm_first: bool = False):
        self.index, self.count, self.metrics_dir = index, count, metrics_dir
        # warm up before listening (a restarted front-end: the others serve meanwhile; at the start, all warm up
        # together and /health says so)
        self.warm_first = warm_first
        self.pid = os.getpid()
        import torch

        self.threads = torch.get_num_threads()  # frontend_main set it: the cores split over the front-ends
        self._queue_counts, self._session_counts = queue_counts, session_counts
        self.header = (FRONTEND_HEADER, str(index).encode())

    def admission(self, limit: int, metrics):
        """``serving.admission`` counted over every front-end (``--max-queue``: a 429 beyond)."""
        from .serving import admission

        refuse = admission(limit, metrics)._refuse
        return _SharedSlots(SharedCount(self._queue_counts, self.index, limit), refuse, metrics.queue_depth.set)

    def sessions(self, limit: int) -> SharedCount:
        """The open realtime sessions of every front-end (``--max-realtime-sessions``)."""
        return SharedCount(self._session_counts, self.index, limit)

    def header_middleware(self):
        header = self.header

        class FrontendHeader:
            """Adds ``X-Glmasr-Frontend`` to every HTTP response."""

            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http":
                    return await self.app(scope, receive, send)

                async def send_with_header(message):
                    if message["type"] == "http.response.start":
                        message = dict(message)
                        message["headers"] = [*message.get("headers", []), header]
                    await send(message)

                return await self.app(scope, receive, send_with_header)

        return FrontendHeader


def _shared_slots_class():
    from .serving import Slots, Ticket

    class SharedSlots(Slots):
        """``serving.Slots`` whose limit is checked against every front-end's count (``SharedCount``)."""

        def __init__(self, count: SharedCount, refuse, gauge=None):
            super().__init__(count.limit, refuse, gauge)
            self.count = count

        def enter(self) -> Ticket:
            with self._lock:
                if not self.count.reserve():
                    raise self._refuse(self.count.total())
                self.active += 1
                if self._gauge is not None:
                    self._gauge(self.active)
            return Ticket(self)

        def _leave(self) -> None:
            with self._lock:
                self.count.release()
                self.active -= 1
                if self._gauge is not None:
                    self._gauge(self.active)

    return SharedSlots


def _SharedSlots(count, refuse, gauge=None):
    return _shared_slots_class()(count, refuse, gauge)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with ``SO_REUSEPORT`` (not listening yet)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(address)
    except BaseException:
        s.close()
        raise
    return s


@dataclass
class FrontendSpec:
    """Everything a front-end process needs, pickled to it at spawn."""

    index: int
    count: int
    host: str
    port: int
    config: object  # app.ServerConfig, with this front-end's part of the split limits
    endpoints: list
    authkey: bytes
    folder: str  # the checkpoint folder
    slots: int
    pending: object  # EngineHost.pending
    queue_counts: object
    session_counts: object
    metrics_dir: str
    log_level: str
    drain_timeout_s: float
    restarted: bool = False
    threads: int = 1  # torch CPU threads (the live VAD network): the cores split over the front-ends
    word_timestamps: bool = False  # the engines load an aligner (EngineHost.word_timestamps)


def frontend_threads(k: int) -> int:
    """torch CPU threads per front-end of K: the usable cores split evenly. Each front-end runs the live sessions'
    VAD network on the CPU; with torch's default of one thread per core in each, K front-ends would ask for K times
    the cores at once and their spinning OpenMP pools would slow every batch down."""
    from ..workers.process import cores

    return max(1, cores() // k)


def frontend_main(spec: FrontendSpec, pipe) -> None:
    """A front-end process: its own ``SO_REUSEPORT`` socket on the port, uvicorn, the app over the engines.
    Ctrl-C is the supervisor's to handle (it reaches the whole process group); SIGTERM drains."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(spec.threads)
    from ..workers.attached import AttachedEngineClient
    from .app import create_app
    from .http import SWITCH_INTERVAL_S, log_config, make_server, uvicorn_config

    try:
        sock = reuseport_socket(spec.host, spec.port)
    except OSError as e:
        pipe.send(("start_failed", f"cannot bind {spec.host}:{spec.port}: {e}"))
        return
    engine = AttachedEngineClient(spec.endpoints, spec.authkey, spec.folder, spec.slots, spec.pending,
                                  word_timestamps=spec.word_timestamps)
    frontend = Frontend(spec.index, spec.count, spec.metrics_dir, spec.queue_counts, spec.session_counts,
                        warm_first=spec.restarted)
    app = create_app(engine, spec.config, frontend=frontend)
    config = spec.config
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = make_server(uvicorn_config(app, spec.host, spec.port, config.limits, log_level=spec.log_level,
                                        log_config=log_config(spec.log_level),
                                        timeout_graceful_shutdown=spec.drain_timeout_s, lifespan="on",
                                        ws_max_size=config.realtime.ws_max_size),
                         on_exit=app.state.begin_drain, ignore_sigint=True,
                         before_shutdown=app.state.close_live_sessions)
    pipe.send(("listening", os.getpid()))
    pipe.close()
    server.run(sockets=[sock])
    sys.exit(0 if server.started or server.should_exit else 1)


class _Front:
    def __init__(self, index: int):
        self.index = index
        self.process = None
        self.pipe = None
        self.listened = False
        self.deaths = 0  # in a row before it listened
        self.error: str | None = None
        self.restarts = 0


class Supervisor:
    """Runs the engines and K front-ends until a signal (module docstring). ``engine``: an unstarted
    ``EngineHost``; ``config``: the server's ``ServerConfig`` (global limits)."""

    def __init__(self, engine, config, frontends: int, host: str, port: int, warmup: str, drain_timeout_s: float,
                 log_level: str = "info"):
        if frontends < 1:
            raise ValueError(f"--frontends must be at least 1, got {frontends}")
        for name, value in (("--max-connections", config.limits.max_connections),
                            ("--max-uploads", config.limits.max_uploads)):
            if value < frontends:
                raise ValueError(f"{name} {value} is split over the front-ends: give at least --frontends "
                                 f"({frontends})")
        self.engine, self.config, self.k = engine, config, frontends
        self.host, self.port, self.warmup = host, port, warmup
        self.drain_timeout_s, self.log_level = drain_timeout_s, log_level
        self._stop = threading.Event()
        self._force = False
        self.failure: str | None = None

    def _signal(self, signum, frame) -> None:
        if self._stop.is_set() and signum == signal.SIGINT:
            self._force = True  # a second Ctrl-C: no more waiting
        self._stop.set()

    def run(self) -> int:
        import multiprocessing as mp
        from multiprocessing.sharedctypes import RawArray

        try:
            self._reserved = reuseport_socket(self.host, self.port)
        except OSError as e:
            print(f"error: cannot listen on {self.host}:{self.port}: {e}", file=sys.stderr)
            return 1
        self.port = self._reserved.getsockname()[1]
        print(f"serving {self.engine.folder} on {self.k} front-end processes over {len(self.engine.devices)} engine "
              f"process(es) ({','.join(self.engine.devices)}) as {', '.join(self.config.served_names)} at "
              f"http://{self.host}:{self.port}/v1", file=sys.stderr)
        folder = tempfile.mkdtemp(prefix="glmasr-serve-")  # 0700: the sockets and metric files are ours alone
        metrics_dir = os.path.join(folder, "metrics")
        os.mkdir(metrics_dir)
        old_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each front-end's prometheus_client
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signal)
        self._ctx = mp.get_context("spawn")
        self._queue_counts = RawArray("q", self.k)
        self._session_counts = RawArray("q", self.k)
        self._metrics_dir = metrics_dir
        self._authkey = os.urandom(32)
        self._fronts = [_Front(i) for i in range(self.k)]
        try:
            self.engine.start(folder, self._authkey, self.warmup)
            self._endpoints = self.engine.endpoints()
            for f in self._fronts:
                self._spawn(f)
            self._watch()
        finally:
            self._shutdown()
            if old_env is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = old_env
            self._reserved.close()
            shutil.rmtree(folder, ignore_errors=True)
        if self.failure is not None:
            print(f"error: {self.failure}", file=sys.stderr)
            return 1
        return 0

    def _spawn(self, f: _Front) -> None:
        limits = self.config.limits
        config = replace(self.config, limits=replace(
            limits, max_connections=share(limits.max_connections, self.k, f.index),
            max_uploads=share(limits.max_uploads, self.k, f.index)))
        spec = FrontendSpec(index=f.index, count=self.k, host=self.host, port=self.port, config=config,
                            endpoints=self._endpoints, authkey=self._authkey, folder=str(self.engine.folder),
                            slots=self.engine.slots, pending=self.engine.pending, queue_counts=self._queue_counts,
                            session_counts=self._session_counts, metrics_dir=self._metrics_dir,
                            log_level=self.log_level, drain_timeout_s=self.drain_timeout_s,
                            restarted=f.restarts > 0, threads=frontend_threads(self.k),
                            word_timestamps=self.engine.word_timestamps)
        reader, writer = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=frontend_main, args=(spec, writer), daemon=True,
                              name=f"glmasr-frontend{f.index}")
        p.start()
        writer.close()
        f.process, f.pipe, f.listened = p, reader, False

    def _watch(self) -> None:
        from multiprocessing.connection import wait as wait_any

        while not self._stop.is_set():
            waits = [f.process.sentinel for f in self._fronts] + [f.pipe for f in self._fronts if f.pipe]
            ready = set(wait_any(waits, timeout=0.25))
            for f in self._fronts:
                if f.pipe is not None and f.pipe in ready:
                    self._read(f)
                if f.process.sentinel in ready and not self._stop.is_set():
                    self._died(f)
            self._check_engines()

    def _read(self, f: _Front) -> None:
        try:
            msg = f.pipe.recv()
        except (EOFError, OSError):
            f.pipe.close()
            f.pipe = None
            return
        if msg[0] == "listening":
            f.listened, f.deaths, f.error = True, 0, None
        elif msg[0] == "start_failed":
            f.error = msg[1]

    def _died(self, f: _Front) -> None:
        from ..workers.process import describe_exit

        p = f.process
        p.join(5.0)
        if f.pipe is not None:  # what it said before it died (e.g. why it could not start)
            while f.pipe is not None and f.pipe.poll():
                self._read(f)
            if f.pipe is not None:
                f.pipe.close()
                f.pipe = None
        self._forget(f, p.pid)
        why = describe_exit(p.exitcode)
        if not f.listened:
            f.deaths += 1
            if f.deaths >= GIVE_UP_AFTER:
                self.failure = (f"front-end {f.index} could not start ({f.deaths} times; last: "
                                f"{f.error or why})")
                self._stop.set()
                return
        log.warning("front-end %d (pid %d) exited (%s); restarting it", f.index, p.pid, why)
        print(f"glmasr serve: front-end {f.index} (pid {p.pid}) exited ({why}); restarting it", file=sys.stderr)
        f.restarts += 1
        self._spawn(f)

    def _forget(self, f: _Front, pid: int) -> None:
        """A dead front-end's shares of the global counts and its live gauges are gone with it."""
        self._queue_counts[f.index] = 0
        self._session_counts[f.index] = 0
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self._metrics_dir)
        except Exception:  # noqa: BLE001 - metrics only
            pass

    def _check_engines(self) -> None:
        states = self.engine.states()
        gone = [s for s in states if s["state"] == "gone"]
        if not gone:
            return
        never = [s for s in gone if not s["ever_ready"]]
        if never or len(gone) == len(states):
            s = (never or gone)[0]
            self.failure = f"engine process {s['worker']} ({s['device']}) could not start: {s['error']}"
            self._stop.set()

    def _shutdown(self) -> None:
        """Drain the front-ends (SIGTERM: they stop accepting and finish what they hold), then the engines."""
        self.engine.stop_restarts()
        fronts = [f for f in getattr(self, "_fronts", []) if f.process is not None]
        for f in fronts:
            if f.process.is_alive():
                try:
                    os.kill(f.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.drain_timeout_s + STOP_GRACE_S
        for f in fronts:
            while f.process.is_alive() and time.monotonic() < deadline and not self._force:
                f.process.join(0.1)
            if f.process.is_alive():
                f.process.kill()
                f.process.join(5.0)
        self.engine.close(timeout=0.0 if self._force else self.drain_timeout_s)
