"""The files policy on the worker pool (``pool.py``): many files, one engine process per device, results as they
finish, a crashed worker's files retried. ``glmasr transcribe --devices`` uses it.

    from glmasr.workers import transcribe_files
    results = transcribe_files(paths, devices=["cuda:0", "cuda:1"], model="zai-org/GLM-ASR-Nano-2512")

or, keeping the workers loaded between batches and taking results as they finish:

    with DevicePool(["cuda:0", "cuda:1"], model=folder, decode=DecodeOptions(segmentation="vad")) as pool:
        for fr in pool.run(paths):          # completion order; fr.index is the position in ``paths``
            ...

- The files wait in one queue in the parent. A worker is handed the next file (its path: the worker loads it)
  whenever it holds fewer than ``in_flight`` files and not more than its fair share of what is left, so its
  engine batches the files it holds and a slow worker or a long file holds back only that worker's own files.
  Handing out from the parent (not from a queue the workers read) means the parent always knows which files
  each worker holds.
- ``run`` yields each file's ``FileResult`` as it comes back (the CLI writes its outputs there);
  ``transcribe_files`` returns them in input order.
- Retries: a worker that dies (a crash, an OOM kill, ``file_timeout_s`` passed, or ``worker_timeout_s`` without
  an engine step: off by default, as the time a file is held includes decoding its audio) puts the files it held
  back as "suspects": each runs alone on a worker that holds nothing else, so a second death is that file's own.
  After ``retries`` such deaths a file is reported failed with the exit statuses, never lost. When no worker is
  left (each given up) the files left are reported failed, so ``run`` always ends.
- A file that cannot be read or transcribed fails alone (``FileResult.error``), without retries: not a crash.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ..options import DecodeOptions, Priority
from ..results import Transcription
from .pool import Worker, WorkerPool, parse_devices
from ..errors import WorkerStartError

__all__ = ["DevicePool", "FileResult", "WorkerStartError", "parse_devices", "transcribe_files"]

DEFAULT_IN_FLIGHT = {"cuda": 16, "cpu": 4}


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


class _Task:
    __slots__ = ("tid", "index", "path", "crashes", "attempts", "t_first", "t_sent", "exits", "done")

    def __init__(self, tid: int, index: int, path: str):
        self.tid, self.index, self.path = tid, index, path
        self.crashes = self.attempts = 0
        self.t_first = self.t_sent = 0.0
        self.exits: list[str] = []
        self.done = False

    def finish(self, w: Worker | None = None, **outcome) -> FileResult:
        """Done: its one FileResult (``w``: the worker that had it last)."""
        self.done = True
        if w is None:
            return FileResult(self.index, self.path, attempts=self.attempts, **outcome)
        return FileResult(self.index, self.path, device=w.device, worker=w.slot, attempts=self.attempts,
                          wall_ms=1e3 * (time.monotonic() - self.t_first), **outcome)


class _FileWorker(Worker):
    capacity = 1
    isolated = False  # holds a suspect: gets nothing else
    draining = False  # gets nothing new until empty, then takes a suspect


class DevicePool(WorkerPool):
    """Worker processes, one per entry of ``devices``, each with the model loaded (see the module docstring).

    model: a checkpoint folder or hub id (resolved once here, so a download happens once, in the caller).
    decode: ``DecodeOptions`` for every file. in_flight: files a worker holds at once (default 16 on CUDA, 4 on
    the CPU). retries: how many times a file that was in flight when a worker died is tried again.
    file_timeout_s: a worker holding one file longer than this is killed (then as a crash). start_timeout_s: a
    worker not loaded by then is given up. worker_timeout_s: a worker holding files whose engine makes no step for
    this long is killed (None: off). threads: torch threads per worker (default: the cores split evenly).
    aligner: a glm-asr-ctc head folder or hub id every worker loads, for ``decode.word_timestamps`` (checked here,
    once). engine_options: ``EngineOptions`` fields (max_batch, ...). Call ``close`` (or use ``with``) when done.

    The calling program must be importable without side effects (``if __name__ == "__main__":``), as always with
    the ``spawn`` start method.
    """

    worker_class = _FileWorker

    def __init__(self, devices, model=None, dtype=None, decode: DecodeOptions | None = None,
                 in_flight: int | None = None, retries: int = 2, file_timeout_s: float | None = None,
                 start_timeout_s: float = 900.0, threads: int | None = None, worker_timeout_s: float | None = None,
                 _test_hooks: dict | None = None, decode_weights: str = "bf16", aligner=None, **engine_options):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)
                                      or in_flight < 1):
            raise ValueError(f"in_flight must be a positive integer, got {in_flight!r}")
        super().__init__(devices, model, dtype, threads=threads, start_timeout_s=start_timeout_s,
                         worker_timeout_s=worker_timeout_s, drain_timeout_s=30.0, hooks=_test_hooks,
                         engine_options=engine_options, name="glmasr-worker", decode_weights=decode_weights,
                         aligner=aligner)
        self.decode = decode or DecodeOptions()
        self.retries = retries
        self.file_timeout_s = file_timeout_s
        for w in self._workers:
            w.capacity = in_flight or DEFAULT_IN_FLIGHT["cuda" if w.device.startswith("cuda") else "cpu"]
        self._next_task = 0
        self._broken = False
        self._fresh: deque[_Task] = deque()
        self._suspects: deque[_Task] = deque()
        self._out: deque[FileResult] = deque()
        try:
            self._start()
        except BaseException:
            self.close(timeout=5.0)
            raise

    def workers(self) -> list[dict]:
        """Each slot's device, state and what its worker said when it was ready (pid, threads, load_ms)."""
        with self._cv:
            return [{"slot": w.slot, "device": w.device, "state": w.state, **w.info} for w in self._workers]

    def wait_ready(self, timeout: float | None = None) -> list[dict]:
        """Wait until every worker has loaded the model (or was given up); returns ``workers()``. Raises
        ``WorkerStartError`` when none could, ``TimeoutError`` after ``timeout`` seconds."""
        self.wait_started(timeout)
        if not any(w.state == "ready" for w in self._workers):
            raise self._start_failure()
        return self.workers()

    def run(self, paths: Iterable, on_result: Callable[[FileResult], None] | None = None) -> Iterator[FileResult]:
        """Transcribe ``paths`` (files); yields a ``FileResult`` per path as each finishes (completion order),
        exactly once each. Raises ``WorkerStartError`` if no worker could load the model. Leaving the iteration
        early stops the workers (the pool cannot be used after that)."""
        if self._closed or self._broken:
            raise RuntimeError("this DevicePool is closed")
        tasks = [_Task(self._next_task + i, i, os.fspath(p)) for i, p in enumerate(paths)]
        self._next_task += len(tasks)
        with self._cv:
            self._fresh, self._suspects, self._out = deque(tasks), deque(), deque()
        left = len(tasks)
        finished_ok = False
        try:
            while left:
                with self._cv:
                    self._dispatch()
                    if not self._out and not any(w.state in ("starting", "ready") for w in self._workers):
                        if not any(w.info for w in self._workers):
                            raise self._start_failure()
                        why = "; ".join(w.error for w in self._workers if w.error) or "every worker died"
                        self._out += [t.finish(error=f"no worker left to transcribe it ({why})")
                                      for t in (*self._fresh, *self._suspects) if not t.done]
                    if not self._out:
                        self._cv.wait(0.5)
                    out, self._out = list(self._out), deque()
                for fr in out:
                    left -= 1
                    if on_result is not None:
                        on_result(fr)
                    yield fr
            finished_ok = True
        finally:
            if not finished_ok:  # abandoned or failed: what the workers hold cannot be matched up any more
                self._broken = True
                self.close(timeout=5.0)

    def _start_failure(self) -> WorkerStartError:
        return WorkerStartError("no worker could load the model: " + "; ".join(
            f"worker {w.slot} ({w.device}): {w.error or 'died while loading'}" for w in self._workers))

    # ---- dispatch (with _cv held) ----
    def _dispatch(self) -> None:
        fresh, suspects = self._fresh, self._suspects
        while fresh and fresh[0].done:
            fresh.popleft()
        ready = [w for w in self._workers if w.state == "ready"]
        for w in ready:
            if not w.held:
                w.isolated = w.draining = False
                if suspects:
                    self._send(w, suspects.popleft())
                    w.isolated = True
        if suspects and ready and not any(w.isolated or w.draining for w in ready):
            min(ready, key=lambda w: len(w.held)).draining = True  # it empties, then takes a suspect
        alive = sum(w.state in ("starting", "ready") for w in self._workers)
        held = sum(len(w.held) for w in self._workers)
        share = max(1, math.ceil((len(fresh) + held) / max(1, alive)))  # no worker hoards what others could take
        progress = True
        while fresh and progress:  # one file per worker per pass: the least loaded first
            progress = False
            for w in sorted(ready, key=lambda w: len(w.held)):
                if fresh and not w.isolated and not w.draining and len(w.held) < min(w.capacity, share):
                    self._send(w, fresh.popleft())
                    progress = True

    def _send(self, w: _FileWorker, t: _Task) -> None:
        t.attempts += 1
        t.t_sent = time.monotonic()
        t.t_first = t.t_first or t.t_sent
        self._hand(w, t.tid, t, ("submit", t.tid, t.path, self.decode, None, 0.0, None, False, None, Priority.BATCH))

    # ---- the pool's hooks ----
    def _job_message(self, w, t: _Task, msg) -> None:
        kind = msg[0]
        if t.done:
            return
        if kind == "delta" and msg[2].finished:
            self._out.append(t.finish(w, result=msg[2].result))
        elif kind in ("rejected", "failed"):
            self._out.append(t.finish(w, error=msg[3]))
        elif kind == "end":  # never without one of those: still, a file is never lost
            self._out.append(t.finish(w, error="the worker ended it without a result"))

    def _died(self, w, held: dict, why: str, closing: bool) -> None:
        for t in held.values():
            if t.done:
                continue
            t.crashes += 1
            t.exits.append(f"{w.device}: {why}")
            if t.crashes > self.retries:
                self._out.append(t.finish(w, error=f"the worker process died each of the {t.crashes} times this "
                                                   f"file was being transcribed ({'; '.join(t.exits)})"))
            else:
                self._suspects.append(t)

    def _overdue(self, w, now: float) -> str | None:
        if self.file_timeout_s is not None and w.held and \
                now - min(t.t_sent for t in w.held.values()) > self.file_timeout_s:
            return f"a file took over {self.file_timeout_s:g} s"
        return None


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
