"""Where the Whisper log-mel time goes: stage-ablation and tiling variants of kernels/logmel/logmel.cu.

Every variant is a compile-time switch of the kernel (macros in KernelConfig -> NVRTC options -> cubin
cache key), so one device call compiles and times all of them:
  stage ablations (timing only, their output is meaningless):
    LM_VARIANT 1  no FFT (windowed samples straight into the mel stage)
    LM_VARIANT 2  mel projection cut to one tap per filter (the FFT output is still consumed)
    LM_VARIANT 4  no output stores in the main launch (run-time-never-true conditional store)
    LM_VARIANT 7  all three: load/window + block skeleton (filter staging, syncs, tile min/max)
    main only     the default kernel without the finalize launch
  tiling variants (checked against glmasr.features before timing; max abs diff <= 2e-4):
    LM_DIRECT 1   mel results stored from registers (no shared output tile: ~29 KB instead of ~53 KB smem)
    LM_MINB n     __launch_bounds__(threads, n): caps registers so that n blocks fit per SM
    pairs/iters   FFTs per block x iterations per block (frames per block = 2 * pairs * iters)
  skeleton variants (LM_SKEL bits, kernels/logmel/logmel.cu; must be BIT-IDENTICAL to the default kernel,
  checked with torch.equal on fp32, bf16 and fp16 output, besides the glmasr.features tolerance checks):
    skel 1 stage  each iteration's input span staged into shared memory by cp.async, one iteration ahead
    skel 2 pspec  power spectrum formed once per bin (float2 per mel tap instead of Z[k], Z[N-k] + recombination)
    skel 4 tasks  packed filter descriptor (one shared load per mel task instead of three)
  --set skel (default): the default kernel, its load+skeleton ablation and the skeleton variants (fits the
  150 s breakdown step of scripts/device.sh logmel); --set all: also the older ablation / tiling table.
  To ship a winner: kernels/logmel/_config.py WHISPER_SKEL = <bits> (and WHISPER_MINB if a minb column won).
Also reports registers, local (spill) memory, static/dynamic shared memory and blocks per SM from
cuOccupancyMaxActiveBlocksPerMultiprocessor. Writes $OUT/logmel_breakdown.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout root
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_logmel, next to this file

from bench_logmel import copy_peak_gbs, n_inputs, time_graph  # noqa: E402

from glmasr_kernels.logmel import _config as C  # noqa: E402
from glmasr_kernels.logmel import _runtime as R  # noqa: E402
from glmasr_kernels.logmel._build import KernelConfig, get_cubin  # noqa: E402

N_MELS = 128


def base_cfg(sm: int, out_bf16: bool = False) -> KernelConfig:
    """The production Whisper configuration (what kernels.logmel.whisper_features launches) for SM `sm`."""
    ept, pairs, iters = C.LAUNCH[400]
    return KernelConfig(400, pairs, iters, C.split_lanes(400, N_MELS), 0, True, False, out_bf16, sm, ept,
                        C.WHISPER_DIRECT, C.WHISPER_MINB, skel=C.WHISPER_SKEL)


# skeleton variants: name -> LM_SKEL bits / other overrides, relative to the production configuration
SKEL_VARIANTS = {
    "skel1 stage": dict(skel=1),
    "skel2 pspec": dict(skel=2),
    "skel4 tasks": dict(skel=4),
    "skel5 stage+tasks": dict(skel=5),
    "skel7 stage+pspec+tasks": dict(skel=7),
    "skel7 minb0 (no register cap)": dict(skel=7, minb=0),
    "skel1 P8R4 (64 frames/block)": dict(skel=1, iters=4),
}


def skel_variants(sm: int):
    b = base_cfg(sm)
    ablations = {
        "default": (b, True),
        "default load+skeleton only (1|2|4)": (replace(b, variant=7), True),
        "skel1 load+skeleton only (1|2|4)": (replace(b, skel=1, variant=7), True),
        "skel7 load+skeleton only (1|2|4)": (replace(b, skel=7, variant=7), True),
    }
    tilings = {"default": b, **{k: replace(b, **kw) for k, kw in SKEL_VARIANTS.items()}}
    return ablations, tilings


def variants(sm: int, which: str = "skel"):
    if which == "skel":
        return skel_variants(sm)
    b = base_cfg(sm)
    d = replace(b, direct=True, minb=0)
    ablations = {  # name -> (cfg, finalize)
        "default": (b, True),
        "default main only (no finalize)": (b, False),
        "default no FFT": (replace(b, variant=1), True),
        "default mel 1-tap": (replace(b, variant=2), True),
        "default no stores": (replace(b, variant=4), True),
        "default load+skeleton only (1|2|4)": (replace(b, variant=7), True),
        "direct": (d, True),
        "direct main only (no finalize)": (d, False),
        "direct no FFT": (replace(d, variant=1), True),
        "direct mel 1-tap": (replace(d, variant=2), True),
        "direct no stores": (replace(d, variant=4), True),
    }
    tilings = {
        "default": b,
        "direct": d,
        "direct minb5": replace(d, minb=5),
        "direct minb6": replace(d, minb=6),
        "direct minb7": replace(d, minb=7),
        "direct P8R4 (64 frames/block)": replace(d, iters=4),
        "direct P16R1 (32 frames/block, 320 thr)": replace(d, pairs=16, iters=1),
    }
    sa, st = skel_variants(sm)
    return {**ablations, **sa}, {**tilings, **st}


def _warm(cfg):
    t = time.time()
    try:
        get_cubin(cfg)
    except Exception as e:  # noqa: BLE001  (a variant that does not compile is reported, not fatal)
        print(f"compile failed: {cfg}: {str(e)[-400:]}", flush=True)
        return -1.0
    return time.time() - t


def occupancy(cfg: KernelConfig, nnz: int) -> dict:
    from cuda.bindings import driver

    mod = R.get_module(cfg, torch.cuda.current_device())
    smem = C.smem_bytes(mod.ws_bytes, mod.tfs, N_MELS, nnz)
    mod.ensure_smem(smem)
    A = driver.CUfunction_attribute
    ga = lambda fn, a: int(R._ck(driver.cuFuncGetAttribute(a, fn), "cuFuncGetAttribute"))  # noqa: E731
    threads = mod.block[0] * mod.block[1]
    blocks = int(R._ck(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(mod.main, threads, smem), "occupancy"))
    fin = {}
    if mod.finalize is not None:
        fin = dict(
            finalize_regs=ga(mod.finalize, A.CU_FUNC_ATTRIBUTE_NUM_REGS),
            finalize_blocks_per_sm=int(R._ck(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(mod.finalize, 256, 0), "occ")),
        )
    return dict(
        threads=threads, block=list(mod.block[:2]), frames_per_block=mod.tf,
        regs=ga(mod.main, A.CU_FUNC_ATTRIBUTE_NUM_REGS),
        local_bytes=ga(mod.main, A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
        static_smem=ga(mod.main, A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
        dyn_smem=smem, fft_ws_bytes=mod.ws_bytes,
        blocks_per_sm=blocks, warps_per_sm=blocks * ((threads + 31) // 32), **fin,
    )


_CHECK_INPUTS: dict = {}


def _check_inputs():
    """Inputs and references of check(), built once: 8 mixed-length rows with dirty tails, 8 full rows."""
    if _CHECK_INPUTS:
        return _CHECK_INPUTS
    from glmasr.features import log_mel_windows
    from glmasr.features import whisper_features as ref_whisper

    rng = np.random.default_rng(7)
    B = 8
    lens = [480000, 479999, 300001, 160, 1000, 12345, 480000 - 161, 250000]
    g = torch.Generator(device="cuda").manual_seed(1)
    full = torch.randn(B, 480000, device="cuda", generator=g) * 0.1
    full[1::2] *= torch.linspace(0, 1, 480000, device="cuda") ** 3  # a quiet start: clamp path taken
    pieces = [full[i, : lens[i]].clone() for i in range(B)]
    pcm = torch.zeros_like(full)
    for i, n in enumerate(lens):
        pcm[i, :n] = pieces[i]
    dirty = pcm.clone()
    for i, n in enumerate(lens):
        dirty[i, n:] = float(rng.uniform(0.5, 2.0))
    rf, rm = ref_whisper(pieces, device="cuda")
    _CHECK_INPUTS.update(dirty=dirty, full=full, L=torch.tensor(lens, device="cuda"), rf=rf, rm=rm,
                         ref_full=log_mel_windows(full))
    # rows of 479999 samples: every other row starts off a 16-byte boundary (LM_STAGE's 4-byte cp.async path);
    # int16 rows of 479998 samples: every other row is 4- but not 16-byte aligned (LM_STAGE's plain-copy path)
    _CHECK_INPUTS["odd"] = dirty[:, :479999].contiguous()
    _CHECK_INPUTS["i16"] = (dirty[:, :479998].clamp(-1, 1) * 32767).round().to(torch.int16).contiguous()
    return _CHECK_INPUTS


def _outputs(cfg: KernelConfig) -> dict:
    """The kernel's outputs on the check inputs: fp32 mixed (+mask), fp32 full (+mask), bf16 and fp16 mixed."""
    I = _check_inputs()
    f, m = R.whisper_impl(I["dirty"], I["L"], N_MELS, None, cfg=replace(cfg, out_bf16=False, out_f16=False))
    f2, m2 = R.whisper_impl(I["full"], None, N_MELS, None, cfg=replace(cfg, out_bf16=False, out_f16=False))
    fb, _ = R.whisper_impl(I["dirty"], I["L"], N_MELS, None, cfg=replace(cfg, out_bf16=True, out_f16=False))
    fh, _ = R.whisper_impl(I["dirty"], I["L"], N_MELS, None, cfg=replace(cfg, out_bf16=False, out_f16=True))
    fo, mo = R.whisper_impl(I["odd"], I["L"].clamp(max=479999), N_MELS, None, cfg=replace(cfg, out_bf16=False, out_f16=False))
    fi, _ = R.whisper_impl(I["i16"], None, N_MELS, None, cfg=replace(cfg, in_i16=True, out_bf16=False, out_f16=False))
    torch.cuda.synchronize()
    return dict(f=f, m=m, f2=f2, m2=m2, fb=fb, fh=fh, fo=fo, mo=mo, fi=fi)


_DEFAULT_OUT: dict = {}


def check(cfg: KernelConfig, default_cfg: KernelConfig | None = None) -> dict:
    """Max abs diff vs glmasr.features on mixed lengths (+ dirty tails, mask) and full rows; bf16 and fp16
    output within their rounding; and bitexact: every output equal (torch.equal) to default_cfg's."""
    I = _check_inputs()
    rf = I["rf"]
    o = _outputs(cfg)
    res = {}
    res["mixed_max_abs"] = (o["f"] - rf).abs().max().item()
    res["mixed_nan"] = bool(torch.isnan(o["f"]).any())
    res["mask_equal"] = bool(torch.equal(o["m"], I["rm"]))
    res["full_max_abs"] = (o["f2"] - I["ref_full"]).abs().max().item()
    res["full_mask_all"] = bool(o["m2"].all())
    res["bf16_ok"] = bool(((o["fb"].float() - rf).abs() <= rf.abs() * 2.0**-8 + 2e-4).all())
    res["fp16_ok"] = bool(((o["fh"].float() - rf).abs() <= rf.abs() * 2.0**-11 + 2e-4).all())
    res["ok"] = (res["mixed_max_abs"] <= 2e-4 and res["full_max_abs"] <= 2e-4 and not res["mixed_nan"]
                 and res["mask_equal"] and res["full_mask_all"] and res["bf16_ok"] and res["fp16_ok"])
    if default_cfg is not None:
        if not _DEFAULT_OUT:
            _DEFAULT_OUT.update(_outputs(default_cfg))
        d = _DEFAULT_OUT
        res["bitexact"] = all(torch.equal(o[k], d[k]) for k in o)
        if not res["bitexact"]:
            res["bitexact_diff"] = {k: (o[k].float() - d[k].float()).abs().max().item() for k in o}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant (any host with NVRTC)")
    ap.add_argument("--sm", type=int, default=900)
    ap.add_argument("--set", default="skel", choices=["skel", "all"],
                    help="skel: default vs the LM_SKEL skeleton variants (default); all: also the older ablations/tilings")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]

    if args.compile_only:
        from glmasr_kernels.logmel._build import nvrtc_compile

        ab, ti = variants(args.sm, args.set)
        cfgs = {repr(c): c for c in [c for c, _ in ab.values()] + list(ti.values())}
        with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
            logs = list(ex.map(functools.partial(nvrtc_compile, verbose_ptxas=True), cfgs.values()))
        for c, (_, log) in zip(cfgs.values(), logs):
            main_log = log[log.find("'logmel_main'"):]
            print(c, "\n  ", " | ".join(ln.strip() for ln in main_log.splitlines()[1:4]), flush=True)
        return

    major, minor = torch.cuda.get_device_capability()
    sm = major * 100 + minor * 10
    ab, ti = variants(sm, args.set)
    cfgs = {repr(c): c for c in [c for c, _ in ab.values()] + list(ti.values())
            + [replace(c, out_bf16=True) for c in ti.values()] + [replace(c, out_f16=True) for c in ti.values()]
            + [replace(c, in_i16=True) for c in ti.values()]}
    t0 = time.time()
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        secs = list(ex.map(_warm, cfgs.values()))
    print(f"compiled/loaded {len(cfgs)} configs in {time.time() - t0:.1f} s (max {max(secs):.1f} s each)", flush=True)

    result = dict(set=args.set, whisper_skel=C.WHISPER_SKEL, whisper_minb=C.WHISPER_MINB,
                  device=torch.cuda.get_device_name(), sm=sm, n_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    jpath, mpath = out / "logmel_breakdown.json", out / "logmel_breakdown.md"

    def dump():
        jpath.write_text(json.dumps(result, indent=1, default=str))

    _, _, _, _, _, nnz = R._filters(("whisper", N_MELS), "cuda:0")
    occ = {}
    for name, cfg in {**{k: c for k, (c, _) in ab.items()}, **ti}.items():
        try:
            occ[name] = occupancy(cfg, nnz)
        except Exception as e:  # noqa: BLE001
            occ[name] = dict(error=repr(e)[:300])
        print(f"occupancy {name:40s} {occ[name]}", flush=True)
    result["occupancy"] = occ
    result["configs"] = {k: asdict(c) for k, c in ti.items()}
    dump()

    checks = {}
    with torch.inference_mode():
        for name, cfg in ti.items():
            try:
                checks[name] = check(cfg, ti["default"])
            except Exception as e:  # noqa: BLE001
                checks[name] = dict(ok=False, error=repr(e)[:300])
            print(f"check {name:40s} {checks[name]}", flush=True)
        result["checks"] = checks
        dump()

        peak = copy_peak_gbs()
        result["copy_peak_gbs"] = peak
        print(f"copy peak {peak:.0f} GB/s", flush=True)
        timings = {}
        jobs = [("ablation", k, c, fin) for k, (c, fin) in ab.items()]
        jobs += [("tiling", k, c, True) for k, c in ti.items() if k not in ("default", "direct")]
        if "default" not in ab:
            jobs.insert(0, ("tiling", "default", ti["default"], True))
        for B in batches:
            nb_in = B * 480000 * 4
            nbytes = nb_in + B * N_MELS * 3000 * 4 + B * 3000 * 4
            ins = [torch.randn(B, 480000, device="cuda") * 0.1 for _ in range(n_inputs(nb_in))]
            for kind, name, cfg, fin in jobs:
                ck = checks.get(name, {})
                if kind == "tiling" and not (ck.get("ok") and (ck.get("bitexact", True) or not name.startswith("skel"))):
                    continue  # a skeleton variant must be bit-identical to the default kernel
                fn = lambda x, cfg=cfg, fin=fin: R.whisper_impl(x, None, N_MELS, None, cfg=cfg, finalize=fin)  # noqa: E731
                try:
                    ms = time_graph(fn, ins)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} B={B}: {e!r}"[:300], flush=True)
                    continue
                timings.setdefault(name, {"kind": kind})[f"{B}x30s_ms"] = ms
                timings[name][f"{B}x30s_pct_copy_peak"] = 100.0 * nbytes / (ms * 1e-3) / 1e9 / peak
                print(f"B={B:4d} {name:40s} {ms:8.4f} ms", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
            del ins
            torch.cuda.empty_cache()
        result["timings"] = timings
        dump()

    cols = [f"{B}x30s_ms" for B in batches]
    lines = ["| variant | " + " | ".join(f"{B}x30s ms" for B in batches) + " | regs | local B | smem B | blocks/SM | warps/SM | check | bit-exact |",
             "|---|" + "---|" * len(batches) + "---|---|---|---|---|---|---|"]
    for name, t in timings.items():
        o = occ.get(name, {})
        ck = checks.get(name)
        ck_s = "-" if ck is None else ("ok %.1e" % max(ck.get("mixed_max_abs", 1), ck.get("full_max_abs", 1)) if ck.get("ok") else "FAIL")
        lines.append(f"| {name} | " + " | ".join(f"{t.get(c, float('nan')):.4f}" for c in cols)
                     + f" | {o.get('regs')} | {o.get('local_bytes')} | {(o.get('dyn_smem') or 0) + (o.get('static_smem') or 0)}"
                     f" | {o.get('blocks_per_sm')} | {o.get('warps_per_sm')} | {ck_s} | {'-' if ck is None else ck.get('bitexact', '-')} |")
    for name, ck in checks.items():
        if not ck.get("ok") or ck.get("bitexact") is False:
            lines.append(f"| {name} | correctness FAILED: {ck} |")
    md = "\n".join(lines)
    mpath.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
