"""GLM-ASR: audio encoder + projector + Llama decoder + lm head (reference path).

The module tree and parameter names mirror the checkpoint's key layout (``audio_tower``,
``multi_modal_projector``, ``language_model``, ``lm_head``), so weights load by name with no renaming
inside the model.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import GlmAsrConfig
from .device import host_to_device
from .decoder import TextDecoder
from .encoder import AudioEncoder
from .kv_cache import KVCache
from .projector import AudioProjector


class GlmAsrModel(nn.Module):
    """The reference model, one implementation of the engine's model interface (models/interface.py): no
    Triton kernels (so no fused greedy commit), and no switch behind ``batch_invariant``: the runner sets it,
    nothing reads it (on CUDA the engine refuses the mode for this model, whose cuBLAS GEMMs pick their
    algorithms by the number of rows)."""

    triton_encoder = False
    triton_decoder = False
    batch_invariant = False

    def __init__(self, cfg: GlmAsrConfig):
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.multi_modal_projector = AudioProjector(cfg)
        self.language_model = TextDecoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel windows (W, n_mels, 3000) -> projected audio embeddings (W, 375, text_hidden)."""
        return self.multi_modal_projector(self.audio_tower(features))

    def encode_states(self, features: torch.Tensor, frames=None) -> torch.Tensor:
        """Log-mel windows (W, n_mels, F), F <= 3000 -> encoder states before the projector (W, ceil(F / 2),
        audio_hidden): for aligners. ``frames`` (W,): window i's own length (<= F); its states are then those of
        the window alone at that length (the first ceil(frames[i] / 2); the rest mean nothing)."""
        limit = 2 * self.cfg.audio.max_position_embeddings
        if features.ndim != 3 or not 0 < features.shape[2] <= limit:
            raise ValueError(f"features must be (windows, n_mels, frames) with 1..{limit} frames, got "
                             f"{tuple(features.shape)}")
        if frames is not None:
            frames = torch.as_tensor(frames, dtype=torch.int64)
            if frames.shape != (features.shape[0],) or not bool(((frames >= 1) & (frames <= features.shape[2])).all()):
                raise ValueError(f"frames must be one length in 1..{features.shape[2]} per window "
                                 f"({features.shape[0]}), got {frames.tolist()}")
        return self.audio_tower(features, frames)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(ids)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder on embeddings at positions (sequence b in cache row ``rows[b]``, default b);
        returns final-normed hidden states."""
        return self.language_model(embeds, positions, cache, kv_len, rows)

    def prefill(self, embeds: list[torch.Tensor], cache: KVCache, rows: list[int]) -> torch.Tensor:
        """Prompts ``embeds[i]`` (L_i, hidden) into cache row ``rows[i]`` from slot 0; returns the final-normed
        hidden state of each prompt's last token (len(embeds), hidden). One ``decode`` per prompt: the plain
        reference of the fast path's packed prefill (same interface)."""
        dev = self.device
        last = []
        for e, row in zip(embeds, rows):
            n = e.shape[0]
            positions = torch.arange(n, device=dev)[None]
            last.append(self.decode(e[None], positions, cache, kv_len=n, rows=host_to_device([row], dev))[0, -1])
        return torch.stack(last)

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        y = self.lm_head(hidden)
        return y.float() if upcast else y
