"""Preallocated key/value cache of the decoder.

Layout: ``k[layer]`` and ``v[layer]`` are (batch, kv_heads, capacity, head_dim). Sequence b's token at
position p lives in slot p of row b: every sequence starts at slot 0 and positions double as slot indices,
so a batch of prompts of different lengths needs no left padding and each sequence's RoPE positions are
simply 0, 1, 2, ... The whole buffer is allocated once; nothing grows per token.

Slots a sequence has not written yet are never read by the attention of that sequence (the kernels bound the
reads by its length; the reference path zeroes unwritten slots before its masked matmul, since 0 * NaN is
NaN). The buffer is still zero-filled at allocation so that no stale memory can ever reach a result.
"""

from __future__ import annotations

import torch

from .config import TextDecoderConfig


class KVCache:
    def __init__(self, cfg: TextDecoderConfig, batch: int, capacity: int, device, dtype: torch.dtype):
        if capacity > cfg.max_position_embeddings:
            raise ValueError(f"KV cache capacity {capacity} exceeds the model's {cfg.max_position_embeddings} positions")
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch = batch
        self.capacity = capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Store k, v (B, kv_heads, T, head_dim) of tokens at ``positions`` (B, T) into their slots of cache
        rows ``rows`` (B,) (default 0..B-1)."""
        rows = (torch.arange(k.shape[0], device=k.device) if rows is None else rows)[:, None]
        # (B, T, kv_heads, head_dim) views of the buffer and the new entries; index_put writes in place.
        self.k[layer].transpose(1, 2)[rows, positions] = k.transpose(1, 2)
        self.v[layer].transpose(1, 2)[rows, positions] = v.transpose(1, 2)
