"""Audio input: files, numpy arrays and torch tensors to 16 kHz mono float32, then 30 s windows.

- Files are read with ``soundfile`` (libsndfile: wav, flac, ogg/vorbis, opus, mp3 and more), always as float32
  in [-1, 1) whatever the stored PCM format.
- Arrays/tensors: float data is taken as is (float16, bfloat16 and the other float types converted to
  float32); integer PCM is scaled to [-1, 1) (int16 by 1/32768, int32 by 1/2^31, uint8 centred at 128). Other
  sample types (bool, complex, object, strings, ...) raise ``AudioError`` naming the input and the dtype.
- Several channels are averaged to mono. A 2-D array is (samples, channels) or (channels, samples): the axis
  with at most 16 entries is the channel axis.
- Any other sample rate is resampled to 16 kHz with ``soxr`` (the SoX resampler, "HQ" quality): a band-limited
  polyphase resampler with a steep anti-alias filter, far more accurate than linear interpolation, fast on the
  CPU, and the default resampler of librosa, which is what Whisper-family models were usually fed.
- Bad input (missing/corrupt file, empty audio, NaN/inf, a bad sample rate) raises ``AudioError`` naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .features import SAMPLE_RATE, WINDOW_SAMPLES

MAX_CHANNELS = 16


class AudioError(ValueError):
    """Audio that cannot be used: missing, unreadable, empty, non-finite or with a bad sample rate."""


@dataclass
class Audio:
    """16 kHz mono float32 samples and where they came from (for messages)."""

    samples: np.ndarray
    source: str

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / SAMPLE_RATE


def _unsupported_dtype(source: str, dtype) -> AudioError:
    return AudioError(f"{source}: unsupported sample dtype {dtype}; audio must be float (float16/bfloat16/"
                      f"float32/float64) or integer PCM (int8/int16/int32/int64/uint8) samples")


def _tensor_to_numpy(t: torch.Tensor, source: str) -> np.ndarray:
    """A torch tensor's samples as numpy: float types other than float32/float64 (float16, bfloat16, float8,
    which numpy lacks or handles poorly) become float32; bool and complex are refused, naming the dtype."""
    if t.dtype == torch.bool or t.is_complex():
        raise _unsupported_dtype(source, t.dtype)
    t = t.detach()
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    try:
        return t.cpu().numpy()
    except (TypeError, RuntimeError) as e:  # a dtype or layout numpy cannot hold (sparse, quantized, ...)
        raise AudioError(f"{source}: cannot read samples of dtype {t.dtype} ({e})") from None


def _to_float(data: np.ndarray, source: str) -> np.ndarray:
    if data.dtype == np.bool_:
        raise _unsupported_dtype(source, data.dtype)
    if np.issubdtype(data.dtype, np.floating):
        return data.astype(np.float32, copy=False)
    if data.dtype == np.uint8:
        return (data.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(data.dtype, np.signedinteger):
        scale = float(2 ** (8 * data.dtype.itemsize - 1))
        return (data.astype(np.float64) / scale).astype(np.float32)
    raise _unsupported_dtype(source, data.dtype)


def _to_mono(data: np.ndarray, source: str) -> np.ndarray:
    if data.ndim == 1:
        return data
    if data.ndim != 2:
        raise AudioError(f"{source}: audio must be 1-D (samples) or 2-D (samples x channels), got shape {data.shape}")
    rows, cols = data.shape
    if cols <= MAX_CHANNELS and (rows > MAX_CHANNELS or cols <= rows):
        return data.mean(axis=1, dtype=np.float64).astype(np.float32)
    if rows <= MAX_CHANNELS:
        return data.mean(axis=0, dtype=np.float64).astype(np.float32)
    raise AudioError(f"{source}: cannot tell the channel axis of shape {data.shape} (neither axis has <= "
                     f"{MAX_CHANNELS} entries)")


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    if rate == target:
        return samples
    import soxr

    return soxr.resample(samples, rate, target, quality="HQ").astype(np.float32, copy=False)


def read_file(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    import soundfile as sf

    p = Path(path).expanduser()
    if not p.exists():
        raise AudioError(f"audio file not found: {p}")
    if p.is_dir():
        raise AudioError(f"audio path is a folder, not a file: {p}")
    try:
        data, rate = sf.read(str(p), dtype="float32", always_2d=False)
    except Exception as e:
        raise AudioError(f"cannot decode audio file {p}: {e}") from None
    return data, int(rate)


def load_audio(audio, sampling_rate: int | None = None, source: str | None = None) -> Audio:
    """One input (path, numpy array or torch tensor) -> 16 kHz mono float32 ``Audio``.

    ``sampling_rate`` is required for arrays/tensors and, for files, must match the file's rate if given.
    ``source``: how messages name the input (e.g. "audio 3" for the fourth item of a batch); the default is
    the path, or "ndarray/Tensor of shape (...), dtype ...". Every AudioError starts with it.
    """
    if isinstance(audio, Audio):
        return audio
    if isinstance(audio, (str, os.PathLike)):
        try:
            data, rate = read_file(audio)
        except AudioError as e:  # these already name the path
            raise (e if source is None else AudioError(f"{source}: {e}")) from None
        source = str(audio) if source is None else f"{source} ({audio})"
        if sampling_rate is not None and int(sampling_rate) != rate:
            raise AudioError(f"{source}: file is {rate} Hz but sampling_rate={sampling_rate} was given")
    elif isinstance(audio, (np.ndarray, torch.Tensor)):
        what = f"{type(audio).__name__} of shape {tuple(audio.shape)}, dtype {audio.dtype}"
        source = what if source is None else f"{source} ({what})"
        if sampling_rate is None:
            raise AudioError(f"{source}: pass sampling_rate= with raw audio arrays (e.g. 16000)")
        rate = sampling_rate
        data = _tensor_to_numpy(audio, source) if isinstance(audio, torch.Tensor) else np.asarray(audio)
    else:
        raise AudioError(f"{'' if source is None else source + ': '}unsupported audio input type "
                         f"{type(audio).__name__}: pass a file path, a numpy array or a torch tensor")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 1000 <= int(rate) <= 768000:
        raise AudioError(f"{source}: sampling_rate must be an integer in [1000, 768000] Hz, got {rate!r}")
    data = _to_mono(_to_float(np.asarray(data), source), source)
    if data.shape[0] == 0:
        raise AudioError(f"{source}: audio is empty (0 samples)")
    if not np.isfinite(data).all():
        bad = int((~np.isfinite(data)).sum())
        raise AudioError(f"{source}: audio has {bad} NaN or infinite samples")
    samples = np.ascontiguousarray(resample(data, int(rate)), dtype=np.float32)
    return Audio(samples=samples, source=source)


def split_windows(samples: np.ndarray) -> list[np.ndarray]:
    """Non-overlapping 30 s windows, like the reference processor (the last may be shorter)."""
    n = samples.shape[0]
    count = max(1, -(-n // WINDOW_SAMPLES))
    return [samples[i * WINDOW_SAMPLES: min((i + 1) * WINDOW_SAMPLES, n)] for i in range(count)]
