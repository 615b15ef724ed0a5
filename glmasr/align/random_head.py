"""Random-weight CTC aligner heads in the published glm-asr-ctc layout, for tests and offline demos.

``build_random_head`` writes ``config.json`` (the exporter's fields) and ``ctc_head.safetensors`` with the real
key names and shapes. Two sizes: ``"full"``, the published dimensions (proj 2048, hidden 512, 5 blocks of 8
heads, ffn 128; ~40.0 M parameters with the GLM vocabulary), and ``"small"`` (proj 64, hidden 32, 2 blocks of 4
heads, ffn 16) for the tiny test model. The input width follows the model's encoder (``encoder_dim``) and the
classes its tokenizer (tokenizer length + 1, blank last), as ``build_head_for_checkpoint`` reads them from a
checkpoint folder. Word times from a random head are meaningless; its shapes and plumbing are real.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .head import CtcHead, CtcHeadConfig, head_config_for

SIZES = {"full": {}, "small": {"proj_hidden": 64, "ctc_hidden": 32, "num_blocks": 2, "num_heads": 4,
                                "ffn_hidden": 16}}


def build_random_head(folder, config: CtcHeadConfig, seed: int = 0, weights_name: str = "ctc_head.safetensors"
                      ) -> Path:
    """Write a head of ``config`` with random weights (torch's default init, seeded) to ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        head = CtcHead(config)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / weights_name), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return folder


def build_head_for_checkpoint(folder, model_folder, size: str = "small", seed: int = 0, **fields) -> Path:
    """A random head for the GLM-ASR checkpoint in ``model_folder``: its encoder width and tokenizer length;
    ``size`` "small" or "full"; ``fields`` override config fields."""
    from ..checkpoint.weights import read_config
    from .ctc_aligner import TokenizerOffsets

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    cfg = read_config(Path(model_folder))
    vocab = TokenizerOffsets(model_folder).size
    config = head_config_for(cfg.audio.hidden_size, vocab, **SIZES[size])
    return build_random_head(folder, dataclasses.replace(config, **fields), seed)
