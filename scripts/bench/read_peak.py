"""The H200's read ceiling: a read-only Triton kernel streaming a large buffer (the decode step only reads its
weights; a copy's bandwidth counts read and write traffic, whose mix differs). Each program sums 16-byte vectors
of its slice with evict-first loads and writes one value, so the write traffic is nil."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(X, OUT, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = X + pid.to(tl.int64) * n_per_prog
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, n_per_prog, BLOCK):
        acc ^= tl.load(base + start + offs, eviction_policy="evict_first")
    tl.store(OUT + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_GBps(nbytes: int = 2 * 1024 ** 3, programs: int | None = None, block: int = 2048, repeats: int = 10) -> float:
    """Best-of-``repeats`` read bandwidth (GB/s) over an int32 buffer of ``nbytes`` (default 2 GiB, far above L2),
    ``programs`` persistent programs (default 8 per SM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = programs or 8 * sms
    n = nbytes // 4
    n_per = (n // programs) // block * block
    x = torch.ones(programs * n_per, dtype=torch.int32, device="cuda")
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    for _ in range(2):
        _read_kernel[(programs,)](x, out, n_per, BLOCK=block, num_warps=8)
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _read_kernel[(programs,)](x, out, n_per, BLOCK=block, num_warps=8)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    torch.cuda.synchronize()
    return x.numel() * 4 / (best * 1e6)


if __name__ == "__main__":
    for progs in (None, 264, 2112):
        print(progs, f"{read_GBps(programs=progs):.0f} GB/s")
