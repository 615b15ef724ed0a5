"""Fused rotary position embedding (RoPE), half-split (``rotate_half``) layout, q and k in ONE launch, in place.

For each token (b, t) with position p = positions[b, t] and each head of q and of k, on the first R dims of
the head (R = rotary_dim = 2 * cos.shape[1]; dims [R, D) are left untouched):

    x1 = x[:R/2], x2 = x[R/2:R];  c = cos[p].to(dtype), s = sin[p].to(dtype)     (cos/sin of freqs, fp32 table)
    x[:R/2]  <- x1*c - x2*s        x[R/2:R] <- x2*c + x1*s

Each product and the sum are rounded to the I/O dtype exactly like HF's ``q*cos + rotate_half(q)*sin`` in that
dtype (cos/sin cast to q's dtype first), so the result is bit-identical to the eager HF path in bf16 and fp32.
Tokens with a negative position are padding and are left untouched.

Shapes: q (B, T, Hq, D), k (B, T, Hk, D); any strides for the B, T, H dims (e.g. views into a fused QKV
projection output (B, T, (Hq+2Hk)*D)); unit stride in the last dim. positions (B, T) int32/int64 (any strides;
(B,) accepted when T == 1). cos_cache/sin_cache (max_pos, R/2) fp32 from ``build_rope_cache``.
Decoder: D = R = 128, theta 1e4. Encoder: D = 64, R = 32 (partial), theta 1e4.

``rope_and_append`` additionally writes the rotated k and the v of each token to slot p of its row of a KV
cache (see kv_append.py for the layout), in the same single launch (q rotated in place; k written back in place
too unless ``write_k=False``). Launched with PDL on sm_90+ (``_triton_utils.pdl_launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, interpreting, next_pow2, pdl_begin, pdl_launch, pdl_wait

__all__ = ["build_rope_cache", "rope_", "rope_ref", "rope_and_append", "rope_and_append_ref"]


def build_rope_cache(rotary_dim: int, max_positions: int, theta: float = 10000.0, device=None,
                     inv_freq_device="cpu"):
    """fp32 (cos, sin), each (max_positions, rotary_dim // 2), following HF's default rope:

    inv_freq = 1 / theta ** (arange(0, dim, 2, int64).float() / dim)   (computed on ``inv_freq_device``; HF
    builds it when the module is created, normally on CPU), freqs = pos.float() * inv_freq (exact fp32 product,
    as HF's K=1 matmul), cos/sin evaluated in fp32 on ``device`` (where HF evaluates them at run time).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=inv_freq_device)
                                .float() / rotary_dim))
    inv_freq = inv_freq.to(device)
    pos = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def _apply_ref(x, cos, sin, rdim):
    xr, xp = x[..., :rdim], x[..., rdim:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


def rope_ref(q, k, positions, cos_cache, sin_cache):
    """Out-of-place reference (HF ``apply_rotary_pos_emb`` with partial-rotary pass-through). Returns (q', k')."""
    rdim = 2 * cos_cache.shape[1]
    if positions.dim() == 1:
        positions = positions[:, None]
    pos = positions.long()
    valid = (pos >= 0)[..., None, None]
    pc = pos.clamp_min(0)
    cos = torch.cat((cos_cache[pc], cos_cache[pc]), dim=-1)[:, :, None, :].to(q.dtype)
    sin = torch.cat((sin_cache[pc], sin_cache[pc]), dim=-1)[:, :, None, :].to(q.dtype)
    qo = torch.where(valid, _apply_ref(q, cos, sin, rdim), q)
    ko = torch.where(valid, _apply_ref(k, cos, sin, rdim), k)
    return qo, ko


def rope_and_append_ref(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, cache_rows=None):
    """Reference of ``rope_and_append``: returns (q', k') and updates k_cache/v_cache in place."""
    from .kv_append import kv_append_ref
    qo, ko = rope_ref(q, k, positions, cos_cache, sin_cache)
    kv_append_ref(ko, v, positions, k_cache, v_cache, cache_rows)
    return qo, ko


@triton.jit
def _rot_tokens(X, tok0, NTOK, H, T, sb, st, sh, P, spb, spt, COS, SIN, CS,
                KC, VC, V, svb, svt, svh, ROWS, srb, srt, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                H_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, PASS: tl.constexpr,
                PASS_P2: tl.constexpr, BLOCK_T: tl.constexpr, APPEND: tl.constexpr, WRITE_X: tl.constexpr,
                HAS_ROWS: tl.constexpr):
    """BLOCK_T tokens x all H heads x HALF dims: cos/sin loaded once per token, broadcast over heads."""
    tok = tok0 + tl.arange(0, BLOCK_T)
    t = (tok % T).to(tl.int64)
    b = (tok // T).to(tl.int64)
    pos = tl.load(P + b * spb + t * spt, mask=tok < NTOK, other=-1).to(tl.int64)
    tmask = (tok < NTOK) & (pos >= 0)
    pc = tl.where(tmask, pos, 0)
    h = tl.arange(0, H_P2)
    d = tl.arange(0, HALF_P2)
    dmask = d < HALF
    m2 = tmask[:, None] & dmask[None, :]                                  # [BT, HALF]
    m3 = m2[:, None, :] & (h < H)[None, :, None]                          # [BT, H, HALF]
    c = tl.load(COS + pc[:, None] * CS + d[None, :], mask=m2, other=0.0)
    s = tl.load(SIN + pc[:, None] * CS + d[None, :], mask=m2, other=0.0)
    base = X + b * sb + t * st                                            # [BT]
    ptr1 = base[:, None, None] + (h.to(tl.int64) * sh)[None, :, None] + d[None, None, :]
    x1 = tl.load(ptr1, mask=m3, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=m3, other=0.0)
    dt = x1.dtype
    c = c.to(dt).to(tl.float32)[:, None, :]
    s = s.to(dt).to(tl.float32)[:, None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # same roundings as HF in the I/O dtype: round(round(x1*c) + round(-x2*s)), round(round(x2*c) + round(x1*s))
    o1 = ((x1f * c).to(dt).to(tl.float32) + (-(x2f * s)).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)).to(dt)
    if WRITE_X:
        tl.store(ptr1, o1, mask=m3)
        tl.store(ptr1 + HALF, o2, mask=m3)
    if APPEND:
        if HAS_ROWS:
            crow = tl.load(ROWS + b * srb + t * srt, mask=tmask, other=0).to(tl.int64)
        else:
            crow = b
        hk = (h.to(tl.int64) * skc_h)[None, :, None]
        kp = (crow * skc_b + pc * skc_n)[:, None, None] + hk + d[None, None, :]
        tl.store(KC + kp, o1, mask=m3)
        tl.store(KC + kp + HALF, o2, mask=m3)
        vsrc = (b * svb + t * svt)[:, None, None] + (h.to(tl.int64) * svh)[None, :, None] + d[None, None, :]
        vdst = (crow * svc_b + pc * svc_n)[:, None, None] + (h.to(tl.int64) * svc_h)[None, :, None] + d[None, None, :]
        tl.store(VC + vdst, tl.load(V + vsrc, mask=m3, other=0.0), mask=m3)
        tl.store(VC + vdst + HALF, tl.load(V + vsrc + HALF, mask=m3, other=0.0), mask=m3)
        if PASS > 0:
            e = tl.arange(0, PASS_P2)
            m4 = tmask[:, None, None] & (h < H)[None, :, None] & (e < PASS)[None, None, :]
            xsrc = base[:, None, None] + (h.to(tl.int64) * sh)[None, :, None] + 2 * HALF + e[None, None, :]
            kdst = (crow * skc_b + pc * skc_n)[:, None, None] + hk + 2 * HALF + e[None, None, :]
            tl.store(KC + kdst, tl.load(xsrc, mask=m4, other=0.0), mask=m4)
            vsrc2 = (b * svb + t * svt)[:, None, None] + (h.to(tl.int64) * svh)[None, :, None] + 2 * HALF + e[None, None, :]
            vdst2 = (crow * svc_b + pc * svc_n)[:, None, None] + (h.to(tl.int64) * svc_h)[None, :, None] + 2 * HALF + e[None, None, :]
            tl.store(VC + vdst2, tl.load(V + vsrc2, mask=m4, other=0.0), mask=m4)


# Counts that vary per call (rows: a packed prefill's tokens, W x 1500 encoder rows, the decode batch) are not
# specialised on, so a new count never compiles another variant in the middle of a request.
@triton.jit(do_not_specialize=["T", "NTOK", "NQB", "spb", "srb"])
def _rope_kernel(Q, K, P, COS, SIN, CS, T, HQ, HK, NTOK, NQB,
                 sqb, sqt, sqh, skb, skt, skh, spb, spt,
                 KC, VC, V, svb, svt, svh, ROWS, srb, srt, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                 HQ_P2: tl.constexpr, HK_P2: tl.constexpr,
                 HALF: tl.constexpr, HALF_P2: tl.constexpr, PASS: tl.constexpr, PASS_P2: tl.constexpr,
                 BLOCK_TQ: tl.constexpr, BLOCK_TK: tl.constexpr, APPEND: tl.constexpr, WRITE_K: tl.constexpr,
                 HAS_ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pdl_wait(PDL)
    # programs [0, NQB) rotate q (BLOCK_TQ tokens each), the rest rotate k (BLOCK_TK tokens each)
    pid = tl.program_id(0)
    if pid < NQB:
        _rot_tokens(Q, pid * BLOCK_TQ, NTOK, HQ, T, sqb, sqt, sqh, P, spb, spt, COS, SIN, CS,
                    KC, VC, V, svb, svt, svh, ROWS, srb, srt, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                    HQ_P2, HALF, HALF_P2, PASS, PASS_P2, BLOCK_TQ, False, True, HAS_ROWS)
    else:
        _rot_tokens(K, (pid - NQB) * BLOCK_TK, NTOK, HK, T, skb, skt, skh, P, spb, spt, COS, SIN, CS,
                    KC, VC, V, svb, svt, svh, ROWS, srb, srt, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                    HK_P2, HALF, HALF_P2, PASS, PASS_P2, BLOCK_TK, APPEND, WRITE_K, HAS_ROWS)


def _prep(q, k, positions, cos_cache, sin_cache):
    check_device(q, k, positions, cos_cache, sin_cache)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must be (B, T, H, D)")
    B, T, HQ, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError("k must be (B, T, Hk, D) with q's B, T, D")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need unit stride in the last dim (they are rotated in place)")
    if q.dtype != k.dtype:
        raise ValueError("q and k must share a dtype")
    if positions.dim() == 1:
        positions = positions[:, None]
    if tuple(positions.shape) != (B, T):
        raise ValueError(f"positions must be (B, T) = {(B, T)}, got {tuple(positions.shape)}")
    half = cos_cache.shape[1]
    if 2 * half > D or sin_cache.shape != cos_cache.shape:
        raise ValueError("rotary dim 2*cos.shape[1] must be <= head_dim and sin/cos shapes equal")
    if cos_cache.dtype != torch.float32 or cos_cache.stride(1) != 1 or sin_cache.stride() != cos_cache.stride():
        cos_cache = cos_cache.float().contiguous()
        sin_cache = sin_cache.float().contiguous()
    return B, T, HQ, D, positions, half, cos_cache, sin_cache


def _launch(q, k, positions, cos_cache, sin_cache, v=None, k_cache=None, v_cache=None, cache_rows=None,
            write_k=True, tile_elems=None, num_warps=None):
    B, T, HQ, D, positions, half, cos_cache, sin_cache = _prep(q, k, positions, cos_cache, sin_cache)
    HK = k.shape[2]
    ntok = B * T
    if ntok == 0:
        return
    half_p2 = next_pow2(half)
    hq_p2, hk_p2 = next_pow2(HQ), next_pow2(HK)
    # ~tile_elems elements per half-tile: enough bytes in flight per program, few programs for decode
    te = tile_elems or 2048
    btq = max(1, min(64, te // (hq_p2 * half_p2)))
    btk = max(1, min(64, te // (hk_p2 * half_p2)))
    nqb, nkb = cdiv(ntok, btq), cdiv(ntok, btk)
    append = v is not None
    if append:
        vs = v.stride()
        kcs, vcs = k_cache.stride(), v_cache.stride()
        dummy_rows = cache_rows if cache_rows is not None else positions
    else:
        v, k_cache, v_cache, vs, kcs, vcs, dummy_rows = q, q, q, (0, 0, 0, 1), (0, 0, 0, 1), (0, 0, 0, 1), positions
    # cache row per sequence (B,) or per token (B, T) (a packed prefill: many sequences in one row of tokens)
    row_strides = (dummy_rows.stride(0), dummy_rows.stride(1) if dummy_rows.dim() == 2 else 0)
    _rope_kernel[(nqb + nkb,)](
        q, k, positions, cos_cache, sin_cache, cos_cache.stride(0), T, HQ, HK, ntok, nqb,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        positions.stride(0), positions.stride(1),
        k_cache, v_cache, v, vs[0], vs[1], vs[2], dummy_rows, *row_strides,
        kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
        HQ_P2=hq_p2, HK_P2=hk_p2, HALF=half, HALF_P2=half_p2, PASS=D - 2 * half,
        PASS_P2=next_pow2(max(1, D - 2 * half)), BLOCK_TQ=btq, BLOCK_TK=btk, APPEND=append, WRITE_K=write_k,
        HAS_ROWS=cache_rows is not None, num_warps=num_warps or 4, **pdl_launch(q.device),
        # keep every intermediate rounding of HF's bf16 math: with fp fusion on, the compiler contracts the
        # products into FMAs / drops the fp32->bf16->fp32 round trips (measured: 10-20% of bf16 outputs 1 ulp off)
        **({} if interpreting() else dict(enable_fp_fusion=False)))


def rope_(q, k, positions, cos_cache, sin_cache, tile_elems=None, num_warps=None):
    """Rotate q and k in place (one launch). Returns (q, k)."""
    _launch(q, k, positions, cos_cache, sin_cache, tile_elems=tile_elems, num_warps=num_warps)
    return q, k


def rope_and_append(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, cache_rows=None, write_k=True):
    """Rotate q (and k, unless ``write_k=False``) in place and store rotated k and v at slot ``positions[b, t]``
    of row ``cache_rows[b]`` (default b; or ``cache_rows[b, t]`` when it is (B, T): a packed prefill, several
    sequences in one row of tokens) of k_cache/v_cache (max_batch, Hk, max_len, D). One launch.
    v: (B, T, Hk, D), any strides for B, T, H, unit stride in D. Returns (q, k)."""
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError("v must have k's shape and unit stride in the last dim")
    if cache_rows is not None and tuple(cache_rows.shape) not in ((k.shape[0],), tuple(k.shape[:2])):
        raise ValueError(f"cache_rows must be (B,) = ({k.shape[0]},) or (B, T) = {tuple(k.shape[:2])}, "
                         f"got {tuple(cache_rows.shape)}")
    for c in (k_cache, v_cache):
        if c.dim() != 4 or c.shape[1] != k.shape[2] or c.shape[3] != k.shape[3] or c.stride(-1) != 1:
            raise ValueError("caches must be (max_batch, Hk, max_len, D) with unit stride in D")
        if c.dtype != k.dtype:
            raise ValueError("cache dtype must equal k's dtype")
    _launch(q, k, positions, cos_cache, sin_cache, v, k_cache, v_cache, cache_rows, write_k)
    return q, k
