"""kernels/persistent_decode.py: the batch-1 decode step over all layers against its plain-PyTorch reference.

CPU (TRITON_INTERPRET=1): the staged launch (one launch per layer and stage: the same stage code, kernel
boundaries for barriers; the interpreter runs programs one after another, so a spin barrier cannot run there).
GPU: the staged and the persistent launch (grid barriers), which must agree bit for bit, both against the
reference; the persistent launch inside a CUDA graph; the error flag stays clear.
"""

import os

import pytest
import torch

from glmasr_kernels import persistent_decode as pd
from glmasr_kernels.rope import build_rope_cache

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 for the CPU")

# (layers, hidden, q heads, kv heads, head_dim, intermediate): tiny (down has 2 K tiles of 64 under the
# interpreter: hidden 64 sets BK), and on the GPU the real widths with 2 layers
TINY = (2, 64, 4, 2, 16, 96)
REAL = (2, 2048, 16, 4, 128, 6144)


def _problem(shape, dtype, capacity, seed, batch=3):
    n_layers, hidden, nq, nk, d, inter = shape
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to(DEV, dtype)

    w = pd.PersistentWeights(rnd(n_layers, (nq + 2 * nk) * d, hidden, scale=hidden ** -0.5),
                             rnd(n_layers, hidden, nq * d, scale=(nq * d) ** -0.5),
                             rnd(n_layers, 2 * inter, hidden, scale=hidden ** -0.5),
                             rnd(n_layers, hidden, inter, scale=inter ** -0.5),
                             1 + rnd(n_layers, hidden, scale=0.1), 1 + rnd(n_layers, hidden, scale=0.1))
    kc = rnd(n_layers, batch, nk, capacity, d, scale=1.0)
    vc = rnd(n_layers, batch, nk, capacity, d, scale=1.0)
    res = rnd(1, hidden, scale=1.0)
    cos, sin = build_rope_cache(d, 4096, 10000.0, device=DEV)
    ws = pd.PersistentWorkspace((nq + 2 * nk) * d, nq, d, inter, DEV, dtype)
    # poisoned: an element a stage leaves unwritten but the next one reads shows up as NaN
    for t in (ws.qkv, ws.partial, ws.lse, ws.act):
        t.fill_(float("nan"))
    return w, kc, vc, res, cos, sin, ws


def _run(fn, w, kc, vc, res, cos, sin, lengths, rows, max_len, **kw):
    kc, vc, res = kc.clone(), vc.clone(), res.clone()
    out = fn(res, w, kc, vc, cos, sin, lengths, cache_rows=rows, max_len=max_len, **kw)
    return out, kc, vc


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("programs", [3, 4, 8])
@pytest.mark.parametrize("length,max_len", [(1, 16), (23, 40), (40, 40), (70, 96)])
def test_staged_equals_reference_fp32(programs, length, max_len):
    """fp32: the kernel's roundings are the reference's up to the fp32 summation order; 1e-5 relative to the
    largest element is ~30x the observed difference. 3 / 4 / 8 programs: several row blocks per program and
    idle programs; lengths: the first position, a partial chunk, a full bucket, several context splits."""
    w, kc, vc, res, cos, sin, ws = _problem(TINY, torch.float32, 96, seed=programs + length)
    lengths = torch.tensor([length], device=DEV)
    rows = torch.tensor([1], device=DEV)
    out, k1, v1 = _run(pd.persistent_decode, w, kc, vc, res, cos, sin, lengths, rows, max_len, workspace=ws,
                       persistent=False, programs=programs)
    ref, k2, v2 = _run(pd.persistent_decode_ref, w, kc, vc, res, cos, sin, lengths, rows, max_len)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    assert torch.allclose(k1, k2, rtol=1e-5, atol=1e-6) and torch.allclose(v1, v2, rtol=1e-5, atol=1e-6)
    # the new token's slot of row 1 was written in every layer; other rows untouched
    assert (k1[:, [0, 2]] == kc[:, [0, 2]]).all()
    assert not torch.equal(k1[:, 1, :, length - 1], kc[:, 1, :, length - 1])


def test_staged_default_row_and_input_validation():
    w, kc, vc, res, cos, sin, ws = _problem(TINY, torch.float32, 32, seed=3)
    lengths = torch.tensor([9], device=DEV)
    out, k1, _ = _run(pd.persistent_decode, w, kc, vc, res, cos, sin, lengths, None, 32, workspace=ws,
                      persistent=False)
    ref, k2, _ = _run(pd.persistent_decode_ref, w, kc, vc, res, cos, sin, lengths, None, 32)
    assert _rel(out, ref) < 1e-5 and torch.allclose(k1, k2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="res must be"):
        pd.persistent_decode(res.expand(2, -1).contiguous(), w, kc, vc, cos, sin, lengths, ws, persistent=False)
    with pytest.raises(ValueError, match="wgu must be"):
        bad = pd.PersistentWeights(w.wqkv, w.wo, w.wgu[:, :-2].contiguous(), w.wdown, w.ln1, w.ln2)
        pd.persistent_decode(res.clone(), bad, kc, vc, cos, sin, lengths, ws, persistent=False)
    with pytest.raises(ValueError, match="max_len 64 > cache capacity 32"):
        pd.persistent_decode(res.clone(), w, kc, vc, cos, sin, lengths, ws, max_len=64, persistent=False)
    assert pd.supports(4096, 32, 8, 128) is not None and pd.supports(2048, 16, 4, 128) is None


@pytest.mark.skipif(not CUDA, reason="the persistent launch (grid barriers) needs a CUDA GPU")
@pytest.mark.parametrize("shape", [TINY, REAL], ids=["tiny", "real-widths"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_persistent_equals_staged_and_reference_gpu(shape, dtype):
    """The persistent launch runs the staged launch's arithmetic in the same order: bit-identical outputs and
    cache writes. Against the reference: fp32 1e-5 relative; bf16 within 2e-2 of the largest element (the
    reference rounds the same points but sums in another order, and bf16 rounding differences then propagate
    through 2 layers x 5 stages; the engine tests check tokens)."""
    for length, max_len in ((1, 64), (64, 64), (300, 320), (1000, 1024)):
        w, kc, vc, res, cos, sin, ws = _problem(shape, dtype, 1024, seed=length)
        lengths = torch.tensor([length], device=DEV)
        rows = torch.tensor([2], device=DEV)
        a, ka, va = _run(pd.persistent_decode, w, kc, vc, res, cos, sin, lengths, rows, max_len, workspace=ws,
                         persistent=True)
        b, kb, vb = _run(pd.persistent_decode, w, kc, vc, res, cos, sin, lengths, rows, max_len, workspace=ws,
                         persistent=False)
        ref, kr, _ = _run(pd.persistent_decode_ref, w, kc, vc, res, cos, sin, lengths, rows, max_len)
        assert not ws.error()
        assert torch.equal(a, b) and torch.equal(ka, kb) and torch.equal(va, vb), (length, max_len)
        assert torch.isfinite(a).all()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert _rel(a, ref) < tol, (length, _rel(a, ref))
        assert _rel(ka, kr) < tol
        assert ws.counters[:2].tolist() == [0, 0]  # reset by the last program out


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
def test_persistent_in_cuda_graph_replays_like_eager():
    """Captured once, replayed for consecutive positions: each replay equals an eager launch from the same
    state (the counters reset themselves between launches, so replays never see a stale barrier count)."""
    w, kc, vc, res, cos, sin, ws = _problem(REAL, torch.bfloat16, 256, seed=5)
    lengths = torch.tensor([10], device=DEV)
    static_res = res.clone()
    k_graph, v_graph = kc.clone(), vc.clone()
    pd.persistent_decode(static_res.clone(), w, k_graph.clone(), v_graph.clone(), cos, sin, lengths, ws, max_len=128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pd.persistent_decode(static_res, w, k_graph, v_graph, cos, sin, lengths, ws, max_len=128)
    k_eager, v_eager = kc.clone(), vc.clone()
    for step in range(5):
        lengths.fill_(10 + step)
        start = torch.randn(res.shape, generator=torch.Generator().manual_seed(step)).to(DEV, res.dtype)
        static_res.copy_(start)
        graph.replay()
        eager = pd.persistent_decode(start.clone(), w, k_eager, v_eager, cos, sin, lengths, ws, max_len=128)
        torch.cuda.synchronize()
        assert torch.equal(static_res, eager), step
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager)
    assert not ws.error()
