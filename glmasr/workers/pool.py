"""The lifecycle of a pool of engine worker processes, one per entry of ``devices`` (the child: ``process.py``).
Two dispatch policies build on it: ``files.py`` (``DevicePool``: files, retried after a crash) and
``requests.py`` (``DataParallelEngineClient``: the server's requests, never retried).

A worker slot's states: ``starting`` (spawned, loading) -> ``ready`` -> (its death) -> ``starting`` again, until
``stopping`` (closing: draining) -> ``stopped``; or ``gone`` (given up).

- Spawn: ``spawn`` context, ``CUDA_VISIBLE_DEVICES`` per CUDA worker, ``cores // len(devices)`` torch threads each
  (``threads``); an entry may repeat (``cuda:0,cuda:0``: two engines on one GPU).
- Ready handshake: the worker says ``ready`` once loaded (and warmed up). ``start_failed``, or no ``ready`` within
  ``start_timeout_s`` (the worker is killed), gives the slot up at once: a load fails the same way every time.
- Heartbeat and watchdog: each worker sends its engine's step count every second; a ready worker that holds jobs
  while that count has not moved for ``worker_timeout_s`` (None: no such watchdog) is killed, and so is one its
  policy finds overdue (``_overdue``: the files' ``file_timeout_s``). The reason goes into its exit text.
- Death: EOF on its pipe or its process sentinel. The pool's one monitor thread reads every message a worker sent
  before it died, then ``_on_death``: the jobs it held go to the policy (``_died``) and the slot is restarted,
  unless the pool is closing or ``stop_restarts`` was called (``stopped``), or it has died ``GIVE_UP_AFTER``
  times in a row before it was ready (``gone``).
- Drain / close: each worker gets ``stop``, finishes what it holds and exits; one still running after the drain
  timeout is killed; a worker still loading is killed at once (it holds nothing).

Jobs: a policy hands a job to a worker with ``_hand`` (the worker then holds it: ``Worker.held``) and gets every
message about it (``_job_message``) until the worker's ``end`` releases it, or its death (``_died``). Threads: the
monitor (reads, deaths, timeouts) and one sender per worker (a large message never blocks the caller, and a
message that cannot be pickled fails its own job). The policy hooks run with the pool's lock (``_cv``) held and
must not block.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from multiprocessing.connection import wait as wait_any

from .process import WorkerSpec, cores, describe_exit, spawn

log = logging.getLogger(__name__)
GIVE_UP_AFTER = 3  # deaths in a row before ready (a load that crashes), after which a slot is given up
_READS = 256  # messages read from one worker before the monitor looks at the others


def parse_devices(devices) -> list[str]:
    """``"cuda:0,cuda:1"`` or a list -> a checked list of device strings ("cpu", "cuda", "cuda:N")."""
    from ..models.device import resolve_device

    if isinstance(devices, str):
        devices = [d for d in (x.strip() for x in devices.split(",")) if d]
    devices = [str(d) for d in devices]
    if not devices:
        raise ValueError("devices is empty: give at least one device, e.g. cuda:0,cuda:1 or cpu,cpu")
    for d in devices:
        resolve_device(d)  # unknown names and missing GPUs fail here, in the caller
    return devices


class Worker:
    """One device's worker process (restarted after a death), the jobs it holds and its counters."""

    def __init__(self, slot: int, device: str, threads: int):
        self.slot, self.device, self.threads = slot, device, threads
        self.state = "new"
        self.process = self.to_child = self.from_child = self.sendq = None
        self.held: dict = {}  # job id -> the policy's record of it
        self.info: dict = {}  # what it said when ready (pid, device, threads, load_ms, warmup_ms)
        self.error: str | None = None  # why it could not start
        self.last_exit: str | None = None
        self.killed_for: str | None = None  # why the pool killed it
        self.deaths = 0  # in a row before ready
        self.restarts = self.failures = self.stalls = 0
        self.progress: int | None = None  # its engine's step count, from the heartbeat
        self.progress_at = self.started_at = 0.0


def send_loop(q, conn, unsendable) -> None:
    """Send each message ``q`` gives on ``conn`` until None comes or the other end is gone (the reader sees that
    and fails what the process held). A ``submit`` that cannot be pickled fails its job alone:
    ``unsendable(job_id, "Type: message")``."""
    while True:
        msg = q.get()
        if msg is None:
            return
        try:
            conn.send(msg)
        except (OSError, EOFError):
            return
        except Exception as e:  # noqa: BLE001 - a message that cannot be pickled
            if msg[0] == "submit":
                unsendable(msg[1], f"{type(e).__name__}: {e}")


class WorkerPool:
    """The lifecycle (module docstring); a policy subclasses it and implements the hooks below."""

    worker_class = Worker

    def __init__(self, devices, model=None, dtype=None, threads: int | None = None, start_timeout_s: float = 900.0,
                 worker_timeout_s: float | None = None, drain_timeout_s: float = 30.0, hooks: dict | None = None,
                 engine_options: dict | None = None, name: str = "glmasr-worker", decode_weights: str = "bf16",
                 aligner=None):
        from ..options import EngineOptions
        from ..checkpoint.weights import DEFAULT_MODEL_ID, read_config, resolve_checkpoint
        from ..models.fast_weights import check_decode_weights

        self.devices = parse_devices(devices)
        check_decode_weights(decode_weights)
        not_cuda = [d for d in self.devices if not d.startswith("cuda")]
        if decode_weights != "bf16" and not_cuda:  # refused here, not once per worker after a load
            raise ValueError(f"decode_weights={decode_weights!r} needs CUDA devices (the Triton path), not "
                             f"{', '.join(not_cuda)}")
        self.decode_weights = decode_weights
        if worker_timeout_s is not None and not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0 (or None: no watchdog), got {worker_timeout_s!r}")
        self.engine_options = {k: v for k, v in (engine_options or {}).items() if v is not None}
        self.options = EngineOptions.from_env(**self.engine_options)  # bad options fail here, not in every worker
        self.folder = resolve_checkpoint(model if model is not None else DEFAULT_MODEL_ID)  # a download: once, here
        config = read_config(self.folder)  # a broken config fails here, once
        self.model = str(self.folder)
        # word times: the head is found (a hub id downloads here, once) and checked against the model here, so a
        # bad head fails before any worker starts; each worker loads it from the resolved folder
        self.aligner: str | None = None
        if aligner is not None:
            from ..align import load_aligner

            if not isinstance(aligner, (str, os.PathLike)):
                raise TypeError(f"aligner must be a glm-asr-ctc head folder or hub id (each worker process loads "
                                f"its own), got {type(aligner).__name__}")
            self.aligner = load_aligner(aligner, self.folder, "cpu", model_config=config).source
        self.dtype = None if dtype is None else str(dtype).replace("torch.", "")
        self.start_timeout_s = start_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._hooks = dict(hooks or {})
        self._name = name
        per = max(1, cores() // len(self.devices)) if threads is None else int(threads)
        self._workers = [self.worker_class(i, d, per) for i, d in enumerate(self.devices)]
        self._cv = threading.Condition()
        self._spec: dict = {}
        self._ctx = None
        self._closed = False
        self._no_restarts = False

    @property
    def word_timestamps(self) -> bool:
        """Every worker loads an aligner (``EngineClient.word_timestamps``; a supervisor's front-ends are told)."""
        return self.aligner is not None

    # ---- the policy's hooks (called with _cv held) ----
    def _job_message(self, w: Worker, item, msg) -> None:
        """A message about a job ``w`` holds (``item``: what ``_hand`` got); after ``end`` it holds it no more."""

    def _died(self, w: Worker, held: dict, why: str, closing: bool) -> None:
        """``w`` died (``why``: its exit) holding ``held``; it is already restarted, stopped or given up."""

    def _overdue(self, w: Worker, now: float) -> str | None:
        """Why ready ``w`` must be killed now (its death then handles its jobs), or None."""
        return None

    # ---- for the policy ----
    def _start(self, **spec) -> None:
        """Spawn every worker (``spec``: ``WorkerSpec``'s warmup / server) and the monitor thread."""
        import torch.multiprocessing as tmp

        with self._cv:
            if self._closed:
                raise RuntimeError("this worker pool is closed")
            self._ctx = tmp.get_context("spawn")
            self._spec = spec
            try:
                for w in self._workers:
                    self._spawn(w)
            finally:  # also when a spawn failed: the ones started are reaped and closed as usual
                threading.Thread(target=self._monitor, name=f"{self._name}-monitor", daemon=True).start()

    def _hand(self, w: Worker, jid, item, msg) -> None:
        """``w`` holds job ``jid`` from now on; ``msg`` (its "submit") goes to it."""
        if not w.held:  # idle until now: the watchdog's clock starts with this job
            w.progress_at = time.monotonic()
        w.held[jid] = item
        w.sendq.put(msg)

    def wait_started(self, timeout: float | None = None) -> None:
        """Wait until no worker is loading (each is ready or given up); ``TimeoutError`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                starting = [w for w in self._workers if w.state == "starting"]
                if not starting:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"worker(s) not ready after {timeout:g} s: "
                                       + ", ".join(f"{w.slot} ({w.device})" for w in starting))
                self._cv.wait(1.0 if left is None else min(left, 1.0))

    def stop_restarts(self) -> None:
        """From now on a worker that exits is not restarted (shutting down: a SIGTERM)."""
        with self._cv:
            self._no_restarts = True

    def close(self, timeout: float | None = None) -> None:
        """Drain: every worker finishes what it holds, then exits (killed after ``timeout``, default
        ``drain_timeout_s``); jobs still held then go to the policy as the worker stops."""
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
        for w in loading:  # holds nothing: nothing to drain
            w.process.kill()
        with self._cv:  # the monitor reaps each worker and marks it stopped
            if not self._cv.wait_for(lambda: all(w.state != "stopping" for w in running), timeout=timeout):
                for w in running:
                    if w.state == "stopping":
                        w.process.kill()
                self._cv.wait_for(lambda: all(w.state != "stopping" for w in running), timeout=10.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- processes ----
    def _spawn(self, w: Worker) -> None:  # with _cv held
        def spec(device):
            return WorkerSpec(slot=w.slot, device=device, model=self.model, dtype=self.dtype,
                              engine_options=self.engine_options, threads=w.threads, hooks=self._hooks,
                              decode_weights=self.decode_weights, aligner=self.aligner, **self._spec)

        w.process, w.to_child, w.from_child = spawn(self._ctx, spec, w.device, f"{self._name}{w.slot}")
        w.sendq = queue.SimpleQueue()
        w.state, w.info, w.killed_for, w.progress = "starting", {}, None, None
        w.started_at = time.monotonic()
        threading.Thread(target=self._send_loop, args=(w, w.sendq, w.to_child), daemon=True,
                         name=f"{self._name}{w.slot}-send").start()

    def _send_loop(self, w: Worker, q, conn) -> None:
        def unsendable(job_id, error: str) -> None:  # its death, if any, hands the rest to the policy
            with self._cv:
                self._message(w, ("rejected", job_id, "error", error))
                self._message(w, ("end", job_id))

        send_loop(q, conn, unsendable)

    def _monitor(self) -> None:
        """The one thread that reads every worker's messages, sees deaths and kills what the timeouts say."""
        period = 0.5 if self.worker_timeout_s is None else min(0.5, self.worker_timeout_s / 4)
        while True:
            with self._cv:
                live = [w for w in self._workers if w.state in ("starting", "ready", "stopping")]
            if not live:  # all stopped or given up: nothing will be spawned again
                return
            ready = set(wait_any([w.from_child for w in live] + [w.process.sentinel for w in live], timeout=period))
            for w in live:
                if w.from_child in ready or w.process.sentinel in ready:
                    if self._read(w) or w.process.sentinel in ready:
                        self._on_death(w)
            self._tick()

    def _read(self, w: Worker) -> bool:
        """The messages ``w`` has sent (up to ``_READS``); True once its pipe is closed (its process ends)."""
        for _ in range(_READS):
            try:
                if not w.from_child.poll():
                    return False
                msg = w.from_child.recv()
            except Exception:  # noqa: BLE001 - EOF, or a message cut short by its death
                return True
            with self._cv:
                try:
                    self._message(w, msg)
                except Exception:  # noqa: BLE001 - a bug here must not stop the monitor
                    log.exception("worker %d: cannot handle the message %r", w.slot, msg[:2])
        return False

    def _message(self, w: Worker, msg) -> None:  # with _cv held
        kind = msg[0]
        if kind == "ready":
            w.info, w.error, w.deaths = msg[1], None, 0
            w.progress_at = time.monotonic()
            if w.state == "starting":
                w.state = "ready"
        elif kind == "start_failed":
            w.error = msg[1]
        elif kind == "progress":
            if msg[1] != w.progress:
                w.progress, w.progress_at = msg[1], time.monotonic()
            return
        else:
            item = w.held.get(msg[1])
            if item is None:  # not (any more) this worker's: a stale message
                return
            if kind == "end":
                del w.held[msg[1]]
            elif kind == "failed":
                w.failures += 1
            self._job_message(w, item, msg)
        self._cv.notify_all()

    def _on_death(self, w: Worker) -> None:
        p = w.process
        p.join(5.0)
        if p.is_alive():  # its pipe closed but it lingers
            p.kill()
            p.join(5.0)
        why = describe_exit(p.exitcode) + (f": {w.killed_for}" if w.killed_for else "")
        w.sendq.put(None)
        for c in (w.to_child, w.from_child):
            try:
                c.close()
            except OSError:
                pass
        with self._cv:
            held, w.held = w.held, {}
            w.last_exit, w.progress = why, None
            closing = self._closed or w.state == "stopping"
            if closing:
                w.state = "stopped"
            elif w.state == "starting" and (w.error is not None or w.killed_for is not None):
                w.state, w.error = "gone", w.error or why  # a load fails the same way every time
            else:
                w.failures += len(held)
                if w.state == "starting":
                    w.deaths += 1
                if self._no_restarts:
                    w.state = "stopped"
                elif w.deaths >= GIVE_UP_AFTER:
                    w.state, w.error = "gone", f"died {w.deaths} times while loading ({why})"
                else:
                    w.restarts += 1
                    try:
                        self._spawn(w)
                    except Exception as e:  # noqa: BLE001 - cannot even start a process: give the slot up
                        w.state, w.error = "gone", f"cannot start a worker process: {type(e).__name__}: {e}"
            self._died(w, held, why, closing)
            self._cv.notify_all()

    def _tick(self) -> None:
        now = time.monotonic()
        kill = []
        with self._cv:
            for w in self._workers:
                if w.killed_for is not None:
                    continue
                if w.state == "starting" and now - w.started_at > self.start_timeout_s:
                    w.killed_for = f"not loaded after {self.start_timeout_s:g} s"
                elif w.state == "ready" and w.held and self.worker_timeout_s is not None \
                        and now - w.progress_at > self.worker_timeout_s:
                    w.killed_for = f"its engine made no progress for {self.worker_timeout_s:g} s"
                    w.stalls += 1
                elif w.state == "ready":
                    w.killed_for = self._overdue(w, now)
                if w.killed_for is not None:
                    kill.append(w)
        for w in kill:
            log.warning("worker %d (%s): %s; killing it", w.slot, w.device, w.killed_for)
            w.process.kill()
