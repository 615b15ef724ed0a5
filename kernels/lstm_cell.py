"""An LSTM cell (PyTorch gate order i, f, g, o) run over many steps for a batch of independent streams, in fp32,
one launch for the whole sequence (the recurrence of Silero VAD, ``glmasr/vad.py``).

For every stream n < N and step t < T, from (h, c) = (h0[n], c0[n]):

    gates = gates_x[t, n] + W_hh @ h                  (4H,): the input projection (both biases included) is
                                                      precomputed by the caller for all steps
    i, f, g, o = gates.chunk(4)
    c = sigmoid(f) * c + sigmoid(i) * tanh(g);   h = sigmoid(o) * tanh(c)
    h, c = h * keep[t, n], c * keep[t, n]             only for t < K, when ``keep`` is given
    hs[t, n] = h

then h_out[n], c_out[n] = h, c. ``lstm_sequence_ref`` is that loop in plain torch (``torch.addmm`` per step);
``lstm_step`` / ``lstm_step_ref`` are one step (T = 1) with the interface of a single cell.

Design: each stream's recurrence is independent, so one program owns BLOCK_N streams for all T steps (no
grid-wide synchronisation, so the result does not depend on the grid); c stays in registers, W_hh (4H x H,
256 KiB at H = 128) is re-read every step (from L2; fastest stored column-major, ``w_hh.t().contiguous().t()``,
else the launcher makes that copy). h @ W_hh^T is ``tl.dot`` with ``input_precision="ieee"`` (fp32 FMAs, no TF32)
over K-chunks of KC columns of h, read back from where the program stored it (h0, then hs[t - 1], behind a
barrier): an FMA dot holds its whole K per thread, and a register tensor cannot be sliced. tl.dot needs
BLOCK_N >= 16; the rows past N are masked (never stored). The outputs may alias the inputs (h_out / hs[0] may be
h0, c_out c0): every thread has read a step's h before any thread writes the next one.

Numerics vs the reference: the same fp32 operations, except the 128-term dot products are summed in another
order and exp/tanh are Triton's (tanh as an odd polynomial near 0 and (1 - e^-2|x|) / (1 + e^-2|x|) elsewhere,
a few ulps); per step that is ~1e-7 relative on the state, and the recurrence does not grow it (the gates
saturate and f < 1 contracts c): the tests hold it to rtol = atol = 1e-5 over tens of steps.

Shapes (fp32, unit stride in the last dim; any row strides):
    gates_x (T, N, 4H); h0, c0 (N, H); w_hh (4H, H); hs (T, N, H); h_out, c_out (N, H);
    keep (K, N) or (K, N, 1) with K <= T, or None. H a power of two >= 16 (128 for Silero VAD).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from ._triton_utils import cdiv, check_device, interpreting
except ImportError:  # the references below stay usable without Triton
    triton = None

__all__ = ["lstm_sequence", "lstm_sequence_ref", "lstm_step", "lstm_step_ref"]


def lstm_sequence_ref(gates_x, h0, c0, w_hh, hs=None, h_out=None, c_out=None, keep=None):
    """Plain torch (the reference): see the module docstring. Returns (hs, h_out, c_out)."""
    steps, n, _ = gates_x.shape
    hidden = h0.shape[1]
    hs = gates_x.new_empty(steps, n, hidden) if hs is None else hs
    k = _keep_rows(keep, steps, n)
    h, c = h0, c0
    for t in range(steps):
        gates = torch.addmm(gates_x[t], h, w_hh.t())
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if k is not None and t < k.shape[0]:
            h = h * k[t, :, None]
            c = c * k[t, :, None]
        hs[t] = h
    h_out = h.clone() if h_out is None else h_out.copy_(h)
    c_out = c.clone() if c_out is None else c_out.copy_(c)
    return hs, h_out, c_out


def lstm_step_ref(gates_x_t, h, c, w_hh, out_h=None, out_c=None, hs_t=None, keep=None):
    """One step in plain torch: gates_x_t (N, 4H), h, c (N, H), keep (N,) / (N, 1) / None. Returns (h', c')."""
    _, out_h, out_c = lstm_sequence_ref(gates_x_t[None], h, c, w_hh, None if hs_t is None else hs_t[None],
                                        out_h, out_c, None if keep is None else keep.reshape(1, -1))
    return out_h, out_c


def _keep_rows(keep, steps, n):
    """keep (K, N) or (K, N, 1) -> (K, N) view, checked."""
    if keep is None:
        return None
    k = keep.reshape(keep.shape[0], -1) if keep.ndim == 3 else keep
    if k.ndim != 2 or k.shape[1] != n or k.shape[0] > steps or (keep.ndim == 3 and keep.shape[2] != 1):
        raise ValueError(f"keep must be (K, {n}) or (K, {n}, 1) with K <= {steps}, got {tuple(keep.shape)}")
    return k


if triton is not None:

    @triton.jit
    def _tanh(x):
        # Odd Taylor polynomial near 0 (where 1 - e would cancel), the exp form elsewhere: a few ulps everywhere.
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        big = (1.0 - e) / (1.0 + e)
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        return tl.where(a < 0.125, small, tl.where(x < 0, -big, big))

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _lstm_sequence_kernel(G, H0, C0, W, HS, HO, CO, KEEP, N, STEPS, K,
                              sg_t, sg_n, sh0, sc0, swj, swk, shs_t, shs_n, sho, sco, sk_t, sk_n,
                              HID: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr,
                              HAS_KEEP: tl.constexpr, STEPS_HINT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, HID)
        kcols = tl.arange(0, KC)
        mask = rmask[:, None] & (cols < HID)[None, :]
        h = tl.zeros([BLOCK_N, HID], dtype=tl.float32)
        c = tl.load(C0 + rows64[:, None] * sc0 + cols[None, :], mask=mask, other=0.0)
        # h is read back in K-chunks from where it was stored (h0, then hs[t - 1]); see the module docstring.
        src = H0 + rows64[:, None] * sh0  # (BLOCK_N, 1) row pointers of this step's h
        dst = HS + rows64[:, None] * shs_n  # hs[t]
        gp = G + rows64[:, None] * sg_n + cols[None, :]  # advanced by one step per iteration (64-bit pointers)
        kp = KEEP + rows64 * sk_n
        # STEPS_HINT (interpreter only): its range() cannot take a runtime scalar (NumPy >= 2.3).
        for t in range(STEPS if STEPS_HINT is None else STEPS_HINT):
            # One gate at a time (f, i, g, o), so at most two accumulators are live.
            gi = tl.load(gp, mask=mask, other=0.0)
            gf = tl.load(gp + HID, mask=mask, other=0.0)
            gg = tl.load(gp + 2 * HID, mask=mask, other=0.0)
            go = tl.load(gp + 3 * HID, mask=mask, other=0.0)
            # A rolled loop over K-chunks: unrolled, the compiler issues every chunk's W loads up front and spills.
            for k0 in tl.range(0, HID, KC, loop_unroll_factor=1):
                a = tl.load(src + k0 + kcols[None, :], mask=rmask[:, None], other=0.0)  # (BLOCK_N, KC)
                wt = W + cols[None, :] * swj + (k0 + kcols)[:, None] * swk  # (KC, HID): W_i^T[k, j] = W[j, k]
                gi = tl.dot(a, tl.load(wt), gi, input_precision="ieee")
                gf = tl.dot(a, tl.load(wt + HID * swj), gf, input_precision="ieee")
                gg = tl.dot(a, tl.load(wt + 2 * HID * swj), gg, input_precision="ieee")
                go = tl.dot(a, tl.load(wt + 3 * HID * swj), go, input_precision="ieee")
            c = _sigmoid(gf) * c + _sigmoid(gi) * _tanh(gg)
            h = _sigmoid(go) * _tanh(c)
            if HAS_KEEP:
                kv = tl.load(kp, mask=rmask & (t < K), other=1.0)
                h = h * kv[:, None]
                c = c * kv[:, None]
                kp += sk_t
            tl.debug_barrier()  # every thread has read this step's h (hs[0] may alias h0) ...
            tl.store(dst + cols[None, :], h, mask=mask)
            tl.debug_barrier()  # ... and hs[t] is written by all threads before any reads it back
            src = dst
            dst += shs_t
            gp += sg_t
        tl.store(HO + rows64[:, None] * sho + cols[None, :], h, mask=mask)
        tl.store(CO + rows64[:, None] * sco + cols[None, :], c, mask=mask)


def _unit_last(x, name):
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim")
    return x


def lstm_sequence(gates_x, h0, c0, w_hh, hs=None, h_out=None, c_out=None, keep=None, block_n=16, kc=16, num_warps=8):
    """The whole recurrence in one launch (module docstring). Allocates hs, h_out, c_out when None; h_out / c_out
    may be h0 / c0 (in place). Returns (hs, h_out, c_out)."""
    check_device(gates_x, h0, c0, w_hh, hs, h_out, c_out, keep)
    steps, n, four_h = gates_x.shape
    hidden = w_hh.shape[1]
    if w_hh.shape != (four_h, hidden) or four_h != 4 * hidden or h0.shape != (n, hidden) or c0.shape != (n, hidden):
        raise ValueError(f"shapes: gates_x {tuple(gates_x.shape)}, h0 {tuple(h0.shape)}, c0 {tuple(c0.shape)}, "
                         f"w_hh {tuple(w_hh.shape)} (expected (T, N, 4H), (N, H), (N, H), (4H, H))")
    if hidden < 16 or hidden & (hidden - 1):
        raise ValueError(f"hidden size must be a power of two >= 16, got {hidden}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    tensors = [gates_x, h0, c0, w_hh] + [t for t in (hs, h_out, c_out, keep) if t is not None]
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError("lstm_sequence is fp32 only")
    gates_x, h0, c0 = (x if x.stride(-1) == 1 else x.contiguous() for x in (gates_x, h0, c0))
    hs = gates_x.new_empty(steps, n, hidden) if hs is None else _unit_last(hs, "hs")
    h_out = torch.empty_like(h0, memory_format=torch.contiguous_format) if h_out is None else _unit_last(h_out, "h_out")
    c_out = torch.empty_like(c0, memory_format=torch.contiguous_format) if c_out is None else _unit_last(c_out, "c_out")
    if hs.shape != (steps, n, hidden) or h_out.shape != (n, hidden) or c_out.shape != (n, hidden):
        raise ValueError("hs must be (T, N, H), h_out and c_out (N, H)")
    if w_hh.stride(0) != 1:  # W^T contiguous: coalesced (KC, H) tiles and no spills (ptxas, sm_90, 8 warps)
        w_hh = w_hh.t().contiguous().t()
    k = _keep_rows(keep, steps, n)
    if n == 0 or steps == 0:
        if steps == 0:
            h_out.copy_(h0)
            c_out.copy_(c0)
        return hs, h_out, c_out
    kk = k if k is not None else h0  # never read without HAS_KEEP
    _lstm_sequence_kernel[(cdiv(n, block_n),)](
        gates_x, h0, c0, w_hh, hs, h_out, c_out, kk, n, steps, 0 if k is None else k.shape[0],
        gates_x.stride(0), gates_x.stride(1), h0.stride(0), c0.stride(0), w_hh.stride(0), w_hh.stride(1),
        hs.stride(0), hs.stride(1), h_out.stride(0), c_out.stride(0),
        kk.stride(0) if k is not None else 0, kk.stride(1) if k is not None else 0,
        HID=hidden, BLOCK_N=block_n, KC=min(kc, hidden), HAS_KEEP=k is not None,
        STEPS_HINT=steps if interpreting() else None, num_warps=num_warps, num_stages=1)
    return hs, h_out, c_out


def lstm_step(gates_x_t, h, c, w_hh, out_h=None, out_c=None, hs_t=None, keep=None, block_n=16, num_warps=8):
    """One step (the same kernel with T = 1): gates_x_t (N, 4H), h, c (N, H) -> (h', c') written to out_h, out_c
    (allocated when None; may be h, c) and to hs_t (N, H) when given; keep (N,) / (N, 1) / None."""
    check_device(gates_x_t, h, c, w_hh, out_h, out_c, hs_t, keep)
    n = gates_x_t.shape[0]
    hidden = w_hh.shape[1]
    out_h = torch.empty(n, hidden, device=h.device, dtype=h.dtype) if out_h is None else out_h
    out_c = torch.empty(n, hidden, device=c.device, dtype=c.dtype) if out_c is None else out_c
    # hs_t None: h' goes to out_h twice (same program, same value), no scratch buffer.
    _unit_last(out_h, "out_h")
    hs = (out_h if hs_t is None else hs_t)[None]
    lstm_sequence(gates_x_t[None], h, c, w_hh, hs, out_h, out_c, None if keep is None else keep.reshape(1, -1),
                  block_n=block_n, num_warps=num_warps)
    return out_h, out_c
