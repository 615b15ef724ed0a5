"""CUDA (NVRTC) decode GEMVs (kernels/cuda_gemv.py, cuda_gemv.cu) vs the plain-torch references.

CPU (no GPU needed; NVRTC compiles for sm_90 anywhere): the decoder's table configs compile, and their cubins
(``cuobjdump`` from Triton's wheel) use no local memory (STACK 0), registers within the budget of the occupancy
the config assumes (``GemvConfig.reg_budget``), and issue every weight load of the first chunk before the PDL
wait (SASS: the LDGs precede ACQBULK); the disk cache; ``select``; argument errors; the .cu is wheel data.

GPU (skipped without a CUDA device of compute capability >= 9.0): the decoder's shapes at M = 1 and 2 and odd
shapes (ragged K chunks, N not a multiple of the block's columns, N = 1, K = 8), every benchmark candidate of two
shapes, SwiGLU, pdl on and off, and a PDL chain (Triton RMSNorm -> CUDA GEMV -> CUDA GEMV SwiGLU -> Triton skinny
GEMM) captured in a CUDA graph and replayed with new inputs.

int8 weights (``scale=``): the same, on W quantized with ``skinny_gemm.quantize_rows`` from fresh random bf16
weights (CPU: the int8 table's cubins, with the row scales also requested before the wait; GPU: decoder shapes,
odd shapes down to K = 16, every candidate of three shapes, SwiGLU, a PDL chain with int8 GEMVs and the Triton
int8 skinny GEMM). Tolerance: the kernel's products q * x are exact in fp32 (7 + 8 significant bits), so its sum
differs from the exact one only by fp32 summation order, as for bf16; the row scale adds one fp32 rounding
(2**-24 relative). The contract is ``y = scale * (x @ q^T)``: checked against that product in fp64 with the bf16
bounds below, and against ``skinny_gemm``'s int8 references (which dequantize ``q * scale`` in fp32 first:
another 2**-24 relative per weight) within 1 bf16 ulp.

Inputs: fresh torch.randn draws (x ~ N(0, 1), W ~ N(0, 1/K): outputs ~N(0, 1)), never zeros; outputs are
NaN-poisoned first, so an element left unwritten fails.

Tolerance. The kernel sums the bf16 products in fp32 in its own order (lanes, then a shuffle tree): its sum is
off the exact one by a random walk of fp32 roundings, ~2**-24 * sqrt(K) * (partial sums ~10) ~ 5e-5 at K = 6144
for these inputs, then rounds once to bf16 (half an ulp, <= 2**-8 relative). So against the exact (fp64) product:
|out - ref64| <= 2**-8 |ref64| + 5e-4 (a bf16 half-ulp plus 10x the summation slack), and against that product
rounded to bf16 at most 1 ulp apart (a sum near a rounding midpoint may land on either side): |out - ref| <=
2**-7 |ref| + 5e-4, with >= 95 % of the elements bit-identical. SwiGLU rounds four times (gate, up, silu,
product; the silu uses the fast exp like Triton's):
against the rounded reference |out - ref| <= 3 * 2**-7 |ref| + 1e-3 (each flipped rounding upstream moves the
result by ~1 ulp of its own), norm ratio < 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from glmasr_kernels import cuda_gemv as cg
from glmasr_kernels.cuda_gemv import GemvConfig

REPO = Path(__file__).resolve().parents[1]
BF = torch.bfloat16


def _nvrtc() -> bool:
    try:
        import cuda.bindings.nvrtc  # noqa: F401
        return True
    except Exception:
        return False


def _cuobjdump() -> str | None:
    try:
        import triton
    except Exception:
        return None
    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return p if os.path.exists(p) else None


needs_nvrtc = pytest.mark.skipif(not _nvrtc(), reason="cuda-bindings with NVRTC not installed")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and cg.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device of compute capability >= 9.0 and cuda-bindings")

DECODER = {  # name -> (W rows, K, swiglu)
    "qkv": (3072, 2048, False), "o_proj": (2048, 2048, False), "gate_up_swiglu": (12288, 2048, True),
    "down": (2048, 6144, False), "lm_head": (59264, 2048, False),
}


# ------------------------------------------------------------------------------------------------ CPU

@functools.cache
def _compiled(cfg: GemvConfig) -> tuple[int, int, int]:
    """(registers, stack bytes, weight LDGs before the PDL wait) of cfg's sm_90 cubin: one compile per config."""
    cubin, _ = cg.nvrtc_compile(cfg, 90)
    tool = _cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    wait = next(i for i, ln in enumerate(lines) if "ACQBULK" in ln)
    return regs, stack, sum(1 for ln in lines[:wait] if re.search(r"\bLDG", ln))


# the decoder's M = 1 table configs (and one M = 2): each a distinct kernel shape (split K, SwiGLU, 2 rows);
# int8: its table's M = 1 configs, one M = 2 and the I2F conversion
CPU_CONFIGS = list(dict.fromkeys([cg.CONFIGS[(n, k, 1, sw)] for n, k, sw in DECODER.values()]
                                 + [cg.CONFIGS[(3072, 2048, 2, False)]]))
CPU_CONFIGS_INT8 = list(dict.fromkeys([cg.CONFIGS_INT8[(n, k, 1, sw)] for n, k, sw in DECODER.values()
                                       if (n, k, 1, sw) in cg.CONFIGS_INT8]
                                      + [cg.CONFIGS_INT8[(12288, 2048, 2, True)],
                                         GemvConfig(rows=2, warps=4, vec=4, int8=True, i2f=True)]))


# the qkv GEMV's RoPE + KV append form, bf16 (shipped) and int8
CPU_CONFIGS_FUSED = ([c for c in cg.default_configs() if c.rope]
                     + [cg.rope_config(cg.CONFIGS_INT8[(3072, 2048, 1, False)])])


@needs_nvrtc
@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump (shipped in Triton's wheel) not found")
@pytest.mark.parametrize("cfg", CPU_CONFIGS + CPU_CONFIGS_INT8 + CPU_CONFIGS_FUSED,
                         ids=lambda c: c.short().replace(" ", "_"))
def test_config_compiles_sm90_without_spills(cfg):
    regs, stack, ldg_before_wait = _compiled(cfg)
    assert stack == 0, f"{cfg.short()}: {stack} bytes of local memory (spills)"
    assert regs <= cfg.reg_budget(), f"{cfg.short()}: {regs} registers > {cfg.reg_budget()} at {cfg.occupancy()} blocks"
    # the whole first chunk of weights is requested before griddepcontrol.wait (ptxas sinks .nc loads below it);
    # int8: so are the row scales the lane stores with (gate and up for SwiGLU)
    scales = (2 if cfg.swiglu or cfg.rope else 1) if cfg.int8 else 0  # rope: the rotation partner's scale too
    # rope: the settled form's position and cache row (an int32 and an int64 load each) and the lane's cos / sin
    settled = 6 if cfg.rope else 0
    assert ldg_before_wait == cfg.weight_rows * cfg.vec + scales + settled, (cfg.short(), ldg_before_wait)


@needs_nvrtc
def test_disk_cache_and_prebuild(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMASR_CACHE_DIR", str(tmp_path))
    cfg = GemvConfig(rows=1, warps=2, vec=1)  # small and not in the table: a cold compile
    (path,) = cg.prebuild([cfg], sm=90)
    assert path.parent == tmp_path / "cubins" and path.read_bytes()[:4] == b"\x7fELF"
    monkeypatch.setattr(cg, "nvrtc_compile", lambda *a, **k: pytest.fail("cache hit expected"))
    assert cg.get_cubin(cfg, 90) == path.read_bytes()
    # the key covers the macros and the target
    assert cg.cache_key(cfg, 90) != cg.cache_key(GemvConfig(rows=1, warps=2, vec=2), 90)
    assert cg.cache_key(cfg, 90) != cg.cache_key(cfg, 100)


def test_select_and_configs():
    for m in (1, 2):
        for n, k, sw in DECODER.values():
            cfg = cg.select(n, k, sw, m)
            assert cfg == cg.CONFIGS[(n, k, m, sw)] and cfg.m == m and cfg.swiglu == sw
            # one chunk covers K: the program's whole weight slice is in flight before the wait
            assert cfg.chunk_k >= k
            cands = cg.sweep_configs(n, k, sw, m)
            assert cands[0] == cfg and len(cands) == len(set(cands)) and all(c.m == m and c.swiglu == sw for c in cands)
    h = cg.select(1000, 4104)  # heuristic: K past one warp's 8 vectors per lane -> split over warps
    assert h is not None and h.ksplit > 1 and h.chunk_k >= 4104
    assert cg.select(37, 200).vec == 1
    for bad in [(64, 100, False, 1), (64, 0, False, 1), (64, 64, False, 3), (64, 64, False, 0), (63, 64, True, 1)]:
        assert cg.select(*bad) is None, bad
    with pytest.raises(ValueError, match="ksplit"):
        GemvConfig(warps=4, ksplit=3)
    with pytest.raises(ValueError, match="m <="):
        GemvConfig(m=3)
    with pytest.raises(ValueError, match="i2f only with int8"):
        GemvConfig(i2f=True)


def test_select_and_configs_int8():
    for m in (1, 2):
        for name, (n, k, sw) in DECODER.items():
            cfg = cg.select(n, k, sw, m, int8=True)
            assert cfg.int8 and cfg.m == m and cfg.swiglu == sw and cfg.chunk_k >= k
            if name == "lm_head":  # stays bf16: no table entry, the heuristic still runs it
                assert (n, k, m, sw) not in cg.CONFIGS_INT8
                continue
            assert cfg == cg.CONFIGS_INT8[(n, k, m, sw)]
            cands = cg.sweep_configs(n, k, sw, m, int8=True)
            assert cands[0] == cfg and cands[1] == dataclasses.replace(cfg, i2f=True)
            assert len(cands) == len(set(cands)) and all(c.int8 and c.m == m and c.swiglu == sw for c in cands)
    assert (12288, 2048, 1, False) in cg.CONFIGS_INT8  # gate_up unfused
    for n, k in [(37, 208), (1000, 4112), (333, 6160), (1, 16)]:
        h = cg.select(n, k, int8=True)
        assert h.int8 and h.vec_k == 16 and h.chunk_k >= k and h.vec <= 8, (n, k, h)
    assert cg.select(64, 24, int8=True) is None and cg.select(64, 24) is not None  # int8: K % 16
    assert cg.select(64, 8, int8=True) is None


def test_prebuild_default_covers_int8_and_the_fused_forms(monkeypatch):
    built = []
    monkeypatch.setattr(cg, "get_cubin", lambda cfg, sm=90: built.append(cfg))
    monkeypatch.setattr(cg, "cubin_path", lambda cfg, sm=90: cfg)
    cg.prebuild(sm=90, workers=1)
    fused = {cg.rope_config(cg.CONFIGS[(n, k, 1, False)]) for n, k in cg.QKV_ROPE_SHAPES}
    assert len(fused) == 1 and all(c.rope and c.rows % 2 == 0 for c in fused)
    assert sorted(map(repr, built)) == sorted(map(repr, set(cg.CONFIGS.values()) | set(cg.CONFIGS_INT8.values())
                                                  | fused))


def test_rope_form_needs_whole_rotation_pairs():
    for bad in (dict(rows=1), dict(rows=2, m=2), dict(rows=2, swiglu=True)):
        with pytest.raises(ValueError, match="rope needs"):
            GemvConfig(rope=True, **bad)
    assert cg.rope_config(GemvConfig(rows=1)).rows == 2 and cg.rope_config(GemvConfig(rows=4)).rows == 4
    assert cg.rope_config(GemvConfig(rows=2)).macros()["GV_ROPE"] == "1"


def test_argument_errors():
    w = torch.randn(64, 64).to(BF)
    x = torch.randn(1, 64).to(BF)
    cases = [
        (lambda: cg.gemv(x.float(), w), "x must be bfloat16"),
        (lambda: cg.gemv(x, w.half()), "W must be bfloat16"),
        (lambda: cg.gemv(x, w[:, :32]), "W must be contiguous"),
        (lambda: cg.gemv(x, w.t()), "W must be contiguous"),
        (lambda: cg.gemv(torch.randn(1, 60).to(BF), torch.randn(8, 60).to(BF)), "K = 60"),
        (lambda: cg.gemv(torch.randn(3, 64).to(BF), w), "M = 3"),
        (lambda: cg.gemv(x, torch.randn(64, 32).to(BF)), "last dim must be W's K = 32"),
        (lambda: cg.gemv(x, w.reshape(-1)), "2-D"),
        (lambda: cg.gemv_swiglu(x, torch.randn(63, 64).to(BF)), "even for SwiGLU"),
        (lambda: cg.gemv(x, w), "must be a CUDA tensor"),  # everything else valid: the device is the problem
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_argument_errors_int8():
    from glmasr_kernels.skinny_gemm import quantize_rows

    q, sc = quantize_rows(torch.randn(64, 64) / 8)
    x = torch.randn(1, 64).to(BF)
    q24, sc24 = quantize_rows(torch.randn(8, 24))
    cases = [
        (lambda: cg.gemv(x, q), "W is int8: pass its per-row fp32 dequantization scales as scale="),
        (lambda: cg.gemv(x, q.float().to(BF), scale=sc), "scale= is for an int8 W"),
        (lambda: cg.gemv(x, q, scale=sc.double()), "scale must be an fp32 tensor"),
        (lambda: cg.gemv(x, q, scale=sc.to(BF)), "scale must be an fp32 tensor"),
        (lambda: cg.gemv(x, q, scale=[1.0] * 64), "scale must be an fp32 tensor"),
        (lambda: cg.gemv(x, q, scale=sc[:63]), r"scale must have shape \(64,\)"),
        (lambda: cg.gemv(x, q, scale=sc[None]), r"scale must have shape \(64,\)"),
        (lambda: cg.gemv(x, q, scale=torch.randn(128)[::2]), "scale must be contiguous"),
        (lambda: cg.gemv(torch.randn(1, 24).to(BF), q24, scale=sc24), "K = 24 .*multiple of 16 for an int8 W"),
        (lambda: cg.gemv(x.float(), q, scale=sc), "x must be bfloat16"),
        (lambda: cg.gemv(x, q.to(torch.uint8), scale=sc), "W must be bfloat16 \\(or int8"),
        (lambda: cg.gemv(x, q[:, :32], scale=sc), "W must be contiguous"),
        (lambda: cg.gemv_swiglu(x, q[:63].contiguous(), scale=sc[:63]), "even for SwiGLU"),
        (lambda: cg.gemv(x, q, scale=sc), "must be a CUDA tensor"),  # everything else valid
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def _rope_args(nq=2, nk=1, d=8, rows=2, max_len=16, positions=None, **over):
    kw = dict(positions=torch.tensor([3]) if positions is None else positions, cos=torch.randn(max_len, d // 2),
              sin=torch.randn(max_len, d // 2), k_cache=torch.randn(rows, nk, max_len, d).to(BF),
              v_cache=torch.randn(rows, nk, max_len, d).to(BF), n_heads=nq, n_kv_heads=nk, head_dim=d)
    kw.update(over)
    return cg.RopeAppend(**kw)


def test_argument_errors_rope():
    """rope= is checked before the device (so on the CPU too), naming its problem."""
    x = torch.randn(1, 64).to(BF)
    w = torch.randn(64, 64).to(BF)
    wqkv = torch.randn(32, 64).to(BF)  # 2 + 1 + 1 heads of 8
    cases = [
        (lambda: cg.gemv_qkv_rope(x, w, _rope_args()), "W has 64 rows; q, k and v of 2 \\+ 1 \\+ 1 heads"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(positions=torch.tensor([3, 4]))), "one token"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(positions=torch.tensor([3.0]))), "positions must be a"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(cache_rows=torch.tensor([0.0]))), "cache_rows must be a"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(cos=torch.randn(16, 8))), r"cos must be a contiguous"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(k_cache=torch.randn(2, 1, 16, 8).to(BF).transpose(2, 3)
                                                      .contiguous().transpose(2, 3))), "k_cache must be a contiguous"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(v_cache=torch.randn(2, 1, 16, 8))), "v_cache must be a"),
        (lambda: cg.gemv_qkv_rope(torch.randn(2, 64).to(BF), wqkv, _rope_args()), "one token: x must have one row"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(), out=torch.empty(1, 32).to(BF)), r"out must be a \(1, 16\)"),
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(), config=GemvConfig(rows=2)), "rope=False; the call has"),
        (lambda: cg.gemv(x, wqkv, config=cg.rope_config(GemvConfig())), "rope=True; the call has"),
        # everything else valid: the device is the problem
        (lambda: cg.gemv_qkv_rope(x, wqkv, _rope_args(cache_rows=torch.tensor([1]))), "must be a CUDA tensor"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_cu_is_wheel_data():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.cu" in data.get("glmasr_kernels", []), "kernels/cuda_gemv.cu must ship in the wheel"
    assert (REPO / "kernels" / "cuda_gemv.cu").exists()


# ------------------------------------------------------------------------------------------------ GPU

def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(BF)


def _check_gemv(x, w, out):
    ref64 = x.double() @ w.double().t()  # exact enough, and never TF32 whatever the process's matmul flags
    ref = ref64.to(BF).double()
    o = out.double()
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    assert ((o - ref64).abs() <= 2 ** -8 * ref64.abs() + 5e-4).all(), (o - ref64).abs().max().item()
    assert ((o - ref).abs() <= 2 ** -7 * ref.abs() + 5e-4).all()
    assert (o == ref).float().mean().item() >= 0.95


def _check_swiglu(x, w, out):
    ref = cg.gemv_swiglu_ref(x, w).float()
    o = out.float()
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    assert ((o - ref).abs() <= 3 * 2 ** -7 * ref.abs() + 1e-3).all(), (o - ref).abs().max().item()
    assert ((o - ref).norm() / ref.norm()).item() < 1e-2


def _quant(n, k):
    """int8 W (N, K) and its fp32 row scales, quantized from fresh random bf16 weights (~N(0, 1/K))."""
    from glmasr_kernels.skinny_gemm import quantize_rows

    return quantize_rows(_rand(n, k, scale=k ** -0.5))


def _check_gemv_int8(x, q, sc, out):
    """The contract y = scale * (x @ q^T): the bf16 bounds against it in fp64, and within 1 ulp of the int8
    reference (fp32 dequantization first)."""
    ref64 = (x.double() @ q.double().t()) * sc.double()
    ref = ref64.to(BF).double()
    o = out.double()
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    assert ((o - ref64).abs() <= 2 ** -8 * ref64.abs() + 5e-4).all(), (o - ref64).abs().max().item()
    assert ((o - ref).abs() <= 2 ** -7 * ref.abs() + 5e-4).all()
    assert (o == ref).float().mean().item() >= 0.95
    ref32 = cg.gemv_ref(x, q, scale=sc).double()
    assert ((o - ref32).abs() <= 2 ** -7 * ref32.abs() + 5e-4).all()


def _check_swiglu_int8(x, q, sc, out):
    ref = cg.gemv_swiglu_ref(x, q, scale=sc).float()
    o = out.float()
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    assert ((o - ref).abs() <= 3 * 2 ** -7 * ref.abs() + 1e-3).all(), (o - ref).abs().max().item()
    assert ((o - ref).norm() / ref.norm()).item() < 1e-2


def _quant_or_bf16(n, k, int8):
    """W (N, K) and its row scales: fresh random bf16 weights (~N(0, 1/K)), quantized to int8 when ``int8``."""
    if int8:
        return _quant(n, k)
    return _rand(n, k, scale=k ** -0.5), None


def _run_case(n, k, swiglu, m, cfg=None, pdl=None, lead=(), int8=False):
    x = _rand(*lead, m, k)
    w, sc = _quant_or_bf16(n, k, int8)
    out = torch.full((*lead, m, n // 2 if swiglu else n), float("nan"), device="cuda", dtype=BF)
    fn = cg.gemv_swiglu if swiglu else cg.gemv
    res = fn(x, w, out=out, config=cfg, pdl=pdl, scale=sc)
    torch.cuda.synchronize()
    assert res is out
    x2, o2 = x.reshape(m, k), out.reshape(m, -1)
    if int8:
        (_check_swiglu_int8 if swiglu else _check_gemv_int8)(x2, w, sc, o2)
    else:
        (_check_swiglu if swiglu else _check_gemv)(x2, w, o2)


@gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name", list(DECODER))
def test_decoder_shapes(name, m):
    n, k, sw = DECODER[name]
    _run_case(n, k, sw, m)


@gpu
@pytest.mark.parametrize("n,k,swiglu,m", [
    (37, 200, False, 1), (1, 8, False, 1), (1000, 4104, False, 2), (333, 6152, False, 1), (2050, 2056, False, 1),
    (74, 200, True, 2), (6, 16384, True, 1), (130, 2048, False, 2),
])
def test_odd_shapes(n, k, swiglu, m):
    _run_case(n, k, swiglu, m)


@gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("name,m", [("qkv", 1), ("down", 1), ("gate_up_swiglu", 1), ("qkv", 2)])
def test_every_candidate(name, m, int8):
    n, k, sw = DECODER[name]
    cands = cg.sweep_configs(n, k, sw, m, int8=int8)
    cg.prebuild(cands, sm=cg._device_sm(torch.cuda.current_device()))
    for cfg in cands:
        _run_case(n, k, sw, m, cfg=cfg, int8=int8)


@gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_pdl_flag_and_leading_dims(pdl, int8):
    _run_case(3072, 2048, False, 1, pdl=pdl, lead=(1,), int8=int8)
    _run_case(12288, 2048, True, 2, pdl=pdl, int8=int8)


@gpu
def test_unaligned_x_is_copied():
    k, n = 2048, 512
    buf = _rand(k + 1)
    x = buf[1:].view(1, k)  # 2-byte offset: not 16-byte aligned
    w = _rand(n, k, scale=k ** -0.5)
    _check_gemv(x, w, cg.gemv(x, w))


@gpu
def test_wrong_config_and_out():
    x, w = _rand(1, 64), _rand(64, 64)
    with pytest.raises(ValueError, match="config"):
        cg.gemv(x, w, config=GemvConfig(m=2))
    with pytest.raises(ValueError, match="out must be"):
        cg.gemv(x, w, out=torch.empty(1, 63, device="cuda", dtype=BF))


@gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name", [nm for nm in DECODER if nm != "lm_head"] + ["gate_up"])
def test_decoder_shapes_int8(name, m):
    n, k, sw = DECODER[name] if name != "gate_up" else (12288, 2048, False)
    _run_case(n, k, sw, m, int8=True)


@gpu
@pytest.mark.parametrize("n,k,swiglu,m", [
    (37, 208, False, 1), (1, 16, False, 1), (1000, 4112, False, 2), (333, 6160, False, 1), (2050, 2064, False, 1),
    (74, 208, True, 2), (6, 16384, True, 1), (130, 2048, False, 2), (59264 // 8, 2048, False, 1),
])
def test_odd_shapes_int8(n, k, swiglu, m):
    _run_case(n, k, swiglu, m, int8=True)


@gpu
def test_wrong_config_int8():
    x = _rand(1, 64)
    q, sc = _quant(64, 64)
    with pytest.raises(ValueError, match="int8=False"):
        cg.gemv(x, q, scale=sc, config=GemvConfig())
    with pytest.raises(ValueError, match="int8=True"):
        cg.gemv(x, _rand(64, 64), config=GemvConfig(int8=True, vec=1))
    with pytest.raises(ValueError, match="scale is on"):
        cg.gemv(x, q, scale=sc.cpu())


@gpu
def test_pdl_chain_in_cuda_graph_int8():
    """Triton RMSNorm (PDL) -> int8 gemv -> int8 gemv_swiglu -> Triton int8 skinny_gemm (PDL), captured once and
    replayed with new inputs, checked stage by stage on the captured intermediates."""
    from glmasr_kernels.rmsnorm import rms_norm, rms_norm_ref
    from glmasr_kernels.skinny_gemm import skinny_gemm, skinny_gemm_ref

    from glmasr.engine.cuda_graphs import capture

    hid, inter = 2048, 6144
    src = _rand(1, hid)
    gain = _rand(hid, scale=0.1) + 1
    q_q, s_q = _quant(hid, hid)
    q_gu, s_gu = _quant(2 * inter, hid)
    q_d, s_d = _quant(hid, inter)
    y1 = torch.empty(1, hid, device="cuda", dtype=BF)
    y2 = torch.empty(1, inter, device="cuda", dtype=BF)
    y3 = torch.empty(1, hid, device="cuda", dtype=BF)
    holder = {}

    def step():
        h = rms_norm(src, gain, 1e-5)
        holder["h"] = h
        cg.gemv(h, q_q, out=y1, pdl=True, scale=s_q)
        cg.gemv_swiglu(y1, q_gu, out=y2, pdl=True, scale=s_gu)
        skinny_gemm(y2, q_d, out=y3, scale=s_d)
        return h

    graph, h = capture(step, torch.device("cuda"))
    for _ in range(3):
        src.copy_(_rand(1, hid))
        for t in (y1, y2, y3):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        hr = rms_norm_ref(src, gain, 1e-5).float()
        assert ((h.float() - hr).norm() / hr.norm()).item() < 1e-2
        _check_gemv_int8(h, q_q, s_q, y1)
        _check_swiglu_int8(y1, q_gu, s_gu, y2)
        ref3 = skinny_gemm_ref(y2, q_d, scale=s_d).float()
        assert torch.isfinite(y3.float()).all()
        assert ((y3.float() - ref3).abs() <= 2 ** -7 * ref3.abs() + 1e-4).all()


@gpu
def test_pdl_chain_in_cuda_graph():
    """Triton RMSNorm (PDL) -> gemv -> gemv_swiglu -> Triton skinny_gemm (PDL), captured once, replayed with new
    inputs: every stage must see its producer's writes of this replay (checked stage by stage against the
    references on the captured intermediates)."""
    from glmasr_kernels.rmsnorm import rms_norm, rms_norm_ref
    from glmasr_kernels.skinny_gemm import skinny_gemm, skinny_gemm_ref

    from glmasr.engine.cuda_graphs import capture

    hid, inter = 2048, 6144
    src = _rand(1, hid)
    gain = _rand(hid, scale=0.1) + 1
    w_q = _rand(hid, hid, scale=hid ** -0.5)
    w_gu = _rand(2 * inter, hid, scale=hid ** -0.5)
    w_d = _rand(hid, inter, scale=inter ** -0.5)
    y1 = torch.empty(1, hid, device="cuda", dtype=BF)
    y2 = torch.empty(1, inter, device="cuda", dtype=BF)
    y3 = torch.empty(1, hid, device="cuda", dtype=BF)
    holder = {}

    def step():
        h = rms_norm(src, gain, 1e-5)
        holder["h"] = h
        cg.gemv(h, w_q, out=y1, pdl=True)
        cg.gemv_swiglu(y1, w_gu, out=y2, pdl=True)
        skinny_gemm(y2, w_d, out=y3)
        return h

    graph, h = capture(step, torch.device("cuda"))
    for _ in range(3):
        src.copy_(_rand(1, hid))
        for t in (y1, y2, y3):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        hr = rms_norm_ref(src, gain, 1e-5).float()  # the producer ran on this replay's src
        assert ((h.float() - hr).norm() / hr.norm()).item() < 1e-2
        _check_gemv(h, w_q, y1)
        _check_swiglu(y1, w_gu, y2)
        ref3 = skinny_gemm_ref(y2, w_d).float()
        assert torch.isfinite(y3.float()).all()
        assert ((y3.float() - ref3).abs() <= 2 ** -7 * ref3.abs() + 1e-4).all()


# ------------------------------------------------------------------------------------------------ GPU: RoPE form
# gemv_qkv_rope against gemv_ref + rope_and_append_ref. RoPE rounds the projection, each product and the sum like
# rope_and_append: where the projection's sum lands one ulp away from the fp64-exact reference's rounding (the
# GEMV tolerance above), the rotated value moves by about one ulp: the SwiGLU bounds (3 ulps + 1e-3), >= 90 % of
# the elements bit-identical. (Against the unfused CUDA path, gemv + rope_and_append, it is bit-identical:
# tests/test_fused_decode_step.py.)


def _rope_case(int8, pos_value, pos_dtype, row, settled=False):
    """The decoder's qkv shape (16 q + 4 k + 4 v heads of 128): fused vs the reference on cloned random caches;
    ``settled``: position, row and cos / sin read before the PDL wait (``RopeAppend.settled``)."""
    from glmasr_kernels.rope import build_rope_cache

    nq, nk, d, rows, max_len = 16, 4, 128, 3, 8192
    n, k = (nq + 2 * nk) * d, 2048
    x = _rand(1, k)
    w, sc = _quant_or_bf16(n, k, int8)
    cos, sin = build_rope_cache(d, max_len, 10000.0, device="cuda")
    kc, vc = _rand(rows, nk, max_len, d), _rand(rows, nk, max_len, d)  # random, never zeros: untouched slots stay
    pos = torch.tensor([pos_value], device="cuda", dtype=pos_dtype)
    crow = None if row is None else torch.tensor([row], device="cuda", dtype=torch.int32)
    got_k, got_v = kc.clone(), vc.clone()
    rope = cg.RopeAppend(pos, cos, sin, got_k, got_v, nq, nk, d, crow, settled=settled)
    q = torch.full((1, nq * d), float("nan"), device="cuda", dtype=BF)
    assert cg.gemv_qkv_rope(x, w, rope, out=q, scale=sc) is q
    torch.cuda.synchronize()
    want_k, want_v = kc.clone(), vc.clone()
    want_q = cg.gemv_qkv_rope_ref(x, w, dataclasses.replace(rope, k_cache=want_k, v_cache=want_v), scale=sc)
    return q, want_q, (got_k, got_v), (want_k, want_v), (kc, vc), pos_value, (0 if row is None else row)


def _close_rotated(o, ref):
    o, ref = o.double(), ref.double()
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    assert ((o - ref).abs() <= 3 * 2 ** -7 * ref.abs() + 1e-3).all(), (o - ref).abs().max().item()
    assert (o == ref).float().mean().item() >= 0.90


@gpu
@pytest.mark.parametrize("settled", [False, True])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("pos_value,pos_dtype,row", [(0, torch.int64, None), (777, torch.int32, 2),
                                                      (8191, torch.int64, 1)])
def test_qkv_rope_append(int8, pos_value, pos_dtype, row, settled):
    q, want_q, got, want, before, p, r = _rope_case(int8, pos_value, pos_dtype, row, settled)
    _close_rotated(q, want_q)
    for g, wnt, b in zip(got, want, before):
        # only slot p of row r changed, and it holds the rotated k / the v of this token
        mask = torch.ones(b.shape[0], b.shape[2], dtype=torch.bool, device="cuda")
        mask[r, p] = False
        assert torch.equal(g.permute(0, 2, 1, 3)[mask], b.permute(0, 2, 1, 3)[mask]), "another slot was written"
        _close_rotated(g[r, :, p], wnt[r, :, p])
        assert not torch.equal(g[r, :, p], b[r, :, p])


@gpu
@pytest.mark.parametrize("settled", [False, True])
def test_qkv_rope_negative_position_is_padding(settled):
    q, want_q, got, want, before, _, _ = _rope_case(False, -1, torch.int64, None, settled)
    _close_rotated(q, want_q)  # unrotated q (rope_and_append leaves padding tokens alone)
    for g, b in zip(got, before):
        assert torch.equal(g, b), "a padding token wrote the cache"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
