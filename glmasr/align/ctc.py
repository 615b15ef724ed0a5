"""CTC forced alignment: the single best (Viterbi) path of a known token sequence through frame posteriors.

The targets y_1..y_L are expanded to S = 2L + 1 states ``blank y_1 blank y_2 ... y_L blank`` (even states
blank, state 2i+1 token i). A path visits one state per frame, starts in state 0 or 1, ends in S-1 or S-2, and at
each frame stays, moves one state on, or jumps two (from token i-1 to token i, skipping the blank between) unless
the two tokens are equal: a repeated token needs a blank between its copies, or CTC would collapse them into one.
The path maximises the summed log-posteriors of the states it visits. Token i's span is the frames its path spends
in state 2i+1: [start, end), at least one frame; its probability is the mean posterior over those frames.

Infeasible inputs (fewer frames than tokens plus repeats) have no path: ``None``. ``ctc_viterbi_batch`` runs
several utterances in one vectorised pass (numpy over the batch and the states, a Python loop over frames; the
back-pointers take T x S bytes); ``ctc_viterbi`` is one utterance. Scores accumulate in float64.

``ctc_viterbi_batch_torch`` is the same recursion on torch tensors, for log-posteriors that already sit on a GPU:
on CUDA the frame loop and the back-trace are one Triton launch (``glmasr_kernels.ctc_viterbi``, one program per
utterance, up to its ``MAX_STATES`` states); elsewhere (and beyond that, or without Triton) the loop is a handful
of (B, S) torch operations per frame whatever the batch, with the back-trace on the host. Its results equal
``ctc_viterbi_batch``'s (the same float64 sums, the same tie order: stay, then one step, then a skip); the numpy
function is its reference.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

NEG = -1e30  # "unreachable"; float64 sums of real log-posteriors never come near it


@dataclass
class CtcAlignment:
    """The best path of one utterance. ``spans``: (L, 2) int64, token i covers frames [spans[i,0], spans[i,1]);
    ``probs``: (L,) mean posterior of token i over its frames; ``path``: (T,) the state of each frame;
    ``score``: the path's summed log-posterior."""

    spans: np.ndarray
    probs: np.ndarray
    path: np.ndarray
    score: float


def min_frames(targets) -> int:
    """Frames a CTC path of ``targets`` needs: one per token plus a blank between equal neighbours."""
    t = list(targets)
    return len(t) + sum(a == b for a, b in itertools.pairwise(t))


def ctc_viterbi(log_probs: np.ndarray, targets, blank: int) -> CtcAlignment | None:
    """One utterance: ``log_probs`` (T, C) log-posteriors (rows need not be normalised), ``targets`` column
    indices (none equal to ``blank``). None when no path exists."""
    return ctc_viterbi_batch([(log_probs, targets)], blank)[0]


def _prepare(items, blank: int, as_array) -> list:
    prepared = []
    for log_probs, targets in items:
        lp = as_array(log_probs)
        tg = np.asarray(list(targets), dtype=np.int64)
        if lp.ndim != 2:
            raise ValueError(f"log_probs must be (frames, classes), got shape {lp.shape}")
        if tg.size and (tg.min() < 0 or tg.max() >= lp.shape[1]):
            raise ValueError(f"target ids must lie in [0, {lp.shape[1]}), got {tg.min()}..{tg.max()}")
        if not 0 <= blank < lp.shape[1]:
            raise ValueError(f"blank {blank} outside the {lp.shape[1]} classes")
        if (tg == blank).any():
            raise ValueError(f"the blank id {blank} cannot be a target")
        prepared.append((lp, tg))
    return prepared


def ctc_viterbi_batch(items, blank: int) -> list[CtcAlignment | None]:
    """``items``: (log_probs (T_b, C_b), targets) per utterance; one vectorised pass over all of them."""
    prepared = _prepare(items, blank, np.asarray)
    out: list[CtcAlignment | None] = [None] * len(prepared)
    live = [i for i, (lp, tg) in enumerate(prepared) if lp.shape[0] >= max(1, min_frames(tg))]
    if not live:
        return out
    B = len(live)
    T = np.array([prepared[i][0].shape[0] for i in live])
    L = np.array([prepared[i][1].size for i in live])
    S = 2 * L + 1
    Tmax, Smax = int(T.max()), int(S.max())
    # emissions (B, Tmax, Smax): the log-posterior of each state's class; unreachable past an utterance's states
    emit = np.full((B, Tmax, Smax), NEG, dtype=np.float64)
    skip = np.zeros((B, Smax), dtype=bool)  # state s may be entered from s-2
    for b, i in enumerate(live):
        lp, tg = prepared[i]
        ext = np.full(S[b], blank, dtype=np.int64)
        ext[1::2] = tg
        emit[b, :T[b], :S[b]] = lp[:, ext]
        if L[b] > 1:
            skip[b, 3:S[b]:2] = tg[1:] != tg[:-1]
    alpha = np.full((B, Smax), NEG, dtype=np.float64)
    alpha[:, 0] = emit[:, 0, 0]
    if Smax > 1:
        alpha[:, 1] = np.where(S > 1, emit[:, 0, 1], NEG)
    back = np.zeros((B, Tmax, Smax), dtype=np.int8)  # 0 stay, 1 from s-1, 2 from s-2
    prev1 = np.full((B, Smax), NEG)
    prev2 = np.full((B, Smax), NEG)
    for t in range(1, Tmax):
        prev1[:, 1:] = alpha[:, :-1]
        prev2[:, 2:] = np.where(skip[:, 2:], alpha[:, :-2], NEG)
        cand = np.stack([alpha, prev1, prev2])  # ties go to the lowest choice: stay, then one step
        choice = cand.argmax(axis=0)
        best = np.take_along_axis(cand, choice[None], axis=0)[0]
        active = (t < T)[:, None]
        alpha = np.where(active, np.maximum(best + emit[:, t], NEG), alpha)
        back[:, t] = choice
    for b, i in enumerate(live):
        lp, tg = prepared[i]
        s_last = S[b] - 1
        end = s_last if S[b] == 1 or alpha[b, s_last] >= alpha[b, s_last - 1] else s_last - 1
        score = alpha[b, end]
        if score <= NEG / 2:
            continue
        path = np.empty(T[b], dtype=np.int64)
        s = end
        for t in range(T[b] - 1, -1, -1):
            path[t] = s
            s -= back[b, t, s]
        out[i] = _spans(path, lp, tg, blank, float(score))
    return out


def ctc_viterbi_batch_torch(items, blank: int, kernel: bool | None = None) -> list[CtcAlignment | None]:
    """``ctc_viterbi_batch`` with the frame recursion on the items' device: ``items`` (log_probs (T_b, C_b)
    tensors, all on one device, targets) per utterance.

    ``kernel``: None (default) runs the recursion and the back-trace as one Triton launch
    (``glmasr_kernels.ctc_viterbi.ctc_viterbi_paths``; only the paths and scores come back to the host) on CUDA
    when Triton is importable and the longest utterance has at most its ``MAX_STATES`` states, else the torch loop
    (``ctc_viterbi_paths_ref``: the back-pointers, B x T x S bytes, come back and are traced on the host); True
    always the kernel (CPU tensors only under TRITON_INTERPRET=1: for tests; ValueError above ``MAX_STATES``);
    False always the torch loop. All give the same results."""
    import torch
    from glmasr_kernels.ctc_viterbi import ctc_viterbi_paths_ref

    prepared = _prepare(items, blank, lambda x: x if isinstance(x, torch.Tensor) else torch.as_tensor(x))
    out: list[CtcAlignment | None] = [None] * len(prepared)
    live = [i for i, (lp, tg) in enumerate(prepared) if lp.shape[0] >= max(1, min_frames(tg))]
    if not live:
        return out
    dev = prepared[live[0]][0].device
    B = len(live)
    T = np.array([prepared[i][0].shape[0] for i in live])
    L = np.array([prepared[i][1].size for i in live])
    S = 2 * L + 1
    Tmax, Smax = int(T.max()), int(S.max())
    f64 = torch.float64
    emit = torch.full((B, Tmax, Smax), NEG, dtype=f64, device=dev)
    skip = np.zeros((B, Smax), dtype=bool)
    for b, i in enumerate(live):
        lp, tg = prepared[i]
        ext = np.full(S[b], blank, dtype=np.int64)
        ext[1::2] = tg
        emit[b, :T[b], :S[b]] = lp.index_select(1, torch.from_numpy(ext).to(dev)).to(f64)
        if L[b] > 1:
            skip[b, 3:S[b]:2] = tg[1:] != tg[:-1]
    skip_t = torch.from_numpy(skip).to(dev)
    if kernel is None:
        paths_fn = _viterbi_paths(dev, Smax) or ctc_viterbi_paths_ref
    elif kernel:
        from glmasr_kernels.ctc_viterbi import ctc_viterbi_paths as paths_fn
    else:
        paths_fn = ctc_viterbi_paths_ref
    scores_t, paths_t = paths_fn(emit, skip_t, T, S)
    scores, paths = scores_t.cpu().numpy(), paths_t.cpu().numpy()
    for b, i in enumerate(live):
        if scores[b] <= NEG / 2:
            continue
        lp, tg = prepared[i]
        out[i] = _spans(paths[b, :T[b]], lp.float().cpu().numpy(), tg, blank, float(scores[b]))
    return out


@functools.lru_cache(maxsize=1)
def _import_kernel():
    try:
        from glmasr_kernels.ctc_viterbi import MAX_STATES, ctc_viterbi_paths, triton
    except ImportError:
        return None
    return (ctc_viterbi_paths, MAX_STATES) if triton is not None else None


def _viterbi_paths(device, states: int):
    """The Triton recursion and back-trace where they run by default (CUDA, Triton importable, at most
    MAX_STATES states), else None (the torch loop)."""
    if device.type != "cuda":
        return None
    found = _import_kernel()
    return found[0] if found is not None and states <= found[1] else None


def _spans(path: np.ndarray, log_probs: np.ndarray, targets: np.ndarray, blank: int, score: float) -> CtcAlignment:
    L = targets.size
    token = path // 2
    on = (path % 2) == 1
    frames = np.nonzero(on)[0]
    which = token[frames]
    starts = np.full(L, -1, dtype=np.int64)
    ends = np.full(L, -1, dtype=np.int64)
    # frames of one token are contiguous (the path never returns to a state it left)
    first = np.ones(frames.size, dtype=bool)
    first[1:] = which[1:] != which[:-1]
    last = np.ones(frames.size, dtype=bool)
    last[:-1] = which[:-1] != which[1:]
    starts[which[first]] = frames[first]
    ends[which[last]] = frames[last] + 1
    post = np.exp(log_probs[frames, targets[which]].astype(np.float64))
    sums = np.bincount(which, weights=post, minlength=L)
    counts = np.bincount(which, minlength=L)
    return CtcAlignment(np.stack([starts, ends], axis=1), sums / np.maximum(counts, 1), path, score)
