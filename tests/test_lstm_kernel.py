"""The LSTM recurrence kernel (kernels/lstm_cell.py) against its plain-PyTorch reference.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here when there is no GPU), a few to twenty steps. GPU: the same
tests compiled, plus a real-shape one (skipped without CUDA). Inputs are fresh random draws (never zeros), every
output buffer is NaN-poisoned first, and N is never only a multiple of the 16-stream block.

Tolerance rtol = atol = 1e-5 (fp32): the kernel does the reference's operations in fp32 except that the 128-term
dot products h @ W_hh^T are summed in another order and exp/tanh are its own (a few ulps); gates are O(1), so each
step differs by ~1e-7 absolute, and the recurrence does not grow it (saturating gates, forget gate < 1): measured
<= 5e-7 over 12 steps in the interpreter. The error is absolute-like (state values near 0 carry the same ~1e-7), so
the atol term matters as much as the rtol one.
"""

from __future__ import annotations


import pytest
import torch

from conftest import DEV, gpu_only, require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

from glmasr_kernels.lstm_cell import lstm_sequence, lstm_sequence_ref, lstm_step, lstm_step_ref  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
H = 128


def _inputs(steps, n, seed, hidden=H):
    g = torch.Generator().manual_seed(seed)
    gates_x = torch.randn(steps, n, 4 * hidden, generator=g) * 1.5
    w_hh = torch.randn(4 * hidden, hidden, generator=g) * (1.5 / hidden ** 0.5)
    h0 = torch.rand(n, hidden, generator=g) * 2 - 1
    c0 = torch.randn(n, hidden, generator=g)
    return [t.to(DEV) for t in (gates_x, w_hh, h0, c0)]


def _keep(k, n, seed, three_d):
    g = torch.Generator().manual_seed(seed + 1)
    keep = (torch.rand(k, n, generator=g) > 0.4).float()
    return (keep.unsqueeze(-1) if three_d else keep).to(DEV)


def _nan(*shape):
    return torch.full(shape, float("nan"), device=DEV)


@pytest.mark.parametrize("n", [1, 7, 37, 256, 300])
@pytest.mark.parametrize("keep_form", [None, "2d", "3d"])
def test_sequence_matches_reference(n, keep_form):
    steps = 12 if n < 100 else 5
    gates_x, w_hh, h0, c0 = _inputs(steps, n, seed=n)
    keep = None if keep_form is None else _keep(min(4, steps), n, seed=n, three_d=keep_form == "3d")
    hs, h_out, c_out = _nan(steps, n, H), _nan(n, H), _nan(n, H)
    lstm_sequence(gates_x, h0, c0, w_hh, hs, h_out, c_out, keep=keep)
    ref_hs, ref_h, ref_c = lstm_sequence_ref(gates_x, h0, c0, w_hh, keep=keep)
    torch.testing.assert_close(hs, ref_hs, **TOL)
    torch.testing.assert_close(h_out, ref_h, **TOL)
    torch.testing.assert_close(c_out, ref_c, **TOL)
    torch.testing.assert_close(h_out, hs[-1], rtol=0, atol=0)
    if keep is not None:  # streams held at zero through the masked steps
        k = keep.reshape(keep.shape[0], n)
        dropped = k[-1] == 0
        assert (hs[keep.shape[0] - 1][dropped] == 0).all()


def test_in_place_strided_and_allocated():
    """Outputs aliasing the inputs (h_out is h0, c_out is c0), gates_x and hs as strided views of bigger buffers,
    a row-major W_hh (the launcher re-lays it), a larger block, and the launcher allocating everything."""
    steps, n = 9, 21
    gates_x, w_hh, h0, c0 = _inputs(steps, n, seed=11)
    ref_hs, ref_h, ref_c = lstm_sequence_ref(gates_x, h0, c0, w_hh)
    big = torch.randn(steps, n + 5, 4 * H + 64, device=DEV)
    big[:, 3:3 + n, 32:32 + 4 * H] = gates_x
    g_view = big[:, 3:3 + n, 32:32 + 4 * H]
    hs_big = _nan(steps, n + 2, H + 16)
    hs_view = hs_big[:, 1:1 + n, 8:8 + H]
    h, c = h0.clone(), c0.clone()
    lstm_sequence(g_view, h, c, w_hh, hs_view, h, c, block_n=32)
    torch.testing.assert_close(hs_view, ref_hs, **TOL)
    torch.testing.assert_close(h, ref_h, **TOL)
    torch.testing.assert_close(c, ref_c, **TOL)
    assert hs_big[:, 0].isnan().all() and hs_big[:, 1 + n].isnan().all()  # nothing outside the view written
    assert hs_big[:, :, :8].isnan().all() and hs_big[:, :, 8 + H:].isnan().all()
    hs2, h2, c2 = lstm_sequence(gates_x, h0, c0, w_hh.t().contiguous().t())
    torch.testing.assert_close(hs2, ref_hs, **TOL)
    torch.testing.assert_close(c2, ref_c, **TOL)


@pytest.mark.parametrize("n", [1, 19])
@pytest.mark.parametrize("keep_form", [None, "1d", "2d"])
def test_step_matches_reference(n, keep_form):
    gates_x, w_hh, h, c = _inputs(1, n, seed=100 + n)
    keep = None
    if keep_form is not None:
        keep = _keep(1, n, seed=n, three_d=False)[0]
        keep = keep if keep_form == "1d" else keep[:, None]
    ref_h, ref_c = lstm_step_ref(gates_x[0], h, c, w_hh, keep=keep)
    out_h, out_c, hs_t = _nan(n, H), _nan(n, H), _nan(n, H)
    lstm_step(gates_x[0], h, c, w_hh, out_h, out_c, hs_t, keep=keep)
    torch.testing.assert_close(out_h, ref_h, **TOL)
    torch.testing.assert_close(out_c, ref_c, **TOL)
    torch.testing.assert_close(hs_t, out_h, rtol=0, atol=0)
    h2, c2 = lstm_step(gates_x[0], h, c, w_hh, keep=keep)  # allocated, no hs_t
    torch.testing.assert_close(h2, ref_h, **TOL)
    torch.testing.assert_close(c2, ref_c, **TOL)
    h3, c3 = h.clone(), c.clone()
    lstm_step(gates_x[0], h3, c3, w_hh, h3, c3, keep=keep)  # in place (hs[0] is then h0 itself)
    torch.testing.assert_close(h3, ref_h, **TOL)
    torch.testing.assert_close(c3, ref_c, **TOL)


def test_zero_steps_and_bad_inputs():
    gates_x, w_hh, h0, c0 = _inputs(3, 5, seed=3)
    hs, h, c = lstm_sequence(gates_x[:0], h0, c0, w_hh, h_out=_nan(5, H), c_out=_nan(5, H))
    assert hs.shape == (0, 5, H) and torch.equal(h, h0) and torch.equal(c, c0)
    with pytest.raises(ValueError, match="shapes"):
        lstm_sequence(gates_x, h0[:4], c0, w_hh)
    with pytest.raises(ValueError, match="keep"):
        lstm_sequence(gates_x, h0, c0, w_hh, keep=torch.ones(4, 5, device=DEV))  # K > T
    with pytest.raises(ValueError, match="fp32"):
        lstm_sequence(gates_x.double(), h0.double(), c0.double(), w_hh.double())
    with pytest.raises(ValueError, match="block_n"):
        lstm_sequence(gates_x, h0, c0, w_hh, block_n=8)


@gpu_only
def test_real_shape_on_gpu():
    """256 streams (the VAD's batch) plus an odd count, 200 steps, a leading keep mask."""
    for n in (256, 301):
        gates_x, w_hh, h0, c0 = _inputs(200, n, seed=7)
        keep = _keep(62, n, seed=7, three_d=True)
        hs, h, c = _nan(200, n, H), _nan(n, H), _nan(n, H)
        lstm_sequence(gates_x, h0, c0, w_hh, hs, h, c, keep=keep)
        ref_hs, ref_h, ref_c = lstm_sequence_ref(gates_x, h0, c0, w_hh, keep=keep)
        err = (hs - ref_hs).abs().max().item()
        print(f"\nN={n}, 200 steps: max |kernel - torch| = {err:.1e}")
        torch.testing.assert_close(hs, ref_hs, rtol=1e-4, atol=1e-4)  # 200 steps: ~1e-7 per step, some growth
        torch.testing.assert_close(c, ref_c, rtol=1e-4, atol=1e-4)
