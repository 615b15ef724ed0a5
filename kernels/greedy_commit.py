"""Greedy pick, its log-probability and per-slot stop bookkeeping of one decode step, in one launch (the
engine's step epilogue).

For every slot b < B (one program each), with ``step = step_index[0]``:

    tok      = argmax(logits[b])                      first index of the maximum (torch.argmax's tie rule;
                                                      a row of all -inf gives 0)
    logp     = log_softmax(float32(logits[b]))[tok]   natural log, softmax over the whole row; a row of all
                                                      -inf gives NaN (as torch does)
    is_eos   = tok in eos_ids and not ignore_eos[b]
    stop     = mask[b] and is_eos;    append = mask[b] and not is_eos
    out[b, step]   = tok if append else -1;      out_logprob[b, step] = logp if append else 0.0
    remaining[b]  -= append;          hit = append and remaining[b] <= 0
    status[b]      = STOPPED if stop else LENGTH if hit else status[b]
    stop_token[b]  = tok if stop else stop_token[b]
    active[b]      = (active[b] and not mask[b]) or (append and not hit)
    tokens[b]      = tok if append else tokens[b];     positions[b] += append

exactly ``commit_tokens(*greedy_pick(logits), mask, ...)`` (the plain-torch reference, ``greedy_commit_ref``:
``argmax`` and ``log_softmax(...).gather``); like it, the kernel leaves ``step_index += 1``, which the caller does
after the launch (programs read it concurrently). In a CUDA graph this replaces ~30 tiny torch kernels per decode
step with one.

The log-probability costs no extra pass and no (B, V) tensor: beside each lane's running maximum (the argmax)
the kernel keeps an online log-sum-exp, ``s = s * exp(m_old - m_new) + exp(x - m_new)`` per lane, then combines
the lanes once, ``S = sum(s_lane * exp(m_lane - max))``; since the pick *is* the maximum, ``logp = -log(S)``
(torch computes ``(x[tok] - max) - log(sum(exp(x - max)))``, the same number up to summation order and the
exp implementation: a few fp32 ulps of S, ~1e-6 absolute in logp at the real V = 59264).

Status codes: ``RUNNING`` 0, ``STOPPED`` 1 (an eos id ended the sequence), ``LENGTH`` 2 (its budget ran out).
``commit_tokens`` and the codes are plain torch and import without Triton: the engine's plain path (the CPU
fallback, also on machines without Triton) uses them for every step.

Shapes: logits (B, V) any float dtype, unit stride in V; mask, ignore_eos, active (>= B,) bool; remaining,
status, stop_token, tokens, positions (>= B,) int64; out (>= B, S) int64 with S > step; out_logprob (>= B, S)
float32 or float64 (the engine uses float64 so it can read it back bit-cast inside its int64 token copy), unit
stride in S; eos_ids (E,) int64; step_index (1,) int64. Launched with PDL on sm_90+ (``_triton_utils.pdl_launch``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from ._triton_utils import cdiv, check_device, interpreting, next_pow2, pdl_begin, pdl_launch, pdl_wait
except ImportError:  # the reference and the codes below serve the plain path without Triton
    triton = None

__all__ = ["RUNNING", "STOPPED", "LENGTH", "commit_tokens", "greedy_commit", "greedy_commit_ref", "greedy_pick"]

RUNNING, STOPPED, LENGTH = 0, 1, 2


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the greedy tokens of (B, V) logits and their log-probabilities (fp32, natural log, softmax
    over the whole row of the logits as fp32), ``argmax`` and ``log_softmax(...).gather``."""
    tok = logits.argmax(-1)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None])[:, 0]
    return tok, logp


def commit_tokens(next_tokens, next_logprobs, mask, eos_ids, ignore_eos, out, out_logprob, step_index, remaining,
                  status, stop_token, active, tokens, positions) -> None:
    """Per-slot bookkeeping of one greedy step for slots [0, b), b = len(next_tokens), those in ``mask``: eos
    -> STOPPED, budget exhausted -> LENGTH, the token appended to column ``step_index`` of ``out`` and its
    log-probability to the same column of ``out_logprob`` (0.0 where nothing is appended). Plain torch;
    ``step_index`` not advanced."""
    b = next_tokens.shape[0]
    is_eos = (next_tokens[:, None] == eos_ids[None, :]).any(-1) & ~ignore_eos[:b]
    stop = mask & is_eos
    append = mask & ~is_eos
    out[:b].index_copy_(1, step_index, torch.where(append, next_tokens, -1)[:, None])
    lp = torch.where(append, next_logprobs.to(out_logprob.dtype), 0.0)
    out_logprob[:b].index_copy_(1, step_index, lp[:, None])
    rem = remaining[:b] - append.long()
    remaining[:b] = rem
    hit_length = append & (rem <= 0)
    status[:b] = torch.where(stop, STOPPED, torch.where(hit_length, LENGTH, status[:b]))
    stop_token[:b] = torch.where(stop, next_tokens, stop_token[:b])
    active[:b] = mask.logical_not().logical_and(active[:b]) | (append & ~hit_length)
    tokens[:b] = torch.where(append, next_tokens, tokens[:b])
    positions[:b] += append.long()


def greedy_commit_ref(logits, mask, eos_ids, ignore_eos, out, out_logprob, step_index, remaining, status, stop_token,
                      active, tokens, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: ``greedy_pick`` then ``commit_tokens``; returns the picks and their log-probs."""
    nxt, logp = greedy_pick(logits)
    commit_tokens(nxt, logp, mask[:logits.shape[0]], eos_ids, ignore_eos, out, out_logprob, step_index, remaining,
                  status, stop_token, active, tokens, positions)
    return nxt, logp


if triton is not None:
    @triton.jit
    def _greedy_commit_kernel(LOGITS, sl, V, EOS, N_EOS, MASK, IGNORE, OUT, so, OUT_LP, slp, STEP, REMAINING,
                              STATUS, STOP_TOKEN, ACTIVE, TOKENS, POSITIONS,
                              BLOCK_V: tl.constexpr, V_ITERS: tl.constexpr, EOS_P2: tl.constexpr,
                              STOPPED_C: tl.constexpr, LENGTH_C: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_V], 2147483647, tl.int32)
        sum_exp = tl.zeros([BLOCK_V], tl.float32)  # per lane: sum of exp(x - best) over the lane's elements
        for it in range(V_ITERS):  # constexpr trip count (interpreter); lanes keep their first maximum
            idx = it * BLOCK_V + offs
            x = tl.load(LOGITS + b * sl + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            better = x > best
            new_best = tl.where(better, x, best)
            # online log-sum-exp; a lane that has seen only -inf (padding) keeps 0 instead of exp(-inf - -inf)
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            sum_exp = sum_exp * tl.exp(best - shift) + tl.exp(x - shift)
            best = new_best
            best_i = tl.where(better, idx, best_i)
        top = tl.max(best, axis=0)
        tok = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
        tok = tl.where(tok == 2147483647, 0, tok).to(tl.int64)  # all -inf: index 0, like torch.argmax
        top_shift = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(sum_exp * tl.exp(best - top_shift), axis=0)
        # the pick is the maximum: log_softmax[tok] = (top - top) - log(total); all -inf: NaN, as torch gives
        logp = tl.where(top == float("-inf"), float("nan"), -tl.log(tl.where(top == float("-inf"), 1.0, total)))

        e = tl.arange(0, EOS_P2)
        eos = tl.load(EOS + e, mask=e < N_EOS, other=-1)
        is_eos = (tl.sum((eos == tok).to(tl.int32), axis=0) > 0) & (tl.load(IGNORE + b) == 0)
        m = tl.load(MASK + b) != 0
        stop = m & is_eos
        append = m & (is_eos == 0)
        step = tl.load(STEP)
        tl.store(OUT + b * so + step, tl.where(append, tok, -1))
        tl.store(OUT_LP + b * slp + step, tl.where(append, logp, 0.0).to(OUT_LP.dtype.element_ty))
        rem = tl.load(REMAINING + b) - append.to(tl.int64)
        tl.store(REMAINING + b, rem)
        hit = append & (rem <= 0)
        st = tl.load(STATUS + b)
        tl.store(STATUS + b, tl.where(stop, STOPPED_C, tl.where(hit, LENGTH_C, st)))
        tl.store(STOP_TOKEN + b, tl.where(stop, tok, tl.load(STOP_TOKEN + b)))
        act = tl.load(ACTIVE + b) != 0
        tl.store(ACTIVE + b, ((act & (m == 0)) | (append & (hit == 0))).to(tl.int1))
        tl.store(TOKENS + b, tl.where(append, tok, tl.load(TOKENS + b)))
        tl.store(POSITIONS + b, tl.load(POSITIONS + b) + append.to(tl.int64))


def greedy_commit(logits, mask, eos_ids, ignore_eos, out, out_logprob, step_index, remaining, status, stop_token,
                  active, tokens, positions) -> None:
    """One launch: see the module docstring (the caller increments ``step_index`` afterwards)."""
    if triton is None:
        raise RuntimeError("greedy_commit needs Triton; use commit_tokens (plain torch) without it")
    check_device(logits, mask, eos_ids, out, out_logprob)
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits need unit stride in the vocabulary dim")
    for name, t, dt in (("mask", mask, torch.bool), ("ignore_eos", ignore_eos, torch.bool),
                        ("active", active, torch.bool), ("remaining", remaining, torch.int64),
                        ("status", status, torch.int64), ("stop_token", stop_token, torch.int64),
                        ("tokens", tokens, torch.int64), ("positions", positions, torch.int64),
                        ("eos_ids", eos_ids, torch.int64), ("step_index", step_index, torch.int64)):
        if t.dtype != dt or t.dim() != 1 or (name not in ("eos_ids", "step_index") and t.shape[0] < b) \
                or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D {dt} tensor with >= {b} entries")
    if out.dtype != torch.int64 or out.dim() != 2 or out.shape[0] < b or out.stride(1) != 1:
        raise ValueError("out must be (>= B, S) int64 with unit stride in S")
    if out_logprob.dtype not in (torch.float32, torch.float64) or out_logprob.dim() != 2 \
            or out_logprob.shape[0] < b or out_logprob.shape[1] < out.shape[1] or out_logprob.stride(1) != 1:
        raise ValueError("out_logprob must be (>= B, >= out's S) float32 or float64 with unit stride in S")
    if b == 0:
        return
    block_v = 1024 if interpreting() else 4096
    _greedy_commit_kernel[(b,)](
        logits, logits.stride(0), v, eos_ids, eos_ids.numel(), mask, ignore_eos, out, out.stride(0), out_logprob,
        out_logprob.stride(0), step_index, remaining, status, stop_token, active, tokens, positions,
        BLOCK_V=block_v, V_ITERS=cdiv(v, block_v), EOS_P2=max(2, next_pow2(eos_ids.numel())),
        STOPPED_C=STOPPED, LENGTH_C=LENGTH, num_warps=8, **pdl_launch(logits.device))
