"""Checkpoints written by transformers' own ``save_pretrained`` load and give transformers' outputs.

(a) With the pinned transformers: a tiny random ``GlmAsrForConditionalGeneration`` is built and saved here by
    transformers itself (one file, and sharded with a small ``max_shard_size``; tied and untied lm head), then
    loaded with ``glmasr.load``; greedy tokens and teacher-forced logits must equal that transformers model's on
    fresh random audio.
(b) ``tests/fixtures/tiny-random-transformers-5.24``: the same kind of checkpoint written by the newest
    transformers release (see its README.md); it must load and give the logits that the pinned transformers
    computes from those weights.

fp32 on CPU: both sides compute the same function, so the logits differ only by rounding (observed ~1e-7
relative); 1e-5 relative to the largest logit leaves room for BLAS summation order.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import glmasr
from glmasr.pipeline import teacher_forced_logits
from glmasr.checkpoint.random_weights import CHAT_TEMPLATE, build_tokenizer, make_config
from glmasr.checkpoint.weights import canonical_name

from conftest import noise
from test_end_to_end import assert_same_greedy_tokens, hf_generate

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-random-transformers-5.24"
MAX_NEW = 16


def saved_keys(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def transformers_checkpoint(folder: Path, tied: bool, max_shard_size=None, seed: int = 0):
    """Build a tiny random GLM-ASR with transformers and let transformers write it (weights, config, tokenizer,
    processor). Returns (processor, model): the oracle, exactly the model that was saved."""
    from transformers import GlmAsrForConditionalGeneration, GlmAsrProcessor, WhisperFeatureExtractor

    tokenizer = build_tokenizer(None)
    cfg = make_config("tiny-random", tokenizer)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = GlmAsrForConditionalGeneration(cfg).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    processor = GlmAsrProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(folder))
    return processor, model


def reference_logits(oracle, audio, forced):
    processor, model = oracle
    inputs = processor.apply_transcription_request([audio])
    ids = torch.cat([inputs["input_ids"], torch.tensor([forced])], dim=1)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=inputs["input_features"],
                    input_features_mask=inputs["input_features_mask"]).logits[0]
    return out[inputs["input_ids"].shape[1] - 1:], inputs["input_ids"][0].tolist()


def assert_matches_oracle(asr, oracle, seed: int):
    audio = noise(3.5, seed)
    forced = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    ours, prompt_ids = teacher_forced_logits(asr, audio, forced, sampling_rate=16000)
    ref, ref_prompt = reference_logits(oracle, audio, forced)
    assert prompt_ids == ref_prompt
    assert ours.shape == ref.shape
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5
    audios = [audio, noise(40.0, seed + 1)]
    expected = hf_generate(oracle, audios, max_new_tokens=MAX_NEW)
    results = glmasr.transcribe(audios, model=asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    for r, (ids, _), a in zip(results, expected, audios):
        assert_same_greedy_tokens(r.token_ids, ids, oracle, a)


@pytest.mark.parametrize("tied,max_shard_size", [(True, None), (True, "100KB"), (False, "100KB")],
                         ids=["single-file", "sharded", "sharded-untied-lm-head"])
def test_pinned_transformers_save_pretrained_loads(tmp_path, tied, max_shard_size):
    import transformers

    oracle = transformers_checkpoint(tmp_path, tied, max_shard_size)
    keys = saved_keys(tmp_path)
    if max_shard_size is not None:
        assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    # What transformers wrote (not our writer): every key maps onto one of our parameters.
    assert len(keys) == len(oracle[1].state_dict()) - (1 if tied else 0), (transformers.__version__, keys[:5])
    asr = glmasr.load(tmp_path, device="cpu")
    m = asr.model
    shares = m.lm_head.weight.data_ptr() == m.language_model.embed_tokens.weight.data_ptr()
    assert shares == tied
    assert_matches_oracle(asr, oracle, seed=11 if tied else 12)


def test_newest_transformers_fixture_loads_and_matches_pinned_transformers():
    from transformers import AutoProcessor, GlmAsrForConditionalGeneration

    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["transformers_version"] == "5.24.0"  # the README's version; regenerate both together
    assert (FIXTURE / "model.safetensors").stat().st_size < 2_000_000
    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    model = GlmAsrForConditionalGeneration.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    asr = glmasr.load(FIXTURE, device="cpu")
    ours = asr.model.state_dict()
    # Both loaders hold exactly the saved tensors (a key either side skipped would be random, voiding the test).
    for key, t in on_disk.items():
        name = canonical_name(key)
        assert torch.equal(ours[name], t), key
    for key, t in model.state_dict().items():  # transformers' runtime names
        assert torch.equal(ours[canonical_name(key)], t), key
    assert_matches_oracle(asr, (processor, model), seed=21)
