"""Random-weight GLM-ASR checkpoints for tests, offline demos and speed work.

The real weights cannot be downloaded everywhere, so we build checkpoints with transformers'
``GlmAsrForConditionalGeneration`` (random init) and a stand-in tokenizer: a byte-level BPE with no merges
(every byte is a token) plus the GLM special tokens. Two sizes:

- ``tiny``: the real topology at toy width (``configs/tiny-random.json``), runs in milliseconds on a CPU.
- ``full``: the real config (``configs/glm-asr-nano-2512.json``); the special tokens sit at the real ids
  (59246 ... 59260) and the vocabulary is padded with filler tokens to 59264 entries.

Two key layouts: ``"shipped"`` (the Hub file: ``audio_tower.*``, ``language_model.model.*``,
``language_model.lm_head.weight``) and ``"transformers"`` (what ``save_pretrained`` writes, lm head tied).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .resources import cache_dir, config_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                  "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"]
# Real ids of the GLM-ASR tokenizer where known (spec section 1.4); begin/end of audio are unverified there.
FULL_SIZE_SPECIAL_IDS = {"<|endoftext|>": 59246, "<|system|>": 59252, "<|user|>": 59253, "<|assistant|>": 59254,
                         "<|observation|>": 59255, "<|begin_of_audio|>": 59256, "<|end_of_audio|>": 59257,
                         "<|pad|>": 59260}
# Renders exactly '<|user|>\n<|begin_of_audio|><|pad|><|end_of_audio|><|user|>\nPROMPT<|assistant|>\n'.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}<|begin_of_audio|><|pad|><|end_of_audio|><|user|>{{ '\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{ '\\n' }}{%- endif -%}"
)


def config_path(name: str) -> Path:
    """Path of a shipped config (``tiny-random`` or ``glm-asr-nano-2512``), from the installed package or the
    source checkout (``glmasr.checkpoint.resources``)."""
    return config_file(name)


def build_tokenizer(vocab_size: int | None = None):
    """Stand-in GLM tokenizer. ``vocab_size=None``: 256 bytes + 8 specials appended (264 tokens);
    otherwise exactly ``vocab_size`` tokens with the specials at their real GLM-ASR ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    if vocab_size is not None:
        specials = FULL_SIZE_SPECIAL_IDS
        if vocab_size <= max(specials.values()):
            raise ValueError(f"vocab_size {vocab_size} too small for the GLM special token ids")
        by_id = {i: t for t, i in specials.items()}
        for i in range(len(vocab), vocab_size):
            vocab[by_id.get(i, f"<|filler_{i}|>")] = i
    model = models.BPE(vocab=vocab, merges=[])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(name: str, tokenizer):
    """transformers GlmAsrConfig from a shipped config file, with token ids taken from ``tokenizer``."""
    from transformers import GlmAsrConfig

    data = json.loads(config_path(name).read_text())
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    data["audio_token_id"] = ids["<|pad|>"]
    text = data["text_config"]
    text["vocab_size"] = len(tokenizer) if name == "tiny-random" else text["vocab_size"]
    text["eos_token_id"] = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    for drop in ("architectures", "transformers_version", "model_type", "dtype"):
        data.pop(drop, None)
    return GlmAsrConfig(**data)


_SHIPPED_PREFIXES = [("model.audio_tower.", "audio_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("model.language_model.", "language_model.model."),
                     ("lm_head.", "language_model.lm_head.")]


def _state_for_layout(model, layout: str) -> dict[str, torch.Tensor]:
    """The model's tensors under the key names of ``layout`` (contiguous, unshared copies)."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if layout == "transformers":
        # save_pretrained's convention for a tied model: the lm head is not stored.
        state.pop("lm_head.weight", None)
        return state
    out = {}
    for key, value in state.items():
        for src, dst in _SHIPPED_PREFIXES:
            if key.startswith(src):
                out[dst + key[len(src):]] = value
                break
        else:
            raise KeyError(f"unexpected runtime key {key}")
    return out


def build_checkpoint(folder: str | Path, size: str = "tiny", layout: str = "shipped", seed: int = 0,
                     device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Write a random GLM-ASR checkpoint (config, safetensors, tokenizer, processor files) to ``folder``."""
    from safetensors.torch import save_file
    from transformers import GlmAsrForConditionalGeneration, GlmAsrProcessor, WhisperFeatureExtractor

    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    if layout not in ("shipped", "transformers"):
        raise ValueError(f"layout must be 'shipped' or 'transformers', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(None if size == "tiny" else 59264)
    cfg = make_config("tiny-random" if size == "tiny" else "glm-asr-nano-2512", tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GlmAsrForConditionalGeneration(cfg)
    model = model.to(dtype).eval()
    # Weights are written by us, not by save_pretrained, so that each layout is exactly the documented one.
    model.config.save_pretrained(str(folder))
    save_file(_state_for_layout(model, layout), str(folder / "model.safetensors"), metadata={"format": "pt"})
    processor = GlmAsrProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(folder))
    return folder


# Bump when build_checkpoint's output for the tiny checkpoint changes, so cached copies are rebuilt.
TINY_FORMAT = 1
_STAMP = "glmasr-random-checkpoint.json"


def _tiny_stamp() -> dict:
    return {"format": TINY_FORMAT, "size": "tiny", "layout": "shipped", "seed": 0,
            "config_sha256": hashlib.sha256(config_path("tiny-random").read_bytes()).hexdigest()}


def _stamp_matches(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / _STAMP).read_text()) == stamp and (folder / "model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def ensure_tiny_checkpoint(folder: str | Path | None = None, log=None) -> Path:
    """The tiny random checkpoint of ``--model tiny-random`` (seed 0, shipped layout), built once into ``folder``
    (default: ``glmasr.checkpoint.resources.cache_dir() / "tiny-random"``, user-writable, outside the package) and reused
    while its stamp matches the shipped tiny config. Built in a temporary sibling folder and renamed into place,
    so an interrupted or concurrent build never leaves a half-written checkpoint behind. ``log(message)`` is
    called before a build."""
    folder = Path(folder) if folder is not None else cache_dir() / "tiny-random"
    stamp = _tiny_stamp()
    if _stamp_matches(folder, stamp):
        return folder
    if log is not None:
        log(f"building a tiny random-weight checkpoint in {folder} (transcripts will be gibberish)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building-", dir=folder.parent))
    try:
        build_checkpoint(tmp, size="tiny", layout="shipped", seed=0)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        if folder.exists() and not _stamp_matches(folder, stamp):
            shutil.rmtree(folder)  # stale: an older format or config
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _stamp_matches(folder, stamp):  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def ensure_full_size_checkpoint(folder: str | Path = "/tmp/glmasr-full-random") -> Path:
    """The full-size random bf16 checkpoint used for speed work, built on the GPU once per machine."""
    folder = Path(folder)
    if not (folder / "model.safetensors").exists():
        build_checkpoint(folder, size="full", layout="shipped", seed=0, device="cuda", dtype=torch.bfloat16)
        torch.cuda.empty_cache()
    return folder
