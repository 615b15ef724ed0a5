"""The one entry for any audio input: ``load_audio`` (a path, bytes-like file decoding aside, a numpy array or a
torch tensor) -> 16 kHz mono float32 ``Audio``; ``split_windows`` cuts it into the reference processor's 30 s
windows.

- Files decode through ``decode.py`` (the format from the magic bytes, limits, truncation warnings).
- Arrays/tensors: float data is taken as is (float16, bfloat16 and the other float types converted to
  float32); integer PCM is scaled to [-1, 1) (int16 by 1/32768, int32 by 1/2^31, uint8 centred at 128). Other
  sample types (bool, complex, object, strings, ...) raise ``AudioError`` naming the input and the dtype.
- Several channels are averaged to mono. A 2-D array is (samples, channels) or (channels, samples): the axis
  with at most ``MAX_CHANNELS`` (16) entries is the channel axis.
- Any other sample rate is resampled to 16 kHz (``resampler.py``).
- Bad input (empty audio, NaN/inf, a bad sample rate) raises ``AudioError`` naming it.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch

from ..errors import AudioError
from . import resampler as _rs
from .decode import Audio, _decode_path, _decoded_audio
from .features import WINDOW_SAMPLES

MAX_CHANNELS = 16  # arrays: the axis with at most this many entries is the channel axis


def _prefixed(e: AudioError, prefix: str) -> AudioError:
    """``e`` (same class and attributes) with its message led by ``prefix``."""
    new = copy.copy(e)
    new.args = (f"{prefix}: {e}",)
    return new


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
        return _rs.blockwise_mean(data, axis=1)
    if rows <= MAX_CHANNELS:
        return _rs.blockwise_mean(data, axis=0)
    raise AudioError(f"{source}: cannot tell the channel axis of shape {data.shape} (neither axis has <= "
                     f"{MAX_CHANNELS} entries)")


def _samples_16k(data, rate, source: str, error: type[AudioError]) -> np.ndarray:
    """Checked samples at ``rate`` -> 16 kHz mono float32; the checks raise ``error`` (InvalidAudioError for
    decoded audio, so a bad file or upload keeps its typed code)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 1000 <= int(rate) <= 768000:
        raise error(f"{source}: sampling_rate must be an integer in [1000, 768000] Hz, got {rate!r}")
    data = _to_mono(_to_float(np.asarray(data), source), source)
    if data.shape[0] == 0:
        raise error(f"{source}: audio is empty (0 samples)")
    if not np.isfinite(data).all():
        bad = int((~np.isfinite(data)).sum())
        raise error(f"{source}: audio has {bad} NaN or infinite samples")
    return np.ascontiguousarray(_rs.resample(data, int(rate)), dtype=np.float32)


def load_audio(audio, sampling_rate: int | None = None, source: str | None = None) -> Audio:
    """One input (path, numpy array or torch tensor) -> 16 kHz mono float32 ``Audio``.

    ``sampling_rate`` is required for arrays/tensors and, for files, must match the file's rate if given.
    ``source``: how messages name the input (e.g. "audio 3" for the fourth item of a batch); the default is
    the path, or "ndarray/Tensor of shape (...), dtype ...". Every AudioError starts with it, and so does the
    ``AudioWarning`` for a truncated file (issued once per call; the result's ``truncated`` says so too).
    Files decode as ``decode_audio_bytes`` does and raise the same ``AudioDecodeError`` kinds.
    """
    if isinstance(audio, Audio):
        return audio
    if isinstance(audio, (str, os.PathLike)):
        try:
            dec = _decode_path(audio, mono=True)
        except AudioError as e:  # these already name the path
            raise (e if source is None else _prefixed(e, source)) from None
        source = str(audio) if source is None else f"{source} ({audio})"
        return _decoded_audio(dec, source, sampling_rate, allow_truncated=True)
    if isinstance(audio, (np.ndarray, torch.Tensor)):
        what = f"{type(audio).__name__} of shape {tuple(audio.shape)}, dtype {audio.dtype}"
        source = what if source is None else f"{source} ({what})"
        if sampling_rate is None:
            raise AudioError(f"{source}: pass sampling_rate= with raw audio arrays (e.g. 16000)")
        data = _tensor_to_numpy(audio, source) if isinstance(audio, torch.Tensor) else np.asarray(audio)
        return Audio(samples=_samples_16k(data, sampling_rate, source, AudioError), source=source)
    raise AudioError(f"{'' if source is None else source + ': '}unsupported audio input type "
                     f"{type(audio).__name__}: pass a file path, a numpy array or a torch tensor")


def split_windows(samples: np.ndarray) -> list[np.ndarray]:
    """Non-overlapping 30 s windows, like the reference processor (the last may be shorter)."""
    n = samples.shape[0]
    count = max(1, -(-n // WINDOW_SAMPLES))
    return [samples[i * WINDOW_SAMPLES: min((i + 1) * WINDOW_SAMPLES, n)] for i in range(count)]
