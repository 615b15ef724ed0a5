"""The encoder flash-attention kernel (kernels/encoder_attention.py) vs its plain-PyTorch reference.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here automatically when there is no GPU) at small shapes
(T not a multiple of the block sizes, head_dim 16/32/64, strided qkv, ``out=``, the encoder's ``rope_`` first).
GPU: the same tests compiled, plus the real encoder shape (W 1 and 2, T 1500, H 20, D 64; skipped without
CUDA) after ``rope_``, against the reference and ``rope_`` + torch SDPA, and a CUDA-graph capture.

Every output is poisoned (NaN) before the kernel runs, so an unwritten element fails the comparison; inputs
are fresh torch.randn draws with a per-test seed (never zeros).

Tolerances (elementwise, torch.testing.assert_close), as in tests/test_triton_kernels.py:
* fp32: rtol=atol=1e-5. Same math as the reference in fp32 (the dots in IEEE fp32); differences are the
  summation order of the online softmax and exp2 vs exp, a few fp32 ulps.
* bf16: rtol=2e-2, atol=1e-2. Scores and softmax are fp32, but P is rounded to bf16 for the P@V product (as flash
  attention does) while the reference keeps P in fp32: a relative error <= 2**-9 per weight that averages out
  over the T keys, plus the output rounding (1 bf16 ulp = 2**-8..2**-7 relative, and the interpreter truncates
  instead of rounding: another ulp). Outputs are averages of N(0, 1) values, |o| < ~1, so atol 1e-2 is ~2 ulps
  at the top of the range.
"""

from __future__ import annotations


import pytest
import torch

from conftest import CUDA, DEV, gpu_only, require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

from glmasr_kernels.encoder_attention import (  # noqa: E402
    CONFIG, AttnConfig, default_config, encoder_attention, encoder_attention_ref)
from glmasr_kernels.rope import build_rope_cache, rope_, rope_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=1e-2)}
# small tiles so that T = 37 / 70 have several query blocks, full key tiles and a key tail
SMALL = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def randn(*shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(out, ref, dtype):
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "NaN/Inf in output (unwritten element?)"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def poisoned(W, T, H, D, dtype):
    return torch.full((W, T, H, D), float("nan"), device=DEV, dtype=dtype)


def qkv_fused(W, T, H, D, dtype, seed):
    """The encoder's layout: the contiguous (W, T, 3*H*D) projection output viewed as (W, T, 3, H, D)."""
    return randn(W, T, 3 * H * D, dtype=dtype, seed=seed).view(W, T, 3, H, D)


CASES = [  # (W, T, H, D)
    (2, 37, 2, 64),   # the encoder's head_dim
    (1, 70, 3, 32),
    (2, 37, 3, 16),   # the tiny test model's encoder (head_dim 16)
    (1, 16, 2, 8),    # head_dim under 16: padded dot lanes, one query block and one key tile exactly
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_encoder_attention_matches_ref(case, dtype):
    W, T, H, D = case
    qkv = qkv_fused(W, T, H, D, dtype, seed=W * 1000 + T * 10 + H + D)
    before = qkv.clone()
    ref = encoder_attention_ref(qkv)
    out = poisoned(W, T, H, D, dtype)
    res = encoder_attention(qkv, out=out, config=SMALL)
    assert res is out
    close(out, ref, dtype)
    assert torch.equal(qkv, before), "qkv is read only"


def test_default_config_and_allocated_out():
    W, T, H, D = 1, 70, 2, 64
    qkv = qkv_fused(W, T, H, D, torch.bfloat16, seed=7)
    assert default_config() == CONFIG if CUDA else default_config().block_m <= 32  # the interpreter's small tiles
    out = encoder_attention(qkv)
    assert out.shape == (W, T, H, D) and out.is_contiguous() and out.dtype == torch.bfloat16
    close(out, encoder_attention_ref(qkv), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_qkv_and_sm_scale(dtype):
    # qkv with padded token rows, windows and a (3, H) -> (H, 3) head-major storage: arbitrary strides, unit in D
    W, T, H, D = 2, 37, 3, 32
    store = randn(W + 1, T + 3, H, 3, D + 8, dtype=dtype, seed=51)
    qkv = store[1:, 2:T + 2, :, :, 4:D + 4].permute(0, 1, 3, 2, 4)
    assert qkv.shape == (W, T, 3, H, D) and qkv.stride(-1) == 1 and not qkv.is_contiguous()
    out = poisoned(W, T, H, D, dtype)
    encoder_attention(qkv, sm_scale=0.3, out=out, config=SMALL)
    close(out, encoder_attention_ref(qkv, sm_scale=0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_after_rope_as_the_encoder_runs_it(dtype):
    # the encoder layer: rope_ rotates q and k in place inside the fused projection output, then the kernel
    # attends over it; equal to the reference on rope_ref-rotated q/k
    W, T, H, D, R = 2, 37, 2, 64, 32
    qkv = qkv_fused(W, T, H, D, dtype, seed=81)
    cos, sin = build_rope_cache(R, 64, 10000.0, DEV)
    pos = torch.arange(T, device=DEV, dtype=torch.int32).expand(W, T)
    x = qkv.clone()
    q_ref, k_ref = rope_ref(x[:, :, 0], x[:, :, 1], pos, cos, sin)
    x[:, :, 0], x[:, :, 1] = q_ref, k_ref
    ref = encoder_attention_ref(x)
    q, k, _ = qkv.unbind(2)
    rope_(q, k, pos, cos, sin)
    out = poisoned(W, T, H, D, dtype)
    encoder_attention(qkv, out=out, config=SMALL)
    close(out, encoder_attention_ref(qkv), dtype)  # the kernel on what rope_ produced
    if CUDA or dtype == torch.float32:
        # (not bf16 under the interpreter: there rope_ truncates instead of rounding, q/k come out biased
        # towards 0 by up to 2 ulps and the bias adds up in the scores)
        close(out, ref, dtype)


def test_bad_inputs():
    qkv = qkv_fused(1, 8, 2, 16, torch.float32, seed=91)
    with pytest.raises(ValueError, match=r"qkv must be \(W, T, 3, H, D\)"):
        encoder_attention(qkv.reshape(1, 8, 96))
    with pytest.raises(ValueError, match=r"qkv must be \(W, T, 3, H, D\)"):
        encoder_attention(randn(1, 8, 2, 2, 16, dtype=torch.float32, seed=92))
    with pytest.raises(ValueError, match="power of two"):
        encoder_attention(randn(1, 8, 3, 2, 24, dtype=torch.float32, seed=93))
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        encoder_attention(qkv.half())
    with pytest.raises(ValueError, match="unit stride in D"):
        encoder_attention(randn(1, 8, 3, 16, 2, dtype=torch.float32, seed=94).transpose(3, 4))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        encoder_attention(qkv, out=torch.empty(1, 8, 32, device=DEV))
    with pytest.raises(ValueError, match="out dtype"):
        encoder_attention(qkv, out=torch.empty(1, 8, 2, 16, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="powers of two >= 16"):
        encoder_attention(qkv, config=AttnConfig(block_m=48))
    with pytest.raises(ValueError, match="config must be an AttnConfig"):
        encoder_attention(qkv, config=(32, 16))


# ------------------------------------------------------------------------------------------------ GPU only
REAL = dict(T=1500, H=20, D=64, R=32)


def _real(W, seed):
    """The real shape's qkv with q and k already rotated by ``rope_`` (what the encoder hands the kernel)."""
    qkv = qkv_fused(W, REAL["T"], REAL["H"], REAL["D"], torch.bfloat16, seed)
    cos, sin = build_rope_cache(REAL["R"], 1500, 10000.0, DEV)
    q, k, _ = qkv.unbind(2)
    rope_(q, k, torch.arange(REAL["T"], device=DEV, dtype=torch.int32).expand(W, REAL["T"]), cos, sin)
    return qkv


def _sdpa(qkv):
    q, k, v = qkv.unbind(2)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         scale=qkv.shape[-1] ** -0.5)
    return o.transpose(1, 2).contiguous()


@gpu_only
@pytest.mark.parametrize("W", [1, 2])
def test_gpu_real_shape(W):
    qkv = _real(W, seed=100 + W)
    ref = encoder_attention_ref(qkv)
    sdpa = _sdpa(qkv)
    close(sdpa, ref, torch.bfloat16)
    out = poisoned(W, REAL["T"], REAL["H"], REAL["D"], torch.bfloat16)
    encoder_attention(qkv, out=out)
    close(out, ref, torch.bfloat16)
    close(out, sdpa, torch.bfloat16)


@gpu_only
def test_gpu_cuda_graph():
    W = 2
    buf = _real(W, seed=131)
    out = torch.empty(W, REAL["T"], REAL["H"], REAL["D"], device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        encoder_attention(buf, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        encoder_attention(buf, out=out)
    for it in range(2):
        fresh = _real(W, seed=140 + it)
        buf.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, encoder_attention_ref(fresh), torch.bfloat16)
