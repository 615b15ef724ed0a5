"""Finding a checkpoint and loading its tensors into our model.

A checkpoint is a folder with ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``) and the tokenizer files. ``resolve_checkpoint`` accepts such a folder or a
Hugging Face hub id (downloaded into the normal HF cache by ``huggingface_hub.snapshot_download``).

These key layouts are accepted and mapped onto our module names (``canonical_name``):
- shipped (the Hub file; also what transformers 5.24 ``save_pretrained`` writes): ``audio_tower.*``,
  ``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.weight``
- transformers 5.17 ``save_pretrained``: as shipped, but the decoder one level deeper,
  ``language_model.model.model.*`` (its renaming table for this model holds two rules that both rename
  ``language_model.model``, and saving reverses both); lm head as shipped
- transformers' runtime names (``state_dict()`` of ``GlmAsrForConditionalGeneration``): ``model.audio_tower.*``,
  ``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.weight``
``save_pretrained`` leaves the lm head out when it is tied (``tie_word_embeddings``, the GLM-ASR default); a
missing lm head is tied to the token embeddings. Tensors go from the file straight to the target device
and are cast to the target dtype there; no second model is ever materialised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import GlmAsrConfig

DEFAULT_MODEL_ID = "zai-org/GLM-ASR-Nano-2512"

# (checkpoint prefix, our prefix); the first match wins, so a prefix comes before every shorter one it extends
# ("language_model.model.model." before "language_model.model.").
_PREFIXES = [
    ("language_model.model.model.", "language_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("model.audio_tower.", "audio_tower."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "language_model."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("audio_tower.", "audio_tower."),
    ("lm_head.", "lm_head."),
]
# Present in some exports, unused by the model (Whisper's absolute positions; GLM-ASR uses RoPE).
_IGNORED = {"audio_tower.embed_positions.weight"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found, read, or does not match the model."""


def canonical_name(key: str) -> str | None:
    for src, dst in _PREFIXES:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~")) and not os.path.exists(s)


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """Local folder for ``model``: the folder itself, or a hub snapshot (cached copy first, then network)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise CheckpointError(f"model path {text!r} is a file; pass the checkpoint folder that holds config.json")
    if not _looks_like_hub_id(text):
        raise CheckpointError(f"model {text!r} is neither an existing folder nor a Hugging Face hub id "
                              f"('owner/name')")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as e:  # network errors, offline mode, gated repos: all end the same way for the user
        raise CheckpointError(
            f"could not get {text!r} from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).\n"
            f"No network and no cached copy? Pass a local checkpoint folder instead, e.g.\n"
            f"  glmasr.load('/path/to/GLM-ASR-Nano-2512')   or   python demo.py --model /path/to/GLM-ASR-Nano-2512\n"
            f"(download it elsewhere with `huggingface-cli download {text} --local-dir weights/GLM-ASR-Nano-2512`),\n"
            f"or run offline with random weights: python demo.py --model tiny-random"
        ) from None


def safetensors_files(folder: Path) -> dict[str, Path]:
    """Map each tensor key to the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        missing_files = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing_files:
            raise CheckpointError(f"{index} names shard files that are not in {folder}: {missing_files}")
        return {k: folder / f for k, f in weight_map.items()}
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"cannot read {single}: {e}") from None
    found = sorted(p.name for p in folder.iterdir())
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder} (found: {found})")


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_state_dict(folder: Path, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
    """Read every tensor the model needs from ``folder``, checked by name and shape, on ``device``/``dtype``."""
    from safetensors import safe_open

    expected = expected_tensors(model)
    key_files = safetensors_files(folder)
    by_name: dict[str, str] = {}
    unexpected = []
    for key in key_files:
        name = canonical_name(key)
        if name in _IGNORED:
            continue
        if name is None or name not in expected:
            unexpected.append(key)
        elif name in by_name:
            raise CheckpointError(f"tensor {name!r} appears twice in {folder} (as {by_name[name]!r} and {key!r})")
        else:
            by_name[name] = key
    tied = False
    if "lm_head.weight" not in by_name and "language_model.embed_tokens.weight" in by_name:
        tied = True  # tie_word_embeddings: the lm head shares the embedding matrix
    missing = [n for n in expected if n not in by_name and not (tied and n == "lm_head.weight")]
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}"
                         + (" ..." if len(unexpected) > 20 else ""))
        raise CheckpointError(f"checkpoint {folder} does not match the GLM-ASR layout:\n  " + "\n  ".join(lines))

    state: dict[str, torch.Tensor] = {}
    mis_shaped = []
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    files: dict[Path, list[str]] = {}
    for name, key in by_name.items():
        files.setdefault(key_files[key], []).append(name)
    for path, names in files.items():
        try:
            with safe_open(str(path), framework="pt", device=dev) as f:
                for name in names:
                    key = by_name[name]
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[name]:
                        mis_shaped.append(f"{key}: file {shape}, model {expected[name]}")
                        continue
                    state[name] = f.get_tensor(key).to(dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensors from {path}: {e}") from None
    if mis_shaped:
        raise CheckpointError(f"checkpoint {folder} has tensors whose shapes do not match its config.json:\n  "
                              + "\n  ".join(mis_shaped))
    if tied:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    return state


def read_config(folder: Path) -> GlmAsrConfig:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"no config.json in {folder}: not a GLM-ASR checkpoint folder")
    return GlmAsrConfig.from_json_file(path)
