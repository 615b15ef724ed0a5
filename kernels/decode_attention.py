"""Decode attention: one query token per sequence over its KV cache, GQA, fp32 max-stable softmax.

    out[b, h] = softmax_j( q[b, h] . K[row_b, h // G, j] * scale ) @ V[row_b, h // G, j],   j in [0, lengths[b])

with G = Hq // Hk query heads per kv head (16 / 4 = 4 for the decoder), scale = 1/sqrt(D) unless given,
row_b = cache_rows[b] (default b). Scores, softmax and the accumulator are fp32; P is rounded to the KV dtype
for the P@V product (as flash attention does); the output is in q's dtype. A sequence with length 0 gets 0.

Shapes: q (B, Hq, D) any strides for B and H, unit stride in D; k_cache/v_cache (max_batch, Hk, max_len_buf, D)
with unit stride in D (the layout of kv_append.py; any other strides accepted); lengths (B,) int32/int64;
``max_len`` a python int (the cache capacity or a bucket >= every length; lengths are clamped to it): it and B
fix the grid, so a call is CUDA-graph capturable (no host sync, no .item()).

Two launch modes, chosen by ``choose_num_splits(B, Hk, max_len, n_sms)`` unless ``num_splits`` is given:
* single pass (num_splits == 1): grid (B, Hk); each program loads q of its G heads once and streams its
  [length, D] K and V slabs in BLOCK_N tiles (each K/V tile is shared by the G query heads: one tl.dot with
  the G heads padded to 16 rows), online softmax, writes the normalised output.
* split-KV (flash decoding): grid (B, Hk, S); program s covers positions [s*C, (s+1)*C) (C a multiple of
  BLOCK_N, fixed by max_len), writes a partial normalised output and its log-sum-exp (fp32), then a reduction
  kernel (grid (B, Hq)) combines the S partials. Programs past a sequence's length write an empty partial.
  With ``counters`` (caller-owned zeroed int32, ``new_counters``) and at most ``COMBINE_IN_KERNEL_MAX_SPLITS``
  splits there is no second kernel: each program bumps its (sequence, kv head) counter after storing its
  partial, and the one that arrives last combines the S partials of its heads (fixed order: deterministic) and
  resets the counter.
Both kernels launch with PDL on sm_90+ (``_triton_utils.pdl_launch``; they wait before touching anything,
with one exception below).

One-tile programs (``ONE_TILE_PATH`` and a split of exactly BLOCK_N positions: every split at batch 1 up to
MAX_SPLITS * MIN_CHUNK positions) run without the loop, and without ``cache_rows`` they request their K/V tile
before the PDL wait: positions before a sequence's last were written by earlier steps (earlier launches of the
stream, finished before this one started), so only the last position, the one the kernel before appends, is read
again after the wait (past L1, ``.cg``) and put in place of its early copy; positions at or past the length are
zeroed. The result is bit-identical to the loop's with one tile at the same number of warps. With
``lengths_settled`` (lengths written before the kernel ahead started) the lengths are read before the wait too, so
after it only q and the last K/V row are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, interpreting, next_pow2, num_sms, pdl_begin, pdl_launch, pdl_wait

__all__ = ["decode_attention", "decode_attention_ref", "choose_num_splits", "new_counters"]

_LOG2E = 1.4426950408889634


def decode_attention_ref(q, k_cache, v_cache, lengths, max_len=None, cache_rows=None, sm_scale=None):
    """Plain-PyTorch reference (fp32 math, masked softmax). Same interface as ``decode_attention``."""
    B, HQ, D = q.shape
    HK = k_cache.shape[1]
    L = k_cache.shape[2] if max_len is None else max_len
    rows = torch.arange(B, device=q.device) if cache_rows is None else cache_rows.long()
    k = k_cache[rows, :, :L].float().repeat_interleave(HQ // HK, dim=1)  # (B, HQ, L, D)
    v = v_cache[rows, :, :L].float().repeat_interleave(HQ // HK, dim=1)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    valid = torch.arange(L, device=q.device)[None, :] < lengths.long().clamp(max=L)[:, None]  # (B, L)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # length 0 -> all-masked row -> 0 output
    return torch.einsum("bhl,bhld->bhd", p, v).to(q.dtype)


# Fewest positions per split program and most splits (see choose_num_splits). Batch-1 decode step on the H200
# (notes/measurements.md, tenth session), ms at context 64 / 512 / 2048 / 8184: 256 positions 1.128 / 1.252 /
# 1.233 / 1.287, 64 positions 1.123 / 1.120 / 1.183 / 1.308 (66 splits at 8184: the combine grows); at most 32
# splits keeps 8184 at 256 positions per program.
MIN_CHUNK = 64
# The in-kernel combine (``counters=``) for launches of at most this many splits; more go to the combine kernel,
# whose (B, Hq) programs read the partials in parallel where the last split program reads them one after another
# (H200, batch 1, notes/measurements.md, eleventh session: 4 splits -0.034 ms per step, 8-32 splits +0.03 to
# +0.08 ms).
COMBINE_IN_KERNEL_MAX_SPLITS = 4
MAX_SPLITS = 32
# Programs whose split is one BLOCK_N tile skip the loop and (without cache_rows) request that tile before the PDL
# wait (module docstring).
ONE_TILE_PATH = True
# Their warps: 2 measured equal to 4 at context 64 and 8184 (loop programs there) and 0.008 / 0.018 ms per step
# faster at 512 / 2048 (H200, batch 1, notes/measurements.md, eighteenth session); 8 slower everywhere.
ONE_TILE_WARPS = 2


def choose_num_splits(batch: int, n_kv_heads: int, max_len: int, n_sms: int, block_n: int = 64,
                      min_chunk: int | None = None) -> int:
    """Split count for the (batch, kv head) programs. Measured on the H200 (notes/triton_kernels.md):
    one pass is best once batch*Hk >= #SMs (64x4096: 1 split 122.8 us vs 3 splits 130 us); below that, ~2
    programs per SM (8x4096: 8 splits; 1x8192: 32-128 splits all ~8.7 us), each chunk >= min_chunk positions."""
    ctas = batch * n_kv_heads
    if ctas >= n_sms:
        return 1
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    max_splits = max(1, min(MAX_SPLITS, cdiv(max_len, max(min_chunk, block_n))))
    return max(1, min(max_splits, cdiv(2 * n_sms, ctas)))


def new_counters(device, n: int = 4096) -> torch.Tensor:
    """The zeroed int32 counters ``decode_attention(counters=)`` needs for up to n (sequence, kv head) pairs.
    Allocate once, outside any CUDA graph capture; the kernel leaves them zero after each launch."""
    return torch.zeros(n, dtype=torch.int32, device=device)


@triton.jit
def _tile_probs(q, k, nmask, m_i, qk_scale, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """A tile's scores against the running max m_i: (new max, its finite stand-in, exp2 probabilities); masked
    positions get probability 0."""
    if UPCAST:  # CPU interpreter: its tl.dot mishandles bf16 operands, so feed it fp32 copies
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked tile with nothing seen yet
    return m_new, m_safe, tl.math.exp2(qk - m_safe[:, None])


@triton.jit
def _tile_pv(p, v, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """P @ V with P rounded to V's dtype first (as flash attention does)."""
    pv = p.to(v.dtype)
    if UPCAST:
        pv = pv.to(tl.float32)
        v = v.to(tl.float32)
    return tl.dot(pv, v, input_precision=DOT_PREC)


@triton.jit
def _normalised(acc, m_i, l_i):
    """(acc / l_i, log-sum-exp in the log2 domain); an empty row (l_i 0) gives (0, -inf)."""
    nonempty = l_i > 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    return acc * inv_l[:, None], lse


@triton.jit
def _attn_tile(q, kbase, vbase, n, end, skn, svn, offs_d, dmask, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr,
               UPCAST: tl.constexpr):
    """One BLOCK_N tile of K/V: online-softmax update of (m_i, l_i, acc) for the BLOCK_H query rows."""
    nmask = n < end
    k = tl.load(kbase + n[:, None].to(tl.int64) * skn + offs_d[None, :], mask=nmask[:, None] & dmask[None, :],
                other=0.0)
    m_new, m_safe, p = _tile_probs(q, k, nmask, m_i, qk_scale, DOT_PREC, UPCAST)
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vbase + n[:, None].to(tl.int64) * svn + offs_d[None, :], mask=nmask[:, None] & dmask[None, :],
                other=0.0)
    acc = acc * alpha[:, None] + _tile_pv(p, v, DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_split(Q, q_off, hmask, kbase, vbase, skn, svn, raw_length, max_len, start, chunk, qk_scale,
                  BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_STAGES: tl.constexpr, DOT_PREC: tl.constexpr, STATIC_ITERS: tl.constexpr):
    """One program's split [start, start + chunk) of one kv head's context for its BLOCK_H query rows (Q +
    q_off[i], rows past the group masked by ``hmask``): returns the normalised partial output (BLOCK_H, BLOCK_D)
    fp32 and its log-sum-exp (log2 domain, -inf when empty)."""
    length = tl.minimum(raw_length, max_len)
    end = tl.minimum(start + chunk, length)
    # head_dim is padded to BLOCK_D >= 16 (tl.dot needs K >= 16); the padding lanes are masked to zero.
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    hdmask = hmask[:, None] & dmask[None, :]
    q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=hdmask, other=0.0)
    if STATIC_ITERS > 0:
        q = q.to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if STATIC_ITERS > 0:
        # Triton's CPU interpreter (with numpy >= 2.4) cannot run loops with run-time bounds: fixed trip count,
        # masked tiles (fully-masked tiles are no-ops thanks to the guards in _tile_probs).
        for it in range(STATIC_ITERS):
            m_i, l_i, acc = _attn_tile(q, kbase, vbase, start + it * BLOCK_N + offs_n, end, skn, svn, offs_d, dmask,
                                       m_i, l_i, acc, qk_scale, DOT_PREC, STATIC_ITERS > 0)
    else:
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = _attn_tile(q, kbase, vbase, n0 + offs_n, end, skn, svn, offs_d, dmask,
                                       m_i, l_i, acc, qk_scale, DOT_PREC, STATIC_ITERS > 0)
    return _normalised(acc, m_i, l_i)


@triton.jit
def _attend_tile(q, k, v, valid, qk_scale, BLOCK_H: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``_attend_split`` with exactly one tile, its K/V already loaded (rows not ``valid`` zero): the loop's
    operations in the same order, so the same bits. Returns (normalised output, log-sum-exp)."""
    if UPCAST:  # CPU interpreter, as in _attend_split
        q = q.to(tl.float32)
    m, _, p = _tile_probs(q, k, valid, tl.full([BLOCK_H], float("-inf"), tl.float32), qk_scale, DOT_PREC, UPCAST)
    return _normalised(_tile_pv(p, v, DOT_PREC, UPCAST), m, tl.sum(p, axis=1))


@triton.jit
def _combine_last(OP, LSE, O, CNT, cnt_idx, n_splits, prow0, hmask, hdmask, o_ptrs,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr, S_P2: tl.constexpr):
    """The in-kernel combine: the split program that finishes last for its (sequence, kv head) merges the
    S partials of its query heads (rows prow0 + s of OP / LSE) and writes the output. Every program's partials
    were stored before its counter increment (a CTA barrier, then one acq_rel atomic: release of the whole
    CTA's stores, as in a split-K semaphore); the last one, after its acquire, reads them past L1 (.cg) and
    resets the counter for the next launch."""
    tl.debug_barrier()
    done = tl.atomic_add(CNT + cnt_idx, 1, sem="acq_rel", scope="gpu")
    if done == n_splits - 1:
        tl.debug_barrier()
        offs_s = tl.arange(0, S_P2)
        smask = offs_s < n_splits
        lses = tl.load(LSE + prow0[:, None] + offs_s[None, :], mask=hmask[:, None] & smask[None, :],
                       other=float("-inf"), cache_modifier=".cg")
        mx = tl.max(lses, axis=1)
        w = tl.where(lses > float("-inf"), tl.math.exp2(lses - mx[:, None]), 0.0)
        den = tl.sum(w, axis=1)
        offs_d = tl.arange(0, BLOCK_D)
        num = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in tl.static_range(S_P2):
            o_s = tl.load(OP + (prow0 + s)[:, None] * D + offs_d[None, :], mask=hdmask & (s < n_splits), other=0.0,
                          cache_modifier=".cg")
            w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)
            num += o_s * w_s[:, None]
        res = tl.where(den[:, None] > 0.0, num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
        tl.store(o_ptrs, res.to(O.dtype.element_ty), mask=hdmask)
        tl.atomic_xchg(CNT + cnt_idx, 0)


@triton.jit
def _decode_attn_kernel(Q, K, V, LENS, ROWS, O, OP, LSE, CNT, max_len, chunk, n_splits, qk_scale,
                        sqb, sqh, skb, skh, skn, svb, svh, svn, sob, soh,
                        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_ROWS: tl.constexpr, NUM_STAGES: tl.constexpr,
                        DOT_PREC: tl.constexpr, STATIC_ITERS: tl.constexpr, PDL: tl.constexpr,
                        FUSED_COMBINE: tl.constexpr = False, S_P2: tl.constexpr = 1,
                        ONE_TILE: tl.constexpr = False, EARLY_TILE: tl.constexpr = False,
                        EARLY_LENS: tl.constexpr = False):
    pdl_begin(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s_id = tl.program_id(2)
    start = s_id * chunk
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    n = start + tl.arange(0, BLOCK_N)
    if EARLY_TILE:
        # the tile's address is known before the wait: request it now (module docstring)
        kbase = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vbase = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        # past L1 (.cg), as every early read here: no line this SM cached in an earlier launch can be stale
        tmask = (n < max_len)[:, None] & dmask[None, :]
        k_early = tl.load(kbase + n[:, None].to(tl.int64) * skn + offs_d[None, :], mask=tmask, other=0.0,
                          cache_modifier=".cg")
        v_early = tl.load(vbase + n[:, None].to(tl.int64) * svn + offs_d[None, :], mask=tmask, other=0.0,
                          cache_modifier=".cg")
    if EARLY_LENS:  # settled lengths (decode_attention's lengths_settled)
        raw_length = tl.load(LENS + b, cache_modifier=".cg").to(tl.int32)
    pdl_wait(PDL)
    if not EARLY_LENS:
        raw_length = tl.load(LENS + b).to(tl.int32)
    if HAS_ROWS:
        row = tl.load(ROWS + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    kbase = K + row * skb + kvh.to(tl.int64) * skh
    vbase = V + row * svb + kvh.to(tl.int64) * svh
    if ONE_TILE:
        length = tl.minimum(raw_length, max_len)
        valid = n < length
        vmask = valid[:, None] & dmask[None, :]
        q = tl.load(Q + b.to(tl.int64) * sqb + heads.to(tl.int64)[:, None] * sqh + offs_d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        if not EARLY_TILE:
            k = tl.load(kbase + n[:, None].to(tl.int64) * skn + offs_d[None, :], mask=vmask, other=0.0)
            v = tl.load(vbase + n[:, None].to(tl.int64) * svn + offs_d[None, :], mask=vmask, other=0.0)
        else:
            last = length - 1  # appended by the kernel before: read again, past L1
            lmask = dmask & (last >= start) & (last < start + BLOCK_N)
            k_last = tl.load(kbase + last.to(tl.int64) * skn + offs_d, mask=lmask, other=0.0, cache_modifier=".cg")
            v_last = tl.load(vbase + last.to(tl.int64) * svn + offs_d, mask=lmask, other=0.0, cache_modifier=".cg")
            is_last = (n == last)[:, None]
            k = tl.where(vmask, tl.where(is_last, k_last[None, :], k_early), 0.0)
            v = tl.where(vmask, tl.where(is_last, v_last[None, :], v_early), 0.0)
        out, lse = _attend_tile(q, k, v, valid, qk_scale, BLOCK_H, DOT_PREC, STATIC_ITERS > 0)
    else:
        out, lse = _attend_split(Q + b.to(tl.int64) * sqb, heads.to(tl.int64) * sqh, hmask, kbase, vbase, skn, svn,
                                 raw_length, max_len, start, chunk, qk_scale,
                                 BLOCK_H, D, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_PREC, STATIC_ITERS)
    hdmask = hmask[:, None] & (offs_d < D)[None, :]
    o_ptrs = O + b.to(tl.int64) * sob + heads[:, None] * soh + offs_d[None, :]
    if SPLIT:
        # partials: OP (B, HQ, S, D) fp32, LSE (B, HQ, S) fp32 (log2 domain; -inf when empty)
        prow0 = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * n_splits
        prow = prow0 + s_id
        tl.store(OP + prow[:, None] * D + offs_d[None, :], out, mask=hdmask)
        tl.store(LSE + prow, lse, mask=hmask)
        if FUSED_COMBINE:
            _combine_last(OP, LSE, O, CNT, b * tl.num_programs(1) + kvh, n_splits, prow0, hmask, hdmask, o_ptrs,
                          BLOCK_H, BLOCK_D, D, S_P2)
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=hdmask)


@triton.jit
def _combine_kernel(OP, LSE, O, n_splits, sob, soh, HQ,
                    D: tl.constexpr, S_P2: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_P2)
    smask = offs_s < n_splits
    prow = (b.to(tl.int64) * HQ + h) * n_splits
    lse = tl.load(LSE + prow + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - mx), 0.0)
    den = tl.sum(w, axis=0)
    offs_d = tl.arange(0, D)
    o = tl.load(OP + (prow + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], axis=0)
    res = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(O + b.to(tl.int64) * sob + h * soh + offs_d, res.to(O.dtype.element_ty))


def decode_attention(q, k_cache, v_cache, lengths, max_len: int | None = None, cache_rows=None,
                     sm_scale: float | None = None, num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, out=None, counters=None,
                     lengths_settled: bool = False):
    """See the module docstring. Returns ``out`` (B, Hq, D) in q's dtype. ``counters``: an int32 tensor of zeros on
    q's device, owned by the caller and used by one stream at a time (``new_counters``): a launch of 2 to
    ``COMBINE_IN_KERNEL_MAX_SPLITS`` splits then combines in its last program per (sequence, kv head) instead of a
    second kernel (it needs B * Hk counters; splits happen below one program per SM, so the default 4096 cover any
    batch that splits), and leaves the counters zero again. ``lengths_settled``: ``lengths`` holds its values since
    before the kernel ahead of this launch started (written by an ordinary, non-PDL launch or an earlier step), so
    one-tile programs read it before their PDL wait too; leave it False when the kernel just ahead may write it."""
    check_device(q, k_cache, v_cache, lengths, cache_rows)
    B, HQ, D = q.shape
    _, HK, LBUF, DK = k_cache.shape
    if DK != D or v_cache.shape[1:] != k_cache.shape[1:] or HQ % HK:
        raise ValueError("k_cache/v_cache must be (max_batch, Hk, max_len, D) with Hq % Hk == 0")
    if D != next_pow2(D):
        raise ValueError("head_dim must be a power of two")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("unit stride in head_dim required")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache dtypes differ")
    if counters is not None and (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
                                 or counters.device != q.device or not counters.is_contiguous()):
        raise ValueError(f"counters must be a contiguous int32 tensor on {q.device} (decode_attention.new_counters)")
    max_len = LBUF if max_len is None else int(max_len)
    if max_len > LBUF:
        raise ValueError(f"max_len {max_len} > cache capacity {LBUF}")
    group = HQ // HK
    if out is None:
        out = torch.empty((B, HQ, D), device=q.device, dtype=q.dtype)
    if B == 0:
        return out
    interp = interpreting()
    if block_n is None:
        block_n = 16 if interp else 64
    if num_splits is None:
        num_splits = choose_num_splits(B, HK, max_len, num_sms(q.device), block_n)
    chunk = cdiv(cdiv(max(max_len, 1), num_splits), block_n) * block_n
    n_splits = max(1, cdiv(max_len, chunk))
    one_tile = ONE_TILE_PATH and chunk == block_n
    if num_warps is None:
        num_warps = ONE_TILE_WARPS if one_tile else 4
    if num_stages is None:
        num_stages = 1 if interp else 3
    if q.dtype != k_cache.dtype:
        q = q.to(k_cache.dtype)
    dot_prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    qk_scale = (1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)) * _LOG2E
    block_h = max(16, next_pow2(group))
    rows = cache_rows if cache_rows is not None else lengths
    ks, vs = k_cache.stride(), v_cache.stride()
    common = dict(GROUP=group, BLOCK_H=block_h, D=D, BLOCK_D=max(16, D), BLOCK_N=block_n, HAS_ROWS=cache_rows is not None,
                  NUM_STAGES=num_stages, DOT_PREC=dot_prec, num_warps=num_warps,
                  STATIC_ITERS=cdiv(chunk, block_n) if interp else 0, ONE_TILE=one_tile,
                  EARLY_TILE=one_tile and cache_rows is None,
                  EARLY_LENS=one_tile and cache_rows is None and bool(lengths_settled), **pdl_launch(q.device))
    if n_splits == 1:
        _decode_attn_kernel[(B, HK, 1)](
            q, k_cache, v_cache, lengths, rows, out, out, out, lengths, max_len, chunk, 1, qk_scale,
            q.stride(0), q.stride(1), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], out.stride(0), out.stride(1),
            SPLIT=False, **common)
        return out
    op = torch.empty((B, HQ, n_splits, D), device=q.device, dtype=torch.float32)
    lse = torch.empty((B, HQ, n_splits), device=q.device, dtype=torch.float32)
    fused = counters is not None and n_splits <= COMBINE_IN_KERNEL_MAX_SPLITS
    if fused and counters.numel() < B * HK:
        raise ValueError(f"counters must hold at least B * Hk = {B * HK} elements for a split launch, got "
                         f"{counters.numel()} (decode_attention.new_counters)")
    _decode_attn_kernel[(B, HK, n_splits)](
        q, k_cache, v_cache, lengths, rows, out, op, lse, counters if fused else lengths, max_len, chunk, n_splits,
        qk_scale, q.stride(0), q.stride(1), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], out.stride(0), out.stride(1),
        SPLIT=True, FUSED_COMBINE=fused, S_P2=next_pow2(n_splits) if fused else 1, **common)
    if fused:
        return out
    _combine_kernel[(B, HQ)](op, lse, out, n_splits, out.stride(0), out.stride(1), HQ,
                             D=D, S_P2=next_pow2(n_splits), num_warps=4, **pdl_launch(q.device))
    return out
