"""The decode step's GEMMs go to the CUDA GEMV (kernels/cuda_gemv.py) exactly for the shapes
``fast_decoder.CUDA_GEMV_SHAPES`` lists (one row, bf16 weights, CUDA), to the Triton skinny kernel otherwise, and
both give the same results within the GEMV tolerance."""

from __future__ import annotations

import os

import pytest
import torch

from glmasr.models import fast_decoder
from glmasr_kernels import cuda_gemv, skinny_gemm

from conftest import gpu_only


def _spy(monkeypatch):
    calls = []
    for name in ("gemv", "gemv_swiglu"):
        real = getattr(cuda_gemv, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(cuda_gemv, name, spy)
    return calls


def test_unlisted_shapes_and_the_cpu_stay_on_the_skinny_kernel(monkeypatch):
    """On the CPU (the interpreter) every call, on a GPU a shape the table does not list, runs on skinny_gemm."""
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the skinny kernel runs on the CPU under TRITON_INTERPRET=1 only")
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    calls = _spy(monkeypatch)
    x = torch.randn(1, 64, device=dev, dtype=dt)
    w = torch.randn(96, 64, device=dev, dtype=dt)
    got = fast_decoder._decode_linear(x, w)
    assert calls == []
    tol = 2e-2 if cuda else 1e-5
    torch.testing.assert_close(got.float(), skinny_gemm.skinny_gemm_ref(x, w).float(), rtol=tol, atol=tol)


def test_the_table_names_decoder_shapes_at_one_row():
    for n, k, m, swiglu in fast_decoder.CUDA_GEMV_SHAPES:
        assert m == 1 and cuda_gemv.select(n, k, swiglu, m) is not None


@gpu_only
@pytest.mark.parametrize("shape", sorted(fast_decoder.CUDA_GEMV_SHAPES))
def test_routed_shapes_run_on_cuda_and_match_the_skinny_kernel(monkeypatch, shape):
    if not cuda_gemv.is_available("cuda"):
        pytest.skip("cuda_gemv needs sm_90+ and cuda-bindings")
    n, k, m, swiglu = shape
    torch.manual_seed(sum(shape[:2]))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).contiguous()
    calls = _spy(monkeypatch)
    routed = fast_decoder._decode_linear_swiglu if swiglu else fast_decoder._decode_linear
    got = routed(x, w)
    assert calls == ["gemv_swiglu" if swiglu else "gemv"]
    want = (skinny_gemm.skinny_gemm_swiglu_ref if swiglu else skinny_gemm.skinny_gemm_ref)(x, w)
    # fp32 accumulation in another order, one bf16 rounding: a bf16 ulp or two of the result's scale
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2e-3)
    # a second row goes to the skinny kernel (not in the table)
    calls.clear()
    x2 = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)
    routed(x2, w)
    assert calls == []


@gpu_only
@pytest.mark.parametrize("shape", sorted(fast_decoder.CUDA_GEMV_INT8_SHAPES))
def test_routed_int8_shapes_run_on_cuda_and_match_the_int8_reference(monkeypatch, shape):
    if not cuda_gemv.is_available("cuda"):
        pytest.skip("cuda_gemv needs sm_90+ and cuda-bindings")
    n, k, m, swiglu = shape
    torch.manual_seed(n + 3 * k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, scale = skinny_gemm.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
    calls = _spy(monkeypatch)
    routed = fast_decoder._decode_linear_swiglu if swiglu else fast_decoder._decode_linear
    got = routed(x, q, scale=scale)
    assert calls == ["gemv_swiglu" if swiglu else "gemv"]
    ref = skinny_gemm.skinny_gemm_swiglu_ref if swiglu else skinny_gemm.skinny_gemm_ref
    want = ref(x, q, scale=scale)
    # exact products, fp32 sums in another order, the row scale, one bf16 rounding: a bf16 ulp or two
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2e-3)
