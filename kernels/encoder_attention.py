"""Encoder self-attention (flash attention, bidirectional, no mask) straight from the fused QKV projection,
with the encoder's partial RoPE applied to q and k on load and the output written in o_proj's layout.

For each window w, head h and query position t (scale = D**-0.5 unless ``sm_scale`` is given):

    q, k, v = qkv[w, :, 0, h], qkv[w, :, 1, h], qkv[w, :, 2, h]             (T, D) each
    q, k    = rope(q, k, positions[w])                                     (optional, see below)
    out[w, t, h] = softmax_j(q[t] . k[j] * scale) @ v                      j in [0, T): no mask

Replaces, in the encoder layer (glmasr/models/fast.py ``_encoder_layers``), ``rope_`` + SDPA + the
``attn.transpose(1, 2).reshape(...)`` copy by one launch.

Shapes: qkv (W, T, 3, H, D): any strides for W, T, the q/k/v index and H, unit stride in D (typically the
contiguous (W, T, 3*H*D) projection output viewed); bf16 or fp32; D a power of two (padded to 16 lanes below
16). ``out`` (W, T, H, D) contiguous in qkv's dtype (= (W, T, H*D), what o_proj reads); allocated if None.
T is a compile-time constant of the kernel (one compile per sequence length; the encoder always uses 1500);
it need not be a multiple of the block sizes (the key tail is masked with -inf, the query tail on store).

RoPE (when ``cos``/``sin`` are given: fp32 (max_pos, R/2) tables from ``rope.build_rope_cache``, R = 2 *
cos.shape[1] <= D, R/2 a power of two): half-split (rotate_half) layout on dims [0, R), dims [R, D) untouched,
with exactly the roundings of kernels/rope.py (HF's eager bf16 math): c, s rounded to the I/O dtype, then
x1' = round(round(x1*c) + round(-x2*s)), x2' = round(round(x2*c) + round(x1*s)). The roundings are done with
integer round-to-nearest-even bit operations, so the compiler cannot contract them into FMAs (kernels/rope.py
launches with fp fusion off for that; this kernel keeps it on for the softmax) and the interpreter rounds like
the GPU. ``positions``: None (default) means arange(T) in every window (the encoder's RoPE restarts at 0 per
window, T <= max_pos is checked); else (W, T) or (T,) int32/int64, any strides, values < max_pos (not checked:
no host sync), a negative position leaves that token unrotated (as ``rope_``).
The rotated q/k are never written back: qkv is read only. To use the RoPE, the kernel splits the QK^T
contraction into three dots (dims [0, R/2), [R/2, R), [R, D)), so no lane shuffles are needed; the K tile
is rotated once per query block that reads it (redundant work, ~T/BLOCK_M times per key: hence
``rope_in_kernel=False``, which rotates q and k IN PLACE in qkv with ``rope_`` (one extra launch) and runs
the kernel without RoPE, for comparison).

Math: scores, the online max-stable softmax (exp2 with the scale pre-multiplied by log2(e)), the running sum
and the accumulator are fp32; P is rounded to the I/O dtype for the P@V product (as flash attention does);
the output is rounded once. No host syncs: CUDA-graph capturable.

Launch: grid (cdiv(T, BLOCK_M), H, W); a program owns BLOCK_M query rows of one (window, head), optionally as
``subtiles`` = 2 independent halves that share each K/V tile (and its rotation) so the compiler can overlap
one half's softmax with the other's tensor-core work (FA3's intra-warpgroup ping-pong, in software); it
streams the T keys in BLOCK_N tiles (full tiles unmasked, one masked tail tile), software-pipelined with
``num_stages`` when ``pipelined``. Configs: ``CONFIGS`` (defaults with and without RoPE), ``CANDIDATES``
(what scripts/bench/encoder_attention.py times on the H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, interpreting, next_pow2

__all__ = ["AttnConfig", "CONFIGS", "CANDIDATES", "INTERPRET_CONFIG", "encoder_attention", "encoder_attention_ref",
           "default_config", "flops"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Launch config. ``block_m`` query rows per program (``subtiles`` halves of block_m/subtiles rows each),
    ``block_n`` keys per tile, ``num_stages`` software-pipelining depth of the K/V loop when ``pipelined``
    (else the loop is not pipelined: loads issued in the iteration that uses them)."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    subtiles: int = 1
    pipelined: bool = True

    def short(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'x2' if self.subtiles == 2 else ''}{'' if self.pipelined else '-nopipe'}")


# The best of scripts/bench/encoder_attention.py's table on the H200 (2026-12-01, 20 candidates, 1 and 32 windows of
# 1500 x 20 heads x 64): with RoPE on load m256n64w8s3 (49.5 / 1487 us; today's rope_ + cuDNN + copy 44.0 / 1092),
# without m128n64w8s3 (after rope_: 38.9 / 1030 us, 296 / 358 TFLOP/s).
CONFIGS = {
    "rope": AttnConfig(block_m=256, block_n=64, num_warps=8, num_stages=3),
    "plain": AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
}
# Small tiles for the CPU interpreter (it pays per op, not per element; tests pass their own configs too).
INTERPRET_CONFIG = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)

CANDIDATES = [
    AttnConfig(bm, bn, nw, ns, sub, pipe)
    for bm, bn, nw, ns, sub, pipe in [
        (128, 64, 4, 2, 1, True), (128, 64, 4, 3, 1, True), (128, 64, 4, 4, 1, True),
        (128, 64, 8, 2, 1, True), (128, 64, 8, 3, 1, True), (128, 64, 8, 4, 1, True),
        (128, 128, 4, 2, 1, True), (128, 128, 4, 3, 1, True),
        (128, 128, 8, 2, 1, True), (128, 128, 8, 3, 1, True),
        (64, 64, 4, 3, 1, True), (64, 128, 4, 3, 1, True),
        (256, 64, 8, 3, 1, True), (256, 128, 8, 2, 1, True),
        # two query sub-tiles per program sharing each K/V tile (ping-pong in software)
        (128, 64, 4, 3, 2, True), (128, 128, 8, 2, 2, True), (256, 64, 8, 3, 2, True), (256, 128, 8, 2, 2, True),
        # K/V loads not software-pipelined
        (128, 64, 4, 1, 1, False), (128, 128, 8, 1, 1, False),
    ]
]


def default_config(rope: bool) -> AttnConfig:
    if interpreting():
        return INTERPRET_CONFIG
    return CONFIGS["rope" if rope else "plain"]


# ------------------------------------------------------------------------------------------------ reference

def encoder_attention_ref(qkv, cos=None, sin=None, positions=None, sm_scale=None, out=None, config=None,
                          rope_in_kernel=True):
    """Plain-PyTorch reference, same interface (``config`` and ``rope_in_kernel`` ignored; qkv is not modified):
    ``rope.rope_ref`` on q and k, then fp32 softmax attention, output rounded once to qkv's dtype."""
    from .rope import rope_ref

    W, T, _, H, D = qkv.shape
    q, k, v = qkv.unbind(2)
    if cos is not None:
        if positions is None:
            positions = torch.arange(T, device=qkv.device).expand(W, T)
        elif positions.dim() == 1:
            positions = positions[None].expand(W, T)
        q, k = rope_ref(q, k, positions, cos, sin)
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
def _rne(x, ROUND: tl.constexpr):
    """fp32 -> the nearest-even bf16 value, kept in fp32 (integer ops: never contracted into an FMA); identity
    for fp32 I/O. Finite inputs (overflow correctly becomes inf)."""
    if ROUND:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x


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
def _load_tile(base, tok, st, rmask, w, POS, sp_w, sp_t, COS, SIN, cs,
               MASK_R: tl.constexpr, ROPE: tl.constexpr, HAS_POS: tl.constexpr, ROUND: tl.constexpr,
               UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
               HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr):
    """Rows ``tok`` of one head's q or k slab (row stride st), returned as the three dot operands
    (x1', x2', x_pass) with RoPE applied (ROPE), or (x, x, x) for the whole head (not ROPE)."""
    rowp = base + tok[:, None].to(tl.int64) * st
    if ROPE:
        dh = tl.arange(0, HALF_P)
        hmask = dh < HALF
        x1 = _ld(rowp + dh[None, :], rmask, hmask, MASK_R, HALF_P != HALF)
        x2 = _ld(rowp + HALF + dh[None, :], rmask, hmask, MASK_R, HALF_P != HALF)
        dt = x1.dtype
        if HAS_POS:
            pos = tl.load(POS + w.to(tl.int64) * sp_w + tok.to(tl.int64) * sp_t, mask=rmask, other=-1).to(tl.int64)
            valid = pos >= 0
            pc = tl.where(valid, pos, 0)
            c = _ld(COS + pc[:, None] * cs + dh[None, :], valid, hmask, True, HALF_P != HALF)
            s = _ld(SIN + pc[:, None] * cs + dh[None, :], valid, hmask, True, HALF_P != HALF)
            c = tl.where(valid[:, None], c, 1.0)  # padding token: c = 1, s = 0 is an exact identity
        else:
            pc = tok.to(tl.int64)
            if MASK_R:
                pc = tl.where(rmask, pc, 0)
            c = _ld(COS + pc[:, None] * cs + dh[None, :], rmask, hmask, False, HALF_P != HALF)
            s = _ld(SIN + pc[:, None] * cs + dh[None, :], rmask, hmask, False, HALF_P != HALF)
        c = _rne(c, ROUND)
        s = _rne(s, ROUND)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        # kernels/rope.py's roundings: round(round(x1*c) + round(-x2*s)), round(round(x2*c) + round(x1*s))
        o1 = _rne(_rne(x1f * c, ROUND) - _rne(x2f * s, ROUND), ROUND)
        o2 = _rne(_rne(x2f * c, ROUND) + _rne(x1f * s, ROUND), ROUND)
        if UPCAST:
            o1 = o1.to(dt).to(tl.float32)
            o2 = o2.to(dt).to(tl.float32)
        else:
            o1 = o1.to(dt)
            o2 = o2.to(dt)
        if PASS > 0:
            dp = tl.arange(0, PASS_P)
            xp = _ld(rowp + 2 * HALF + dp[None, :], rmask, dp < PASS, MASK_R, PASS_P != PASS)
            if UPCAST:
                xp = xp.to(tl.float32)
        else:
            xp = o1  # unused
    else:
        dd = tl.arange(0, BLOCK_D)
        xp = _ld(rowp + dd[None, :], rmask, dd < D, MASK_R, BLOCK_D != D)
        if UPCAST:
            xp = xp.to(tl.float32)
        o1 = xp  # unused
        o2 = xp
    return o1, o2, xp


@triton.jit
def _step(q1, q2, qp, k1, k2, kp, v, kmask, m_i, l_i, acc, qk_scale,
          ROPE: tl.constexpr, PASS: tl.constexpr, MASK_K: tl.constexpr, DOT_PREC: tl.constexpr,
          PV_DTYPE: tl.constexpr):
    """One K/V tile for one query (sub-)tile: scores, online-softmax update of (m_i, l_i, acc)."""
    if ROPE:
        qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PREC)
        if PASS > 0:
            qk = tl.dot(qp, tl.trans(kp), qk, input_precision=DOT_PREC)
    else:
        qk = tl.dot(qp, tl.trans(kp), input_precision=DOT_PREC)
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
def _enc_attn_kernel(QKV, O, COS, SIN, POS, qk_scale,
                     s_w, s_t, s_c, s_h, so_w, so_t, so_h, sp_w, sp_t, cs,
                     T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
                     ROPE: tl.constexpr, HAS_POS: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILES: tl.constexpr,
                     LOOP_STAGES: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    w = tl.program_id(2)
    base = QKV + w.to(tl.int64) * s_w + h.to(tl.int64) * s_h
    kbase = base + s_c
    vbase = base + 2 * s_c
    SUB: tl.constexpr = BLOCK_M // SUBTILES
    MASK_Q: tl.constexpr = T % BLOCK_M != 0
    N_FULL: tl.constexpr = (T // BLOCK_N) * BLOCK_N

    rows0 = mb * BLOCK_M + tl.arange(0, SUB)
    q1a, q2a, qpa = _load_tile(base, rows0, s_t, rows0 < T, w, POS, sp_w, sp_t, COS, SIN, cs, MASK_Q, ROPE,
                               HAS_POS, ROUND, UPCAST, D, BLOCK_D, HALF, HALF_P, PASS, PASS_P)
    m_a = tl.full([SUB], float("-inf"), tl.float32)
    l_a = tl.zeros([SUB], tl.float32)
    acc_a = tl.zeros([SUB, BLOCK_D], tl.float32)
    if SUBTILES == 2:
        rows1 = rows0 + SUB
        q1b, q2b, qpb = _load_tile(base, rows1, s_t, rows1 < T, w, POS, sp_w, sp_t, COS, SIN, cs, MASK_Q, ROPE,
                                   HAS_POS, ROUND, UPCAST, D, BLOCK_D, HALF, HALF_P, PASS, PASS_P)
        m_b = tl.full([SUB], float("-inf"), tl.float32)
        l_b = tl.zeros([SUB], tl.float32)
        acc_b = tl.zeros([SUB, BLOCK_D], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    for n0 in tl.range(0, N_FULL, BLOCK_N, num_stages=LOOP_STAGES):
        tok = n0 + offs_n
        kmask = tok < T  # all true here (full tiles); masks are compiled out below
        k1, k2, kp = _load_tile(kbase, tok, s_t, kmask, w, POS, sp_w, sp_t, COS, SIN, cs, False, ROPE, HAS_POS,
                                ROUND, UPCAST, D, BLOCK_D, HALF, HALF_P, PASS, PASS_P)
        v = _ld(vbase + tok[:, None].to(tl.int64) * s_t + dd[None, :], kmask, dd < D, False, BLOCK_D != D)
        if UPCAST:
            v = v.to(tl.float32)
        m_a, l_a, acc_a = _step(q1a, q2a, qpa, k1, k2, kp, v, kmask, m_a, l_a, acc_a, qk_scale, ROPE, PASS, False,
                                DOT_PREC, PV_DTYPE)
        if SUBTILES == 2:
            m_b, l_b, acc_b = _step(q1b, q2b, qpb, k1, k2, kp, v, kmask, m_b, l_b, acc_b, qk_scale, ROPE, PASS,
                                    False, DOT_PREC, PV_DTYPE)
    if N_FULL < T:  # the key tail: one masked tile
        tok = N_FULL + offs_n
        kmask = tok < T
        k1, k2, kp = _load_tile(kbase, tok, s_t, kmask, w, POS, sp_w, sp_t, COS, SIN, cs, True, ROPE, HAS_POS,
                                ROUND, UPCAST, D, BLOCK_D, HALF, HALF_P, PASS, PASS_P)
        v = _ld(vbase + tok[:, None].to(tl.int64) * s_t + dd[None, :], kmask, dd < D, True, BLOCK_D != D)
        if UPCAST:
            v = v.to(tl.float32)
        m_a, l_a, acc_a = _step(q1a, q2a, qpa, k1, k2, kp, v, kmask, m_a, l_a, acc_a, qk_scale, ROPE, PASS, True,
                                DOT_PREC, PV_DTYPE)
        if SUBTILES == 2:
            m_b, l_b, acc_b = _step(q1b, q2b, qpb, k1, k2, kp, v, kmask, m_b, l_b, acc_b, qk_scale, ROPE, PASS,
                                    True, DOT_PREC, PV_DTYPE)

    _store_out(O, acc_a, l_a, rows0, w, h, so_w, so_t, so_h, T, D, BLOCK_D, MASK_Q)
    if SUBTILES == 2:
        _store_out(O, acc_b, l_b, rows1, w, h, so_w, so_t, so_h, T, D, BLOCK_D, MASK_Q)


# ------------------------------------------------------------------------------------------------ launcher

_DTYPES = (torch.bfloat16, torch.float32)


def _check(qkv, cos, sin, positions, out, config):
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (W, T, 3, H, D), got shape {tuple(getattr(qkv, 'shape', ()))}")
    W, T, _, H, D = qkv.shape
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv dtype must be bfloat16 or float32, got {qkv.dtype}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv must have unit stride in D (the last dim), got strides {tuple(qkv.stride())}")
    if D != next_pow2(D):
        raise ValueError(f"qkv head_dim D = {D} (shape {tuple(qkv.shape)}) must be a power of two")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must be given together (or neither)")
    if positions is not None and cos is None:
        raise ValueError("positions given without cos/sin: positions only select RoPE table rows")
    if cos is not None:
        if cos.dim() != 2 or sin.shape != cos.shape:
            raise ValueError(f"cos/sin must be (max_pos, R/2) tables of one shape, got cos {tuple(cos.shape)}, "
                             f"sin {tuple(sin.shape)}")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"cos/sin must be float32 (rope.build_rope_cache), got {cos.dtype}, {sin.dtype}")
        half = cos.shape[1]
        if half < 1 or 2 * half > D:
            raise ValueError(f"rotary dim R = 2 * cos.shape[1] = {2 * half} must be in [2, D = {D}] "
                             f"(cos shape {tuple(cos.shape)}, qkv shape {tuple(qkv.shape)})")
        if half != next_pow2(half):
            raise ValueError(f"rotary dim R = 2 * cos.shape[1] = {2 * half}: R/2 must be a power of two")
        if positions is None:
            if T > cos.shape[0]:
                raise ValueError(f"T = {T} positions (arange(T) per window) but the RoPE table cos has only "
                                 f"{cos.shape[0]} rows (shape {tuple(cos.shape)})")
        else:
            if positions.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
            if tuple(positions.shape) not in ((W, T), (T,)):
                raise ValueError(f"positions must be (W, T) = {(W, T)} or (T,) = {(T,)}, got "
                                 f"{tuple(positions.shape)}")
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
        if bad or config.subtiles not in (1, 2) or config.block_m // config.subtiles < 16:
            raise ValueError(f"config {config}: block_m, block_n must be powers of two >= 16, subtiles 1 or 2 "
                             f"with block_m / subtiles >= 16")


def encoder_attention(qkv, cos=None, sin=None, positions=None, sm_scale=None, out=None, config=None,
                      rope_in_kernel=True):
    """See the module docstring. Returns ``out`` (W, T, H, D) in qkv's dtype (view it as (W, T, H*D))."""
    _check(qkv, cos, sin, positions, out, config)
    check_device(qkv, cos, sin, positions, out)
    W, T, _, H, D = qkv.shape
    if out is None:
        out = torch.empty((W, T, H, D), device=qkv.device, dtype=qkv.dtype)
    if W == 0 or T == 0 or H == 0:
        return out
    rope = cos is not None
    if rope and not rope_in_kernel:
        from .rope import rope_
        pos = positions
        if pos is None:
            pos = torch.arange(T, device=qkv.device).expand(W, T)
        elif pos.dim() == 1:
            pos = pos[None].expand(W, T)
        rope_(qkv[:, :, 0], qkv[:, :, 1], pos, cos, sin)
        rope = False
    cfg = config or default_config(rope)
    interp = interpreting()
    half = cos.shape[1] if rope else 0
    pass_ = D - 2 * half
    has_pos = rope and positions is not None
    if has_pos and positions.dim() == 1:
        sp_w, sp_t = 0, positions.stride(0)
    elif has_pos:
        sp_w, sp_t = positions.stride(0), positions.stride(1)
    else:
        sp_w, sp_t = 0, 0
    if rope and (cos.stride(1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    fp32 = qkv.dtype == torch.float32
    s = qkv.stride()
    dummy = qkv  # stands in for the pointers a mode does not read
    grid = (cdiv(T, cfg.block_m), H, W)
    _enc_attn_kernel[grid](
        qkv, out, cos if rope else dummy, sin if rope else dummy, positions if has_pos else dummy,
        scale * _LOG2E, s[0], s[1], s[2], s[3], out.stride(0), out.stride(1), out.stride(2), sp_w, sp_t,
        cos.stride(0) if rope else 0,
        T=T, D=D, BLOCK_D=max(16, D), HALF=half, HALF_P=max(16, next_pow2(max(half, 1))), PASS=pass_,
        PASS_P=max(16, next_pow2(max(pass_, 1))), ROPE=rope, HAS_POS=has_pos, ROUND=qkv.dtype == torch.bfloat16,
        UPCAST=interp, DOT_PREC="ieee" if fp32 else "tf32", PV_DTYPE=tl.float32 if fp32 else tl.bfloat16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUBTILES=cfg.subtiles,
        LOOP_STAGES=(cfg.num_stages if cfg.pipelined else 1) if not interp else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def flops(W: int, T: int, H: int, D: int) -> float:
    """Attention FLOPs of one call (QK^T and PV, 2 flops per multiply-add): 4 * T * T * D * H * W."""
    return 4.0 * T * T * D * H * W

