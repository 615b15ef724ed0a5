"""The Triton model path (fused weight cache + kernels) against the plain-PyTorch path, same weights.

On CPU this runs under TRITON_INTERPRET=1 (CI); on the H200 it runs the compiled kernels (device tool).
"""

import os

import pytest
import torch

import glmasr
from glmasr.pipeline import teacher_forced_logits

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
    lw = fast.model.decoder.layers[0]
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_decode_rows_equal_the_row_alone(tiny_shipped, dtype):
    """``batch_invariant``: a sequence decoded alone (1 row, KV bucket 32) and the same sequence as row 7 of 19
    (the other rows fresh random prompts and tokens at other positions, KV bucket 64: the GEMVs 16 rows at a
    time, attention over a longer bucket) give bit-identical hidden states, logits and cache writes. Each prompt
    is prefilled alone, as the engine does in this mode."""
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr.models.kv_cache import KVCache

    if dtype == "bfloat16" and not torch.cuda.is_available():
        pytest.skip("bf16 runs on the GPU (the interpreter's bf16 is fp32 truncated)")
    ref = glmasr.load(tiny_shipped, device=DEVICE, dtype=dtype, backend="torch")
    fast = FastGlmAsrModel(ref.model)
    fast.batch_invariant = True
    c, dt = fast.cfg.text, getattr(torch, dtype)
    g = torch.Generator().manual_seed(17)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dt)  # noqa: E731
    b, target, plen = 19, 7, 9
    prompt = rnd(plen, c.hidden_size)
    alone, batch = KVCache(c, 1, 64, DEVICE, dt), KVCache(c, b, 64, DEVICE, dt)
    for cache in (alone, batch):
        cache.k.fill_(float("nan"))  # slots nobody wrote must never be read
        cache.v.fill_(float("nan"))
    first_alone = fast.logits(fast.prefill([prompt], alone, [0]))
    lengths = [plen if r == target else 3 + (5 * r) % 20 for r in range(b)]
    firsts = [fast.logits(fast.prefill([prompt if r == target else rnd(n, c.hidden_size)], batch, [r]))
              for r, n in enumerate(lengths)]
    assert torch.equal(firsts[target], first_alone)
    for i in range(3):
        x = rnd(1, 1, c.hidden_size)
        h1 = fast.decode(x, torch.tensor([[plen + i]], device=DEVICE), alone, kv_len=32)
        xs = rnd(b, 1, c.hidden_size)
        xs[target] = x[0]
        pos = torch.tensor([[n + i] for n in lengths], device=DEVICE)
        hb = fast.decode(xs, pos, batch, kv_len=64)
        assert torch.isfinite(hb).all()
        assert torch.equal(hb[target], h1[0]), f"step {i}: row {target} of {b} differs from the row alone"
        assert torch.equal(fast.logits(hb[:, 0])[target], fast.logits(h1[:, 0])[0])
    n = plen + 3
    assert torch.equal(batch.k[:, target, :, :n], alone.k[:, 0, :, :n])
    assert torch.equal(batch.v[:, target, :, :n], alone.v[:, 0, :, :n])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_prefill_equals_reference_per_prompt(tiny_shipped, dtype):
    """The fast path's packed prefill (all prompts in one pass, per-token positions and cache rows, varlen
    attention: flash on the GPU in bf16, per-prompt SDPA in fp32 and under the interpreter) against the
    reference's one decode per prompt, same weights, prompts of 1..37 tokens into scattered cache rows of a
    NaN-poisoned cache. Last-token hidden states: fp32 within 1e-5 of the largest (summation order only); bf16
    within 3e-2 (different GEMM shapes and attention kernels round differently through the layers; the engine
    tests check the tokens). Cache: each prompt's slots [0, L) written and finite, every other slot untouched."""
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr.models.kv_cache import KVCache

    if dtype == "bfloat16" and not torch.cuda.is_available():
        pytest.skip("bf16 comparison runs on the GPU (the interpreter's bf16 is fp32 truncated)")
    ref = glmasr.load(tiny_shipped, device=DEVICE, dtype=dtype, backend="torch")
    fast = FastGlmAsrModel(ref.model)
    assert fast.decoder.packed_attention == ("flash-varlen" if dtype == "bfloat16" else "sdpa")
    c, dt = fast.cfg.text, getattr(torch, dtype)
    g = torch.Generator().manual_seed(31)
    lengths, rows = [37, 1, 12, 5, 20], [4, 0, 6, 2, 5]
    embeds = [torch.randn(n, c.hidden_size, generator=g).to(DEVICE, dt) for n in lengths]
    caches = []
    for model in (fast, ref.model):
        cache = KVCache(c, 8, 48, DEVICE, dt)
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        caches.append((model.prefill(embeds, cache, rows), cache))
    (a, ca), (b, cb) = caches
    assert a.shape == (len(lengths), c.hidden_size) and torch.isfinite(a).all()
    bound = 1e-5 if dtype == "float32" else 3e-2
    assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < bound
    for layer in range(c.num_hidden_layers):
        for got, want in ((ca.k[layer], cb.k[layer]), (ca.v[layer], cb.v[layer])):
            assert torch.equal(got.isnan(), want.isnan())
            for row, n in zip(rows, lengths):
                assert torch.isfinite(got[row, :, :n]).all() and got[row, :, n:].isnan().all()
            assert got[[1, 3, 7]].isnan().all()
            diff = (got.nan_to_num(0) - want.nan_to_num(0)).abs().max() / want.nan_to_num(0).abs().max()
            assert diff.item() < bound


def test_encoder_attention_kernel_equals_sdpa_path(both_paths):
    """The encoder layers with attention on kernels/encoder_attention.py (the GPU default) against torch SDPA
    (the interpreter's default), both after ``rope_``, fp32: the two differ in summation order only, 5e-5
    relative to the largest value. One layer's fp32 attention differs by ~1e-6 relative (online softmax, exp2);
    through the tiny encoder's layers over 1500 frames the H200 measured 1.25e-5, so 5e-5 leaves 4x margin
    while a real fault (a wrong rotation, a dropped tile) is O(1)."""
    from glmasr_kernels.layernorm import layer_norm

    _, fast = both_paths
    enc = fast.model.encoder
    # the layers over a whole window on the GPU; at a short length under the interpreter (the kernel takes any
    # T; 1500 frames of attention take minutes there)
    w, t, hidden = 2, 1500 if torch.cuda.is_available() else 45, fast.config.audio.hidden_size
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(w, t, hidden, generator=g).to(DEVICE)
    positions = torch.arange(t, device=DEVICE, dtype=torch.int32).expand(w, t)
    h0 = layer_norm(residual, *enc.layers[0].ln1, fast.config.audio.layer_norm_eps)
    saved = enc.attention_kernel
    try:
        enc.attention_kernel = False
        base = enc.run_layers(h0, residual.clone(), positions)
        enc.attention_kernel = True
        got = enc.run_layers(h0, residual.clone(), positions)
    finally:
        enc.attention_kernel = saved
    assert torch.isfinite(got).all()
    assert ((got - base).abs().max() / base.abs().max()).item() < 5e-5


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
    from glmasr_kernels.logmel import is_available

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


def test_encoder_pieces_make_the_count_from_graph_buckets():
    """A window count up to the largest bucket is a sum of buckets, largest first (each a graph replay); above
    it, or with no buckets (graphs off), the eager pass runs ([])."""
    from glmasr.engine.model_runner import encoder_pieces

    buckets = (1, 2, 4, 8)
    for w in range(1, 9):
        p = encoder_pieces(w, buckets)
        assert sum(p) == w and p == sorted(p, reverse=True) and set(p) <= set(buckets), (w, p)
        assert len(p) == bin(w).count("1")  # the fewest replays
    assert encoder_pieces(7, buckets) == [4, 2, 1] and encoder_pieces(8, buckets) == [8]
    assert encoder_pieces(9, buckets) == [] and encoder_pieces(32, buckets) == []
    assert encoder_pieces(3, ()) == [] and encoder_pieces(0, buckets) == []
    assert encoder_pieces(3, (2,)) == []  # no way to make it: eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_encoder_graphs_equal_eager(tiny_shipped):
    """The runner's encoder replayed from CUDA graphs (1, 2; 5 = 4 + 1 and 7 = 4 + 2 + 1 windows as several
    replays; 12 windows, above the largest bucket, run eagerly, no graph) equals the model's eager encoder. fp32
    with cuDNN's TF32 convolutions off; a bucket of another size may make cuBLAS pick other kernels (another
    summation order), so the bound is fp32 rounding through the stack: 1e-5 of the output's largest magnitude (the
    first device run measured 2.4e-5 absolute with TF32 convolutions on). The model itself holds no graph."""
    from glmasr.engine.model_runner import ENCODER_BUCKETS, ModelRunner
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr.options import EngineOptions

    ref = glmasr.load(tiny_shipped, device="cuda", dtype="float32", backend="torch")
    fast = FastGlmAsrModel(ref.model)
    runner = ModelRunner(fast, EngineOptions(max_batch=1).resolved("cuda"))
    assert runner.encoder_buckets == ENCODER_BUCKETS == (1, 2, 4, 8)
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            for w in (1, 2, 5, 7, 12):
                feats = torch.randn(w, 128, 3000, device="cuda")
                out = runner.encode_audio(feats)
                expect = fast.encode_audio(feats)
                assert out.shape == expect.shape
                err = ((out - expect).abs().max() / expect.abs().max()).item()
                assert err < 1e-5, f"{w} windows: {err:.2e}"
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert sorted(runner._encoder_graphs) == [1, 2, 4] and runner.stats["encoder_captures"] == 3
    assert ModelRunner(ref.model, EngineOptions(max_batch=1).resolved("cuda")).encoder_buckets == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_pdl_decode_step_in_graph_equals_plain_launches(tiny_shipped):
    """One decode step (skinny GEMVs, RMSNorm, RoPE+append, split-KV attention) captured in a CUDA graph with
    programmatic dependent launch equals the same step launched eagerly without PDL, bit for bit (same kernels,
    same arithmetic: PDL only changes when a kernel may start, so any difference is a missed wait)."""
    from glmasr.models.kv_cache import KVCache
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr_kernels import _triton_utils

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ref = glmasr.load(tiny_shipped, device="cuda", dtype="bfloat16", backend="torch")
    fast = FastGlmAsrModel(ref.model)
    c = fast.cfg.text
    g = torch.Generator(device="cuda").manual_seed(3)
    cache = KVCache(c, 3, 512, "cuda", torch.bfloat16)
    prompt = torch.randn(3, 40, c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    fast.decode(prompt, torch.arange(40, device="cuda").expand(3, 40), cache, kv_len=40)
    step = torch.randn(3, 1, c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.tensor([[40], [40], [40]], device="cuda")
    try:
        _triton_utils.set_pdl(False)
        plain = fast.logits(fast.decode(step, pos, cache, kv_len=512)[:, 0])
        _triton_utils.set_pdl(True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fast.logits(fast.decode(step, pos, cache, kv_len=512)[:, 0])  # warm-up (compiles the PDL variants)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fast.logits(fast.decode(step, pos, cache, kv_len=512)[:, 0])
        static.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    finally:
        _triton_utils.set_pdl(None)
    assert torch.equal(static, plain)
