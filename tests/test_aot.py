"""Ahead-of-time kernel builds (kernels/aot.py, ``glmasr compile``), on the CPU.

The key check: a child process (TRITON_INTERPRET unset, Triton's active driver replaced by a fake CUDA sm_90 device)
sends real launches of the RMSNorm kernel through ``JITFunction.run(..., warmup=True)`` (the JIT's own
specialization and compile, no launch) inside ``record()``; the manifest is built with ``build()`` into an empty
cache folder; a fresh child repeats the launches against that folder and Triton's compilation listener must report a
cache hit for every one (no compile). The recording child itself compiles into another, empty folder, so it
reports misses: the check can fail. Inputs are fresh random tensors; one launch has 16-divisible sizes and strides,
the other odd ones (different divisibility attributes).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from conftest import require_kernels  # noqa: E402 - sets TRITON_INTERPRET without a GPU

require_kernels()

from glmasr_kernels import aot  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# The JIT side, in a child that sees compiled (not interpreted) kernels. argv: mode ("record" PATH | "check").
_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class FakeCuda:  # what JITFunction.run asks the driver for
        def get_current_device(self):
            return 0
        def get_current_stream(self, device=None):
            return 0
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(FakeCuda())
    from glmasr_kernels import aot
    from glmasr_kernels.rmsnorm import _rmsnorm_kernel

    hits = []
    knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    g = torch.Generator().manual_seed(int(sys.argv[2]))

    def launch(m, n, has_res):
        x = torch.randn(m, n, generator=g).to(torch.bfloat16)
        w = torch.randn(n, generator=g).to(torch.bfloat16)
        y = torch.empty_like(x)
        _rmsnorm_kernel.run(x, x, w, y, y, m, n, n, n, n, n, 1e-5, HAS_RES=has_res, BLOCK_M=8, BLOCK_N=64,
                            PDL=True, num_warps=2, launch_pdl=True, grid=(1,), warmup=True)

    with aot.record() as rec:
        launch(8, 64, False)
        launch(5, 37, True)
        launch(8, 64, False)  # the same specialization again: one entry
    if sys.argv[1] == "record":
        aot.write_manifest(rec, sys.argv[3])
    print(json.dumps({"hits": hits, "entries": len(rec.entries), "skipped": rec.skipped,
                      "target": rec.target}))
""")


def _child(mode: str, cache: Path, *extra: str, seed: int = 0) -> dict:
    env = aot.worker_env(cache)
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, str(seed), *extra], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_built_cache_is_what_the_jit_looks_up(tmp_path):
    manifest = tmp_path / "sm90.json"
    rec = _child("record", tmp_path / "record-cache", str(manifest), seed=1)
    # the recording compiled into an empty cache: misses (the check below can fail)
    assert rec["hits"] == [False, False] and rec["entries"] == 2 and rec["skipped"] == []
    assert rec["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    m = aot.read_manifest(manifest)
    assert len(m["entries"]) == 2 and m["target"]["arch"] == 90
    assert {e["constexprs"]["HAS_RES"] for e in m["entries"]} == {False, True}
    assert all(e["options"] == {"num_warps": 2, "launch_pdl": True} for e in m["entries"])

    built = tmp_path / "built-cache"
    report = aot.build(manifest, arch=90, cache_dir=built, workers=2, nvrtc=False)
    assert report.ok and len(report.built) == 2 and not report.cached and not report.stale, report
    assert report.triton_cache_dir == str(built.resolve())
    # a fresh process, new random inputs of the same shapes: every launch finds its kernel in the built cache
    check = _child("check", built, seed=2)
    assert check["hits"] == [True, True], check

    again = aot.build(manifest, arch=90, cache_dir=built, workers=1, nvrtc=False)
    assert again.ok and len(again.cached) == 2 and not again.built


def _entry(**changes) -> dict:
    names = ["X", "R", "W", "Y", "RO", "M", "N", "sx", "sr", "sy", "sro", "eps", "HAS_RES", "BLOCK_M", "BLOCK_N",
             "PDL"]
    types = ["*bf16"] * 5 + ["i32"] * 6 + ["fp32"] + ["constexpr"] * 4
    e = {"module": "glmasr_kernels.rmsnorm", "qualname": "_rmsnorm_kernel", "signature": dict(zip(names, types)),
         "constexprs": {"HAS_RES": False, "BLOCK_M": 4, "BLOCK_N": 32, "PDL": False},
         "attrs": {"X": [["tt.divisibility", 16]]}, "options": {"num_warps": 1}}
    e.update(changes)
    return e


def test_stale_and_broken_entries_are_reported(tmp_path):
    sig = dict(_entry()["signature"])
    renamed = {("Xin" if k == "X" else k): v for k, v in sig.items()}
    entries = [
        _entry(qualname="_gone_kernel"),
        _entry(module="glmasr_kernels.no_such_module"),
        _entry(qualname="rms_norm"),  # a plain function, not a kernel
        _entry(signature=renamed, attrs={}),
        _entry(constexprs={"HAS_RES": False, "BLOCK_M": 4, "BLOCK_N": 32}),  # PDL's value missing
        _entry(options={"num_warps": 1, "no_such_option": 3}),
        _entry(constexprs={"HAS_RES": False, "BLOCK_M": 4, "BLOCK_N": 48, "PDL": False}),  # fails to compile
    ]
    report = aot.build(aot.manifest_dict(entries), cache_dir=tmp_path / "cache", workers=2, nvrtc=False)
    assert len(report.stale) == 6 and not report.built and not report.cached, report
    text = " ".join(why for _, why in report.stale)
    for needle in ("has no _gone_kernel", "no_such_module no longer exists", "not a Triton kernel",
                   "parameters are now", "no value for the constexpr PDL", "no_such_option"):
        assert needle in text, (needle, text)
    assert not report.ok and len(report.failed) == 1
    assert "power of 2" in report.failed[0][1], report.failed


def test_manifest_round_trip_merge_and_errors(tmp_path):
    import triton.language as tl

    path = tmp_path / "m.json"
    a, b = _entry(), _entry(constexprs={"HAS_RES": True, "BLOCK_M": 4, "BLOCK_N": 32, "PDL": False})
    c = _entry(module="glmasr_kernels.activations", qualname="_x")
    written = aot.write_manifest([b, a], path)
    assert aot.read_manifest(path) == written
    assert written["entries"] == [a, b]  # sorted: the file is stable whatever order the launches came in
    merged = aot.write_manifest([a, c], path)
    assert merged["entries"] == [c, a, b]
    text = path.read_text()
    assert len([ln for ln in text.splitlines() if ln.strip().startswith('{"module"')]) == 3  # one line each
    assert merged["triton"] and merged["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    with pytest.raises(aot.ManifestError, match="not .*'arch': 100"):
        aot.write_manifest([a], path, target={"backend": "cuda", "arch": 100, "warp_size": 32})

    for value in (tl.bfloat16, tl.constexpr(3), 2.5, None, "ieee"):
        enc = aot._encode_constexpr(value)
        assert json.loads(json.dumps(enc)) == enc
        dec = aot._decode_constexpr(enc)
        assert type(dec) is type(value) and str(dec) == str(value)

    bad = tmp_path / "bad.json"
    for content, needle in (("{not json", "not valid JSON"), ('{"format": 1}', "field 'format'"),
                            (json.dumps({**written, "entries": [{"module": "m"}]}), "entries[0].qualname"),
                            (json.dumps({**written, "target": {"arch": "90"}}), "field 'target'")):
        bad.write_text(content)
        with pytest.raises(aot.ManifestError, match=str(bad)) as err:
            aot.read_manifest(bad)
        assert needle in str(err.value)
    with pytest.raises(aot.ManifestError, match="no such manifest"):
        aot.read_manifest(tmp_path / "missing.json")
    with pytest.raises(aot.ManifestError, match="record one"):
        aot.build(path, arch=80, nvrtc=False)


def test_shipped_manifest_is_valid_and_packaged():
    m = aot.read_manifest(aot.default_manifest(90))
    assert m["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    assert len(m["entries"]) >= 40  # recorded on the H200 (scripts/record_kernels.py)
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    # resolved: the device machine links the checkout's kernels/ in as glmasr_kernels
    rel = aot.default_manifest(90).resolve().relative_to((REPO / "kernels").resolve()).as_posix()
    assert any(fnmatch.fnmatch(rel, p) for p in patterns.get("glmasr_kernels", [])), patterns


def test_record_chains_the_previous_hook():
    from triton import knobs

    calls = []

    def previous(**kw):
        calls.append(kw["key"])
        return "answer"

    class Info:  # a hook call for something that is not a module-level JITFunction
        module, name, jit_function = "m", "f.<locals>.k", object()

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = previous
    try:
        with aot.record() as rec:
            out = knobs.runtime.jit_cache_hook(key="k1", repr="r", fn=Info(), compile={"device": 0},
                                               is_manual_warmup=True, already_compiled=False)
            assert knobs.runtime.jit_cache_hook is not previous
        assert knobs.runtime.jit_cache_hook is previous
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert out == "answer" and calls == ["k1"]
    assert rec.entries == [] and len(rec.skipped) == 1 and rec.skipped[0][0] == "m.f.<locals>.k"


def test_logmel_config_for_an_sm_without_a_device(monkeypatch):
    import torch

    import glmasr_kernels.logmel as logmel
    from glmasr_kernels.logmel import _build, _runtime

    monkeypatch.setattr(_runtime, "_device_sm", lambda index: 900)  # a capability-9.0 device
    on_device = _runtime._cfg(_runtime.WHISPER_N_FFT, 128, 2.0, True, False, torch.float32, 0)
    assert logmel.whisper_config(128, sm=900) == on_device and on_device.sm == 900
    built = []
    monkeypatch.setattr(_build, "get_cubin", built.append)
    logmel.prebuild(128, sm=900)
    logmel.prebuild(128, "cuda:0")  # the device path: the SM read from the (patched) device
    assert built == [on_device, on_device]
    if logmel._deps_importable():
        (job,) = aot.logmel_jobs(90)
        assert job.path.endswith(f"logmel_{_build.cache_key(on_device)}.cubin")
        assert Path(job.path).parent == _build.cache_dir() and job.build.args == (on_device,)
    else:
        with pytest.raises(aot.ToolchainMissing, match="glmasr\\[cuda\\]"):
            aot.logmel_jobs(90)


def _cli(capsys, *args) -> tuple[int, str, str]:
    from glmasr.cli.main import main

    code = main(["compile", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_compile_command(tmp_path, capsys, monkeypatch):
    from glmasr.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["compile", "--help"])
    assert e.value.code == 0 and "--arch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["compile", "--workers", "0"])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "glmasr-kernel-manifest/1"}')
    code, _, err = _cli(capsys, "--manifest", str(bad), "--no-nvrtc")
    assert code == 2 and str(bad) in err and "field 'target'" in err
    code, _, err = _cli(capsys, "--manifest", str(tmp_path / "none.json"))
    assert code == 2 and "no such manifest" in err

    empty = tmp_path / "empty.json"
    aot.write_manifest([], empty)
    code, out, _ = _cli(capsys, "--manifest", str(empty), "--no-nvrtc", "--cache-dir", str(tmp_path / "c"))
    assert code == 0 and "0 built" in out and "no Triton entries" in out

    def no_nvrtc(arch):
        raise aot.ToolchainMissing("the log-mel frontend needs cuda-bindings: pip install 'glmasr[cuda]'")

    monkeypatch.setattr(aot, "NVRTC_FAMILIES", [no_nvrtc])
    code, _, err = _cli(capsys, "--manifest", str(empty))
    assert code == 2 and "glmasr[cuda]" in err
    monkeypatch.setattr(aot, "_triton_version", lambda: None)
    code, _, err = _cli(capsys, "--manifest", str(empty), "--no-nvrtc")
    assert code == 2 and "Triton is not installed" in err and "glmasr[cuda]" in err


def test_nvrtc_family_outcomes(tmp_path):
    """A family's jobs: built when its file is missing, cached when present, failed with the error otherwise."""
    made = tmp_path / "a.bin"
    present = tmp_path / "b.bin"
    present.write_bytes(os.urandom(8))

    def boom():
        raise RuntimeError("nvrtc said no")

    def family(arch):
        return [aot.NvrtcJob("a", str(made), lambda: made.write_bytes(os.urandom(8))),
                aot.NvrtcJob("b", str(present), boom),
                aot.NvrtcJob("c", str(tmp_path / "c.bin"), boom),
                aot.NvrtcJob("d", str(tmp_path / "d.bin"), lambda: None)]

    report = aot.build(aot.manifest_dict([]), families=[family], workers=2)
    assert report.nvrtc_built == ["a"] and report.nvrtc_cached == ["b"] and made.exists()
    failed = dict(report.nvrtc_failed)
    assert "nvrtc said no" in failed["c"] and "was not written" in failed["d"] and not report.ok
