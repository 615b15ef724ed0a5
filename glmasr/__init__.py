"""glmasr: a fast, exact inference engine for GLM-ASR-Nano-2512.

    import glmasr
    result = glmasr.transcribe("speech.wav")            # loads zai-org/GLM-ASR-Nano-2512
    asr = glmasr.load("/path/to/checkpoint", device="cuda")
    results = glmasr.transcribe(["a.wav", "b.flac"], model=asr)   # thread-safe: one engine per model
    asr.close()                                          # or `with glmasr.load(...) as asr:` frees it
"""

from . import errors
from .api import close_shared_model, transcribe, transcribe_stream
from .errors import (AudioError, AudioWarning, CheckpointError, ConfigError, DiarizationUnavailableError,
                     EngineClosed, EngineError, InvalidSpeakerReference, RequestPreempted, RequestTimeoutError,
                     TokenizerError)
from .handle import GlmAsr, TranscriptionJob, load
from .models.config import GlmAsrConfig
from .options import DecodeOptions, EngineOptions, Priority
from .results import Segment, Transcription, TranscriptDelta, Word

__all__ = ["load", "transcribe", "transcribe_stream", "GlmAsr", "TranscriptionJob", "Transcription",
           "TranscriptDelta", "DecodeOptions", "EngineOptions", "GlmAsrConfig", "AudioError", "CheckpointError",
           "ConfigError", "TokenizerError", "EngineError", "EngineClosed", "RequestTimeoutError", "AudioWarning",
           "RequestPreempted", "Priority", "Segment", "Word", "DiarizationUnavailableError", "InvalidSpeakerReference", "close_shared_model", "errors"]
__version__ = "0.1.0"
