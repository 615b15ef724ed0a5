"""Checkpoint loading: both key layouts, shards, tying, and errors that name the tensors."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import glmasr
from glmasr.weights import CheckpointError, canonical_name, resolve_checkpoint


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def tensors(folder):
    return load_file(str(folder / "model.safetensors"))


def test_both_layouts_give_identical_parameters(tiny_shipped, tiny_transformers):
    with safe_open(str(tiny_shipped / "model.safetensors"), "pt") as f:
        assert "language_model.lm_head.weight" in f.keys() and "audio_tower.conv1.weight" in f.keys()
    with safe_open(str(tiny_transformers / "model.safetensors"), "pt") as f:
        assert "model.audio_tower.conv1.weight" in f.keys() and "lm_head.weight" not in f.keys()
    a = glmasr.load(tiny_shipped, device="cpu").model.state_dict()
    b = glmasr.load(tiny_transformers, device="cpu").model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("key,name", [
    # shipped (the Hub file; transformers 5.24 save_pretrained)
    ("audio_tower.layers.3.self_attn.q_proj.bias", "audio_tower.layers.3.self_attn.q_proj.bias"),
    ("multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.weight"),
    ("language_model.model.layers.0.mlp.up_proj.weight", "language_model.layers.0.mlp.up_proj.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    # transformers 5.17 save_pretrained: the decoder one level deeper
    ("language_model.model.model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    ("language_model.model.model.norm.weight", "language_model.norm.weight"),
    # transformers' runtime names
    ("model.audio_tower.conv1.weight", "audio_tower.conv1.weight"),
    ("model.multi_modal_projector.linear_2.bias", "multi_modal_projector.linear_2.bias"),
    ("model.language_model.layers.1.self_attn.k_proj.weight", "language_model.layers.1.self_attn.k_proj.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("vision_tower.patch_embed.weight", None),
])
def test_canonical_names_of_every_layout(key, name):
    assert canonical_name(key) == name


def test_missing_lm_head_is_tied_to_embeddings(tiny_transformers):
    m = glmasr.load(tiny_transformers, device="cpu").model
    assert m.lm_head.weight.data_ptr() == m.language_model.embed_tokens.weight.data_ptr()


def test_default_dtype_and_explicit_dtype(tiny_shipped):
    assert glmasr.load(tiny_shipped, device="cpu").dtype == torch.float32
    assert glmasr.load(tiny_shipped, device="cpu", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        glmasr.load(tiny_shipped, device="cpu", dtype="int8")


def test_sharded_checkpoint_with_index(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "sharded")
    state = tensors(folder)
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(folder / name))
        weight_map.update({k: name for k in ks})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = glmasr.load(tiny_shipped, device="cpu").model.state_dict()
    got = glmasr.load(folder, device="cpu").model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_missing_tensor_is_named(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "missing")
    state = tensors(folder)
    del state["audio_tower.layers.1.mlp.fc2.bias"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): audio_tower\.layers\.1\.mlp\.fc2\.bias"):
        glmasr.load(folder, device="cpu")


def test_mis_shaped_tensor_is_named(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "shape")
    state = tensors(folder)
    state["language_model.model.layers.0.self_attn.k_proj.weight"] = torch.randn(3, 32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_proj\.weight: file \(3, 32\), model \(16, 32\)"):
        glmasr.load(folder, device="cpu")


def test_unexpected_tensor_is_named(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "extra")
    state = tensors(folder)
    state["audio_tower.mystery.weight"] = torch.randn(2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): audio_tower\.mystery\.weight"):
        glmasr.load(folder, device="cpu")


def test_unused_whisper_position_table_is_ignored(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "posemb")
    state = tensors(folder)
    state["audio_tower.embed_positions.weight"] = torch.randn(1500, 64)
    save_file(state, str(folder / "model.safetensors"))
    glmasr.load(folder, device="cpu")


def test_wrong_folder_layouts(tiny_shipped, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        glmasr.load(tmp_path, device="cpu")
    folder = copy_checkpoint(tiny_shipped, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        glmasr.load(folder, device="cpu")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        glmasr.load(folder, device="cpu")
    with pytest.raises(CheckpointError, match="is a file"):
        glmasr.load(folder / "config.json", device="cpu")


@pytest.mark.parametrize("device", ["tpu", "cuda:banana", "npu:0"])
def test_unknown_device(tiny_shipped, device):
    with pytest.raises(ValueError, match="device"):
        glmasr.load(tiny_shipped, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda(tiny_shipped):
    with pytest.raises(ValueError, match="CUDA is not available"):
        glmasr.load(tiny_shipped, device="cuda")


def test_offline_hub_id_error_names_both_ways_out(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("someone/not-cached-model")
    assert "local checkpoint folder" in str(e.value) and "tiny-random" in str(e.value)


def test_not_a_path_nor_hub_id():
    with pytest.raises(CheckpointError, match="neither an existing folder"):
        resolve_checkpoint("/definitely/not/here")
