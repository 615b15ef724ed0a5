"""Whisper-style audio encoder of GLM-ASR (reference path).

Input: log-mel features (W, n_mels, 3000) of W independent 30 s windows. Two convolutions (the second with
stride 2) bring them to (W, 1500, hidden); then pre-LayerNorm transformer layers with bidirectional attention
over all 1500 frames (no padding mask: the reference attends the padded tail too, so we must as well) and
partial half-split RoPE (first ``rotary_dim`` of each head's dims, positions 0..1499 per window); then a final
LayerNorm. Parameter names match the checkpoint (``audio_tower.*``).

``frames`` (aligners only, ``GlmAsrModel.encode_states``): windows of different lengths in one batch, each computed
as if it were alone at its own length: features past a window's frames and the first convolution's outputs there
are zeroed (what the convolutions' zero padding gives the bare window) and attention keys past its states are
masked out. States past a window's own length are left as computed and mean nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import AudioEncoderConfig
from .layers import RotaryTable, apply_rope, gelu, layer_norm


class EncoderAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        width = cfg.num_attention_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, width, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, width, bias=False)  # Whisper heritage: no k bias
        self.v_proj = nn.Linear(cfg.hidden_size, width, bias=True)
        self.o_proj = nn.Linear(width, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor | None = None) -> torch.Tensor:
        """``keys``: optional (b, 1, 1, t) bool, the frames each window's queries may attend (AudioEncoder's
        ``frames``)."""
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, scale=self.head_dim ** -0.5)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class EncoderMLP(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.eps = cfg.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = EncoderAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = EncoderMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor | None = None) -> torch.Tensor:
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn(layer_norm(x, ln1.weight, ln1.bias, self.eps), cos, sin, keys)
        return x + self.mlp(layer_norm(x, ln2.weight, ln2.bias, self.eps))


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.hidden_size, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.rope: RotaryTable | None = None

    def rotary(self, device) -> RotaryTable:
        if self.rope is None or self.rope.cos.device != torch.device(device):
            self.rope = RotaryTable(self.cfg.rotary_dim, self.cfg.max_position_embeddings, self.cfg.rope_theta, device)
        return self.rope

    def forward(self, features: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """features (W, n_mels, F) -> hidden states (W, ceil(F / 2), hidden). ``frames`` (W,) int: window i holds
        only its first frames[i] feature frames (module docstring); None: every window is F long."""
        features = features.to(self.conv1.weight.dtype)
        keys = None
        if frames is not None:
            frames = torch.as_tensor(frames, device=features.device).view(-1, 1)
            valid = torch.arange(features.shape[2], device=features.device)[None, :] < frames  # (W, F)
            features = features * valid[:, None, :]
            x = gelu(self.conv1(features)) * valid[:, None, :]
        else:
            x = gelu(self.conv1(features))
        x = gelu(self.conv2(x)).transpose(1, 2)
        w, t, _ = x.shape
        if frames is not None:
            keys = (torch.arange(t, device=x.device)[None, :] < (frames + 1) // 2)[:, None, None, :]
        positions = torch.arange(t, device=x.device).expand(w, t)
        cos, sin = self.rotary(x.device).lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, keys)
        return layer_norm(x, self.norm.weight, self.norm.bias, self.cfg.layer_norm_eps)
