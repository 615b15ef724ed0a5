"""The Triton model path (fused weight cache + kernels) against the plain-PyTorch path, same weights.

On CPU this runs under TRITON_INTERPRET=1 (CI); on the H200 it runs the compiled kernels (device tool).
"""

import os

import pytest
import torch

import glmasr
from glmasr.api import teacher_forced_logits

from conftest import noise

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                reason="needs CUDA, or TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def both_paths(tiny_shipped):
    from glmasr.models.fast import FastGlmAsrModel

    ref = glmasr.load(tiny_shipped, device=DEVICE, dtype="float32", backend="torch")
    fast = glmasr.load(tiny_shipped, device=DEVICE, dtype="float32", backend="torch")
    fast.model = FastGlmAsrModel(fast.model)
    return ref, fast


def test_fast_path_shares_weights_with_reference(both_paths):
    _, fast = both_paths
    lw = fast.model.dec_layers[0]
    q = fast.model.reference.language_model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == lw.w_qkv.data_ptr()
    up = fast.model.reference.language_model.layers[0].mlp.up_proj.weight
    assert up.data_ptr() == lw.w_gate_up[lw.w_gate_up.shape[0] // 2:].data_ptr()


def test_fast_logits_match_reference_fp32(both_paths):
    """fp32 on both sides, different op order (fused QKV GEMM, kernels): rounding-level differences.
    1e-5 relative to the largest logit is ~100x the observed fp32 difference."""
    ref, fast = both_paths
    audio = noise(3.5, 5)
    forced = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    a, ids_a = teacher_forced_logits(fast, audio, forced, sampling_rate=16000)
    b, ids_b = teacher_forced_logits(ref, audio, forced, sampling_rate=16000)
    assert ids_a == ids_b
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_fast_greedy_tokens_equal_reference_mixed_batch(both_paths):
    ref, fast = both_paths
    audios = [noise(1.0, 6), noise(12.0, 7)]
    a = glmasr.transcribe(audios, model=fast, sampling_rate=16000, max_new_tokens=8)
    b = glmasr.transcribe(audios, model=ref, sampling_rate=16000, max_new_tokens=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


def test_backend_validation(tiny_shipped):
    with pytest.raises(ValueError, match="unknown backend"):
        glmasr.load(tiny_shipped, device="cpu", backend="cuda-graphs")
    if not torch.cuda.is_available() and not INTERPRET:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            glmasr.load(tiny_shipped, device="cpu", backend="triton")


def test_fast_path_ignores_unwritten_kv_slots(both_paths, nan_kv_cache):
    """Decode attention must read only slots [0, length): a NaN-poisoned KV buffer changes nothing."""
    _, fast = both_paths
    audios = [noise(1.0, 16), noise(12.0, 17)]
    clean = glmasr.transcribe(audios, model=fast, sampling_rate=16000, max_new_tokens=6)
    nan_kv_cache(fast)
    poisoned = glmasr.transcribe(audios, model=fast, sampling_rate=16000, max_new_tokens=6)
    assert [r.token_ids for r in poisoned] == [r.token_ids for r in clean]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_cuda_engine_uses_fused_frontend_and_agrees(tiny_shipped):
    """On CUDA the default load runs the Triton model on features from the fused cuFFTDx frontend. Against the
    plain-torch path (torch features, torch model) in fp32: features differ by <= 2e-4 (frontend tolerance),
    so logits agree to 1e-3 relative and greedy tokens are identical on this clip."""
    from kernels.logmel import is_available

    assert is_available(), "the device run installs nvidia-mathdx / nvidia-cuda-cccl (scripts/device_*.sh)"
    fast = glmasr.load(tiny_shipped, device="cuda", dtype="float32")
    ref = glmasr.load(tiny_shipped, device="cuda", dtype="float32", backend="torch")
    assert fast.frontend == "cuda" and ref.frontend == "torch"
    audio = noise(7.0, 23)
    forced = [5, 17, 99, 200]
    a, _ = teacher_forced_logits(fast, audio, forced, sampling_rate=16000)
    b, _ = teacher_forced_logits(ref, audio, forced, sampling_rate=16000)
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-3
    ta = glmasr.transcribe(audio, model=fast, sampling_rate=16000, max_new_tokens=8).token_ids
    tb = glmasr.transcribe(audio, model=ref, sampling_rate=16000, max_new_tokens=8).token_ids
    assert ta == tb


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_encoder_graphs_equal_eager(tiny_shipped):
    """Encoder replayed from CUDA graphs (window-count buckets, padded with zero windows) equals the eager
    encoder. fp32; a padded bucket may make cuBLAS/SDPA pick other kernels, so compare to fp32 rounding."""
    from glmasr.models.fast import FastGlmAsrModel

    ref = glmasr.load(tiny_shipped, device="cuda", dtype="float32", backend="torch")
    fast = FastGlmAsrModel(ref.model, encoder_graphs=True)
    for w in (1, 3, 5):
        feats = torch.randn(w, 128, 3000, device="cuda")
        out = fast.encode_audio(feats)
        torch.testing.assert_close(out, fast._encode_eager(feats), rtol=1e-4, atol=1e-5)
    assert sorted(fast._enc_graphs) == [1, 4, 8]
