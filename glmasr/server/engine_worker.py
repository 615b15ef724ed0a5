"""One engine worker process of ``glmasr serve --data-parallel N`` (the front end's side: ``data_parallel.py``).

``engine_worker_main`` runs in a ``spawn`` process (started with ``glmasr.parallel.process.start_worker``, so a CUDA
worker sees only its GPU): it loads the model (``load_model``), warms it up as the server's ``--warmup`` says,
says ``ready``, then serves requests from its pipe with an asyncio loop over a ``LocalEngineClient``: the exact
code the single-engine server runs (``submit_loaded``: planning, the engine, the transcript assembler), so a
request's deltas and its ``Transcription`` are what one in-process engine gives.

Messages, front end -> worker: ``("submit", rid, audio, decode, t_start, audio_ms, pieces, stream)``,
``("abort", rid)``, ``("stop",)``. Worker -> front end: ``("ready", info)``, ``("start_failed", message)``,
``("progress", rounds)`` every ``HEARTBEAT_S`` (the engine steps done so far: the front end's watchdog kills a
worker whose engine stops moving while it holds requests), and per
request ``("accepted", rid, prompt_tokens)`` or ``("rejected", rid, kind, message)``, ``("first", rid, t)``,
``("delta", rid, TranscriptDelta)``..., ``("failed", rid, kind, message)``, always ending with ``("end", rid)``
once the worker holds nothing of it any more (its engine slots are free). ``kind``: "audio", "value", "closed",
"engine", "error".

Signals: SIGINT is ignored (Ctrl-C reaches the whole process group; the front end drains and then stops its
workers); SIGTERM, like ``("stop",)``, drains: new requests are refused ("closed"), the ones in hand finish,
then the process exits 0. A worker whose front end went away (its pipe closed) exits at once.

Test hooks (``hooks``, set by tests only): ``crash_on_prompt``: a request whose instruction equals this string
makes the process ``os._exit(CRASH_EXIT_CODE)`` (a crash with its other requests in flight); ``step_delay``:
``(path, seconds)``: each engine step sleeps that long while the file ``path`` exists (a request then lasts
long enough to be interrupted).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field

CRASH_EXIT_CODE = 70
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class EngineWorkerSpec:
    """Everything a worker needs, pickled to it at spawn."""

    slot: int
    device: str  # as the worker sees it: "cpu" or "cuda:0" (CUDA_VISIBLE_DEVICES picks the GPU)
    model: str  # a local checkpoint folder
    dtype: str | None
    engine_options: dict
    threads: int
    warmup: str  # "full" | "request" | "none"
    hooks: dict = field(default_factory=dict)


def _install_hooks(hooks: dict) -> None:
    delay = hooks.get("step_delay")
    if delay:
        from glmasr.engine.engine import Engine

        path, seconds = delay
        step = Engine.step

        def slow_step(self):
            if os.path.exists(path):
                time.sleep(float(seconds))
            return step(self)
        Engine.step = slow_step


def engine_worker_main(spec: EngineWorkerSpec, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.perf_counter()
    try:
        from glmasr.parallel.process import load_model

        from .engine_client import LocalEngineClient

        _install_hooks(spec.hooks)
        asr = load_model(spec.device, spec.model, spec.dtype, spec.engine_options, spec.threads)
        load_ms = 1e3 * (time.perf_counter() - t0)
        client = LocalEngineClient(asr)
        t1 = time.perf_counter()
        timings = client.warmup(spec.warmup)
        timings["warmup_ms"] = 1e3 * (time.perf_counter() - t1)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which gives the slot up
        try:
            outbox.send(("start_failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    term = threading.Event()  # a SIGTERM before the loop runs: drained as soon as it does
    signal.signal(signal.SIGTERM, lambda signum, frame: term.set())
    try:
        outbox.send(("ready", {"pid": os.getpid(), "device": str(asr.device), "threads": spec.threads,
                               "load_ms": load_ms, "warmup_ms": timings}))
    except OSError:
        return
    asyncio.run(_WorkerServer(client, spec, inbox, outbox).run(term))
    asr.close()


class _WorkerServer:
    def __init__(self, client, spec: EngineWorkerSpec, inbox, outbox):
        self.client = client
        self.inbox = inbox
        self.outbox = outbox
        self.crash_on = spec.hooks.get("crash_on_prompt")
        self.tasks: dict[int, asyncio.Task] = {}
        self.jobs: dict = {}
        self.aborted: set[int] = set()
        self.draining = False

    async def run(self, term: threading.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.loop.add_signal_handler(signal.SIGTERM, self.drain)
        if term.is_set():
            self.drain()
        threading.Thread(target=self._read, name="glmasr-worker-inbox", daemon=True).start()
        beat = self.loop.create_task(self._heartbeat())
        await self.done.wait()
        beat.cancel()

    async def _heartbeat(self) -> None:
        """The engine thread's step count, from the loop's thread (the one that sends): it stalls only with
        the engine, which a stuck kernel or a deadlock holds while the asyncio loop still runs."""
        loop = self.client.asr.loop
        while True:
            self.send(("progress", loop.rounds))
            await asyncio.sleep(HEARTBEAT_S)

    def send(self, msg) -> None:
        try:
            self.outbox.send(msg)
        except OSError:  # the front end is gone: nobody wants the results
            os._exit(0)

    def _read(self) -> None:  # a thread: the pipe's messages, handed to the loop
        while True:
            try:
                msg = self.inbox.recv()
            except (EOFError, OSError):
                os._exit(0)
            self.loop.call_soon_threadsafe(self._handle, msg)

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "submit":
            rid, decode = msg[1], msg[3]
            if self.crash_on is not None and decode.prompt == self.crash_on:
                os._exit(CRASH_EXIT_CODE)  # test hook: the process dies with its requests in flight
            if self.draining:
                self.send(("rejected", rid, "closed", "the engine worker is shutting down"))
                self.send(("end", rid))
                return
            self.tasks[rid] = self.loop.create_task(self._run(*msg[1:]))
        elif kind == "abort":
            rid = msg[1]
            job = self.jobs.get(rid)
            if job is not None:
                job.abort()
            elif rid in self.tasks:  # still being planned: aborted as soon as it exists
                self.aborted.add(rid)
        elif kind == "stop":
            self.drain()

    def drain(self) -> None:
        self.draining = True
        if not self.tasks:
            self.done.set()

    async def _run(self, rid, audio, decode, t_start, audio_ms, pieces, stream) -> None:
        from glmasr.audio import AudioError
        from glmasr.engine.loop import EngineClosed, EngineError

        job = None
        try:
            try:
                job = await asyncio.to_thread(self.client.submit, audio, decode, t_start, audio_ms, pieces, stream)
            except AudioError as e:
                self.send(("rejected", rid, "audio", str(e)))
                return
            except EngineClosed as e:
                self.send(("rejected", rid, "closed", str(e)))
                return
            except ValueError as e:
                self.send(("rejected", rid, "value", str(e)))
                return
            except Exception as e:  # noqa: BLE001 - this request's failure
                self.send(("rejected", rid, "error", f"{type(e).__name__}: {e}"))
                return
            self.jobs[rid] = job
            if rid in self.aborted:
                job.abort()
            self.send(("accepted", rid, job.prompt_tokens))
            job.on_first_output(lambda t: self.loop.call_soon_threadsafe(self.send, ("first", rid, t)))
            try:
                async for d in job.adeltas():
                    self.send(("delta", rid, d))
            except EngineError as e:
                self.send(("failed", rid, "engine", str(e)))
            except Exception as e:  # noqa: BLE001
                self.send(("failed", rid, "error", f"{type(e).__name__}: {e}"))
        finally:
            if job is not None:
                job.abort()  # a no-op once finished
            self.jobs.pop(rid, None)
            self.aborted.discard(rid)
            self.tasks.pop(rid, None)
            self.send(("end", rid))
            if self.draining and not self.tasks:
                self.done.set()
