import json

import pytest

from glmasr.models.config import ConfigError, GlmAsrConfig
from glmasr.checkpoint.random_weights import config_path


def test_real_config_parses_with_spec_values():
    cfg = GlmAsrConfig.from_json_file(config_path("glm-asr-nano-2512"))
    assert (cfg.audio.hidden_size, cfg.audio.num_hidden_layers, cfg.audio.num_attention_heads) == (1280, 32, 20)
    assert (cfg.audio.head_dim, cfg.audio.rotary_dim, cfg.audio.layer_norm_eps) == (64, 32, 1e-5)
    assert (cfg.text.hidden_size, cfg.text.num_hidden_layers, cfg.text.num_key_value_heads) == (2048, 28, 4)
    assert cfg.text.eos_token_ids == (59246, 59253, 59255)
    assert cfg.audio_token_id == 59260 and cfg.merged_width == 5120 and cfg.projector_hidden == 4096


def test_defaults_fill_missing_fields():
    cfg = GlmAsrConfig.from_dict({"model_type": "glmasr"})
    assert cfg.text.max_position_embeddings == 8192 and cfg.audio.rope_theta == 10000.0


def test_flat_v4_rope_keys_are_accepted():
    cfg = GlmAsrConfig.from_dict({"audio_config": {"rope_theta": 500.0, "partial_rotary_factor": 0.25},
                                  "text_config": {"rope_theta": 1e6}})
    assert cfg.audio.rope_theta == 500.0 and cfg.audio.rotary_dim == 16 and cfg.text.rope_theta == 1e6


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "whisper"}, "model_type"),
    ({"text_config": {"hidden_act": "gelu"}}, "hidden_act"),
    ({"text_config": {"rope_parameters": {"rope_type": "yarn"}}}, "rope_type"),
    ({"audio_config": {"intermediate_size": 1000}}, "intermediate_size"),
    ({"text_config": {"num_attention_heads": 6, "num_key_value_heads": 4}}, "multiple"),
    ({"text_config": {"num_hidden_layers": 0}}, "num_hidden_layers"),
    ({"audio_token_id": 10 ** 6}, "audio_token_id"),
])
def test_bad_configs_name_the_field(patch, message):
    with pytest.raises(ConfigError, match=message):
        GlmAsrConfig.from_dict(patch)


def test_invalid_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        GlmAsrConfig.from_json_file(p)


def test_tiny_config_matches_its_json():
    data = json.loads(config_path("tiny-random").read_text())
    cfg = GlmAsrConfig.from_dict(data)
    assert cfg.audio.hidden_size == 64 and cfg.text.head_dim == 8 and cfg.text.num_key_value_heads == 2
