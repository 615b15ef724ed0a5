"""Decode GEMVs in CUDA (NVRTC, sm_90+): ``y = x @ W^T`` for one or two rows of x, bf16, with PDL.

Computes, with fp32 accumulation and one rounding to bf16 (the math and roundings of ``skinny_gemm``):

    gemv(x, W)          y = x @ W^T                            x (..., K), W (N, K)    -> (..., N)
    gemv_swiglu(x, W)   y = silu(x @ Wg^T) * (x @ Wu^T)        W = [Wg; Wu] (2I, K)    -> (..., I)

int8 weights (``scale=``, as ``skinny_gemm``'s): W int8 (N, K) with one fp32 scale per row, ``scale`` (N,)
contiguous (SwiGLU: rows [0, I) the gate's, [I, 2I) the up's), from ``skinny_gemm.quantize_rows``; the kernel
computes ``y[m, n] = scale[n] * sum_k x[m, k] q[n, k]``: q converted to fp32 exactly in registers, fp32 FMAs,
the fp32 sum multiplied by scale[n] before the single rounding to bf16 (SwiGLU: gate and up each scaled, then the
roundings below). An int8 W requires ``scale`` and a bf16 W refuses one; K a multiple of 16 (one 16-byte vector
= 16 int8). The references (``gemv_ref(..., scale=)``) are ``skinny_gemm``'s, dequantizing in fp32 first.

``gemv_swiglu`` rounds like the unfused path (``skinny_gemm_swiglu``): gate and up rounded to bf16, silu in fp32
rounded (``g / (1 + exp(-g))`` with the fast exponential, as Triton's ``tl.exp``), product rounded.

``gemv_qkv_rope(x, W, RopeAppend(...))``: the decoder's qkv projection of one token with ``rope.py``'s
``rope_and_append`` in the epilogue (one launch instead of two): W's rows are q, k, v heads; q and k rotated
(rotate_half, the same roundings: projection, cos/sin, each product and the sum rounded to bf16), k and v stored
at the token's slot of its KV cache row, q returned. The warps visit each q/k head's rows as (d, d + D/2) pairs
(``rope_row`` in the .cu), so both halves of a rotation end in one warp; a negative position is padding (q
unrotated, the cache untouched). Bit-identical to ``gemv`` + ``rope_and_append`` (same sums per row).

Shape contract: x bf16 and W bf16 (or int8 with ``scale``) on one CUDA device of compute capability >= 9.0
(``griddepcontrol``); x (..., K)
with M = prod(leading dims) in {1, 2} (``MAX_M``; more rows: ``skinny_gemm``); its last dim contiguous, rows
16-byte aligned (copied otherwise: x is tiny, but the copy allocates); W (N, K) contiguous (nn.Linear layout, never
copied: anything else raises), its data 16-byte aligned, K a multiple of 8 (one 16-byte vector = 8 bf16; int8:
16), K >= 8 (int8: 16),
N >= 1 (even for SwiGLU: rows [0, I) gate, [I, 2I) up). ``out=`` (..., N or I) bf16, last dim contiguous,
viewable as (M, N); with ``out`` given nothing is allocated per call. No host synchronisation; graph-capturable.
``ValueError`` names the offending argument for anything else. ``*_ref``: the plain-torch references (fp32 math
on the same bf16 inputs, ``skinny_gemm``'s).

Kernel (kernels/cuda_gemv.cu): each warp owns ``rows`` output columns (SwiGLU: ``rows`` gate/up row pairs) and
reads them as 16-byte vectors along K, lane l taking vectors l, l + 32, ... (each load instruction of a warp is
512 contiguous bytes of one row). A block is ``warps`` warps in ``warps / ksplit`` column groups; with
``ksplit`` > 1 the warps of a group split K into slices and add their sums through shared memory (fixed order:
deterministic). K is walked in chunks of ``ksplit * vec * 256`` elements: every lane holds ``vec`` vectors per row
per chunk in registers, and the whole first chunk (for the decoder's shapes the program's whole weight slice) is
requested BEFORE ``griddepcontrol.wait``, so in a PDL chain the weight stream of this kernel starts while the
previous kernel drains; only x (the previous kernel's output) is read after the wait. ``pipe``: chunks after
the first are double-buffered in registers (for K longer than one chunk). Then fp32 FMAs, a butterfly shuffle
reduction per column, one lane per (column, x row) rounds and stores. ``griddepcontrol.launch_dependents`` is the
kernel's first instruction: the next kernel's blocks may start (and issue their own weight loads) as soon as
this grid's last wave is resident.

Choices:
* Weight loads are ``ld.global.L1::no_allocate.L2::cache_hint`` with an evict-first L2 policy (streamed once).
  Not ``.nc``: ptxas sinks non-coherent loads below ``griddepcontrol.wait`` (their data is read-only for the
  grid, so moving them is legal), which would defeat the point; coherent loads stay above it
  (``tests/test_cuda_gemv.py`` checks the SASS: every first-chunk weight LDG precedes the wait, ACQBULK).
* x is read per lane straight into registers (the lane needs exactly the x vectors matching its weight
  vectors, the same for all its rows), through L1, which serves the block's other warps: no shared-memory stage
  and no block barrier between the wait and the FMAs (a barrier would make every warp wait for the slowest).
* Rows past N re-read the last valid row (in bounds, result dropped) instead of predicating every load; lanes
  past K are predicated off and read as zeros.
* int8 (``GemvConfig.int8``): the same 16-byte weight vectors (16 int8 each: a row of K = 2048 is 4 vectors per
  lane), issued before the wait like bf16's, with the row scale(s) the storing lane needs (a weight too); per
  weight vector two x vectors after the wait. int8 -> fp32 by the magic number, not ``cvt.rn.f32.s8``: flip the
  sign bits (one LOP3 per 4 values: u = q + 128), put each byte under the exponent of 2^23 (one PRMT: the bits of
  2^23 + u) and subtract 2^23 + 128 (one FADD), exact and 2.25 instructions per value on the integer and fp32
  pipes; ``cvt.rn.f32.s8`` is a single I2F, but a quarter-rate one (16 per SM per clock on sm_90) against ~18
  int8 per SM per clock of weight stream at full bandwidth (``i2f=True`` builds it for measurement). Each
  converted vector serves both x rows (M = 2).
* No headers: bf16 <-> fp32 are bit operations plus ``cvt.rn.bf16.f32``, so NVRTC needs nothing but itself and
  a compile takes well under a second.
* ``__launch_bounds__(threads, min_blocks)`` with ``min_blocks`` from the config's register estimate
  (``GemvConfig.occupancy``): ptxas is held to the budget that occupancy assumes; the tests check the cubins
  for spills (STACK 0) and registers within it.

Configs (``GemvConfig``, all compile-time macros, one cubin each): ``CONFIGS`` for the decoder's shapes
(qkv 3072x2048, o 2048x2048, gate_up + SwiGLU 12288x2048, down 2048x6144, lm head 59264x2048; M = 1, 2),
``CONFIGS_INT8`` for the int8 ones (not the lm head, which stays bf16: the bf16 entry of the shape with its
weight bytes in flight per warp kept, i.e. half the vectors per row and twice the rows per warp), else
``_heuristic``. ``select(n, k, swiglu, m, int8)`` returns the config or None where the kernel cannot run the
shape.
``sweep_configs`` is the benchmark's candidate grid. The table is a first guess; scripts/bench/bench_cuda_gemv.py
measures every candidate.

Build: NVRTC for the device's SM (or ``sm=`` ahead of time: ``prebuild`` compiles every table config for sm_90
on a machine without a GPU), cached on disk next to the log-mel cubins (``logmel._build.cache_dir``) by a hash
of the source, the options and the NVRTC version. Launch: ``cuLaunchKernelEx`` on torch's current stream with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (``pdl=True``, the default on sm_90+ unless
``_triton_utils.set_pdl(False)``), so the launch chains with the Triton kernels launched with ``launch_pdl=True``
and is captured by ``torch.cuda.graph``; ``pdl=False`` launches plainly (``griddepcontrol.wait`` is then a no-op).
Per call: no allocation (with ``out``), preallocated per-thread argument buffers and launch configs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

__all__ = ["GemvConfig", "RopeAppend", "CONFIGS", "CONFIGS_INT8", "QKV_ROPE_SHAPES", "MAX_M", "select",
           "sweep_configs", "default_configs", "has_rope_form", "rope_config", "gemv", "gemv_swiglu",
           "gemv_qkv_rope", "gemv_ref", "gemv_swiglu_ref", "gemv_qkv_rope_ref", "is_available", "prebuild",
           "get_cubin", "nvrtc_compile"]

KERNEL_SRC = Path(__file__).with_name("cuda_gemv.cu")
MAX_M = 2
VEC = 8  # bf16 per 16-byte vector
VEC8 = 16  # int8 per 16-byte vector
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
N_ARGS = 21  # gemv_kernel's parameters


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One compiled variant of cuda_gemv.cu (every field a macro)."""

    rows: int = 1  # output columns per warp (SwiGLU: gate/up row pairs)
    warps: int = 4  # warps per block
    ksplit: int = 1  # warps sharing a column group, one K slice each
    vec: int = 8  # 16-byte vectors per lane per weight row per chunk
    m: int = 1  # rows of x
    swiglu: bool = False
    pipe: bool = False  # double-buffer the chunks after the first
    min_blocks: int = 0  # __launch_bounds__ blocks per SM; 0: from the register estimate (occupancy())
    prefetch: int = 0  # L2 prefetch size hint of the weight loads: 0, 128 or 256 bytes
    int8: bool = False  # W int8 (16 K elements per 16-byte vector) with per-row fp32 scales
    i2f: bool = False  # int8 only: convert with cvt.rn.f32.s8 (I2F) instead of the magic-number PRMT + FADD
    rope: bool = False  # the qkv GEMV: RoPE + KV append in the epilogue (rows visited in rotation pairs)

    def __post_init__(self):
        checks = [(self.rows >= 1, "rows >= 1"), (1 <= self.warps <= 32, "1 <= warps <= 32"),
                  (self.ksplit >= 1 and self.warps % self.ksplit == 0, "ksplit divides warps"),
                  (1 <= self.vec <= 32, "1 <= vec <= 32"), (1 <= self.m <= MAX_M, f"1 <= m <= {MAX_M}"),
                  (self.min_blocks >= 0, "min_blocks >= 0"), (self.prefetch in (0, 128, 256), "prefetch 0/128/256"),
                  (self.rows * self.m <= 32, "rows * m <= 32 (one lane stores each)"),
                  (self.int8 or not self.i2f, "i2f only with int8"),
                  (not self.rope or (self.m == 1 and self.rows % 2 == 0 and not self.swiglu),
                   "rope needs m 1, even rows and no SwiGLU")]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"GemvConfig: {what}, got {self}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def block_cols(self) -> int:
        """Output columns per block."""
        return (self.warps // self.ksplit) * self.rows

    @property
    def weight_rows(self) -> int:
        """Weight rows per warp."""
        return 2 * self.rows if self.swiglu else self.rows

    @property
    def vec_k(self) -> int:
        """K elements per 16-byte weight vector (8 bf16 or 16 int8)."""
        return VEC8 if self.int8 else VEC

    @property
    def chunk_k(self) -> int:
        """K elements per chunk (the first chunk is loaded before the PDL wait)."""
        return self.ksplit * self.vec * 32 * self.vec_k

    @property
    def bytes_in_flight(self) -> int:
        """Weight bytes one warp requests per chunk (the first chunk: before the PDL wait)."""
        return self.weight_rows * self.vec * 16 * 32

    def est_regs(self) -> int:
        """Registers per thread the kernel needs (weights in flight, x vectors, sums, addresses, ~24 others;
        int8: the fp32 x of one weight vector and the converted weight vector, 16 + 16 M)."""
        w = self.weight_rows * self.vec * 4 * (2 if self.pipe else 1)
        x = 16 * self.m + 16 if self.int8 else 4 * self.m * self.vec
        return w + x + self.weight_rows * (self.m + 2) + (2 if self.int8 else 0) + 24

    def occupancy(self) -> int:
        """Blocks per SM the register budget assumes (the __launch_bounds__ minimum)."""
        if self.min_blocks:
            return self.min_blocks
        regs = min(255, -(-self.est_regs() // 8) * 8)
        return max(1, min(MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM // self.warps, REGS_PER_SM // (self.threads * regs)))

    def reg_budget(self) -> int:
        """Registers per thread allowed at ``occupancy()`` blocks per SM (allocation granularity 8)."""
        return min(255, REGS_PER_SM // (self.threads * self.occupancy()) // 8 * 8)

    def macros(self) -> dict[str, str]:
        return {"GV_R": str(self.rows), "GV_WARPS": str(self.warps), "GV_KS": str(self.ksplit),
                "GV_V": str(self.vec), "GV_M": str(self.m), "GV_SWIGLU": str(int(self.swiglu)),
                "GV_PIPE": str(int(self.pipe)), "GV_MINB": str(self.occupancy()), "GV_PF": str(self.prefetch),
                "GV_Q8": str(int(self.int8)), "GV_I2F": str(int(self.i2f)), "GV_ROPE": str(int(self.rope))}

    def short(self) -> str:
        return (("int8 " if self.int8 else "") + f"R{self.rows} W{self.warps} KS{self.ksplit} V{self.vec} M{self.m}"
                + (" swiglu" if self.swiglu else "") + (" i2f" if self.i2f else "")
                + (" pipe" if self.pipe else "") + (f" pf{self.prefetch}" if self.prefetch else "")
                + (" rope" if self.rope else "")
                + f" minb{self.occupancy()}")


@dataclasses.dataclass(frozen=True)
class RopeAppend:
    """The qkv GEMV's epilogue (``gemv_qkv_rope``): ``kernels/rope.py``'s ``rope_and_append`` for one token. W's
    rows are q (n_heads heads), k, v (n_kv_heads each) of ``head_dim``; the token at ``positions`` (one element,
    int32/int64) gets q and k rotated (``cos``/``sin`` (max_positions, head_dim / 2) fp32 from
    ``rope.build_rope_cache``), k and v stored at that slot of cache row ``cache_rows`` (one element; None: row 0)
    of ``k_cache``/``v_cache`` (rows, n_kv_heads, max_len, head_dim) bf16 contiguous; a negative position is
    padding (q unrotated, the cache untouched). ``settled``: positions and cache_rows hold their values since
    before the kernel ahead of this launch started (written by an ordinary, non-PDL launch or an earlier step), so
    the kernel reads them, and the token's cos / sin, before its PDL wait, off the critical path; leave it False
    when the kernel just ahead may write them."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    cache_rows: torch.Tensor | None = None
    settled: bool = False


# ------------------------------------------------------------------------------------------------ configs

def _table() -> dict[tuple[int, int, int, bool], GemvConfig]:
    t = {}
    for m in (1, 2):
        c = functools.partial(GemvConfig, m=m)
        # M = 1: the best of the H200 sweep (us per call, graph-timed, rotating weights; notes/measurements.md,
        # tenth session): qkv R2 W2 3.70 (Triton 4.11), o R1 W2 2.73 (3.58), gate|up R1 W4 12.47 (12.52), down
        # R1 W3 KS3 7.04 (11.53), lm head equal to Triton. M = 2: not swept, the same shapes of block.
        t[(3072, 2048, m, False)] = c(rows=2, warps=2)
        t[(2048, 2048, m, False)] = c(rows=1, warps=2)
        t[(12288, 2048, m, True)] = c(rows=1, warps=4, swiglu=True)
        t[(12288, 2048, m, False)] = c(rows=2, warps=4)
        t[(2048, 6144, m, False)] = c(rows=1, warps=3, ksplit=3)
        t[(59264, 2048, m, False)] = c(rows=2, warps=4)
    return t


# Keyed by (W rows, K, M, swiglu) for the GLM-ASR-Nano decoder.
CONFIGS: dict[tuple[int, int, int, bool], GemvConfig] = _table()


def _table_int8() -> dict[tuple[int, int, int, bool], GemvConfig]:
    # M = 1: the best of the H200 sweep (us per call; the same run): qkv R4 W4 2.94 (Triton int8 3.26), o R1 W2
    # 2.62 (2.87), gate|up R1 W2 8.45 (8.82), down R2 W6 KS3 5.20 (8.17); the magic-number conversion beat I2F
    # everywhere (0.84-0.96x with I2F). M = 2: not swept.
    t = {}
    for m in (1, 2):
        c = functools.partial(GemvConfig, m=m, int8=True)
        t[(3072, 2048, m, False)] = c(rows=4 if m == 1 else 2, warps=4, vec=4)
        t[(2048, 2048, m, False)] = c(rows=1, warps=2, vec=4)
        t[(12288, 2048, m, True)] = c(rows=1, warps=2, vec=4, swiglu=True)
        t[(12288, 2048, m, False)] = c(rows=4, warps=4, vec=4)
        t[(2048, 6144, m, False)] = c(rows=2, warps=6, ksplit=3, vec=4)
    return t


# int8 weights (same keys; the lm head stays bf16).
CONFIGS_INT8: dict[tuple[int, int, int, bool], GemvConfig] = _table_int8()


# The decoder's qkv shape (W rows, K): the product launches its RoPE form at one row of x (``gemv_qkv_rope``; bf16
# weights, models/fast_decoder.py), so ``default_configs`` prebuilds it.
QKV_ROPE_SHAPES: frozenset[tuple[int, int]] = frozenset({(3072, 2048)})


def has_rope_form(n: int, k: int, m: int, swiglu: bool) -> bool:
    """Whether the product launches the RoPE form (``gemv_qkv_rope``) of the GEMV keyed (n, k, m, swiglu)."""
    return m == 1 and not swiglu and (n, k) in QKV_ROPE_SHAPES


def default_configs() -> list[GemvConfig]:
    """Every config the product launches: the tables (bf16 and int8) and the RoPE form of the bf16 qkv entry."""
    out = [*CONFIGS.values(), *CONFIGS_INT8.values()]
    out += [rope_config(cfg) for key, cfg in CONFIGS.items() if has_rope_form(*key)]
    return list(dict.fromkeys(out))


def rope_config(cfg: GemvConfig) -> GemvConfig:
    """cfg's RoPE + KV append form (``gemv_qkv_rope``): an even number of rows per warp (whole rotation pairs)."""
    return dataclasses.replace(cfg, rope=True, rows=cfg.rows + cfg.rows % 2)


def _heuristic(n_out: int, k: int, m: int, swiglu: bool, int8: bool = False) -> GemvConfig:
    """One chunk covers K when it can: up to 8 vectors per lane per row (K <= 2048 in one warp; int8: 4096),
    else K split over up to 4 warps of a group; two columns per warp only for wide plain GEMVs (enough warps
    remain to fill the SMs several times). int8 with at most 4 vectors per lane per row: twice the rows per warp
    (the bytes in flight per warp of the bf16 rule at the same K)."""
    per = -(-k // (32 * (VEC8 if int8 else VEC)))  # vectors per lane for a whole row read by one warp
    if per <= 8:
        ks, vec = 1, per
    else:
        ks = min(4, -(-per // 8))
        vec = min(8, -(-per // ks))
    rows = 2 if (n_out >= 16384 and not swiglu and m == 1) else 1
    if int8 and vec <= 4:
        rows *= 2
    return GemvConfig(rows=rows, warps=ks * max(1, 4 // ks), ksplit=ks, vec=vec, m=m, swiglu=swiglu, int8=int8)


def _shape_error(n: int, k: int, swiglu: bool, m: int, int8: bool = False) -> str | None:
    if not 1 <= m <= MAX_M:
        return f"M = {m} rows of x (the CUDA GEMV takes 1..{MAX_M}; use skinny_gemm for more)"
    if int8 and (k < VEC8 or k % VEC8):
        return f"K = {k} (must be a positive multiple of {VEC8} for an int8 W: one 16-byte vector is 16 int8)"
    if k < VEC or k % VEC:
        return f"K = {k} (must be a positive multiple of {VEC}: one 16-byte vector is 8 bf16)"
    if n < 1 or (swiglu and n % 2):
        return f"N = {n} W rows (must be >= 1{', and even for SwiGLU ([Wg; Wu])' if swiglu else ''})"
    if n * k >= 1 << 40 or k // VEC >= 1 << 31 or n >= 1 << 31:
        return f"W ({n}, {k}) too large"
    return None


def select(n: int, k: int, swiglu: bool = False, m: int = 1, int8: bool = False) -> GemvConfig | None:
    """Config for W (n, k) (n = 2I for SwiGLU) and m rows of x, bf16 W or (``int8``) int8 W: the table's
    (``CONFIGS`` / ``CONFIGS_INT8``), else the heuristic's; None where the kernel does not take the shape (m
    outside 1..MAX_M, K not a positive multiple of 8 (int8: 16), odd n for SwiGLU)."""
    if _shape_error(n, k, swiglu, m, int8) is not None:
        return None
    cfg = (CONFIGS_INT8 if int8 else CONFIGS).get((n, k, m, swiglu))
    return cfg if cfg is not None else _heuristic(n // 2 if swiglu else n, k, m, swiglu, int8)


def sweep_configs(n: int, k: int, swiglu: bool = False, m: int = 1, int8: bool = False) -> list[GemvConfig]:
    """The benchmark's candidates for W (n, k): the selected config first, then variants of rows per warp, warps
    per block, K split and (for K beyond one chunk) the register pipeline. int8: the selected config with the
    I2F conversion second, then the grid with 4 warps per block first (more rows per warp before fewer)."""
    base = select(n, k, swiglu, m, int8)
    if base is None:
        return []
    per = -(-k // (32 * (VEC8 if int8 else VEC)))
    c = functools.partial(GemvConfig, m=m, swiglu=swiglu, int8=int8)
    out = [base]
    if int8:
        out.append(dataclasses.replace(base, i2f=True))
    rows_opts = (1, 2) if swiglu else (1, 2, 4)
    if per <= 8:
        if int8:
            grid = [(r, w) for w in (4, 2, 8) for r in (rows_opts[::-1] if w == 4 else rows_opts)]
        else:
            grid = [(r, w) for r in rows_opts for w in (2, 4, 8)]
        for r, w in grid:
            out.append(c(rows=r, warps=w, vec=per))
        if per % 2 == 0:
            out.append(c(rows=2 if not swiglu else 1, warps=4, ksplit=2, vec=per // 2))
        out.append(dataclasses.replace(base, prefetch=256))
    else:
        for ks, w in ((3, 3), (3, 6), (2, 4), (4, 4), (4, 8), (6, 6)):
            if -(-per // ks) <= 12:
                out.append(c(rows=1, warps=w, ksplit=ks, vec=-(-per // ks)))
        out.append(c(rows=2, warps=6, ksplit=3, vec=-(-per // 3)))
        if int8:
            out.append(c(rows=2, warps=4, ksplit=2, vec=-(-per // 2)))
        out.append(c(rows=1, warps=4, vec=8))
        out.append(c(rows=1, warps=4, vec=8, pipe=True))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


# ------------------------------------------------------------------------------------------------ build

@functools.lru_cache(maxsize=1)
def _source() -> str:
    return KERNEL_SRC.read_text()


@functools.lru_cache(maxsize=1)
def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    from .logmel._build import _check

    return ".".join(map(str, _check(nvrtc.nvrtcVersion(), "version")))


def compile_options(cfg: GemvConfig, sm: int = 90) -> list[str]:
    return ["--std=c++17", f"--gpu-architecture=sm_{sm}", *(f"-D{k}={v}" for k, v in sorted(cfg.macros().items()))]


def cache_key(cfg: GemvConfig, sm: int = 90) -> str:
    h = hashlib.sha256()
    for part in (_source(), *compile_options(cfg, sm), _nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def nvrtc_compile(cfg: GemvConfig, sm: int = 90) -> tuple[bytes, str]:
    """Compile now (no cache; no GPU needed). Returns (cubin, log); RuntimeError with the log on failure."""
    from .logmel._build import compile_program

    return compile_program(_source(), "cuda_gemv.cu", compile_options(cfg, sm), f"{cfg} (sm_{sm})")


def cubin_path(cfg: GemvConfig, sm: int = 90) -> Path:
    from .logmel._build import cache_dir

    return cache_dir() / f"gemv_{cache_key(cfg, sm)}.cubin"



def get_cubin(cfg: GemvConfig, sm: int = 90) -> bytes:
    """The cubin for cfg on sm_<sm>: from the disk cache, else compiled (said once on stderr) and stored."""
    from .logmel._build import cached_cubin

    return cached_cubin(cubin_path(cfg, sm), lambda: nvrtc_compile(cfg, sm)[0],
                        "glmasr_kernels.cuda_gemv: compiling CUDA GEMVs with NVRTC (first use)")


def prebuild(configs: list[GemvConfig] | None = None, sm: int = 90, workers: int | None = None) -> list[Path]:
    """Ahead of time (no GPU needed): compile ``configs`` (default: ``default_configs()``, the tables and their
    fused forms) for sm_<sm> into the disk cache, ``workers`` at a time (NVRTC releases the GIL). Returns the
    cubin paths."""
    from concurrent.futures import ThreadPoolExecutor

    cfgs = list(dict.fromkeys(configs if configs is not None else default_configs()))
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda c: get_cubin(c, sm), cfgs))
    return [cubin_path(c, sm) for c in cfgs]


# ------------------------------------------------------------------------------------------------ runtime

@functools.lru_cache(maxsize=1)
def _deps_importable() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.bindings.nvrtc  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _device_sm(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def is_available(device: torch.device | str | None = None) -> bool:
    """True when cuda-bindings (driver + NVRTC) import and the device (default: the current one) is sm_90+."""
    if not (torch.cuda.is_available() and _deps_importable()):
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False
    return _device_sm(dev.index if dev.index is not None else torch.cuda.current_device()) >= 90


class _Kernel:
    """One config's cubin loaded into torch's primary context of one device."""

    def __init__(self, cfg: GemvConfig, device_index: int):
        from .logmel._runtime import _ck, _drv, load_module

        self.module = load_module(get_cubin(cfg, _device_sm(device_index)), device_index)
        self.fn = _ck(_drv().cuModuleGetFunction(self.module, b"gemv_kernel"), "cuModuleGetFunction")
        self.cfg = cfg


_kernels: dict[tuple[GemvConfig, int], _Kernel] = {}
_lock = threading.Lock()


def _kernel(cfg: GemvConfig, device_index: int) -> _Kernel:
    key = (cfg, device_index)
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                k = _kernels[key] = _Kernel(cfg, device_index)
    return k


class _ThreadState(threading.local):
    """Per-thread launch scratch: the argument slots (one 8-byte slot per kernel parameter; a 4-byte parameter
    reads its slot's low half), the pointer array to them, and one CUlaunchConfig per (kernel, pdl) whose grid
    and stream are set per call (the driver copies both at launch / capture)."""

    def __init__(self):
        import numpy as np

        self.vals = np.zeros(N_ARGS, np.uint64)
        self.ptrs = np.arange(N_ARGS, dtype=np.uint64) * 8 + np.uint64(self.vals.ctypes.data)
        self.ptrs_addr = int(self.ptrs.ctypes.data)
        self.configs: dict = {}


_tls = _ThreadState()


def _launch_config(kernel: _Kernel, pdl: bool):
    key = (id(kernel), pdl)
    lc = _tls.configs.get(key)
    if lc is None:
        from cuda.bindings import driver

        lc = driver.CUlaunchConfig()
        lc.blockDimX, lc.blockDimY, lc.blockDimZ = kernel.cfg.threads, 1, 1
        lc.gridDimY = lc.gridDimZ = 1
        lc.sharedMemBytes = 0
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            lc.attrs = [attr]
            lc.numAttrs = 1
        else:
            lc.numAttrs = 0
        _tls.configs[key] = lc
    return lc


def _pdl_default(device: torch.device) -> bool:
    from ._triton_utils import pdl_enabled

    return pdl_enabled(device)


def _check_scale(name: str, w: torch.Tensor, scale) -> bool:
    """The (W, scale) pair (``skinny_gemm._check_scale``'s rules): True for an int8 W with its (N,) fp32
    contiguous row scales, False for a bf16 W without any."""
    if w.dtype == torch.int8:
        if scale is None:
            raise ValueError(f"{name}: W is int8: pass its per-row fp32 dequantization scales as scale= "
                             "(skinny_gemm.quantize_rows)")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise ValueError(f"{name}: scale must be an fp32 tensor (one per row of W), got "
                             f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if scale.dim() != 1 or (w.dim() >= 1 and scale.shape[0] != w.shape[0]):
            raise ValueError(f"{name}: scale must have shape ({w.shape[0] if w.dim() else '?'},) (one per row of W "
                             f"{tuple(w.shape)}), got {tuple(scale.shape)}")
        if scale.stride(0) != 1 and scale.shape[0] > 1:
            raise ValueError(f"{name}: scale must be contiguous")
        if scale.device != w.device:
            raise ValueError(f"{name}: scale is on {scale.device}, W on {w.device}")
        return True
    if scale is not None:
        raise ValueError(f"{name}: scale= is for an int8 W (per-row dequantization); W is {w.dtype}")
    return False


def _validate(x, w, out, swiglu: bool, config: GemvConfig | None, scale=None, rope: RopeAppend | None = None):
    """Checks every argument; returns (x as (M, K) rows 16-byte aligned, out as (M, N) view, out, M, N, K, cfg,
    int8). With ``rope`` out holds only the q columns (M, n_heads * head_dim)."""
    name = "gemv_qkv_rope" if rope is not None else "gemv_swiglu" if swiglu else "gemv"
    for nm, t in (("x", x), ("W", w)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {nm} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: x must be bfloat16, got {x.dtype}")
    if w.dtype not in (torch.bfloat16, torch.int8):
        raise ValueError(f"{name}: W must be bfloat16 (or int8 with scale=), got {w.dtype}")
    int8 = _check_scale(name, w, scale)
    if w.dim() != 2:
        raise ValueError(f"{name}: W must be 2-D (N, K), got shape {tuple(w.shape)}")
    nw, k = w.shape
    if not w.is_contiguous():
        raise ValueError(f"{name}: W must be contiguous (N, K) row-major, got strides {tuple(w.stride())} "
                         "(the weight is never copied)")
    if w.data_ptr() % 16:
        raise ValueError(f"{name}: W's data must be 16-byte aligned (the kernel reads 16-byte vectors)")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name}: x's last dim must be W's K = {k}, got x shape {tuple(x.shape)}")
    m = x.numel() // k if k else 0
    err = _shape_error(nw, k, swiglu, m, int8)
    if err is not None:
        raise ValueError(f"{name}: unsupported {err}")
    if int8 and scale.data_ptr() % 4:
        raise ValueError(f"{name}: scale's data must be 4-byte aligned")
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (m > 1 and x2.stride(0) % VEC):
        x2 = x2.clone(memory_format=torch.contiguous_format)
    n = nw // 2 if swiglu else nw
    n_store = rope.n_heads * rope.head_dim if rope is not None else n
    oshape = (*x.shape[:-1], n_store)
    if out is None:
        out = torch.empty(oshape, device=x.device, dtype=torch.bfloat16)
    else:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != oshape or out.dtype != torch.bfloat16 \
                or out.device != x.device:
            raise ValueError(f"{name}: out must be a {oshape} bfloat16 tensor on {x.device}, got "
                             f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
        if out.stride(-1) != 1 and n > 1:
            raise ValueError(f"{name}: out must have a contiguous last dim")
    try:
        out2 = out.view(m, n_store)
    except RuntimeError as e:
        raise ValueError(f"{name}: out must be viewable as ({m}, {n_store})") from e
    if rope is not None:
        if m != 1:
            raise ValueError(f"{name}: one token: x must have one row, got M = {m}")
        _check_rope(name, rope, nw, x.device)
    if config is None:
        cfg = select(nw, k, swiglu, m, int8)
        cfg = rope_config(cfg) if rope is not None else cfg
    else:
        cfg = config
    if cfg.m != m or cfg.swiglu != swiglu or cfg.int8 != int8 or cfg.rope != (rope is not None):
        raise ValueError(f"{name}: config {cfg.short()} is for m={cfg.m}, swiglu={cfg.swiglu}, int8={cfg.int8}, "
                         f"rope={cfg.rope}; the call has m={m}, swiglu={swiglu}, int8={int8} (W {w.dtype}), "
                         f"rope={rope is not None}")
    for nm, t in (("x", x), ("W", w)):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: {nm} must be a CUDA tensor, got device {t.device}")
    if x.device != w.device:
        raise ValueError(f"{name}: x is on {x.device}, W on {w.device}")
    return x2, out2, out, m, n, k, cfg, int8


def _check_rope(name: str, rope: RopeAppend, nw: int, device) -> None:
    if not isinstance(rope, RopeAppend):
        raise ValueError(f"{name}: rope must be a RopeAppend")
    hd, nq, nk = rope.head_dim, rope.n_heads, rope.n_kv_heads
    if nw != (nq + 2 * nk) * hd:
        raise ValueError(f"{name}: W has {nw} rows; q, k and v of {nq} + {nk} + {nk} heads of {hd} need "
                         f"{(nq + 2 * nk) * hd}")
    for nm, t, dt in (("positions", rope.positions, (torch.int32, torch.int64)),
                      ("cache_rows", rope.cache_rows, (torch.int32, torch.int64)),
                      ("cos", rope.cos, (torch.float32,)), ("sin", rope.sin, (torch.float32,)),
                      ("k_cache", rope.k_cache, (torch.bfloat16,)), ("v_cache", rope.v_cache, (torch.bfloat16,))):
        if t is None and nm == "cache_rows":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in dt or t.device != device:
            raise ValueError(f"{name}: {nm} must be a {' or '.join(map(str, dt))} tensor on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '-')}")
    if rope.positions.numel() != 1 or (rope.cache_rows is not None and rope.cache_rows.numel() != 1):
        raise ValueError(f"{name}: one token: positions (and cache_rows) must hold one element")
    for nm, t in (("cos", rope.cos), ("sin", rope.sin)):
        if t.dim() != 2 or t.shape[1] != hd // 2 or not t.is_contiguous():
            raise ValueError(f"{name}: {nm} must be a contiguous (max_positions, {hd // 2}) table")
    for nm, t in (("k_cache", rope.k_cache), ("v_cache", rope.v_cache)):
        if t.dim() != 4 or t.shape[1] != nk or t.shape[3] != hd or not t.is_contiguous():
            raise ValueError(f"{name}: {nm} must be a contiguous (rows, {nk}, max_len, {hd}) tensor, got "
                             f"{tuple(t.shape)}")


def _run(x, w, out, swiglu: bool, config: GemvConfig | None, pdl: bool | None, scale=None,
         rope: RopeAppend | None = None):
    x2, out2, out, m, n, k, cfg, int8 = _validate(x, w, out, swiglu, config, scale, rope)
    dev = x.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if _device_sm(idx) < 90:
        raise ValueError(f"cuda_gemv needs compute capability >= 9.0 (griddepcontrol); {dev} is sm_{_device_sm(idx)}")
    kern = _kernel(cfg, idx)
    use_pdl = _pdl_default(dev) if pdl is None else bool(pdl)
    lc = _launch_config(kern, use_pdl)
    lc.gridDimX = -(-n // cfg.block_cols)
    lc.hStream = torch.cuda.current_stream(dev).cuda_stream
    vals = _tls.vals  # slots 9-20 (RoPE) are read only by a rope config's kernel, which always gets them set
    vals[0] = x2.data_ptr()
    vals[1] = w.data_ptr()
    vals[2] = out2.data_ptr()
    vals[3] = n
    vals[4] = k // cfg.vec_k
    vals[5] = x2.stride(0) // VEC if m > 1 else 0
    vals[6] = out2.stride(0) if m > 1 else 0
    vals[7] = n if swiglu else 0
    vals[8] = scale.data_ptr() if int8 else 0
    if rope is not None:
        rows = rope.cache_rows
        vals[9] = rope.positions.data_ptr()
        vals[10] = rows.data_ptr() if rows is not None else 0
        vals[11] = ((rope.positions.dtype == torch.int64) | (rows is not None and rows.dtype == torch.int64) << 1
                    | (rows is not None) << 2 | bool(rope.settled) << 3)
        vals[12] = rope.cos.data_ptr()
        vals[13] = rope.sin.data_ptr()
        vals[14] = rope.k_cache.data_ptr()
        vals[15] = rope.v_cache.data_ptr()
        vals[16] = rope.head_dim
        vals[17] = rope.n_heads * rope.head_dim
        vals[18] = (rope.n_heads + rope.n_kv_heads) * rope.head_dim
        vals[19] = rope.k_cache.shape[2]
        vals[20] = rope.n_kv_heads
    from cuda.bindings import driver

    err = driver.cuLaunchKernelEx(lc, kern.fn, _tls.ptrs_addr, 0)[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx (cuda_gemv {cfg.short()}) failed: {err}")
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: GemvConfig | None = None,
         pdl: bool | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W(N, K)^T -> (..., N), bf16, M <= 2 rows of x; W bf16, or int8 with ``scale`` (N,) fp32 per
    row (``y = scale * (x @ q^T)``); ``pdl`` None: PDL on sm_90+ unless ``_triton_utils.set_pdl(False)``. See
    the module docstring."""
    return _run(x, w, out, False, config, pdl, scale)


def gemv_swiglu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: GemvConfig | None = None, pdl: bool | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) with W = [Wg; Wu] (2I, K) -> (..., I), bf16, M <= 2 rows of x; an int8 W
    takes its 2I row scales in ``scale`` (gate's, then up's)."""
    return _run(x, w, out, True, config, pdl, scale)


def gemv_qkv_rope(x: torch.Tensor, w: torch.Tensor, rope: RopeAppend, out: torch.Tensor | None = None,
                  config: GemvConfig | None = None, pdl: bool | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """One token's attention input in one launch: qkv = x @ W^T, then ``rope_and_append`` (``RopeAppend``):
    returns the rotated q (..., n_heads * head_dim); k and v go to the cache only. x (..., K) with one row."""
    return _run(x, w, out, False, config, pdl, scale, rope)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T in fp32 on the given inputs, rounded once to x's dtype (``skinny_gemm_ref``; an int8 W with its
    ``scale`` dequantized in fp32 first)."""
    from .skinny_gemm import skinny_gemm_ref

    return skinny_gemm_ref(x, w, out, scale=scale)


def gemv_swiglu_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) with the unfused path's roundings (``skinny_gemm_swiglu_ref``; int8 W:
    dequantized in fp32 first)."""
    from .skinny_gemm import skinny_gemm_swiglu_ref

    return skinny_gemm_swiglu_ref(x, w, out, scale=scale)


def gemv_qkv_rope_ref(x: torch.Tensor, w: torch.Tensor, rope: RopeAppend, out: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv_ref`` then ``rope_and_append_ref`` (the cache updated in place); returns the rotated q."""
    from .rope import rope_and_append_ref

    nq, nk, d = rope.n_heads, rope.n_kv_heads, rope.head_dim
    qkv = gemv_ref(x, w, scale=scale).reshape(1, 1, -1)
    q = qkv[..., : nq * d].reshape(1, 1, nq, d)
    k = qkv[..., nq * d:(nq + nk) * d].reshape(1, 1, nk, d)
    v = qkv[..., (nq + nk) * d:].reshape(1, 1, nk, d)
    rows = None if rope.cache_rows is None else rope.cache_rows.reshape(1)
    qo, _ = rope_and_append_ref(q, k, v, rope.positions.reshape(1, 1), rope.cos, rope.sin, rope.k_cache,
                                rope.v_cache, rows)
    qo = qo.reshape(*x.shape[:-1], nq * d)
    return qo if out is None else out.copy_(qo)


if __name__ == "__main__":  # python -m glmasr_kernels.cuda_gemv [sm]: prebuild the table's cubins (no GPU needed)
    for p in prebuild(sm=int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print(p)
