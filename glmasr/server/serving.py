"""Transcription over a shared ``GlmAsr`` handle, for the HTTP layer (``app.py``).

Per request: admission into a bounded set of in-flight requests (``Admission``; full = 429), the upload decoded
with the duration limit enforced while decoding (``decode_upload``), planned and submitted to the engine, all of it
in a worker thread (``asyncio.to_thread``; the event loop never decodes or plans), then the engine's outputs
consumed with the async API (``job.aresult()`` / ``job.adeltas()``). A client that goes away aborts its engine
request: a streamed answer through the cancellation of its body iterator (and, whatever happens, when the response
object is done), a plain one by a watcher on the connection's ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..audio import Audio, AudioError, load_audio
from ..engine.loop import EngineClosed, EngineError
from ..options import DecodeOptions
from . import protocol
from .metrics import Metrics
from .protocol import APIError, TranscriptionRequest, bad_request

DECODE_BLOCK_S = 10  # seconds of audio decoded per read while the duration limit is checked


def decode_upload(data: bytes, filename: str, max_audio_s: float | None) -> Audio:
    """Upload bytes -> 16 kHz mono ``Audio``: libsndfile detects the format from the bytes; the stream is read in
    blocks of ``DECODE_BLOCK_S`` and refused as soon as it exceeds ``max_audio_s`` (a header declaring more is
    refused before anything is decoded). Then ``load_audio`` does what it does for files (mono, resampling,
    checks). Every problem is a 400 naming the file.

    MP4/M4A/MOV, WebM/Matroska and ADTS AAC (which libsndfile cannot read) are decoded with PyAV when it is
    installed (the ``containers`` extra; else a 400 saying so), with the same limits: the header's duration
    first, then frames counted while decoding. The samples equal what ``load_audio`` gives for the same file.

    Truncation: a decode error part-way (a cut FLAC, MP4 or AAC), or a FLAC/MP3 that decodes to less than 90 % of
    the length its header declares, is refused; a cut WAV, Ogg or WebM has no such tell here (what is there
    decodes) and is transcribed as the shorter audio it is."""
    import soundfile as sf

    name = f"file {filename!r}"
    if not data:
        raise bad_request(f"{name} is empty (0 bytes)", "file", "empty_file")
    kind = container_kind(data)
    if kind is not None:
        rate, channels, blocks = _decode_container(data, kind, name, max_audio_s)
        return _to_audio(blocks, rate, channels, name)
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except Exception as e:
        why = str(e).rsplit(">: ", 1)[-1].strip() or type(e).__name__  # libsndfile names the BytesIO object
        raise bad_request(f"{name} is not audio this server can decode ({why}); send wav, flac, ogg "
                          f"(vorbis/opus), mp3, or (with PyAV installed) mp4/m4a/webm", "file",
                          "invalid_audio") from None
    with f:
        rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        max_frames = None if not max_audio_s else int(max_audio_s * rate)
        if max_frames is not None and declared > max_frames and f.format not in ("MPEG",):
            raise _too_long(name, declared / rate, max_audio_s)
        blocks, total = [], 0
        try:
            while True:
                block = f.read(DECODE_BLOCK_S * rate, dtype="float32", always_2d=True)
                if not len(block):
                    break
                total += len(block)
                if max_frames is not None and total > max_frames:
                    raise _too_long(name, None, max_audio_s)
                blocks.append(block)
        except APIError:
            raise
        except Exception as e:
            raise bad_request(f"{name} is truncated or corrupt: decoding failed after {total / rate:.2f} s "
                              f"({type(e).__name__}: {e})", "file", "invalid_audio") from None
        if f.format in ("FLAC", "MPEG") and declared > 0 and total < 0.9 * declared:
            raise bad_request(f"{name} is truncated: its header declares {declared / rate:.2f} s but only "
                              f"{total / rate:.2f} s could be decoded", "file", "invalid_audio")
    return _to_audio(blocks, rate, channels, name)


def _to_audio(blocks: list[np.ndarray], rate: int, channels: int, name: str) -> Audio:
    """(frames, channels) blocks at the file's rate -> ``load_audio`` (mono, resampling, checks), as for files."""
    samples = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
    if channels == 1:
        samples = samples[:, 0]
    try:
        return load_audio(samples, rate, source=name)
    except AudioError as e:
        raise bad_request(str(e), "file", "invalid_audio") from None


def container_kind(data: bytes) -> str | None:
    """MP4/M4A/MOV (``ftyp``), Matroska/WebM (EBML) or ADTS AAC, from the magic bytes: the containers libsndfile
    cannot read (the OpenAI API accepts mp4, m4a and webm; browsers record webm)."""
    if data[4:8] == b"ftyp":
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska"
    if len(data) >= 2 and data[0] == 0xFF and (data[1] & 0xF6) == 0xF0:
        return "AAC (ADTS)"
    return None


def _decode_container(data: bytes, kind: str, name: str, max_audio_s: float | None):
    """Decode with PyAV (the ``containers`` extra): the header's duration is checked first (MP4 and WebM declare
    it; ADTS does not), then frames are counted while decoding and the upload refused once past the limit."""
    try:
        import av
    except ImportError:
        raise bad_request(f"{name} is {kind}, which needs PyAV on the server (pip install 'glmasr[containers]')",
                          "file", "unsupported_format") from None
    try:
        container = av.open(io.BytesIO(data), "r")
    except Exception as e:
        raise bad_request(f"{name} looks like {kind} but cannot be opened ({type(e).__name__}: {e})", "file",
                          "invalid_audio") from None
    with container:
        if not container.streams.audio:
            raise bad_request(f"{name} has no audio stream", "file", "invalid_audio")
        stream = container.streams.audio[0]
        if max_audio_s:
            declared = None
            if stream.duration and stream.time_base:
                declared = float(stream.duration * stream.time_base)
            elif container.duration:
                declared = container.duration / 1_000_000
            if declared is not None and declared > max_audio_s and kind != "AAC (ADTS)":
                raise _too_long(name, declared, max_audio_s)
        to_float = av.AudioResampler(format="fltp")  # sample format only: same layout and rate
        blocks, rate, channels, total = [], None, None, 0
        try:
            for frame in container.decode(stream):
                for fr in to_float.resample(frame):
                    a = fr.to_ndarray()  # (channels, frames)
                    if rate is None:
                        rate, channels = int(fr.sample_rate), a.shape[0]
                    elif int(fr.sample_rate) != rate or a.shape[0] != channels:
                        raise bad_request(f"{name}: the audio stream changes its rate or channels part-way",
                                          "file", "invalid_audio")
                    total += a.shape[1]
                    if max_audio_s and total > max_audio_s * rate:
                        raise _too_long(name, None, max_audio_s)
                    blocks.append(np.ascontiguousarray(a.T))
        except APIError:
            raise
        except Exception as e:
            raise bad_request(f"{name} is truncated or corrupt: decoding failed after "
                              f"{total / (rate or 1):.2f} s ({type(e).__name__}: {e})", "file",
                              "invalid_audio") from None
    if rate is None:
        raise bad_request(f"{name}: no audio could be decoded", "file", "invalid_audio")
    return rate, channels, blocks


def _too_long(name: str, seconds: float | None, limit: float) -> APIError:
    what = f"{seconds:.1f} s long" if seconds is not None else f"longer than {limit:g} s"
    return APIError(413, f"{name} is {what}; this server accepts at most {limit:g} s of audio per request "
                         f"(--max-audio-s)", param="file", code="audio_too_long")


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


class Admission:
    """At most ``limit`` requests inside the server at once; one more is refused (429), never queued unbounded."""

    def __init__(self, limit: int, metrics: Metrics):
        self.limit = limit
        self.active = 0
        self._lock = threading.Lock()
        self._metrics = metrics

    def enter(self) -> "Ticket":
        with self._lock:
            if self.active >= self.limit:
                raise APIError(429, f"the server has {self.active} requests in flight (its limit, --max-queue); "
                                    "retry later", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"})
            self.active += 1
            self._metrics.queue_depth.set(self.active)
        return Ticket(self)

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1
            self._metrics.queue_depth.set(self.active)


class Ticket:
    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._leave()


@dataclass
class Started:
    """A request submitted to the engine."""

    job: object  # TranscriptionJob
    audio: Audio
    t0: float  # request received (perf_counter)
    first_token: list  # [perf_counter of the first engine output] once it came


class TranscriptionService:
    def __init__(self, asr, metrics: Metrics, max_audio_s: float | None):
        self.asr = asr
        self.metrics = metrics
        self.max_audio_s = max_audio_s

    def _prepare(self, req: TranscriptionRequest, t0: float) -> Started:
        t_audio = time.perf_counter()
        audio = decode_upload(req.data, req.filename, self.max_audio_s)
        audio_ms = 1e3 * (time.perf_counter() - t_audio)
        pieces = None if req.vad is None else vad_pieces(audio, req.vad)
        try:
            decode = DecodeOptions(prompt=req.instruction)
            job = self.asr.submit_loaded(audio, decode, 0, t0, audio_ms, pieces=pieces)
        except EngineClosed:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        except AudioError as e:  # too short for one audio token
            raise bad_request(str(e), "file", "invalid_audio") from None
        except ValueError as e:  # the prompt leaves no room for the audio
            raise bad_request(str(e), "prompt") from None
        first: list = []
        stream = job.stream
        calls = [0]

        def on_output():  # on the engine thread as each output arrives, and once at once from set_listener
            calls[0] += 1
            if not first and (calls[0] > 1 or getattr(stream, "_items", None)):
                first.append(time.perf_counter())
        stream.set_listener(on_output)
        return Started(job, audio, t0, first)

    async def start(self, req: TranscriptionRequest, t0: float) -> Started:
        """Decode, plan and submit in a worker thread. If the caller is cancelled meanwhile, the job that the
        thread still submits is aborted as soon as it exists."""
        fut = asyncio.get_running_loop().run_in_executor(None, self._prepare, req, t0)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().job.abort())
            raise

    def _account(self, started: Started, result) -> None:
        m = self.metrics
        m.audio_seconds.inc(started.audio.duration_s)
        m.generated_tokens.inc(len(result.token_ids))
        m.prompt_tokens.inc(prompt_tokens(started.job))
        if started.first_token:
            m.ttft.observe(started.first_token[0] - started.t0)

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
            yield protocol.done_event(result.text, prompt_tokens(job), len(result.token_ids))
            yield protocol.sse("[DONE]")
        except EngineError as e:
            yield protocol.error_event(f"transcription failed: {e}", code="engine_error")
        finally:
            job.abort()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def prompt_tokens(job) -> int:
    return sum(len(p.prompt_ids) for p in job.assembler.plans)
