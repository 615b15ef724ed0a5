"""Skinny decode GEMMs (kernels/skinny_gemm.py) vs their plain-PyTorch references.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here automatically when there is no GPU) at small, odd shapes
(N = 37/200, K = 96/200, M in {1, 3, 8, 16}), both inner products (FMA and tl.dot), split-K 1..3, ragged N and K
tiles, SwiGLU fused or not. GPU: the same tests compiled, plus the decoder's real shapes (skipped without CUDA).

Inputs: fresh torch.randn draws (x ~ N(0, 1), W ~ N(0, 1/K), so outputs are ~N(0, 1)), never zeros; outputs are
poisoned with NaN first, so an unwritten element fails.

Tolerance. Reference = fp32 math on the same bf16 inputs (``*_ref``), rounded once to bf16 (SwiGLU: rounded at
the points of the unfused path). The kernel accumulates in fp32 in another order (differences ~1e-6 relative),
then rounds once, so its result is the reference's up to one bf16 rounding: <= 1 ulp = 2**-8..2**-7 relative;
Triton's CPU interpreter truncates fp32->bf16 instead of rounding to nearest (another <= 1 ulp, always toward
zero). SwiGLU rounds three times (gate/up, silu, product): up to ~3 ulps under the interpreter. Checks:
* elementwise: |out - ref| <= atol + rtol |ref| with rtol = 1.6e-2 (2 ulps; SwiGLU 3.2e-2), atol = 1e-2
  (outputs are O(1); the fp32-summation error on an output near zero is ~1e-6);
* norm: ||out - ref|| / ||ref|| < 1e-2 (SwiGLU 2e-2); bf16 rounding alone gives ~2e-3 (interpreter ~4e-3).
On the GPU (round to nearest), the plain GEMM must match the reference bit-for-bit on >= 95% of elements.
"""

from __future__ import annotations


import pytest
import torch

from conftest import DEV, gpu_only, require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

from glmasr_kernels.skinny_gemm import (  # noqa: E402
    CONFIGS, invariant_config, kernel_config, linear_invariant, linear_swiglu_invariant,
    MAX_M, SkinnyConfig, linear, linear_swiglu, select, skinny_gemm, skinny_gemm_ref, skinny_gemm_swiglu,
    skinny_gemm_swiglu_ref)

BF = torch.bfloat16
RTOL, ATOL, NORM = 1.6e-2, 1e-2, 1e-2
RTOL_SW, NORM_SW = 3.2e-2, 2e-2

_SEED = [1234]


def gen(*shape, scale=1.0, device=DEV, dtype=BF):
    _SEED[0] += 1
    g = torch.Generator(device="cpu")
    g.manual_seed(_SEED[0])
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def poisoned(*shape, device=DEV, dtype=BF):
    return torch.full(shape, float("nan"), device=device, dtype=dtype)


def check(out, ref, rtol=RTOL, norm=NORM):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "NaN/Inf in output (unwritten element?)"
    err = (o - r).abs()
    bad = err > ATOL + rtol * r.abs()
    assert not bad.any(), f"{int(bad.sum())} elements off; max abs err {err.max().item():.3g}"
    rel = ((o - r).norm() / r.norm()).item()
    assert rel < norm, f"relative error {rel:.3g}"
    return rel


# configs exercised at the small shapes: FMA / dot, split-K, ragged tiles (BLOCK_K < K, K % BLOCK_K != 0)
SMALL_CFGS = [
    None,  # select()'s choice
    SkinnyConfig(block_n=4, block_k=32),
    SkinnyConfig(block_n=16, block_k=64, split_k=2),
    SkinnyConfig(block_n=8, block_k=32, split_k=3),
    SkinnyConfig(block_n=16, block_k=32, split_k=1, use_dot=True),
    SkinnyConfig(block_n=32, block_k=32, split_k=3, use_dot=True),
    # two K tiles loaded before the PDL wait (the peeled second tile; K=96 at BK 32 has 3 tiles, K=200 has 7)
    SkinnyConfig(block_n=4, block_k=32, preload=2),
    SkinnyConfig(block_n=16, block_k=32, split_k=2, use_dot=True, preload=2),
]
SMALL_SHAPES = [(200, 96), (37, 96), (37, 200)]


def _cfg_id(c):
    return "select" if c is None else c.short().replace(" ", "-")


@pytest.mark.parametrize("cfg", SMALL_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_gemm_small(m, cfg):
    for n, k in SMALL_SHAPES:
        x = gen(m, k)
        w = gen(n, k, scale=k ** -0.5)
        out = poisoned(m, n)
        res = skinny_gemm(x, w, out=out, config=cfg)
        assert res is out
        check(out, skinny_gemm_ref(x, w))


@pytest.mark.parametrize("cfg", [None, SkinnyConfig(8, 32, 3), SkinnyConfig(16, 64, 2, use_dot=True)], ids=_cfg_id)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_gemm_swiglu_small(m, cfg):
    for i, k in [(100, 96), (37, 200)]:
        x = gen(m, k)
        w = gen(2 * i, k, scale=k ** -0.5)
        out = poisoned(m, i)
        res = skinny_gemm_swiglu(x, w, out=out, config=cfg)
        assert res is out
        check(out, skinny_gemm_swiglu_ref(x, w), rtol=RTOL_SW, norm=NORM_SW)


def test_leading_dims_strides_and_alloc():
    # x (2, 3, K) -> (2, 3, N); x with a row stride (a slice); W a row slice of a bigger matrix (row stride > K)
    k, n = 96, 37
    x = gen(2, 3, k)
    big = gen(n + 5, k + 16, scale=k ** -0.5)
    w = big[2:2 + n, 8:8 + k]
    assert w.stride() == (k + 16, 1)
    y = skinny_gemm(x, w)
    check(y, skinny_gemm_ref(x, w))
    xs = gen(4, 2 * k)[:, :k]
    out = poisoned(4, n)
    skinny_gemm(xs, w, out=out, config=SkinnyConfig(8, 32, 2))
    check(out, skinny_gemm_ref(xs, w))


def test_fp32_io():
    x = gen(3, 96, dtype=torch.float32)
    w = gen(37, 96, scale=96 ** -0.5, dtype=torch.float32)
    y = skinny_gemm(x, w, config=SkinnyConfig(8, 32))
    torch.testing.assert_close(y, skinny_gemm_ref(x, w), rtol=1e-5, atol=1e-5)


def test_explicit_workspace():
    x = gen(3, 96)
    w = gen(200, 96, scale=96 ** -0.5)
    ws = torch.full((3 * 3 * 200,), float("nan"), device=DEV, dtype=torch.float32)
    out = poisoned(3, 200)
    skinny_gemm(x, w, out=out, config=SkinnyConfig(16, 32, 3), workspace=ws)
    check(out, skinny_gemm_ref(x, w))
    with pytest.raises(ValueError):
        skinny_gemm(x, w, config=SkinnyConfig(16, 32, 3), workspace=ws[:10])


def test_select_and_errors():
    for m in range(1, MAX_M + 1):
        assert select(m, 3072, 2048) is not None
    assert select(MAX_M + 1, 3072, 2048) is None
    assert select(64, 59264, 2048) is None
    # a tuned "cuBLAS wins" entry: the dispatchers use cuBLAS, a direct call still gets a kernel config
    none_keys = [key for key, cfg in CONFIGS.items() if cfg is None]
    for n, k, mb, sw in none_keys:
        assert select(mb, n, k, sw) is None
        assert isinstance(kernel_config(mb, n, k, sw), SkinnyConfig)
    x = gen(MAX_M + 1, 32)
    w = gen(16, 32)
    with pytest.raises(ValueError):
        skinny_gemm(x, w)
    with pytest.raises(ValueError):
        skinny_gemm(gen(2, 32), gen(16, 48))
    with pytest.raises(ValueError):
        skinny_gemm(gen(2, 32), gen(32, 16).t())  # K stride != 1: never copy a weight
    with pytest.raises(ValueError):
        skinny_gemm_swiglu(gen(2, 32), gen(15, 32))
    with pytest.raises(ValueError, match="preload"):
        skinny_gemm(gen(2, 32), gen(16, 32), config=SkinnyConfig(8, 32, preload=3))


def test_dispatchers():
    # M <= 16: skinny kernel; M > 16: cuBLAS / torch (bf16 matmul on CPU is fine at these sizes)
    for m in (2, 20):
        x = gen(m, 96)
        w = gen(37, 96, scale=96 ** -0.5)
        out = poisoned(m, 37)
        linear(x, w, out=out)
        check(out, skinny_gemm_ref(x, w))
        w2 = gen(2 * 37, 96, scale=96 ** -0.5)
        check(linear_swiglu(x, w2), skinny_gemm_swiglu_ref(x, w2), rtol=RTOL_SW, norm=NORM_SW)


def _invariance(n, k, swiglu, counts, dtype=BF):
    """Row r of a call of m rows, for every m in ``counts``, against the same row computed alone: bit for bit
    (the batch-invariant dispatchers' promise), and each call within tolerance of the reference. Fresh random
    rows around it at every m; outputs poisoned."""
    fn, ref_fn = (linear_swiglu_invariant, skinny_gemm_swiglu_ref) if swiglu else (linear_invariant, skinny_gemm_ref)
    w = gen(2 * n if swiglu else n, k, scale=k ** -0.5, dtype=dtype)
    row = gen(1, k, dtype=dtype)
    alone = fn(row, w, out=poisoned(1, n, dtype=dtype))
    for m in counts:
        x = gen(m, k, dtype=dtype)
        at = (m * 7) // 10  # somewhere inside, also past the first 16-row chunk
        x[at] = row[0]
        out = poisoned(m, n, dtype=dtype)
        assert fn(x, w, out=out) is out
        if dtype == BF:
            check(out, ref_fn(x, w), *((RTOL_SW, NORM_SW) if swiglu else (RTOL, NORM)))
        else:
            torch.testing.assert_close(out, ref_fn(x, w), rtol=1e-5, atol=1e-5)
        assert torch.equal(out[at], alone[0]), f"M={m}: row {at} differs from the same row alone"


@pytest.mark.parametrize("swiglu", [False, True])
def test_batch_invariant_dispatchers_small(swiglu):
    """Any row count (past 16: the kernel 16 rows at a time): a row's output never depends on the others."""
    assert invariant_config(37, 96, swiglu).use_dot
    _invariance(37, 96, swiglu, (2, 5, 16, 21, 40))
    fn = linear_swiglu_invariant if swiglu else linear_invariant
    w = gen(74 if swiglu else 37, 96, scale=96 ** -0.5)
    with pytest.raises(ValueError, match=r"out must be \(21, 37\)"):  # same element count, other shape
        fn(gen(21, 96), w, out=poisoned(37, 21))


def test_batch_invariant_dispatchers_fp32():
    _invariance(37, 200, False, (3, 17), dtype=torch.float32)


def test_invariant_config_is_the_dot_path_even_where_the_table_says_fma(monkeypatch):
    monkeypatch.setitem(CONFIGS, (48, 64, 16, False), SkinnyConfig(4, 64))
    assert invariant_config(48, 64).use_dot


# ------------------------------------------------------------------------------------------------ GPU, real shapes

DECODE_SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
                 "lm_head": (59264, 2048)}


@gpu_only
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_decode_shapes_gpu(name, m):
    n, k = DECODE_SHAPES[name]
    x = gen(m, k)
    w = gen(n, k, scale=k ** -0.5)
    out = poisoned(m, n)
    skinny_gemm(x, w, out=out)
    ref = skinny_gemm_ref(x, w)
    rel = check(out, ref)
    same = (out == ref).float().mean().item()
    print(f"[exact] {name} M={m} cfg={kernel_config(m, n, k).short()} rel={rel:.2e} bit-identical={same:.4f}")
    assert same >= 0.95, f"only {same:.3f} of outputs bit-identical to the fp32 reference rounded once"


@gpu_only
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_batch_invariant_decode_shapes_gpu(name):
    """The decoder's shapes in bf16: a row alone equals that row in calls of 2-64 rows, bit for bit (the default
    dispatch ``linear`` does not promise it: FMA configs for 1-2 rows, tensor cores above, cuBLAS past 16)."""
    n, k = DECODE_SHAPES[name]
    _invariance(n // 2 if name == "gate_up" else n, k, name == "gate_up", (2, 3, 8, 16, 33, 64))


@gpu_only
@pytest.mark.parametrize("use_dot", [False, True])
def test_fp32_is_true_fp32_gpu(use_dot):
    """fp32 I/O (the tiny checkpoint's test dtype) must not go through TF32 on the tensor-core path: within
    1e-5 of the fp64 product (TF32 is ~1e-3; the first device run of the dot path without ieee was 9.5e-4)."""
    x = gen(8, 1024, dtype=torch.float32)
    w = gen(256, 1024, dtype=torch.float32, scale=1024 ** -0.5)
    out = torch.full((8, 256), float("nan"), device=DEV)
    skinny_gemm(x, w, out=out, config=SkinnyConfig(32, 128, 1, use_dot=use_dot, num_stages=3))
    ref = (x.double() @ w.double().t()).float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


@gpu_only
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_decode_swiglu_gpu(m):
    k, i = 2048, 6144
    x = gen(m, k)
    w = gen(2 * i, k, scale=k ** -0.5)
    out = poisoned(m, i)
    skinny_gemm_swiglu(x, w, out=out)
    ref = skinny_gemm_swiglu_ref(x, w)
    rel = check(out, ref, rtol=RTOL_SW, norm=NORM_SW)
    same = (out == ref).float().mean().item()
    print(f"[exact] swiglu M={m} rel={rel:.2e} bit-identical={same:.4f}")
    assert same >= 0.9


@gpu_only
@pytest.mark.parametrize("cfg", [SkinnyConfig(8, 512, 2), SkinnyConfig(16, 256, 4, use_dot=True, num_stages=3),
                                 SkinnyConfig(64, 128, 1, num_warps=8, use_dot=True, num_stages=4)], ids=_cfg_id)
def test_configs_gpu(cfg):
    for m in (1, 5, 16):
        for n, k in [(2048, 2048), (2048, 6144), (1000, 1000)]:
            x = gen(m, k)
            w = gen(n, k, scale=k ** -0.5)
            out = poisoned(m, n)
            skinny_gemm(x, w, out=out, config=cfg)
            check(out, skinny_gemm_ref(x, w))


@gpu_only
def test_cuda_graph_capture():
    # out and workspace preallocated: capture, change the inputs in place, replay, compare
    m, n, k = 4, 2048, 6144
    x = gen(m, k)
    w = gen(n, k, scale=k ** -0.5)
    w2 = gen(2 * 1024, k, scale=k ** -0.5)
    out = poisoned(m, n)
    out2 = poisoned(m, 1024)
    cfg = SkinnyConfig(8, 512, 4)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        skinny_gemm(x, w, out=out, config=cfg)  # warm-up: compile + workspace
        skinny_gemm_swiglu(x, w2, out=out2, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        skinny_gemm(x, w, out=out, config=cfg)
        skinny_gemm_swiglu(x, w2, out=out2, config=cfg)
    x.copy_(gen(m, k))
    out.fill_(float("nan"))
    out2.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check(out, skinny_gemm_ref(x, w))
    check(out2, skinny_gemm_swiglu_ref(x, w2), rtol=RTOL_SW, norm=NORM_SW)
