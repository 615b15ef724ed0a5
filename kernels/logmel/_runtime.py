"""Driver-API module loading and launches of logmel.cu on torch's current stream, and the
torch.library custom ops (namespace glmasr) that wrap them.

Modules are cached per (configuration, device): a CUmodule belongs to one context, and we load
into torch's primary context of the tensor's device.
"""

from __future__ import annotations

import functools
import struct
import threading

import numpy as np
import torch

from . import _config as C
from ._build import KernelConfig, get_cubin
from .mel_filters import mel_filter_bank_np

WHISPER_SAMPLES = 480000
WHISPER_FRAMES = 3000
WHISPER_HOP = 160
WHISPER_N_FFT = 400
MAX_GRID_Y = 65535

_lock = threading.Lock()


def _drv():
    from cuda.bindings import driver

    return driver


def _ck(ret, what: str):
    driver = _drv()
    err = ret[0] if isinstance(ret, tuple) else ret
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call {what} failed: {err}")
    if isinstance(ret, tuple):
        rest = ret[1:]
        return rest[0] if len(rest) == 1 else rest
    return None


@functools.lru_cache(maxsize=None)
def _device_sm(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 100 + minor * 10


def load_module(cubin: bytes, device_index: int):
    """``cubin`` loaded into torch's primary context of device ``device_index`` (made current on this thread if
    nothing is); the CUmodule. Shared by the NVRTC families."""
    driver = _drv()
    with torch.cuda.device(device_index):
        torch.cuda.init()
        torch.cuda.current_stream(device_index)  # makes torch's primary context current
        _ck(driver.cuInit(0), "cuInit")
        ctx = _ck(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            dev = _ck(driver.cuDeviceGet(device_index), "cuDeviceGet")
            ctx = _ck(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _ck(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return _ck(driver.cuModuleLoadData(cubin), "cuModuleLoadData")


class _Module:
    """One loaded cubin: logmel_main (+ logmel_finalize for Whisper) and its layout info."""

    def __init__(self, cfg: KernelConfig, device_index: int):
        driver = _drv()
        with torch.cuda.device(device_index):
            self.module = load_module(get_cubin(cfg), device_index)
            self.main = _ck(driver.cuModuleGetFunction(self.module, b"logmel_main"), "cuModuleGetFunction")
            self.finalize = None
            if cfg.whisper:
                self.finalize = _ck(driver.cuModuleGetFunction(self.module, b"logmel_finalize"), "cuModuleGetFunction")
            dptr, size = _ck(driver.cuModuleGetGlobal(self.module, b"logmel_info"), "cuModuleGetGlobal")
            info = np.zeros(8, np.uint32)
            _ck(driver.cuMemcpyDtoH(info.ctypes.data, dptr, info.nbytes), "cuMemcpyDtoH")
            dev = _ck(driver.cuDeviceGet(device_index), "cuDeviceGet")
            self.smem_optin = int(
                _ck(
                    driver.cuDeviceGetAttribute(
                        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev
                    ),
                    "cuDeviceGetAttribute",
                )
            )
        self.block = (int(info[0]), int(info[1]), 1)
        self.ws_bytes = int(info[2])
        self.ept = int(info[3])
        self.tf = int(info[4])
        self.tfs = int(info[5])
        self.threads = int(info[7])
        self.smem_set = 48 * 1024
        self.cfg = cfg

    def smem(self, hop: int, n_mels: int, nnz: int) -> int:
        """Dynamic shared memory of logmel_main for this module at n_mels / nnz (``hop`` does not change it)."""
        return C.smem_bytes(self.ws_bytes, self.tfs, n_mels, nnz)

    def ensure_smem(self, nbytes: int) -> None:
        if nbytes <= self.smem_set:
            return
        if nbytes > self.smem_optin - 1024:  # static shared memory (the reduction scratch) sits on top
            raise ValueError(
                f"configuration needs {nbytes} bytes of shared memory, more than the device's {self.smem_optin}"
                " (too many mel filter weights for this n_fft/n_mels)"
            )
        driver = _drv()
        _ck(
            driver.cuFuncSetAttribute(
                self.main, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes
            ),
            "cuFuncSetAttribute",
        )
        self.smem_set = nbytes


_modules: dict[tuple[KernelConfig, int], _Module] = {}


def get_module(cfg: KernelConfig, device_index: int) -> _Module:
    key = (cfg, device_index)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = _Module(cfg, device_index)
                _modules[key] = mod
    return mod


def _pack(args) -> np.ndarray:
    """Kernel arguments as 8-byte slots (ints little-endian; floats in the low 4 bytes)."""
    vals = np.zeros(len(args), np.uint64)
    for i, a in enumerate(args):
        if isinstance(a, float):
            vals[i] = struct.unpack("<I", struct.pack("<f", a))[0]
        else:
            vals[i] = int(a) & 0xFFFFFFFFFFFFFFFF
    return vals


def _launch(fn, grid, block, smem: int, stream: int, args) -> None:
    driver = _drv()
    vals = _pack(args)
    ptrs = np.arange(len(args), dtype=np.uint64) * 8 + np.uint64(vals.ctypes.data)
    _ck(driver.cuLaunchKernel(fn, *grid, *block, smem, stream, ptrs.ctypes.data, 0), "cuLaunchKernel")


# ---------------------------------------------------------------- cached per-device constants
@functools.lru_cache(maxsize=64)
def _filters(key: tuple, device: str):
    (kind, *rest) = key
    if kind == "whisper":
        (n_mels,) = rest
        fb = mel_filter_bank_np(WHISPER_N_FFT // 2 + 1, n_mels)
        window = C.hann_window_padded(WHISPER_N_FFT, WHISPER_N_FFT)
        scale = 0.25  # pairing gives |2X|^2
    else:
        (sample_rate, n_fft, win_length, f_min, f_max, n_mels, norm, mel_scale, power, normalized) = rest
        fb = C.mel_fbanks(n_fft // 2 + 1, f_min, f_max, n_mels, sample_rate, norm, mel_scale)
        window = C.hann_window_padded(n_fft, win_length)
        s = C.magnitude_scale(normalized, n_fft, window)
        scale = (s / 2.0) ** power
    start, width, off, w = C.pack_filters(fb, scale)
    dev = torch.device(device)
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    return t(window), t(start), t(width), t(off), t(w), int(width.sum())


def _cfg(n_fft: int, n_mels: int, power: float, whisper: bool, in_i16: bool, out_dtype, dev_index: int | None,
         sm: int | None = None):
    """The production configuration for device ``dev_index``, or (``sm`` given, e.g. 900) for a device of that SM
    without touching one; out_dtype: a torch dtype (float32 / bfloat16 / float16) or, as before, a bool (True:
    bfloat16)."""
    out_bf16, out_f16 = _out_flags(out_dtype)
    ept, pairs, iters = C.LAUNCH[n_fft]
    return KernelConfig(
        n_fft=n_fft, pairs=pairs, iters=iters, split=C.split_lanes(n_fft, n_mels), power_mode=C.power_mode(power),
        whisper=whisper, in_i16=in_i16, out_bf16=out_bf16, sm=_device_sm(dev_index) if sm is None else sm, ept=ept,
        direct=whisper and C.WHISPER_DIRECT, minb=C.WHISPER_MINB if whisper else 0, out_f16=out_f16,
    )


def _out_flags(out_dtype) -> tuple[bool, bool]:
    if isinstance(out_dtype, bool):
        return out_dtype, False
    return C.out_dtype_flags(out_dtype, "out_dtype")


def _out_torch_dtype(cfg: KernelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.out_bf16 else torch.float16 if cfg.out_f16 else torch.float32


def _check_input(x: torch.Tensor, name: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    if x.dtype not in (torch.float32, torch.int16):
        raise ValueError(f"{name} must be float32 or int16, got {x.dtype}")


# ---------------------------------------------------------------- Whisper features
def whisper_impl(pcm: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype):
    """out_dtype: torch.float32 / bfloat16 / float16 (a bool still means bfloat16 or not)."""
    B, T = pcm.shape
    dev = pcm.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cfg = _cfg(WHISPER_N_FFT, n_mels, 2.0, True, pcm.dtype == torch.int16, out_dtype, idx)
    out = torch.empty(B, n_mels, WHISPER_FRAMES, dtype=_out_torch_dtype(cfg), device=dev)
    mask = torch.empty(B, WHISPER_FRAMES, dtype=torch.int32, device=dev)
    if B == 0:
        return out, mask
    mod = get_module(cfg, idx)
    window, start, width, off, w, nnz = _filters(("whisper", n_mels), str(dev))
    n_tiles = -(-WHISPER_FRAMES // mod.tf)
    tmax = torch.empty(B, n_tiles, dtype=torch.float32, device=dev)
    tmin = torch.empty_like(tmax)
    pcm = pcm.contiguous()
    smem = mod.smem(WHISPER_HOP, n_mels, nnz)
    mod.ensure_smem(smem)
    stream = torch.cuda.current_stream(dev).cuda_stream
    es_in, es_out = pcm.element_size(), out.element_size()
    for b0 in range(0, B, MAX_GRID_Y):
        nb = min(MAX_GRID_Y, B - b0)
        len_ptr = 0 if lengths is None else lengths.data_ptr() + 8 * b0
        tmax_p, tmin_p = tmax.data_ptr() + 4 * b0 * n_tiles, tmin.data_ptr() + 4 * b0 * n_tiles
        out_p = out.data_ptr() + es_out * b0 * n_mels * WHISPER_FRAMES
        _launch(
            mod.main, (n_tiles, nb, 1), mod.block, smem, stream,
            [pcm.data_ptr() + es_in * b0 * T, out_p, window.data_ptr(), start.data_ptr(), width.data_ptr(),
             off.data_ptr(), w.data_ptr(), len_ptr, tmax_p, tmin_p,
             T, WHISPER_SAMPLES, T, 0, WHISPER_HOP, WHISPER_N_FFT // 2, 0, WHISPER_FRAMES, n_mels, nnz, n_tiles, 1.0],
        )
        _launch(
            mod.finalize, (n_tiles, nb, 1), (256, 1, 1), 0, stream,
            [out_p, mask.data_ptr() + 4 * b0 * WHISPER_FRAMES, tmax_p, tmin_p, len_ptr, T, WHISPER_HOP,
             WHISPER_FRAMES, n_mels, n_tiles],
        )
    return out, mask


@torch.library.custom_op("glmasr::logmel_whisper", mutates_args=())
def _whisper_op(pcm: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return whisper_impl(pcm, lengths, n_mels, out_dtype)


@_whisper_op.register_fake
def _(pcm, lengths, n_mels, out_dtype):
    B = pcm.shape[0]
    out = pcm.new_empty((B, n_mels, WHISPER_FRAMES), dtype=out_dtype)
    return out, pcm.new_empty((B, WHISPER_FRAMES), dtype=torch.int32)


# ---------------------------------------------------------------- general mel spectrogram
def mel_impl(
    x: torch.Tensor, sample_rate: float, n_fft: int, win_length: int, hop: int, f_min: float, f_max: float,
    pad: int, n_mels: int, power: float, normalized: str, center: bool, pad_mode: str, norm: str,
    mel_scale: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    B, T = x.shape
    dev = x.device
    nf = C.n_frames(T, n_fft, hop, pad, center)
    _out_flags(out_dtype)  # ValueError naming the accepted dtypes
    out = torch.empty(B, n_mels, nf, dtype=out_dtype, device=dev)
    if B == 0:
        return out
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cfg = _cfg(n_fft, n_mels, power, False, x.dtype == torch.int16, out_dtype, idx)
    mod = get_module(cfg, idx)
    norm_v = None if norm == "" else norm
    norm_n = False if normalized == "" else normalized
    key = ("mel", sample_rate, n_fft, win_length, f_min, f_max, n_mels, norm_v, mel_scale, power, norm_n)
    window, start, width, off, w, nnz = _filters(key, str(dev))
    n_tiles = -(-nf // mod.tf)
    x = x.contiguous()
    smem = mod.smem(hop, n_mels, nnz)
    mod.ensure_smem(smem)
    stream = torch.cuda.current_stream(dev).cuda_stream
    cpad = n_fft // 2 if center else 0
    es_in, es_out = x.element_size(), out.element_size()
    for b0 in range(0, B, MAX_GRID_Y):
        nb = min(MAX_GRID_Y, B - b0)
        _launch(
            mod.main, (n_tiles, nb, 1), mod.block, smem, stream,
            [x.data_ptr() + es_in * b0 * T, out.data_ptr() + es_out * b0 * n_mels * nf, window.data_ptr(),
             start.data_ptr(), width.data_ptr(), off.data_ptr(), w.data_ptr(), 0, 0, 0,
             T, T + 2 * pad, T, pad, hop, cpad, C.PAD_MODES[pad_mode], nf, n_mels, nnz, n_tiles, power / 2.0],
        )
    return out


@torch.library.custom_op("glmasr::logmel_mel", mutates_args=())
def _mel_op(
    x: torch.Tensor, sample_rate: float, n_fft: int, win_length: int, hop: int, f_min: float, f_max: float,
    pad: int, n_mels: int, power: float, normalized: str, center: bool, pad_mode: str, norm: str,
    mel_scale: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    return mel_impl(x, sample_rate, n_fft, win_length, hop, f_min, f_max, pad, n_mels, power, normalized,
                    center, pad_mode, norm, mel_scale, out_dtype)


@_mel_op.register_fake
def _(x, sample_rate, n_fft, win_length, hop, f_min, f_max, pad, n_mels, power, normalized, center, pad_mode,
      norm, mel_scale, out_dtype):
    B, T = x.shape
    nf = C.n_frames(T, n_fft, hop, pad, center)
    return x.new_empty((B, n_mels, nf), dtype=out_dtype)
