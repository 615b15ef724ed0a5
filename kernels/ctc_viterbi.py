"""The Viterbi recursion of CTC forced alignment for a batch of utterances, in one launch: the frame loop of
``glmasr.align.ctc``'s Viterbi (see that module for the states and the path rules), and optionally the back-trace.

``ctc_viterbi_forward``: for every utterance b < B (one program each) over states s < Smax, with n = lengths[b]:

    alpha[s] = emit[b, 0, s] for s < 2, NEG elsewhere                 (a path starts in state 0 or 1)
    back[b, 0, s] = 0
    for t in 1 .. Tmax-1:
        p0 = alpha[s];  p1 = alpha[s-1] (NEG at s = 0);  p2 = alpha[s-2] where skip[b, s] (NEG elsewhere)
        choice = argmax(p0, p1, p2), ties to the lowest (stay, then one step, then the skip)
        if t < n:  alpha[s] = max(p_choice + emit[b, t, s], NEG);   back[b, t, s] = choice
        else:      alpha unchanged;                                  back[b, t, s] = 0
    alpha_out[b] = alpha

in float64, NEG = -1e30 (``glmasr.align.ctc.NEG``: "unreachable"). Every operation is the reference's in the same
order (one float64 add, compares, selects), so the results equal ``ctc_viterbi_forward_ref`` (the torch loop,
~10 small launches per frame) and the numpy Viterbi bit for bit; a NaN in ``emit`` propagates as it does there
(``max(NaN, NEG)`` is NaN). The states past an utterance's own 2L+1 must hold NEG in every frame (as the caller
builds ``emit``), so that they stay unreachable.

``ctc_viterbi_paths`` adds, given each utterance's state count S_b = states[b], the back-trace in the same program
(so that only B x Tmax path entries leave the device, not the B x Tmax x Smax back-pointers):

    end = S_b - 1 if S_b == 1 or alpha[S_b - 1] >= alpha[S_b - 2] else S_b - 2;   scores[b] = alpha[end]
    for t = n-1 .. 0:  paths[b, t] = end;  end -= back[b, t, end]
    paths[b, t] = -1 for t >= n

``ctc_viterbi_paths_ref`` is the forward reference and that walk in numpy (vectorised over the batch). A score
<= NEG / 2 means no path; its walk still stays inside [0, Smax) but means nothing.

Design: the recursion is sequential in t and couples neighbouring states, so one program owns one utterance for
all frames, with the whole state axis in one block (BLOCK_S = next power of two >= Smax, at most ``MAX_STATES``;
the caller runs the torch loop beyond). A register tensor cannot be shifted, so alpha[s-1] and alpha[s-2] are read
back from a scratch row in global memory (store, barrier, shifted loads). Two scratch rows alternate between
frames, so one barrier per frame suffices: a thread writes row t % 2 again at frame t + 2 only after the barrier
of frame t + 1, which every thread reaches after its reads of frame t. The next frame's emissions are loaded a
frame ahead. Every program runs all Tmax - 1 frames (those past its length are masked): the programs run side by
side, so the launch takes the longest utterance's time either way, and back is written everywhere. The back-trace
is a scalar walk (one dependent load per frame) behind a barrier that makes every thread's back rows visible.

Shapes: emit (B, Tmax, Smax) float64, unit stride in S; skip (B, Smax) bool (state s may be entered from s - 2;
read only at s >= 2); lengths (B,) ints in [1, Tmax] and states (B,) ints in [1, Smax] (host or device; checked
on the host, so CUDA tensors cost a sync); outputs alpha (B, Smax) float64, back (B, Tmax, Smax) int8 (0 stay,
1 from s - 1, 2 from s - 2), scores (B,) float64, paths (B, Tmax) int64, unit stride in the last dim, allocated
when not given. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl

    from ._triton_utils import check_device, interpreting, next_pow2
except ImportError:  # the reference below stays usable without Triton
    triton = None

__all__ = ["MAX_STATES", "NEG", "ctc_viterbi_forward", "ctc_viterbi_forward_ref", "ctc_viterbi_paths",
           "ctc_viterbi_paths_ref"]

NEG = -1e30
MAX_STATES = 4096  # one block of float64 alphas per program: 8 per thread at 16 warps


def _host_ints(x, name: str, b: int, lo: int, hi: int, what: str) -> np.ndarray:
    v = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if v.shape != (b,) or not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"{name} must be ({b},) integers, got {v.dtype} {v.shape}")
    if b and (v.min() < lo or v.max() > hi):
        raise ValueError(f"{name} must lie in [{lo}, {hi}] ({what}), got {v.min()}..{v.max()}")
    return v.astype(np.int64)


def _check_out(name, out, shape, dtype, device):
    if out is not None and (out.dtype != dtype or tuple(out.shape) != shape or out.device != device
                            or (out.numel() and out.stride(-1) != 1)):
        raise ValueError(f"{name} must be a {shape} {dtype} tensor on {device} with unit stride in its last dim")


def _check(emit, skip, lengths, max_states: int | None) -> np.ndarray:
    """Shapes and dtypes of the inputs; returns the lengths as a host int64 array."""
    if not isinstance(emit, torch.Tensor) or emit.dtype != torch.float64 or emit.dim() != 3:
        raise ValueError(f"emit must be a (B, Tmax, Smax) float64 tensor, got "
                         f"{getattr(emit, 'dtype', type(emit).__name__)} {tuple(getattr(emit, 'shape', ()))}")
    b, t_max, s_max = emit.shape
    if b and (t_max < 1 or s_max < 1):
        raise ValueError(f"emit {tuple(emit.shape)}: every utterance needs at least one frame and one state")
    if max_states is not None and s_max > max_states:
        raise ValueError(f"the CTC Viterbi kernel holds at most {max_states} states (a target of "
                         f"{(max_states - 1) // 2} tokens) in one block, got {s_max}; use the torch reference")
    if not isinstance(skip, torch.Tensor) or skip.dtype != torch.bool or tuple(skip.shape) != (b, s_max):
        raise ValueError(f"skip must be a ({b}, {s_max}) bool tensor, got "
                         f"{getattr(skip, 'dtype', type(skip).__name__)} {tuple(getattr(skip, 'shape', ()))}")
    return _host_ints(lengths, "lengths", b, 1, t_max, "emit's frames")


def ctc_viterbi_forward_ref(emit, skip, lengths, alpha=None, back=None):
    """Plain torch (the reference, and the path beyond ``MAX_STATES`` or without Triton): the module docstring's
    recursion as ~10 (B, Smax) operations per frame on emit's device. Returns (alpha, back)."""
    lens = _check(emit, skip, lengths, None)
    b, t_max, s_max = emit.shape
    dev, f64 = emit.device, torch.float64
    _check_out("alpha", alpha, (b, s_max), f64, dev)
    _check_out("back", back, (b, t_max, s_max), torch.int8, dev)
    neg = torch.tensor(NEG, dtype=f64, device=dev)
    a = torch.full((b, s_max), NEG, dtype=f64, device=dev)
    a[:, :2] = emit[:, 0, :2]
    bk = torch.zeros((b, t_max, s_max), dtype=torch.int8, device=dev) if back is None else back
    bk[:, 0] = 0
    prev1 = torch.full((b, s_max), NEG, dtype=f64, device=dev)
    prev2 = torch.full((b, s_max), NEG, dtype=f64, device=dev)
    skip2 = skip[:, 2:].to(dev)
    n = torch.from_numpy(lens).to(dev)[:, None]
    one, two = torch.ones((), dtype=torch.int8, device=dev), torch.full((), 2, dtype=torch.int8, device=dev)
    zero = torch.zeros((), dtype=torch.int8, device=dev)
    for t in range(1, t_max):
        prev1[:, 1:] = a[:, :-1]
        prev2[:, 2:] = torch.where(skip2, a[:, :-2], neg)
        # ties go to the lowest choice (stay, then one step), as numpy's argmax over [alpha, prev1, prev2]
        c1 = prev1 > a
        best = torch.where(c1, prev1, a)
        c2 = prev2 > best
        best = torch.where(c2, prev2, best)
        bk[:, t] = torch.where(c2, two, torch.where(c1, one, zero))
        a = torch.where(t < n, torch.clamp_min(best + emit[:, t], NEG), a)
    if t_max > 1:  # frames past an utterance's length: back 0, as the kernel writes them
        bk.masked_fill_(torch.arange(t_max, device=dev)[None, :, None] >= n[:, :, None], 0)
    if alpha is not None:
        alpha.copy_(a)
        a = alpha
    return a, bk


def ctc_viterbi_paths_ref(emit, skip, lengths, states, scores=None, paths=None):
    """``ctc_viterbi_forward_ref``, then the back-trace of the module docstring in numpy on the host (the batch
    traced together, one frame at a time). Returns (scores (B,) float64, paths (B, Tmax) int64) on emit's
    device."""
    lens = _check(emit, skip, lengths, None)
    b, t_max, s_max = emit.shape
    n_states = _host_ints(states, "states", b, 1, s_max, "emit's states")
    _check_out("scores", scores, (b,), torch.float64, emit.device)
    _check_out("paths", paths, (b, t_max), torch.int64, emit.device)
    alpha, back = ctc_viterbi_forward_ref(emit, skip, lens)
    alpha_h, back_h = alpha.cpu().numpy(), back.cpu().numpy()
    rows = np.arange(b)
    last = n_states - 1
    before = np.maximum(last - 1, 0)
    ends = np.where((n_states == 1) | (alpha_h[rows, last] >= alpha_h[rows, before]), last, before)
    path_h = np.full((b, t_max), -1, dtype=np.int64)
    state = ends.copy()
    for t in range(t_max - 1, -1, -1):
        act = t < lens
        path_h[act, t] = state[act]
        state = np.where(act, state - back_h[rows, t, state], state)
    sc = torch.from_numpy(alpha_h[rows, ends]).to(emit.device)
    pt = torch.from_numpy(path_h).to(emit.device)
    if scores is not None:
        sc = scores.copy_(sc)
    if paths is not None:
        pt = paths.copy_(pt)
    return sc, pt


if triton is not None:

    @triton.jit(do_not_specialize=["T", "S", "se_b", "se_t", "ssk", "sa", "sbk_b", "sbk_t", "sp"])
    def _ctc_viterbi_kernel(EMIT, SKIP, LEN, STATES, ALPHA, BACK, SCRATCH, SCORES, PATHS, T, S,
                            se_b, se_t, ssk, sa, sbk_b, sbk_t, sp,
                            NEG_C: tl.constexpr, BLOCK_S: tl.constexpr, TRACE: tl.constexpr,
                            T_HINT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        # NEG as float64 tensor: a bare float constant would be rounded to float32 (-1e30 is not one)
        neg = tl.full([BLOCK_S], NEG_C, tl.float64)
        smask = s < S
        n = tl.load(LEN + b)
        sk = tl.load(SKIP + b * ssk + s, mask=smask & (s >= 2), other=0) != 0
        ep = EMIT + b * se_b + s  # frame t's row, advanced by a frame per iteration (64-bit pointers)
        bp = BACK + b * sbk_b + s
        row0 = SCRATCH + b * (2 * BLOCK_S) + s  # the two alternating scratch rows: row0, row0 + BLOCK_S
        alpha = tl.load(ep, mask=smask & (s < 2), other=neg)
        tl.store(bp, tl.zeros([BLOCK_S], tl.int8), mask=smask)
        ep += se_t
        e = tl.load(ep, mask=smask & (1 < n), other=neg)
        # T_HINT (interpreter only): its range() cannot take a runtime scalar
        for t in range(1, T if T_HINT is None else T_HINT):
            ep += se_t
            e_next = tl.load(ep, mask=smask & (t + 1 < n), other=neg)
            row = row0 + (t % 2) * BLOCK_S
            tl.store(row, alpha)
            tl.debug_barrier()  # the whole row is written before any thread reads its neighbours
            p1 = tl.load(row - 1, mask=s >= 1, other=neg)
            p2 = tl.load(row - 2, mask=sk, other=neg)
            # ties go to the lowest choice: stay, then one step, then the skip
            c1 = p1 > alpha
            best = tl.where(c1, p1, alpha)
            c2 = p2 > best
            best = tl.where(c2, p2, best)
            choice = tl.where(c2, 2, tl.where(c1, 1, 0))
            new = best + e
            new = tl.where(new < neg, neg, new)  # clamp_min: a NaN stays NaN, as in the reference
            active = t < n
            alpha = tl.where(active, new, alpha)
            bp += sbk_t
            tl.store(bp, tl.where(active, choice, 0).to(tl.int8), mask=smask)
            e = e_next
        tl.store(ALPHA + b * sa + s, alpha, mask=smask)
        if TRACE:
            tl.debug_barrier()  # alpha and every thread's back rows are written before the walk reads them
            last = tl.load(STATES + b) - 1
            a_last = tl.load(ALPHA + b * sa + last)
            a_before = tl.load(ALPHA + b * sa + tl.maximum(last - 1, 0))
            state = tl.where((last == 0) | (a_last >= a_before), last, last - 1)
            tl.store(SCORES + b, tl.load(ALPHA + b * sa + state))
            pp = PATHS + b * sp
            bt = BACK + b * sbk_b
            for i in range(T if T_HINT is None else T_HINT):
                t = (T if T_HINT is None else T_HINT) - 1 - i
                live = t < n
                tl.store(pp + t, tl.where(live, state, -1))
                state -= tl.load(bt + t * sbk_t + state, mask=live, other=0).to(tl.int64)


def _num_warps(block_s: int) -> int:
    # ~4 states per thread up to 16 warps (8 at MAX_STATES): fewer threads keep the per-frame barrier cheap
    return max(1, min(16, block_s // 128))


def _launch(emit, skip, lens, n_states, alpha, back, scores, paths):
    b, t_max, s_max = emit.shape
    dev = emit.device
    if emit.stride(2) != 1:
        emit = emit.contiguous()
    skip = skip.to(dev)
    if skip.stride(1) != 1:
        skip = skip.contiguous()
    block_s = max(16, next_pow2(s_max))
    scratch = torch.empty((b, 2, block_s), dtype=torch.float64, device=dev)
    trace = n_states is not None
    if t_max * back.stride(1) >= 2**31:  # the walk's in-slab offsets are 32-bit
        raise ValueError(f"{t_max} frames x {back.stride(1)} states exceed the kernel's 2**31 offsets")
    meta = torch.from_numpy(np.stack([lens, n_states if trace else lens])).to(dev)  # one copy: lengths, states
    _ctc_viterbi_kernel[(b,)](
        emit, skip, meta[0], meta[1], alpha, back, scratch, scores if trace else alpha, paths if trace else back,
        t_max, s_max, emit.stride(0), emit.stride(1), skip.stride(0), alpha.stride(0), back.stride(0),
        back.stride(1), paths.stride(0) if trace else 0,
        NEG_C=NEG, BLOCK_S=block_s, TRACE=trace, T_HINT=t_max if interpreting() else None,
        num_warps=_num_warps(block_s), num_stages=1)


def _need_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs Triton; use {name}_ref (plain torch) without it")


def ctc_viterbi_forward(emit, skip, lengths, alpha=None, back=None):
    """One launch of the module docstring's recursion; returns (alpha (B, Smax) float64, back (B, Tmax, Smax)
    int8), written to ``alpha`` / ``back`` when given. ValueError above ``MAX_STATES`` states."""
    _need_triton("ctc_viterbi_forward")
    check_device(emit, alpha, back)
    lens = _check(emit, skip, lengths, MAX_STATES)
    b, t_max, s_max = emit.shape
    dev = emit.device
    _check_out("alpha", alpha, (b, s_max), torch.float64, dev)
    _check_out("back", back, (b, t_max, s_max), torch.int8, dev)
    alpha = torch.empty((b, s_max), dtype=torch.float64, device=dev) if alpha is None else alpha
    back = torch.empty((b, t_max, s_max), dtype=torch.int8, device=dev) if back is None else back
    if b:
        _launch(emit, skip, lens, None, alpha, back, None, None)
    return alpha, back


def ctc_viterbi_paths(emit, skip, lengths, states, scores=None, paths=None):
    """The recursion and the back-trace in one launch (module docstring); returns (scores (B,) float64, paths
    (B, Tmax) int64, -1 past each length), written to ``scores`` / ``paths`` when given. ValueError above
    ``MAX_STATES`` states."""
    _need_triton("ctc_viterbi_paths")
    check_device(emit, scores, paths)
    lens = _check(emit, skip, lengths, MAX_STATES)
    b, t_max, s_max = emit.shape
    dev = emit.device
    n_states = _host_ints(states, "states", b, 1, s_max, "emit's states")
    _check_out("scores", scores, (b,), torch.float64, dev)
    _check_out("paths", paths, (b, t_max), torch.int64, dev)
    scores = torch.empty(b, dtype=torch.float64, device=dev) if scores is None else scores
    paths = torch.empty((b, t_max), dtype=torch.int64, device=dev) if paths is None else paths
    if b:
        alpha = torch.empty((b, s_max), dtype=torch.float64, device=dev)
        back = torch.empty((b, t_max, s_max), dtype=torch.int8, device=dev)
        _launch(emit, skip, lens, n_states, alpha, back, scores, paths)
    return scores, paths
