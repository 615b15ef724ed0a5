"""The GPU model: GLM-ASR on the Triton kernels over a fused weight cache, behind the engine's model interface
(``models/interface.py``: ``encode_audio``, ``embed_tokens``, ``prefill``, ``decode``, ``logits``, the
capability flags and ``batch_invariant``), so the engine runs it or the plain ``GlmAsrModel`` alike.

Built once at load from a loaded reference model, whose modules keep working on the same weights
(``.reference``):

- ``models/fast_weights.py``: the weight cache (fused ``[q; k; v]`` and ``[gate; up]`` matrices shared with the
  reference modules);
- ``models/fast_encoder.py``: the encoder + projector (cuBLAS GEMMs, LayerNorm, GELU, RoPE and attention
  kernels);
- ``models/fast_decoder.py``: the decoder and lm head (skinny GEMVs, RMSNorm, RoPE + KV append, decode
  attention; the packed prefill);
- ``models/kernel_support.py``: configs the kernels cannot serve. The part concerned (encoder, decoder) runs on
  the reference modules instead, decided once here with one ``KernelFallbackWarning`` per part.

``decode_weights="int8"`` (opt-in): the decode step's GEMVs stream per-row int8 copies of the decoder's matrices
(``models/fast_decoder.py`` says what changes and what it costs); it needs the Triton decoder.

The model holds no CUDA graph: the engine's runner captures and replays them (``engine/model_runner.py``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from glmasr_kernels._triton_utils import interpreting

from .fast_decoder import KernelDecoder
from .fast_encoder import KernelEncoder
from .fast_weights import check_decode_weights
from .glmasr import GlmAsrModel
from ..errors import KernelFallbackWarning
from .kernel_support import kernel_support
from .kv_cache import KVCache

__all__ = ["FastGlmAsrModel", "KernelFallbackWarning", "kernel_support"]

class FastGlmAsrModel:
    """GLM-ASR on Triton kernels + cuBLAS GEMMs; see the module docstring. ``decode_weights``: "bf16" (the
    model's matrices) or "int8" (``models/fast_decoder.py``)."""

    def __init__(self, reference: GlmAsrModel, decode_weights: str = "bf16"):
        check_decode_weights(decode_weights)
        if reference.device.type != "cuda" and not interpreting():
            raise ValueError("the Triton model path needs the weights on a CUDA device "
                             "(or TRITON_INTERPRET=1 for CPU testing)")
        self.reference = reference
        self.cfg = cfg = reference.cfg
        # models/interface.py; the engine's runner sets it before each of its prefills, decode rounds and dry passes
        self.batch_invariant = False
        # Parts whose config a kernel cannot serve run on the reference modules, decided here, not mid-transcribe.
        # (The frontend is chosen by the caller: ``kernel_support(cfg)["frontend"]``.)
        self.kernel_support = kernel_support(cfg)
        self.fallbacks = {p: r for p, r in self.kernel_support.items() if r is not None and p != "frontend"}
        if decode_weights == "int8" and "decoder" in self.fallbacks:
            raise ValueError(f"decode_weights='int8' needs the Triton decoder, which this config cannot use: "
                             f"{self.fallbacks['decoder']}")
        self.decode_weights = decode_weights
        for part, reason in self.fallbacks.items():
            warnings.warn(f"GLM-ASR {part} runs on the plain PyTorch path instead of the Triton kernels: {reason}",
                          KernelFallbackWarning, stacklevel=2)
        self.encoder = None if "encoder" in self.fallbacks else KernelEncoder(reference)
        self.decoder = None if "decoder" in self.fallbacks else KernelDecoder(reference, decode_weights)
        self.triton_encoder = self.encoder is not None
        self.triton_decoder = self.decoder is not None
        self.embedding = reference.language_model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.reference.device

    @property
    def dtype(self) -> torch.dtype:
        return self.reference.dtype

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        if self.encoder is None:
            return self.reference.encode_audio(features)
        return self.encoder(features)

    def encode_states(self, features: torch.Tensor, frames=None) -> torch.Tensor:
        # The reference modules (same weights): any frame count without a kernel compile per length (the
        # attention kernel's T is a compile-time constant); SDPA does the attention.
        return self.reference.encode_states(features, frames)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.decoder is None:
            return self.reference.decode(embeds, positions, cache, kv_len, rows)
        return self.decoder.forward(embeds, positions, cache, kv_len, rows, self.batch_invariant)

    def prefill(self, embeds: list[torch.Tensor], cache: KVCache, rows: list[int]) -> torch.Tensor:
        if self.decoder is None:
            return self.reference.prefill(embeds, cache, rows)
        return self.decoder.prefill(embeds, cache, rows)

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        if self.decoder is None:
            return self.reference.logits(hidden, upcast)
        return self.decoder.logits(hidden, upcast, self.batch_invariant)
