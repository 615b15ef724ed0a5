"""Which parts of the GPU path the kernels can run for a config: ``kernel_support(cfg)``, checked at load so an
unsupported checkpoint falls back to the plain PyTorch path for that part (one ``KernelFallbackWarning`` per
part) instead of failing mid-transcribe. A kernel's limit on the config (a power-of-two head size, a width
cap) goes here.
"""

from __future__ import annotations

import triton.language as tl

from glmasr_kernels._triton_utils import next_pow2

# Config limits of the kernels the GPU path launches (kernels/*.py), checked by ``kernel_support``.
# LayerNorm / RMSNorm hold a whole row in registers: kernels/layernorm.py and kernels/rmsnorm.py refuse N > 32768.
NORM_MAX_WIDTH = 32768
# Triton's cap on the elements of one block (tensor) inside a kernel; larger tiles fail to compile.
TILE_MAX_NUMEL = getattr(tl, "TRITON_MAX_TENSOR_NUMEL", 1 << 20)
# The frontend kernel (kernels/logmel) computes Whisper features with these mel counts only.
LOGMEL_MEL_BINS = (80, 128)
# decode_attention's K/V tile length on the GPU (kernels/decode_attention.py: block_n = 64; 16 when interpreting).
_DECODE_BLOCK_N = 64


def _rope_tile(heads: int, rotary_dim: int) -> int:
    """Elements of the smallest block kernels/rope.py launches: one token x next_pow2(heads) x next_pow2(R/2)."""
    return next_pow2(heads) * next_pow2(rotary_dim // 2)


def kernel_support(cfg) -> dict[str, str | None]:
    """For each part of the GPU path ("frontend", "encoder", "decoder"): None if its kernels can run ``cfg``
    (a ``GlmAsrConfig``), else the reason, naming the config field, its value and the kernel's constraint
    (several reasons joined by "; "). Nothing is launched; the limits are the launchers' own checks
    (kernels/*.py) and Triton's block size cap.

    - frontend (kernels/logmel, chosen by the caller of the model): ``num_mel_bins`` in (80, 128).
    - encoder: LayerNorm width (``hidden_size`` <= 32768); RoPE block (next_pow2(heads) x next_pow2(rotary
      dim / 2) <= Triton's cap); attention (kernels/encoder_attention.py) needs a power-of-two ``head_dim``.
      GELU and the GEMMs (cuBLAS) take any size.
    - decoder: decode attention needs a power-of-two ``head_dim`` and its tiles within Triton's cap; RMSNorm
      width (``hidden_size`` <= 32768); RoPE + KV append block as for the encoder. SwiGLU, the skinny GEMMs
      and greedy_commit take any size.
    """
    a, t = cfg.audio, cfg.text
    frontend, encoder, decoder = [], [], []
    if a.num_mel_bins not in LOGMEL_MEL_BINS:
        frontend.append(f"audio_config.num_mel_bins = {a.num_mel_bins}, but the fused log-mel kernel "
                        f"(kernels/logmel) computes {' or '.join(map(str, LOGMEL_MEL_BINS))} mel bins only")
    if a.hidden_size > NORM_MAX_WIDTH:
        encoder.append(f"audio_config.hidden_size = {a.hidden_size}, but the LayerNorm kernel (kernels/layernorm.py) "
                       f"holds a row in registers: at most {NORM_MAX_WIDTH}")
    if _rope_tile(a.num_attention_heads, a.rotary_dim) > TILE_MAX_NUMEL:
        encoder.append(f"audio_config.num_attention_heads = {a.num_attention_heads} with rotary dim {a.rotary_dim}: "
                       f"the RoPE kernel (kernels/rope.py) block next_pow2(heads) x next_pow2(rotary_dim / 2) = "
                       f"{_rope_tile(a.num_attention_heads, a.rotary_dim)} elements exceeds Triton's {TILE_MAX_NUMEL}")
    if a.head_dim != next_pow2(a.head_dim):
        encoder.append(f"audio_config.head_dim = {a.head_dim}, but the encoder attention kernel "
                       f"(kernels/encoder_attention.py) needs a power of two")
    d = t.head_dim
    if d != next_pow2(d):
        decoder.append(f"text_config.head_dim = {d}, but the decode attention kernel (kernels/decode_attention.py) "
                       f"needs a power of two")
    else:
        block_h, block_d = max(16, next_pow2(t.num_attention_heads // t.num_key_value_heads)), max(16, d)
        tile = max(_DECODE_BLOCK_N * block_d, block_h * block_d, block_h * _DECODE_BLOCK_N)
        if tile > TILE_MAX_NUMEL:
            decoder.append(f"text_config.head_dim = {d} with {t.num_attention_heads // t.num_key_value_heads} query "
                           f"heads per kv head: a decode attention (kernels/decode_attention.py) tile of {tile} "
                           f"elements exceeds Triton's {TILE_MAX_NUMEL}")
    if t.hidden_size > NORM_MAX_WIDTH:
        decoder.append(f"text_config.hidden_size = {t.hidden_size}, but the RMSNorm kernel (kernels/rmsnorm.py) "
                       f"holds a row in registers: at most {NORM_MAX_WIDTH}")
    if _rope_tile(t.num_attention_heads, d) > TILE_MAX_NUMEL:
        decoder.append(f"text_config.num_attention_heads = {t.num_attention_heads} with head_dim {d}: the RoPE kernel "
                       f"(kernels/rope.py) block next_pow2(heads) x next_pow2(head_dim / 2) = "
                       f"{_rope_tile(t.num_attention_heads, d)} elements exceeds Triton's {TILE_MAX_NUMEL}")
    return {part: "; ".join(reasons) or None
            for part, reasons in (("frontend", frontend), ("encoder", encoder), ("decoder", decoder))}
