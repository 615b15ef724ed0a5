"""The CTC Viterbi forward kernel (kernels/ctc_viterbi.py) against its torch reference and the numpy Viterbi.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest when there is no GPU) at small shapes (T <= 40,
S <= 33). GPU: the same tests compiled, plus a real-shape one (skipped without CUDA). Inputs are fresh random
draws (the seed is in every failure message); every third batch has rounded log-posteriors, so ties between
staying, stepping and skipping are common and the tie order is checked. Output buffers are poisoned first (back
with a sentinel, alpha with NaN), so an element the kernel leaves unwritten fails. The comparisons are exact:
the kernel does the reference's float64 operations in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# conftest sets TRITON_INTERPRET when there is no GPU, before anything imports glmasr_kernels
from conftest import DEV, gpu_only, require_kernels

require_kernels()

from glmasr_kernels.ctc_viterbi import (
    MAX_STATES,
    NEG,
    ctc_viterbi_forward,
    ctc_viterbi_forward_ref,
    ctc_viterbi_paths,
    ctc_viterbi_paths_ref,
)

from glmasr.align import ctc
from glmasr.align.ctc import ctc_viterbi_batch, ctc_viterbi_batch_torch

SENTINEL = 77  # never a back-pointer (0, 1 or 2)


def _fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return seed, np.random.default_rng(seed)


def _random_forward_inputs(rng, B, Tmax, Smax, rounded, special):
    """emit / skip / lengths / states as ctc.py builds them: per utterance S_b odd <= Smax (one at Smax when it is odd),
    T_b <= Tmax (one at Tmax), NEG past each utterance's states and frames; ``special`` puts -inf (log 0) and
    one NaN into some emissions."""
    S = rng.integers(0, (Smax - 1) // 2 + 1, size=B) * 2 + 1
    if Smax % 2:
        S[rng.integers(B)] = Smax
    T = rng.integers(1, Tmax + 1, size=B)
    T[rng.integers(B)] = Tmax
    emit = np.full((B, Tmax, Smax), NEG)
    skip = np.zeros((B, Smax), dtype=bool)
    for b in range(B):
        e = np.log(rng.dirichlet(np.ones(S[b]) * 0.7, size=T[b]))
        if rounded:
            e = np.round(e)
        if special:
            e[rng.random(e.shape) < 0.05] = -np.inf
        emit[b, :T[b], :S[b]] = e
        skip[b, 3:S[b]:2] = rng.random(len(range(3, S[b], 2))) < 0.7
    if special:
        b = rng.integers(B)
        emit[b, rng.integers(T[b]), rng.integers(S[b])] = np.nan
    return torch.from_numpy(emit).to(DEV), torch.from_numpy(skip).to(DEV), torch.from_numpy(T), S


def _poisoned(B, Tmax, Smax):
    return (torch.full((B, Smax), float("nan"), dtype=torch.float64, device=DEV),
            torch.full((B, Tmax, Smax), SENTINEL, dtype=torch.int8, device=DEV))


def _assert_forward_equal(emit, skip, lengths, msg):
    alpha, back = _poisoned(*emit.shape)
    got_alpha, got_back = ctc_viterbi_forward(emit, skip, lengths, alpha=alpha, back=back)
    assert got_alpha.data_ptr() == alpha.data_ptr() and got_back.data_ptr() == back.data_ptr()
    want_alpha, want_back = ctc_viterbi_forward_ref(emit, skip, lengths)
    assert (back != SENTINEL).all(), f"unwritten back-pointers ({msg})"
    assert torch.equal(back, want_back), msg
    # exact, NaN where the reference has NaN (a NaN emission propagates in both)
    torch.testing.assert_close(alpha, want_alpha, rtol=0, atol=0, equal_nan=True, msg=msg)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 1, 7), (2, 9, 1), (1, 12, 2), (4, 40, 33), (5, 23, 16),
                                   (2, 17, 32)])
def test_forward_equals_reference_bit_for_bit(shape):
    """Alpha and the back-pointers equal the torch loop's exactly, every element written (poisoned buffers):
    one-frame and one-state batches (no loop iterations / no neighbours), mixed lengths, Smax odd and even
    (padding past Smax inside the block), ties, -inf and NaN emissions."""
    seed, rng = _fresh_rng()
    for trial in range(3):
        emit, skip, lengths, _ = _random_forward_inputs(rng, *shape, rounded=trial % 3 == 0, special=trial == 2)
        _assert_forward_equal(emit, skip, lengths, f"seed {seed}, trial {trial}, shape {shape}")
    assert NEG == ctc.NEG  # the kernel's "unreachable" is the Viterbi's


def _assert_paths_equal(emit, skip, lengths, states, msg):
    B, Tmax, _ = emit.shape
    scores = torch.full((B,), float("nan"), dtype=torch.float64, device=DEV)
    paths = torch.full((B, Tmax), -SENTINEL, dtype=torch.int64, device=DEV)
    got_scores, got_paths = ctc_viterbi_paths(emit, skip, lengths, states, scores=scores, paths=paths)
    assert got_scores.data_ptr() == scores.data_ptr() and got_paths.data_ptr() == paths.data_ptr()
    want_scores, want_paths = ctc_viterbi_paths_ref(emit, skip, lengths, states)
    assert (paths != -SENTINEL).all(), f"unwritten path entries ({msg})"
    assert torch.equal(paths, want_paths), msg
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=0, equal_nan=True, msg=msg)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 1, 7), (2, 9, 1), (4, 40, 33), (5, 23, 16)])
def test_paths_equal_reference_bit_for_bit(shape):
    """The in-kernel back-trace: scores and paths (-1 past each length) equal the reference's walk exactly, every
    entry written, the end state chosen per utterance (S_b - 1 or S_b - 2, ties to the last), also where an
    utterance has no path (its score <= NEG / 2: -inf emissions) and where a NaN emission reaches the end."""
    seed, rng = _fresh_rng()
    for trial in range(3):
        emit, skip, lengths, states = _random_forward_inputs(rng, *shape, rounded=trial % 3 == 0,
                                                             special=trial == 2)
        _assert_paths_equal(emit, skip, lengths, states, f"seed {seed}, trial {trial}, shape {shape}")


def test_kernel_batch_equals_numpy():
    """``ctc_viterbi_batch_torch(kernel=True)`` against the numpy Viterbi on fresh random batches: the same paths,
    spans, scores and probabilities bit for bit; batches mix lengths, utterances with no path (too few frames,
    repeats that need a blank), no tokens (L = 0) and one frame."""
    seed, rng = _fresh_rng()
    compared = none = empty = 0
    for trial in range(9):
        items = []
        for _ in range(int(rng.integers(2, 6))):
            T, C, L = int(rng.integers(1, 41)), int(rng.integers(2, 7)), int(rng.integers(0, 17))
            lp = np.log(rng.dirichlet(np.ones(C) * 0.7, size=T)).astype(np.float32)
            if trial % 3 == 0:
                lp = np.round(lp)
            items.append((lp, [int(x) for x in rng.integers(1, C, size=L)]))
        if trial == 0:  # the edge cases, every run: no tokens, one frame, a repeat without room for its blank
            lp = np.log(rng.dirichlet(np.ones(4), size=3)).astype(np.float32)
            items += [(lp, []), (lp[:1], [2]), (lp[:2], [3, 3]), (lp, [1, 2, 1])]
        want = ctc_viterbi_batch(items, blank=0)
        got = ctc_viterbi_batch_torch([(torch.from_numpy(lp).to(DEV), tg) for lp, tg in items], blank=0,
                                      kernel=True)
        for k, (w, g) in enumerate(zip(want, got)):
            msg = f"seed {seed}, trial {trial}, item {k}"
            assert (w is None) == (g is None), msg
            if w is None:
                none += 1
                continue
            compared += 1
            empty += len(items[k][1]) == 0
            assert np.array_equal(g.path, w.path) and np.array_equal(g.spans, w.spans), msg
            assert g.score == w.score and np.array_equal(g.probs, w.probs), msg
    assert compared > 15 and none >= 2 and empty >= 1, (compared, none, empty)


def test_default_dispatch_uses_the_kernel_on_cuda_only():
    """kernel=None: the kernel for CUDA tensors up to MAX_STATES states, the torch loop otherwise."""
    assert ctc._viterbi_paths(torch.device("cuda"), 33) is ctc_viterbi_paths
    assert ctc._viterbi_paths(torch.device("cuda"), MAX_STATES) is ctc_viterbi_paths
    assert ctc._viterbi_paths(torch.device("cuda"), MAX_STATES + 1) is None
    assert ctc._viterbi_paths(torch.device("cpu"), 33) is None


def test_bad_inputs_get_clear_errors():
    rng = np.random.default_rng(5)
    emit, skip, lengths, states = _random_forward_inputs(rng, 2, 6, 5, rounded=False, special=False)
    with pytest.raises(ValueError, match=f"at most {MAX_STATES} states"):
        ctc_viterbi_forward(torch.full((1, 2, MAX_STATES + 1), -1.0, dtype=torch.float64, device=DEV),
                            torch.zeros((1, MAX_STATES + 1), dtype=torch.bool, device=DEV), [2])
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 6\]"):
        ctc_viterbi_forward(emit, skip, [0, 6])
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 6\]"):
        ctc_viterbi_forward(emit, skip, [3, 7])
    with pytest.raises(ValueError, match=r"lengths must be \(2,\) integers"):
        ctc_viterbi_forward(emit, skip, [3])
    with pytest.raises(ValueError, match="emit must be a .* float64"):
        ctc_viterbi_forward(emit.float(), skip, lengths)
    with pytest.raises(ValueError, match="skip must be a"):
        ctc_viterbi_forward(emit, skip[:, :4], lengths)
    with pytest.raises(ValueError, match="back must be a"):
        ctc_viterbi_forward(emit, skip, lengths, back=torch.zeros(2, 6, 5, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match=r"states must lie in \[1, 5\]"):
        ctc_viterbi_paths(emit, skip, lengths, [5, 6])
    with pytest.raises(ValueError, match="paths must be a"):
        ctc_viterbi_paths(emit, skip, lengths, states, paths=torch.zeros(2, 6, dtype=torch.int32, device=DEV))


@gpu_only
def test_real_shapes_on_the_gpu():
    """Aligner-sized batches (up to 40 s of frames, up to MAX_STATES states, one with -inf and NaN emissions)
    compiled: equal to the torch loop and the host back-trace."""
    seed, rng = _fresh_rng()
    for shape, special in (((16, 1500, 401), False), ((2, 2000, MAX_STATES), False), ((40, 700, 129), True)):
        emit, skip, lengths, states = _random_forward_inputs(rng, *shape, rounded=False, special=special)
        _assert_forward_equal(emit, skip, lengths, f"seed {seed}, shape {shape}")
        _assert_paths_equal(emit, skip, lengths, states, f"seed {seed}, shape {shape}")
