"""Transcription over an engine client (``engine_client.py``: the shared in-process ``GlmAsr`` engine, or the
engine worker processes of ``--data-parallel``), for the HTTP layer (``app.py``).

Per request: admission into a bounded set of in-flight requests (``admission``; full = 429), the upload decoded
with the duration limit enforced while decoding (``decode_upload``), planned and submitted to the engine, all of it
in a worker thread (``asyncio.to_thread``; the event loop never decodes or plans), then the engine's outputs
consumed with the async API (``request.aresult()`` / ``request.adeltas()``). A client that goes away aborts its
engine request: a streamed answer through the cancellation of its body iterator (and, whatever happens, when the
response object is done), a plain one by a watcher on the connection's ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from ..audio import Audio, AudioDecodeError, AudioError, AudioTooLongError, decode_audio_file
from ..engine.loop import EngineClosed, EngineError, RequestTimeoutError
from ..options import DecodeOptions
from . import protocol
from .engine_client import EngineRequest, EngineUnavailable
from .metrics import Metrics
from .protocol import APIError, TranscriptionRequest, bad_request


def decode_upload(file, filename: str, max_audio_s: float | None) -> Audio:
    """The spooled upload -> 16 kHz mono ``Audio`` through the package's decoder (``audio.decode_audio_file``: the
    format from the bytes, sample rate, channels and duration bounded before and while decoding, memory bounded by
    the decoded 16 kHz samples), so an upload gives exactly what ``load_audio`` gives for the same file. A truncated
    or damaged upload is refused (it was likely cut in transit) rather than transcribed short. Its typed errors
    become the envelope: ``audio_too_long`` a 413, the rest (empty_file, invalid_audio, unsupported_format,
    unsupported_audio) a 400, all with ``param`` "file"."""
    try:
        return decode_audio_file(file, f"file {filename!r}", max_audio_s or None, allow_truncated=False)
    except AudioTooLongError as e:
        raise APIError(413, f"{e} (the server's --max-audio-s)", param="file", code=e.code) from None
    except AudioDecodeError as e:
        raise bad_request(str(e), "file", e.code) from None


def vad_pieces(audio: Audio, params: dict) -> list[tuple[float, float]]:
    """Speech regions (Silero VAD on the CPU, so the GPU stays the engine's) merged into <= 30 s pieces."""
    try:
        from ..vad import VadUnavailableError, merge_regions, speech_regions
    except ImportError as e:
        raise bad_request(f"chunking_strategy needs glmasr.vad, which this install lacks ({e})", "chunking_strategy",
                          "unsupported_value") from None
    try:
        regions = speech_regions(audio.samples, device="cpu", **params)
    except VadUnavailableError as e:
        raise bad_request(f"chunking_strategy needs the vad extra (pip install 'glmasr[vad]'): {e}",
                          "chunking_strategy", "unsupported_value") from None
    return merge_regions(regions)


class Slots:
    """At most ``limit`` holders at once; one more is refused with ``refuse(active)`` (an ``APIError``), never queued
    unbounded. ``gauge(active)`` follows the count (a metric). Used for the requests admitted to the engine
    (``admission``: --max-queue, a 429) and for the uploads being received (``uploads``: --max-uploads, a 503)."""

    def __init__(self, limit: int, refuse, gauge=None):
        self.limit = limit
        self.active = 0
        self._refuse = refuse
        self._gauge = gauge
        self._lock = threading.Lock()

    def enter(self) -> "Ticket":
        with self._lock:
            if self.active >= self.limit:
                raise self._refuse(self.active)
            self.active += 1
            if self._gauge is not None:
                self._gauge(self.active)
        return Ticket(self)

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1
            if self._gauge is not None:
                self._gauge(self.active)


def admission(limit: int, metrics: Metrics) -> Slots:
    """Requests admitted to transcription (past their upload) at once: ``--max-queue``; one more is a 429."""
    return Slots(limit, lambda active: APIError(
        429, f"the server has {active} requests in flight (its limit, --max-queue); retry later",
        type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}), metrics.queue_depth.set)


def upload_slots(limit: int) -> Slots:
    """Request bodies being received at once: ``--max-uploads``; one more is a 503."""
    return Slots(limit, lambda active: APIError(
        503, f"the server is receiving {active} uploads (its limit, --max-uploads); retry later",
        type="server_error", code="too_many_uploads", headers={"Retry-After": "1"}))


class Ticket:
    def __init__(self, slots: Slots):
        self._slots = slots
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._leave()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


@dataclass
class Started:
    """A request submitted to the engine."""

    job: EngineRequest
    audio: Audio
    t0: float  # request received (perf_counter)


def _submission_error(e: BaseException) -> APIError | None:
    """The answer to a request the engine could not take (None: not such an error)."""
    if isinstance(e, EngineClosed):
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), type="server_error", code=e.code, headers={"Retry-After": "1"})
    if isinstance(e, AudioError):  # too short for one audio token
        return bad_request(str(e), "file", "invalid_audio")
    if isinstance(e, ValueError):  # the prompt leaves no room for the audio
        return bad_request(str(e), "prompt")
    return None


def timed_out(seconds: float | None) -> APIError:
    return APIError(504, f"the transcription did not finish within the server's request timeout of {seconds:g} s "
                         "(--request-timeout); it was stopped", type="server_error", code="request_timeout")


class TranscriptionService:
    """``request_timeout_s``: the engine aborts a request still unfinished this long after it was submitted (a 504;
    None: no limit)."""

    def __init__(self, engine, metrics: Metrics, max_audio_s: float | None, request_timeout_s: float | None = None):
        self.engine = engine  # an EngineClient
        self.metrics = metrics
        self.max_audio_s = max_audio_s
        self.request_timeout_s = request_timeout_s

    def _prepare(self, req: TranscriptionRequest, t0: float) -> Started:
        t_audio = time.perf_counter()
        audio = decode_upload(req.file, req.filename, self.max_audio_s)
        audio_ms = 1e3 * (time.perf_counter() - t_audio)
        pieces = None if req.vad is None else vad_pieces(audio, req.vad)
        try:
            job = self.engine.submit(audio, DecodeOptions(prompt=req.instruction), t0, audio_ms, pieces,
                                     req.stream, timeout=self.request_timeout_s)
        except Exception as e:
            err = _submission_error(e)
            if err is None:
                raise
            raise err from None
        return Started(job, audio, t0)

    async def start(self, req: TranscriptionRequest, t0: float) -> Started:
        """Decode, plan and submit in a worker thread, then wait until the engine has taken it. If the caller is
        cancelled meanwhile, the job that the thread still submits is aborted as soon as it exists."""
        fut = asyncio.get_running_loop().run_in_executor(None, self._prepare, req, t0)
        try:
            started = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().job.abort())
            raise
        try:
            await started.job.started()
        except BaseException as e:
            started.job.abort()
            err = _submission_error(e) if isinstance(e, Exception) else None
            if err is None:
                raise
            raise err from None
        return started

    def _account(self, started: Started, result) -> None:
        m = self.metrics
        m.audio_seconds.inc(started.audio.duration_s)
        m.generated_tokens.inc(len(result.token_ids))
        m.prompt_tokens.inc(started.job.prompt_tokens)
        if started.job.first_output_at is not None:
            m.ttft.observe(started.job.first_output_at - started.t0)

    async def transcribe(self, started: Started, disconnected) -> object:
        """The ``Transcription`` of a submitted request; aborts it (and raises ``ClientGone``) when the awaitable
        ``disconnected`` completes first."""
        job = started.job
        result_task = asyncio.ensure_future(job.aresult())
        gone_task = asyncio.ensure_future(disconnected)
        try:
            done, _ = await asyncio.wait({result_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
            if result_task not in done:
                job.abort()
                raise ClientGone()
            try:
                result = result_task.result()
            except RequestTimeoutError:
                raise timed_out(self.request_timeout_s) from None
            except EngineUnavailable as e:  # the engine worker holding it died
                raise APIError(503, f"transcription failed: {e}", type="server_error", code=e.code,
                               headers={"Retry-After": "1"}) from None
            except EngineError as e:
                raise APIError(500, f"transcription failed: {e}", type="server_error", code="engine_error") from None
            except RuntimeError as e:  # aborted underneath us (shutdown)
                raise APIError(503, f"transcription was aborted: {e}", type="server_error", code="aborted") from None
            self._account(started, result)
            return result
        finally:
            job.abort()
            for t in (result_task, gone_task):
                if not t.done():
                    t.cancel()

    async def events(self, started: Started, req: TranscriptionRequest):
        """Server-sent events of a streamed request: deltas as the engine produces them, then the done event
        (the exact final text, equal to the non-streamed one) and ``[DONE]``. An engine failure ends the stream
        with an ``error`` event (the client raises on it). The deltas concatenate to the done text; the one
        exception is the rare case ``transcript.py`` describes, where decoding all tokens at once revises text
        already streamed (the done text is then still the exact one)."""
        job = started.job
        try:
            result = None
            async for d in job.adeltas():
                if d.text:
                    yield protocol.delta_event(d.text)
                if d.finished:
                    result = d.result
            if result is None:
                yield protocol.error_event("transcription was aborted", code="aborted")
                return
            self._account(started, result)
            yield protocol.done_event(result.text, job.prompt_tokens, len(result.token_ids))
            yield protocol.sse("[DONE]")
        except RequestTimeoutError:
            e = timed_out(self.request_timeout_s)
            yield protocol.error_event(e.message, code=e.code)
        except EngineUnavailable as e:
            yield protocol.error_event(f"transcription failed: {e}", code=e.code)
        except EngineError as e:
            yield protocol.error_event(f"transcription failed: {e}", code="engine_error")
        finally:
            job.abort()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""

