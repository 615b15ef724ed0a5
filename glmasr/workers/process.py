"""The worker process of every engine-worker pool (``pool.py``), and how the parent starts it.

Spawn (``spawn``): a ``spawn`` process running ``worker_main(spec, inbox, outbox)`` with one pipe per direction.
The parent keeps the ends it uses and closes the child's, so a child that dies is seen at once as EOF on its pipe;
a process that dies mid-send breaks only its own pipe (a shared ``multiprocessing.Queue`` has a lock a dying
writer can hold forever), and every message it sent before dying can still be read. A CUDA worker starts with
``CUDA_VISIBLE_DEVICES`` naming its GPU (mapped through the parent's own), so it sees only ``cuda:0`` from its
first CUDA call on; ``WorkerSpec.device`` is the device as the child sees it.

The child ignores SIGINT (Ctrl-C reaches the whole process group; the parent decides), loads the model with
``threads`` torch and audio threads, warms it up as ``spec.warmup`` says, and says ``("ready", info)`` (or
``("start_failed", message)``, then exits). It then serves jobs from its pipe on an asyncio loop over one engine
client: the server's ``LocalEngineClient`` (``spec.server``: its warm-up and first-output times), else the
handle's own jobs (no serve extra needed). Either way planning, the engine and the transcript assembler are the
single engine's code, so a job's deltas and its ``Transcription`` are what one in-process engine gives, and the
jobs a worker holds batch in its engine. Every ``HEARTBEAT_S`` it sends ``("progress", rounds)``: its engine's
step count, read on the loop's thread, so a stuck kernel or a deadlock (which holds the engine thread, not the
pipe) shows as a count that stops moving.

Messages, parent -> worker: ``("submit", id, source, decode, t_start, audio_ms, pieces, stream, timeout,
priority)`` (``source``: decoded ``Audio``, or a file path the worker loads itself, timed from then; ``priority``:
the engine request's class, ``glmasr.engine.request.Priority``), ``("abort", id)``,
``("stop",)``. Worker -> parent: ``ready``, ``start_failed``, ``progress`` as above, and per job
``("accepted", id, prompt_tokens)`` or ``("rejected", id, kind, message)``, ``("first", id, t)``,
``("delta", id, TranscriptDelta)``... (the last one ``finished``, with the ``Transcription``; with
``stream=False`` only that one), ``("failed", id, kind, message)``, always ending with ``("end", id)`` once the
worker holds nothing of the job (its engine slots are free). ``kind``: the error's stable code
(``glmasr.errors.error_code``: "invalid_audio", "invalid_value", "shutting_down", "request_timeout", "engine_error",
"preempted", ..., or "error" for anything else).

Listening (``spec.listen``: ``(folder, authkey)``, ``glmasr serve --frontends K``): the worker takes jobs from
several front-end processes instead of its parent. Once warmed up it listens on the Unix socket
``engine_address(folder, slot)`` (``multiprocessing.connection.Listener``, the authkey's challenge on every
connection; a stale socket file of a dead predecessor is replaced), then says ``ready``; each front-end connects
as a client and gets ``("hello", info)`` (the ready info). Job messages are the same as on the parent pipe, with
job ids per connection; the jobs of every connection batch in the one engine. A connection that closes (its
front-end died or stopped) aborts the jobs it sent (nobody wants their results); the parent pipe then carries only
``stop`` and the heartbeat ``("progress", rounds, jobs held)``. ``spec.pending`` (a shared int64 array, one entry
per slot) holds the number of jobs the worker holds, updated as they come and go: the front-ends read the engine's
global load from it (live drafts are skipped when the engine is full).

Stopping: ``("stop",)`` or SIGTERM drains (new jobs are rejected as "shutting_down", the ones in hand finish, then the
process exits 0). A worker whose parent went away (its pipe closed) exits at once: nobody wants its results.

Test hooks (``spec.hooks``, tests only): ``crash_on``: a file whose name contains it, or ``crash_on_prompt``: a
job whose ``decode.prompt`` equals it, makes the process ``os._exit(CRASH_EXIT_CODE)`` when it arrives (a crash
with its other jobs in flight); ``sleep_on``: ``(name part, seconds)``: such a file waits that long first (a slow
file); ``step_delay``: ``(path, seconds)``: each engine step sleeps that long while ``path`` exists.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field

CRASH_EXIT_CODE = 70  # the test hooks' exit: what a segfault or an OOM kill looks like to the parent
HEARTBEAT_S = 1.0
_ENV_LOCK = threading.Lock()


def cores() -> int:
    """The CPUs this process may use (split between CPU workers)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_exit(code: int | None) -> str:
    """An exit status as words: "killed by SIGKILL", "exit status 70"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def child_device(device: str) -> tuple[str, str | None]:
    """A device as the parent names it -> (the device as the child sees it, its ``CUDA_VISIBLE_DEVICES`` or None).
    ``cuda:1`` -> ("cuda:0", "1"), or the parent's own visible id at position 1; ``cpu`` -> ("cpu", None)."""
    if not device.startswith("cuda"):
        return device, None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else None
    return "cuda:0", ids[index] if ids is not None and index < len(ids) else str(index)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, pickled to it at spawn."""

    slot: int
    device: str  # as the worker sees it: "cpu" or "cuda:0" (CUDA_VISIBLE_DEVICES picks the GPU)
    model: str  # a local checkpoint folder (the parent resolved hub ids)
    dtype: str | None
    engine_options: dict
    threads: int
    decode_weights: str = "bf16"  # glmasr.load's
    aligner: str | None = None  # glmasr.load's: a resolved glm-asr-ctc head folder (word times), or None
    warmup: str = "none"  # "full" | "request" | "none" (LocalEngineClient.warmup)
    server: bool = False  # serve through glmasr.server's LocalEngineClient (needs the serve extra)
    hooks: dict = field(default_factory=dict)
    listen: tuple | None = None  # (folder, authkey): take jobs from front-end connections (module docstring)
    pending: object = None  # a shared int64 array (multiprocessing RawArray): [slot] = jobs held, or None


def engine_address(folder: str, slot: int) -> str:
    """The Unix socket a listening worker of ``slot`` accepts front-end connections on."""
    return os.path.join(folder, f"engine{slot}.sock")


def spawn(ctx, make_spec, device: str, name: str):
    """Start ``worker_main(make_spec(child_device), ...)`` in a ``ctx`` (spawn) process for ``device``. Returns
    ``(process, to_child, from_child)``: the parent's ends of the two pipes."""
    to_child_r, to_child_w = ctx.Pipe(duplex=False)
    from_child_r, from_child_w = ctx.Pipe(duplex=False)
    dev, visible = child_device(device)
    p = ctx.Process(target=worker_main, args=(make_spec(dev), to_child_r, from_child_w), daemon=True, name=name)
    with _ENV_LOCK:  # the child inherits the environment at exec: it sees only its GPU from the start
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            if visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
            p.start()
        finally:
            if visible is not None:
                if old is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = old
    to_child_r.close()
    from_child_w.close()
    return p, to_child_w, from_child_r


# ---- the child ----
def worker_main(spec: WorkerSpec, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.perf_counter()
    try:
        import torch

        import glmasr
        from glmasr import audio as audio_mod

        _install_step_delay(spec.hooks.get("step_delay"))
        torch.set_num_threads(spec.threads)
        audio_mod.AUDIO_THREADS = spec.threads  # decoding/resampling threads of one long file
        asr = glmasr.load(spec.model, device=spec.device, dtype=spec.dtype, decode_weights=spec.decode_weights,
                          aligner=spec.aligner, **spec.engine_options)
        load_ms = 1e3 * (time.perf_counter() - t0)
        if spec.server:
            from .engine_client import LocalEngineClient

            client = LocalEngineClient(asr)
        else:
            client = _HandleClient(asr)
        t1 = time.perf_counter()
        timings = client.warmup(spec.warmup)
        timings["warmup_ms"] = 1e3 * (time.perf_counter() - t1)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which gives the slot up
        try:
            outbox.send(("start_failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    term = threading.Event()  # a SIGTERM before the loop runs: drained as soon as it does
    signal.signal(signal.SIGTERM, lambda signum, frame: term.set())
    info = {"pid": os.getpid(), "device": str(asr.device), "threads": spec.threads, "load_ms": load_ms,
            "warmup_ms": timings, "slot": spec.slot}
    listener = None
    if spec.listen is not None:
        try:
            listener = _listen(spec)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which gives the slot up
            try:
                outbox.send(("start_failed", f"cannot listen for front-ends: {type(e).__name__}: {e}"))
            except OSError:
                pass
            return
    try:
        outbox.send(("ready", info))
    except OSError:
        return
    asyncio.run(_Jobs(client, spec.hooks, inbox, outbox, listener=listener, info=info, pending=spec.pending,
                      slot=spec.slot).run(term))
    asr.close()


def _listen(spec: WorkerSpec):
    from multiprocessing.connection import Listener

    folder, authkey = spec.listen
    address = engine_address(folder, spec.slot)
    try:  # a predecessor's socket file (it died): nobody listens on it any more
        os.unlink(address)
    except FileNotFoundError:
        pass
    return Listener(address, family="AF_UNIX", backlog=64, authkey=authkey)


def _install_step_delay(delay) -> None:
    if delay:
        from glmasr.engine.engine import Engine

        path, seconds = delay
        step = Engine.step

        def slow_step(self):
            if os.path.exists(path):
                time.sleep(float(seconds))
            return step(self)
        Engine.step = slow_step


class _HandleClient:
    """The handle's own jobs, for workers outside the server: ``LocalEngineClient`` without the serve extra, and
    without first-output times or prompt counts (nobody asks for them)."""

    def __init__(self, asr):
        self.asr = asr

    def warmup(self, mode: str) -> dict:
        return {}

    def submit(self, audio, decode, t_start, audio_ms, pieces, stream, timeout, priority):
        return _HandleJob(self.asr.submit_loaded(audio, decode, 0, t_start, audio_ms, pieces=pieces, timeout=timeout,
                                                 priority=priority), stream)


class _HandleJob:
    prompt_tokens = 0

    def __init__(self, job, stream: bool):
        self.job, self.stream = job, stream

    def on_first_output(self, fn) -> None:
        pass

    def adeltas(self):
        return self.job.adeltas(stream=self.stream)

    def abort(self) -> None:
        self.job.abort()


def _error_kind(e: BaseException) -> tuple[str, str]:
    """(code, message) of a job's error for the pipe (``glmasr.errors.error_code``; rebuilt with ``from_code``)."""
    from glmasr.errors import error_code

    code = error_code(e)
    return code, str(e) if code != "error" else f"{type(e).__name__}: {e}"


class _Link:
    """One source of jobs: the parent's pipe (``parent``: its loss ends the process) or a front-end's connection."""

    def __init__(self, lid: int, inbox, outbox, parent: bool):
        self.lid, self.inbox, self.outbox, self.parent = lid, inbox, outbox, parent
        self.open = True


class _Jobs:
    """The child's asyncio side: jobs from the pipe (or the front-ends' connections), their messages back (all sent
    from the loop's thread). Jobs are keyed by (link, id): ids are per connection."""

    def __init__(self, client, hooks: dict, inbox, outbox, listener=None, info=None, pending=None, slot: int = 0):
        self.client = client
        self.outbox = outbox
        self.hooks = hooks
        self.parent = _Link(0, inbox, outbox, parent=True)
        self.listener = listener
        self.info = info or {}
        self.pending, self.slot = pending, slot
        self.links: dict[int, _Link] = {}
        self._lids = iter(range(1, 1 << 62))
        self.tasks: dict[tuple, asyncio.Task] = {}
        self.jobs: dict = {}
        self.aborted: set[tuple] = set()
        self.draining = False

    async def run(self, term: threading.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.loop.add_signal_handler(signal.SIGTERM, self.drain)
        if term.is_set():
            self.drain()
        self._count()
        threading.Thread(target=self._read, args=(self.parent,), name="glmasr-worker-inbox", daemon=True).start()
        if self.listener is not None:
            threading.Thread(target=self._accept, name="glmasr-worker-accept", daemon=True).start()
        beat = self.loop.create_task(self._heartbeat())
        await self.done.wait()
        beat.cancel()

    async def _heartbeat(self) -> None:
        loop = self.client.asr.loop
        while True:
            if self.listener is None:
                self.send(("progress", loop.rounds))
            else:  # the parent holds no jobs: it learns here whether the engine holds some (its watchdog)
                self.send(("progress", loop.rounds, len(self.tasks)))
            await asyncio.sleep(HEARTBEAT_S)

    def send(self, msg, link: _Link | None = None) -> None:
        link = self.parent if link is None else link
        if not link.open:
            return
        try:
            link.outbox.send(msg)
        except OSError:
            if link.parent:  # the parent is gone: nobody wants the results
                os._exit(0)
            self._lost(link)  # that front-end is gone: the jobs it sent are aborted

    def _count(self) -> None:
        if self.pending is not None:
            self.pending[self.slot] = len(self.tasks)

    def _accept(self) -> None:  # a thread: front-ends connecting
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):  # a client that failed the handshake, or the listener closed
                if self.listener is None:
                    return
                time.sleep(0.01)
                continue
            except Exception:  # noqa: BLE001 - a wrong authkey (AuthenticationError): that client only
                continue
            self.loop.call_soon_threadsafe(self._connected, conn)

    def _connected(self, conn) -> None:
        link = _Link(next(self._lids), conn, conn, parent=False)
        self.links[link.lid] = link
        self.send(("hello", self.info), link)
        if link.open:
            threading.Thread(target=self._read, args=(link,), name=f"glmasr-worker-conn{link.lid}",
                             daemon=True).start()

    def _lost(self, link: _Link) -> None:  # on the loop's thread
        if not link.open:
            return
        link.open = False
        self.links.pop(link.lid, None)
        try:
            link.outbox.close()
        except OSError:
            pass
        for (lid, jid) in list(self.tasks):
            if lid == link.lid:
                self._abort((lid, jid))

    def _read(self, link: _Link) -> None:  # a thread: the pipe's messages, handed to the loop
        while True:
            try:
                msg = link.inbox.recv()
            except Exception:  # noqa: BLE001 - EOF, a broken connection, or a message cut short
                if link.parent:
                    os._exit(0)
                try:
                    self.loop.call_soon_threadsafe(self._lost, link)
                except RuntimeError:  # the loop is closed: the process is ending
                    pass
                return
            self.loop.call_soon_threadsafe(self._handle, msg, link)

    def _abort(self, key) -> None:
        job = self.jobs.get(key)
        if job is not None:
            job.abort()
        elif key in self.tasks:  # still being planned: aborted as soon as it exists
            self.aborted.add(key)

    def _handle(self, msg, link: _Link | None = None) -> None:
        link = self.parent if link is None else link
        if not link.open:
            return
        kind = msg[0]
        if kind == "submit":
            jid, source, decode = msg[1], msg[2], msg[3]
            name = os.path.basename(source) if isinstance(source, str) else ""
            crash_on, crash_on_prompt = self.hooks.get("crash_on"), self.hooks.get("crash_on_prompt")
            if (crash_on is not None and crash_on in name) or \
                    (crash_on_prompt is not None and decode.prompt == crash_on_prompt):
                os._exit(CRASH_EXIT_CODE)  # test hook: the process dies with its jobs in flight
            if self.draining:
                self.send(("rejected", jid, "shutting_down", "the engine worker is shutting down"), link)
                self.send(("end", jid), link)
                return
            key = (link.lid, jid)
            self.tasks[key] = self.loop.create_task(self._run(link, name, *msg[1:]))
            self._count()
        elif kind == "abort":
            self._abort((link.lid, msg[1]))
        elif kind == "stop" and link.parent:
            self.drain()

    def drain(self) -> None:
        self.draining = True
        if not self.tasks:
            self.done.set()

    def _submit(self, source, decode, t_start, audio_ms, pieces, stream, timeout, priority):  # a thread
        if isinstance(source, str):  # a file: loaded here, timed from here (as ``GlmAsr.submit`` does)
            from glmasr.audio import load_audio

            t_start = time.perf_counter()
            source = load_audio(source)
            audio_ms = 1e3 * (time.perf_counter() - t_start)
        return self.client.submit(source, decode, t_start, audio_ms, pieces, stream, timeout, priority)

    async def _run(self, link, name, jid, source, decode, t_start, audio_ms, pieces, stream, timeout,
                   priority) -> None:
        key = (link.lid, jid)
        job = None
        try:
            sleep = self.hooks.get("sleep_on")
            if name and sleep is not None and sleep[0] in name:
                await asyncio.sleep(float(sleep[1]))  # test hook: a slow file
            try:
                job = await asyncio.to_thread(self._submit, source, decode, t_start, audio_ms, pieces, stream,
                                              timeout, priority)
            except Exception as e:  # noqa: BLE001 - this job's own problem (the audio, the prompt, ...)
                self.send(("rejected", jid, *_error_kind(e)), link)
                return
            self.jobs[key] = job
            if key in self.aborted:
                job.abort()
            self.send(("accepted", jid, job.prompt_tokens), link)
            job.on_first_output(lambda t: self.loop.call_soon_threadsafe(self.send, ("first", jid, t), link))
            try:
                async for d in job.adeltas():
                    self.send(("delta", jid, d), link)
            except Exception as e:  # noqa: BLE001 - this job's failure
                self.send(("failed", jid, *_error_kind(e)), link)
        finally:
            if job is not None:
                job.abort()  # a no-op once finished
            self.jobs.pop(key, None)
            self.aborted.discard(key)
            self.tasks.pop(key, None)
            self._count()
            self.send(("end", jid), link)
            if self.draining and not self.tasks:
                self.done.set()
