"""Persistent decode step: every decoder layer of one token (batch 1) in one launch.

Computes what the decode step's kernel chain computes per layer (glmasr/models/fast.py ``decode``), with the
same roundings:

    h    = rms_norm(res, ln1)                       qkv = round(h @ Wqkv^T)
    q, k = rope(q, k) at position len - 1           k, v appended to the KV cache at that slot
    a    = round(attention(q, cache))               res = round(res + round(a @ Wo^T))
    h    = rms_norm(res, ln2)                       act = swiglu(h @ Wgu^T)   (skinny_gemm's roundings)
    res  = round(res + round(act @ Wdown^T))

``persistent_decode(res, weights, ...)`` updates the residual stream ``res`` (1, hidden) in place through all
layers; the caller applies the final norm and the lm head.

Why one launch: at batch 1 the step reads 2.94 GB of weights, and a chain of ~200 kernels pays a ramp and a tail
per kernel (notes/decode_step.md). Here a grid of one program per SM walks the layers' five stages (qkv GEMV,
attention, o GEMV, gate|up GEMV + SwiGLU, down GEMV) with a grid-wide barrier between dependent stages, and
each program issues the loads of its first two weight tiles of the next stage while it waits at the
barrier, so the weight stream does not drain between matrices.

Work split: a GEMV stage's W rows are cut in BN-row blocks dealt round-robin to the G programs; a program
streams its blocks' (BN, BK) tiles (K <= BK for the 2048-wide matrices: one tile per block) two tiles ahead of
the one it multiplies. The input vector is formed per program from L2: the RMSNorm statistics over the whole
residual row (each program redundantly: 4 KB), the attention output by combining the attention programs'
partials (flash-decoding: per split a normalised partial and its log-sum-exp). Attention runs on NK x S
programs (kv head, split of the context); the program whose split holds the new position rotates and appends
the new k, v first. Activations written by one program and read by another in the same launch are loaded with
``.cg`` (L2, not the SM's L1, which another layer's copy of the same buffer may still occupy).

Grid barrier: an arrival counter (one atomic add with release semantics per program), a spin on it with acquire
semantics (Triton runs scalar atomics in one thread and broadcasts), a block barrier on both sides; the next
stage's weight tiles are requested between the arrival and the spin (the release fence would wait for them). Barrier i
waits for i * G arrivals; the last program to leave resets the counters, so the next launch starts at zero. The
spin is bounded (MAX_SPIN polls, ~0.5 s; once one barrier gave up, the later ones do not wait): if programs were not co-resident it gives up, sets the error flag
(``PersistentWorkspace.error()``) and continues with whatever it has; the launch is cooperative where Triton
can launch it so (co-residency guaranteed by the driver).

Interpreter (TRITON_INTERPRET=1, CPU) and ``persistent=False``: the same stage code launched once per (layer,
stage), kernel boundaries standing in for the barriers (the CPU interpreter runs programs one after another, a
spin barrier would never return). On the GPU the two modes run the same arithmetic in the same order, so their
outputs are bit-identical (tests/test_persistent_decode.py).

Shape contract: batch 1; res (1, hidden) contiguous; weights stacked over layers (``PersistentWeights``):
wqkv (L, (Hq + 2 Hk) D, hidden), wo (L, hidden, Hq D), wgu (L, 2 I, hidden) = [gate; up], wdown (L, hidden, I),
ln1 / ln2 (L, hidden), all contiguous, one dtype (bf16 the target; fp16 / fp32 accepted); hidden <= 2048 and
Hq D <= 2048 (one K tile: ``supports``); k_cache / v_cache (L, max_batch, Hk, capacity, D) (KVCache's layout),
unit stride in D; cos / sin (max_pos, R/2) fp32 (rope.build_rope_cache); lengths (1,) int (the new token's
position + 1); cache_rows (1,) int or None (row 0); ``max_len`` a python int >= the length (the graph's KV
bucket). No host synchronisation: CUDA-graph capturable. The workspace (activations, partials, counters) is
the caller's (``PersistentWorkspace``), one per stream that launches: two launches must never share one.

``persistent_decode_ref`` is the plain-PyTorch reference (the reference ops of skinny_gemm, decode_attention).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_device, interpreting, next_pow2, num_sms, pdl_begin, pdl_enabled, pdl_wait
from .decode_attention import _attend_split, decode_attention_rope_append_ref
from .skinny_gemm import _normed, _swiglu_epilogue, skinny_gemm_ref, skinny_gemm_swiglu_ref

__all__ = ["PersistentWeights", "PersistentWorkspace", "PersistentConfig", "persistent_decode",
           "persistent_decode_ref", "supports"]

_LOG2E = 1.4426950408889634
# The widest K a GEMV stage holds its input vector for in registers (one tile): hidden and Hq * D.
MAX_WIDTH = 2048
# Attention splits of the context (flash decoding) at most; the partials' stride, fixed so one variant compiles.
MAX_SPLITS = 8
# Barrier polls before a program gives up (error flag): ~0.5 s at ~0.5 us a poll, far beyond any real wait.
MAX_SPIN = 1 << 20
# Stages per layer (qkv, attention, o, gate|up, down): the barriers of a launch are layers * STAGES.
STAGES = 5
_STAGES = tl.constexpr(STAGES)


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
    """Rows per block of each GEMV stage, the K tile, warps, programs per SM."""
    bn_qkv: int = 8
    bn_o: int = 8
    bn_gate_up: int = 4
    bn_down: int = 8
    block_k: int = 2048
    num_warps: int = 8
    programs_per_sm: int = 1
    # grid barrier: 1 Triton atomics, 2 a PTX poll loop in one thread (acquire loads), 3 the same with relaxed
    # polls and one acquire fence, 0 none (timing probes: wrong results)
    barrier: int = 2
    # register cap per thread (None: the compiler's choice); several programs per SM need it low enough to fit
    maxnreg: int | None = None

    def short(self) -> str:
        return (f"qkv{self.bn_qkv} o{self.bn_o} gu{self.bn_gate_up} d{self.bn_down} BK{self.block_k} "
                f"w{self.num_warps} p{self.programs_per_sm} bar{self.barrier}"
                + (f" r{self.maxnreg}" if self.maxnreg else ""))


@dataclasses.dataclass
class PersistentWeights:
    """The decoder's weights stacked over layers (see the module docstring for the shapes)."""
    wqkv: torch.Tensor
    wo: torch.Tensor
    wgu: torch.Tensor
    wdown: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor

    def tensors(self):
        return (self.wqkv, self.wo, self.wgu, self.wdown, self.ln1, self.ln2)


class PersistentWorkspace:
    """Buffers of one launch stream: qkv (N_qkv,), the attention partials (Hq, MAX_SPLITS, D) fp32 and their
    log-sum-exps, the SwiGLU output (I,), and the barrier / exit counters and the error flag (int32)."""

    def __init__(self, n_qkv: int, n_heads: int, head_dim: int, inter: int, device, dtype: torch.dtype):
        self.qkv = torch.empty(n_qkv, device=device, dtype=dtype)
        self.partial = torch.empty((n_heads, MAX_SPLITS, head_dim), device=device, dtype=torch.float32)
        self.lse = torch.empty((n_heads, MAX_SPLITS), device=device, dtype=torch.float32)
        self.act = torch.empty(inter, device=device, dtype=dtype)
        self.counters = torch.zeros(4, device=device, dtype=torch.int32)  # barrier, exit, error, spare

    def error(self) -> bool:
        """Whether a launch gave up waiting at a barrier (host sync)."""
        return bool(self.counters[2].item())

    def reset(self) -> None:
        """Zero the counters and the flag (after an error)."""
        self.counters.zero_()


def supports(hidden: int, n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """None if the persistent kernel serves this decoder shape, else why not."""
    if hidden > MAX_WIDTH or n_heads * head_dim > MAX_WIDTH:
        return f"hidden {hidden} / heads x head_dim {n_heads * head_dim} above {MAX_WIDTH}"
    if n_heads % n_kv_heads or head_dim != next_pow2(head_dim):
        return "query heads must be a multiple of kv heads and head_dim a power of two"
    return None


# ------------------------------------------------------------------------------------------------ reference

def persistent_decode_ref(res, weights: PersistentWeights, k_cache, v_cache, cos_cache, sin_cache, lengths,
                          workspace=None, cache_rows=None, max_len=None, eps: float = 1e-5,
                          sm_scale: float | None = None, persistent=None, config=None, programs=None,
                          cooperative=True):
    """The layers with the reference ops (fp32 math on the rounded inputs, the chain's roundings); updates
    ``res`` and the caches in place and returns ``res``. ``persistent_decode``'s interface: the workspace and the
    launch options are accepted and not used."""
    n_heads = weights.wo.shape[2] // k_cache.shape[-1]
    n_kv, d = k_cache.shape[2], k_cache.shape[-1]
    x = res
    for layer in range(weights.wqkv.shape[0]):
        qkv = skinny_gemm_ref(x, weights.wqkv[layer], norm_weight=weights.ln1[layer], eps=eps)
        q = qkv[:, : n_heads * d].view(1, n_heads, d)
        k = qkv[:, n_heads * d:(n_heads + n_kv) * d].view(1, n_kv, d)
        v = qkv[:, (n_heads + n_kv) * d:].view(1, n_kv, d)
        attn = decode_attention_rope_append_ref(q, k, v, cos_cache, sin_cache, k_cache[layer], v_cache[layer],
                                                lengths, max_len, cache_rows, sm_scale)
        x = skinny_gemm_ref(attn.reshape(1, n_heads * d), weights.wo[layer], residual=x)
        act = skinny_gemm_swiglu_ref(x, weights.wgu[layer], norm_weight=weights.ln2[layer], eps=eps)
        x = skinny_gemm_ref(act, weights.wdown[layer], residual=x)
    res.copy_(x)
    return res


# ------------------------------------------------------------------------------------------------ kernel

@triton.jit
def _arrive(CNT, BARRIER: tl.constexpr):
    """This program's arrival at the grid barrier (CNT[0]), after every warp's writes of the stage."""
    if BARRIER > 0:
        tl.debug_barrier()
        tl.atomic_add(CNT, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for(CNT, target, MAXSPIN: tl.constexpr, BARRIER: tl.constexpr):
    """Wait until CNT[0] >= ``target`` arrivals; on giving up, CNT[2] = 1 (error flag). The release fence of
    ``_arrive`` waits for the arriving thread's outstanding loads, so the next stage's weight tiles are issued
    between the two calls, not before the arrival. BARRIER 1: Triton atomics (one thread polls, the value is
    broadcast through shared memory each poll); 2: thread 0 polls in a PTX loop, one block barrier after; 0: no
    barrier at all (timing probes only: the result is wrong)."""
    if BARRIER == 1:
        cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        # once a barrier of this launch gave up, the later ones do not wait either (the output is void anyway)
        n = tl.where(tl.atomic_add(CNT + 2, 0, sem="relaxed", scope="gpu") != 0, MAXSPIN, 0)
        while (cur < target) & (n < MAXSPIN):
            cur = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
            n += 1
        if cur < target:
            tl.atomic_xchg(CNT + 2, 1)
        tl.debug_barrier()
    elif BARRIER >= 2:
        # 2: every poll an acquire load; 3: relaxed polls, one acquire fence once the count is reached
        if BARRIER == 2:
            poll: tl.constexpr = "ld.acquire.gpu.global.b32"
            after: tl.constexpr = ""
        else:
            poll: tl.constexpr = "ld.relaxed.gpu.global.b32"
            after: tl.constexpr = "fence.acq_rel.gpu; "
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 v, t, n; .reg .b64 e; mov.u32 t, %tid.x; mov.u32 $0, 0; "
            "setp.ne.u32 q, t, 0; @q bra DONE${:uid}; add.u64 e, $1, 8; ld.relaxed.gpu.global.b32 n, [e]; "
            "setp.ne.u32 q, n, 0; mov.u32 n, 0; @q bra DONE${:uid}; "
            "LOOP${:uid}: " + poll + " v, [$1]; add.u32 n, n, 1; setp.lt.s32 p, v, $2; "
            "setp.lt.and.u32 p, n, $3, p; @p bra LOOP${:uid}; " + after +
            "setp.lt.s32 p, v, $2; @p st.relaxed.gpu.global.b32 [e], 1; "
            "DONE${:uid}: }",
            "=r,l,r,r", [CNT, target, MAXSPIN], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()


@triton.jit
def _w_tile(W, t, pid, valid, N: tl.constexpr, K: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr):
    """Tile t of this program's stream of a GEMV stage: block pid + (t // KT) * G, K tile t % KT; rows past N
    (and everything when not ``valid``) masked. For SwiGLU also the matching up rows (+HALF)."""
    KT: tl.constexpr = (K + BK - 1) // BK
    u = t // KT
    offs_k = (t - u * KT) * BK + tl.arange(0, BK)
    rows = (pid + u * G) * BN + tl.arange(0, BN)
    rmask = (rows < N) & valid
    if K % BK == 0:
        mask = rmask[:, None]
    else:
        mask = rmask[:, None] & (offs_k < K)[None, :]
    ptrs = W + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    w2 = w
    if SWIGLU:
        w2 = tl.load(ptrs + HALF * K, mask=mask, other=0.0, eviction_policy="evict_first")
    return w, w2


@triton.jit
def _gemv(W, pid, wa, wa2, wb, wb2, x_reg, X, Y, R,
          N: tl.constexpr, K: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, SWIGLU: tl.constexpr, RESID: tl.constexpr, X_REG: tl.constexpr):
    """y = x @ W^T over this program's blocks (tiles 0 and 1 given: ``wa``, ``wb``), epilogue SwiGLU or
    round(R + round(y)); x in registers (``X_REG``, K <= BK) or loaded per K tile from X."""
    KT: tl.constexpr = (K + BK - 1) // BK
    UNITS: tl.constexpr = ((N + BN - 1) // BN + G - 1) // G
    offs_n = tl.arange(0, BN)
    acc = tl.zeros((BN,), dtype=tl.float32)
    acc2 = tl.zeros((BN,), dtype=tl.float32)
    for t in range(UNITS * KT):
        wc, wc2 = _w_tile(W, t + 2, pid, True, N, K, HALF, G, BN, BK, SWIGLU)
        kt = t % KT
        if X_REG:
            x = x_reg.to(tl.float32)
        else:
            offs_k = kt * BK + tl.arange(0, BK)
            x = tl.load(X + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(wa.to(tl.float32) * x[None, :], axis=1)
        if SWIGLU:
            acc2 += tl.sum(wa2.to(tl.float32) * x[None, :], axis=1)
        if kt == KT - 1:
            rows = (pid + (t // KT) * G) * BN + offs_n
            mask = rows < N
            if SWIGLU:
                y = _swiglu_epilogue(acc, acc2, Y)
            else:
                y = acc
            if RESID:
                dt = Y.dtype.element_ty
                r = tl.load(R + rows, mask=mask, other=0.0, cache_modifier=".cg")
                y = r.to(tl.float32) + y.to(dt).to(tl.float32)
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=mask)
            acc = tl.zeros((BN,), dtype=tl.float32)
            acc2 = tl.zeros((BN,), dtype=tl.float32)
        wa, wa2, wb, wb2 = wb, wb2, wc, wc2


@triton.jit
def _normed_row(RES, LN, eps, HID: tl.constexpr, BK: tl.constexpr):
    """rms_norm(res, ln) as a (BK,) vector (kernels/rmsnorm.py's roundings); res read from L2."""
    offs = tl.arange(0, BK)
    m = offs < HID
    x = tl.load(RES + offs, mask=m, other=0.0, cache_modifier=".cg")
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / HID + eps)
    g = tl.load(LN + offs, mask=m, other=0.0)
    return _normed(x, rstd, g, True)


@triton.jit
def _combined_heads(OP, LSE, n_splits, NQ: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                    S_P2: tl.constexpr, dt: tl.constexpr):
    """The attention output (Hq * D,) from the splits' partials, as decode_attention's combine computes it
    (max-shifted exp2 weights of the log-sum-exps); one split at a time, so only (BK,) vectors are live."""
    offs = tl.arange(0, BK)
    hh = offs // D
    dd = offs - hh * D
    kmask = offs < NQ * D
    mx = tl.full((BK,), float("-inf"), tl.float32)
    for s in tl.static_range(S_P2):
        m = kmask & (s < n_splits)
        mx = tl.maximum(mx, tl.load(LSE + hh * S_P2 + s, mask=m, other=float("-inf"), cache_modifier=".cg"))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros((BK,), tl.float32)
    num = tl.zeros((BK,), tl.float32)
    for s in tl.static_range(S_P2):
        m = kmask & (s < n_splits)
        lse = tl.load(LSE + hh * S_P2 + s, mask=m, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - mx), 0.0)
        o = tl.load(OP + (hh * S_P2 + s) * D + dd, mask=m, other=0.0, cache_modifier=".cg")
        den += w
        num += o * w
    return tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0).to(dt)


@triton.jit
def _attention_stage(layer, pid, QKV, KC, VC, COS, SIN, LENS, ROWS, OP, LSE, max_len, chunk, n_splits, qk_scale,
                     scs, skl, skb, skh, skn, svl, svb, svh, svn,
                     NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, S_P2: tl.constexpr, HAS_ROWS: tl.constexpr,
                     STATIC_ITERS: tl.constexpr, DOT_PREC: tl.constexpr):
    """Programs 0 .. NK * n_splits - 1: (kv head, context split) of decode attention with RoPE + the append."""
    GROUP: tl.constexpr = NQ // NK
    BLOCK_D: tl.constexpr = D if D > 16 else 16
    if pid < NK * n_splits:
        g = pid // n_splits
        s_id = pid - g * n_splits
        raw_length = tl.load(LENS).to(tl.int32)
        if HAS_ROWS:
            row = tl.load(ROWS).to(tl.int64)
        else:
            row = 0
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < GROUP
        heads = g * GROUP + offs_h
        kbase = KC + layer.to(tl.int64) * skl + row * skb + g.to(tl.int64) * skh
        vbase = VC + layer.to(tl.int64) * svl + row * svb + g.to(tl.int64) * svh
        out, lse = _attend_split(QKV, heads.to(tl.int64) * D, hmask, QKV + NQ * D + g * D,
                                 QKV + (NQ + NK) * D + g * D, kbase, vbase, skn, svn, COS, SIN, scs, raw_length,
                                 max_len, s_id * chunk, chunk, qk_scale, BLOCK_H, D, BLOCK_D, BLOCK_N, 2, DOT_PREC,
                                 STATIC_ITERS, True, HALF, ".cg")
        offs_d = tl.arange(0, BLOCK_D)
        hdmask = hmask[:, None] & (offs_d < D)[None, :]
        prow = heads * S_P2 + s_id
        tl.store(OP + prow[:, None] * D + offs_d[None, :], out, mask=hdmask)
        tl.store(LSE + prow, lse, mask=hmask)


# run-time counts (the context split, the graph's KV bucket, the layer of a staged launch) are not specialised on,
# so a new value never compiles another variant of this large kernel
@triton.jit(do_not_specialize=["max_len", "chunk", "n_splits", "stage_layer"])
def _persistent_decode_kernel(
        RES, WQKV, WO, WGU, WD, LN1, LN2, KC, VC, COS, SIN, LENS, ROWS,
        QKV, OP, LSE, ACT, CNT,
        max_len, chunk, n_splits, qk_scale, eps, scs, skl, skb, skh, skn, svl, svb, svh, svn, stage_layer,
        NL: tl.constexpr, HID: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr,
        INTER: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BK: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, S_P2: tl.constexpr, HAS_ROWS: tl.constexpr,
        STAGE: tl.constexpr, STATIC_ITERS: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
        MAXSPIN: tl.constexpr, BARRIER: tl.constexpr):
    # STAGE -1: all layers, barriers between stages; 0..4: only that stage of layer ``stage_layer``.
    NQKV: tl.constexpr = (NQ + 2 * NK) * D
    KO: tl.constexpr = NQ * D
    pdl_begin(PDL)
    pid = tl.program_id(0)
    dt = RES.dtype.element_ty
    if STAGE < 0:
        # layer 0's first qkv tiles are in flight while the previous kernel finishes (they are weights)
        qa, qa2 = _w_tile(WQKV, 0, pid, True, NQKV, HID, 0, G, BN_QKV, BK, False)
        qb, qb2 = _w_tile(WQKV, 1, pid, True, NQKV, HID, 0, G, BN_QKV, BK, False)
        pdl_wait(PDL)
        for layer in range(NL):
            lw = layer.to(tl.int64)
            wqkv = WQKV + lw * (NQKV * HID)
            wo = WO + lw * (HID * KO)
            wgu = WGU + lw * (2 * INTER * HID)
            wd = WD + lw * (HID * INTER)
            bar = layer * (_STAGES * G)
            x = _normed_row(RES, LN1 + lw * HID, eps, HID, BK)
            _gemv(wqkv, pid, qa, qa2, qb, qb2, x, RES, QKV, RES, NQKV, HID, 0, G, BN_QKV, BK, False, False, True)
            _arrive(CNT, BARRIER)
            oa, oa2 = _w_tile(wo, 0, pid, True, HID, KO, 0, G, BN_O, BK, False)
            ob, ob2 = _w_tile(wo, 1, pid, True, HID, KO, 0, G, BN_O, BK, False)
            _wait_for(CNT, bar + G, MAXSPIN, BARRIER)
            _attention_stage(layer, pid, QKV, KC, VC, COS, SIN, LENS, ROWS, OP, LSE, max_len, chunk, n_splits,
                             qk_scale, scs, skl, skb, skh, skn, svl, svb, svh, svn, NQ, NK, D, HALF, BLOCK_H,
                             BLOCK_N, S_P2, HAS_ROWS, STATIC_ITERS, DOT_PREC)
            _arrive(CNT, BARRIER)
            _wait_for(CNT, bar + 2 * G, MAXSPIN, BARRIER)
            x = _combined_heads(OP, LSE, n_splits, NQ, D, BK, S_P2, dt)
            _gemv(wo, pid, oa, oa2, ob, ob2, x, RES, RES, RES, HID, KO, 0, G, BN_O, BK, False, True, True)
            _arrive(CNT, BARRIER)
            ga, ga2 = _w_tile(wgu, 0, pid, True, INTER, HID, INTER, G, BN_GU, BK, True)
            gb, gb2 = _w_tile(wgu, 1, pid, True, INTER, HID, INTER, G, BN_GU, BK, True)
            _wait_for(CNT, bar + 3 * G, MAXSPIN, BARRIER)
            x = _normed_row(RES, LN2 + lw * HID, eps, HID, BK)
            _gemv(wgu, pid, ga, ga2, gb, gb2, x, RES, ACT, RES, INTER, HID, INTER, G, BN_GU, BK, True, False, True)
            _arrive(CNT, BARRIER)
            da, da2 = _w_tile(wd, 0, pid, True, HID, INTER, 0, G, BN_D, BK, False)
            db, db2 = _w_tile(wd, 1, pid, True, HID, INTER, 0, G, BN_D, BK, False)
            _wait_for(CNT, bar + 4 * G, MAXSPIN, BARRIER)
            _gemv(wd, pid, da, da2, db, db2, x, ACT, RES, RES, HID, INTER, 0, G, BN_D, BK, False, True, False)
            more = layer + 1 < NL
            if more:
                _arrive(CNT, BARRIER)
            qa, qa2 = _w_tile(wqkv + NQKV * HID, 0, pid, more, NQKV, HID, 0, G, BN_QKV, BK, False)
            qb, qb2 = _w_tile(wqkv + NQKV * HID, 1, pid, more, NQKV, HID, 0, G, BN_QKV, BK, False)
            if more:
                _wait_for(CNT, bar + 5 * G, MAXSPIN, BARRIER)
        # the last program out resets the counters for the next launch (nobody polls them any more)
        if tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            tl.atomic_xchg(CNT, 0)
            tl.atomic_xchg(CNT + 1, 0)
    else:
        pdl_wait(PDL)
        lw = stage_layer.to(tl.int64)
        if STAGE == 0:
            w = WQKV + lw * (NQKV * HID)
            a, a2 = _w_tile(w, 0, pid, True, NQKV, HID, 0, G, BN_QKV, BK, False)
            b, b2 = _w_tile(w, 1, pid, True, NQKV, HID, 0, G, BN_QKV, BK, False)
            x = _normed_row(RES, LN1 + lw * HID, eps, HID, BK)
            _gemv(w, pid, a, a2, b, b2, x, RES, QKV, RES, NQKV, HID, 0, G, BN_QKV, BK, False, False, True)
        elif STAGE == 1:
            _attention_stage(stage_layer, pid, QKV, KC, VC, COS, SIN, LENS, ROWS, OP, LSE, max_len, chunk,
                             n_splits, qk_scale, scs, skl, skb, skh, skn, svl, svb, svh, svn, NQ, NK, D, HALF,
                             BLOCK_H, BLOCK_N, S_P2, HAS_ROWS, STATIC_ITERS, DOT_PREC)
        elif STAGE == 2:
            w = WO + lw * (HID * KO)
            a, a2 = _w_tile(w, 0, pid, True, HID, KO, 0, G, BN_O, BK, False)
            b, b2 = _w_tile(w, 1, pid, True, HID, KO, 0, G, BN_O, BK, False)
            x = _combined_heads(OP, LSE, n_splits, NQ, D, BK, S_P2, dt)
            _gemv(w, pid, a, a2, b, b2, x, RES, RES, RES, HID, KO, 0, G, BN_O, BK, False, True, True)
        elif STAGE == 3:
            w = WGU + lw * (2 * INTER * HID)
            a, a2 = _w_tile(w, 0, pid, True, INTER, HID, INTER, G, BN_GU, BK, True)
            b, b2 = _w_tile(w, 1, pid, True, INTER, HID, INTER, G, BN_GU, BK, True)
            x = _normed_row(RES, LN2 + lw * HID, eps, HID, BK)
            _gemv(w, pid, a, a2, b, b2, x, RES, ACT, RES, INTER, HID, INTER, G, BN_GU, BK, True, False, True)
        else:
            w = WD + lw * (HID * INTER)
            a, a2 = _w_tile(w, 0, pid, True, HID, INTER, 0, G, BN_D, BK, False)
            b, b2 = _w_tile(w, 1, pid, True, HID, INTER, 0, G, BN_D, BK, False)
            x = tl.zeros((BK,), dtype=dt)
            _gemv(w, pid, a, a2, b, b2, x, ACT, RES, RES, HID, INTER, 0, G, BN_D, BK, False, True, False)


# ------------------------------------------------------------------------------------------------ launcher

def attention_splits(max_len: int, n_kv_heads: int, programs: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk) of the context for the attention stage: ~one BLOCK_N tile per split, at most
    MAX_SPLITS, never more programs than the grid has."""
    splits = max(1, min(MAX_SPLITS, cdiv(max_len, block_n), programs // n_kv_heads))
    chunk = cdiv(cdiv(max(max_len, 1), splits), block_n) * block_n
    return max(1, cdiv(max_len, chunk)), chunk


def persistent_decode(res: torch.Tensor, weights: PersistentWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, lengths: torch.Tensor,
                      workspace: PersistentWorkspace, cache_rows: torch.Tensor | None = None,
                      max_len: int | None = None, eps: float = 1e-5, sm_scale: float | None = None,
                      persistent: bool | None = None, config: PersistentConfig | None = None,
                      programs: int | None = None, cooperative: bool = True) -> torch.Tensor:
    """See the module docstring. ``persistent`` (default: on the GPU) chooses one launch with grid barriers
    over one launch per (layer, stage); ``programs`` overrides the grid size (tests: several blocks per
    program). Returns ``res``, updated in place."""
    check_device(res, k_cache, v_cache, lengths, cache_rows, *weights.tensors())
    cfg = config or PersistentConfig()
    interp = interpreting()
    n_layers, n_qkv, hidden = weights.wqkv.shape
    d = k_cache.shape[-1]
    n_kv = k_cache.shape[2]
    n_heads = weights.wo.shape[2] // d
    inter = weights.wdown.shape[2]
    why = supports(hidden, n_heads, n_kv, d)
    if why:
        raise ValueError(f"persistent_decode: {why}")
    expect = dict(wqkv=(n_layers, (n_heads + 2 * n_kv) * d, hidden), wo=(n_layers, hidden, n_heads * d),
                  wgu=(n_layers, 2 * inter, hidden), wdown=(n_layers, hidden, inter), ln1=(n_layers, hidden),
                  ln2=(n_layers, hidden))
    for name, shape in expect.items():
        t = getattr(weights, name)
        if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != res.dtype:
            raise ValueError(f"persistent_decode: {name} must be {shape} contiguous {res.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if tuple(res.shape) != (1, hidden) or not res.is_contiguous():
        raise ValueError(f"persistent_decode: res must be (1, {hidden}) contiguous (batch 1), got {tuple(res.shape)}")
    if k_cache.dim() != 5 or k_cache.shape[0] != n_layers or v_cache.shape != k_cache.shape \
            or k_cache.dtype != res.dtype or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"persistent_decode: k_cache / v_cache must be (layers {n_layers}, max_batch, Hk, capacity, "
                         f"D) {res.dtype} with unit stride in D, got {tuple(k_cache.shape)} {k_cache.dtype}")
    if cos_cache.dtype != torch.float32 or cos_cache.stride(1) != 1 or sin_cache.stride() != cos_cache.stride():
        cos_cache, sin_cache = cos_cache.float().contiguous(), sin_cache.float().contiguous()
    capacity = k_cache.shape[3]
    max_len = capacity if max_len is None else int(max_len)
    if max_len > capacity:
        raise ValueError(f"persistent_decode: max_len {max_len} > cache capacity {capacity}")
    ws = workspace
    if ws.qkv.numel() != n_qkv or ws.act.numel() != inter or ws.partial.shape[0] != n_heads:
        raise ValueError("persistent_decode: the workspace was made for another decoder shape")
    g = programs or (4 if interp else num_sms(res.device) * cfg.programs_per_sm)
    if g < n_kv:
        raise ValueError(f"persistent_decode: {g} programs < {n_kv} kv heads")
    block_n = 16 if interp else 64
    n_splits, chunk = attention_splits(max_len, n_kv, g, block_n)
    bk = min(cfg.block_k, next_pow2(max(hidden, n_heads * d, inter)))
    if bk < next_pow2(max(hidden, n_heads * d)):
        raise ValueError(f"persistent_decode: block_k {cfg.block_k} must cover hidden {hidden} and heads x head_dim "
                         f"{n_heads * d} (their GEMVs hold the input vector as one K tile)")
    persistent = (not interp) if persistent is None else persistent
    if persistent and interp:
        raise ValueError("persistent_decode: the persistent launch cannot run in the CPU interpreter")
    pdl = pdl_enabled(res.device)
    ks, vs = k_cache.stride(), v_cache.stride()
    qk_scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * _LOG2E
    dot_prec = "ieee" if res.dtype == torch.float32 else "tf32"
    rows = cache_rows if cache_rows is not None else lengths
    args = (res, *weights.tensors(), k_cache, v_cache, cos_cache, sin_cache, lengths, rows,
            ws.qkv, ws.partial, ws.lse, ws.act, ws.counters,
            max_len, chunk, n_splits, qk_scale, float(eps), cos_cache.stride(0),
            ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3])
    const = dict(NL=n_layers, HID=hidden, NQ=n_heads, NK=n_kv, D=d, INTER=inter, HALF=cos_cache.shape[1], G=g,
                 BN_QKV=cfg.bn_qkv, BN_O=cfg.bn_o, BN_GU=cfg.bn_gate_up, BN_D=cfg.bn_down, BK=bk,
                 BLOCK_H=max(16, next_pow2(n_heads // n_kv)), BLOCK_N=block_n, S_P2=MAX_SPLITS,
                 HAS_ROWS=cache_rows is not None, STATIC_ITERS=cdiv(chunk, block_n) if interp else 0,
                 DOT_PREC=dot_prec, PDL=pdl, MAXSPIN=MAX_SPIN, BARRIER=cfg.barrier, num_warps=cfg.num_warps)
    if not interp:
        # RoPE's intermediate roundings must stay (kernels/rope.py: fp fusion contracts them into FMAs)
        const["enable_fp_fusion"] = False
        # the attention stage's K/V pipeline: 2 stages (shared memory is what lets several programs share an SM)
        const["num_stages"] = 2
        if cfg.maxnreg:
            const["maxnreg"] = cfg.maxnreg
        if pdl:
            const["launch_pdl"] = True
    if persistent:
        _persistent_decode_kernel[(g,)](*args, 0, STAGE=-1, launch_cooperative_grid=cooperative, **const)
    else:
        for layer in range(n_layers):
            for stage in range(STAGES):
                _persistent_decode_kernel[(g,)](*args, layer, STAGE=stage, **const)
    return res
