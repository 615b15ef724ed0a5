"""The worker side of ``glmasr.parallel``: one process, one device, one loaded model.

``worker_main`` runs in a process started with the ``spawn`` context. It loads the model on its device, says
``ready``, then takes files from its task pipe until told to stop. Each file runs on a thread of its own
(``submit(...).result()``: decode, plan, engine, text), so the files a worker holds at once are batched by its
engine like calls from many threads in one process. Results go back on the result pipe as each finishes.

Messages, worker -> parent: ``("ready", info)``, ``("start_failed", message)``, ``("done", task_id,
Transcription)``, ``("error", task_id, message)``. Parent -> worker: ``("task", task_id, path)``, ``("stop",)``.
Pipes (not a shared ``multiprocessing.Queue``): a process that dies mid-send can only break its own pipe, never
a lock the other workers need, and every message it sent before dying can still be read.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .process import load_model

# exit status of a worker killed by the test hook ``crash_on`` (what a segfault or an OOM kill looks like to the
# parent: the process is gone, with its files in flight)
CRASH_EXIT_CODE = 70


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, pickled to it at spawn."""

    slot: int
    device: str  # as the worker sees it: "cpu" or "cuda:0" (CUDA_VISIBLE_DEVICES picks the GPU)
    model: str  # a local checkpoint folder (the parent resolved hub ids)
    dtype: str | None
    engine_options: dict
    decode: object  # glmasr.DecodeOptions
    in_flight: int
    threads: int
    # test hooks: {"crash_on": name part} -> os._exit on such a file; {"sleep_on": (name part, seconds)}
    hooks: dict = field(default_factory=dict)


def worker_main(spec: WorkerSpec, tasks, results) -> None:
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            results.send(msg)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    t0 = time.perf_counter()
    try:
        import glmasr

        asr = load_model(spec.device, spec.model, spec.dtype, spec.engine_options, spec.threads)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        try:
            send(("start_failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    send(("ready", {"pid": os.getpid(), "device": str(asr.device), "threads": spec.threads,
                    "load_ms": 1e3 * (time.perf_counter() - t0)}))

    crash_on = spec.hooks.get("crash_on")
    sleep_on = spec.hooks.get("sleep_on")

    def run_one(task_id: int, path: str) -> None:
        name = os.path.basename(path)
        if crash_on is not None and crash_on in name:
            os._exit(CRASH_EXIT_CODE)  # test hook: the process dies with this file (and the others) in flight
        if sleep_on is not None and sleep_on[0] in name:
            time.sleep(float(sleep_on[1]))  # test hook: a slow file
        try:
            r = asr.submit(path, spec.decode).result()
        except Exception as e:  # noqa: BLE001 - this file's failure, reported per file
            msg = str(e) if isinstance(e, glmasr.AudioError) else f"{type(e).__name__}: {e}"
            try:
                send(("error", task_id, msg))
            except OSError:
                pass
            return
        try:
            send(("done", task_id, r))
        except OSError:  # the parent is gone
            pass

    pool = ThreadPoolExecutor(max(1, spec.in_flight), thread_name_prefix=f"glmasr-worker{spec.slot}")
    while True:
        try:
            msg = tasks.recv()
        except (EOFError, OSError):  # the parent went away: nobody wants the files in hand
            os._exit(0)
        if msg[0] == "stop":
            break
        _, task_id, path = msg
        pool.submit(run_one, task_id, path)
    pool.shutdown(wait=True)
    asr.close()
