"""Llama-style text decoder of GLM-ASR (reference path).

Pre-RMSNorm layers with grouped-query attention (kv heads shared by ``num_attention_heads /
num_key_value_heads`` query heads), full-dim half-split RoPE and a SwiGLU MLP. Keys and values go to a
preallocated ``KVCache``; each token's position is also its cache slot. Parameter names match the
checkpoint (``language_model.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextDecoderConfig
from .kv_cache import KVCache
from .layers import RotaryTable, apply_rope, rms_norm, swiglu


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, positions, cache: KVCache, layer: int, kv_len: int, rows) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        cache.write(layer, k, v, positions, rows)
        slots = torch.arange(kv_len, device=x.device)
        # Causal by position: a query at position p sees slots 0..p of its own row.
        visible = slots[None, None, :] <= positions[:, :, None]  # (B, T, S)
        # Slots past a row's last position in this call may hold anything (another sequence's old entries,
        # unwritten memory): zero them so that masked scores and 0-weighted values stay finite.
        written = (slots[None, :] <= positions.amax(dim=1)[:, None])[:, None, :, None]  # (B, 1, S, 1)
        rows = torch.arange(b, device=x.device) if rows is None else rows
        keys = torch.where(written, cache.k[layer][rows, :, :kv_len], 0)
        values = torch.where(written, cache.v[layer][rows, :, :kv_len], 0)
        a = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible[:, None], scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DecoderMLP(cfg)

    def forward(self, x, cos, sin, positions, cache, layer, kv_len, rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer, kv_len, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.cfg = cfg
        # Given its weight, nn.Embedding skips reset_parameters: its normal_ on the meta device (where load()
        # builds the model) imports torch._dynamo, ~1 s here and seconds on the H200 machine. Weights come
        # from the checkpoint anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope: RotaryTable | None = None

    def rotary(self, device) -> RotaryTable:
        if self.rope is None or self.rope.cos.device != torch.device(device):
            self.rope = RotaryTable(self.cfg.head_dim, self.cfg.max_position_embeddings, self.cfg.rope_theta, device)
        return self.rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, hidden) embeddings at ``positions`` (B, T) -> final-normed hidden states (B, T, hidden).

        ``kv_len`` bounds the cache slots attended to (> every position in the call); sequence b lives in
        cache row ``rows[b]`` (default b).
        """
        cos, sin = self.rotary(x.device).lookup(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, cache, i, kv_len, rows)
        return self.norm(x)
