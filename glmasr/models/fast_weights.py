"""The GPU path's weight cache, built once at load from a loaded reference model (``GlmAsrModel``).

Per encoder layer one fused ``[q; k; v]`` matrix (3840 x 1280 for the real config) with a fused bias whose k
part is zero (the encoder's k_proj has no bias); per decoder layer one fused ``[q; k; v]`` matrix (3072 x 2048)
and one fused ``[gate; up]`` matrix (12288 x 2048). The reference modules' separate q/k/v (gate/up) weights are
re-pointed to row slices of the fused tensors, so both paths share one copy of every weight (the reference
path stays usable on the same object for checks) and each original tensor is freed as soon as its layer is
fused. The other weights (o_proj, fc1, fc2, down_proj, the norms) are the reference's own tensors.

Opt-in int8 decode weights (``DecoderLayerWeights.add_int8``, ``KernelDecoder(decode_weights="int8")``): each
decoder layer also holds ``Int8Matrix`` copies of its four matrices (int8 + one fp32 scale per row,
``glmasr_kernels.skinny_gemm.quantize_rows``) for the decode step's GEMVs; the bf16 matrices stay (the prefill
and the reference modules use them).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

# what the decode step's GEMVs stream (KernelDecoder's decode_weights): "bf16" the model's own matrices (bf16, or
# fp32 where the model was loaded in fp32), "int8" per-row int8 copies
DECODE_WEIGHTS = ("bf16", "int8")


def check_decode_weights(value) -> str:
    """``value`` when it is one of ``DECODE_WEIGHTS``, else ValueError naming the allowed values."""
    if value not in DECODE_WEIGHTS:
        raise ValueError(f"unknown decode_weights {value!r}: use one of {DECODE_WEIGHTS}")
    return value


def _share(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Point a reference Linear's weight at a slice of a fused matrix (no copy)."""
    linear.weight = nn.Parameter(rows, requires_grad=False)


class EncoderLayerWeights:
    """One encoder layer: ``w_qkv``/``b_qkv`` fused, ``w_o``/``b_o``, ``w_fc1``/``b_fc1``, ``w_fc2``/``b_fc2``,
    and the LayerNorms ``ln1``/``ln2`` as (weight, bias)."""

    def __init__(self, layer):
        attn = layer.self_attn
        width = attn.q_proj.weight.shape[0]
        self.w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
        zeros = torch.zeros(width, device=self.w_qkv.device, dtype=self.w_qkv.dtype)
        self.b_qkv = torch.cat([attn.q_proj.bias, zeros, attn.v_proj.bias]).contiguous()
        for i, lin in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            _share(lin, self.w_qkv[i * width:(i + 1) * width])
        self.w_o, self.b_o = attn.o_proj.weight, attn.o_proj.bias
        self.ln1 = (layer.input_layernorm.weight, layer.input_layernorm.bias)
        self.ln2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias)
        self.w_fc1, self.b_fc1 = layer.mlp.fc1.weight, layer.mlp.fc1.bias
        self.w_fc2, self.b_fc2 = layer.mlp.fc2.weight, layer.mlp.fc2.bias


@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """An int8 copy of a weight matrix: ``q`` int8 (N, K) and ``scale`` fp32 (N,), ``W ~ q * scale[:, None]``
    (symmetric, per output row: ``skinny_gemm.quantize_rows``)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Matrix:
        from glmasr_kernels.skinny_gemm import quantize_rows

        return cls(*quantize_rows(w))

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


@dataclasses.dataclass(frozen=True)
class Int8DecoderLayer:
    """The int8 copies of one decoder layer's four matrices (``DecoderLayerWeights.add_int8``)."""

    qkv: Int8Matrix
    o: Int8Matrix
    gate_up: Int8Matrix
    down: Int8Matrix

    def matrices(self) -> tuple[Int8Matrix, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class DecoderLayerWeights:
    """One decoder layer: ``w_qkv`` and ``w_gate_up`` fused, ``w_o``, ``w_down``, the RMSNorm gains ``ln1``/``ln2``;
    ``int8``: their int8 copies (``add_int8``) or None."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
        self.w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
        nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        _share(attn.q_proj, self.w_qkv[:nq])
        _share(attn.k_proj, self.w_qkv[nq:nq + nk])
        _share(attn.v_proj, self.w_qkv[nq + nk:])
        inter = mlp.gate_proj.weight.shape[0]
        _share(mlp.gate_proj, self.w_gate_up[:inter])
        _share(mlp.up_proj, self.w_gate_up[inter:])
        self.w_o, self.w_down = attn.o_proj.weight, mlp.down_proj.weight
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.int8: Int8DecoderLayer | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four matrices a bf16 decode step streams (for weight-byte counts)."""
        return self.w_qkv, self.w_o, self.w_gate_up, self.w_down

    @torch.no_grad()
    def add_int8(self) -> None:
        """Quantize the four matrices into ``self.int8`` (per-row int8, ``quantize_rows``); the bf16 ones stay."""
        self.int8 = Int8DecoderLayer(*(Int8Matrix.quantize(w) for w in self.tensors()))


@torch.no_grad()
def encoder_weights(layers) -> list[EncoderLayerWeights]:
    return [EncoderLayerWeights(layer) for layer in layers]


@torch.no_grad()
def decoder_weights(layers) -> list[DecoderLayerWeights]:
    return [DecoderLayerWeights(layer) for layer in layers]
