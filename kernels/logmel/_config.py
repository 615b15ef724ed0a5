"""Pure-python logic of the CUDA log-mel frontend (no GPU, no NVRTC needed).

Argument validation for the torchaudio-compatible MelSpectrogram, the mel filter banks and their
sparse packing, the per-n_fft launch configuration, and a python mirror of the kernel's pad-mode
index mapping (kept here so that it can be unit-tested against torch.nn.functional.pad on CPU).
"""

from __future__ import annotations

import math

import numpy as np

SUPPORTED_N_FFT = (400,) + tuple(1 << k for k in range(6, 15))  # 400, 64 .. 16384
PAD_MODES = {"reflect": 0, "constant": 1, "replicate": 2, "circular": 3}

# Whisper features only (n_fft 400, log-mel + finalize): mel results stored from registers instead of a
# shared output tile (LM_DIRECT), and __launch_bounds__ min blocks per SM (LM_MINB, 0: none).
# Measured on the H200 (graph replay, 128x30s): tile + no bound 0.424 ms, direct 0.387 ms, direct + minb 5
# (72 regs, 5 blocks/SM, 20 B spill) 0.369 ms; see notes/logmel.md.
WHISPER_DIRECT = True
WHISPER_MINB = 5


def out_dtype_flags(dtype, name: str = "dtype") -> tuple[bool, bool]:
    """(out_bf16, out_f16) of KernelConfig for an output dtype; ValueError naming the accepted ones otherwise.

    The kernels compute in float32 and round once on store (round to nearest even). float16 saturates to inf
    above 65504 (power mel values of loud input can), exactly what torch's ``.to(torch.float16)`` gives.
    """
    import torch

    flags = {torch.float32: (False, False), torch.bfloat16: (True, False), torch.float16: (False, True)}
    if not isinstance(dtype, torch.dtype) or dtype not in flags:
        raise ValueError(f"{name} must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    return flags[dtype]

# n_fft -> (elements per thread, complex FFTs per block, iterations per block).
# Threads per FFT = n_fft / ept; blocks get >= 128 threads where the FFT allows it.
LAUNCH = {
    64: (8, 16, 2),
    128: (8, 8, 2),
    256: (16, 8, 2),
    400: (20, 8, 2),
    512: (16, 4, 2),
    1024: (16, 2, 2),
    2048: (16, 1, 2),
    4096: (16, 1, 1),
    8192: (16, 1, 1),
    16384: (32, 1, 1),
}


def threads_per_block(n_fft: int) -> int:
    ept, pairs, _ = LAUNCH[n_fft]
    return (n_fft // ept) * pairs


def split_lanes(n_fft: int, n_mels: int) -> int:
    """Lanes per mel dot product: spread idle threads over the dot products (a power of 2 <= 32)."""
    ept, pairs, _ = LAUNCH[n_fft]
    threads = threads_per_block(n_fft)
    if threads % 32:
        return 1  # shuffles need whole warps
    s = 1
    while s < 32 and 2 * s * pairs * n_mels <= threads:
        s *= 2
    return s


def power_mode(power: float) -> int:
    return 0 if power == 2.0 else 1 if power == 1.0 else 2


# ---------------------------------------------------------------- pad-mode index mapping (mirror)
def map_pad_index(j: int, length: int, mode: str) -> int:
    """Index into a signal of `length` for position j of its pad-mode padded version (-1: zero).

    Mirrors map_pad() in logmel.cu; one fold, valid for pads accepted by validate_pad().
    """
    if 0 <= j < length:
        return j
    if mode == "reflect":
        return -j if j < 0 else 2 * (length - 1) - j
    if mode == "replicate":
        return 0 if j < 0 else length - 1
    if mode == "circular":
        return j + length if j < 0 else j - length
    if mode == "constant":
        return -1
    raise ValueError(f"pad_mode must be one of {sorted(PAD_MODES)}, got {mode!r}")


def validate_pad(cpad: int, length: int, mode: str) -> None:
    """torch.nn.functional.pad's limits for centre padding `cpad` on a signal of `length`."""
    if mode == "reflect" and cpad >= length:
        raise ValueError(
            f"pad_mode='reflect' needs the (padded) signal longer than n_fft // 2 = {cpad}, got {length} samples"
        )
    if mode == "circular" and cpad > length:
        raise ValueError(f"pad_mode='circular' needs at least n_fft // 2 = {cpad} samples, got {length}")


def n_frames(length: int, n_fft: int, hop: int, pad: int, center: bool) -> int:
    lp = length + 2 * pad + (2 * (n_fft // 2) if center else 0)
    if lp < n_fft:
        raise ValueError(f"signal too short: {length} samples (+ padding) < n_fft={n_fft}")
    return 1 + (lp - n_fft) // hop


# ---------------------------------------------------------------- filter banks
def _hz_to_mel(f, scale: str):
    f = np.asarray(f, dtype=np.float64)
    if scale == "htk":
        return 2595.0 * np.log10(1.0 + f / 700.0)
    mel = 3.0 * f / 200.0
    logstep = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-30) / 1000.0) / logstep, mel)


def _mel_to_hz(m, scale: str):
    m = np.asarray(m, dtype=np.float64)
    if scale == "htk":
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    f = 200.0 * m / 3.0
    logstep = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), f)


def mel_fbanks(n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int, norm, mel_scale: str):
    """Triangular mel filters (n_freqs, n_mels), float32, torchaudio.functional.melscale_fbanks semantics
    (bins on linspace(0, sample_rate // 2, n_freqs); norm None or 'slaney'; mel_scale 'htk' or 'slaney').

    Evaluated in float32 torch arithmetic in the same order as torchaudio: its float32 filters differ
    from exact ones by up to ~3e-4 relative at the triangle edges, more than the 1e-4 test tolerance.
    """
    import torch

    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    m_min = float(_hz_to_mel(f_min, mel_scale))
    m_max = float(_hz_to_mel(f_max, mel_scale))
    m_pts = torch.linspace(m_min, m_max, n_mels + 2)
    if mel_scale == "htk":
        f_pts = 700.0 * (10.0 ** (m_pts / 2595.0) - 1.0)
    else:
        f_pts = 200.0 * m_pts / 3.0
        log_t = m_pts >= 15.0
        f_pts[log_t] = 1000.0 * torch.exp(math.log(6.4) / 27.0 * (m_pts[log_t] - 15.0))
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0.0)
    if norm == "slaney":
        fb = fb * (2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels])).unsqueeze(0)
    return fb.numpy().astype(np.float32)


def pack_filters(fb: np.ndarray, scale: float = 1.0):
    """Sparse packing of (n_freqs, n_mels) triangular filters: each filter's contiguous support.

    Returns int32 start, width, offset (n_mels,) and float32 weights (nnz,), weights * scale.
    The support is [first non-zero, last non-zero]; zeros inside it (none for triangles) are kept.
    """
    fb = np.asarray(fb, dtype=np.float32)
    n_freqs, n_mels = fb.shape
    start = np.zeros(n_mels, np.int32)
    width = np.zeros(n_mels, np.int32)
    off = np.zeros(n_mels, np.int32)
    chunks = []
    pos = 0
    for m in range(n_mels):
        nz = np.nonzero(fb[:, m])[0]
        if nz.size:
            lo, hi = int(nz[0]), int(nz[-1]) + 1
            start[m], width[m] = lo, hi - lo
            chunks.append(fb[lo:hi, m])
        off[m] = pos
        pos += int(width[m])
    w = np.concatenate(chunks) if chunks else np.zeros(1, np.float32)
    w = (w.astype(np.float64) * scale).astype(np.float32)
    if w.size == 0:
        w = np.zeros(1, np.float32)
    return start, width, off, w


def smem_bytes(ws_bytes: int, tfs: int, n_mels: int, nnz: int) -> int:
    """Dynamic shared memory of logmel_main (layout in logmel.cu): FFT workspace / Z, output tile, filter
    descriptors, filter weights."""
    return ws_bytes + 4 * n_mels * tfs + 12 * n_mels + 4 * nnz


# ---------------------------------------------------------------- MelSpectrogram arguments
def validate_mel_args(
    sample_rate=16000,
    n_fft=400,
    win_length=None,
    hop_length=None,
    f_min=0.0,
    f_max=None,
    pad=0,
    n_mels=128,
    window_fn=None,
    power=2.0,
    normalized=False,
    wkwargs=None,
    center=True,
    pad_mode="reflect",
    onesided=None,
    norm=None,
    mel_scale="htk",
) -> dict:
    """Check torchaudio.transforms.MelSpectrogram arguments; return the resolved ones.

    Raises ValueError naming the argument for anything the CUDA kernel does not support.
    """
    import torch

    if window_fn is not None and window_fn is not torch.hann_window:
        raise ValueError("window_fn: only the periodic Hann window (torch.hann_window) is supported")
    if wkwargs:
        raise ValueError("wkwargs: window arguments are not supported (periodic Hann only)")
    if not isinstance(n_fft, int) or isinstance(n_fft, bool) or n_fft not in SUPPORTED_N_FFT:
        raise ValueError(f"n_fft must be 400 or a power of two in [64, 16384], got {n_fft!r}")
    win_length = n_fft if win_length is None else win_length
    if not isinstance(win_length, int) or not 1 <= win_length <= n_fft:
        raise ValueError(f"win_length must be an int in [1, n_fft={n_fft}], got {win_length!r}")
    hop_length = win_length // 2 if hop_length is None else hop_length
    if not isinstance(hop_length, int) or hop_length < 1:
        raise ValueError(f"hop_length must be a positive int, got {hop_length!r}")
    if not isinstance(sample_rate, (int, float)) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate!r}")
    f_max = float(sample_rate // 2) if f_max is None else float(f_max)
    f_min = float(f_min)
    if not 0.0 <= f_min < f_max:
        raise ValueError(f"f_min must satisfy 0 <= f_min < f_max, got f_min={f_min}, f_max={f_max}")
    if not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be a non-negative int, got {pad!r}")
    if not isinstance(n_mels, int) or not 1 <= n_mels <= 1024:
        raise ValueError(f"n_mels must be an int in [1, 1024], got {n_mels!r}")
    if power is None:
        raise ValueError("power=None (complex spectrogram) is not supported; use a positive float")
    if not isinstance(power, (int, float)) or isinstance(power, bool) or not power > 0 or not math.isfinite(power):
        raise ValueError(f"power must be a positive finite number, got {power!r}")
    if normalized is True:
        normalized = "window"
    if normalized not in (False, "window", "frame_length"):
        raise ValueError(f"normalized must be a bool, 'window' or 'frame_length', got {normalized!r}")
    if not isinstance(center, bool):
        raise ValueError(f"center must be a bool, got {center!r}")
    if pad_mode not in PAD_MODES:
        raise ValueError(f"pad_mode must be one of {sorted(PAD_MODES)}, got {pad_mode!r}")
    if onesided is not None and onesided is not True:
        raise ValueError("onesided: only onesided=True (or None) is supported; a mel scale needs the onesided spectrum")
    if norm not in (None, "slaney"):
        raise ValueError(f"norm must be None or 'slaney', got {norm!r}")
    if mel_scale not in ("htk", "slaney"):
        raise ValueError(f"mel_scale must be 'htk' or 'slaney', got {mel_scale!r}")
    return dict(
        sample_rate=sample_rate, n_fft=n_fft, win_length=win_length, hop_length=hop_length, f_min=f_min,
        f_max=f_max, pad=pad, n_mels=n_mels, power=float(power), normalized=normalized, center=center,
        pad_mode=pad_mode, norm=norm, mel_scale=mel_scale,
    )


def hann_window_padded(n_fft: int, win_length: int) -> np.ndarray:
    """Periodic Hann of win_length, zero-padded to n_fft centred (torch.stft's placement), float32."""
    import torch

    w = torch.hann_window(win_length, periodic=True, dtype=torch.float32).numpy()
    out = np.zeros(n_fft, np.float32)
    left = (n_fft - win_length) // 2
    out[left : left + win_length] = w
    return out


def magnitude_scale(normalized, n_fft: int, window: np.ndarray) -> float:
    """Factor s applied to X by the STFT normalisation (torchaudio's Spectrogram semantics)."""
    if normalized == "window":
        return 1.0 / math.sqrt(float(np.sum(window.astype(np.float64) ** 2)))
    if normalized == "frame_length":
        return 1.0 / math.sqrt(n_fft)
    return 1.0
