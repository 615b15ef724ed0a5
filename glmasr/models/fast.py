"""GPU model path: the GLM-ASR forward pass on our Triton kernels over a fused weight cache.

Same interface as ``GlmAsrModel`` (``encode_audio``, ``embed_tokens``, ``decode``, ``prefill``,
``logits``), so the engine loop runs either. Built once at load from a loaded reference model:

- Weight cache: per decoder layer one fused ``[q; k; v]`` matrix (3072 x 2048) and one fused ``[gate; up]``
  matrix (12288 x 2048), every decoder weight kind stacked over the layers (``dec_stack``, what the persistent
  decode step indexes; each layer's weights are views of it); per encoder layer a fused ``[q; k; v]`` matrix (3840 x 1280) with a fused bias whose
  k part is zero (the encoder's k_proj has no bias). The reference modules' separate q/k/v (gate/up) weights
  are re-pointed to row slices of the fused tensors, so both paths share one copy of every weight and the
  reference path stays usable on the same object (``.reference``) for checks.
- Kernels: LayerNorm / RMSNorm fused with the residual add (``kernels.layernorm``, ``kernels.rmsnorm``), RoPE
  on q and k in one launch, for the decoder fused with the KV-cache append (``kernels.rope``), decode attention
  straight from the KV buffer with per-sequence lengths (``kernels.decode_attention``), SwiGLU over the merged
  gate|up output and exact GELU with the GEMM's bias (``kernels.activations``). Decode-step GEMMs (one token
  per sequence, M <= 16) run on ``kernels.skinny_gemm`` (gate|up fused with SwiGLU), other GEMMs on cuBLAS
  (``F.linear``); encoder attention is ``kernels.encoder_attention`` (torch SDPA under the interpreter); the
  packed prefill (``prefill``: every admitted prompt in one unpadded pass) runs one variable-length causal
  flash-attention call, ``decode``'s padded prefill torch SDPA.
- Encoder CUDA graphs for 1 and 2 windows (launch-bound); larger window counts run eagerly (GPU-bound).

Contract of ``decode``: either a prefill from slot 0 (``positions`` = 0..T-1 for every row, ``kv_len == T``)
or one token per sequence (T == 1) at per-sequence positions.

Configs the kernels cannot serve (``kernel_support``): the part concerned (encoder, decoder) runs on the
reference modules instead, decided once at construction with one ``KernelFallbackWarning`` per part.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import triton.language as tl
from torch import nn

from glmasr_kernels import persistent_decode
from glmasr_kernels._triton_utils import interpreting, next_pow2
from glmasr_kernels.activations import gelu_bias, swiglu
from glmasr_kernels.decode_attention import decode_attention
from glmasr_kernels.layernorm import layer_norm
from glmasr_kernels.rmsnorm import rms_norm
from glmasr_kernels.rope import build_rope_cache, rope_, rope_and_append

from .. import cuda_graphs
from ..device import host_to_device
from .glmasr import GlmAsrModel
from .kv_cache import KVCache


# Config limits of the kernels this path launches (kernels/*.py), checked by ``kernel_support``.
# LayerNorm / RMSNorm hold a whole row in registers: kernels/layernorm.py and kernels/rmsnorm.py refuse N > 32768.
NORM_MAX_WIDTH = 32768
# Triton's cap on the elements of one block (tensor) inside a kernel; larger tiles fail to compile.
TILE_MAX_NUMEL = getattr(tl, "TRITON_MAX_TENSOR_NUMEL", 1 << 20)
# The frontend kernel (kernels/logmel) computes Whisper features with these mel counts only.
LOGMEL_MEL_BINS = (80, 128)
# decode_attention's K/V tile length on the GPU (kernels/decode_attention.py: block_n = 64; 16 when interpreting).
_DECODE_BLOCK_N = 64


# Default implementation per encoder op (FastGlmAsrModel.encoder_kernels): the faster one measured on the H200
# (notes/measurements.md).
ENCODER_KERNELS = {"qkv": "cublas", "o": "cublas", "fc1": "cublas", "fc2": "cublas", "attention": "triton"}


class KernelFallbackWarning(UserWarning):
    """A part of the model runs on the plain PyTorch path because its config does not fit a kernel."""


def _rope_tile(heads: int, rotary_dim: int) -> int:
    """Elements of the smallest block kernels/rope.py launches: one token x next_pow2(heads) x next_pow2(R/2)."""
    return next_pow2(heads) * next_pow2(rotary_dim // 2)


def kernel_support(cfg) -> dict[str, str | None]:
    """For each part of the GPU path ("frontend", "encoder", "decoder"): None if its kernels can run ``cfg``
    (a ``GlmAsrConfig``), else the reason, naming the config field, its value and the kernel's constraint
    (several reasons joined by "; "). Nothing is launched; the limits are the launchers' own checks
    (kernels/*.py) and Triton's block size cap.

    - frontend (kernels/logmel, chosen by the caller of this class): ``num_mel_bins`` in (80, 128).
    - encoder: LayerNorm width (``hidden_size`` <= 32768); RoPE block (next_pow2(heads) x next_pow2(rotary
      dim / 2) <= Triton's cap). GELU, the GEMMs (cuBLAS) and attention (torch SDPA) take any size.
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


def _share(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Point a reference Linear's weight at a slice of a fused matrix (no copy)."""
    linear.weight = nn.Parameter(rows, requires_grad=False)


class _EncoderLayerWeights:
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


class _DecoderLayerWeights:
    """Layer ``i``'s decoder weights as views of the stacked tensors (``_decoder_weights``): the fused ``[q; k;
    v]`` and ``[gate; up]`` matrices written straight into their slots, the reference modules' weights re-pointed
    to the same memory."""

    def __init__(self, layer, stack: "persistent_decode.PersistentWeights", i: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.w_qkv, self.w_o, self.w_gate_up, self.w_down = stack.wqkv[i], stack.wo[i], stack.wgu[i], stack.wdown[i]
        self.ln1, self.ln2 = stack.ln1[i], stack.ln2[i]
        torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], out=self.w_qkv)
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=self.w_gate_up)
        self.w_o.copy_(attn.o_proj.weight)
        self.w_down.copy_(mlp.down_proj.weight)
        self.ln1.copy_(layer.input_layernorm.weight)
        self.ln2.copy_(layer.post_attention_layernorm.weight)
        nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        _share(attn.q_proj, self.w_qkv[:nq])
        _share(attn.k_proj, self.w_qkv[nq:nq + nk])
        _share(attn.v_proj, self.w_qkv[nq + nk:])
        _share(attn.o_proj, self.w_o)
        inter = mlp.gate_proj.weight.shape[0]
        _share(mlp.gate_proj, self.w_gate_up[:inter])
        _share(mlp.up_proj, self.w_gate_up[inter:])
        _share(mlp.down_proj, self.w_down)
        layer.input_layernorm.weight = nn.Parameter(self.ln1, requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(self.ln2, requires_grad=False)


@torch.no_grad()
def _decoder_weights(modules) -> "tuple[list[_DecoderLayerWeights], persistent_decode.PersistentWeights]":
    """The decoder's weights stacked over layers, one tensor per kind (what the persistent decode step indexes by
    layer), and each layer's views of them. Each weight is copied once, into its slot; a layer's original tensors
    are freed as soon as its modules point at the stack."""
    first = modules[0]
    attn, mlp = first.self_attn, first.mlp

    def stacked(*parts):
        rows = sum(p.shape[0] for p in parts)
        return torch.empty((len(modules), rows, *parts[0].shape[1:]), device=parts[0].device, dtype=parts[0].dtype)

    stack = persistent_decode.PersistentWeights(
        stacked(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), stacked(attn.o_proj.weight),
        stacked(mlp.gate_proj.weight, mlp.up_proj.weight), stacked(mlp.down_proj.weight),
        stacked(first.input_layernorm.weight), stacked(first.post_attention_layernorm.weight))
    return [_DecoderLayerWeights(layer, stack, i) for i, layer in enumerate(modules)], stack


_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
         "math": "MATH"}


def _sdpa_backends(names: tuple[str, ...]):
    """Context: torch SDPA restricted to ``names``, tried in that order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA[n]) for n in names], set_priority=True)


def _flash_varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash-attention varlen forward takes the packed prefill: CUDA sm_80+, fp16/bf16, a head
    dim that is a multiple of 8 up to 256, and a torch built with it (not under the Triton interpreter)."""
    if device.type != "cuda" or interpreting() or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256 or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    return torch.backends.cuda.is_flash_attention_available()


class FastGlmAsrModel:
    """GLM-ASR on Triton kernels + cuBLAS GEMMs; see the module docstring."""

    # The engine runs its Triton step epilogue (kernels/greedy_commit.py) when this is true; set per instance
    # to whether the decoder runs on the kernels.
    uses_triton = True

    def __init__(self, reference: GlmAsrModel, encoder_graphs: bool = True, decode_gemm: str = "skinny",
                 decode_step: str = "chain"):
        if reference.device.type != "cuda" and not interpreting():
            raise ValueError("the Triton model path needs the weights on a CUDA device "
                             "(or TRITON_INTERPRET=1 for CPU testing)")
        # Decode-step GEMMs (one token per sequence): "skinny" for the GEMV kernels of kernels/skinny_gemm.py
        # (M <= 16, tuned table; cuBLAS above and where the sweep found cuBLAS faster), or "cublas".
        if decode_gemm not in ("cublas", "skinny"):
            raise ValueError(f"decode_gemm must be 'cublas' or 'skinny', got {decode_gemm!r}")
        self.decode_gemm = decode_gemm
        # A batch-1 decode step with the skinny GEMVs: "chain" one kernel per op (``decode``'s loop), or
        # "persistent" all layers in one launch (kernels/persistent_decode.py: grid barriers between stages, the
        # next matrix's first weight tiles in flight during each barrier). Other batch sizes: the chain. Chain by
        # default: on the H200 (2026-12-01, notes/decode_step.md) the persistent launch took 1.28 ms for the
        # layers at context 64 against ~1.20 ms for the chain's, and more at long contexts.
        if decode_step not in ("persistent", "chain"):
            raise ValueError(f"decode_step must be 'persistent' or 'chain', got {decode_step!r}")
        self.decode_step = decode_step
        # Decode steps (one token per row, <= 16 rows) as the fused chain (``_decode_step_fused``) when True; off:
        # measured on the H200 (benchmark.sh breakdown, 2026-12-01) 1.265 ms against the unfused chain's 1.268 at
        # batch 1 (the launches it saves are paid back by the row statistics each GEMV program computes after its
        # PDL wait) and 2.254 against 1.639 ms at batch 8 (16 padded rows of statistics per tensor-core program).
        self.fused_decode = False
        # Batch invariance (EngineOptions.batch_invariant; the engine's runner sets it): a decode row's numerics
        # must not depend on the rows beside it. The decode GEMVs and the lm head then run one config per shape
        # for every row count (skinny_gemm.linear_invariant), decode attention one pass per (row, kv head) (its
        # split count would follow the batch), and neither the persistent nor the fused step (batch-1 or
        # row-count-dependent paths).
        self.batch_invariant = False
        self.reference = reference
        self.cfg = cfg = reference.cfg
        # Parts whose config a kernel cannot serve run on the reference modules: the instance attributes below
        # shadow this class's methods, so nothing else dispatches. One warning per part, here, not mid-transcribe.
        # (The frontend is chosen by the caller: ``kernel_support(cfg)["frontend"]``.)
        self.kernel_support = kernel_support(cfg)
        self.fallbacks = {p: r for p, r in self.kernel_support.items() if r is not None and p != "frontend"}
        for part, reason in self.fallbacks.items():
            warnings.warn(f"GLM-ASR {part} runs on the plain PyTorch path instead of the Triton kernels: {reason}",
                          KernelFallbackWarning, stacklevel=2)
        if "encoder" in self.fallbacks:
            self.encode_audio = reference.encode_audio
            encoder_graphs = False
        if "decoder" in self.fallbacks:
            self.decode, self.logits, self.prefill = reference.decode, reference.logits, reference.prefill
            self.uses_triton = False
        enc, dec = reference.audio_tower, reference.language_model
        self.enc_layers = [] if "encoder" in self.fallbacks else [_EncoderLayerWeights(layer) for layer in enc.layers]
        self.dec_layers, self.dec_stack = ([], None) if "decoder" in self.fallbacks else _decoder_weights(dec.layers)
        self.conv1, self.conv2 = enc.conv1, enc.conv2
        self.enc_norm = (enc.norm.weight, enc.norm.bias)
        self.proj = reference.multi_modal_projector
        self.embedding = dec.embed_tokens.weight
        self.final_norm = dec.norm.weight
        self.lm_head = reference.lm_head.weight
        dev = reference.device
        self.enc_cos, self.enc_sin = build_rope_cache(cfg.audio.rotary_dim, cfg.audio.max_position_embeddings,
                                                      cfg.audio.rope_theta, device=dev)
        self.dec_cos, self.dec_sin = build_rope_cache(cfg.text.head_dim, cfg.text.max_position_embeddings,
                                                      cfg.text.rope_theta, device=dev)
        c = cfg.text
        self.persistent_support = (persistent_decode.supports(c.hidden_size, c.num_attention_heads,
                                                              c.num_key_value_heads, c.head_dim)
                                   if self.dec_stack is not None else "the decoder runs on the plain path")
        # the persistent step's activations and barrier counters (one engine stream launches it)
        self._persistent_ws = None if self.persistent_support else persistent_decode.PersistentWorkspace(
            self.dec_stack.wqkv.shape[1], c.num_attention_heads, c.head_dim, self.dec_stack.wdown.shape[2], dev,
            reference.dtype)
        # Encoder CUDA graphs per window-count bucket (ENCODER_BUCKETS): eager batch 1 is launch-bound (~400
        # launches from Python per pass).
        self.encoder_graphs = encoder_graphs and dev.type == "cuda"
        self._enc_graphs: dict[int, tuple] = {}
        self._enc_pool = cuda_graphs.GraphPool()
        # Encoder attention (1500 x 1500 per head, no mask): SDPA backends in priority order; the first that
        # supports the call runs (cuDNN's Hopper kernel first; fp32 falls through to the efficient/math ones).
        self.encoder_sdpa = ("cudnn", "flash", "efficient", "math")
        # Per encoder op, which implementation runs: "cublas" (F.linear; fc1 + the GELU kernel; o / fc2 with the
        # residual add inside the LayerNorm kernel) or "triton" (kernels/gemm_epilogue.py: bias, GELU and the
        # residual add in the GEMM's epilogue); attention "sdpa" (rope_ + torch SDPA + transpose copy), "triton"
        # (rope_ + kernels/encoder_attention.py writing o_proj's layout) or "triton-rope" (RoPE on load).
        # Chosen per op by measurement (ENCODER_KERNELS).
        self.encoder_kernels = dict(ENCODER_KERNELS)
        if interpreting():
            # 1500-frame attention takes minutes in Triton's CPU interpreter: CPU tests keep torch SDPA here (the
            # kernel's own tests and test_fast_path's switch test run it at short lengths)
            self.encoder_kernels["attention"] = "sdpa"
        # Decoder prefill (causal, GQA): cuDNN first. Measured on the H200 (2026-12-01, notes/measurements.md):
        # flash first gave 256 x 30 s at 128 slots RTFx 1745 against cuDNN's 3200, and choosing flash for a shape's
        # first occurrence only (cuDNN builds a plan per new shape) did not lift the mixed workload (first call /
        # warm 690 / 1722 against 836 / 1651) while it made a repeated prefill change numerics between its first
        # and second run; so one order for every shape.
        self.prefill_sdpa = ("cudnn", "flash", "efficient", "math")
        # Attention of the packed prefill (``prefill``): "flash-varlen" (one variable-length causal flash call over
        # all prompts: no padding, no per-shape plan) where torch's flash kernel takes the call, else "sdpa" (per
        # prompt, with ``prefill_sdpa``).
        self.packed_attention = "flash-varlen" if _flash_varlen_supported(reference.device, reference.dtype,
                                                                          cfg.text.head_dim) else "sdpa"

    @property
    def device(self) -> torch.device:
        return self.reference.device

    @property
    def dtype(self) -> torch.dtype:
        return self.reference.dtype

    # ---- audio ----
    # Window counts replayed from CUDA graphs: the launch-bound ones. From 3 windows on, a pass is GPU-bound
    # (~5 ms of GPU work per window against ~400 launches), so it runs eagerly: a graph would only add its capture
    # (one more pass) and its own activation memory to the first call of each new count.
    ENCODER_BUCKETS = (1, 2)

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel windows (W, n_mels, 3000) -> projected audio embeddings (W, 375, text_hidden).

        With graphs, a W in ENCODER_BUCKETS replays that bucket's graph; any other W runs eagerly."""
        w = features.shape[0]
        if not self.encoder_graphs or w not in self.ENCODER_BUCKETS or torch.cuda.is_current_stream_capturing():
            return self._encode_eager(features)
        return self._encode_graphed(features)

    def reset_encoder_graphs(self) -> None:
        """Drop the captured encoder graphs and their memory pool (after changing ``encoder_sdpa``). The pool
        handle goes too: capturing into the pool of freed graphs trips the caching allocator."""
        self._enc_graphs.clear()
        self._enc_pool.reset()

    def _encode_graphed(self, features: torch.Tensor) -> torch.Tensor:
        bucket = features.shape[0]
        if bucket not in self._enc_graphs:
            self._enc_graphs[bucket] = self._capture_encoder(bucket, features)
        graph, static_in, static_out = self._enc_graphs[bucket]
        static_in.copy_(features)
        graph.replay()
        return static_out.clone()

    def _capture_encoder(self, bucket: int, like: torch.Tensor):
        static_in = torch.zeros((bucket,) + tuple(like.shape[1:]), device=like.device, dtype=like.dtype)
        graph, static_out = cuda_graphs.capture(lambda: self._encode_eager(static_in), like.device,
                                                self._enc_pool.handle)
        return graph, static_in, static_out

    def _encode_eager(self, features: torch.Tensor) -> torch.Tensor:
        a = self.cfg.audio
        x = F.gelu(F.conv1d(features.to(self.dtype), self.conv1.weight, self.conv1.bias, padding=1))
        x = F.gelu(F.conv1d(x, self.conv2.weight, self.conv2.bias, stride=2, padding=1))
        residual = x.transpose(1, 2).contiguous()  # (W, T, hidden)
        w, t, hidden = residual.shape
        positions = torch.arange(t, device=x.device, dtype=torch.int32).expand(w, t)
        eps = a.layer_norm_eps
        h = layer_norm(residual, *self.enc_layers[0].ln1, eps)
        with _sdpa_backends(self.encoder_sdpa):
            h = self._encoder_layers(h, residual, positions)
        merged = h.reshape(w, t // self.cfg.merge_factor, hidden * self.cfg.merge_factor)
        p = self.proj
        return F.linear(gelu_bias(F.linear(merged, p.linear_1.weight), p.linear_1.bias),
                        p.linear_2.weight, p.linear_2.bias)

    def _encoder_layers(self, h: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The encoder layers; each op on the implementation ``encoder_kernels`` names for it. ``residual`` is
        this pass's own buffer (``_encode_eager`` made it), so the fused epilogues update it in place."""
        a = self.cfg.audio
        w, t, hidden = residual.shape
        eps = a.layer_norm_eps
        ek = self.encoder_kernels
        if any(ek[op] == "triton" for op in ("qkv", "o", "fc1", "fc2")):
            from glmasr_kernels import gemm_epilogue as ge
        if ek["attention"] in ("triton", "triton-rope"):
            from glmasr_kernels.encoder_attention import encoder_attention
        for i, lw in enumerate(self.enc_layers):
            if ek["qkv"] == "triton":
                qkv = ge.linear_bias(h, lw.w_qkv, lw.b_qkv)
            else:
                qkv = F.linear(h, lw.w_qkv, lw.b_qkv)
            qkv = qkv.view(w, t, 3, a.num_attention_heads, a.head_dim)
            if ek["attention"] in ("triton", "triton-rope"):
                # output (W, T, H, D): no transpose copy; "triton-rope" rotates q and k on load (no rope_ launch,
                # but every query block re-rotates the K tiles it reads: slower, measured), "triton" after rope_
                attn = encoder_attention(qkv, self.enc_cos, self.enc_sin, positions=positions,
                                         sm_scale=a.head_dim ** -0.5,
                                         rope_in_kernel=ek["attention"] == "triton-rope").view(w, t, hidden)
            else:
                q, k, v = qkv.unbind(2)
                rope_(q, k, positions, self.enc_cos, self.enc_sin)
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      scale=a.head_dim ** -0.5)
                attn = attn.transpose(1, 2).reshape(w, t, hidden)
            if ek["o"] == "triton":
                residual = ge.linear_bias_residual(attn, lw.w_o, lw.b_o, residual, out=residual)
                h = layer_norm(residual, *lw.ln2, eps)
            else:
                h, residual = layer_norm(F.linear(attn, lw.w_o, lw.b_o), *lw.ln2, eps, residual=residual)
            if ek["fc1"] == "triton":
                g = ge.linear_gelu(h, lw.w_fc1, lw.b_fc1)
            else:
                g = gelu_bias(F.linear(h, lw.w_fc1), lw.b_fc1)
            nxt = self.enc_layers[i + 1].ln1 if i + 1 < len(self.enc_layers) else self.enc_norm
            if ek["fc2"] == "triton":
                residual = ge.linear_bias_residual(g, lw.w_fc2, lw.b_fc2, residual, out=residual)
                h = layer_norm(residual, *nxt, eps)
            else:
                h, residual = layer_norm(F.linear(g, lw.w_fc2, lw.b_fc2), *nxt, eps, residual=residual)
        return h

    # ---- text ----
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder over embeddings (B, T, hidden) at positions (B, T), sequence b in cache row ``rows[b]``
        (default b); returns final-normed hidden states."""
        c = self.cfg.text
        b, t, hidden = embeds.shape
        nq, nk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        prefill = t > 1
        if prefill and kv_len != t:
            raise ValueError("the fast path prefills from slot 0 only (kv_len must equal the prompt length)")
        if not prefill and self._persistent_step_fits(b):
            return self._decode_step_persistent(embeds, positions, cache, kv_len, rows)
        if not prefill and self._fused_step_fits(b):
            return self._decode_step_fused(embeds, positions, cache, kv_len, rows)
        eps = c.rms_norm_eps
        residual = embeds
        h = rms_norm(embeds, self.dec_layers[0].ln1, eps)
        lengths = positions[:, 0] + 1 if not prefill else None
        linear, linear_swiglu = self._decode_linears(prefill)
        for i, lw in enumerate(self.dec_layers):
            qkv = linear(h, lw.w_qkv)
            q = qkv[..., : nq * d].view(b, t, nq, d)
            k = qkv[..., nq * d:(nq + nk) * d].view(b, t, nk, d)
            v = qkv[..., (nq + nk) * d:].view(b, t, nk, d)
            rope_and_append(q, k, v, positions, self.dec_cos, self.dec_sin, cache.k[i], cache.v[i], cache_rows=rows)
            if prefill:
                with _sdpa_backends(self.prefill_sdpa):
                    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True, scale=d ** -0.5, enable_gqa=nq != nk)
                attn = attn.transpose(1, 2).reshape(b, t, nq * d)
            else:
                attn = decode_attention(q[:, 0], cache.k[i], cache.v[i], lengths, max_len=kv_len, cache_rows=rows,
                                        sm_scale=d ** -0.5, num_splits=1 if self.batch_invariant else None
                                        ).reshape(b, 1, nq * d)
            h, residual = rms_norm(linear(attn, lw.w_o), lw.ln2, eps, residual=residual)
            mlp = linear(linear_swiglu(h, lw.w_gate_up), lw.w_down)
            nxt = self.dec_layers[i + 1].ln1 if i + 1 < len(self.dec_layers) else self.final_norm
            h, residual = rms_norm(mlp, nxt, eps, residual=residual)
        return h

    def prefill(self, embeds: list[torch.Tensor], cache: KVCache, rows: list[int]) -> torch.Tensor:
        """Prompts ``embeds[i]`` (L_i, hidden) into cache row ``rows[i]`` from slot 0, packed: their tokens in one
        (1, sum L_i, hidden) pass, each token with its own position and cache row, so the GEMMs see no padding,
        and attention is one variable-length causal call (``packed_attention``). Returns the final-normed hidden
        state of each prompt's last token (len(embeds), hidden); the last layer's MLP runs on those rows only.
        Same interface as ``GlmAsrModel.prefill``."""
        c = self.cfg.text
        nq, nk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        lengths = [int(e.shape[0]) for e in embeds]
        if len(rows) != len(lengths) or min(lengths, default=0) < 1:
            raise ValueError(f"prefill needs one cache row per prompt and non-empty prompts; got {len(rows)} rows "
                             f"for prompt lengths {lengths}")
        n, max_len = sum(lengths), max(lengths)
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        # per-token positions and cache rows, the prompts' boundaries (int32, as flash takes them): one copy, each
        # part at a 64-byte aligned offset (Triton specialises on pointer alignment: an odd token count would
        # otherwise compile another variant of the RoPE kernel)
        stride = -(-n // 16) * 16
        host = torch.zeros(2 * stride + len(starts), dtype=torch.int32)
        host[:n] = torch.cat([torch.arange(length, dtype=torch.int32) for length in lengths])
        host[stride:stride + n] = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int32), torch.tensor(lengths))
        host[2 * stride:] = torch.tensor(starts, dtype=torch.int32)
        dev_idx = host_to_device(host, self.device)
        positions, tok_rows = dev_idx[:n].view(1, n), dev_idx[stride:stride + n].view(1, n)
        cu = dev_idx[2 * stride:]
        last = (cu[1:] - 1).long()
        x = torch.cat(embeds)[None] if len(embeds) > 1 else embeds[0][None]
        residual = x
        h = rms_norm(x, self.dec_layers[0].ln1, eps)
        for i, lw in enumerate(self.dec_layers):
            qkv = F.linear(h, lw.w_qkv)
            q = qkv[..., : nq * d].view(1, n, nq, d)
            k = qkv[..., nq * d:(nq + nk) * d].view(1, n, nk, d)
            v = qkv[..., (nq + nk) * d:].view(1, n, nk, d)
            rope_and_append(q, k, v, positions, self.dec_cos, self.dec_sin, cache.k[i], cache.v[i],
                            cache_rows=tok_rows)
            attn = self._packed_attention(q[0], k[0], v[0], cu, starts, max_len).view(1, n, nq * d)
            h, residual = rms_norm(F.linear(attn, lw.w_o), lw.ln2, eps, residual=residual)
            if i + 1 == len(self.dec_layers):  # only the last tokens' hidden states are read
                h, residual = h[:, last], residual[:, last]
            mlp = F.linear(swiglu(F.linear(h, lw.w_gate_up)), lw.w_down)
            nxt = self.dec_layers[i + 1].ln1 if i + 1 < len(self.dec_layers) else self.final_norm
            h, residual = rms_norm(mlp, nxt, eps, residual=residual)
        return h[0]

    def _packed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                          starts: list[int], max_len: int) -> torch.Tensor:
        """Causal attention within each prompt of a packed prefill: q (N, Hq, D), k/v (N, Hk, D) (views into the
        QKV output), prompt i = rows [starts[i], starts[i+1]) (``cu`` the same boundaries on the device, int32);
        returns (N, Hq, D)."""
        scale = q.shape[-1] ** -0.5
        if self.packed_attention == "flash-varlen":
            # torch's flash-attention 2 varlen forward (GQA native: Hq a multiple of Hk), causal, no dropout
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                           scale=scale)[0]
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        with _sdpa_backends(self.prefill_sdpa):
            for s, e in zip(starts, starts[1:]):
                out[s:e] = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    is_causal=True, scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
        return out

    @property
    def _persistent_on(self) -> bool:
        """Whether batch-1 decode steps run as one persistent launch (``decode_step``, the skinny GEMVs, and a
        decoder shape the kernel serves)."""
        return (self._persistent_ws is not None and self.decode_step == "persistent" and self.decode_gemm == "skinny"
                and not self.batch_invariant)

    def _persistent_step_fits(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` rows runs as one persistent launch."""
        return batch == 1 and self._persistent_on

    def _decode_step_persistent(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                                rows: torch.Tensor | None) -> torch.Tensor:
        """One batch-1 decode step: every layer in one launch (kernels/persistent_decode.py), same roundings
        as the chain; then the final norm."""
        c = self.cfg.text
        hidden = embeds.shape[-1]
        res = embeds.reshape(1, hidden).clone()  # the kernel updates the residual stream in place
        persistent_decode.persistent_decode(res, self.dec_stack, cache.k, cache.v, self.dec_cos, self.dec_sin,
                                            positions[:, 0] + 1, self._persistent_ws, cache_rows=rows,
                                            max_len=kv_len, eps=c.rms_norm_eps, sm_scale=c.head_dim ** -0.5)
        return rms_norm(res, self.final_norm, c.rms_norm_eps).view(1, 1, hidden)

    @property
    def decode_error_flag(self) -> torch.Tensor | None:
        """(1,) int32 on the device, non-zero once a persistent decode launch gave up at a grid barrier (its
        programs were not co-resident, so the step's output is wrong); the engine reads it back with each round's
        tokens. None without the persistent step."""
        return self._persistent_ws.counters[2:3] if self._persistent_on else None

    def reset_decode_error(self) -> None:
        self._persistent_ws.reset()

    def _fused_step_fits(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` rows runs the fused chain (``fused_decode``, the skinny GEMMs, and
        a skinny config for each of the layer's four shapes at this row count)."""
        if not self.fused_decode or self.decode_gemm != "skinny" or self.batch_invariant:
            return False
        from glmasr_kernels.skinny_gemm import select

        c = self.cfg.text
        qkv_rows = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        inter = self.dec_layers[0].w_down.shape[1]
        return all(select(batch, n, k, sw) is not None for n, k, sw in (
            (qkv_rows, c.hidden_size, False), (c.hidden_size, c.num_attention_heads * c.head_dim, False),
            (2 * inter, c.hidden_size, True), (c.hidden_size, inter, False)))

    def _decode_step_fused(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                           rows: torch.Tensor | None) -> torch.Tensor:
        """One decode step (T == 1) as 5 launches per layer instead of 8: the RMSNorms run inside the GEMVs that
        read their output (prologue), the residual adds inside the GEMVs that produce them (epilogue, in place
        on one residual stream), RoPE + the KV append inside decode attention. Same roundings as ``decode``'s
        unfused chain (tests/test_fast_path.py compares the two)."""
        from glmasr_kernels.decode_attention import decode_attention_rope_append
        from glmasr_kernels.skinny_gemm import skinny_gemm, skinny_gemm_swiglu

        c = self.cfg.text
        b, _, hidden = embeds.shape
        nq, nk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        lengths = positions[:, 0] + 1
        res = embeds.view(b, hidden)
        for i, lw in enumerate(self.dec_layers):
            qkv = skinny_gemm(res, lw.w_qkv, norm_weight=lw.ln1, eps=eps)
            attn = decode_attention_rope_append(
                qkv[:, : nq * d].view(b, nq, d), qkv[:, nq * d:(nq + nk) * d].view(b, nk, d),
                qkv[:, (nq + nk) * d:].view(b, nk, d), self.dec_cos, self.dec_sin, cache.k[i], cache.v[i], lengths,
                max_len=kv_len, cache_rows=rows, sm_scale=d ** -0.5)
            # layer 0 starts the stream in a new buffer (the embeddings are the caller's); in place after that
            res = skinny_gemm(attn.view(b, nq * d), lw.w_o, residual=res, out=None if i == 0 else res)
            act = skinny_gemm_swiglu(res, lw.w_gate_up, norm_weight=lw.ln2, eps=eps)
            skinny_gemm(act, lw.w_down, residual=res, out=res)
        return rms_norm(res, self.final_norm, eps).view(b, 1, hidden)

    def _decode_linears(self, prefill: bool):
        """(linear, linear_swiglu) for this call: cuBLAS (+ the SwiGLU kernel), or the skinny GEMV kernels (their
        batch-invariant dispatchers with ``batch_invariant``, whatever ``decode_gemm`` says)."""
        if not prefill and (self.batch_invariant or self.decode_gemm == "skinny"):
            from glmasr_kernels import skinny_gemm

            if self.batch_invariant:
                return skinny_gemm.linear_invariant, skinny_gemm.linear_swiglu_invariant
            return skinny_gemm.linear, skinny_gemm.linear_swiglu
        return F.linear, lambda x, w: swiglu(F.linear(x, w))

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """lm head; fp32 unless ``upcast=False`` (the model dtype: the engine's greedy_commit reads it as is and
        casts each element to fp32 in registers, exactly what ``.float()`` gives, for both the argmax and the
        log-sum-exp of the chosen token's log-probability, so the cast kernel per step is saved)."""
        linear, _ = self._decode_linears(prefill=hidden.dim() > 2 and hidden.shape[-2] > 1)
        y = linear(hidden, self.lm_head)
        return y.float() if upcast else y
