"""The audio encoder + projector of the GPU path, on the fused weight cache (models/fast_weights.py).

Per layer: the fused ``[q; k; v]`` GEMM (cuBLAS, with its bias), RoPE on q and k in place (``rope.rope_``),
attention over the fused projection output (``kernels/encoder_attention.py``: writes o_proj's (W, T, H, D)
layout, no transpose copy), o_proj (cuBLAS) with the residual add inside the next LayerNorm kernel, fc1
(cuBLAS) + exact GELU with the bias (``kernels/activations.py``), fc2 (cuBLAS) with the residual add inside
the next LayerNorm. Under Triton's CPU interpreter attention is torch SDPA after the same ``rope_`` (1500-frame
attention takes minutes in the interpreter; the kernel's own tests run it at short lengths). The encoder
attends over all 1500 frames with no mask, as the reference does.

A call is one eager pass: the engine's runner replays launch-bound window counts from CUDA graphs of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmasr_kernels._triton_utils import interpreting
from glmasr_kernels.activations import gelu_bias
from glmasr_kernels.encoder_attention import encoder_attention
from glmasr_kernels.layernorm import layer_norm
from glmasr_kernels.rope import build_rope_cache, rope_

from .fast_weights import encoder_weights
from .layers import sdpa_backends


class KernelEncoder:
    """``encoder(features)``: log-mel windows (W, n_mels, 3000) -> projected audio embeddings (W, 375,
    text_hidden), same interface and roundings as ``GlmAsrModel.encode_audio`` (the reference modules' weights,
    fused where the kernels read them together)."""

    def __init__(self, reference):
        cfg = reference.cfg
        enc = reference.audio_tower
        self.cfg = cfg
        self.dtype = reference.dtype
        self.layers = encoder_weights(enc.layers)
        self.conv1, self.conv2 = enc.conv1, enc.conv2
        self.norm = (enc.norm.weight, enc.norm.bias)
        self.proj = reference.multi_modal_projector
        a = cfg.audio
        self.cos, self.sin = build_rope_cache(a.rotary_dim, a.max_position_embeddings, a.rope_theta,
                                              device=reference.device)
        # attention on kernels/encoder_attention.py, or (the interpreter) torch SDPA; tests set it to compare them
        self.attention_kernel = not interpreting()

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        a = self.cfg.audio
        x = F.gelu(F.conv1d(features.to(self.dtype), self.conv1.weight, self.conv1.bias, padding=1))
        x = F.gelu(F.conv1d(x, self.conv2.weight, self.conv2.bias, stride=2, padding=1))
        residual = x.transpose(1, 2).contiguous()  # (W, T, hidden)
        w, t, hidden = residual.shape
        positions = torch.arange(t, device=x.device, dtype=torch.int32).expand(w, t)
        h = layer_norm(residual, *self.layers[0].ln1, a.layer_norm_eps)
        h = self.run_layers(h, residual, positions)
        merged = h.reshape(w, t // self.cfg.merge_factor, hidden * self.cfg.merge_factor)
        p = self.proj
        return F.linear(gelu_bias(F.linear(merged, p.linear_1.weight), p.linear_1.bias),
                        p.linear_2.weight, p.linear_2.bias)

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The encoder layers on the first layer's normed input ``h`` and the residual stream ``residual`` (W, T,
        hidden) at ``positions`` (W, T) int32; returns the final LayerNorm's output."""
        a = self.cfg.audio
        w, t, hidden = residual.shape
        eps = a.layer_norm_eps
        for i, lw in enumerate(self.layers):
            qkv = F.linear(h, lw.w_qkv, lw.b_qkv).view(w, t, 3, a.num_attention_heads, a.head_dim)
            q, k, v = qkv.unbind(2)
            rope_(q, k, positions, self.cos, self.sin)
            if self.attention_kernel:
                attn = encoder_attention(qkv, sm_scale=a.head_dim ** -0.5).view(w, t, hidden)
            else:
                with sdpa_backends():
                    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          scale=a.head_dim ** -0.5)
                attn = attn.transpose(1, 2).reshape(w, t, hidden)
            h, residual = layer_norm(F.linear(attn, lw.w_o, lw.b_o), *lw.ln2, eps, residual=residual)
            g = gelu_bias(F.linear(h, lw.w_fc1), lw.b_fc1)
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm
            h, residual = layer_norm(F.linear(g, lw.w_fc2, lw.b_fc2), *nxt, eps, residual=residual)
        return h
