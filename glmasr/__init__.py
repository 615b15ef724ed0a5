"""glmasr: a fast, exact inference engine for GLM-ASR-Nano-2512.

    import glmasr
    result = glmasr.transcribe("speech.wav")            # loads zai-org/GLM-ASR-Nano-2512
    asr = glmasr.load("/path/to/checkpoint", device="cuda")
    results = glmasr.transcribe(["a.wav", "b.flac"], model=asr)
"""

from .api import GlmAsr, Transcription, TranscriptDelta, load, transcribe, transcribe_stream
from .audio import AudioError
from .config import ConfigError, GlmAsrConfig
from .tokenizer import TokenizerError
from .weights import CheckpointError

__all__ = ["load", "transcribe", "transcribe_stream", "GlmAsr", "Transcription", "TranscriptDelta", "GlmAsrConfig", "AudioError", "CheckpointError",
           "ConfigError", "TokenizerError"]
__version__ = "0.1.0"
