"""Whisper's mel filter bank in plain numpy (no torch, no CUDA).

One definition shared by the CUDA frontend (``_runtime``, which packs it for the kernel) and the plain-PyTorch
reference ``glmasr.audio.features`` (which imports it from here: the package may import the kernels, the kernels
never import the package).
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400


def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    min_log_hz, min_log_mel = 1000.0, 15.0
    logstep = 27.0 / np.log(6.4)
    mels = 3.0 * freq / 200.0
    log_region = freq >= min_log_hz
    mels = np.where(log_region, min_log_mel + np.log(np.maximum(freq, 1e-30) / min_log_hz) * logstep, mels)
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    min_log_hz, min_log_mel = 1000.0, 15.0
    logstep = np.log(6.4) / 27.0
    freq = 200.0 * mels / 3.0
    log_region = mels >= min_log_mel
    return np.where(log_region, min_log_hz * np.exp(logstep * (mels - min_log_mel)), freq)


@functools.lru_cache(maxsize=16)
def mel_filter_bank_np(
    n_freqs: int = N_FFT // 2 + 1,
    n_mels: int = 128,
    f_min: float = 0.0,
    f_max: float = 8000.0,
    sample_rate: int = SAMPLE_RATE,
) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters, shape (n_freqs, n_mels), float32.

    Built in float64 and cast once, like ``transformers.audio_utils.mel_filter_bank(..., norm="slaney",
    mel_scale="slaney")``: FFT bin k sits at ``k * sample_rate / (2 * (n_freqs - 1))`` Hz.
    Cached: the returned array is shared, do not modify it.
    """
    if n_mels < 1:
        raise ValueError(f"n_mels must be >= 1, got {n_mels}")
    if not 0.0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"need 0 <= f_min < f_max <= sample_rate/2, got f_min={f_min}, f_max={f_max}")
    mel_pts = np.linspace(_hz_to_mel_slaney(f_min), _hz_to_mel_slaney(f_max), n_mels + 2)
    hz_pts = _mel_to_hz_slaney(mel_pts)
    fft_freqs = np.linspace(0, sample_rate // 2, n_freqs)
    diffs = np.diff(hz_pts)
    slopes = hz_pts[None, :] - fft_freqs[:, None]  # (n_freqs, n_mels + 2)
    down = -slopes[:, :-2] / diffs[:-1]
    up = slopes[:, 2:] / diffs[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (hz_pts[2 : n_mels + 2] - hz_pts[:n_mels])
    filters = filters * enorm[None, :]
    return filters.astype(np.float32)


__all__ = ["mel_filter_bank_np"]
