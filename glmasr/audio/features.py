"""Whisper log-mel features in plain PyTorch (the reference path; CPU and CUDA).

Recipe (``shared/spec/logmel-frontend.md`` section 1), per 30 s window of 480000 samples at 16 kHz:
reflect-padded centred STFT (n_fft 400, hop 160, periodic Hann), drop the last frame (3000 frames),
power, Slaney mel filterbank (128 or 80 bins, 0-8000 Hz), log10 clamped at 1e-10, clamp at
(window max - 8), then (x + 4) / 4. The max is taken per window over all mel bins and frames,
padding included, exactly as ``transformers.WhisperFeatureExtractor`` does.

This module is the reference that the fused CUDA frontend (``kernels/logmel``) is tested against,
and the CPU path of the engine.
"""

from __future__ import annotations

import functools

import torch

# Defined next to the CUDA frontend that packs it for its kernel (pure numpy; importing it loads no CUDA code).
from glmasr_kernels.logmel.mel_filters import mel_filter_bank_np

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
WINDOW_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000
FRAMES_PER_WINDOW = WINDOW_SAMPLES // HOP_LENGTH  # 3000


def mel_filter_bank(n_mels: int = 128, device: torch.device | str | None = None) -> torch.Tensor:
    """The Whisper filterbank as a torch tensor of shape (201, n_mels), float32."""
    return torch.from_numpy(mel_filter_bank_np(N_FFT // 2 + 1, n_mels)).to(device)


@functools.lru_cache(maxsize=8)
def _cached_constants(n_mels: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32, device=device)
    return window, mel_filter_bank(n_mels, device=device)


def num_valid_frames(num_samples: int | torch.Tensor):
    """Frames of a window that carry audio: ceil(valid_samples / 160) (the reference mask)."""
    if isinstance(num_samples, torch.Tensor):
        return (num_samples + HOP_LENGTH - 1) // HOP_LENGTH
    return (int(num_samples) + HOP_LENGTH - 1) // HOP_LENGTH


def log_mel_windows(windows: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper log-mel of full 30 s windows.

    windows: (B, 480000) float32, already zero-padded; any device.
    returns: (B, n_mels, 3000) float32 on the same device.
    """
    if windows.ndim != 2 or windows.shape[1] != WINDOW_SAMPLES:
        raise ValueError(f"windows must have shape (B, {WINDOW_SAMPLES}), got {tuple(windows.shape)}")
    windows = windows.to(torch.float32)
    window, filters = _cached_constants(n_mels, str(windows.device))
    spec = torch.stft(
        windows, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = spec[..., :-1].abs() ** 2  # (B, 201, 3000): the reference drops the last frame
    mel = filters.T @ power  # (B, n_mels, 3000)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    window_max = log_spec.amax(dim=(1, 2), keepdim=True)
    log_spec = torch.maximum(log_spec, window_max - 8.0)
    return (log_spec + 4.0) / 4.0


def pack_windows(pieces: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-padded 30 s windows (B, 480000) float32 on the CPU from 1-D pieces of at most 480000 samples, and
    their lengths (B,) int64."""
    lengths = [int(p.shape[0]) for p in pieces]
    for i, (p, n) in enumerate(zip(pieces, lengths)):
        if p.ndim != 1 or n > WINDOW_SAMPLES:
            raise ValueError(f"window piece {i} must be 1-D with at most {WINDOW_SAMPLES} samples, got {tuple(p.shape)}")
    out = torch.zeros(len(pieces), WINDOW_SAMPLES, dtype=torch.float32)
    for i, p in enumerate(pieces):
        out[i, : lengths[i]] = torch.as_tensor(p, dtype=torch.float32)
    return out, torch.tensor(lengths, dtype=torch.int64)


def whisper_features(
    pieces: list, n_mels: int = 128, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and frame mask for a list of window pieces (each <= 30 s of 16 kHz mono audio).

    returns (features (B, n_mels, 3000) float32, mask (B, 3000) int32 with the first
    ceil(len/160) frames set).
    """
    windows, lengths = pack_windows(pieces)
    feats = log_mel_windows(windows.to(device), n_mels)
    frames = num_valid_frames(lengths.to(feats.device))
    mask = (torch.arange(FRAMES_PER_WINDOW, device=feats.device)[None, :] < frames[:, None]).to(torch.int32)
    return feats, mask


def frames_to_audio_tokens(frames: int | torch.Tensor, merge_factor: int = 4):
    """Audio tokens from valid mel frames: conv2 halves (ceil), then a 4-frame merge (floor).

    Equals the reference processor's formula; <= 0 means the audio is too short for one token.
    """
    conv2 = (frames - 1) // 2 + 1
    return (conv2 - merge_factor) // merge_factor + 1


def min_samples_for_one_token(merge_factor: int = 4) -> int:
    """Smallest number of 16 kHz samples that yields one audio token (961 for merge 4)."""
    frames_needed = 2 * merge_factor - 1  # ceil(F/2) >= 4  <=>  F >= 7
    return (frames_needed - 1) * HOP_LENGTH + 1


__all__ = [
    "SAMPLE_RATE",
    "N_FFT",
    "HOP_LENGTH",
    "WINDOW_SAMPLES",
    "FRAMES_PER_WINDOW",
    "mel_filter_bank",
    "mel_filter_bank_np",
    "log_mel_windows",
    "pack_windows",
    "whisper_features",
    "num_valid_frames",
    "frames_to_audio_tokens",
    "min_samples_for_one_token",
]

