"""Append new keys/values to a preallocated KV cache (one launch for k and v).

KV cache layout (per decoder layer; the engine's ``KVCache.k[layer]`` / ``.v[layer]`` are exactly this):

    k_cache, v_cache: (max_batch, n_kv_heads, max_len, head_dim), unit stride in head_dim (contiguous bf16
    in the engine). Sequence b's token at position p lives in slot p of cache row ``cache_rows[b]`` (default
    row b). Each (row, kv head) is one contiguous [max_len, head_dim] slab, which is what decode attention
    streams.

For each token (b, t) with p = positions[b, t] >= 0:  k_cache[row, :, p, :] = k[b, t];  v_cache[...] = v[b, t].
Tokens with p < 0 (padding) are skipped.

Shapes: k, v (B, T, Hk, D), any strides for B, T, H (views into a fused QKV output work), unit stride in D;
positions (B, T) int32/int64 ((B,) accepted when T == 1); cache_rows (B,) int or None. Same dtype for k and cache.
No host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, next_pow2

__all__ = ["kv_append", "kv_append_ref"]


def kv_append_ref(k, v, positions, k_cache, v_cache, cache_rows=None):
    if positions.dim() == 1:
        positions = positions[:, None]
    B, T = positions.shape
    rows = torch.arange(B, device=k.device) if cache_rows is None else cache_rows.long()
    rows = rows[:, None].expand(B, T) if rows.dim() == 1 else rows  # per sequence (B,) or per token (B, T)
    pos = positions.long()
    valid = pos >= 0
    r, p = rows[valid], pos[valid]
    # (row, pos) pairs -> (n, Hk, D)
    k_cache[r, :, p] = k[valid]
    v_cache[r, :, p] = v[valid]


@triton.jit
def _kv_append_kernel(K, V, KC, VC, P, ROWS, NROWS, H, T,
                      skb, skt, skh, svb, svt, svh, spb, spt,
                      skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                      D: tl.constexpr, D_P2: tl.constexpr, BLOCK_R: tl.constexpr, HAS_ROWS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = (r % H).to(tl.int64)
    tok = r // H
    t = (tok % T).to(tl.int64)
    b = (tok // T).to(tl.int64)
    pos = tl.load(P + b * spb + t * spt, mask=r < NROWS, other=-1).to(tl.int64)
    rmask = (r < NROWS) & (pos >= 0)
    pc = tl.where(rmask, pos, 0)
    if HAS_ROWS:
        crow = tl.load(ROWS + b, mask=rmask, other=0).to(tl.int64)
    else:
        crow = b
    d = tl.arange(0, D_P2)
    m = rmask[:, None] & (d < D)[None, :]
    kv = tl.load(K + (b * skb + t * skt + h * skh)[:, None] + d[None, :], mask=m, other=0.0)
    vv = tl.load(V + (b * svb + t * svt + h * svh)[:, None] + d[None, :], mask=m, other=0.0)
    tl.store(KC + (crow * skc_b + h * skc_h + pc * skc_n)[:, None] + d[None, :], kv, mask=m)
    tl.store(VC + (crow * svc_b + h * svc_h + pc * svc_n)[:, None] + d[None, :], vv, mask=m)


def kv_append(k, v, positions, k_cache, v_cache, cache_rows=None):
    """Write k, v (B, T, Hk, D) into k_cache/v_cache (max_batch, Hk, max_len, D) at slots ``positions``."""
    check_device(k, v, positions, k_cache, v_cache, cache_rows)
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError("k and v must both be (B, T, Hk, D)")
    B, T, H, D = k.shape
    if positions.dim() == 1:
        positions = positions[:, None]
    if tuple(positions.shape) != (B, T):
        raise ValueError(f"positions must be (B, T) = {(B, T)}")
    for c in (k_cache, v_cache):
        if c.dim() != 4 or c.shape[1] != H or c.shape[3] != D or c.stride(-1) != 1 or c.dtype != k.dtype:
            raise ValueError("caches must be (max_batch, Hk, max_len, D), unit stride in D, k's dtype")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need unit stride in the last dim")
    n = B * T * H
    if n == 0:
        return
    d_p2 = next_pow2(D)
    block_r = max(1, min(64, 4096 // d_p2))
    kcs, vcs = k_cache.stride(), v_cache.stride()
    _kv_append_kernel[(cdiv(n, block_r),)](
        k, v, k_cache, v_cache, positions, cache_rows if cache_rows is not None else positions, n, H, T,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        positions.stride(0), positions.stride(1), kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
        D=D, D_P2=d_p2, BLOCK_R=block_r, HAS_ROWS=cache_rows is not None, num_warps=4)
