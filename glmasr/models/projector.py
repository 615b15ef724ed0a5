"""Projector from encoder frames to decoder embeddings (reference path).

Four consecutive encoder frames are concatenated (a reshape, not pooling: token j is
``[h[4j], h[4j+1], h[4j+2], h[4j+3]]``), then ``linear_1 -> exact GELU -> linear_2``.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import GlmAsrConfig
from .layers import gelu


class AudioProjector(nn.Module):
    def __init__(self, cfg: GlmAsrConfig):
        super().__init__()
        self.merge_factor = cfg.merge_factor
        self.linear_1 = nn.Linear(cfg.merged_width, cfg.projector_hidden)
        self.linear_2 = nn.Linear(cfg.projector_hidden, cfg.text.hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """frames (W, T, hidden) -> (W, T // 4, text_hidden)."""
        w, t, h = frames.shape
        merged = frames.reshape(w, t // self.merge_factor, h * self.merge_factor)
        return self.linear_2(gelu(self.linear_1(merged)))
