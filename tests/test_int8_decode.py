"""Opt-in int8 decode weights: ``skinny_gemm.quantize_rows``, the int8 variants of the skinny GEMV kernels
(``scale=``) against their fp32 references, and the model path (``glmasr.load(..., decode_weights="int8")``)
against bf16 decode weights on the tiny random checkpoint; the CLI flag; ``scripts/bench/int8_agreement.py``.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest without a GPU), small odd shapes. Inputs are
fresh seeded torch.randn draws (x ~ N(0, 1), W ~ N(0, 1/K), so outputs are ~N(0, 1)), never zeros; one weight row
is all zeros on purpose (its scale is 1, its outputs 0); outputs and split-K workspaces are NaN-poisoned first.

Kernel tolerance. The reference (``*_ref(..., scale=)``) dequantizes in fp32 (``q * scale[:, None]``), multiplies
in fp32 and rounds once; the kernel sums ``x * q`` in fp32 in another order, scales the sum and rounds once. The
two fp32 results differ by ~1e-7 of the summed magnitudes, so:
* fp32 I/O (no rounding at all): |out - ref| <= 1e-5 (1 + |ref|) (plain and SwiGLU); this is the tight check
  that each row's scale, the gate's and the up's, is applied where it belongs.
* bf16 I/O, plain: one bf16 rounding of the output: |out - ref| <= 2**-7 |ref| + 1e-5 (bf16 keeps 8 significant
  bits, so one rounding moves a value by at most 2**-7 of its magnitude; the interpreter truncates where the
  reference rounds to nearest, still within one such step).
* bf16 I/O, SwiGLU: rounded at gate/up, at silu and at the product like the bf16 reference, where silu can
  amplify a one-ulp gate difference: the bf16 SwiGLU bound of tests/test_skinny_gemm.py (|d| <= 1e-2 + 3.2e-2
  |ref|, relative norm < 2e-2).

Model tolerance (tiny random checkpoint, fp32, 2 layers, hidden 32): (1) the int8 decode step must equal, to
fp32 rounding (1e-4 of the largest logit), the same step with every decoder matrix replaced by its dequantized
copy ``q * scale``, i.e. the right int8 matrices with the right scales reach every GEMV, and nothing else
changes; (2) against the unquantized weights, on random embeddings (18 rows: the int8 GEMVs run 16 + 2 rows) and
teacher-forced (16 sequences fed the bf16 path's greedy tokens), |logit difference| / std(logits) must stay
< 0.06 on average and < 1.0 at worst, and top-1 agreement >= 0.9, about 2x the quantization's own effect on
this model (mean ~0.02-0.025, worst ~0.25-0.5, agreement 0.97-1.0). Bugs fail them: a scale left out gives mean
~1.0 and agreement ~0.06, the up rows scaled with the gate's scales mean ~0.29 and agreement ~0.55, every
non-SwiGLU scale applied 5% too large mean 0.06-0.08; (1) fails all three (and a decode step that ignores the
int8 copies), and ``test_int8_model_holds_both_weights`` checks the stored copies against the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEV, noise, require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

import glmasr  # noqa: E402
from glmasr_kernels.skinny_gemm import (  # noqa: E402
    MAX_M, SkinnyConfig, int8_config, invariant_config, kernel_config, linear, linear_invariant, linear_swiglu,
    linear_swiglu_invariant, quantize_rows, select, skinny_gemm, skinny_gemm_ref, skinny_gemm_swiglu,
    skinny_gemm_swiglu_ref)

ROOT = Path(__file__).resolve().parent.parent
BF = torch.bfloat16
F32 = torch.float32
_SEED = [9000]


def gen(*shape, scale=1.0, dtype=BF):
    _SEED[0] += 1
    g = torch.Generator().manual_seed(_SEED[0])
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype)


def poisoned(*shape, dtype=BF):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def weight(rows, k, dtype=BF):
    """A random int8 weight (rows, k) with its scales; row 5 all zeros (scale 1)."""
    w = gen(rows, k, scale=k ** -0.5, dtype=dtype)
    w[5] = 0
    return quantize_rows(w)


def check(out, ref, swiglu=False):
    """The module docstring's kernel tolerance for out's dtype."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "NaN/Inf in output (unwritten element?)"
    err = (o - r).abs()
    if out.dtype == F32:
        bound = 1e-5 * (1 + r.abs())
    elif swiglu:
        bound = 1e-2 + 3.2e-2 * r.abs()
        assert ((o - r).norm() / r.norm()).item() < 2e-2
    else:
        bound = 2.0 ** -7 * r.abs() + 1e-5
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off; max abs err {err.max().item():.3g}"


# ------------------------------------------------------------------------------------------------ quantize_rows

@pytest.mark.parametrize("dtype", [BF, F32])
def test_quantize_rows_round_trip(dtype):
    w = gen(37, 200, scale=0.1, dtype=dtype)
    w[3, 17] = 40.0  # an outlier: its row's step grows, the others' do not
    w[5] = 0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == F32 and s.shape == (37,)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    assert s[5].item() == 1.0 and not q[5].any()
    nonzero = [i for i in range(37) if i != 5]
    assert (q[nonzero].abs().amax(dim=1) == 127).all()  # each row's largest value maps to +-127
    wf = w.float()
    torch.testing.assert_close(s[nonzero], wf[nonzero].abs().amax(dim=1) / 127, rtol=1e-6, atol=0)
    err = (q.float() * s[:, None] - wf).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5) + 1e-7).all(), "a weight is more than half a step off"
    assert s[3] > 10 * s[4]


def test_quantize_rows_bad_input():
    with pytest.raises(ValueError, match="floating-point 2-D"):
        quantize_rows(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="floating-point 2-D"):
        quantize_rows(torch.zeros(8))
    w = torch.randn(6, 8)
    w[4, 2] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite values \(rows \[4\]"):
        quantize_rows(w)


# ------------------------------------------------------------------------------------------------ kernels

# select()'s int8 choice and both inner products, split-K 1 and > 1, ragged K tiles (K = 200 at BK 32/64)
CFGS = [None, SkinnyConfig(8, 32, 1), SkinnyConfig(8, 32, 3), SkinnyConfig(16, 32, 1, use_dot=True),
        SkinnyConfig(16, 64, 2, use_dot=True)]


def _cfg_id(c):
    return "select" if c is None else c.short().replace(" ", "-")


def _launch(x, w, s, cfg, swiglu):
    """The kernel into a poisoned out (and a poisoned workspace for split-K)."""
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    out = poisoned(*x.shape[:-1], n, dtype=x.dtype)
    split = cfg is not None and cfg.split_k > 1
    ws = torch.full((cfg.split_k * x.shape[0] * w.shape[0],), float("nan"), device=DEV) if split else None
    fn = skinny_gemm_swiglu if swiglu else skinny_gemm
    assert fn(x, w, out=out, config=cfg, workspace=ws, scale=s) is out
    return out


@pytest.mark.parametrize("cfg", CFGS, ids=_cfg_id)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_int8_kernel_vs_reference(swiglu, m, cfg):
    n, k = 37, 200
    for dtype in (BF, F32):
        q, s = weight(2 * n if swiglu else n, k)
        x = gen(m, k, dtype=dtype)
        ref = (skinny_gemm_swiglu_ref if swiglu else skinny_gemm_ref)(x, q, scale=s)
        check(_launch(x, q, s, cfg, swiglu), ref, swiglu)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_int8_dispatchers_past_16_rows_never_use_cublas(swiglu, monkeypatch):
    """17 rows (shaped (17, 1, K) like a decode step's x): the kernel twice (16 + 1 rows) into views of out;
    cuBLAS / torch matmul must not be called (it has no int8 x bf16 GEMM)."""
    k, n = 96, 37
    q, s = weight(2 * n if swiglu else n, k)
    x = gen(MAX_M + 1, 1, k)
    ref = (skinny_gemm_swiglu_ref if swiglu else skinny_gemm_ref)(x, q, scale=s)

    def no_cublas(*a, **kw):
        raise AssertionError("an int8 weight reached cuBLAS")

    monkeypatch.setattr(torch.nn.functional, "linear", no_cublas)
    monkeypatch.setattr(torch, "matmul", no_cublas)
    fn = linear_swiglu if swiglu else linear
    out = poisoned(MAX_M + 1, 1, n)
    assert fn(x, q, out=out, scale=s) is out
    check(out, ref, swiglu)
    check(fn(x[:3], q, scale=s), ref[:3], swiglu)  # <= 16 rows: one launch, output allocated


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_int8_invariant_dispatchers(swiglu):
    """A row alone and the same row inside calls of 2, 17 and 21 rows (past 16: 16 at a time): bit-identical."""
    k, n = 96, 37
    fn = linear_swiglu_invariant if swiglu else linear_invariant
    ref_fn = skinny_gemm_swiglu_ref if swiglu else skinny_gemm_ref
    q, s = weight(2 * n if swiglu else n, k)
    assert invariant_config(q.shape[0], k, swiglu, int8=True).use_dot
    row = gen(1, k)
    alone = fn(row, q, out=poisoned(1, n), scale=s)
    for m in (2, 17, 21):
        x = gen(m, k)
        at = (m * 7) // 10  # past the first 16-row chunk for m > 16
        x[at] = row[0]
        out = poisoned(m, n)
        assert fn(x, q, out=out, scale=s) is out
        check(out, ref_fn(x, q, scale=s), swiglu)
        assert torch.equal(out[at], alone[0]), f"M={m}: row {at} differs from the same row alone"


def test_int8_configs():
    """int8 configs start from the bf16 config of the shape: FMA with BLOCK_K doubled, tensor cores unchanged;
    never None (cuBLAS) for 1..16 rows, also where bf16 prefers cuBLAS."""
    for m in range(1, MAX_M + 1):
        for n, k, sw in ((3072, 2048, False), (12288, 2048, True), (2048, 6144, False), (59264, 2048, False)):
            bf = kernel_config(m, n, k, sw)
            i8 = select(m, n, k, sw, int8=True)
            assert i8 == kernel_config(m, n, k, sw, int8=True) == int8_config(bf)
            assert i8.block_k == (bf.block_k if bf.use_dot else 2 * bf.block_k)
            assert (i8.block_n, i8.split_k, i8.use_dot, i8.num_warps, i8.num_stages) == (
                bf.block_n, bf.split_k, bf.use_dot, bf.num_warps, bf.num_stages)
    assert select(2, 59264, 2048) is None and select(2, 59264, 2048, int8=True) is not None
    assert select(MAX_M + 1, 2048, 2048, int8=True) is None  # the dispatchers run 16 rows at a time


def test_int8_bad_inputs_name_the_problem():
    k, n = 32, 16
    q, s = weight(n, k)
    x = gen(2, k)
    for fn in (skinny_gemm, linear, linear_invariant, skinny_gemm_ref):
        with pytest.raises(ValueError, match=r"W is int8: pass its per-row fp32 dequantization scales as scale="):
            fn(x, q)
    with pytest.raises(ValueError, match=r"W is int8"):
        linear(gen(MAX_M + 3, k), q)  # the chunked path checks too
    with pytest.raises(ValueError, match=r"scale must have shape \(16,\)"):
        skinny_gemm(x, q, scale=s[:-1])
    with pytest.raises(ValueError, match=r"scale must have shape \(32,\)"):
        skinny_gemm_swiglu(x, torch.cat([q, q]), scale=s)  # SwiGLU: gate and up rows each need a scale
    with pytest.raises(ValueError, match="scale must be an fp32 tensor"):
        skinny_gemm(x, q, scale=s.to(BF))
    with pytest.raises(ValueError, match="scale must be contiguous"):
        skinny_gemm(x, q, scale=torch.stack([s, s], 1)[:, 0])
    with pytest.raises(ValueError, match=r"scale= is for an int8 W .* W is torch.bfloat16"):
        linear(x, gen(n, k), scale=s)
    with pytest.raises(ValueError, match=r"scale= is for an int8 W"):
        skinny_gemm_ref(x, gen(n, k), scale=s)
    with pytest.raises(ValueError, match="x must be bf16, fp16 or fp32 with an int8 W, got torch.int8"):
        skinny_gemm(q[:2], q, scale=s)
    with pytest.raises(ValueError, match=r"x last dim 48 != W.shape\[1\] 32"):
        skinny_gemm(gen(2, 48), q, scale=s)


# ------------------------------------------------------------------------------------------------ the model path

@pytest.fixture(scope="module")
def handles(tiny_shipped):
    """The tiny checkpoint twice on the Triton path in fp32: bf16 (the model's own) and int8 decode weights."""
    both = [glmasr.load(tiny_shipped, device=DEV, dtype="float32", backend="triton", decode_weights=dw)
            for dw in ("bf16", "int8")]
    yield both
    for h in both:
        h.close()


def _prefilled(models, prompts, capacity):
    from glmasr.models.kv_cache import KVCache

    out = []
    for m in models:
        cache = KVCache(m.cfg.text, len(prompts), capacity, m.device, m.dtype)
        out.append((cache, m.logits(m.prefill(prompts, cache, list(range(len(prompts)))))))
    return out


def _step(model, cache, x, position, invariant=True):
    """One decode step of every cache row; fp32 logits. The lm head (never quantized, the same matrix on both
    paths) in torch: under the interpreter it would cost a third of the step (the script's test runs it).
    ``invariant`` (default): a batch-invariant step, which takes the int8 copies at any row count (a plain step
    of more than ``INT8_MAX_ROWS`` rows takes the bf16 matrices: test_int8_only_for_small_steps)."""
    pos = torch.full((x.shape[0], 1), position, device=DEV, dtype=torch.long)
    before, model.batch_invariant = model.batch_invariant, invariant
    try:
        hidden = model.decode(x[:, None], pos, cache, kv_len=cache.capacity)[:, 0]
    finally:
        model.batch_invariant = before
    return torch.nn.functional.linear(hidden, model.decoder.lm_head).float()


def _embeds(model, n, g):
    scale = float(model.embedding.float().std())
    return (torch.randn(n, model.cfg.text.hidden_size, generator=g) * scale).to(DEV, model.dtype)


class Agreement:
    """Pooled |logit difference| / std(reference logits) and top-1 agreement over decode steps."""

    def __init__(self):
        self.max = self.sum = self.n = self.agree = self.rows = 0

    def add(self, ref, got):
        rel = (got - ref).abs() / ref.std(dim=-1, keepdim=True)
        self.max = max(self.max, rel.max().item())
        self.sum += rel.sum().item()
        self.n += rel.numel()
        self.agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        self.rows += ref.shape[0]

    def check(self):
        mean, agree = self.sum / self.n, self.agree / self.rows
        print(f"[int8 vs bf16] mean |d|/std {mean:.4f}, max {self.max:.4f}, top-1 {agree:.3f} of {self.rows}")
        assert mean < 0.06 and self.max < 1.0 and agree >= 0.9, (
            f"int8 vs bf16: mean |d|/std {mean:.4f}, max {self.max:.4f}, top-1 agreement {agree:.3f} over "
            f"{self.rows} decisions")


def test_int8_model_holds_both_weights(handles):
    b, i = handles
    dec_b, dec_i = b.model.decoder, i.model.decoder
    assert b.model.decode_weights == "bf16" and i.model.decode_weights == "int8"
    assert all(lw.int8 is None for lw in dec_b.layers)
    for lw in dec_i.layers:
        for w, m in zip(lw.tensors(), lw.int8.matrices()):
            assert m.q.dtype == torch.int8 and m.q.shape == w.shape and m.scale.shape == (w.shape[0],)
            torch.testing.assert_close(m.q.float() * m.scale[:, None], w.float(), rtol=0,
                                       atol=float(m.scale.max()) / 2 * (1 + 1e-5))
        assert lw.w_qkv.dtype == F32  # the model's matrices stay (prefill, reference modules)
    assert dec_i.lm_head.dtype == F32  # the lm head is never quantized
    int8_bytes = sum(m.q.numel() + 4 * m.scale.numel() for lw in dec_i.layers for m in lw.int8.matrices())
    head = dec_i.lm_head.numel() * 4
    assert dec_i.weight_bytes() == int8_bytes + head
    assert dec_b.weight_bytes() == sum(w.numel() * 4 for lw in dec_b.layers for w in lw.tensors()) + head


def test_int8_decode_equals_dequantized_weights(handles, tiny_shipped):
    """The int8 decode step against the same step on a third load whose decoder matrices are the dequantized
    copies ``q * scale`` (fp32): equal to fp32 rounding. 17 rows: the int8 GEMVs run 16 + 1 rows."""
    _, i = handles
    deq = glmasr.load(tiny_shipped, device=DEV, dtype="float32", backend="triton")
    try:
        with torch.no_grad():
            for lq, ld in zip(i.model.decoder.layers, deq.model.decoder.layers):
                for m, w in zip(lq.int8.matrices(), ld.tensors()):
                    w.copy_(m.q.float() * m.scale[:, None])
        g = torch.Generator().manual_seed(41)
        rows, plen = 17, 4
        prompts = [_embeds(i.model, plen, g) for _ in range(rows)]
        (ci, _), = _prefilled([i.model], prompts, plen + 2)
        cd = type(ci)(i.model.cfg.text, rows, plen + 2, DEV, F32)
        cd.k.copy_(ci.k)
        cd.v.copy_(ci.v)
        for t in range(2):
            x = _embeds(i.model, rows, g)
            got, want = _step(i.model, ci, x, plen + t), _step(deq.model, cd, x, plen + t)
            assert torch.isfinite(got).all()
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    finally:
        deq.close()


def test_int8_vs_bf16_on_random_embeddings(handles):
    b, i = handles
    g = torch.Generator().manual_seed(7)
    rows, plen, steps = 18, 5, 2
    prompts = [_embeds(b.model, plen, g) for _ in range(rows)]
    (cb, first_b), (ci, first_i) = _prefilled((b.model, i.model), prompts, plen + steps)
    assert torch.equal(first_b, first_i)  # the prefill runs on the model's own weights either way
    agreement = Agreement()
    for t in range(steps):
        x = _embeds(b.model, rows, g)
        agreement.add(_step(b.model, cb, x, plen + t), _step(i.model, ci, x, plen + t))
    agreement.check()


def test_int8_vs_bf16_teacher_forced(handles):
    """16 sequences; the bf16 path decodes greedily and both are fed its tokens."""
    b, i = handles
    g = torch.Generator().manual_seed(8)
    rows, plen, steps = 16, 5, 3
    (cb, first), (ci, _) = _prefilled((b.model, i.model), [_embeds(b.model, plen, g) for _ in range(rows)],
                                      plen + steps)
    tokens = first.argmax(-1)
    agreement = Agreement()
    for t in range(steps):
        x = b.model.embed_tokens(tokens)
        ref = _step(b.model, cb, x, plen + t)
        agreement.add(ref, _step(i.model, ci, x, plen + t))
        tokens = ref.argmax(-1)
    agreement.check()


def test_int8_only_for_small_steps(handles):
    """A plain (not batch-invariant) decode step of more than INT8_MAX_ROWS rows runs on the bf16 matrices: equal
    to the bf16 handle's step bit for bit; a step of INT8_MAX_ROWS rows runs on the int8 copies: it differs."""
    from glmasr.models.fast_decoder import INT8_MAX_ROWS

    b, i = handles
    g = torch.Generator().manual_seed(9)
    for rows, int8 in ((INT8_MAX_ROWS + 1, False), (INT8_MAX_ROWS, True)):
        (cb, _), (ci, _) = _prefilled((b.model, i.model), [_embeds(b.model, 4, g) for _ in range(rows)], 5)
        x = _embeds(b.model, rows, g)
        same = torch.equal(_step(b.model, cb, x, 4, invariant=False), _step(i.model, ci, x, 4, invariant=False))
        assert same != int8, (rows, same)


def test_load_validates_decode_weights(tiny_shipped):
    with pytest.raises(ValueError, match=r"unknown decode_weights 'fp8': use one of \('bf16', 'int8'\)"):
        glmasr.load(tiny_shipped, device="cpu", decode_weights="fp8")
    with pytest.raises(ValueError, match=r"decode_weights='int8' needs the Triton path .*backend='torch' on cpu"):
        glmasr.load(tiny_shipped, device="cpu", backend="torch", decode_weights="int8")
    if not torch.cuda.is_available():  # auto on the CPU is the plain PyTorch path
        with pytest.raises(ValueError, match=r"needs the Triton path .*backend='auto' on cpu"):
            glmasr.load(tiny_shipped, device="cpu", decode_weights="int8")


# ------------------------------------------------------------------------------------------------ CLI, script

def _cli(argv):
    from glmasr.cli.main import main

    return main(argv)


@pytest.mark.parametrize("flags, words", [
    (["--decode-weights", "int8", "--devices", "cpu,cpu"], ["decode_weights='int8' needs CUDA devices (the Triton path), not cpu, cpu"]),
    (["--decode-weights", "int8", "--device", "cpu"], ["decode_weights='int8' needs the Triton path"]),
])
def test_transcribe_cli_decode_weights_refusals(flags, words, tmp_path, tiny_shipped, capsys):
    import soundfile as sf

    if torch.cuda.is_available() and "--device" in flags:
        pytest.skip("on a GPU machine the CPU refusal is covered by test_load_validates_decode_weights")
    sf.write(tmp_path / "x.wav", noise(1.0, 3), 16000)
    rc = _cli(["transcribe", str(tmp_path / "x.wav"), "--model", str(tiny_shipped), "-q", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words) and "Traceback" not in err, err
    assert not (tmp_path / "x.txt").exists()


def test_cli_decode_weights_choices(capsys):
    with pytest.raises(SystemExit) as e:
        _cli(["transcribe", "x.wav", "--decode-weights", "fp8"])
    assert e.value.code == 2 and "--decode-weights" in capsys.readouterr().err


def test_serve_int8_workers_need_cuda(tiny_shipped, capsys):
    """int8 travels to the data-parallel workers; a CPU worker cannot take it: refused before any process starts."""
    pytest.importorskip("uvicorn")
    rc = _cli(["serve", "--model", str(tiny_shipped), "--decode-weights", "int8", "--data-parallel", "2",
               "--devices", "cpu,cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "decode_weights='int8' needs CUDA devices (the Triton path), not cpu, cpu" in err, err


def test_worker_spec_carries_decode_weights(tiny_shipped, monkeypatch):
    """The pool validates decode_weights and puts it in every worker's spec (what worker_main hands to load);
    no process is started (spawn is replaced)."""
    import glmasr.workers.pool as pool_mod
    from glmasr.workers.requests import DataParallelEngineClient

    with pytest.raises(ValueError, match=r"unknown decode_weights 'fp8'"):
        DataParallelEngineClient(["cpu"], model=str(tiny_shipped), decode_weights="fp8")
    specs = {}

    def fake_spawn(ctx, make_spec, device, name):
        specs[device] = make_spec("cuda:0")
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(pool_mod, "spawn", fake_spawn)
    monkeypatch.setattr(pool_mod, "parse_devices", list)  # CUDA names accepted on a machine without a GPU
    for weights in ("int8", "bf16"):
        pool = DataParallelEngineClient(["cuda:0", "cuda:1"], model=str(tiny_shipped), decode_weights=weights)
        for w in pool._workers:
            with pytest.raises(RuntimeError, match="not started"):
                pool._spawn(w)
        assert {d: s.decode_weights for d, s in specs.items()} == {"cuda:0": weights, "cuda:1": weights}


def test_agreement_script_runs_on_cpu(tmp_path, tiny_shipped):
    """``python -m scripts.bench.int8_agreement --device cpu --steps 3 --rows 1`` on the tiny checkpoint (two
    handles, a prefill and 3 decode steps per case, ~15 s under the interpreter): the report's fields, and numbers
    that are numbers (the GPU run measures)."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "scripts.bench.int8_agreement", "--device", "cpu", "--steps", "3",
                        "--rows", "1", "--model", str(tiny_shipped), "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["steps"] == 3 and r["decode_weight_bytes"]["int8"] < r["decode_weight_bytes"]["bf16"]
    assert r["random"]["decisions"] == 3 and r["teacher_forced"]["decisions"] == 3
    assert r["random"]["prefill_logits_identical"] is True
    for case in ("random", "teacher_forced"):
        s = r[case]
        assert 0 < s["mean_abs_err_over_std"] <= s["max_abs_err_over_std"] < 5
        assert 0 <= s["top1_agreement"] <= 1
    assert "top-1 agree" in p.stdout and "teacher_forced" in p.stdout
