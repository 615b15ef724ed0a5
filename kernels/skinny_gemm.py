"""Skinny (decode) GEMMs: ``y = x @ W^T`` for a handful of rows, memory-bound on the weight.

Computes, with fp32 accumulation and one rounding to the I/O dtype:

    skinny_gemm(x, W)          y = x @ W^T                            x (..., K), W (N, K)   -> (..., N)
    skinny_gemm_swiglu(x, W)   y = silu(x @ Wg^T) * (x @ Wu^T)        W = [Wg; Wu] (2I, K)   -> (..., I)

``skinny_gemm_swiglu`` rounds like the unfused ``swiglu(F.linear(x, W))`` path (kernels/activations.py, HF's
``act_fn(gate_proj(x)) * up_proj(x)``): gate and up rounded to the I/O dtype, silu in fp32 rounded, product in
fp32 rounded; it saves the (M, 2I) round trip through memory and one launch.

Shape contract: ``x`` (..., K) with M = prod(leading dims) <= 16 (``select`` says "cuBLAS" above; ``linear`` /
``linear_swiglu`` dispatch), last dim contiguous (copied otherwise; x is tiny); ``W`` (N, K) with unit stride
in K (nn.Linear layout; any row stride; never copied: a non-unit K stride raises). bf16 (the target), fp16 or
fp32, x and W of one dtype; output in that dtype. Any N, K (odd sizes masked). ``out=`` (..., N) is written in
place (last dim contiguous, viewable as (M, N)); with ``out`` given and split-K == 1 nothing is allocated; with
split-K > 1 an fp32 workspace (split, M, N) is needed: pass ``workspace=`` or a per-device cached one is used
(grown on demand, never freed, so warm up once outside graph capture and do not share it between streams that
run concurrently). No host synchronisation: CUDA-graph capturable, grid fixed per (shape, config).

Design (H200: 132 SMs, ~4.3 TB/s): the weight is streamed exactly once, as (BLOCK_N, BLOCK_K) tiles of
contiguous K runs (16-byte vector loads, ``evict_first``), by a grid of (cdiv(N, BLOCK_N), SPLIT_K) programs;
program (n, s) owns rows [n*BLOCK_N, +BLOCK_N) of W (for SwiGLU also the matching up rows, +I) and the K slice
[s*ITERS*BLOCK_K, +ITERS*BLOCK_K) with a compile-time trip count ITERS. Two inner products:

* FMA (``use_dot=False``, for M <= ~4-8): per K tile, the tile is upcast to fp32 once and each of the BLOCK_M
  rows of x (read from L1/L2; x is a few KB) is multiplied and reduced over K (a broadcast-multiply-reduce,
  CUDA cores). Latency is hidden by many small programs resident per SM (small BLOCK_N).
* Tensor cores (``use_dot=True``, for M ~8-16): "swap AB", ``acc(BLOCK_N, 16) += W_tile @ x_tile^T`` with x
  padded to 16 rows; ``num_stages`` pipelines the W tiles through shared memory.

Split-K (SPLIT_K > 1, for shapes whose N / BLOCK_N leaves SMs idle) writes fp32 partials to the workspace and a
second small kernel sums the splits in a fixed order (deterministic) and applies the epilogue (cast or SwiGLU).

``select(M, N, K, swiglu=False)`` returns the ``SkinnyConfig`` for a shape (the tuned table ``CONFIGS`` for
the decoder's shapes, else a heuristic) or ``None`` = use cuBLAS (M > 16, or where the sweep found cuBLAS
faster).

Batch invariance (``linear_invariant`` / ``linear_swiglu_invariant``, any M): a row's result must not depend on
how many rows share the call. ``select`` is tuned per row-count bucket (FMA configs for 1-2 rows, tensor-core
ones above, cuBLAS past 16), so the same row comes out of different reduction orders. The invariant
dispatchers run every row count on one config per (N, K): the 16-row tensor-core config (``invariant_config``),
whose x tile is padded to 16 rows whatever M is, so each output element is the same dot product in the same
order; more than 16 rows go through it 16 at a time.

PDL (sm_90+, ``_triton_utils.pdl_launch``): the first W tile of each program is loaded before ``pdl_wait``
(SASS: the LDGs precede the griddepcontrol wait), so in a chain of decode kernels the weight stream starts
while the previous kernel drains. ``*_ref`` are the plain-torch references (fp32 math on the given, already
rounded, inputs).

int8 weights (opt-in, ``scale=``): ``W`` may be int8 (N, K) with one fp32 scale per row, ``scale`` (N,) (for
SwiGLU rows [0, I) are the gate's, [I, 2I) the up's), from ``quantize_rows``: symmetric, per output channel,
``scale[n] = max_k |W[n, k]| / 127`` (1 for an all-zero row), ``q = clamp(round(W / scale), -127, 127)``. The
kernel computes ``y[m, n] = scale[n] * sum_k x[m, k] q[n, k]``: the K loop upcasts each int8 tile in registers
(to fp32 on the FMA path, to x's dtype on the tensor-core path, exact: |q| <= 127 fits bf16's 8-bit
significand) and the epilogue multiplies the fp32 accumulator by ``scale[n]`` before the cast / SwiGLU (split-K:
the reduce kernel, after summing the fp32 partials). x, out and the math stay in x's dtype (bf16, fp16, fp32) /
fp32; only the streamed weight bytes halve. Why int8 and not FP8 e4m3: a weight-only GEMV dequantizes in
registers either way (the bytes, not the math, set the time), and int8 with a per-row scale keeps ~7 bits of
uniform precision over the row's range (127 steps of amax/127 each side; error <= half a step) where e4m3 keeps 3
mantissa bits (relative step 1/8 at every magnitude); e4m3's wider range helps only rows whose values span many
octaves, and a per-row scale already fits each row's range. The int8 configs (``int8_config``): the bf16 config
of the same shape, BLOCK_K doubled on the FMA path. ``linear`` / ``linear_swiglu`` never send an int8
weight to cuBLAS (it has no int8 x bf16 GEMM): more than 16 rows run through the kernel 16 at a time. The
references dequantize in fp32 (``x.float() @ (q.float() * scale[:, None]).T``, rounded like the bf16 ones).

Interpreter (TRITON_INTERPRET=1): CPU tensors accepted; tl.dot is fed fp32 copies (its bf16 dot is wrong); the
K loop has a constexpr trip count everywhere, which numpy >= 2.4 needs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import as_rows, cdiv, check_device, interpreting, next_pow2, pdl_begin, pdl_launch, pdl_wait

__all__ = [
    "SkinnyConfig", "CONFIGS", "MAX_M", "select", "kernel_config", "skinny_gemm", "skinny_gemm_swiglu", "skinny_gemm_ref",
    "skinny_gemm_swiglu_ref", "linear", "linear_swiglu", "m_bucket", "invariant_config", "linear_invariant",
    "linear_swiglu_invariant", "quantize_rows", "int8_config",
]

MAX_M = 16


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    # K tiles loaded before the PDL wait (1 or 2); None: PRELOAD_TILES on the FMA path, 1 on the dot path
    preload: int | None = None

    def __post_init__(self):
        if self.preload not in (None, 1, 2):
            raise ValueError(f"SkinnyConfig.preload must be 1 or 2, got {self.preload}")

    def short(self) -> str:
        return (f"{'dot' if self.use_dot else 'fma'} BN{self.block_n} BK{self.block_k} S{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}" + (f" pre{self.preload}" if self.preload else ""))


# ------------------------------------------------------------------------------------------------ references

def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row (per output channel) int8 quantization of a floating-point W (N, K) for ``scale=``:
    returns ``(q, scale)``, q int8 (N, K) contiguous and scale fp32 (N,) on W's device, with
    ``scale[n] = max_k |W[n, k]| / 127`` (1 for an all-zero row, so nothing divides by zero) and
    ``q = clamp(round(W / scale[:, None]), -127, 127)``; ``q * scale[:, None]`` is within ``scale[n] / 2`` of
    every W[n, k] (up to fp32 rounding). Works in fp32 (an (N, K) fp32 temporary); a non-finite W raises."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rows needs a floating-point 2-D weight (N, K), got {w.dtype} {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1) if w.shape[1] else torch.zeros(w.shape[0], device=w.device)
    if not bool(torch.isfinite(amax).all()):
        rows = torch.nonzero(~torch.isfinite(amax)).flatten()[:5].tolist()
        raise ValueError(f"quantize_rows: W has non-finite values (rows {rows}...)")
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _check_scale(w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Validates the (W, scale) pair; True for an int8 W (with its per-row fp32 scale), False for a float W."""
    if w.dtype == torch.int8:
        if scale is None:
            raise ValueError("W is int8: pass its per-row fp32 dequantization scales as scale= (quantize_rows)")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise ValueError(f"scale must be an fp32 tensor (one per row of W), got "
                             f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if scale.dim() != 1 or scale.shape[0] != w.shape[0]:
            raise ValueError(f"scale must have shape ({w.shape[0]},) (one per row of W {tuple(w.shape)}), "
                             f"got {tuple(scale.shape)}")
        if scale.stride(0) != 1 and scale.shape[0] > 1:
            raise ValueError("scale must be contiguous")
        if scale.device != w.device:
            raise ValueError(f"scale is on {scale.device}, W on {w.device}")
        return True
    if scale is not None:
        raise ValueError(f"scale= is for an int8 W (per-row dequantization); W is {w.dtype}")
    return False


def _weight_f32(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """W in fp32 (int8: dequantized, q * scale per row) for the references."""
    if _check_scale(w, scale):
        return w.float() * scale[:, None]
    return w.float()


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T in fp32 on the given inputs, rounded once to x's dtype; an int8 W is dequantized in fp32 first
    (``W.float() * scale[:, None]``)."""
    y = (x.float() @ _weight_f32(w, scale).t()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def skinny_gemm_swiglu_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                           scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T), W = [Wg; Wu]; gate/up rounded to x's dtype first (the unfused path); an int8
    W (with its 2I scales) dequantized in fp32 first."""
    h = skinny_gemm_ref(x, w, scale=scale)
    gate, up = h.chunk(2, dim=-1)
    y = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _load_w(ptrs, nmask, kmask, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_N:
        if EVEN_K:
            w = tl.load(ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(ptrs, mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
    else:
        if EVEN_K:
            w = tl.load(ptrs, mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _load_tiles(w_ptrs, w2_ptrs, k0, K, offs_k, nmask, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                SWIGLU: tl.constexpr):
    """The W tile (and, for SwiGLU, the matching up tile) at K offset k0; w2 is w when not SwiGLU."""
    kmask = (k0 + offs_k) < K
    w = _load_w(w_ptrs + k0, nmask, kmask, EVEN_N, EVEN_K)
    w2 = w
    if SWIGLU:
        w2 = _load_w(w2_ptrs + k0, nmask, kmask, EVEN_N, EVEN_K)
    return w, w2


@triton.jit
def _k_step(X, w, w2, k0, M, K, sx, offs_m, offs_k, acc, acc2,
            BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, SWIGLU: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PREC: tl.constexpr, QUANT: tl.constexpr):
    """One K tile: acc (+ acc2 for the SwiGLU up rows) += x[:, k0:k0+BK] . W_tile (tiles already loaded); an
    int8 tile (QUANT) is upcast in registers, unscaled (the epilogue applies the per-row scale)."""
    k = k0 + offs_k
    kmask = k < K
    if USE_DOT:
        # acc (BLOCK_N, BLOCK_M) += W (BN, BK) @ x^T (BK, BM); x rows >= M are zero.
        xt = tl.load(X + offs_m[None, :] * sx + k[:, None], mask=(offs_m < M)[None, :] & kmask[:, None],
                     other=0.0, eviction_policy="evict_last")
        if UPCAST:
            xt = xt.to(tl.float32)
            acc = tl.dot(w.to(tl.float32), xt, acc, input_precision=DOT_PREC)
            if SWIGLU:
                acc2 = tl.dot(w2.to(tl.float32), xt, acc2, input_precision=DOT_PREC)
        else:
            if QUANT:  # int8 -> x's dtype: exact (|q| <= 127)
                w = w.to(xt.dtype)
                if SWIGLU:
                    w2 = w2.to(xt.dtype)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
            if SWIGLU:
                acc2 = tl.dot(w2, xt, acc2, input_precision=DOT_PREC)
    else:
        # acc (BLOCK_M, BLOCK_N): per row of x, broadcast-multiply the fp32 tile and reduce over K.
        wf = w.to(tl.float32)
        if SWIGLU:
            w2f = w2.to(tl.float32)
        for mi in tl.static_range(BLOCK_M):
            if mi == 0:  # row 0 always exists (M >= 1)
                xm = tl.load(X + k, mask=kmask, other=0.0, eviction_policy="evict_last")
            else:
                xm = tl.load(X + mi * sx + k, mask=kmask & (M > mi), other=0.0, eviction_policy="evict_last")
            xm = xm.to(tl.float32)
            p = tl.sum(wf * xm[None, :], axis=1)
            if SWIGLU:
                p2 = tl.sum(w2f * xm[None, :], axis=1)
            if BLOCK_M == 1:
                acc += p[None, :]
                if SWIGLU:
                    acc2 += p2[None, :]
            else:
                sel = offs_m[:, None] == mi
                acc = tl.where(sel, acc + p[None, :], acc)
                if SWIGLU:
                    acc2 = tl.where(sel, acc2 + p2[None, :], acc2)
    return acc, acc2


@triton.jit
def _swiglu_epilogue(g, u, Y):
    """Rounding of the unfused path: gate/up rounded, silu rounded, product rounded to Y's dtype (returns fp32)."""
    dtype = Y.dtype.element_ty
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return s * u


@triton.jit
def _skinny_kernel(X, W, S, Y, WS, M, N, K, sx, sw, sy, HALF,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, ITERS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   USE_DOT: tl.constexpr, SWIGLU: tl.constexpr, UPCAST: tl.constexpr,
                   NUM_STAGES: tl.constexpr, STATIC: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                   PRELOAD: tl.constexpr, QUANT: tl.constexpr):
    # N = output columns (I for SwiGLU); HALF = row offset of the up half in W (I), unused otherwise.
    # QUANT: W int8 with per-row fp32 scales S (2I of them for SwiGLU); otherwise S is None.
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    k_base = pid_k * (ITERS * BLOCK_K)
    rows64 = offs_n.to(tl.int64)
    w_ptrs = W + rows64[:, None] * sw + offs_k[None, :]
    w2_ptrs = W + (rows64 + HALF)[:, None] * sw + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros_like(acc)
    # First PRELOAD (1 or 2) K tiles peeled: the weights are never written by the step, so with PDL they are
    # already in flight while the previous kernel finishes; x (its output) is read only after the wait.
    w, w2 = _load_tiles(w_ptrs, w2_ptrs, k_base, K, offs_k, nmask, EVEN_N, EVEN_K, SWIGLU)
    if PRELOAD == 2:
        wb, wb2 = _load_tiles(w_ptrs, w2_ptrs, k_base + BLOCK_K, K, offs_k, nmask, EVEN_N, EVEN_K, SWIGLU)
    if QUANT:
        if SPLIT_K == 1:  # the row scales, a weight too (split-K: the reduce kernel applies them)
            scl = tl.load(S + offs_n, mask=nmask, other=1.0)
            scl2 = scl
            if SWIGLU:
                scl2 = tl.load(S + HALF + offs_n, mask=nmask, other=1.0)
    pdl_wait(PDL)
    acc, acc2 = _k_step(X, w, w2, k_base, M, K, sx, offs_m, offs_k, acc, acc2, BLOCK_M, USE_DOT, SWIGLU,
                        UPCAST, DOT_PREC, QUANT)
    if PRELOAD == 2:
        acc, acc2 = _k_step(X, wb, wb2, k_base + BLOCK_K, M, K, sx, offs_m, offs_k, acc, acc2, BLOCK_M,
                            USE_DOT, SWIGLU, UPCAST, DOT_PREC, QUANT)
    if STATIC:
        for it in range(PRELOAD, ITERS):
            k0 = k_base + it * BLOCK_K
            w, w2 = _load_tiles(w_ptrs, w2_ptrs, k0, K, offs_k, nmask, EVEN_N, EVEN_K, SWIGLU)
            acc, acc2 = _k_step(X, w, w2, k0, M, K, sx, offs_m, offs_k, acc, acc2, BLOCK_M, USE_DOT,
                                SWIGLU, UPCAST, DOT_PREC, QUANT)
    else:
        for it in tl.range(PRELOAD, ITERS, num_stages=NUM_STAGES):
            k0 = k_base + it * BLOCK_K
            w, w2 = _load_tiles(w_ptrs, w2_ptrs, k0, K, offs_k, nmask, EVEN_N, EVEN_K, SWIGLU)
            acc, acc2 = _k_step(X, w, w2, k0, M, K, sx, offs_m, offs_k, acc, acc2, BLOCK_M, USE_DOT,
                                SWIGLU, UPCAST, DOT_PREC, QUANT)

    offs_m64 = offs_m.to(tl.int64)
    if USE_DOT:
        row_off = offs_m64[None, :]
        col_off = offs_n[:, None]
        mask = (offs_m < M)[None, :] & nmask[:, None]
    else:
        row_off = offs_m64[:, None]
        col_off = offs_n[None, :]
        mask = (offs_m < M)[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        if QUANT:
            if USE_DOT:
                acc = acc * scl[:, None]
                if SWIGLU:
                    acc2 = acc2 * scl2[:, None]
            else:
                acc = acc * scl[None, :]
                if SWIGLU:
                    acc2 = acc2 * scl2[None, :]
        if SWIGLU:
            res = _swiglu_epilogue(acc, acc2, Y)
        else:
            res = acc
        tl.store(Y + row_off * sy + col_off, res.to(Y.dtype.element_ty), mask=mask)
    else:
        # fp32 partials (unscaled for QUANT): WS (SPLIT_K, M, NT), NT = 2*HALF for SwiGLU (gate | up), else N.
        if SWIGLU:
            nt = 2 * HALF
        else:
            nt = N
        base = WS + (pid_k * M + row_off) * nt + col_off
        tl.store(base, acc, mask=mask)
        if SWIGLU:
            tl.store(base + HALF, acc2, mask=mask)


@triton.jit
def _reduce_scales(S, M, N, HALF, SWIGLU: tl.constexpr, BLOCK: tl.constexpr):
    """The reduce kernel's row scales: S[n] (and S[HALF + n] for the SwiGLU up half) per output element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    n = offs - (offs // N) * N
    scl = tl.load(S + n, mask=mask, other=1.0)
    scl2 = scl
    if SWIGLU:
        scl2 = tl.load(S + HALF + n, mask=mask, other=1.0)
    return scl, scl2


@triton.jit
def _splitk_reduce_kernel(WS, S, Y, M, N, sy, HALF, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr):
    # QUANT: the sums are scaled by the int8 weight's row scales S (gate n: S[n], up n: S[HALF + n]).
    pdl_begin(PDL)
    if QUANT:  # weights: read before the wait
        scl, scl2 = _reduce_scales(S, M, N, HALF, SWIGLU, BLOCK)
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs - m * N
    if SWIGLU:
        nt = 2 * HALF
    else:
        nt = N
    src = WS + m.to(tl.int64) * nt + n
    stride = M * nt
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(src + s * stride, mask=mask, other=0.0)
        if SWIGLU:
            acc2 += tl.load(src + s * stride + HALF, mask=mask, other=0.0)
    if QUANT:
        acc = acc * scl
        if SWIGLU:
            acc2 = acc2 * scl2
    if SWIGLU:
        res = _swiglu_epilogue(acc, acc2, Y)
    else:
        res = acc
    tl.store(Y + m.to(tl.int64) * sy + n, res.to(Y.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ configs

def m_bucket(m: int) -> int:
    """Row-count bucket used for configs and BLOCK_M: 1, 2, 4, 8, 16."""
    return next_pow2(max(1, m))


# Tuned per (W rows N, K, M bucket, swiglu) for the GLM-ASR-Nano decoder (hidden 2048, 16+4x128 heads,
# I = 6144, vocab 59264): ``python -m scripts.bench.bench_skinny_gemm --sweep`` on one H200, 2026-11-29 (438
# configs, each timed in a CUDA graph over rotating weights; see notes/skinny_gemm.md for the table). ``None`` = cuBLAS was
# faster for that shape. Shapes not listed use ``_heuristic``.
CONFIGS: dict[tuple[int, int, int, bool], SkinnyConfig | None] = {
    (2048, 2048, 1, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (2048, 2048, 2, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (2048, 2048, 4, False): SkinnyConfig(32, 128, 1, num_warps=4, num_stages=6, use_dot=True),
    (2048, 2048, 8, False): SkinnyConfig(32, 128, 1, num_warps=4, num_stages=6, use_dot=True),
    (2048, 2048, 16, False): SkinnyConfig(32, 256, 1, num_warps=4, num_stages=4, use_dot=True),
    (2048, 6144, 1, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (2048, 6144, 2, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (2048, 6144, 4, False): SkinnyConfig(32, 256, 2, num_warps=4, num_stages=4, use_dot=True),
    (2048, 6144, 8, False): SkinnyConfig(32, 256, 2, num_warps=4, num_stages=4, use_dot=True),
    (2048, 6144, 16, False): SkinnyConfig(32, 256, 2, num_warps=4, num_stages=4, use_dot=True),
    (3072, 2048, 1, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (3072, 2048, 2, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (3072, 2048, 4, False): SkinnyConfig(32, 128, 1, num_warps=4, num_stages=6, use_dot=True),
    (3072, 2048, 8, False): SkinnyConfig(32, 128, 1, num_warps=4, num_stages=6, use_dot=True),
    (3072, 2048, 16, False): SkinnyConfig(32, 128, 1, num_warps=4, num_stages=6, use_dot=True),
    (12288, 2048, 1, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (12288, 2048, 1, True): SkinnyConfig(8, 1024, 1, num_warps=8, num_stages=1, use_dot=False),
    (12288, 2048, 2, False): SkinnyConfig(16, 256, 1, num_warps=4, num_stages=3, use_dot=False),
    (12288, 2048, 2, True): SkinnyConfig(16, 256, 1, num_warps=4, num_stages=3, use_dot=False),
    (12288, 2048, 4, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (12288, 2048, 4, True): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (12288, 2048, 8, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (12288, 2048, 8, True): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (12288, 2048, 16, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (12288, 2048, 16, True): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (59264, 2048, 1, False): SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, use_dot=False),
    (59264, 2048, 2, False): None,  # cuBLAS 57.1 us vs 60.3 us best skinny
    (59264, 2048, 4, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (59264, 2048, 8, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
    (59264, 2048, 16, False): SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, use_dot=True),
}


def _heuristic(m: int, n: int, k: int, swiglu: bool, sms: int = 132) -> SkinnyConfig:
    mb = m_bucket(m)
    use_dot = mb >= 8
    if use_dot:
        bk = 256 if k >= 256 else max(16, next_pow2(k))
        bn = 32 if n >= 32 * 2 * sms else 16
        stages = 4
        warps = 4
    else:
        # K tile: 8-16 KB of W per program per step in flight (1024 wide at M = 1: 64 registers, no spills)
        bk = (1024 if mb == 1 else 512) if k >= 1024 else max(16, min(512, next_pow2(k)))
        # small row blocks: many programs per SM hide the DRAM latency without pipelining; the tile stays at
        # <= 64 elements per thread (BLOCK_N * BLOCK_K <= 8192 over 4 warps; SwiGLU reads two tiles)
        bn = max(1, min(8, 8192 // bk) // (2 if swiglu else 1))
        stages = 1
        warps = 4
    n_prog = cdiv(n, bn)
    split = 1
    # split K only when the row blocks leave most SMs without work and K is long
    while n_prog * split < sms and cdiv(k, bk) >= 4 * split:
        split *= 2
    return SkinnyConfig(bn, bk, split, warps, stages, use_dot)


def select(m: int, n: int, k: int, swiglu: bool = False, int8: bool = False) -> SkinnyConfig | None:
    """Config for an (m, n, k) problem (n = rows of W, 2I for SwiGLU); None means "use cuBLAS" (m > MAX_M).
    ``int8``: the config for an int8 W (``int8_config``), never None for 1 <= m <= MAX_M (cuBLAS has no int8 x
    bf16 GEMM; more rows run 16 at a time)."""
    if m > MAX_M or m < 1:
        return None
    if int8:
        return int8_config(kernel_config(m, n, k, swiglu))
    key = (n, k, m_bucket(m), swiglu)
    if key in CONFIGS:
        return CONFIGS[key]
    return _heuristic(m, n // 2 if swiglu else n, k, swiglu)


def int8_config(cfg: SkinnyConfig) -> SkinnyConfig:
    """The int8-weight variant of a bf16 config (the rule of ``select(..., int8=True)``; not tuned on its own:
    the table is bf16's, ``config=`` takes an explicit one).

    * FMA path: BLOCK_K doubled. A (BLOCK_N, 2 BLOCK_K) int8 tile is as many bytes as the (BLOCK_N, BLOCK_K)
      bf16 one and each thread still issues 16-byte vector loads (16 int8 instead of 8 bf16), so a program keeps
      the same bytes in flight over half the K iterations (the fp32 copy of the tile in registers doubles).
    * Tensor-core path: unchanged. The int8 tile goes from global memory to registers, is converted there and
      feeds the MMA as its register operand (no shared-memory staging), so a doubled tile would only double
      those registers (for the 16-row gate|up config, into spills)."""
    return cfg if cfg.use_dot else dataclasses.replace(cfg, block_k=2 * cfg.block_k)


def kernel_config(m: int, n: int, k: int, swiglu: bool = False, int8: bool = False) -> SkinnyConfig:
    """The config a direct ``skinny_gemm`` call uses: ``select``'s, or the heuristic where it says cuBLAS
    (``int8``: that config through ``int8_config``)."""
    cfg = select(m, n, k, swiglu) or _heuristic(m, n // 2 if swiglu else n, k, swiglu)
    return int8_config(cfg) if int8 else cfg


def invariant_config(n: int, k: int, swiglu: bool = False, int8: bool = False) -> SkinnyConfig:
    """The one config of the batch-invariant dispatchers for W (n, k): the 16-row one (tensor cores, x padded to
    16 rows for every M); ``int8``: that config through ``int8_config``."""
    cfg = kernel_config(MAX_M, n, k, swiglu)
    # a table entry could say FMA (its BLOCK_M would follow M): the heuristic at 16 rows is always the dot path
    cfg = cfg if cfg.use_dot else _heuristic(MAX_M, n // 2 if swiglu else n, k, swiglu)
    return int8_config(cfg) if int8 else cfg


# ------------------------------------------------------------------------------------------------ launchers

_WS: dict[tuple[str, int | None], list[torch.Tensor]] = {}
# K tiles each program of the FMA path (M <= 2) loads before its PDL wait (1 or 2; at most its tile count).
# Measured on the H200 (benchmark.sh breakdown, same run): decode step 1.266 ms with 1, 1.323 ms with 2 (the
# extra registers cost more than the earlier bytes in flight gain). The tensor-core path always uses 1.
PRELOAD_TILES = 1


def _preload(cfg: SkinnyConfig) -> int:
    if cfg.preload is not None:
        return cfg.preload
    return 1 if cfg.use_dot else PRELOAD_TILES


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    key = (device.type, device.index)
    bufs = _WS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < numel:
        # grow-only; older buffers stay alive so graphs that captured them remain valid
        bufs.append(torch.empty(max(numel, 1 << 16), device=device, dtype=torch.float32))
    return bufs[-1]


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, config: SkinnyConfig | None,
            workspace: torch.Tensor | None, swiglu: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
    check_device(x, w, out, workspace, scale)
    if w.dim() != 2:
        raise ValueError("W must be 2-D (N, K)")
    quant = _check_scale(w, scale)
    nw, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x last dim {x.shape[-1]} != W.shape[1] {k}")
    if quant:
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"x must be bf16, fp16 or fp32 with an int8 W, got {x.dtype}")
    elif x.dtype != w.dtype:
        raise ValueError(f"x dtype {x.dtype} != W dtype {w.dtype}")
    if w.stride(1) != 1 and k > 1:
        raise ValueError("W must have unit stride along K (nn.Linear layout); refusing to copy the weight")
    if swiglu and nw % 2:
        raise ValueError("skinny_gemm_swiglu: W must have an even number of rows ([Wg; Wu])")
    n = nw // 2 if swiglu else nw
    x2 = as_rows(x)
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"skinny_gemm supports M <= {MAX_M} rows (got {m}); use linear(), which dispatches more "
                         f"rows to cuBLAS (an int8 W: to this kernel, {MAX_M} rows at a time)")
    oshape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(oshape, device=x.device, dtype=x.dtype)
    else:
        if tuple(out.shape) != oshape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must be {oshape} {x.dtype} on {x.device}")
        if out.stride(-1) != 1 and n > 1:
            raise ValueError("out must have a contiguous last dim")
    if m == 0 or n == 0:
        return out
    try:
        out2 = out.view(m, n)
    except RuntimeError as e:
        raise ValueError("out must be viewable as (M, N)") from e
    if k == 0:
        out2.zero_()  # empty sum (silu(0) * 0 = 0 for SwiGLU too)
        return out
    cfg = config or kernel_config(m, nw, k, swiglu, int8=quant)
    interp = interpreting()
    bm = m_bucket(m)
    bk = max(16, min(cfg.block_k, next_pow2(k)))
    bn = max(16 if cfg.use_dot else 1, min(cfg.block_n, next_pow2(n)))
    if cfg.use_dot:
        bm = max(16, bm)
    k_tiles = cdiv(k, bk)
    iters = cdiv(k_tiles, max(1, cfg.split_k))
    split = cdiv(k_tiles, iters)  # no empty K slices
    even_n = n % bn == 0
    even_k = k % bk == 0 and k_tiles % iters == 0
    ws = x2  # placeholder pointer when split == 1
    if split > 1:
        need = split * m * nw
        if workspace is not None:
            if workspace.dtype != torch.float32 or workspace.numel() < need or not workspace.is_contiguous():
                raise ValueError(f"workspace must be a contiguous fp32 tensor with >= {need} elements")
            ws = workspace
        else:
            ws = _workspace(x.device, need)
    grid = (cdiv(n, bn), split)
    pdl = pdl_launch(x.device)
    preload = min(_preload(cfg), iters)
    _skinny_kernel[grid](
        x2, w, scale, out2, ws, m, n, k, x2.stride(0), w.stride(0), out2.stride(0), n if swiglu else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, ITERS=iters, EVEN_N=even_n, EVEN_K=even_k,
        USE_DOT=cfg.use_dot, SWIGLU=swiglu, UPCAST=interp, NUM_STAGES=cfg.num_stages, STATIC=interp,
        # fp32 I/O: true fp32 products (tl.dot's default for fp32 is TF32, ~1e-3 relative)
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", PRELOAD=preload, QUANT=quant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if split > 1:
        block = 1024 if m * n >= 1024 else max(16, next_pow2(m * n))
        _splitk_reduce_kernel[(cdiv(m * n, block),)](
            ws, scale, out2, m, n, out2.stride(0), n if swiglu else 0, SPLIT_K=split, SWIGLU=swiglu,
            BLOCK=block, QUANT=quant, num_warps=4, **pdl)
    return out


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: SkinnyConfig | None = None, workspace: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W(N, K)^T -> (..., N) for M <= 16 rows; W int8 with ``scale`` (N,) fp32 per row, or x's
    dtype; see the module docstring."""
    return _launch(x, w, out, config, workspace, False, scale)


def skinny_gemm_swiglu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None, workspace: torch.Tensor | None = None,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) with W = [Wg; Wu] (2I, K) -> (..., I) for M <= 16 rows; an int8 W takes its
    2I row scales in ``scale``."""
    return _launch(x, w, out, config, workspace, True, scale)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatcher: the skinny kernel when ``select`` picks it, else cuBLAS (torch.matmul). An int8 W (with its
    ``scale``) always runs on the kernel, more than 16 rows 16 at a time."""
    if w.dtype == torch.int8:
        return _by_chunks(x, w, out, False, scale, None)
    _check_scale(w, scale)  # a scale with a float W is a mistake, not something to ignore
    if select(_rows(x), w.shape[0], w.shape[1]) is not None:
        return skinny_gemm(x, w, out=out)
    if out is None:
        return F.linear(x, w)
    torch.matmul(x, w.t(), out=out)
    return out


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatcher for the fused gate|up + SwiGLU: skinny kernel for M <= 16, else cuBLAS + kernels.activations;
    an int8 W (with its ``scale``) always on the kernel, 16 rows at a time."""
    if w.dtype == torch.int8:
        return _by_chunks(x, w, out, True, scale, None)
    _check_scale(w, scale)
    if select(_rows(x), w.shape[0], w.shape[1], swiglu=True) is not None:
        return skinny_gemm_swiglu(x, w, out=out)
    from .activations import swiglu

    y = swiglu(F.linear(x, w))
    if out is None:
        return y
    out.copy_(y)
    return out


def _by_chunks(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, swiglu: bool,
               scale: torch.Tensor | None, config: SkinnyConfig | None) -> torch.Tensor:
    """The kernel on any number of rows: one launch up to MAX_M rows, else one per 16 rows into views of
    ``out``. ``config`` None: each launch's own default config (by its row count)."""
    x2 = as_rows(x)
    m = x2.shape[0]
    if m <= MAX_M:
        return _launch(x, w, out, config, None, swiglu, scale)
    if w.dim() != 2:
        raise ValueError("W must be 2-D (N, K)")
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    oshape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(oshape, device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != oshape:  # the chunks below see only (16, n) views of it
        raise ValueError(f"out must be {oshape} {x.dtype} on {x.device}, got {tuple(out.shape)}")
    try:
        out2 = out.view(m, n)
    except RuntimeError as e:
        raise ValueError("out must be viewable as (M, N)") from e
    for i in range(0, m, MAX_M):
        _launch(x2[i:i + MAX_M], w, out2[i:i + MAX_M], config, None, swiglu, scale)
    return out


def _invariant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, swiglu: bool,
               scale: torch.Tensor | None) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError("W must be 2-D (N, K)")
    cfg = invariant_config(w.shape[0], w.shape[1], swiglu, int8=w.dtype == torch.int8)
    return _by_chunks(x, w, out, swiglu, scale, cfg)


def linear_invariant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T for any number of rows, each row's result independent of the row count (module
    docstring: batch invariance). Slower than ``linear`` where ``select`` would pick another config. An int8 W
    takes its ``scale``."""
    return _invariant(x, w, out, False, scale)


def linear_swiglu_invariant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                            scale: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_swiglu`` for any number of rows, batch-invariant like ``linear_invariant``."""
    return _invariant(x, w, out, True, scale)
