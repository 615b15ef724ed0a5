"""Audio in: decoding (``decode``: files, bytes, file objects, within memory and parameter limits), resampling and
channel mixing (``resample``), the one entry for any input (``load``: ``load_audio``, ``split_windows``), the
log-mel features and token counts (``features``) and voice activity (``vad``: the Silero network and
``segment``, the one VAD entry every caller uses)."""

from ..errors import (AudioDecodeError, AudioError, AudioTooLongError, AudioWarning, EmptyAudioFileError,
                      InvalidAudioError, TruncatedAudioError, UnsupportedAudioError, UnsupportedFormatError)
from .decode import Audio, decode_audio_bytes, decode_audio_file, read_file
from .features import SAMPLE_RATE, WINDOW_SAMPLES
from .load import load_audio, split_windows
from .resampler import resample

__all__ = ["Audio", "AudioDecodeError", "AudioError", "AudioTooLongError", "AudioWarning", "EmptyAudioFileError",
           "InvalidAudioError", "SAMPLE_RATE", "TruncatedAudioError", "UnsupportedAudioError",
           "UnsupportedFormatError", "WINDOW_SAMPLES", "decode_audio_bytes", "decode_audio_file", "load_audio",
           "read_file", "resample", "split_windows"]
