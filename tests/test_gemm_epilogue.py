"""Encoder GEMMs with fused epilogues (kernels/gemm_epilogue.py) vs their plain-PyTorch references.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here automatically when there is no GPU) at small, odd shapes
(M = 37 / 5, N = 50 / 33, K = 72 / 200 / 37: ragged M and N tiles, K % BLOCK_K != 0, and K = 37 whose rows are
not 16-byte aligned so TMA configs fall back to pointer loads), every epilogue, fp32 and bf16, pointer / TMA /
persistent / split-epilogue configs, in-place residual, leading dims and strided rows, bad inputs. GPU: the same
compiled, plus the encoder's real shapes at M = 1500 and 3000 (skipped without CUDA) and a CUDA-graph capture.

Inputs: fresh torch.randn draws with a per-test seed, never zeros (x ~ N(0, 1), W ~ N(0, 1/K) so acc ~ N(0, 1),
bias ~ N(0, 0.25), residual ~ N(0, 1)); outputs are poisoned with NaN first (``out=``), so an unwritten element
fails.

Tolerances (elementwise, torch.testing.assert_close):
* fp32: rtol = atol = 1e-5 * max(1, sqrt(K / 64)). The kernel sums the K products in another order than the
  reference matmul; each partial sum is O(1) here and carries a ~2**-24 relative rounding error, and those errors
  add up like a random walk over the K additions, i.e. ~6e-8 * sqrt(K) absolute: at K = 5120 ~4e-6, well under
  1e-5 * sqrt(80) ~ 9e-5 and never below the house 1e-5. GELU (erf) and the residual add are fp32 in both.
* bf16: rtol = 2e-2, atol = 1e-2. Both round at the same points (acc + b; GELU; residual + m), so a difference
  can only come from an fp32 accumulator landing on the other side of a bf16 rounding boundary (1 ulp =
  2**-8..2**-7 relative), carried through the second rounding (GELU / residual: up to 2 ulps = 1.6e-2), plus
  <= 1 ulp because the CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest. On the GPU (round
  to nearest) >= 95 % of the elements must also be bit-identical to the reference.
* residual epilogue: the bound is atol + rtol * max(|ref|, |m|), m = round(acc + b) the GEMM output that was
  added: m's rounding error is relative to |m| and residual + m may cancel to far less than |m|.
"""

from __future__ import annotations

import math
import os
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from glmasr_kernels import gemm_epilogue as ge  # noqa: E402
from glmasr_kernels.gemm_epilogue import (  # noqa: E402
    CANDIDATES, CONFIGS, GemmConfig, linear_bias, linear_bias_ref, linear_bias_residual, linear_bias_residual_ref,
    linear_gelu, linear_gelu_ref, select)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)
gpu_only = pytest.mark.skipif(not CUDA, reason="real encoder shapes need a CUDA GPU (too slow for the CPU interpreter)")
BF = torch.bfloat16
DTYPES = [torch.float32, torch.bfloat16]
C = GemmConfig
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def tol(dtype, k):
    if dtype == torch.float32:
        t = 1e-5 * max(1.0, math.sqrt(k / 64))
        return dict(rtol=t, atol=t)
    return dict(rtol=2e-2, atol=1e-2)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype)


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def close(out, ref, dtype, k, min_identical=0.95, scale=None):
    """assert_close at ``tol``; with ``scale`` (the residual epilogue: |m| of the GEMM output that was added),
    |out - ref| <= atol + rtol * max(|ref|, |scale|) instead: m's rounding error is relative to |m|, and
    residual + m can cancel to far below |m|."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "NaN/Inf in output (unwritten element?)"
    t = tol(dtype, k)
    if scale is None:
        torch.testing.assert_close(out.float(), ref.float(), **t)
    else:
        err = (out.float() - ref.float()).abs()
        bound = t["atol"] + t["rtol"] * torch.maximum(ref.float().abs(), scale.float().abs())
        bad = err > bound
        assert not bad.any(), f"{int(bad.sum())} / {bad.numel()} elements off; max abs err {err.max().item():.3g}"
    if CUDA and dtype == BF:
        same = (out == ref).float().mean().item()
        assert same >= min_identical, f"only {same:.4f} of the elements bit-identical to the reference"


def problem(m, n, k, dtype, seed, residual=False):
    x = randn(m, k, dtype=dtype, seed=seed)
    w = randn(n, k, dtype=dtype, seed=seed + 1, scale=k ** -0.5)
    b = randn(n, dtype=dtype, seed=seed + 2, scale=0.5)
    r = randn(m, n, dtype=dtype, seed=seed + 3) if residual else None
    return x, w, b, r


def seed_of(*key):
    return zlib.crc32(repr(key).encode()) % 100000


EPILOGUES = {
    "bias": (linear_bias, linear_bias_ref, False),
    "gelu": (linear_gelu, linear_gelu_ref, False),
    "residual": (linear_bias_residual, linear_bias_residual_ref, True),
}


def call(name, x, w, b, r, out=None, config=None):
    """(kernel output, reference, scale for ``close``: the rounded GEMM output m for the residual epilogue)."""
    fn, ref_fn, res = EPILOGUES[name]
    if res:
        return fn(x, w, b, r, out=out, config=config), ref_fn(x, w, b, r), linear_bias_ref(x, w, b)
    return fn(x, w, b, out=out, config=config), ref_fn(x, w, b), None


# small configs: pointer path (clamped rows, masked K), GROUP_M swizzle with a ragged last group, TMA, persistent
# (several tiles per program, the last round partly empty), split epilogues (2 / 4 column slices)
SMALL_CFGS = [
    None,  # select(): INTERPRET_DEFAULT under the interpreter, the tuned table on the GPU
    C(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
    C(16, 16, 16, group_m=3, num_warps=4, num_stages=2, persistent=True),
    C(16, 32, 16, group_m=3, num_warps=4, num_stages=2, tma=True),
    C(32, 32, 32, group_m=1, num_warps=4, num_stages=2, tma=True, persistent=True, epilogue_split=2),
    C(16, 64, 32, group_m=4, num_warps=4, num_stages=2, epilogue_split=4),
]
SMALL_SHAPES = [(37, 50, 72), (5, 33, 200), (19, 40, 37)]


def _cfg_id(c):
    return "select" if c is None else c.short().replace(" ", "-")


@pytest.mark.parametrize("cfg", SMALL_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("epi", list(EPILOGUES))
def test_small(epi, dtype, cfg):
    for m, n, k in SMALL_SHAPES:
        x, w, b, r = problem(m, n, k, dtype, seed_of(epi, dtype, m, n, k), residual=EPILOGUES[epi][2])
        out = poisoned(m, n, dtype=dtype)
        y, ref, scale = call(epi, x, w, b, r, out=out, config=cfg)
        assert y is out
        close(out, ref, dtype, k, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [None, C(16, 16, 32, num_warps=4, num_stages=2, tma=True, persistent=True)],
                         ids=_cfg_id)
def test_residual_in_place(dtype, cfg):
    m, n, k = 37, 50, 72
    x, w, b, r = problem(m, n, k, dtype, seed_of("inplace", dtype), residual=True)
    ref = linear_bias_residual_ref(x, w, b, r.clone())
    y = linear_bias_residual(x, w, b, r, out=r, config=cfg)
    assert y is r
    close(r, ref, dtype, k, scale=linear_bias_ref(x, w, b))
    # leading dims, in place on a 3-D residual view
    r3 = randn(2, 3, n, dtype=dtype, seed=7)
    x3 = randn(2, 3, k, dtype=dtype, seed=8)
    ref3 = linear_bias_residual_ref(x3, w, b, r3.clone())
    assert linear_bias_residual(x3, w, b, r3, out=r3, config=cfg) is r3
    close(r3, ref3, dtype, k, scale=linear_bias_ref(x3, w, b))


def test_no_bias_allocation_and_leading_dims():
    k, n = 72, 33
    x = randn(2, 3, k, dtype=BF, seed=11)
    w = randn(n, k, dtype=BF, seed=12, scale=k ** -0.5)
    for fn, ref_fn in ((linear_bias, linear_bias_ref), (linear_gelu, linear_gelu_ref)):
        y = fn(x, w, None)
        assert y.shape == (2, 3, n)
        close(y, ref_fn(x, w, None), BF, k)
    r = randn(2, 3, n, dtype=BF, seed=13)
    close(linear_bias_residual(x, w, None, r), linear_bias_residual_ref(x, w, None, r), BF, k,
          scale=linear_bias_ref(x, w, None))
    # empty M
    assert linear_bias(x[:0], w, None).shape == (0, 3, n)


def test_strided_rows():
    # x a column slice (row stride 2K), W a slice of a bigger matrix (row stride K + 16), out a slice too
    k, n, m = 72, 37, 21
    x = randn(m, 2 * k, dtype=BF, seed=21)[:, :k]
    big = randn(n + 5, k + 16, dtype=BF, seed=22, scale=k ** -0.5)
    w = big[2:2 + n, 8:8 + k]
    b = randn(n, dtype=BF, seed=23)
    obuf = poisoned(m, n + 9, dtype=BF)
    out = obuf[:, 3:3 + n]
    for cfg in (None, C(16, 16, 32, num_warps=4, num_stages=2, tma=True)):
        obuf.fill_(float("nan"))
        linear_gelu(x, w, b, out=out, config=cfg)
        close(out, linear_gelu_ref(x, w, b), BF, k)
        assert torch.isnan(obuf[:, :3]).all() and torch.isnan(obuf[:, 3 + n:]).all(), "wrote outside out"


def test_bad_inputs():
    k, n = 32, 48
    x = randn(4, k, dtype=BF, seed=31)
    w = randn(n, k, dtype=BF, seed=32)
    b = randn(n, dtype=BF, seed=33)
    r = randn(4, n, dtype=BF, seed=34)
    with pytest.raises(ValueError, match=r"x \(4, 32\).*w.shape\[1\] = 48"):
        linear_bias(x, randn(n, 48, dtype=BF, seed=1), None)
    with pytest.raises(ValueError, match=r"w \(48, 32\) dtype torch.float32 != x dtype torch.bfloat16"):
        linear_bias(x, w.float(), None)
    with pytest.raises(ValueError, match=r"w \(48, 32\) must have unit stride along K"):
        linear_bias(x, randn(k, n, dtype=BF, seed=2).t(), None)
    with pytest.raises(ValueError, match=r"x \(4, 32\) must have unit stride in its last dim"):
        linear_bias(randn(k, 4, dtype=BF, seed=3).t(), w, None)
    with pytest.raises(ValueError, match=r"w \(48, 32, 1\) must be 2-D"):
        linear_bias(x, w[..., None], None)
    with pytest.raises(ValueError, match=r"bias \(47,\) must be \(48,\)"):
        linear_gelu(x, w, b[:47])
    with pytest.raises(ValueError, match=r"residual \(4, 47\) must have the output shape \(4, 48\)"):
        linear_bias_residual(x, w, b, r[:, :47])
    with pytest.raises(ValueError, match=r"x dtype torch.int32 unsupported"):
        linear_bias(x.to(torch.int32), w.to(torch.int32), None)
    with pytest.raises(ValueError, match=r"out \(4, 47\) must have shape \(4, 48\)"):
        linear_bias(x, w, b, out=r[:, :47].clone())
    big = randn(4, 2 * n, dtype=BF, seed=35)
    with pytest.raises(ValueError, match=r"out \(4, 32\) overlaps x"):
        linear_bias(x, randn(k, k, dtype=BF, seed=4), None, out=x)
    with pytest.raises(ValueError, match=r"partially overlaps residual"):
        linear_bias_residual(x, w, b, big[:, :n], out=big[:, 1:1 + n])
    with pytest.raises(ValueError, match=r"GemmConfig.block_k must be a power of two >= 16"):
        C(128, 128, 24)
    with pytest.raises(ValueError, match=r"epilogue_split"):
        C(128, 32, 64, epilogue_split=4)


def test_tables():
    for key in [(3840, 1280), (1280, 1280), (5120, 1280), (1280, 5120)]:
        assert isinstance(CONFIGS[key], GemmConfig)
    assert all(isinstance(c, GemmConfig) for c in CANDIDATES) and len(set(CANDIDATES)) == len(CANDIDATES)
    assert ge.m_bucket(1500) == 1 and ge.m_bucket(48000) == 32
    assert isinstance(select(1500, 3840, 1280), GemmConfig)
    assert isinstance(select(7, 77, 33), GemmConfig)


def test_bench_dry_run(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
    try:
        import encoder_gemm
    finally:
        sys.path.pop(0)
    assert encoder_gemm.main(["--out", str(tmp_path), "--dry-run", "--windows", "1,32"]) == 0
    text = capsys.readouterr().out
    assert "fc1" in text and "M= 48000" in text
    assert (tmp_path / "encoder_gemm.json").exists()
    with pytest.raises(SystemExit):
        encoder_gemm.main(["--out", str(tmp_path), "--dry-run", "--windows", "0"])


# ------------------------------------------------------------------------------------------------ GPU, real shapes

ENCODER = {"qkv": (3840, 1280, "bias"), "o": (1280, 1280, "residual"), "fc1": (5120, 1280, "gelu"),
           "fc2": (1280, 5120, "residual")}


@gpu_only
@pytest.mark.parametrize("m", [1500, 3000])
@pytest.mark.parametrize("name", list(ENCODER))
def test_encoder_shapes_gpu(name, m):
    n, k, epi = ENCODER[name]
    x, w, b, r = problem(m, n, k, BF, seed_of(name, m), residual=epi == "residual")
    for cfg in [None, *CANDIDATES[:3]]:
        out = poisoned(m, n, dtype=BF)
        _, ref, scale = call(epi, x, w, b, r, out=out, config=cfg)
        close(out, ref, BF, k, scale=scale)
    if epi == "bias":  # like-for-like with cuBLAS's bias epilogue
        same = (out == torch.nn.functional.linear(x, w, b)).float().mean().item()
        assert same >= 0.95, same


@gpu_only
def test_fp32_gpu():
    m, n, k = 300, 1280, 5120
    x, w, b, r = problem(m, n, k, torch.float32, 5, residual=True)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = poisoned(m, n, dtype=torch.float32)
        linear_bias_residual(x, w, b, r, out=out)
        close(out, linear_bias_residual_ref(x, w, b, r), torch.float32, k, scale=linear_bias_ref(x, w, b))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@gpu_only
def test_cuda_graph_capture():
    m, n, k = 1500, 5120, 1280
    x, w, b, _ = problem(m, n, k, BF, 9)
    out = poisoned(m, n, dtype=BF)
    linear_gelu(x, w, b, out=out)  # compile outside the capture
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        linear_gelu(x, w, b, out=out)
    g.replay()
    torch.cuda.synchronize()
    close(out, linear_gelu_ref(x, w, b), BF, k)
