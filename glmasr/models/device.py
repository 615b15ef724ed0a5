"""Devices and dtypes: what a user may ask for, checked with a clear error, and sync-free host-to-device copies."""

from __future__ import annotations

import torch


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return dev


def same_device(requested: torch.device, actual: torch.device) -> bool:
    """``cuda`` (no index) matches the current CUDA device."""
    if requested.type != actual.type:
        return False
    if requested.type != "cuda" or requested.index is None:
        return True
    return requested.index == (actual.index if actual.index is not None else torch.cuda.current_device())


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}: use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def host_to_device(values: "list[int] | torch.Tensor", device: torch.device) -> torch.Tensor:
    """int list (-> int64) or CPU tensor (its dtype kept) -> tensor on ``device``; on CUDA through pinned memory,
    so the copy does not sync the host (``torch.tensor(values, device="cuda")`` waits for the GPU to drain)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
