"""The one-row decode step's qkv CUDA GEMV with RoPE + KV append in its epilogue (models/fast_decoder.py,
``QKV_ROPE_WEIGHTS``; ``cuda_gemv.gemv_qkv_rope``) against the unfused step (the qkv GEMV, then the Triton RoPE +
append kernel), on a model with the decoder's real widths (the CUDA GEMV takes those shapes only) and 2 layers,
random weights and norm gains, bf16 and int8 decode weights.

GPU only (the CUDA GEMV needs sm_90+); on the CPU the choice itself is checked: the fused form is never taken.

Exactness. Both forms compute each projection row with the same sums in the same order and round RoPE's products
and sums the same way, so the step's hidden state and every KV slot are bit-identical; only the step's slot of
its cache row is written (the caches start random, never zero). The step replayed from a CUDA graph with PDL
equals the same step launched eagerly without PDL, bit for bit (a difference would be a missed wait).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from glmasr.models import fast_decoder
from glmasr_kernels import cuda_gemv

from conftest import gpu_only

BF = torch.bfloat16


def _full_width_model(decode_weights: str):
    """A 2-layer decoder with GLM-ASR-Nano's widths (hidden 2048, 16 + 4 heads of 128, MLP 6144) behind the tiny
    encoder, random weights, norm gains around 1."""
    from glmasr.checkpoint.random_weights import config_path
    from glmasr.models.config import GlmAsrConfig
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr.models.glmasr import GlmAsrModel

    data = json.loads(config_path("tiny-random").read_text())
    full = json.loads(config_path("glm-asr-nano-2512").read_text())["text_config"]
    data["text_config"] = {**full, "num_hidden_layers": 2, "vocab_size": 512, "eos_token_id": [1]}
    torch.manual_seed(0)
    ref = GlmAsrModel(GlmAsrConfig.from_dict(data)).to("cuda", BF).eval()
    with torch.no_grad():
        for layer in ref.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.2 * torch.randn_like(norm.weight))
    return FastGlmAsrModel(ref, decode_weights=decode_weights)


@pytest.fixture(scope="module", params=["bf16", "int8"])
def model(request):
    if not (torch.cuda.is_available() and cuda_gemv.is_available("cuda")):
        pytest.skip("the CUDA GEMV needs a CUDA device of compute capability >= 9.0 and cuda-bindings")
    return _full_width_model(request.param)


def _prefilled(model, n_ctx: int, rows: int = 2):
    from glmasr.models.kv_cache import KVCache

    c = model.cfg.text
    g = torch.Generator(device="cuda").manual_seed(7)
    cache = KVCache(c, rows, 1024, "cuda", BF)
    cache.k.normal_(generator=g)  # never zeros: an untouched slot must stay what it was
    cache.v.normal_(generator=g)
    prompt = torch.randn(1, n_ctx, c.hidden_size, device="cuda", generator=g).to(BF)
    model.decode(prompt, torch.arange(n_ctx, device="cuda")[None], cache, kv_len=n_ctx,
                 rows=torch.tensor([1], device="cuda"))
    return cache, torch.randn(1, 1, c.hidden_size, device="cuda", generator=g).to(BF)


def _step(model, cache, x, pos: int, fused: bool, monkeypatch, kv_len=1024):
    monkeypatch.setattr(fast_decoder, "QKV_ROPE_WEIGHTS", frozenset({"bf16", "int8"} if fused else ()))
    # torch.full: a fill kernel, no host-to-device copy, so the step can be captured in a graph
    return model.decode(x, torch.full((1, 1), pos, device="cuda"), cache, kv_len=kv_len,
                        rows=torch.full((1,), 1, device="cuda"))


def _spy(monkeypatch):
    calls = []
    real = cuda_gemv.gemv_qkv_rope

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cuda_gemv, "gemv_qkv_rope", spy)
    return calls


@gpu_only
def test_rope_in_qkv_equals_the_unfused_step(model, monkeypatch):
    n_ctx = 40
    cache, x = _prefilled(model, n_ctx)
    other = copy.copy(cache)
    other.k, other.v = cache.k.clone(), cache.v.clone()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    calls = _spy(monkeypatch)
    fused = _step(model, cache, x, n_ctx, True, monkeypatch)
    assert len(calls) == model.cfg.text.num_hidden_layers, "the fused form was not taken"
    calls.clear()
    plain = _step(model, other, x, n_ctx, False, monkeypatch)
    assert calls == []
    torch.cuda.synchronize()
    assert torch.isfinite(fused.float()).all()
    assert torch.equal(fused, plain)
    for got, want, before in ((cache.k, other.k, before_k), (cache.v, other.v, before_v)):
        assert torch.equal(got, want)
        slot = torch.zeros(got.shape[1], got.shape[3], dtype=torch.bool, device="cuda")
        slot[1, n_ctx] = True  # row 1, the step's position: the only slot the step writes
        assert torch.equal(got.permute(1, 3, 0, 2, 4)[~slot], before.permute(1, 3, 0, 2, 4)[~slot])
        assert not torch.equal(got[:, 1, :, n_ctx], before[:, 1, :, n_ctx])


@gpu_only
def test_fused_step_in_a_pdl_graph_equals_plain_launches(model, monkeypatch):
    from glmasr_kernels import _triton_utils

    n_ctx = 300
    cache, x = _prefilled(model, n_ctx)
    start_k, start_v = cache.k.clone(), cache.v.clone()
    try:
        _triton_utils.set_pdl(False)
        plain = _step(model, cache, x, n_ctx, True, monkeypatch).clone()
        plain_k, plain_v = cache.k.clone(), cache.v.clone()
        _triton_utils.set_pdl(True)
        cache.k.copy_(start_k)
        cache.v.copy_(start_v)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _step(model, cache, x, n_ctx, True, monkeypatch)  # warm-up (builds the PDL launches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _step(model, cache, x, n_ctx, True, monkeypatch)
        for _ in range(3):
            cache.k.copy_(start_k)
            cache.v.copy_(start_v)
            static.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
    finally:
        _triton_utils.set_pdl(None)
    assert torch.equal(static, plain)
    assert torch.equal(cache.k, plain_k) and torch.equal(cache.v, plain_v)


@gpu_only
def test_batches_and_invariant_steps_stay_unfused(model, monkeypatch):
    monkeypatch.setattr(fast_decoder, "QKV_ROPE_WEIGHTS", frozenset({"bf16", "int8"}))
    from glmasr.models.kv_cache import KVCache

    c = model.cfg.text
    cache = KVCache(c, 2, 64, "cuda", BF)
    calls = _spy(monkeypatch)
    x = torch.randn(2, 1, c.hidden_size, device="cuda").to(BF)
    model.decode(x, torch.tensor([[3], [5]], device="cuda"), cache, kv_len=64)
    model.batch_invariant = True
    try:
        model.decode(x[:1], torch.tensor([[3]], device="cuda"), cache, kv_len=64)
    finally:
        model.batch_invariant = False
    assert calls == []


def test_cpu_never_takes_the_fused_layer(tiny_shipped, monkeypatch):
    """The Triton path under the interpreter (the tiny model): the fused form needs CUDA; the step runs unfused."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the CPU case: TRITON_INTERPRET=1 without a GPU")
    import glmasr
    from glmasr.models.fast import FastGlmAsrModel
    from glmasr.models.kv_cache import KVCache

    fast = FastGlmAsrModel(glmasr.load(tiny_shipped, device="cpu", backend="torch").model)
    c = fast.cfg.text
    assert not fast.decoder._rope_in_qkv(torch.zeros(1, 1, c.hidden_size, dtype=BF), False)
    calls = _spy(monkeypatch)
    cache = KVCache(c, 1, 16, "cpu", torch.float32)
    out = fast.decode(torch.randn(1, 1, c.hidden_size), torch.tensor([[0]]), cache, kv_len=16)
    assert calls == [] and torch.isfinite(out).all()
