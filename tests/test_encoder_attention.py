"""The encoder flash-attention kernel (kernels/encoder_attention.py) vs its plain-PyTorch reference.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here automatically when there is no GPU) at small shapes
(T not a multiple of the block sizes, head_dim 16/32/64 with partial and full rotary, strided qkv, ``out=``).
GPU: the same tests compiled, plus the real encoder shape (W 1 and 2, T 1500, H 20, D 64; skipped without
CUDA), also against ``rope_`` + torch SDPA, every candidate config, and a CUDA-graph capture.

Every output is poisoned (NaN) before the kernel runs, so an unwritten element fails the comparison; inputs
are fresh torch.randn draws with a per-test seed (never zeros).

Tolerances (elementwise, torch.testing.assert_close), as in tests/test_triton_kernels.py:
* fp32: rtol=atol=1e-5. Same math as the reference in fp32 (the dots in IEEE fp32); differences are the
  summation order of the online softmax / the split QK^T contraction and exp2 vs exp, a few fp32 ulps.
* bf16: rtol=2e-2, atol=1e-2. The RoPE'd q/k are bit-identical to rope_ref's (integer round-to-nearest-even
  at the same points), scores and softmax are fp32, but P is rounded to bf16 for the P@V product (as flash
  attention does) while the reference keeps P in fp32: a relative error <= 2**-9 per weight that averages out
  over the T keys, plus the output rounding (1 bf16 ulp = 2**-8..2**-7 relative, and the interpreter truncates
  instead of rounding: another ulp). Outputs are averages of N(0, 1) values, |o| < ~1, so atol 1e-2 is ~2 ulps
  at the top of the range.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from glmasr_kernels.encoder_attention import (  # noqa: E402
    CANDIDATES, AttnConfig, encoder_attention, encoder_attention_ref)
from glmasr_kernels.rope import build_rope_cache, rope_, rope_ref  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)
gpu_only = pytest.mark.skipif(not CUDA, reason="real-shape test needs a CUDA GPU (too slow for the CPU interpreter)")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=1e-2)}
# small tiles so that T = 37 / 70 have several query blocks, full key tiles and a key tail
SMALL = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
SMALL_X2 = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, subtiles=2)


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


CASES = [  # (W, T, H, D, rotary dim R; 0 = no RoPE)
    (2, 37, 2, 64, 32),   # the encoder's head_dim and partial rotary
    (1, 70, 3, 32, 16),   # partial rotary, R/2 = 8 < 16 (padded dot lanes)
    (2, 37, 3, 16, 8),    # the tiny test model's encoder (head_dim 16, R 8)
    (1, 70, 2, 32, 32),   # full rotary (no pass-through dims)
    (2, 37, 2, 64, 0),    # no RoPE
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_encoder_attention_matches_ref(case, dtype):
    W, T, H, D, R = case
    seed = W * 1000 + T * 10 + H + D + R
    qkv = qkv_fused(W, T, H, D, dtype, seed)
    cos, sin = build_rope_cache(R, 128, 10000.0, DEV) if R else (None, None)
    ref = encoder_attention_ref(qkv, cos, sin)
    for cfg in (SMALL, SMALL_X2):
        out = poisoned(W, T, H, D, dtype)
        res = encoder_attention(qkv, cos, sin, out=out, config=cfg)
        assert res is out
        close(out, ref, dtype)


def test_default_config_and_allocated_out():
    W, T, H, D, R = 1, 70, 2, 64, 32
    qkv = qkv_fused(W, T, H, D, torch.bfloat16, seed=7)
    cos, sin = build_rope_cache(R, 1500, 10000.0, DEV)
    out = encoder_attention(qkv, cos, sin)
    assert out.shape == (W, T, H, D) and out.is_contiguous() and out.dtype == torch.bfloat16
    close(out, encoder_attention_ref(qkv, cos, sin), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_qkv_and_sm_scale(dtype):
    # qkv with padded token rows, windows and a (3, H) -> (H, 3) head-major storage: arbitrary strides, unit in D
    W, T, H, D, R = 2, 37, 3, 32, 16
    store = randn(W + 1, T + 3, H, 3, D + 8, dtype=dtype, seed=51)
    qkv = store[1:, 2:T + 2, :, :, 4:D + 4].permute(0, 1, 3, 2, 4)
    assert qkv.shape == (W, T, 3, H, D) and qkv.stride(-1) == 1 and not qkv.is_contiguous()
    cos, sin = build_rope_cache(R, 64, 10000.0, DEV)
    before = qkv.clone()
    out = poisoned(W, T, H, D, dtype)
    encoder_attention(qkv, cos, sin, sm_scale=0.3, out=out, config=SMALL)
    close(out, encoder_attention_ref(qkv, cos, sin, sm_scale=0.3), dtype)
    assert torch.equal(qkv, before), "the fused-RoPE path must not modify qkv"


@pytest.mark.parametrize("pos_kind", ["2d", "1d"])
def test_explicit_positions_and_padding(pos_kind):
    W, T, H, D, R = 2, 37, 2, 64, 32
    qkv = qkv_fused(W, T, H, D, torch.bfloat16, seed=61)
    cos, sin = build_rope_cache(R, 200, 10000.0, DEV)
    g = torch.Generator().manual_seed(62)
    if pos_kind == "2d":
        pos = torch.randint(0, 200, (W, T), generator=g, dtype=torch.int32).to(DEV)
        pos[1, 5] = -1  # padding token: left unrotated (as rope_ does)
    else:
        pos = (torch.arange(T) + 100).to(DEV)
    out = poisoned(W, T, H, D, torch.bfloat16)
    encoder_attention(qkv, cos, sin, positions=pos, out=out, config=SMALL)
    close(out, encoder_attention_ref(qkv, cos, sin, positions=pos), torch.bfloat16)


def test_fused_rope_rounds_exactly_like_rope_ref():
    # the kernel's in-register RoPE must produce exactly rope_ref's bf16 q/k: the fused result equals the kernel
    # without RoPE on rope_ref-rotated inputs up to fp32 summation order (the split QK^T dot), i.e. almost
    # everywhere bit-identical; one bf16 ulp on k alone changes most outputs (measured: 76%), so < 2% differing
    # outputs means the rotation matched
    W, T, H, D, R = 2, 70, 2, 64, 32
    qkv = qkv_fused(W, T, H, D, torch.bfloat16, seed=75)
    cos, sin = build_rope_cache(R, 128, 10000.0, DEV)
    x = qkv.clone()
    q, k = rope_ref(x[:, :, 0], x[:, :, 1], torch.arange(T, device=DEV).expand(W, T), cos, sin)
    x[:, :, 0], x[:, :, 1] = q, k
    fused = encoder_attention(qkv, cos, sin, config=SMALL)
    plain = encoder_attention(x, config=SMALL)
    close(fused, plain, torch.bfloat16)
    frac = (fused != plain).float().mean().item()
    assert frac < 0.02, f"{frac:.2%} of outputs differ: the fused RoPE does not round like rope_ref"


def test_default_positions_restart_per_window():
    # positions=None must mean arange(T) in every window
    W, T, H, D, R = 2, 37, 2, 32, 16
    qkv = qkv_fused(W, T, H, D, torch.float32, seed=71)
    cos, sin = build_rope_cache(R, 64, 10000.0, DEV)
    pos = torch.arange(T, device=DEV).expand(W, T)
    a = encoder_attention(qkv, cos, sin, config=SMALL)
    b = encoder_attention(qkv, cos, sin, positions=pos, config=SMALL)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_kernel_false_equals_rope_then_attention(dtype):
    # rope_in_kernel=False rotates q/k in place with rope_ and runs the kernel without RoPE: same result as the
    # fused path, and qkv afterwards holds exactly rope_ref's rotated q/k
    W, T, H, D, R = 2, 37, 2, 64, 32
    qkv = qkv_fused(W, T, H, D, dtype, seed=81)
    cos, sin = build_rope_cache(R, 64, 10000.0, DEV)
    ref = encoder_attention_ref(qkv, cos, sin)
    fused = encoder_attention(qkv, cos, sin, config=SMALL)
    pos = torch.arange(T, device=DEV).expand(W, T)
    q_ref, k_ref = rope_ref(qkv[:, :, 0], qkv[:, :, 1], pos, cos, sin)
    out = poisoned(W, T, H, D, dtype)
    encoder_attention(qkv, cos, sin, out=out, config=SMALL, rope_in_kernel=False)
    if CUDA or dtype == torch.float32:
        close(qkv[:, :, 0], q_ref, dtype)
        close(qkv[:, :, 1], k_ref, dtype)
    else:
        # rope_ under the interpreter truncates each product: up to 1 ulp of the product (|x*c| < 4: 2**-6)
        # each, which x1*c - x2*s can leave as an absolute error on a small result
        for got, want in ((qkv[:, :, 0], q_ref), (qkv[:, :, 1], k_ref)):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2 * 2 ** -6)
    close(out, encoder_attention_ref(qkv), dtype)  # the kernel without RoPE on what rope_ produced
    if CUDA or dtype == torch.float32:
        # (not bf16 under the interpreter: there rope_ truncates instead of rounding, q/k come out biased
        # towards 0 by up to 2 ulps and the bias adds up in the scores)
        close(out, ref, dtype)
        close(out, fused, dtype)


def test_bad_inputs():
    qkv = qkv_fused(1, 8, 2, 16, torch.float32, seed=91)
    cos, sin = build_rope_cache(8, 16, 10000.0, DEV)
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
    with pytest.raises(ValueError, match=r"R = 2 \* cos.shape\[1\] = 32 must be in \[2, D = 16\]"):
        c2, s2 = build_rope_cache(32, 16, 10000.0, DEV)
        encoder_attention(qkv, c2, s2)
    with pytest.raises(ValueError, match="R/2 must be a power of two"):
        encoder_attention(qkv, cos[:, :3].contiguous(), sin[:, :3].contiguous())
    with pytest.raises(ValueError, match="float32"):
        encoder_attention(qkv, cos.double(), sin.double())
    with pytest.raises(ValueError, match="together"):
        encoder_attention(qkv, cos, None)
    with pytest.raises(ValueError, match="has only 4 rows"):
        encoder_attention(qkv, cos[:4], sin[:4])
    with pytest.raises(ValueError, match=r"positions must be \(W, T\)"):
        encoder_attention(qkv, cos, sin, positions=torch.arange(7, device=DEV))
    with pytest.raises(ValueError, match="int32 or int64"):
        encoder_attention(qkv, cos, sin, positions=torch.arange(8, device=DEV).float())
    with pytest.raises(ValueError, match="positions given without cos/sin"):
        encoder_attention(qkv, positions=torch.arange(8, device=DEV))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        encoder_attention(qkv, out=torch.empty(1, 8, 32, device=DEV))
    with pytest.raises(ValueError, match="out dtype"):
        encoder_attention(qkv, out=torch.empty(1, 8, 2, 16, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="powers of two >= 16"):
        encoder_attention(qkv, config=AttnConfig(block_m=48))
    with pytest.raises(ValueError, match="subtiles"):
        encoder_attention(qkv, config=AttnConfig(block_m=16, subtiles=2))


def test_bench_script_dry_run(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "encoder_attention.py"), "--dry-run",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "cudnn" in p.stdout and "fused-rope" in p.stdout and CANDIDATES[0].short() in p.stdout


# ------------------------------------------------------------------------------------------------ GPU only
REAL = dict(T=1500, H=20, D=64, R=32)


def _real(W, seed):
    qkv = qkv_fused(W, REAL["T"], REAL["H"], REAL["D"], torch.bfloat16, seed)
    cos, sin = build_rope_cache(REAL["R"], 1500, 10000.0, DEV)
    return qkv, cos, sin


def _sdpa_after_rope(qkv, cos, sin):
    W, T = qkv.shape[:2]
    x = qkv.clone()
    q, k, v = x.unbind(2)
    rope_(q, k, torch.arange(T, device=DEV).expand(W, T), cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         scale=qkv.shape[-1] ** -0.5)
    return o.transpose(1, 2).contiguous()


@gpu_only
@pytest.mark.parametrize("W", [1, 2])
def test_gpu_real_shape(W):
    qkv, cos, sin = _real(W, seed=100 + W)
    ref = encoder_attention_ref(qkv, cos, sin)
    sdpa = _sdpa_after_rope(qkv, cos, sin)
    close(sdpa, ref, torch.bfloat16)
    for rope_in_kernel in (True, False):
        x = qkv.clone()
        out = poisoned(W, REAL["T"], REAL["H"], REAL["D"], torch.bfloat16)
        encoder_attention(x, cos, sin, out=out, rope_in_kernel=rope_in_kernel)
        close(out, ref, torch.bfloat16)
        close(out, sdpa, torch.bfloat16)


@gpu_only
def test_gpu_rope_bit_exact_vs_rope_():
    # fused RoPE == rope_ then the kernel without RoPE: up to the split QK^T summation order, so compare the
    # two kernels' outputs tightly (mostly bit-identical) rather than only to the fp32 reference
    qkv, cos, sin = _real(1, seed=111)
    a = encoder_attention(qkv, cos, sin)
    b = encoder_attention(qkv.clone(), cos, sin, rope_in_kernel=False)
    close(a, b, torch.bfloat16)
    frac = (a != b).float().mean().item()
    assert frac < 0.05, f"{frac:.3%} of outputs differ between fused RoPE and rope_ + kernel"


@gpu_only
@pytest.mark.parametrize("cfg", CANDIDATES, ids=lambda c: c.short())
def test_gpu_candidates(cfg):
    qkv, cos, sin = _real(1, seed=121)
    ref = encoder_attention_ref(qkv, cos, sin)
    out = poisoned(1, REAL["T"], REAL["H"], REAL["D"], torch.bfloat16)
    encoder_attention(qkv, cos, sin, out=out, config=cfg)
    close(out, ref, torch.bfloat16)


@gpu_only
def test_gpu_cuda_graph():
    W = 2
    qkv, cos, sin = _real(W, seed=131)
    buf = qkv.clone()
    out = torch.empty(W, REAL["T"], REAL["H"], REAL["D"], device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        encoder_attention(buf, cos, sin, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        encoder_attention(buf, cos, sin, out=out)
    for it in range(2):
        fresh, _, _ = _real(W, seed=140 + it)
        buf.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, encoder_attention_ref(fresh, cos, sin), torch.bfloat16)
