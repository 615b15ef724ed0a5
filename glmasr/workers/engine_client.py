"""What the server's request handling (``serving.py``) talks to: an engine client, in front of one in-process engine
(``LocalEngineClient``, over a loaded ``GlmAsr``) or of N engine worker processes
(``requests.DataParallelEngineClient``, ``glmasr serve --data-parallel N``). The HTTP layer never knows which.

    client.submit(audio, decode, t_start, audio_ms, pieces, stream, timeout=None, priority=Priority.UPLOAD)
        -> EngineRequest   (blocking; a worker thread)
    await request.started()        # the engine took it; raises what planning refused (AudioError, ValueError, ...)
    await request.aresult()        # -> Transcription (stream=False)
    async for d in request.adeltas(): ...   # TranscriptDeltas (stream=True), the last one with the Transcription
    request.abort()                # frees its engine slots (idempotent; a no-op once it finished)

Errors a request can raise, and what the server answers: ``RequestTimeoutError`` (past its timeout, the engine
stopped it: 504), ``EngineClosed`` (shutting down, 503), ``EngineUnavailable``
(no engine can take it, or the engine process serving it died: 503; ``code`` says which), ``EngineError`` (the
engine failed while running it: 500), ``RuntimeError`` (aborted underneath, e.g. shutdown: 503), ``AudioError`` /
``ValueError`` from ``started`` (the audio or the prompt cannot be planned: 400), ``RequestPreempted`` (a request of
priority ``Priority.DRAFT`` or worse that the engine dropped for a better one; never an upload).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ..options import DecodeOptions, Priority

WARMUPS = ("full", "request", "none")


class EngineRequest:
    """One submitted request (see the module docstring)."""

    prompt_tokens: int = 0  # prompt positions (audio + text) of its prompts, known once ``started`` returned
    first_output_at: float | None = None  # perf_counter when its first engine output came back

    @property
    def result(self):
        """The ``Transcription`` once the request finished, else None."""
        raise NotImplementedError

    async def started(self) -> None:
        raise NotImplementedError

    async def aresult(self):
        raise NotImplementedError

    def adeltas(self):
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class EngineClient:
    """The engine side of a server: ``folder`` (the checkpoint: served names), ``slots`` (sequence slots of all
    engines together: the default queue limit is 4 x this), ``num_pending`` (requests the engines hold)."""

    folder: Path
    slots: int

    def submit(self, audio, decode: DecodeOptions, t_start: float, audio_ms: float = 0.0, pieces=None,
               stream: bool = False, timeout: float | None = None, priority: int = Priority.UPLOAD) -> EngineRequest:
        """``timeout``: seconds after which the engine aborts the request (``RequestTimeoutError``); None: none.
        ``priority``: its class (``Priority``, lower first; the server's uploads are ``UPLOAD``); a request of
        ``Priority.DRAFT`` or worse may end with ``RequestPreempted``."""
        raise NotImplementedError

    def warmup(self, mode: str) -> dict:
        """Blocks until the engines can serve (``mode``: "full", "request" or "none"); returns ms per stage."""
        raise NotImplementedError

    @property
    def num_pending(self) -> int:
        raise NotImplementedError

    def workers(self) -> list[dict] | None:
        """Per engine process: state, pid, in-flight work and counters (None: one in-process engine)."""
        return None

    @property
    def word_timestamps(self) -> bool:
        """Whether requests may ask for word times (``DecodeOptions.word_timestamps``): an aligner is loaded."""
        return False

    def close(self) -> None:
        raise NotImplementedError


class LocalRequest(EngineRequest):
    """A ``TranscriptionJob`` of the in-process engine."""

    def __init__(self, job, stream: bool):
        self.job = job
        self.stream = stream
        self.prompt_tokens = sum(len(p.prompt_ids) for p in job.assembler.plans)
        self.first_output_at = None
        self._lock = threading.Lock()
        self._on_first = None
        calls = [0]
        engine_stream = job.stream

        def on_output():  # on the engine thread as each output arrives, and once at once from set_listener
            calls[0] += 1
            if calls[0] > 1 or getattr(engine_stream, "_items", None):
                with self._lock:
                    if self.first_output_at is not None:
                        return
                    self.first_output_at = t = time.perf_counter()
                    fn = self._on_first
                if fn is not None:
                    fn(t)
        engine_stream.set_listener(on_output)

    def on_first_output(self, fn) -> None:
        """Call ``fn(perf_counter)`` once the first engine output has come (now, if it has; else on the engine's
        thread when it comes)."""
        with self._lock:
            t = self.first_output_at
            if t is None:
                self._on_first = fn
        if t is not None:
            fn(t)

    @property
    def result(self):
        return self.job.assembler.result

    async def started(self) -> None:
        return None  # submit_loaded planned it in the caller's thread: its errors were raised there

    async def aresult(self):
        return await self.job.aresult()

    async def adeltas(self):
        async for d in self.job.adeltas(stream=self.stream):
            yield d

    def abort(self) -> None:
        self.job.abort()


class LocalEngineClient(EngineClient):
    """The handle's own engine, in this process (the single-engine server)."""

    def __init__(self, asr):
        self.asr = asr

    @property
    def folder(self) -> Path:
        return self.asr.folder

    @property
    def slots(self) -> int:
        return self.asr.options.max_batch

    @property
    def word_timestamps(self) -> bool:
        return self.asr.aligner is not None

    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
               priority=Priority.UPLOAD) -> LocalRequest:
        return LocalRequest(self.asr.submit_loaded(audio, decode, 0, t_start, audio_ms, pieces=pieces,
                                                   timeout=timeout, priority=priority), stream)

    def warmup(self, mode: str) -> dict:
        if mode not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {mode!r}")
        timings: dict = {}
        if mode == "full":
            timings = dict(self.asr.warmup())
        elif mode == "request":
            import numpy as np

            noise = (np.random.default_rng(0).standard_normal(16000) * 0.1).astype(np.float32)
            self.asr.submit(noise, DecodeOptions(max_new_tokens=8), sampling_rate=16000).result()
        return timings

    @property
    def num_pending(self) -> int:
        return self.asr.loop.num_pending if self.asr._loop is not None else 0

    def close(self) -> None:
        self.asr.close()
