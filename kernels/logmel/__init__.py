"""Fused cuFFTDx log-mel frontend (NVRTC-compiled CUDA, launched through the driver API).

Front doors:
  whisper_features(pcm, lengths=None, n_mels=128, out_dtype=torch.float32) -> (features, mask)
      pcm (B, <=480000) float32 or int16 CUDA; features (B, n_mels, 3000), mask (B, 3000) int32.
      out_dtype float32, bfloat16 or float16 (computed in fp32, rounded once on store).
      Exactly glmasr.audio.features.log_mel_windows on the zero-padded 30 s windows (per-window max).
  MelSpectrogram(**torchaudio.transforms.MelSpectrogram arguments except window_fn)
      input (..., time) float32/int16 CUDA -> (..., n_mels, n_frames).
  is_available() -> whether the CUDA path can run here.
  prebuild(n_mels, device | sm=...) / whisper_config(n_mels, sm=...): the cubin whisper_features uses on a device
      (or any device of SM ``sm``, e.g. 900, without one), built ahead (``glmasr compile``).
  mel_filters.mel_filter_bank_np: the Whisper filter bank in numpy (no CUDA; glmasr.audio.features imports it).
"""

from __future__ import annotations

import functools

import torch

from . import _config

__all__ = ["whisper_features", "MelSpectrogram", "is_available", "prebuild", "whisper_config"]


@functools.lru_cache(maxsize=1)
def _deps_importable() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.bindings.nvrtc  # noqa: F401

        from ._build import include_dirs

        include_dirs()
    except Exception:
        return False
    return True


def is_available() -> bool:
    """True when cuda-bindings, NVRTC and the header wheels are importable and a CUDA device exists."""
    return torch.cuda.is_available() and _deps_importable()


def whisper_config(n_mels: int = 128, out_dtype=torch.float32, *, sm: int):
    """The ``KernelConfig`` that ``whisper_features`` (float32 PCM) uses on a device of SM ``sm`` (e.g. 900 for
    capability 9.0); no device needed."""
    rt = _rt()
    return rt._cfg(rt.WHISPER_N_FFT, n_mels, 2.0, True, False, out_dtype, None, sm=sm)


def prebuild(n_mels: int = 128, device: torch.device | str | None = None, out_dtype=torch.float32, *,
             sm: int | None = None) -> None:
    """Build (NVRTC, seconds when the disk cache is cold) or read the cubin that ``whisper_features`` will use
    on ``device`` (or, ``sm`` given, on any device of that SM, e.g. 900, without touching a device), without
    loading it: safe to call from a background thread while other work runs (the NVRTC compile releases the GIL)."""
    from ._build import get_cubin

    if sm is None:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        sm = _rt()._device_sm(idx)
    get_cubin(whisper_config(n_mels, out_dtype, sm=sm))


def _rt():
    from . import _runtime

    return _runtime


def _no_grad_check(x: torch.Tensor, name: str) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"glmasr_kernels.logmel is inference-only (no backward): {name} requires grad; "
            "call it under torch.no_grad() / torch.inference_mode() or detach the input"
        )


def whisper_features(
    pcm: torch.Tensor,
    lengths=None,
    n_mels: int = 128,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper/GLM-ASR log-mel features of (B, <=480000) 16 kHz PCM, one 30 s window per row.

    lengths: valid samples per row (int sequence or int64 tensor); samples at or past it read as
    zero and the mask marks the first ceil(length / 160) frames. Default: the row length.
    out_dtype: torch.float32, torch.bfloat16 or torch.float16; the kernel computes in float32 and rounds once
    on store (the features lie in about [-1.5, 2.5], far inside float16's range).
    Returns (features (B, n_mels, 3000) out_dtype, mask (B, 3000) int32).
    """
    if not isinstance(pcm, torch.Tensor) or pcm.ndim != 2:
        raise ValueError(f"pcm must be a 2-D (B, samples) tensor, got {getattr(pcm, 'shape', type(pcm))}")
    if pcm.shape[1] > 480000:
        raise ValueError(f"pcm rows must hold at most 480000 samples (30 s at 16 kHz), got {pcm.shape[1]}")
    if n_mels not in (80, 128):
        raise ValueError(f"n_mels must be 80 or 128 for Whisper features, got {n_mels!r}")
    _config.out_dtype_flags(out_dtype, "out_dtype")  # ValueError naming the accepted dtypes
    _rt()._check_input(pcm, "pcm")
    _no_grad_check(pcm, "pcm")
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.tensor(list(lengths), dtype=torch.int64)
        if lengths.shape != (pcm.shape[0],):
            raise ValueError(f"lengths must have shape ({pcm.shape[0]},), got {tuple(lengths.shape)}")
        lengths = lengths.to(device=pcm.device, dtype=torch.int64)
    if torch.compiler.is_compiling():  # the registered op, so torch.compile can trace through it
        return torch.ops.glmasr.logmel_whisper(pcm, lengths, n_mels, out_dtype)
    # eager: straight to the implementation (the custom-op dispatch took ~0.45 ms of host time per call under
    # cProfile on the H200 machine, on the critical path of a one-clip transcription)
    return _rt().whisper_impl(pcm, lengths, n_mels, out_dtype)


class MelSpectrogram(torch.nn.Module):
    """torchaudio.transforms.MelSpectrogram on the fused CUDA kernel (periodic Hann window only).

    Extra keyword: dtype (torch.float32, torch.bfloat16 or torch.float16) for the output. The kernel computes
    in float32 and rounds once on store (round to nearest even), so the result equals rounding the float32
    result: float16 output is inf where the power mel value exceeds float16's range (above 65504, e.g. loud
    int16-scale input or large n_fft with power=2), exactly like ``torchaudio_result.to(torch.float16)``.
    Input (..., time) float32 or int16 (scaled by 1/32768) CUDA tensor; output (..., n_mels, n_frames).
    """

    def __init__(
        self,
        sample_rate: int = 16000,
        n_fft: int = 400,
        win_length=None,
        hop_length=None,
        f_min: float = 0.0,
        f_max=None,
        pad: int = 0,
        n_mels: int = 128,
        window_fn=None,
        power: float = 2.0,
        normalized=False,
        wkwargs=None,
        center: bool = True,
        pad_mode: str = "reflect",
        onesided=None,
        norm=None,
        mel_scale: str = "htk",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        a = _config.validate_mel_args(
            sample_rate=sample_rate, n_fft=n_fft, win_length=win_length, hop_length=hop_length, f_min=f_min,
            f_max=f_max, pad=pad, n_mels=n_mels, window_fn=window_fn, power=power, normalized=normalized,
            wkwargs=wkwargs, center=center, pad_mode=pad_mode, onesided=onesided, norm=norm, mel_scale=mel_scale,
        )
        _config.out_dtype_flags(dtype, "dtype")  # ValueError naming the accepted dtypes
        self.args = a
        self.dtype = dtype
        self.out_bf16 = dtype == torch.bfloat16
        for k, v in a.items():
            setattr(self, k, v)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        if not isinstance(waveform, torch.Tensor) or waveform.ndim < 1:
            raise ValueError("waveform must be a tensor of shape (..., time)")
        _rt()._check_input(waveform, "waveform")
        _no_grad_check(waveform, "waveform")
        a = self.args
        T = waveform.shape[-1]
        if a["center"]:
            _config.validate_pad(a["n_fft"] // 2, T + 2 * a["pad"], a["pad_mode"])
        lead = waveform.shape[:-1]
        x = waveform.reshape(-1, T)
        y = torch.ops.glmasr.logmel_mel(
            x, float(a["sample_rate"]), a["n_fft"], a["win_length"], a["hop_length"], a["f_min"], a["f_max"],
            a["pad"], a["n_mels"], a["power"], a["normalized"] or "", a["center"], a["pad_mode"],
            a["norm"] or "", a["mel_scale"], self.dtype,
        )
        return y.reshape(*lead, a["n_mels"], y.shape[-1])

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.args.items())
