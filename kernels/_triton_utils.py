"""Shared helpers for the Triton kernels in this package (no heavy work at import beyond ``import triton``).

* ``interpreting()``: True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``); the
  launchers then accept CPU tensors and pick small tiles so the interpreter stays fast.
* ``next_pow2``/``cdiv``: integer helpers for tile sizes.
* ``num_sms(device)``: multiprocessor count (cached), used by launch heuristics; a fixed 132 (H200) when
  interpreting or on CPU so heuristics stay deterministic.
* ``as_rows(x)``: view a (..., N) tensor as (M, N) with unit stride in the last dim, copying only if needed.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None = None) -> int:
    device = torch.device(device) if device is not None else None
    if interpreting() or device is None or device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(…, N) -> (M, N) with stride(-1) == 1; a view whenever the leading dims collapse."""
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:
        return x.reshape(-1, n)


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors only under the interpreter."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(f"Triton kernel needs CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 for CPU")


def row_tile(n: int, target_elems: int = 4096, max_rows: int = 64) -> tuple[int, int]:
    """Tile (BLOCK_M, BLOCK_N) for row-wise kernels: whole row in BLOCK_N, several rows per program when short."""
    block_n = next_pow2(n)
    block_m = max(1, min(max_rows, target_elems // block_n))
    return block_m, block_n


def warps_for(elems: int) -> int:
    """Warps for a tile of ``elems`` elements: ~8-16 elements per thread."""
    if elems >= 16384:
        return 16
    if elems >= 4096:
        return 8
    if elems >= 1024:
        return 4
    return 2 if elems >= 256 else 1
