"""The glm-asr-ctc aligner head: its published layout, its math, its loader and the loader's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glmasr.align import CtcAligner, load_head, resolve_head_folder
from glmasr.align.head import CtcHead, CtcHeadConfig, head_config_for
from glmasr.align.random_head import SIZES, build_head_for_checkpoint, build_random_head
from glmasr.checkpoint.resources import config_file
from glmasr.errors import CheckpointError
from glmasr.models.config import GlmAsrConfig

# The published head (JazerJu/glm-asr-ctc, from the training repository's CTCDecoder and its exported
# config.json): a few of its tensors, written out here rather than derived from our own config code.
PUBLISHED = {"linear1.weight": (2048, 1280), "linear1.bias": (2048,), "linear2.weight": (512, 2048),
             "blocks.0.linear_q.weight": (512, 512), "blocks.0.linear_k.bias": (512,),
             "blocks.2.linear_v.weight": (512, 512), "blocks.3.linear_o.bias": (512,),
             "blocks.4.norm1.weight": (512,), "blocks.4.ffn_w1.weight": (128, 512),
             "blocks.4.ffn_w2.weight": (512, 128), "blocks.4.norm2.bias": (512,), "layer_norm.weight": (512,),
             "ctc_lo.weight": (59264, 512),
             "ctc_lo.bias": (59264,)}
PUBLISHED_PARAMS = 39_997_952  # "40 M" on its model card


def full_size_config() -> CtcHeadConfig:
    enc = GlmAsrConfig.from_json_file(config_file("glm-asr-nano-2512")).audio.hidden_size
    return head_config_for(enc, 59263)  # the GLM tokenizer has 59263 tokens: blank 59263, 59264 classes


def reference_logits(head: CtcHead, states: torch.Tensor) -> torch.Tensor:
    """The head's math written out with plain matmuls (no SDPA, no nn modules' forward)."""
    c = head.config
    p = dict(head.named_parameters())

    def lin(x, name):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    def ln(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * p[f"{name}.weight"] + p[f"{name}.bias"]

    def gelu(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    x = gelu(lin(gelu(lin(states, "linear1")), "linear2"))
    for i in range(c.num_blocks):
        b = f"blocks.{i}"
        t, d = x.shape[-2], c.ctc_hidden // c.num_heads
        q, k, v = (lin(x, f"{b}.linear_{n}").view(-1, t, c.num_heads, d).transpose(1, 2) for n in "qkv")
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        a = (w @ v).transpose(1, 2).reshape(-1, t, c.ctc_hidden)
        x = ln(x + lin(a, f"{b}.linear_o"), f"{b}.norm1")
        x = ln(x + lin(gelu(lin(x, f"{b}.ffn_w1")), f"{b}.ffn_w2"), f"{b}.norm2")
    return lin(ln(x, "layer_norm"), "ctc_lo")


def small_config(**fields) -> CtcHeadConfig:
    return head_config_for(64, 263, **{**SIZES["small"], **fields})


def test_full_size_head_has_the_published_layout():
    cfg = full_size_config()
    with torch.device("meta"):
        head = CtcHead(cfg)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    for key, shape in PUBLISHED.items():
        assert shapes[key] == shape, key
    assert sum(v.numel() for v in head.parameters()) == PUBLISHED_PARAMS
    assert len(shapes) == 4 + 5 * 16 + 4  # linear1/2, five blocks of 8 layers x (weight, bias), layer_norm, ctc_lo
    assert cfg.blank_id == 59263 and cfg.vocab_size == 59264


def test_head_math_matches_a_plain_reference():
    torch.manual_seed(1)
    head = CtcHead(small_config()).eval()
    for p in head.parameters():  # fresh, non-default values everywhere (norm weights are ones by default)
        p.data.normal_(0, 0.3)
    states = torch.randn(2, 37, 64)
    with torch.no_grad():
        torch.testing.assert_close(head(states), reference_logits(head, states), rtol=1e-4, atol=1e-4)
        # token_log_probs: the log-softmax over all classes, kept for some, computed a few frames at a time
        classes = torch.tensor([262, 5, 100, 7])
        full = F.log_softmax(head(states[:1])[0], dim=-1)[:, classes]
        torch.testing.assert_close(head.token_log_probs(states[0], classes, chunk=5), full, rtol=1e-5, atol=1e-5)


def test_use_blocks_false_skips_the_blocks():
    torch.manual_seed(2)
    head = CtcHead(small_config(use_blocks=False)).eval()
    states = torch.randn(1, 9, 64)
    with torch.no_grad():
        x = F.gelu(head.linear2(F.gelu(head.linear1(states))))
        torch.testing.assert_close(head(states), head.ctc_lo(head.layer_norm(x)))


def test_full_size_head_runs_on_encoder_output_shapes():
    """One 30 s window of the full-size encoder's output (1500 x 1280) through the full-size head with random
    weights: every frame's posteriors over all 59264 classes sum to one."""
    torch.manual_seed(3)
    cfg = full_size_config()
    head = CtcHead(cfg).eval()
    states = torch.randn(1500, cfg.encoder_dim)
    classes = torch.arange(cfg.vocab_size)
    with torch.no_grad():
        lp = head.token_log_probs(states[:40], classes)
        assert lp.shape == (40, cfg.vocab_size)
        torch.testing.assert_close(torch.logsumexp(lp, dim=1), torch.zeros(40), atol=1e-4, rtol=0)
        some = torch.tensor([cfg.blank_id, 0, 17, 59000])
        out = head.token_log_probs(states, some)
    assert out.shape == (1500, 4) and torch.isfinite(out).all() and (out <= 0).all()


def test_tiny_model_states_fit_a_head_built_for_it(tiny_shipped, tmp_path):
    import glmasr

    folder = build_head_for_checkpoint(tmp_path / "head", tiny_shipped, size="small", seed=4)
    head = load_head(folder)
    asr = glmasr.load(tiny_shipped, device="cpu")
    try:
        feats = torch.randn(2, 128, 501)
        states = asr.model.encode_states(feats)
        assert states.shape == (2, 251, asr.config.audio.hidden_size) == (2, 251, head.config.encoder_dim)
        with torch.no_grad():
            assert head(states).shape == (2, 251, head.config.vocab_size)
    finally:
        asr.close()


def test_loads_the_published_file_names_and_ignores_optimizer_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = small_config()
    a = build_random_head(tmp_path / "a", cfg, seed=5)
    b = build_random_head(tmp_path / "b", cfg, seed=5, weights_name="model.safetensors")
    state = load_file(str(b / "model.safetensors"))
    state["optimizer.state.0.exp_avg"] = torch.randn(3)
    save_file(state, str(b / "model.safetensors"))
    ha, hb = load_head(a), load_head(b)
    for (ka, va), (kb, vb) in zip(ha.state_dict().items(), hb.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert ha.config == cfg


def test_config_fields_missing_are_read_from_the_shapes(tmp_path):
    cfg = small_config(num_heads=8)  # 32 wide, 8 heads: not the default heads either
    folder = build_random_head(tmp_path / "h", cfg, seed=6)
    (folder / "config.json").write_text(json.dumps({"model_type": "ctc-head", "num_heads": 8}))
    got = load_head(folder).config
    assert (got.encoder_dim, got.proj_hidden, got.ctc_hidden, got.num_blocks, got.ffn_hidden, got.vocab_size,
            got.blank_id, got.num_heads) == (64, 64, 32, 2, 16, 264, 263, 8)


def _edit_config(folder: Path, **changes):
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


def _edit_tensors(folder: Path, fn):
    from safetensors.torch import load_file, save_file

    path = folder / "ctc_head.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


@pytest.mark.parametrize("case, expect", [
    ("no_config", "no config.json"),
    ("no_weights", "ctc_head.safetensors or model.safetensors"),
    ("missing_tensor", "missing 1 tensor(s): ['blocks.1.ffn_w2.weight']"),
    ("unexpected_tensor", "unexpected 1 tensor(s): ['blocks.0.extra.weight']"),
    ("extra_block", "num_blocks is 2 but the weights say 3"),
    ("wrong_shape", "tensor 'blocks.0.norm2.bias' has shape [31], expected [32]"),
    ("config_contradicts", "vocab_size is 300 but the weights say 264 (ctc_lo.weight)"),
    ("qwen_family", "'qwen3-asr' encoder"),
    ("frame_rate", "frame_shift_sec 0.076923"),
    ("model_type", "model_type is 'glmasr'"),
    ("bad_json", "cannot read"),
    ("int_tensor", "expected a float type"),
    ("truncated", "truncated"),
    ("heads", "num_heads (5) must divide ctc_hidden (32)"),
])
def test_bad_head_folders_are_named(tmp_path, case, expect):
    folder = build_random_head(tmp_path / "h", small_config(), seed=7)
    weights = folder / "ctc_head.safetensors"
    if case == "no_config":
        (folder / "config.json").unlink()
    elif case == "no_weights":
        weights.unlink()
    elif case == "missing_tensor":
        _edit_tensors(folder, lambda s: s.pop("blocks.1.ffn_w2.weight"))
    elif case == "unexpected_tensor":
        _edit_tensors(folder, lambda s: s.__setitem__("blocks.0.extra.weight", torch.randn(2)))
    elif case == "extra_block":
        _edit_tensors(folder, lambda s: s.update({k.replace("blocks.1.", "blocks.2."): v.clone()
                                                  for k, v in list(s.items()) if k.startswith("blocks.1.")}))
    elif case == "wrong_shape":
        _edit_tensors(folder, lambda s: s.__setitem__("blocks.0.norm2.bias", torch.randn(31)))
    elif case == "config_contradicts":
        _edit_config(folder, vocab_size=300)
    elif case == "qwen_family":
        _edit_config(folder, encoder_family="qwen3-asr")
    elif case == "frame_rate":
        _edit_config(folder, frame_shift_sec=0.076923, frame_rate_hz=13)
    elif case == "model_type":
        _edit_config(folder, model_type="glmasr")
    elif case == "bad_json":
        (folder / "config.json").write_text("{not json")
    elif case == "int_tensor":
        _edit_tensors(folder, lambda s: s.__setitem__("linear1.bias", torch.arange(64)))
    elif case == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 100])
    elif case == "heads":
        _edit_config(folder, num_heads=5)
    with pytest.raises(CheckpointError) as e:
        load_head(folder)
    assert expect in str(e.value)


def test_aligner_for_another_encoder_width_is_refused(tiny_shipped, tmp_path):
    import glmasr

    folder = build_random_head(tmp_path / "h", head_config_for(1280, 263, **SIZES["small"]), seed=8)
    with pytest.raises(CheckpointError, match=r"encoder states 1280 wide .* this model's encoder gives 64"):
        glmasr.load(tiny_shipped, device="cpu", aligner=folder)


def test_aligner_for_a_smaller_vocabulary_is_refused(tiny_shipped, tmp_path):
    folder = build_random_head(tmp_path / "h", head_config_for(64, 100, **SIZES["small"]), seed=9)
    with pytest.raises(CheckpointError, match=r"101 classes .* tokenizer of 264 tokens"):
        CtcAligner.from_folder(folder, tiny_shipped)


def test_aligner_specs_that_are_not_folders(tmp_path, hub_offline):
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file; pass the folder"):
        resolve_head_folder(f)
    with pytest.raises(CheckpointError, match="neither an existing folder nor a Hugging Face hub id"):
        resolve_head_folder(tmp_path / "nope")
    with pytest.raises(CheckpointError) as e:
        resolve_head_folder("JazerJu/glm-asr-ctc")
    assert "hf download JazerJu/glm-asr-ctc --local-dir" in str(e.value) and "aligner=" in str(e.value)
