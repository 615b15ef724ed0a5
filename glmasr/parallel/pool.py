"""Many devices, one machine: one engine process per device, files handed out as workers have room.

    from glmasr.parallel import transcribe_files
    results = transcribe_files(paths, devices=["cuda:0", "cuda:1"], model="zai-org/GLM-ASR-Nano-2512")

or, keeping the workers loaded between batches and taking results as they finish:

    with DevicePool(["cuda:0", "cuda:1"], model=folder, decode=DecodeOptions(segmentation="vad")) as pool:
        for fr in pool.run(paths):          # completion order; fr.index is the position in ``paths``
            ...

Design (see also ``worker.py``):

- One process per entry of ``devices`` (``torch.multiprocessing``, ``spawn`` context; an entry may repeat, e.g.
  ``cuda:0,cuda:0`` runs two engines on one GPU). A CUDA worker sees only its GPU (``CUDA_VISIBLE_DEVICES`` is
  set for the child), each worker gets ``cores // len(devices)`` torch threads.
- The files wait in one queue in the parent. A worker is handed the next file whenever it holds fewer than
  ``in_flight`` files (and not more than its fair share of what is left), so its engine batches the files it
  holds; a slow worker or a long file holds back only that worker's own files. Handing out from the parent (not
  from a queue the workers read) means the parent always knows which files each worker holds.
- Results come back on a pipe per worker as each file finishes; ``run`` yields them at once (the CLI writes a
  file's outputs there). ``transcribe_files`` returns them in input order.
- A worker that dies (a crash, an OOM kill, ``file_timeout_s`` passed) is restarted, and the files it held are
  retried, each on a worker that holds nothing else, so a file that kills again is known to be the cause. A file
  is retried at most ``retries`` times; after that it is reported failed (with the exit status), never lost. When
  no worker can be started any more the files left are reported failed, so ``run`` always ends.
- A file that cannot be read or transcribed fails alone (``FileResult.error``), without retries: that is not a
  crash.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Callable, Iterable, Iterator

from ..options import DecodeOptions
from ..results import Transcription
from .process import cores, describe_exit, start_worker
from .worker import WorkerSpec, worker_main

DEFAULT_IN_FLIGHT = {"cuda": 16, "cpu": 4}
IDLE_DEATHS = 2  # deaths holding no file (e.g. killed while loading) a slot survives before it is given up


class WorkerStartError(RuntimeError):
    """No worker could load the model (the messages of every worker that tried)."""


@dataclass
class FileResult:
    """One input's outcome: ``result`` (a ``Transcription``) or ``error`` (a message naming the problem)."""

    index: int  # position in the list given to ``run`` / ``transcribe_files``
    path: str
    result: Transcription | None = None
    error: str | None = None
    device: str | None = None  # the device of the worker that produced the result (as given in ``devices``)
    worker: int | None = None  # that worker's slot (position in ``devices``)
    attempts: int = 0  # how many times the file was handed to a worker (> 1 after a worker died with it)
    wall_ms: float = 0.0  # from its first hand-out to its result

    @property
    def ok(self) -> bool:
        return self.result is not None


def parse_devices(devices) -> list[str]:
    """``"cuda:0,cuda:1"`` or a list -> a checked list of device strings ("cpu", "cuda", "cuda:N")."""
    from ..device import resolve_device

    if isinstance(devices, str):
        devices = [d for d in (x.strip() for x in devices.split(",")) if d]
    devices = [str(d) for d in devices]
    if not devices:
        raise ValueError("devices is empty: give at least one device, e.g. cuda:0,cuda:1 or cpu,cpu")
    for d in devices:
        resolve_device(d)  # unknown names and missing GPUs fail here, in the caller
    return devices


class _Task:
    __slots__ = ("index", "path", "crashes", "attempts", "t_first", "exits", "done")

    def __init__(self, index: int, path: str):
        self.index, self.path = index, path
        self.crashes = self.attempts = 0
        self.t_first: float | None = None
        self.exits: list[str] = []
        self.done = False


class _Slot:
    """One device's worker process (restarted after a crash) and the files it holds."""

    def __init__(self, slot: int, device: str, threads: int, in_flight: int):
        self.slot, self.device, self.threads, self.capacity = slot, device, threads, in_flight
        self.process = self.tasks = self.results = None
        self.state = "new"  # new | starting | ready | gone (given up)
        self.inflight: dict[int, float] = {}  # task id -> time handed out
        self.isolated = False  # holds a file that was in flight when a worker died: gets nothing else
        self.draining = False  # gets nothing new until empty, then takes such a file
        self.idle_deaths = 0
        self.started_at = 0.0
        self.killed_for: str | None = None  # why the parent killed it (a timeout)
        self.info: dict = {}
        self.start_error: str | None = None


class DevicePool:
    """Worker processes, one per entry of ``devices``, each with the model loaded (see the module docstring).

    model: a checkpoint folder or hub id (resolved once here, so a download happens once, in the caller).
    decode: ``DecodeOptions`` for every file. in_flight: files a worker holds at once (default 16 on CUDA, 4 on
    the CPU). retries: how many times a file that was in flight when a worker died is tried again.
    file_timeout_s: a worker holding one file longer than this is killed (then as a crash). start_timeout_s: a
    worker not loaded by then is given up. threads: torch threads per worker (default: the cores split evenly).
    engine_options: ``EngineOptions`` fields (max_batch, ...). Call ``close`` (or use ``with``) when done.

    The calling program must be importable without side effects (``if __name__ == "__main__":``), as always with
    the ``spawn`` start method.
    """

    def __init__(self, devices, model=None, dtype=None, decode: DecodeOptions | None = None,
                 in_flight: int | None = None, retries: int = 2, file_timeout_s: float | None = None,
                 start_timeout_s: float = 900.0, threads: int | None = None, _test_hooks: dict | None = None,
                 **engine_options):
        import torch.multiprocessing as tmp

        from ..options import EngineOptions
        from ..weights import DEFAULT_MODEL_ID, read_config, resolve_checkpoint

        self.devices = parse_devices(devices)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)
                                      or in_flight < 1):
            raise ValueError(f"in_flight must be a positive integer, got {in_flight!r}")
        EngineOptions.from_env(**engine_options)  # unknown or bad options fail here, not in every worker
        self.decode = decode or DecodeOptions()
        self.retries = retries
        self.file_timeout_s = file_timeout_s
        self.start_timeout_s = start_timeout_s
        folder = resolve_checkpoint(model if model is not None else DEFAULT_MODEL_ID)
        read_config(folder)  # a broken config fails here, once
        self.model = str(folder)
        self.dtype = None if dtype is None else str(dtype).replace("torch.", "")
        self.engine_options = {k: v for k, v in engine_options.items() if v is not None}
        self._hooks = dict(_test_hooks or {})
        self._ctx = tmp.get_context("spawn")
        per = max(1, cores() // len(self.devices)) if threads is None else int(threads)
        self._slots = []
        for i, d in enumerate(self.devices):
            kind = "cuda" if d.startswith("cuda") else "cpu"
            self._slots.append(_Slot(i, d, per, in_flight or DEFAULT_IN_FLIGHT[kind]))
        self._next_task = 0
        self._broken = False
        self._closed = False
        try:
            for s in self._slots:
                self._start(s)
        except BaseException:
            self.close(timeout=5.0)
            raise

    # ---- processes ----
    def _start(self, s: _Slot) -> None:
        def args(device):
            return (WorkerSpec(slot=s.slot, device=device, model=self.model, dtype=self.dtype,
                               engine_options=self.engine_options, decode=self.decode, in_flight=s.capacity,
                               threads=s.threads, hooks=self._hooks),)

        p, tasks_w, results_r = start_worker(self._ctx, worker_main, s.device, args, f"glmasr-worker{s.slot}")
        s.process, s.tasks, s.results = p, tasks_w, results_r
        s.state, s.started_at, s.killed_for, s.info = "starting", time.monotonic(), None, {}
        s.isolated = s.draining = False

    def _alive(self) -> list[_Slot]:
        return [s for s in self._slots if s.state in ("starting", "ready")]

    def workers(self) -> list[dict]:
        """Each slot's device, state and what its worker said when it was ready (pid, threads, load_ms)."""
        return [{"slot": s.slot, "device": s.device, "state": s.state, **s.info} for s in self._slots]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (they finish nothing more: call it when ``run`` is done)."""
        if self._closed:
            return
        self._closed = True
        for s in self._slots:
            if s.process is not None and s.process.is_alive():
                try:
                    s.tasks.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for s in self._slots:
            if s.process is None:
                continue
            s.process.join(max(0.0, deadline - time.monotonic()))
            if s.process.is_alive():
                s.process.kill()
                s.process.join(5.0)
            for c in (s.tasks, s.results):
                c.close()
            s.state = "gone"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the run ----
    def run(self, paths: Iterable, on_result: Callable[[FileResult], None] | None = None) -> Iterator[FileResult]:
        """Transcribe ``paths`` (files); yields a ``FileResult`` per path as each finishes (completion order),
        exactly once each. Raises ``WorkerStartError`` if no worker could load the model. Leaving the iteration
        early stops the workers (the pool cannot be used after that)."""
        if self._closed or self._broken:
            raise RuntimeError("this DevicePool is closed")
        tasks: dict[int, _Task] = {}
        order = []
        for i, p in enumerate(paths):
            tid = self._next_task
            self._next_task += 1
            tasks[tid] = _Task(i, os.fspath(p))
            order.append(tid)
        fresh: deque[int] = deque(order)
        suspects: deque[int] = deque()
        left = len(tasks)
        finished_ok = False
        try:
            while left:
                self._dispatch(tasks, fresh, suspects)
                alive = self._alive()
                if not alive:
                    if not any(s.info for s in self._slots):
                        raise self._start_failure()
                    errors = [s.start_error for s in self._slots if s.start_error]
                    why = "; ".join(errors) if errors else "every worker died"
                    for tid in list(fresh) + list(suspects):
                        if not tasks[tid].done:
                            left -= 1
                            t = tasks[tid]
                            fr = FileResult(t.index, t.path, attempts=t.attempts,
                                            error=f"no worker left to transcribe it ({why})")
                            yield self._emit(tasks, tid, fr, on_result)
                    break
                ready = wait_any([s.results for s in alive] + [s.process.sentinel for s in alive], timeout=0.5)
                for s in alive:
                    if s.results in ready:
                        for fr in self._read(s, tasks):
                            left -= 1
                            yield self._emit(tasks, None, fr, on_result)
                for s in alive:
                    if not s.process.is_alive():
                        for fr in self._read(s, tasks):  # whatever it sent before it died
                            left -= 1
                            yield self._emit(tasks, None, fr, on_result)
                        for fr in self._on_death(s, tasks, suspects):
                            left -= 1
                            yield self._emit(tasks, None, fr, on_result)
                self._check_timeouts()
            finished_ok = True
        finally:
            if not finished_ok:  # abandoned or failed: what the workers hold cannot be matched up any more
                self._broken = True
                self.close(timeout=5.0)

    def wait_ready(self, timeout: float | None = None) -> list[dict]:
        """Wait until every worker has loaded the model (or was given up); returns ``workers()``. Raises
        ``WorkerStartError`` when none could, ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            starting = [s for s in self._slots if s.state == "starting"]
            if not starting:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(starting)} worker(s) not ready after {timeout:g} s")
            wait_any([s.results for s in starting] + [s.process.sentinel for s in starting], timeout=0.5)
            for s in starting:
                self._read(s, {})
                if s.state == "starting" and not s.process.is_alive():
                    self._read(s, {})
                    self._on_death(s, {}, deque())
            self._check_timeouts()
        if not any(s.state == "ready" for s in self._slots):
            raise self._start_failure()
        return self.workers()

    def _start_failure(self) -> WorkerStartError:
        return WorkerStartError("no worker could load the model: " + "; ".join(
            f"worker {s.slot} ({s.device}): {s.start_error or 'died while loading'}" for s in self._slots))

    def _emit(self, tasks, tid, fr: FileResult, on_result) -> FileResult:
        if tid is not None:
            tasks[tid].done = True
        if on_result is not None:
            on_result(fr)
        return fr

    def _dispatch(self, tasks, fresh: deque, suspects: deque) -> None:
        while fresh and tasks[fresh[0]].done:
            fresh.popleft()
        ready = [s for s in self._slots if s.state == "ready"]
        for s in ready:
            if not s.inflight:
                s.isolated = s.draining = False
                if suspects:
                    self._send(s, suspects.popleft(), tasks)
                    s.isolated = True
        if suspects and ready and not any(s.isolated or s.draining for s in ready):
            min(ready, key=lambda s: len(s.inflight)).draining = True  # it empties, then takes a suspect
        alive = len(self._alive())
        held = sum(len(s.inflight) for s in self._slots)
        share = max(1, math.ceil((len(fresh) + held) / max(1, alive)))  # no worker hoards what others could take
        progress = True
        while fresh and progress:  # one file per worker per pass: the least loaded first
            progress = False
            for s in sorted(ready, key=lambda s: len(s.inflight)):
                if fresh and not s.isolated and not s.draining and len(s.inflight) < min(s.capacity, share):
                    self._send(s, fresh.popleft(), tasks)
                    progress = True

    def _send(self, s: _Slot, tid: int, tasks) -> None:
        t = tasks[tid]
        t.attempts += 1
        now = time.monotonic()
        if t.t_first is None:
            t.t_first = now
        s.inflight[tid] = now
        try:
            s.tasks.send(("task", tid, t.path))
        except OSError:  # it died meanwhile: its death puts the file back
            pass

    def _read(self, s: _Slot, tasks) -> list[FileResult]:
        out = []
        while True:
            try:
                if not s.results.poll():
                    break
                msg = s.results.recv()
            except Exception:  # noqa: BLE001 - EOF, or a message cut short by the worker's death
                break
            kind = msg[0]
            if kind == "ready":
                s.state, s.info = "ready", msg[1]
            elif kind == "start_failed":
                s.start_error = msg[1]
            elif kind in ("done", "error"):
                tid = msg[1]
                if tid not in s.inflight:  # not (any more) this worker's: a stale message
                    continue
                del s.inflight[tid]
                t = tasks.get(tid)
                if t is None or t.done:
                    continue
                t.done = True
                fr = FileResult(t.index, t.path, device=s.device, worker=s.slot, attempts=t.attempts,
                                wall_ms=1e3 * (time.monotonic() - t.t_first))
                if kind == "done":
                    fr.result = msg[2]
                else:
                    fr.error = msg[2]
                out.append(fr)
        return out

    def _on_death(self, s: _Slot, tasks, suspects: deque) -> list[FileResult]:
        s.process.join(5.0)
        code = s.process.exitcode
        why = s.killed_for or describe_exit(code)
        for c in (s.tasks, s.results):
            c.close()
        held, s.inflight = list(s.inflight), {}
        out = []
        if s.state == "starting" and (s.start_error is not None or s.killed_for is not None):
            s.start_error = s.start_error or why
            s.state = "gone"  # loading fails the same way every time: not restarted
        elif held:
            for tid in held:
                t = tasks[tid]
                if t.done:
                    continue
                t.crashes += 1
                t.exits.append(f"{s.device}: {why}")
                if t.crashes > self.retries:
                    t.done = True
                    out.append(FileResult(t.index, t.path, device=s.device, worker=s.slot, attempts=t.attempts,
                                          wall_ms=1e3 * (time.monotonic() - t.t_first),
                                          error=f"the worker process died each of the {t.crashes} times this file "
                                                f"was being transcribed ({'; '.join(t.exits)})"))
                else:
                    suspects.append(tid)
            self._start(s)
        else:
            s.idle_deaths += 1
            if s.idle_deaths > IDLE_DEATHS:
                s.start_error = s.start_error or f"died {s.idle_deaths} times holding no file ({why})"
                s.state = "gone"
            else:
                self._start(s)
        return out

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for s in self._alive():
            if s.killed_for is not None or not s.process.is_alive():
                continue
            if s.state == "starting" and now - s.started_at > self.start_timeout_s:
                s.killed_for = f"not loaded after {self.start_timeout_s:g} s"
                s.process.kill()
            elif self.file_timeout_s is not None and s.inflight and \
                    now - min(s.inflight.values()) > self.file_timeout_s:
                s.killed_for = f"killed: a file took over {self.file_timeout_s:g} s"
                s.process.kill()


def transcribe_files(paths, devices, model=None, dtype=None, prompt: str | None = None,
                     max_new_tokens: int | None = None, segmentation: str = "windows",
                     repetition_stop: int | None = None, decode: DecodeOptions | None = None,
                     on_result: Callable[[FileResult], None] | None = None, **pool_options) -> list[FileResult]:
    """Transcribe audio files on several devices at once (one engine process per entry of ``devices``, e.g.
    ``["cuda:0", "cuda:1"]`` or ``"cpu,cpu"``); returns one ``FileResult`` per path, in the order of ``paths``.
    A file that fails has ``error`` set instead of ``result``; nothing raises for one bad file.

    prompt / max_new_tokens / segmentation / repetition_stop: as in ``DecodeOptions`` (or pass ``decode=``).
    on_result: called in this process with each ``FileResult`` as it finishes (write outputs there).
    pool_options: ``DevicePool``'s (in_flight, retries, file_timeout_s, threads, max_batch, ...).
    Each result is what ``glmasr.transcribe`` gives for that file in one process."""
    paths = list(paths)
    if decode is None:
        decode = DecodeOptions(prompt=prompt, max_new_tokens=max_new_tokens, segmentation=segmentation,
                               repetition_stop=repetition_stop)
    out: list[FileResult | None] = [None] * len(paths)
    if not paths:
        return []
    with DevicePool(devices, model=model, dtype=dtype, decode=decode, **pool_options) as pool:
        for fr in pool.run(paths, on_result=on_result):
            out[fr.index] = fr
    return out  # type: ignore[return-value]
