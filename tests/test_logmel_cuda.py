"""Tests of the fused cuFFTDx log-mel frontend (kernels/logmel).

CPU (CI): pure-python logic (argument validation, cache key, pad-mode index mapping, filter packing,
a numpy emulation of the kernel's paired-FFT math) and an NVRTC compile for sm_90 of every kernel
configuration the GPU tests use. GPU (skipped without CUDA): mel vs torchaudio, Whisper features vs
transformers.WhisperFeatureExtractor, int16 input, bf16 output, poisoned outputs, errors, compile.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from glmasr_kernels.logmel import _config as C
from glmasr_kernels.logmel._build import KernelConfig, cache_key

def _nvrtc_available() -> bool:
    try:
        import cuda.bindings.nvrtc  # noqa: F401

        from glmasr_kernels.logmel._build import include_dirs

        include_dirs()
        return True
    except Exception:
        return False


HAS_NVRTC = _nvrtc_available()
HAS_CUDA = torch.cuda.is_available()
needs_nvrtc = pytest.mark.skipif(
    not HAS_NVRTC, reason="cuda-bindings / nvidia-cuda-nvrtc / nvidia-mathdx / nvidia-cuda-cccl not installed"
)
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_NVRTC), reason="needs a CUDA device and the NVRTC/mathdx wheels")

SR = 16000

# ------------------------------------------------------------------ the argument grid (GPU tests)
# Every n_fft with torchaudio defaults (hop n_fft/4, 128 mels, power 2), then argument variations.
MEL_CASES = [dict(n_fft=n, hop_length=n // 4) for n in C.SUPPORTED_N_FFT] + [
    dict(n_fft=400, hop_length=160, power=1.0),
    dict(n_fft=1024, hop_length=256, power=1.0),
    dict(n_fft=400, hop_length=160, power=0.5),
    dict(n_fft=1024, hop_length=300, power=3.0),
    dict(n_fft=400, hop_length=160, normalized=True),
    dict(n_fft=1024, hop_length=256, normalized="frame_length"),
    dict(n_fft=512, win_length=300, hop_length=128),
    dict(n_fft=1024, hop_length=200, center=False),
    dict(n_fft=512, hop_length=128, pad_mode="constant"),
    dict(n_fft=512, hop_length=128, pad_mode="replicate"),
    dict(n_fft=512, hop_length=128, pad_mode="circular"),
    dict(n_fft=256, hop_length=64, pad=37, pad_mode="reflect"),
    dict(n_fft=400, hop_length=160, n_mels=80, norm="slaney", mel_scale="slaney"),
    dict(n_fft=2048, hop_length=512, n_mels=64, f_min=50.0, f_max=7000.0, sample_rate=22050),
    dict(n_fft=4096, hop_length=1024, n_mels=256, sample_rate=44100),
    dict(n_fft=64, hop_length=16, n_mels=40),
]


def _mel_cfg(case: dict, in_i16=False, out_bf16=False, sm=900, out_f16=False) -> KernelConfig:
    a = C.validate_mel_args(**case)
    ept, pairs, iters = C.LAUNCH[a["n_fft"]]
    return KernelConfig(a["n_fft"], pairs, iters, C.split_lanes(a["n_fft"], a["n_mels"]), C.power_mode(a["power"]),
                        False, in_i16, out_bf16, sm, ept, out_f16=out_f16)


def _whisper_cfg(in_i16=False, out_bf16=False, n_mels=128, sm=900, out_f16=False) -> KernelConfig:
    ept, pairs, iters = C.LAUNCH[400]
    return KernelConfig(400, pairs, iters, C.split_lanes(400, n_mels), 0, True, in_i16, out_bf16, sm, ept,
                        C.WHISPER_DIRECT, C.WHISPER_MINB, out_f16=out_f16)


def all_test_configs(sm: int = 900) -> list[KernelConfig]:
    cfgs = {_mel_cfg(c, sm=sm) for c in MEL_CASES}
    cfgs.add(_mel_cfg(dict(n_fft=400, hop_length=160), in_i16=True, sm=sm))
    cfgs.add(_mel_cfg(dict(n_fft=512, hop_length=128), out_bf16=True, sm=sm))
    cfgs.add(_mel_cfg(dict(n_fft=512, hop_length=128), out_f16=True, sm=sm))
    for i16, bf16, f16 in ((False, False, False), (False, True, False), (True, False, False), (False, False, True)):
        cfgs.add(_whisper_cfg(i16, bf16, sm=sm, out_f16=f16))
    cfgs.add(_whisper_cfg(n_mels=80, sm=sm, out_f16=True))
    return sorted(cfgs, key=repr)


# ------------------------------------------------------------------ CPU: pure python
def test_validation_errors():
    bad = [
        (dict(n_fft=300), "n_fft"),
        (dict(n_fft=32768), "n_fft"),
        (dict(win_length=500), "win_length"),
        (dict(hop_length=0), "hop_length"),
        (dict(f_min=9000.0), "f_min"),
        (dict(pad=-1), "pad"),
        (dict(n_mels=0), "n_mels"),
        (dict(power=None), "power"),
        (dict(power=-1.0), "power"),
        (dict(normalized="bogus"), "normalized"),
        (dict(pad_mode="wrap"), "pad_mode"),
        (dict(onesided=False), "onesided"),
        (dict(norm="l2"), "norm"),
        (dict(mel_scale="bark"), "mel_scale"),
        (dict(window_fn=torch.hamming_window), "window_fn"),
        (dict(center="yes"), "center"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            C.validate_mel_args(**kwargs)
    a = C.validate_mel_args(n_fft=1024, normalized=True)
    assert a["win_length"] == 1024 and a["hop_length"] == 512 and a["normalized"] == "window"
    assert a["f_max"] == 8000.0


def test_mel_spectrogram_constructor_errors():
    from glmasr_kernels.logmel import MelSpectrogram

    with pytest.raises(ValueError, match="n_fft"):
        MelSpectrogram(n_fft=1000)
    for bad in (torch.float64, torch.int16, torch.complex64, "float16", None):
        # the message names every accepted dtype
        with pytest.raises(ValueError, match=r"dtype must be torch\.float32, torch\.bfloat16 or torch\.float16"):
            MelSpectrogram(dtype=bad)
    for ok in (torch.float32, torch.bfloat16, torch.float16):
        assert MelSpectrogram(dtype=ok).dtype == ok
    m = MelSpectrogram(n_fft=512, window_fn=torch.hann_window)
    assert m.hop_length == 256


def test_out_dtype_flags():
    assert C.out_dtype_flags(torch.float32) == (False, False)
    assert C.out_dtype_flags(torch.bfloat16) == (True, False)
    assert C.out_dtype_flags(torch.float16) == (False, True)
    with pytest.raises(ValueError, match=r"out_dtype must be torch\.float32, torch\.bfloat16 or torch\.float16"):
        C.out_dtype_flags(torch.float64, "out_dtype")
    with pytest.raises(ValueError, match="exclusive"):
        KernelConfig(400, 8, 2, 1, 0, True, False, True, 900, out_f16=True)
    assert _whisper_cfg(out_f16=True).macros()["LM_OUT_F16"] == "1"
    assert cache_key(_whisper_cfg(out_f16=True)) != cache_key(_whisper_cfg(out_bf16=True))


def test_whisper_features_dtype_error():
    """The out_dtype check comes before any CUDA work, so it runs on CPU too."""
    from glmasr_kernels.logmel import whisper_features

    with pytest.raises(ValueError, match=r"out_dtype must be torch\.float32, torch\.bfloat16 or torch\.float16"):
        whisper_features(torch.zeros(1, 1000), out_dtype=torch.float64)


def test_smem_bytes_layout():
    """Dynamic shared memory of logmel_main: workspace + output tile (n_mels x tfs fp32) + 3 int descriptors
    per mel + the packed weights (mirrors the layout in logmel.cu)."""
    assert C.smem_bytes(100, 0, 128, 394) == 100 + 12 * 128 + 4 * 394
    assert C.smem_bytes(100, 48, 128, 394) == C.smem_bytes(100, 0, 128, 394) + 4 * 128 * 48


@pytest.mark.parametrize("mode", sorted(C.PAD_MODES))
def test_pad_index_mapping_matches_torch(mode):
    rng = np.random.default_rng(1)
    for length in (5, 17, 64):
        for pad in sorted({1, length // 2, length - 1} | ({length} if mode in ("circular", "constant", "replicate") else set())):
            if pad < 1:
                continue
            x = torch.arange(1, length + 1, dtype=torch.float32)[None, None]
            ref = torch.nn.functional.pad(x, (pad, pad), mode=mode)[0, 0].numpy()
            got = np.array([
                0.0 if (i := C.map_pad_index(j - pad, length, mode)) < 0 else float(i + 1)
                for j in range(length + 2 * pad)
            ])
            np.testing.assert_array_equal(got, ref)
    assert rng is not None


def test_pad_validation():
    with pytest.raises(ValueError, match="reflect"):
        C.validate_pad(200, 200, "reflect")
    C.validate_pad(199, 200, "reflect")
    with pytest.raises(ValueError, match="circular"):
        C.validate_pad(201, 200, "circular")
    assert C.n_frames(480000, 400, 160, 0, True) == 3001
    assert C.n_frames(1000, 400, 100, 0, False) == 7
    with pytest.raises(ValueError, match="too short"):
        C.n_frames(100, 400, 100, 0, False)


def test_cache_key_and_dir(tmp_path, monkeypatch):
    from glmasr_kernels.logmel import _build

    a, b = _whisper_cfg(), _whisper_cfg(out_bf16=True)
    assert cache_key(a) == cache_key(_whisper_cfg()) and cache_key(a) != cache_key(b)
    assert cache_key(a) != cache_key(_whisper_cfg(sm=1000))
    from dataclasses import replace

    # the tiling switches are compile options, so they are part of the key
    keys = {cache_key(replace(a, **kw)) for kw in ({}, dict(direct=not a.direct), dict(minb=6), dict(out_f16=True))}
    assert len(keys) == 4
    assert {"LM_DIRECT", "LM_MINB", "LM_OUT_F16"} <= set(a.macros())
    monkeypatch.setenv("GLMASR_CACHE_DIR", str(tmp_path))
    assert _build.cache_dir() == tmp_path / "cubins"  # beside glmasr's own files under the same root
    monkeypatch.delenv("GLMASR_CACHE_DIR")
    assert _build.cache_dir().parts[-2:] == ("glmasr", "cubins")


def test_filterbank_matches_reference_and_packing():
    from glmasr.audio.features import mel_filter_bank_np

    fb = C.mel_fbanks(201, 0.0, 8000.0, 128, 16000, "slaney", "slaney")
    np.testing.assert_allclose(fb, mel_filter_bank_np(201, 128), rtol=1e-3, atol=1e-7)
    fb = mel_filter_bank_np(201, 128)
    start, width, off, w = C.pack_filters(fb)
    assert int(width.sum()) == 394 and width.max() <= 9 and start.min() >= 1
    dense = np.zeros_like(fb)
    for m in range(128):
        dense[start[m] : start[m] + width[m], m] = w[off[m] : off[m] + width[m]]
    np.testing.assert_array_equal(dense, fb)


def test_kernel_math_emulation():
    """Numpy emulation of the kernel (paired complex FFT, sparse mel, (s/2)^p weights, clamp) vs reference."""
    from glmasr.audio.features import log_mel_windows, mel_filter_bank_np

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(480000) * 0.1).astype(np.float32)
    x[100000:] = 0
    n, hop = 400, 160
    win = C.hann_window_padded(n, n)
    start, width, off, w = C.pack_filters(mel_filter_bank_np(201, 128), 0.25)
    j = np.arange(3000)[:, None] * hop - n // 2 + np.arange(n)[None, :]
    j = np.vectorize(lambda v: C.map_pad_index(int(v), 480000, "reflect"))(j)
    frames = x[j] * win
    z = np.fft.fft(frames[0::2] + 1j * frames[1::2], axis=1)
    k = np.arange(201)
    a, c = z[:, k], z[:, np.where(k == 0, 0, n - k)]
    p = np.empty((3000, 201))
    p[0::2] = (a.real + c.real) ** 2 + (a.imag - c.imag) ** 2
    p[1::2] = (a.imag + c.imag) ** 2 + (a.real - c.real) ** 2
    mel = np.stack([p[:, start[m] : start[m] + width[m]] @ w[off[m] : off[m] + width[m]] for m in range(128)])
    lg = np.log10(np.maximum(mel, 1e-10))
    out = (np.maximum(lg, lg.max() - 8) + 4) / 4
    ref = log_mel_windows(torch.from_numpy(x)[None])[0].numpy()
    assert np.abs(out - ref).max() < 2e-5


# ------------------------------------------------------------------ CPU: NVRTC compile (CI)
def _compile_one(cfg: KernelConfig) -> str:
    from glmasr_kernels.logmel._build import nvrtc_compile

    cubin, log = nvrtc_compile(cfg, verbose_ptxas=True)
    assert len(cubin) > 0
    return log


def ci_compile_configs(sm: int = 900) -> list[KernelConfig]:
    """What the CPU compiles for sm_90 (NVRTC needs no GPU): the product's Whisper configs (every dtype) and one
    MelSpectrogram config per supported FFT size (each its own cuFFTDx instantiation). The other test configs
    (power modes, mel counts, dtype flags of MelSpectrogram) differ in constants only; the GPU run compiles all of
    them (scripts/device.sh's prewarm) before its tests run them."""
    sizes = {}
    for c in MEL_CASES:
        sizes.setdefault(c["n_fft"], _mel_cfg(c, sm=sm))
    whisper = {_whisper_cfg(i16, bf16, sm=sm, out_f16=f16)
               for i16, bf16, f16 in ((False, False, False), (False, True, False), (True, False, False),
                                      (False, False, True))}
    return sorted(set(sizes.values()) | whisper, key=repr)


@needs_nvrtc
def test_nvrtc_compiles_every_test_config_sm90():
    cfgs = all_test_configs(900) if torch.cuda.is_available() else ci_compile_configs(900)
    assert len({c.n_fft for c in cfgs}) == len(C.SUPPORTED_N_FFT)
    workers = max(1, min(len(cfgs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        logs = list(ex.map(_compile_one, cfgs))
    import re

    for cfg, log in zip(cfgs, logs):
        main = log[log.find("'logmel_main'"):]
        spill = int(re.search(r"(\d+) bytes spill stores", main).group(1)) if "spill stores" in main else 0
        # a __launch_bounds__ min-blocks cap (Whisper: measured faster) may spill a few words, nothing else may
        limit = 64 if cfg.minb else 0
        assert spill <= limit, f"{cfg} spills {spill} bytes of registers:\n{log}"


# ------------------------------------------------------------------ GPU helpers
def _poison(nbytes: int) -> None:
    """Fill free caching-allocator memory with NaN so unwritten outputs show up."""
    t = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del t


def _speech_like(n: int, seed: int) -> np.ndarray:
    """Harmonic 'voice' with moving pitch, syllable envelope, pauses, and a faint noise floor."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(f0) / SR
    sig = sum((0.6 / h) * np.sin(h * phase) for h in range(1, 12))
    env = np.clip(np.sin(2 * np.pi * 3.1 * t + rng.uniform(0, 6)), 0, None) ** 2
    env *= (np.sin(2 * np.pi * 0.25 * t) > -0.5)
    return (0.3 * sig * env + 1e-4 * rng.standard_normal(n)).astype(np.float32)


def _signal(kind: str, n: int, seed: int) -> np.ndarray:
    if kind == "noise":
        return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)
    return _speech_like(n, seed)


def _split_windows(x: np.ndarray) -> list[np.ndarray]:
    return [x[i : i + 480000] for i in range(0, max(len(x), 1), 480000)]


def _hf_features(pieces: list[np.ndarray]) -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128)
    return np.stack([fe(p, sampling_rate=SR, return_tensors="np")["input_features"][0] for p in pieces])


# ------------------------------------------------------------------ GPU: Whisper features
@needs_cuda
@pytest.mark.parametrize("kind", ["noise", "speech"])
@pytest.mark.parametrize("seconds", [0.5, 3.5, 29.99, 30.0, 61.0])
def test_whisper_vs_hf(kind, seconds):
    from glmasr_kernels.logmel import whisper_features

    x = _signal(kind, int(round(seconds * SR)), seed=int(seconds * 100))
    pieces = _split_windows(x)
    ref = _hf_features(pieces)
    lens = [len(p) for p in pieces]
    pcm = torch.zeros(len(pieces), 480000, device="cuda")
    for i, p in enumerate(pieces):
        pcm[i, : len(p)] = torch.from_numpy(p).cuda()
    _poison(pcm.shape[0] * 128 * 3000 * 4 * 2)
    feats, mask = whisper_features(pcm, lengths=lens)
    torch.cuda.synchronize()
    assert feats.shape == (len(pieces), 128, 3000) and mask.dtype == torch.int32
    assert not torch.isnan(feats).any()
    np.testing.assert_allclose(feats.cpu().numpy(), ref, atol=2e-4, rtol=0)
    want = (torch.arange(3000)[None] < torch.tensor([(n + 159) // 160 for n in lens])[:, None]).int()
    assert torch.equal(mask.cpu(), want)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2, 7, 32, 128])
def test_whisper_batches_vs_torch_reference(batch):
    """Mixed lengths, short (B, T<480000) rows, vs glmasr.audio.features (which matches HF to ~1e-5)."""
    from glmasr.audio.features import whisper_features as ref_whisper
    from glmasr_kernels.logmel import whisper_features

    rng = np.random.default_rng(batch)
    T = 480000 if batch % 2 else 400000
    lens = rng.integers(1, T + 1, size=batch)
    lens[0] = T
    pieces = [torch.from_numpy(_signal("speech" if i % 2 else "noise", int(n), i)) for i, n in enumerate(lens)]
    pcm = torch.zeros(batch, T, device="cuda")
    for i, p in enumerate(pieces):
        pcm[i, : len(p)] = p.cuda()
    pcm_dirty = pcm + 0.0
    for i, n in enumerate(lens):  # garbage past `lengths` must be ignored
        pcm_dirty[i, n:] = 1.0
    rf, rm = ref_whisper([p.cuda() for p in pieces], device="cuda")
    for src in (pcm, pcm_dirty):
        _poison(batch * 128 * 3000 * 4 * 2)
        f, m = whisper_features(src, lengths=torch.tensor(lens))
        torch.cuda.synchronize()
        assert not torch.isnan(f).any()
        assert (f - rf).abs().max().item() < 2e-4
        assert torch.equal(m, rm)


@needs_cuda
def test_whisper_int16_and_default_lengths():
    from glmasr.audio.features import log_mel_windows
    from glmasr_kernels.logmel import whisper_features

    x = _signal("speech", 480000, 3)
    q = np.clip(np.round(x * 32768), -32768, 32767).astype(np.int16)
    pcm16 = torch.from_numpy(q).cuda()[None].repeat(3, 1)
    ref = log_mel_windows(pcm16.float() / 32768)
    _poison(3 * 128 * 3000 * 4 * 2)
    f, m = whisper_features(pcm16)
    torch.cuda.synchronize()
    assert (f - ref).abs().max().item() < 2e-4 and bool(m.all())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n_mels", [128, 80])
def test_whisper_bf16_out(n_mels, dtype):
    from glmasr.audio.features import log_mel_windows
    from glmasr_kernels.logmel import whisper_features

    pcm = torch.from_numpy(_signal("speech", 480000, 5)).cuda()[None].repeat(2, 1)
    pcm[1, 100000:] = 0
    ref = log_mel_windows(pcm, n_mels=n_mels)
    _poison(2 * n_mels * 3000 * 4 * 2)
    f, _ = whisper_features(pcm, lengths=[480000, 100000], n_mels=n_mels, out_dtype=dtype)
    torch.cuda.synchronize()
    assert f.dtype == dtype and not torch.isnan(f.float()).any() and not torch.isinf(f.float()).any()
    # within one rounding of the fp32 reference (half an ulp: 2^-8 relative for bf16, 2^-11 for fp16; the
    # features lie in [-1.5, 2.5], far from fp16's limits) plus the fp32 tolerance
    tol = ref.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) + 2e-4
    assert bool(((f.float() - ref).abs() <= tol).all())
    f32, _ = whisper_features(pcm, lengths=[480000, 100000], n_mels=n_mels)
    assert torch.equal(f, f32.to(dtype))  # rounded once from the kernel's own fp32 result


@needs_cuda
def test_whisper_errors():
    from glmasr_kernels.logmel import whisper_features

    with pytest.raises(ValueError, match="CUDA"):
        whisper_features(torch.zeros(1, 1000))
    with pytest.raises(ValueError, match="480000"):
        whisper_features(torch.zeros(1, 480001, device="cuda"))
    with pytest.raises(ValueError, match="float32 or int16"):
        whisper_features(torch.zeros(1, 1000, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="lengths"):
        whisper_features(torch.zeros(2, 1000, device="cuda"), lengths=[1])
    with pytest.raises(RuntimeError, match="inference-only"):
        whisper_features(torch.zeros(1, 1000, device="cuda", requires_grad=True))


# ------------------------------------------------------------------ GPU: MelSpectrogram vs torchaudio
@needs_cuda
@pytest.mark.parametrize("case", MEL_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_mel_vs_torchaudio(case):
    torchaudio = pytest.importorskip("torchaudio")
    from glmasr_kernels.logmel import MelSpectrogram

    T = 20000 if case["n_fft"] < 8192 else 40000
    x = torch.randn(2, 3, T, device="cuda")
    ref_mod = torchaudio.transforms.MelSpectrogram(**{"sample_rate": SR, **case}).cuda()
    ref = ref_mod(x)
    _poison(ref.numel() * 4 * 2)
    got = MelSpectrogram(**case)(x)
    torch.cuda.synchronize()
    assert got.shape == ref.shape
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@needs_cuda
def test_mel_int16_and_bf16():
    torchaudio = pytest.importorskip("torchaudio")
    from glmasr_kernels.logmel import MelSpectrogram

    q = torch.randint(-20000, 20000, (3, 16000), dtype=torch.int16, device="cuda")
    ref = torchaudio.transforms.MelSpectrogram(n_fft=400, hop_length=160).cuda()(q.float() / 32768)
    got = MelSpectrogram(n_fft=400, hop_length=160)(q)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    x = torch.randn(4, 16000, device="cuda")
    ref = torchaudio.transforms.MelSpectrogram(n_fft=512, hop_length=128).cuda()(x)
    got = MelSpectrogram(n_fft=512, hop_length=128, dtype=torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=1e-4, rtol=2.0**-7)


def _assert_close_fp16(got: torch.Tensor, ref32: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """got (fp16 kernel output) vs ref32.to(float16) (torchaudio's result quantised to fp16).

    Tolerance: |kernel_fp32 - ref_fp32| <= atol + rtol |ref| (the fp32 test's tolerance); rounding both to fp16
    moves each by at most half an fp16 ulp, i.e. by at most one ulp together when they straddle a rounding
    boundary, and an ulp is <= 2^-10 |x| for normal x (subnormals: 2^-24, far under atol). So: atol, rtol + 2^-10.
    Overflow: both are inf where the fp32 value rounds past 65504 (>= 65520); an element whose fp32 reference lies
    within the fp32 tolerance of 65520 may legitimately round either way, so it needs got >= 65504 or finite-close.
    """
    ref16 = ref32.to(torch.float16)
    g, r = got.float(), ref16.float()
    tol = atol + (rtol + 2.0**-10) * r.abs().clamp(max=65504.0)
    edge = (ref32 - 65520.0).abs() <= atol + rtol * 65520.0
    fin = torch.isfinite(r) & torch.isfinite(g)
    assert bool(((g - r).abs() <= tol)[fin].all()), float(((g - r).abs() - tol)[fin].max())
    inf_mismatch = torch.isinf(g) != torch.isinf(r)
    assert bool((~inf_mismatch | (edge & (g.abs() >= 65504.0) & (r.abs() >= 65504.0))).all())


@needs_cuda
@pytest.mark.parametrize("scale", [1.0, 40.0], ids=["normal", "overflow"])
def test_mel_fp16_vs_torchaudio(scale):
    """float16 output = torchaudio's float32 result quantised to float16 (inf past 65504 included)."""
    torchaudio = pytest.importorskip("torchaudio")
    from glmasr_kernels.logmel import MelSpectrogram

    # overflow case: the loudness ramps from 0.01 to 40 (mean bin power ~3e5 at the end), so both finite and
    # overflowing (inf) values occur
    x = torch.randn(4, 16000, device="cuda")
    if scale > 1:
        x = x * torch.logspace(-2, math.log10(scale), 16000, device="cuda")
    ref32 = torchaudio.transforms.MelSpectrogram(n_fft=512, hop_length=128).cuda()(x)
    _poison(ref32.numel() * 4 * 2)
    got = MelSpectrogram(n_fft=512, hop_length=128, dtype=torch.float16)(x)
    torch.cuda.synchronize()
    assert got.dtype == torch.float16 and got.shape == ref32.shape and not torch.isnan(got).any()
    if scale > 1:  # the loud input really overflows fp16 somewhere, and stays finite elsewhere
        assert bool(torch.isinf(ref32.to(torch.float16)).any()) and bool(torch.isfinite(ref32.to(torch.float16)).any())
    _assert_close_fp16(got, ref32)
    got32 = MelSpectrogram(n_fft=512, hop_length=128)(x)
    assert torch.equal(got, got32.to(torch.float16))  # one rounding of the kernel's own fp32 result


@needs_cuda
def test_mel_runtime_errors():
    from glmasr_kernels.logmel import MelSpectrogram

    m = MelSpectrogram(n_fft=1024)
    with pytest.raises(ValueError, match="reflect"):
        m(torch.randn(1, 300, device="cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        m(torch.randn(1, 3000))
    with pytest.raises(RuntimeError, match="inference-only"):
        m(torch.randn(1, 3000, device="cuda", requires_grad=True))
    with torch.no_grad():
        m(torch.randn(1, 3000, device="cuda", requires_grad=True))


@needs_cuda
def test_torch_compile_fullgraph():
    from glmasr_kernels.logmel import MelSpectrogram, whisper_features

    mel = MelSpectrogram(n_fft=512, hop_length=128)

    def f(x, pcm):
        feats, mask = whisper_features(pcm)
        return mel(x).sum() + feats.sum(), mask

    x = torch.randn(2, 8000, device="cuda")
    pcm = torch.randn(2, 480000, device="cuda") * 0.1
    eager = f(x, pcm)
    comp = torch.compile(f, fullgraph=True)(x, pcm)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-5, atol=1e-2)
    assert torch.equal(comp[1], eager[1])


@needs_cuda
def test_warm_load_does_not_compile(monkeypatch):
    """A cached cubin is loaded without NVRTC: the compiler is replaced by one that fails, and loading the
    module still works (its speed is measured by the benchmarks, not asserted here)."""
    from glmasr_kernels.logmel import _build, _runtime

    cfg = _whisper_cfg(sm=_runtime._device_sm(torch.cuda.current_device()))
    _build.get_cubin(cfg)  # ensure cached

    def no_compile(*a, **k):
        raise AssertionError("NVRTC ran although the cubin was cached")

    monkeypatch.setattr(_build, "nvrtc_compile", no_compile)
    cubin = _build.get_cubin(cfg)
    mod = _runtime._Module(cfg, torch.cuda.current_device())
    assert len(cubin) > 0 and mod.tf == 32
