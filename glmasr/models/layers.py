"""Plain-PyTorch building blocks shared by the encoder and the decoder.

These are the reference implementations: the CPU path runs them, and every fast kernel in ``kernels/`` is
tested against them. Their numerics follow the transformers GLM-ASR implementation op for op (fp32
statistics in the norms, RoPE tables computed in fp32 and cast to the activation dtype) so that fp32 runs
agree with it to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, as in Whisper and the GLM-ASR projector."""
    return F.gelu(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RotaryTable:
    """cos/sin of the half-split RoPE for positions [0, max_positions), fp32, computed once.

    ``inv_freq[i] = 1 / theta^(2i / rotary_dim)``; angle = position * inv_freq, in fp32 like the reference.
    ``cos``/``sin`` have shape (max_positions, rotary_dim) with the half-split duplication ``cat(f, f)``.
    """

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, device=None):
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
                                    / rotary_dim))
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.inv_freq = inv_freq
        self.cos = emb.cos()
        self.sin = emb.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + (rotary_dim,), cast to ``dtype``."""
        # No range check here: it would sync the host and break CUDA-graph capture. Callers bound positions
        # by the KV cache capacity, which is at most max_positions.
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on the first ``cos.shape[-1]`` dims of each head; the rest pass through.

    x: (B, heads, T, head_dim); cos/sin: (B, T, rotary_dim) in x's dtype.
    """
    rot = cos.shape[-1]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# torch SDPA backends in the order the GPU path tries them (cuDNN's Hopper kernel first; fp32 and the CPU fall
# through to the efficient / math ones).
SDPA_ORDER = ("cudnn", "flash", "efficient", "math")
_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
         "math": "MATH"}


def sdpa_backends(names: tuple[str, ...] = SDPA_ORDER):
    """Context: torch SDPA restricted to ``names``, tried in that order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA[n]) for n in names], set_priority=True)
