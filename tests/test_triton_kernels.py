"""Triton kernels vs their plain-PyTorch references (kernels/*.py).

CPU: runs under Triton's interpreter (TRITON_INTERPRET=1, set here automatically when there is no GPU) at
small shapes. GPU: the same tests run compiled, plus real-shape tests (skipped without CUDA).

Every output is poisoned (NaN) before the kernel runs, so an unwritten element fails the comparison; inputs
are fresh torch.randn draws with a per-test seed (never zeros).

Tolerances (elementwise, torch.testing.assert_close):
* fp32: rtol=atol=1e-5. The kernels do the reference's math in fp32; the only differences are summation order
  (row reductions, softmax) and rsqrt/exp/erf implementations, each a few fp32 ulps (~1e-7 relative).
* bf16: rtol=2e-2, atol=1e-2. The kernels round at the same points as the reference, so a difference can
  only come from an fp32 intermediate landing on the other side of a bf16 rounding boundary (1 ulp =
  2**-8..2**-7 relative), e.g. through a different summation order or rsqrt. Chains with two roundings
  (RMSNorm: y rounded, then w*y rounded; SwiGLU; RoPE) can then differ by 2 ulps = up to 2**-6 = 1.6e-2
  relative, and Triton's CPU interpreter truncates fp32->bf16 instead of rounding to nearest (another
  <= 1 ulp). On the GPU the bf16 results are mostly bit-identical (checked in the real-shape tests).
* greedy_commit's chosen-token log-probability (fp32 math for any logits dtype): rtol=atol=1e-5, at LOGPROB_TOL.
* decode attention bf16: same tolerance: P is rounded to bf16 for the P@V product (as in flash attention) while
  the reference keeps P in fp32; the error averages over the length, well under one output ulp in bf16.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from conftest import CUDA, DEV, gpu_only, require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

from glmasr_kernels.activations import gelu_bias, gelu_bias_ref, swiglu, swiglu_ref  # noqa: E402
from glmasr_kernels.greedy_commit import greedy_commit, greedy_commit_ref  # noqa: E402
from glmasr_kernels.decode_attention import choose_num_splits, decode_attention, decode_attention_ref  # noqa: E402
from glmasr_kernels.kv_append import kv_append, kv_append_ref  # noqa: E402
from glmasr_kernels.layernorm import layer_norm, layer_norm_ref  # noqa: E402
from glmasr_kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from glmasr_kernels.rope import build_rope_cache, rope_, rope_and_append, rope_and_append_ref, rope_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=1e-2)}


def randn(*shape, dtype, seed=None, scale=1.0):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype)


def close(out, ref, dtype):
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "NaN/Inf in output (unwritten element?)"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def _check_residual(out, ref, dtype, norm_of):
    """Fused residual: new_residual = x + r (one rounding; bit-exact on the GPU, <= 1 ulp under the
    interpreter, which truncates); the normalised output is checked against the reference applied to the
    kernel's own new_residual so that a 1-ulp difference in the sum is not amplified by the normalisation."""
    if CUDA:
        assert torch.equal(out[1], ref[1])
    else:
        close(out[1], ref[1], dtype)
    close(out[0], norm_of(out[1]), dtype)
    if CUDA:
        close(out[0], ref[0], dtype)


# ----------------------------------------------------------------------------------------------- norms
NORM_SHAPES = [(3, 5, 37), (4, 1000), (2, 3, 64), (1, 7, 1280), (2, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_res", [False, True])
def test_rmsnorm(shape, dtype, with_res):
    seed = zlib.crc32(repr((shape, dtype, with_res)).encode()) % 10000
    x = randn(*shape, dtype=dtype, seed=seed)
    w = randn(shape[-1], dtype=dtype, seed=seed + 1)
    r = randn(*shape, dtype=dtype, seed=seed + 2) if with_res else None
    out = rms_norm(x, w, 1e-5, r)
    ref = rms_norm_ref(x, w, 1e-5, r)
    if with_res:
        _check_residual(out, ref, dtype, lambda s: rms_norm_ref(s, w, 1e-5))
    else:
        close(out, ref, dtype)


def test_rmsnorm_strided_rows():
    x = randn(6, 2 * 100, dtype=torch.float32, seed=3)[:, :100]  # row stride 200
    w = randn(100, dtype=torch.float32, seed=4)
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_res", [False, True])
def test_layernorm(shape, dtype, with_res):
    seed = zlib.crc32(repr(("ln", shape, dtype, with_res)).encode()) % 10000
    x = randn(*shape, dtype=dtype, seed=seed, scale=3.0) + 0.5
    w = randn(shape[-1], dtype=dtype, seed=seed + 1)
    b = randn(shape[-1], dtype=dtype, seed=seed + 2)
    r = randn(*shape, dtype=dtype, seed=seed + 3) if with_res else None
    out = layer_norm(x, w, b, 1e-5, r)
    ref = layer_norm_ref(x, w, b, 1e-5, r)
    if with_res:
        _check_residual(out, ref, dtype, lambda s: layer_norm_ref(s, w, b, 1e-5))
    else:
        close(out, ref, dtype)


# ----------------------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (4, 2 * 1000), (2, 2 * 1024 + 2 * 64)])
def test_swiglu(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=shape[-1], scale=2.0)
    close(swiglu(x), swiglu_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 37), (4, 1000), (2, 1280)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gelu_bias(shape, dtype, with_bias):
    x = randn(*shape, dtype=dtype, seed=shape[-1] + 7, scale=2.0)
    b = randn(shape[-1], dtype=dtype, seed=shape[-1] + 8) if with_bias else None
    close(gelu_bias(x, b), gelu_bias_ref(x, b), dtype)


# ------------------------------------------------------------------------------------------------ rope
def _qkv_views(B, T, HQ, HK, D, dtype, seed):
    qkv = randn(B, T, (HQ + 2 * HK) * D, dtype=dtype, seed=seed)
    q = qkv[..., : HQ * D].view(B, T, HQ, D)
    k = qkv[..., HQ * D: (HQ + HK) * D].view(B, T, HK, D)
    v = qkv[..., (HQ + HK) * D:].view(B, T, HK, D)
    return qkv, q, k, v


ROPE_CASES = [  # (B, T, HQ, HK, D, rotary_dim)
    (2, 5, 4, 2, 32, 32),      # full rotary (decoder-like, small)
    (2, 7, 3, 3, 16, 8),       # partial rotary (encoder-like: half the head)
    (3, 1, 4, 1, 128, 128),    # decode shape: one token per sequence, real decoder head_dim
    (1, 9, 2, 2, 64, 32),      # real encoder head_dim/rotary_dim
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_fused_qkv_views(case, dtype):
    B, T, HQ, HK, D, R = case
    _, q, k, _ = _qkv_views(B, T, HQ, HK, D, dtype, seed=sum(case))
    g = torch.Generator().manual_seed(sum(case))
    pos = torch.randint(0, 300, (B, T), generator=g).to(DEV)
    if T > 1:
        pos[0, 1] = -1  # padding token: must stay untouched
    cos, sin = build_rope_cache(R, 300, 10000.0, DEV)
    q_ref, k_ref = rope_ref(q.clone(), k.clone(), pos, cos, sin)
    rope_(q, k, pos, cos, sin)
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)


def test_rope_transposed_strides_int32_positions():
    # q/k as (B, H, T, D) storage transposed to (B, T, H, D) views: arbitrary token/head strides
    B, T, HQ, HK, D = 2, 6, 4, 2, 32
    q = randn(B, HQ, T, D, dtype=torch.float32, seed=11).transpose(1, 2)
    k = randn(B, HK, T, D, dtype=torch.float32, seed=12).transpose(1, 2)
    pos = torch.arange(T, dtype=torch.int32, device=DEV)[None].repeat(B, 1) + torch.tensor([[0], [5]], device=DEV,
                                                                                          dtype=torch.int32)
    cos, sin = build_rope_cache(D, 64, 10000.0, DEV)
    q_ref, k_ref = rope_ref(q.clone(), k.clone(), pos, cos, sin)
    rope_(q, k, pos, cos, sin)
    close(q, q_ref, torch.float32)
    close(k, k_ref, torch.float32)


def test_rope_cache_matches_hf_formula():
    dim, theta = 32, 10000.0
    cos, sin = build_rope_cache(dim, 50, theta, "cpu")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(50).float()[:, None] @ inv[None, :]
    torch.testing.assert_close(cos, freqs.cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin, freqs.sin(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------ kv append (+rope)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("with_rows", [False, True])
def test_kv_append(dtype, T, with_rows):
    B, HK, D, L = 3, 2, 32, 40
    _, _, k, v = _qkv_views(B, T, 4, HK, D, dtype, seed=T * 10 + with_rows)
    g = torch.Generator().manual_seed(T)
    pos = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)]).to(DEV)
    pos[1, 0] = -1
    rows = torch.tensor([3, 0, 2], device=DEV) if with_rows else None
    kc = torch.full((4, HK, L, D), float("nan"), device=DEV, dtype=dtype)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_append(k, v, pos, kc, vc, rows)
    kv_append_ref(k, v, pos, kc_ref, vc_ref, rows)
    # pure copies: bit-exact, NaN (untouched slots) in the same places
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert torch.equal(kc.nan_to_num(0.0), kc_ref.nan_to_num(0.0))
    assert torch.equal(vc.nan_to_num(0.0), vc_ref.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(3, 1, 4, 2, 32, 32), (2, 4, 2, 2, 16, 8)])
def test_rope_and_append(case, dtype):
    B, T, HQ, HK, D, R = case
    L = 24
    _, q, k, v = _qkv_views(B, T, HQ, HK, D, dtype, seed=sum(case) + 1)
    pos = (torch.arange(T, device=DEV)[None] + torch.tensor([[0], [7], [19]], device=DEV)[:B]).clamp(max=L - 1)
    rows = torch.tensor([1, 0, 2], device=DEV)[:B]
    cos, sin = build_rope_cache(R, 64, 10000.0, DEV)
    _rope_and_append_against_ref(q, k, v, pos, cos, sin, rows, (3, HK, L, D), dtype)


def _rope_and_append_against_ref(q, k, v, pos, cos, sin, rows, cache_shape, dtype):
    """rope_and_append against its reference into NaN-poisoned caches of ``cache_shape``; returns the k cache.
    Rotation within the dtype's tolerance, the caches NaN (untouched) in the same places, v copied bit for bit."""
    kc = torch.full(cache_shape, float("nan"), device=DEV, dtype=dtype)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, k_ref = rope_and_append_ref(q.clone(), k.clone(), v, pos, cos, sin, kc_ref, vc_ref, rows)
    rope_and_append(q, k, v, pos, cos, sin, kc, vc, rows)
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    close(kc.nan_to_num(0.0), kc_ref.nan_to_num(0.0), dtype)
    assert torch.equal(vc.nan_to_num(0.0), vc_ref.nan_to_num(0.0))
    return kc


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_append_packed_rows(dtype):
    """A packed prefill's call: one row of tokens holding three prompts (lengths 5, 2, 4), each token with its
    own position (0.. within its prompt) and cache row ((B, T) cache_rows, int32 like the model passes them)."""
    HQ, HK, D, L = 4, 2, 32, 8
    lengths, prompt_rows = [5, 2, 4], [2, 0, 3]
    T = sum(lengths)
    _, q, k, v = _qkv_views(1, T, HQ, HK, D, dtype, seed=77)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEV, torch.int32)[None]
    rows = torch.repeat_interleave(torch.tensor(prompt_rows), torch.tensor(lengths)).to(DEV, torch.int32)[None]
    cos, sin = build_rope_cache(D, 64, 10000.0, DEV)
    kc = _rope_and_append_against_ref(q, k, v, pos, cos, sin, rows, (4, HK, L, D), dtype)
    # row 1 untouched, and each prompt's row written at exactly its slots 0..len-1
    assert kc[1].isnan().all()
    for row, n in zip(prompt_rows, lengths):
        assert not kc[row, :, :n].isnan().any() and kc[row, :, n:].isnan().all()
    with pytest.raises(ValueError, match="cache_rows must be"):
        rope_and_append(q, k, v, pos, cos, sin, kc, kc.clone(), rows[:, :3])


# ------------------------------------------------------------------------------------ decode attention
def _attn_inputs(B, HQ, HK, D, LBUF, dtype, seed, lengths):
    kc = randn(B + 1, HK, LBUF, D, dtype=dtype, seed=seed)
    vc = randn(B + 1, HK, LBUF, D, dtype=dtype, seed=seed + 1)
    q = randn(B, HQ, D, dtype=dtype, seed=seed + 2)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    return q, kc, vc, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_attention_mixed_lengths(dtype, num_splits):
    B, HQ, HK, D, L = 4, 8, 2, 32, 70
    q, kc, vc, lens = _attn_inputs(B, HQ, HK, D, L, dtype, seed=5 + (num_splits or 0), lengths=[1, 70, 33, 17])
    out = torch.full((B, HQ, D), float("nan"), device=DEV, dtype=dtype)
    decode_attention(q, kc, vc, lens, L, num_splits=num_splits, out=out)
    close(out, decode_attention_ref(q, kc, vc, lens, L), dtype)


def test_decode_attention_rows_zero_length_and_bucket():
    # cache rows remapped, a zero-length sequence (-> 0), max_len a bucket smaller than the buffer
    B, HQ, HK, D, LBUF, L = 3, 4, 1, 16, 50, 40
    q, kc, vc, lens = _attn_inputs(B, HQ, HK, D, LBUF, torch.float32, seed=21, lengths=[0, 40, 23])
    rows = torch.tensor([2, 3, 0], device=DEV)
    for ns in (1, 4):
        out = torch.full((B, HQ, D), float("nan"), device=DEV)
        decode_attention(q, kc, vc, lens, L, cache_rows=rows, num_splits=ns, out=out)
        ref = decode_attention_ref(q, kc, vc, lens, L, cache_rows=rows)
        close(out, ref, torch.float32)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_attention_strided_q():
    # q as a view into a fused qkv row (B, (HQ+2HK)*D)
    B, HQ, HK, D, L = 2, 4, 2, 32, 30
    qkv = randn(B, (HQ + 2 * HK) * D, dtype=torch.float32, seed=31)
    q = qkv[:, : HQ * D].view(B, HQ, D)
    _, kc, vc, lens = _attn_inputs(B, HQ, HK, D, L, torch.float32, seed=32, lengths=[30, 9])
    close(decode_attention(q, kc, vc, lens, L), decode_attention_ref(q, kc, vc, lens, L), torch.float32)


@pytest.mark.parametrize("D", [8, 4])
def test_decode_attention_small_head_dim(D):
    # head_dim below tl.dot's minimum K of 16 (the tiny test model has 8): padded lanes must not leak
    B, HQ, HK, L = 3, 4, 2, 20
    q, kc, vc, lens = _attn_inputs(B, HQ, HK, D, L, torch.float32, seed=40 + D, lengths=[20, 3, 11])
    for ns in (1, 3):
        out = torch.full((B, HQ, D), float("nan"), device=DEV)
        decode_attention(q, kc, vc, lens, L, num_splits=ns, out=out)
        close(out, decode_attention_ref(q, kc, vc, lens, L), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 4])
def test_decode_attention_in_kernel_combine(dtype, num_splits, monkeypatch):
    """counters=: the split programs combine in the last one (no second kernel): the reference's result, close to
    the two-kernel combine, zero-length rows 0, remapped cache rows, and the counters zero again after each call
    (reused across calls, as the decoder does across layers and steps)."""
    from glmasr_kernels import decode_attention as da
    from glmasr_kernels.decode_attention import new_counters

    monkeypatch.setattr(da, "COMBINE_IN_KERNEL_MAX_SPLITS", 4)
    # 16-position tiles under the interpreter, 64 on the GPU: a context long enough for every split to hold some
    B, HQ, HK, D = 4, 8, 2, 32
    L = 300 if DEV == "cuda" else 70
    q, kc, vc, lens = _attn_inputs(B, HQ, HK, D, L + 20, dtype, seed=60 + num_splits, lengths=[1, L, 0, L // 2])
    rows = torch.tensor([4, 0, 2, 1], device=DEV)
    counters = new_counters(DEV, 16)
    ref = decode_attention_ref(q, kc, vc, lens, L, cache_rows=rows)
    two = decode_attention(q, kc, vc, lens, L, cache_rows=rows, num_splits=num_splits)
    for _ in range(2):
        out = torch.full((B, HQ, D), float("nan"), device=DEV, dtype=dtype)
        decode_attention(q, kc, vc, lens, L, cache_rows=rows, num_splits=num_splits, out=out, counters=counters)
        close(out, ref, dtype)
        close(out, two, dtype)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert not counters.any(), "the last program of each (sequence, kv head) resets its counter"


def _spy_launches(monkeypatch, name: str) -> list:
    """Record every launch of decode_attention's kernel ``name`` as (grid, keyword arguments); it still runs."""
    from glmasr_kernels import decode_attention as da

    calls = []
    real = getattr(da, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(da, name, Spy())
    return calls


def test_decode_attention_in_kernel_combine_only_for_few_splits(monkeypatch):
    """More splits than COMBINE_IN_KERNEL_MAX_SPLITS go to the combine kernel (the counters stay unused)."""
    from glmasr_kernels import decode_attention as da

    calls = _spy_launches(monkeypatch, "_combine_kernel")
    q, kc, vc, lens = _attn_inputs(2, 4, 2, 16, 400, torch.float32, seed=71, lengths=[400, 99])
    counters = da.new_counters(DEV, 8)
    ref = decode_attention_ref(q, kc, vc, lens, 400)
    # 400 positions: 4 splits of 100 (GPU: 128-position chunks) and 7 of 58 (64): the launcher rounds chunks up to
    # whole tiles, so the split counts asked for are the ones launched on either device
    assert da.COMBINE_IN_KERNEL_MAX_SPLITS == 4
    for ns, want in ((4, 0), (7, 1)):
        calls.clear()
        close(decode_attention(q, kc, vc, lens, 400, num_splits=ns, counters=counters), ref, torch.float32)
        assert len(calls) == want and not counters.any()


def test_decode_attention_counters_are_checked():
    from glmasr_kernels.decode_attention import new_counters

    q, kc, vc, lens = _attn_inputs(3, 4, 2, 16, 200, torch.float32, seed=70, lengths=[200, 3, 11])
    for bad in (new_counters(DEV, 8).long(), [0] * 8, new_counters(DEV, 16)[::2]):
        with pytest.raises(ValueError, match="counters must be a contiguous int32 tensor"):
            decode_attention(q, kc, vc, lens, 200, counters=bad)
    with pytest.raises(ValueError, match="counters must hold at least B \\* Hk = 6 elements for a split launch"):
        decode_attention(q, kc, vc, lens, 200, num_splits=2, counters=new_counters(DEV, 5))
    # too few counters for this batch, but one pass (no split): nothing to count, no error
    ref = decode_attention_ref(q, kc, vc, lens, 200)
    close(decode_attention(q, kc, vc, lens, 200, num_splits=1, counters=new_counters(DEV, 5)), ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_rows", [False, True])
def test_decode_attention_one_tile_path_equals_the_loop(dtype, with_rows, monkeypatch):
    """Programs whose split is one tile skip the loop (and, without cache_rows, load their tile before the PDL
    wait): bit-identical to the loop's one iteration at the same warps (fp32's FMA dot sums in a layout that
    depends on them), single pass and split, zero-length sequences 0, and cache positions at or past each length
    poisoned with NaN (the early tile reads them; they must be zeroed). At its own warps (ONE_TILE_WARPS) the
    path is checked against the reference."""
    from glmasr_kernels import decode_attention as da

    launches = _spy_launches(monkeypatch, "_decode_attn_kernel")
    tile = 64 if DEV == "cuda" else 16
    B, HQ, HK, D = 4, 8, 2, 32
    for L, ns, lengths in ((tile, 1, [tile, 1, 0, 9]), (4 * tile, 4, [4 * tile, 3 * tile + 5, 0, 1]),
                           (4 * tile, 4, [tile, tile + 1, 2 * tile - 1, 7])):
        q, kc, vc, lens = _attn_inputs(B, HQ, HK, D, L + 8, dtype, seed=80 + L + lengths[-1], lengths=lengths)
        rows = torch.tensor([3, 0, 4, 1], device=DEV) if with_rows else None
        for b, n in enumerate(lengths):
            r = b if rows is None else int(rows[b])
            kc[r, :, n:] = float("nan")
            vc[r, :, n:] = float("nan")
        # the reference multiplies the masked positions by 0: its copy of the poison must be finite
        ref = decode_attention_ref(q, kc.nan_to_num(), vc.nan_to_num(), lens, L, cache_rows=rows)
        outs = []
        for one_tile, settled, warps in ((True, False, 4), (True, True, 4), (False, False, 4), (True, True, None)):
            monkeypatch.setattr(da, "ONE_TILE_PATH", one_tile)
            launches.clear()
            out = torch.full((B, HQ, D), float("nan"), device=DEV, dtype=dtype)
            decode_attention(q, kc, vc, lens, L, cache_rows=rows, num_splits=ns, block_n=tile, out=out,
                             lengths_settled=settled, num_warps=warps)
            assert [kw["ONE_TILE"] for _, kw in launches] == [one_tile], launches
            outs.append(out)
            close(out, ref, dtype)
            if lengths[2] == 0:
                assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), (L, ns, lengths)
    # a split of more than one tile keeps the loop
    launches.clear()
    q, kc, vc, lens = _attn_inputs(1, HQ, HK, D, 4 * tile, dtype, seed=99, lengths=[4 * tile])
    out = decode_attention(q, kc, vc, lens, 4 * tile, num_splits=2, block_n=tile)
    assert [kw["ONE_TILE"] for _, kw in launches] == [False]
    close(out, decode_attention_ref(q, kc, vc, lens, 4 * tile), dtype)


@gpu_only
def test_decode_attention_early_tile_sees_the_append_in_a_pdl_graph():
    """The one-tile path requests its tile before the PDL wait while the kernel before it (here rope_and_append,
    as the decode step's qkv GEMV does) is still storing the last position: that position must be read again after
    the wait. Its slot holds NaN before every replay, so an early copy that slipped through gives NaN."""
    from glmasr_kernels._triton_utils import pdl_enabled

    torch.manual_seed(7)
    B, HQ, HK, D, L = 1, 16, 4, 128, 64
    dt = torch.bfloat16
    cos, sin = build_rope_cache(D, 256, device=DEV)
    kc = torch.randn(B, HK, L, D, device=DEV, dtype=dt)
    vc = torch.randn(B, HK, L, D, device=DEV, dtype=dt)
    q = torch.randn(B, 1, HQ, D, device=DEV, dtype=dt)
    k = torch.randn(B, 1, HK, D, device=DEV, dtype=dt)
    v = torch.randn(B, 1, HK, D, device=DEV, dtype=dt)
    out = torch.empty(B, HQ, D, device=DEV, dtype=dt)
    for n in (L, 40, 1):
        pos = torch.full((B, 1), n - 1, device=DEV, dtype=torch.int64)
        lens = pos[:, 0].to(torch.int32) + 1
        qs = q.clone()

        for settled in (False, True):  # lens is written before the graph: settled either way
            def step():
                qs.copy_(q)
                rope_and_append(qs, k.clone(), v, pos, cos, sin, kc, vc)
                decode_attention(qs[:, 0], kc, vc, lens, L, out=out, lengths_settled=settled)

            step()
            torch.cuda.synchronize()
            ref = decode_attention_ref(qs[:, 0], kc, vc, lens, L).to(dt)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(20):
                kc[:, :, n - 1] = float("nan")
                vc[:, :, n - 1] = float("nan")
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert not out.isnan().any(), (n, settled)
                close(out, ref, dt)
    assert pdl_enabled(torch.device(DEV))


def test_choose_num_splits():
    assert choose_num_splits(64, 4, 4096, 132) >= 1
    assert choose_num_splits(1, 4, 8192, 132) > 8
    assert choose_num_splits(1, 4, 64, 132) == 1
    assert choose_num_splits(256, 4, 4096, 132) == 1


def _commit_state(b, seed, lp_dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    st = dict(eos_ids=torch.tensor([3, 7, 11]), ignore_eos=torch.rand(b + 2, generator=g) < 0.3,
              out=torch.randint(-1, 50, (b + 2, 8), generator=g),
              out_logprob=torch.full((b + 2, 8), float("nan"), dtype=lp_dtype),  # poisoned: unwritten shows
              step_index=torch.tensor([5]),
              remaining=torch.randint(0, 4, (b + 2,), generator=g),
              status=torch.randint(0, 3, (b + 2,), generator=g),
              stop_token=torch.randint(-1, 50, (b + 2,), generator=g), active=torch.rand(b + 2, generator=g) < 0.7,
              tokens=torch.randint(0, 50, (b + 2,), generator=g),
              positions=torch.randint(0, 100, (b + 2,), generator=g))
    return {k: v.to(DEV) for k, v in st.items()}


# The chosen token's log-probability: both sides compute log_softmax over the fp32 values of the row (bf16
# logits are cast exactly), so the only differences are the order of the sum S of exp(x - max) (the kernel: a
# few dozen terms per lane, then a tree over the lanes; torch: its own vectorised order) and the exp
# implementation; logp = -log(S) then differs by about the relative error of S, in absolute terms. Measured
# against fp64: the kernel <= 3e-7 at V = 59264 (interpreter); torch's CPU log_softmax (long sequential lane
# sums) up to 9e-6 there, ~5e-7 at the V <= 3001 tested here. So fp32 rtol = atol = 1e-5, and each side is also
# held to the fp64 value at the same tolerance.
LOGPROB_TOL = dict(rtol=1e-5, atol=1e-5)


def _check_logprobs(ours, ref):
    """The whole buffers: NaN where the reference has NaN (poison left in place, an all -inf row), else close."""
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)), "written elements differ (unwritten or extra write)"
    torch.testing.assert_close(ours, ref, equal_nan=True, **LOGPROB_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_commit_matches_torch(dtype):
    """argmax + its log-prob + stop bookkeeping in one kernel == torch argmax / log_softmax gather + the engine's
    commit_tokens, on random state: eos picks (some ignored), budgets running out, masked slots, a tie (first
    index wins), an all -inf row (token 0, log-prob NaN as in torch), the maximum in the ragged last tile;
    slots >= b untouched."""
    b, v = 9, 2500
    logits = randn(b, v, dtype=dtype, seed=171)
    logits[0, 7] = 50.0                           # eos
    logits[1, 11] = 50.0                          # eos (maybe ignored)
    logits[2, 40] = logits[2, 1064] = 60.0        # tie (same lane of a 1024-wide tile): index 40
    logits[3] = float("-inf")                     # all -inf: index 0
    logits[4, v - 1] = 70.0                       # last, ragged tile
    logits[5, 3] = 55.0
    mask = torch.rand(b + 2, generator=torch.Generator().manual_seed(5)) < 0.8
    mask[:6] = True
    mask = mask.to(DEV)
    for seed in (1, 2):
        ours, ref = _commit_state(b, seed), _commit_state(b, seed)
        greedy_commit(logits, mask[:b], **ours)
        picks, logps = greedy_commit_ref(logits, mask[:b], **ref)
        assert picks[:5].tolist() == [7, 11, 40, 0, v - 1]
        assert math.isnan(logps[3].item())
        for name in ours:
            if name != "out_logprob":
                assert torch.equal(ours[name], ref[name]), name
        _check_logprobs(ours["out_logprob"], ref["out_logprob"])
        col = ours["out_logprob"][:b, 5]
        appended = ours["out"][:b, 5] >= 0
        assert (col[~appended] == 0).all() and torch.isnan(ours["out_logprob"][b:]).all()
    with pytest.raises(ValueError, match="remaining"):
        bad = _commit_state(b, 3)
        bad["remaining"] = bad["remaining"].int()
        greedy_commit(logits, mask[:b], **bad)
    with pytest.raises(ValueError, match="out_logprob"):
        bad = _commit_state(b, 3)
        bad["out_logprob"] = bad["out_logprob"].half()
        greedy_commit(logits, mask[:b], **bad)


@pytest.mark.parametrize("v", [1, 5, 264, 1023, 1024, 1025, 2049, 3001, 4097, 8191])
@pytest.mark.parametrize("dtype, lp_dtype", [(torch.float32, torch.float64), (torch.bfloat16, torch.float64),
                                             (torch.float32, torch.float32)])
def test_greedy_commit_logprob_equals_log_softmax(v, dtype, lp_dtype):
    """Every slot appends (ignore_eos, budgets left), so the written column is exactly the log-softmax of each
    row at its argmax: vocabularies below, at and across the 1024-wide tile of the interpreter and the 4096-wide
    one of the GPU (ragged tails),
    flat rows (scale 0.01: the sum has V comparable terms) and peaked ones (scale 8: log-prob near 0)."""
    b = 6
    for scale, seed in ((1.0, 300), (0.01, 301), (8.0, 302)):
        logits = randn(b, v, dtype=dtype, seed=seed + v, scale=scale)
        mask = torch.ones(b, dtype=torch.bool, device=DEV)
        ours, ref = _commit_state(b, seed, lp_dtype), _commit_state(b, seed, lp_dtype)
        for st in (ours, ref):
            st["ignore_eos"].fill_(True)
            st["remaining"].fill_(100)
        greedy_commit(logits, mask, **ours)
        picks, logps = greedy_commit_ref(logits, mask, **ref)
        assert torch.equal(ours["out"], ref["out"]) and torch.equal(ours["tokens"][:b], picks)
        want = torch.log_softmax(logits.float(), -1).gather(-1, picks[:, None])[:, 0]
        torch.testing.assert_close(logps, want, rtol=0, atol=0)  # the reference is log_softmax + gather
        got = ours["out_logprob"][:b, 5]
        assert torch.isfinite(got).all() and (got <= 1e-6).all()
        torch.testing.assert_close(got, want.to(lp_dtype), **LOGPROB_TOL)
        exact = torch.log_softmax(logits.double(), -1).gather(-1, picks[:, None])[:, 0]
        torch.testing.assert_close(got.double(), exact, **LOGPROB_TOL)
        _check_logprobs(ours["out_logprob"], ref["out_logprob"])
        if v == 1:
            assert (got == 0).all()  # one token: probability 1


# ------------------------------------------------------------------------------- GPU: real shapes
@gpu_only
@pytest.mark.parametrize("with_res", [False, True])
def test_gpu_layernorm_encoder_shape(with_res):
    x = randn(32, 1500, 1280, dtype=torch.bfloat16, seed=101)
    w = randn(1280, dtype=torch.bfloat16, seed=102)
    b = randn(1280, dtype=torch.bfloat16, seed=103)
    r = randn(32, 1500, 1280, dtype=torch.bfloat16, seed=104) if with_res else None
    out, ref = layer_norm(x, w, b, 1e-5, r), layer_norm_ref(x, w, b, 1e-5, r)
    if with_res:
        close(out[0], ref[0], torch.bfloat16)
        assert torch.equal(out[1], ref[1])
    else:
        close(out, ref, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("shape", [(1, 400, 2048), (64, 1, 2048), (8, 512, 2048)])
def test_gpu_rmsnorm_decoder_shapes(shape):
    x = randn(*shape, dtype=torch.bfloat16, seed=111)
    w = randn(2048, dtype=torch.bfloat16, seed=112)
    r = randn(*shape, dtype=torch.bfloat16, seed=113)
    out, res = rms_norm(x, w, 1e-5, r)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-5, r)
    close(out, out_ref, torch.bfloat16)
    assert torch.equal(res, res_ref)
    # bf16 rounding points follow HF: nearly all elements bit-identical
    assert (out == out_ref).float().mean().item() > 0.99


@gpu_only
def test_gpu_activations_real_shapes():
    x = randn(2, 1500, 5120, dtype=torch.bfloat16, seed=121)
    b = randn(5120, dtype=torch.bfloat16, seed=122)
    close(gelu_bias(x, b), gelu_bias_ref(x, b), torch.bfloat16)
    g = randn(1, 400, 2 * 6144, dtype=torch.bfloat16, seed=123)
    out, ref = swiglu(g), swiglu_ref(g)
    close(out, ref, torch.bfloat16)
    assert (out == ref).float().mean().item() > 0.99


def _report_exact(tag, out, ref):
    """bf16 GPU results should match HF's roundings almost everywhere; print how far from bit-exact."""
    close(out, ref, torch.bfloat16)
    ne = out != ref
    frac = ne.float().mean().item()
    msg = f"[exact] {tag}: {frac * 100:.4f}% elements differ"
    if ne.any():
        i = ne.nonzero()[0].tolist()
        msg += f", max |diff| {(out.float() - ref.float()).abs().max().item():.3g}, e.g. at {i}: " \
               f"{out[tuple(i)].item()} vs {ref[tuple(i)].item()}"
    print(msg)
    assert frac < 1e-3, msg


@gpu_only
def test_gpu_rope_real_shapes():
    # encoder: (32, 1500) tokens, 20 heads x 64, rotary 32, views into fused qkv
    _, q, k, _ = _qkv_views(32, 1500, 20, 20, 64, torch.bfloat16, seed=131)
    pos = torch.arange(1500, device=DEV)[None].expand(32, 1500)
    cos, sin = build_rope_cache(32, 1500, 10000.0, DEV)
    qr, kr = rope_ref(q.clone(), k.clone(), pos, cos, sin)
    rope_(q, k, pos, cos, sin)
    _report_exact("rope enc", q, qr)
    _report_exact("rope enc k", k, kr)
    # decoder prefill + decode
    cos, sin = build_rope_cache(128, 8192, 10000.0, DEV)
    for B, T in [(2, 400), (64, 1)]:
        _, q, k, _ = _qkv_views(B, T, 16, 4, 128, torch.bfloat16, seed=132 + B)
        pos = torch.randint(0, 8192 - T, (B, 1), device=DEV) + torch.arange(T, device=DEV)[None]
        qr, kr = rope_ref(q.clone(), k.clone(), pos, cos, sin)
        rope_(q, k, pos, cos, sin)
        _report_exact(f"rope dec {B}x{T} q", q, qr)
        _report_exact(f"rope dec {B}x{T} k", k, kr)


@gpu_only
@pytest.mark.parametrize("B,L", [(64, 4096), (1, 8192), (8, 512), (3, 64)])
def test_gpu_decode_attention_real(B, L):
    g = torch.Generator().manual_seed(B * L)
    lens = torch.randint(1, L + 1, (B,), generator=g).tolist()
    lens[0] = L
    q, kc, vc, lens = _attn_inputs(B, 16, 4, 128, L, torch.bfloat16, seed=141 + B, lengths=lens)
    ref = decode_attention_ref(q, kc, vc, lens, L)
    for ns in (None, 1, 4):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kc, vc, lens, L, num_splits=ns, out=out)
        close(out, ref, torch.bfloat16)


@gpu_only
def test_gpu_decode_step_cuda_graph():
    """rope_and_append + decode_attention captured in a CUDA graph; replay with new positions/lengths."""
    B, HQ, HK, D, L = 8, 16, 4, 128, 1024
    cos, sin = build_rope_cache(D, L, 10000.0, DEV)
    kc = randn(B, HK, L, D, dtype=torch.bfloat16, seed=151)
    vc = randn(B, HK, L, D, dtype=torch.bfloat16, seed=152)
    qkv = torch.empty(B, 1, (HQ + 2 * HK) * D, device=DEV, dtype=torch.bfloat16)
    pos = torch.zeros(B, 1, dtype=torch.int64, device=DEV)
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    out = torch.empty(B, HQ, D, device=DEV, dtype=torch.bfloat16)

    def step():
        q = qkv[..., : HQ * D].view(B, 1, HQ, D)
        k = qkv[..., HQ * D: (HQ + HK) * D].view(B, 1, HK, D)
        v = qkv[..., (HQ + HK) * D:].view(B, 1, HK, D)
        rope_and_append(q, k, v, pos, cos, sin, kc, vc)
        decode_attention(q.view(B, HQ, D), kc, vc, lens, L, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qkv.copy_(randn(*qkv.shape, dtype=torch.bfloat16, seed=150))
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for it in range(3):
        p = torch.randint(0, L - 1, (B, 1), device=DEV)
        pos.copy_(p)
        lens.copy_((p[:, 0] + 1).to(torch.int32))
        fresh = randn(*qkv.shape, dtype=torch.bfloat16, seed=160 + it)
        qkv.copy_(fresh)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = fresh[..., : HQ * D].view(B, 1, HQ, D).clone()
        k = fresh[..., HQ * D: (HQ + HK) * D].view(B, 1, HK, D).clone()
        v = fresh[..., (HQ + HK) * D:].view(B, 1, HK, D).clone()
        q_ref, _ = rope_and_append_ref(q, k, v, pos, cos, sin, kc_ref, vc_ref)
        ref = decode_attention_ref(q_ref.view(B, HQ, D), kc_ref, vc_ref, lens, L)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, ref, torch.bfloat16)
        assert torch.equal(vc, vc_ref)  # pure copy
        _report_exact("graph k cache", kc, kc_ref)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_greedy_commit_real_vocab_in_graph(dtype):
    """The real vocabulary (59264) at batch 1..64, launched with PDL inside a CUDA graph as in the decode step,
    replayed on fresh logits: tokens and bookkeeping equal the reference, log-probs within LOGPROB_TOL."""
    v = 59264
    for b in (1, 7, 64):
        logits = torch.empty(b, v, device=DEV, dtype=dtype)
        mask = torch.ones(b, dtype=torch.bool, device=DEV)
        ours = _commit_state(b, 7)
        ours["ignore_eos"].fill_(True)
        ours["remaining"].fill_(10 ** 6)
        start = {k: t.clone() for k, t in ours.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            logits.copy_(randn(b, v, dtype=dtype, seed=400 + b, scale=4.0))
            greedy_commit(logits, mask, **ours)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            greedy_commit(logits, mask, **ours)
        for it in range(3):
            for k in ours:
                ours[k].copy_(start[k])
            ref = {k: t.clone() for k, t in start.items()}
            logits.copy_(randn(b, v, dtype=dtype, seed=500 + 10 * b + it, scale=4.0))
            graph.replay()
            torch.cuda.synchronize()
            greedy_commit_ref(logits, mask, **ref)
            for name in ours:
                if name != "out_logprob":
                    assert torch.equal(ours[name], ref[name]), name
            _check_logprobs(ours["out_logprob"], ref["out_logprob"])
