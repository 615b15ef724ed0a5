"""Encoder self-attention (flash attention, bidirectional, no mask) straight from the fused QKV projection, the
output written in o_proj's layout.

For each window w, head h and query position t (scale = D**-0.5 unless ``sm_scale`` is given):

    q, k, v = qkv[w, :, 0, h], qkv[w, :, 1, h], qkv[w, :, 2, h]             (T, D) each
    out[w, t, h] = softmax_j(q[t] . k[j] * scale) @ v                      j in [0, T): no mask

In the encoder layer (glmasr/models/fast_encoder.py) q and k are rotated in place by ``rope.rope_`` first;
this kernel then replaces SDPA + the ``attn.transpose(1, 2).reshape(...)`` copy by one launch.

Shapes: qkv (W, T, 3, H, D): any strides for W, T, the q/k/v index and H, unit stride in D (typically the
contiguous (W, T, 3*H*D) projection output viewed); bf16 or fp32; D a power of two (padded to 16 lanes below
16). ``out`` (W, T, H, D) contiguous in qkv's dtype (= (W, T, H*D), what o_proj reads); allocated if None.
T is a compile-time constant of the kernel (one compile per sequence length; the encoder always uses 1500);
it need not be a multiple of the block sizes (the key tail is masked with -inf, the query tail on store).
qkv is read only.

Math: scores, the online max-stable softmax (exp2 with the scale pre-multiplied by log2(e)), the running sum
and the accumulator are fp32; P is rounded to the I/O dtype for the P@V product (as flash attention does);
the output is rounded once. No host syncs: CUDA-graph capturable.

Launch: grid (cdiv(T, BLOCK_M), H, W); a program owns BLOCK_M query rows of one (window, head) and streams the
T keys in BLOCK_N tiles (full tiles unmasked, one masked tail tile), software-pipelined with ``num_stages``.
Config: ``CONFIG`` (measured on the H200), ``INTERPRET_CONFIG`` under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, interpreting, next_pow2

__all__ = ["AttnConfig", "CONFIG", "INTERPRET_CONFIG", "encoder_attention", "encoder_attention_ref",
           "default_config", "flops"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Launch config: ``block_m`` query rows per program, ``block_n`` keys per tile, ``num_stages``
    software-pipelining depth of the K/V loop."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def short(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


# The best config measured on the H200 (2026-12-01, 1 and 32 windows of 1500 x 20 heads x 64, after rope_:
# 38.9 / 1030 us, 296 / 358 TFLOP/s; notes/measurements.md, third session).
CONFIG = AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
# Small tiles for the CPU interpreter (it pays per op, not per element; tests pass their own configs too).
INTERPRET_CONFIG = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def default_config() -> AttnConfig:
    return INTERPRET_CONFIG if interpreting() else CONFIG


# ------------------------------------------------------------------------------------------------ reference

def encoder_attention_ref(qkv, sm_scale=None, out=None, config=None):
    """Plain-PyTorch reference, same interface (``config`` ignored): fp32 softmax attention, output rounded once
    to qkv's dtype."""
    W, T, _, H, D = qkv.shape
    q, k, v = qkv.unbind(2)
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    s = torch.einsum("wthd,wshd->whts", q.float(), k.float()) * scale
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("whts,wshd->wthd", p, v.float()).to(qkv.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


# ------------------------------------------------------------------------------------------------ kernel

@triton.jit
def _ld(ptrs, rmask, cmask, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """2-D load with only the masks that are needed (unmasked full tiles vectorise)."""
    if MASK_R and MASK_C:
        x = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
    elif MASK_R:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    elif MASK_C:
        x = tl.load(ptrs, mask=cmask[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_rows(base, tok, st, rmask, MASK_R: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows ``tok`` of one head's q, k or v slab (row stride st), (rows, BLOCK_D)."""
    rowp = base + tok[:, None].to(tl.int64) * st
    dd = tl.arange(0, BLOCK_D)
    x = _ld(rowp + dd[None, :], rmask, dd < D, MASK_R, BLOCK_D != D)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _step(q, k, v, kmask, m_i, l_i, acc, qk_scale, MASK_K: tl.constexpr, DOT_PREC: tl.constexpr,
          PV_DTYPE: tl.constexpr):
    """One K/V tile for the query tile: scores, online-softmax update of (m_i, l_i, acc)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASK_K:
        qk = tl.where(kmask[None, :], qk, float("-inf"))
    # no mask: every row has a finite score in the first tile, so m_new is finite from there on
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = p.to(PV_DTYPE)
    if pv.dtype != v.dtype:  # interpreter (UPCAST): P rounded to the I/O dtype, fed to the dot as fp32
        pv = pv.to(v.dtype)
    acc = tl.dot(pv, v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _store_out(O, acc, l_i, rows, w, h, so_w, so_t, so_h, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_Q: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    o = acc / l_i[:, None]
    ptrs = O + w.to(tl.int64) * so_w + h.to(tl.int64) * so_h + rows[:, None].to(tl.int64) * so_t + dd[None, :]
    val = o.to(O.dtype.element_ty)
    if MASK_Q and BLOCK_D != D:
        tl.store(ptrs, val, mask=(rows < T)[:, None] & (dd < D)[None, :])
    elif MASK_Q:
        tl.store(ptrs, val, mask=(rows < T)[:, None])
    elif BLOCK_D != D:
        tl.store(ptrs, val, mask=(dd < D)[None, :])
    else:
        tl.store(ptrs, val)


@triton.jit
def _enc_attn_kernel(QKV, O, qk_scale, s_w, s_t, s_c, s_h, so_w, so_t, so_h,
                     T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    w = tl.program_id(2)
    base = QKV + w.to(tl.int64) * s_w + h.to(tl.int64) * s_h
    kbase = base + s_c
    vbase = base + 2 * s_c
    MASK_Q: tl.constexpr = T % BLOCK_M != 0
    N_FULL: tl.constexpr = (T // BLOCK_N) * BLOCK_N

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(base, rows, s_t, rows < T, MASK_Q, UPCAST, D, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    for n0 in tl.range(0, N_FULL, BLOCK_N, num_stages=LOOP_STAGES):
        tok = n0 + offs_n
        kmask = tok < T  # all true here (full tiles); masks are compiled out below
        k = _load_rows(kbase, tok, s_t, kmask, False, UPCAST, D, BLOCK_D)
        v = _ld(vbase + tok[:, None].to(tl.int64) * s_t + dd[None, :], kmask, dd < D, False, BLOCK_D != D)
        if UPCAST:
            v = v.to(tl.float32)
        m_i, l_i, acc = _step(q, k, v, kmask, m_i, l_i, acc, qk_scale, False, DOT_PREC, PV_DTYPE)
    if N_FULL < T:  # the key tail: one masked tile
        tok = N_FULL + offs_n
        kmask = tok < T
        k = _load_rows(kbase, tok, s_t, kmask, True, UPCAST, D, BLOCK_D)
        v = _ld(vbase + tok[:, None].to(tl.int64) * s_t + dd[None, :], kmask, dd < D, True, BLOCK_D != D)
        if UPCAST:
            v = v.to(tl.float32)
        m_i, l_i, acc = _step(q, k, v, kmask, m_i, l_i, acc, qk_scale, True, DOT_PREC, PV_DTYPE)

    _store_out(O, acc, l_i, rows, w, h, so_w, so_t, so_h, T, D, BLOCK_D, MASK_Q)


# ------------------------------------------------------------------------------------------------ launcher

_DTYPES = (torch.bfloat16, torch.float32)


def _check(qkv, out, config):
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (W, T, 3, H, D), got shape {tuple(getattr(qkv, 'shape', ()))}")
    W, T, _, H, D = qkv.shape
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv dtype must be bfloat16 or float32, got {qkv.dtype}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv must have unit stride in D (the last dim), got strides {tuple(qkv.stride())}")
    if D != next_pow2(D):
        raise ValueError(f"qkv head_dim D = {D} (shape {tuple(qkv.shape)}) must be a power of two")
    if out is not None:
        if tuple(out.shape) != (W, T, H, D) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous (W, T, H, D) = {(W, T, H, D)} tensor, got shape "
                             f"{tuple(out.shape)} strides {tuple(out.stride())}")
        if out.dtype != qkv.dtype:
            raise ValueError(f"out dtype {out.dtype} must equal qkv's {qkv.dtype}")
        if out.device != qkv.device:
            raise ValueError(f"out is on {out.device}, qkv on {qkv.device}")
    if config is not None:
        if not isinstance(config, AttnConfig):
            raise ValueError(f"config must be an AttnConfig, got {type(config).__name__}")
        bad = [f for f in ("block_m", "block_n") if getattr(config, f) < 16 or
               getattr(config, f) != next_pow2(getattr(config, f))]
        if bad:
            raise ValueError(f"config {config}: block_m, block_n must be powers of two >= 16")


def encoder_attention(qkv, sm_scale=None, out=None, config=None):
    """See the module docstring. Returns ``out`` (W, T, H, D) in qkv's dtype (view it as (W, T, H*D))."""
    _check(qkv, out, config)
    check_device(qkv, out)
    W, T, _, H, D = qkv.shape
    if out is None:
        out = torch.empty((W, T, H, D), device=qkv.device, dtype=qkv.dtype)
    if W == 0 or T == 0 or H == 0:
        return out
    cfg = config or default_config()
    interp = interpreting()
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    fp32 = qkv.dtype == torch.float32
    s = qkv.stride()
    grid = (cdiv(T, cfg.block_m), H, W)
    _enc_attn_kernel[grid](
        qkv, out, scale * _LOG2E, s[0], s[1], s[2], s[3], out.stride(0), out.stride(1), out.stride(2),
        T=T, D=D, BLOCK_D=max(16, D), UPCAST=interp, DOT_PREC="ieee" if fp32 else "tf32",
        PV_DTYPE=tl.float32 if fp32 else tl.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        LOOP_STAGES=1 if interp else cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def flops(W: int, T: int, H: int, D: int) -> float:
    """Attention FLOPs of one call (QK^T and PV, 2 flops per multiply-add): 4 * T * T * D * H * W."""
    return 4.0 * T * T * D * H * W
