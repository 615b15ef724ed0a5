"""Checkpoint loading: both key layouts, shards, tying, and errors that name the tensors."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import glmasr
from glmasr.checkpoint.weights import CheckpointError, canonical_name, resolve_checkpoint


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


def test_offline_hub_id_error_names_both_ways_out(hub_offline):
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("someone/not-cached-model")
    assert "local checkpoint folder" in str(e.value) and "tiny-random" in str(e.value)


def test_not_a_path_nor_hub_id():
    with pytest.raises(CheckpointError, match="neither an existing folder"):
        resolve_checkpoint("/definitely/not/here")


# ---- the chunked reader (the CUDA loading path, run here on the CPU into plain staging buffers) ----

from glmasr.checkpoint import weights  # noqa: E402
from glmasr.models.glmasr import GlmAsrModel  # noqa: E402


def meta_model(folder):
    with torch.device("meta"):
        return GlmAsrModel(weights.read_config(folder))


def bits(t):
    """The tensor's bytes, for bit-exact comparison (NaN payloads and signed zeros included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


def shard(folder, state, parts=3):
    """Rewrite ``folder``'s weights as ``parts`` shards + index (keys interleaved over the shards)."""
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    weight_map = {}
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        mine = keys[i::parts]
        save_file({k: state[k] for k in mine}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in mine})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 bytes (not a multiple of any element size: tensors split mid-element across chunks and
    chunks span several tensors), each read by several threads in pieces of >= 256 bytes."""
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(weights, "_MIN_READ_PIECE", 256)
    monkeypatch.setattr(weights, "READ_THREADS", 3)


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
@pytest.mark.parametrize("chunking", ["default-chunks", "small-chunks"])
def test_chunked_reader_equals_safe_open(tmp_path, request, file_dtype, sharded, chunking):
    if chunking == "small-chunks":
        request.getfixturevalue("small_chunks")
    from glmasr.checkpoint.random_weights import build_checkpoint

    folder = build_checkpoint(tmp_path / "ckpt", size="tiny", layout="shipped", seed=3, dtype=file_dtype)
    if sharded:
        shard(folder, tensors(folder))
    model = meta_model(folder)
    for target in (file_dtype, torch.float32, torch.bfloat16):
        ref = weights.load_state_dict(folder, model, torch.device("cpu"), target, reader="safe_open")
        got = weights.load_state_dict(folder, model, torch.device("cpu"), target, reader="chunked")
        assert_bit_identical(got, ref)
        assert all(t.dtype == target for t in got.values())
        # every tensor has its own storage (a view into a shared buffer would pin the whole file in memory)
        assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got)


def write_in_order(state: dict, path):
    """A safetensors file with the tensors in ``state``'s order, unpadded (save_file sorts them by alignment)."""
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, blobs, pos = {}, [], 0
    for k, t in state.items():
        raw = bytes(bits(t).numpy())
        header[k] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_mixed_dtypes_and_unaligned_offsets_in_one_file(tmp_path, small_chunks):
    """fp32, bf16 and fp16 tensors of odd sizes in one file (so tensor data starts at offsets that are not a
    multiple of the element size), read in each tensor's own dtype: the same bits as safe_open."""
    g = torch.Generator().manual_seed(5)
    state = {}
    for i, (dt, n) in enumerate([(torch.bfloat16, 3), (torch.float32, 7), (torch.float16, 5), (torch.float32, 1),
                                 (torch.bfloat16, 1001), (torch.float16, 2), (torch.float32, 513)]):
        state[f"t{i}"] = (torch.randn(n, generator=g) * 100).to(dt)
    state["t2"][1] = float("nan")
    state["t3"][0] = -0.0
    state["scalar"] = torch.tensor(2.5, dtype=torch.float16)
    state["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    path = tmp_path / "mixed.safetensors"
    write_in_order(state, path)
    entries = weights.read_header(path)
    assert {e.dtype for e in entries.values()} == {torch.float32, torch.bfloat16, torch.float16}
    assert any(e.begin % e.dtype.itemsize for e in entries.values())  # really unaligned
    for threads in (1, 4):
        got = weights.stream_tensors(entries, torch.device("cpu"), None, threads=threads)
        with safe_open(str(path), "pt") as f:
            ref = {k: f.get_tensor(k) for k in f.keys()}
        assert_bit_identical(got, ref)


def test_truncated_file_is_a_clear_error(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "cut")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    for reader in ("chunked", "safe_open"):
        with pytest.raises(CheckpointError, match=r"model\.safetensors: the file is truncated \(tensor '.*' ends "
                                                  r"at byte \d+, the file has \d+ bytes\)"):
            weights.load_state_dict(folder, meta_model(folder), torch.device("cpu"), torch.float32, reader=reader)
    with pytest.raises(CheckpointError, match="truncated"):
        glmasr.load(folder, device="cpu")
    path.write_bytes(data[:20])  # inside the header
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors: not a safetensors file or truncated"):
        glmasr.load(folder, device="cpu")


def test_truncated_shard_is_named(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "cutshard")
    shard(folder, tensors(folder))
    victim = folder / "model-00002-of-00003.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: the file is truncated"):
        glmasr.load(folder, device="cpu")


def test_file_shrinking_while_loading_is_named(tiny_shipped, tmp_path):
    """The headers were checked, then the file lost its tail before the data was read."""
    folder = copy_checkpoint(tiny_shipped, tmp_path / "shrink")
    path = folder / "model.safetensors"
    entries = weights.read_header(path)
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors: the file ends at byte \d+"):
        weights.stream_tensors(entries, torch.device("cpu"), torch.float32)


def test_index_naming_a_tensor_its_shard_lacks(tiny_shipped, tmp_path):
    folder = copy_checkpoint(tiny_shipped, tmp_path / "badindex")
    shard(folder, tensors(folder))
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = "audio_tower.conv1.weight"
    other = next(f for f in set(data["weight_map"].values()) if f != data["weight_map"][key])
    data["weight_map"][key] = other
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"maps tensor '{key}' to {other}, which does not hold it"):
        glmasr.load(folder, device="cpu")


@pytest.mark.parametrize("reader", ["chunked", "safe_open"])
def test_load_timings_are_reported(tiny_shipped, reader):
    t = {}
    state = weights.load_state_dict(tiny_shipped, meta_model(tiny_shipped), torch.device("cpu"), torch.float32,
                                    timings=t, reader=reader)
    assert set(t) == {"weights_read_ms", "weights_to_device_ms", "weights_total_ms", "weights_bytes"}
    assert all(v >= 0 for v in t.values()) and t["weights_read_ms"] <= t["weights_total_ms"]
    assert t["weights_bytes"] == sum(e.nbytes for e in weights.safetensors_entries(tiny_shipped).values())
    assert len(state) == len(weights.safetensors_entries(tiny_shipped))


def test_unknown_reader(tiny_shipped):
    with pytest.raises(ValueError, match="unknown weights reader"):
        weights.load_state_dict(tiny_shipped, meta_model(tiny_shipped), torch.device("cpu"), torch.float32,
                                reader="mmap")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float32])
def test_cuda_chunked_reader_equals_safe_open(tmp_path, small_chunks, target):
    """Pinned staging, double-buffered non-blocking copies, casts on the GPU: the same bits as safe_open."""
    from glmasr.checkpoint.random_weights import build_checkpoint

    folder = build_checkpoint(tmp_path / "ckpt", size="tiny", layout="shipped", seed=4)
    shard(folder, tensors(folder))
    model = meta_model(folder)
    dev = torch.device("cuda")
    t = {}
    ref = weights.load_state_dict(folder, model, dev, target, reader="safe_open")
    got = weights.load_state_dict(folder, model, dev, target, reader="chunked", timings=t)
    assert_bit_identical(got, ref)
    assert all(v.device.type == "cuda" for v in got.values())
    assert t["weights_to_device_ms"] > 0


def test_file_of_empty_tensors_only(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_in_order({"a": torch.zeros(0, 3), "b": torch.zeros(2, 0, dtype=torch.bfloat16)}, path)
    got = weights.stream_tensors(weights.read_header(path), torch.device("cpu"), None)
    assert got["a"].shape == (0, 3) and got["b"].shape == (2, 0) and got["b"].dtype == torch.bfloat16
