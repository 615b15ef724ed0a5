"""Configs a kernel cannot serve: the part concerned falls back to the plain path at load, with one warning.

``kernel_support`` (models/kernel_support.py) is checked on configs alone (no weights: some violations need
sizes far beyond a CPU test) for each constraint of the kernels the GPU path launches. The load-time fallback runs end to end under
TRITON_INTERPRET=1 on tiny checkpoints: a decoder head_dim that is not a power of two (a real tiny violation),
and, for the limits only huge configs reach (norm widths, Triton's block cap), the same tiny model with the
limit lowered (the module constants ``kernel_support`` reads; a test below pins them to the kernels' checks).
Tokens must equal backend="torch" on the same weights.
"""

import os
import warnings

import pytest
import torch

import glmasr
from glmasr.models.config import AudioEncoderConfig, GlmAsrConfig, TextDecoderConfig
from glmasr.checkpoint.random_weights import CHAT_TEMPLATE, build_tokenizer, make_config

from conftest import noise

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                   reason="needs CUDA, or TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
fast = pytest.importorskip("glmasr.models.fast")
ks = pytest.importorskip("glmasr.models.kernel_support")


def config(audio=None, text=None) -> GlmAsrConfig:
    a = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, head_dim=16)
    t = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, eos_token_ids=(256,))
    a.update(audio or {})
    t.update(text or {})
    return GlmAsrConfig(audio=AudioEncoderConfig(**a), text=TextDecoderConfig(**t), audio_token_id=263)


def test_real_and_tiny_configs_are_fully_supported(tiny_shipped):
    from glmasr.checkpoint.random_weights import config_path

    for cfg in (GlmAsrConfig.from_json_file(config_path("glm-asr-nano-2512")), config(),
                GlmAsrConfig.from_json_file(tiny_shipped / "config.json")):
        assert fast.kernel_support(cfg) == {"frontend": None, "encoder": None, "decoder": None}


@pytest.mark.parametrize("audio,text,part,needles", [
    ({}, {"head_dim": 12}, "decoder", ["text_config.head_dim = 12", "power of two", "decode_attention"]),
    ({}, {"head_dim": 96, "num_attention_heads": 16, "num_key_value_heads": 4}, "decoder",
     ["text_config.head_dim = 96", "power of two"]),
    ({}, {"hidden_size": 32776}, "decoder", ["text_config.hidden_size = 32776", "RMSNorm", "32768"]),
    ({"hidden_size": 32800, "intermediate_size": 131200, "num_attention_heads": 4, "head_dim": 8200}, {},
     "encoder", ["audio_config.hidden_size = 32800", "LayerNorm", "32768"]),
    # (only reachable together with the LayerNorm limit: heads * head_dim = hidden_size)
    ({"hidden_size": 8192 * 1024, "intermediate_size": 4 * 8192 * 1024, "num_attention_heads": 8192,
      "head_dim": 1024}, {}, "encoder",
     ["audio_config.num_attention_heads = 8192 with rotary dim 512", "RoPE", "2097152 elements", "LayerNorm"]),
    ({}, {"num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1024}, "decoder",
     ["text_config.num_attention_heads = 4096 with head_dim 1024", "RoPE", "2097152 elements exceeds Triton"]),
    ({}, {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32768}, "decoder",
     ["text_config.head_dim = 32768", "decode attention", "tile of 2097152 elements"]),
    ({"num_mel_bins": 64}, {}, "frontend", ["audio_config.num_mel_bins = 64", "kernels/logmel", "80 or 128"]),
    ({"hidden_size": 96, "num_attention_heads": 4, "head_dim": 24}, {}, "encoder",
     ["audio_config.head_dim = 24", "encoder attention", "power of two"]),
], ids=["head-dim-12", "head-dim-96", "rmsnorm-width", "layernorm-width", "encoder-rope-block", "decoder-rope-block",
        "decode-attention-tile", "mel-bins", "encoder-head-dim-24"])
def test_each_kernel_constraint_is_reported(audio, text, part, needles):
    support = fast.kernel_support(config(audio, text))
    assert support[part] is not None
    for needle in needles:
        assert needle in support[part], support[part]
    assert all(r is None for p, r in support.items() if p != part), support


def test_several_reasons_of_one_part_are_joined():
    reason = fast.kernel_support(config(text={"head_dim": 12, "hidden_size": 40000}))["decoder"]
    assert "head_dim = 12" in reason and "hidden_size = 40000" in reason and "; " in reason


@needs_kernels
def test_limits_are_the_kernels_own_checks():
    """NORM_MAX_WIDTH is where the norm launchers start refusing a row; decode attention refuses head_dim 12."""
    from glmasr_kernels.decode_attention import decode_attention
    from glmasr_kernels.layernorm import layer_norm
    from glmasr_kernels.rmsnorm import rms_norm

    n = ks.NORM_MAX_WIDTH
    x = torch.randn(1, n + 1, device=DEVICE)
    w = torch.ones(n + 1, device=DEVICE)
    with pytest.raises(ValueError, match="32768"):
        rms_norm(x, w)
    with pytest.raises(ValueError, match="32768"):
        layer_norm(x, w, w)
    y = rms_norm(x[:, :n].contiguous(), w[:n])
    assert torch.isfinite(y).all()
    assert torch.isfinite(layer_norm(x[:, :n].contiguous(), w[:n], w[:n])).all()
    q = torch.randn(1, 4, 12, device=DEVICE)
    kv = torch.randn(1, 2, 16, 12, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, kv, kv, torch.tensor([3], device=DEVICE))
    from glmasr_kernels.encoder_attention import encoder_attention

    with pytest.raises(ValueError, match="power of two"):
        encoder_attention(torch.randn(1, 8, 3, 2, 24, device=DEVICE))
    import triton.language as tl

    assert ks.TILE_MAX_NUMEL == tl.TRITON_MAX_TENSOR_NUMEL


def tiny_checkpoint(folder, audio=None, text=None, seed=0):
    """A tiny random checkpoint with config overrides, written by transformers' save_pretrained."""
    from transformers import GlmAsrForConditionalGeneration, GlmAsrProcessor, WhisperFeatureExtractor

    tokenizer = build_tokenizer(None)
    cfg = make_config("tiny-random", tokenizer)
    for section, overrides in ((cfg.audio_config, audio), (cfg.text_config, text)):
        for k, v in (overrides or {}).items():
            setattr(section, k, v)
    torch.manual_seed(seed)
    GlmAsrForConditionalGeneration(cfg).eval().save_pretrained(str(folder))
    GlmAsrProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer,
                    chat_template=CHAT_TEMPLATE).save_pretrained(str(folder))
    return folder


def load_triton(folder):
    """glmasr.load(backend="triton") recording the fallback warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asr = glmasr.load(folder, device=DEVICE, dtype="float32", backend="triton")
    return asr, [w for w in caught if issubclass(w.category, fast.KernelFallbackWarning)]


def assert_same_tokens_as_torch(asr, folder):
    ref = glmasr.load(folder, device=DEVICE, dtype="float32", backend="torch")
    audios = [noise(1.5, 31), noise(5.0, 32)]
    a = glmasr.transcribe(audios, model=asr, sampling_rate=16000, max_new_tokens=6)
    b = glmasr.transcribe(audios, model=ref, sampling_rate=16000, max_new_tokens=6)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


@needs_kernels
def test_supported_config_loads_without_warning(tiny_shipped):
    asr, caught = load_triton(tiny_shipped)
    assert caught == []
    m = asr.model
    assert isinstance(m, fast.FastGlmAsrModel) and m.triton_encoder and m.triton_decoder and m.fallbacks == {}
    assert len(m.encoder.layers) == len(m.decoder.layers) == 2


@needs_kernels
def test_decoder_head_dim_not_a_power_of_two_falls_back(tmp_path):
    """head_dim 12: decode attention cannot run it (before: a bare ValueError mid-transcribe)."""
    folder = tiny_checkpoint(tmp_path, text={"head_dim": 12})
    asr, caught = load_triton(folder)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "decoder" in msg and "text_config.head_dim = 12" in msg and "power of two" in msg
    m = asr.model
    assert not m.triton_decoder and set(m.fallbacks) == {"decoder"} and m.decoder is None
    assert m.triton_encoder and len(m.encoder.layers) == 2  # the encoder still runs on the kernels
    assert_same_tokens_as_torch(asr, folder)


@needs_kernels
def test_encoder_fallback(tmp_path, monkeypatch):
    """Encoder LayerNorm width over the limit (64 > 48 here; the real limit 32768 needs a multi-GB encoder)."""
    folder = tiny_checkpoint(tmp_path)
    monkeypatch.setattr(ks, "NORM_MAX_WIDTH", 48)  # decoder hidden 32 still fits
    asr, caught = load_triton(folder)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "encoder" in msg and "audio_config.hidden_size = 64" in msg and "LayerNorm" in msg
    m = asr.model
    assert m.triton_decoder and not m.triton_encoder and set(m.fallbacks) == {"encoder"} and m.encoder is None
    assert len(m.decoder.layers) == 2
    assert_same_tokens_as_torch(asr, folder)


@needs_kernels
def test_both_parts_fall_back_with_one_warning_each(tmp_path, monkeypatch):
    folder = tiny_checkpoint(tmp_path, text={"head_dim": 12})
    monkeypatch.setattr(ks, "TILE_MAX_NUMEL", 8)  # every RoPE block (4 heads x 4 dims = 16) is now too big
    asr, caught = load_triton(folder)
    assert len(caught) == 2
    enc, dec = (str(w.message) for w in caught)
    assert enc.startswith("GLM-ASR encoder") and "RoPE" in enc
    assert dec.startswith("GLM-ASR decoder") and "head_dim = 12" in dec and "RoPE" in dec
    m = asr.model
    assert not (m.triton_encoder or m.triton_decoder) and set(m.fallbacks) == {"encoder", "decoder"}
    assert_same_tokens_as_torch(asr, folder)
