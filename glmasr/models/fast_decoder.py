"""The text decoder and lm head of the GPU path, on the fused weight cache (models/fast_weights.py).

- ``forward`` (``FastGlmAsrModel.decode``): the decoder over (B, T) embeddings. A decode step (T == 1): per
  layer RMSNorm (``kernels/rmsnorm.py``, the residual add fused into the next one), the fused qkv GEMV, RoPE +
  KV append in one launch (``kernels/rope.py``), decode attention straight from the KV buffer with
  per-sequence lengths (``kernels/decode_attention.py``; split launches combine in-kernel through
  ``attn_counters``), o_proj, the gate|up GEMV fused with SwiGLU and down_proj, every GEMM on
  ``kernels/skinny_gemm.py`` (its dispatchers pick cuBLAS where the table says so or above 16 rows) except the
  shapes ``CUDA_GEMV_SHAPES`` routes to the CUDA GEMV (``kernels/cuda_gemv.py``); at one row with bf16 weights the
  qkv CUDA GEMV also does the RoPE + KV append (``QKV_ROPE_WEIGHTS``). A prefill from slot 0 (T > 1, the runner's
  one-prompt graphs): cuBLAS GEMMs, the SwiGLU kernel and causal torch SDPA (cuDNN first).
- ``prefill``: every admitted prompt in one (1, sum L, hidden) pass, no padding: each token carries its own
  position and cache row into ``rope_and_append``, attention is one variable-length causal flash-attention call
  (per prompt torch SDPA where flash cannot: fp32, the interpreter), and the last layer's MLP runs on each
  prompt's last token only.
- ``logits``: the lm head on the skinny GEMV for up to 16 rows.

Batch invariance (``invariant=True``, the model's ``batch_invariant``): the decode GEMVs and the lm head run one
config per shape for every row count (``skinny_gemm.linear_invariant``) and decode attention one pass per (row,
kv head) (its split count would follow the batch), so a row's numerics do not depend on the rows beside it.

int8 decode weights (opt-in, ``decode_weights="int8"``): a decode step of at most ``INT8_MAX_ROWS`` rows (any
number with ``invariant``) runs its four GEMVs per layer (qkv, o_proj, gate|up + SwiGLU, down_proj) on per-row int8
copies of the matrices (``fast_weights.Int8Matrix``; the kernel upcasts in registers and applies the row scale in
its epilogue, ``kernels/skinny_gemm.py``; more than 16 rows: 16 at a time, never cuBLAS); larger steps use the
bf16 matrices, where they are faster; activations, norms, attention and the KV cache stay in the model's
dtype. The prefill keeps the bf16 matrices on cuBLAS and the lm head stays bf16, so the bf16 matrices stay
loaded and the int8 copies cost memory on top (about 1.35 GB for the full-size model: 28 layers of 48.2 M
weights, plus 2 MB of scales), while a batch-1 decode step streams ~1.6 GB instead of ~2.9 GB. Batch
invariance holds in int8 too (the invariant dispatchers take the int8 weights). Accuracy: the quantized
weights change the logits (error ~ the weights' relative step, 1/254 of each row's largest value); only logit
error and top-1 agreement against bf16 can be measured without labelled speech
(``scripts/bench/int8_agreement.py``); WER must be checked on the user's data.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from glmasr_kernels import cuda_gemv, skinny_gemm
from glmasr_kernels._triton_utils import interpreting
from glmasr_kernels.activations import swiglu
from glmasr_kernels.decode_attention import decode_attention, new_counters
from glmasr_kernels.rmsnorm import rms_norm
from glmasr_kernels.rope import build_rope_cache, rope_and_append

from .device import host_to_device
from .fast_weights import check_decode_weights, decoder_weights
from .kv_cache import KVCache
from .layers import sdpa_backends

# Decode steps of at most this many rows use the int8 copies; larger ones the bf16 matrices (loaded anyway). The int8
# kernels gain on the GEMVs' FMA path (1-2 rows) and lose from the tensor-core path up, where the int8 tile's
# conversion in registers costs more than its bytes save (notes/measurements.md, ninth session). Batch-invariant
# steps use the int8 copies at every row count, so a row's numerics never depend on the batch.
INT8_MAX_ROWS = 2

# Decode GEMV shapes (W rows, K, rows of x, SwiGLU) that run on the CUDA GEMV (kernels/cuda_gemv.py) instead of
# the Triton skinny kernel: those where it measured faster on the H200 (notes/measurements.md, tenth session: at one
# row qkv, o_proj and down_proj 1.1-1.6x, gate|up + SwiGLU equal; 28 layers chained 0.748 vs 0.898 ms; the lm head
# equal, left on Triton). The same four with the int8 decode weights (chained 0.532 vs 0.651 ms).
CUDA_GEMV_SHAPES: frozenset[tuple[int, int, int, bool]] = frozenset({
    (3072, 2048, 1, False), (2048, 2048, 1, False), (12288, 2048, 1, True), (2048, 6144, 1, False)})
CUDA_GEMV_INT8_SHAPES: frozenset[tuple[int, int, int, bool]] = CUDA_GEMV_SHAPES


# The decode weights ("bf16" / "int8") whose one-row decode step runs RoPE + KV append in the qkv CUDA GEMV's
# epilogue (``cuda_gemv.gemv_qkv_rope``: one launch less per layer, bit-identical results). Measured on the H200
# (notes/measurements.md, eleventh session): bf16 1.141 -> 1.095 ms per token at context 64; int8 no better (-0.012
# to +0.025 ms across contexts), so int8 keeps the separate RoPE kernel.
QKV_ROPE_WEIGHTS: frozenset[str] = frozenset({"bf16"})

# A decode step's positions are written by the previous step's commit and its lengths by an ordinary (non-PDL)
# launch before the first layer, so they are settled before any of the layers' PDL kernels starts: the qkv GEMV's
# RoPE epilogue and decode attention's one-tile programs read them before their PDL wait
# (``cuda_gemv.RopeAppend.settled``, ``decode_attention(lengths_settled=)``), off each layer's critical path.
SETTLED_INPUTS_EARLY = True


def _cuda_gemv_takes(x: torch.Tensor, w: torch.Tensor, scale, swiglu: bool) -> bool:
    return _cuda_gemv_routes(w, scale, x.numel() // x.shape[-1], swiglu, x.device)


def _cuda_gemv_routes(w: torch.Tensor, scale, m: int, swiglu: bool, device: torch.device) -> bool:
    """Whether W (with its int8 ``scale``) at ``m`` rows of x runs on the CUDA GEMV (the routing tables)."""
    if device.type != "cuda":
        return False
    table = CUDA_GEMV_INT8_SHAPES if scale is not None else CUDA_GEMV_SHAPES
    if not table or w.dtype != (torch.int8 if scale is not None else torch.bfloat16):
        return False
    return (w.shape[0], w.shape[1], m, swiglu) in table and cuda_gemv.is_available(device)


def prebuild_cuda_gemv(device: torch.device) -> int:
    """Compile (or find in the disk cache) the CUDA GEMV cubins of ``CUDA_GEMV_SHAPES`` for ``device`` (NVRTC, well
    under a second each): ``load`` runs this in a background thread while the weights stream in, so the first
    decode step finds them built. Returns how many there are (0 where the CUDA GEMV cannot run)."""
    global CUDA_GEMV_SHAPES, CUDA_GEMV_INT8_SHAPES
    if not (CUDA_GEMV_SHAPES or CUDA_GEMV_INT8_SHAPES) or not cuda_gemv.is_available(device):
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    configs = []
    for table, kind in ((CUDA_GEMV_SHAPES, "bf16"), (CUDA_GEMV_INT8_SHAPES, "int8")):
        for n, k, m, glu in sorted(table):
            cfg = cuda_gemv.select(n, k, glu, m, int8=kind == "int8")
            configs.append(cfg)
            if cfg is not None and kind in QKV_ROPE_WEIGHTS and cuda_gemv.has_rope_form(n, k, m, glu):
                configs.append(cuda_gemv.rope_config(cfg))
    try:
        return len(cuda_gemv.prebuild([c for c in configs if c is not None], sm=10 * major + minor))
    except Exception as e:  # an NVRTC that cannot build them: the Triton GEMVs take every shape
        logging.getLogger("glmasr").warning("the CUDA decode GEMVs could not be built (%s: %s); the Triton ones "
                                            "run instead", type(e).__name__, e)
        CUDA_GEMV_SHAPES = CUDA_GEMV_INT8_SHAPES = frozenset()
        return 0


def _decode_linear(x: torch.Tensor, w: torch.Tensor, scale=None) -> torch.Tensor:
    """A decode step's GEMM: the CUDA GEMV where ``CUDA_GEMV_SHAPES`` lists the shape, else ``skinny_gemm``."""
    if _cuda_gemv_takes(x, w, scale, False):
        return cuda_gemv.gemv(x, w, scale=scale)
    return skinny_gemm.linear(x, w, scale=scale)


def _decode_linear_swiglu(x: torch.Tensor, w: torch.Tensor, scale=None) -> torch.Tensor:
    if _cuda_gemv_takes(x, w, scale, True):
        return cuda_gemv.gemv_swiglu(x, w, scale=scale)
    return skinny_gemm.linear_swiglu(x, w, scale=scale)


def flash_varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash-attention varlen forward takes the packed prefill: CUDA sm_80+, fp16/bf16, a head
    dim that is a multiple of 8 up to 256, and a torch built with it (not under the Triton interpreter)."""
    if device.type != "cuda" or interpreting() or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256 or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    return torch.backends.cuda.is_flash_attention_available()


def _cublas(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill's GEMM on cuBLAS (the bf16 matrices: a prefill never gets a scale)."""
    return F.linear(x, w)


def _cublas_swiglu(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    return swiglu(F.linear(x, w))


class KernelDecoder:
    """The decoder layers, final norm and lm head of a loaded reference model, on the kernels. ``decode_weights``
    ("bf16" or "int8", ``fast_weights.DECODE_WEIGHTS``): the matrices of the decode step's GEMVs (module
    docstring; "int8" quantizes every layer now and keeps the bf16 matrices too)."""

    def __init__(self, reference, decode_weights: str = "bf16"):
        check_decode_weights(decode_weights)
        dec = reference.language_model
        self.cfg = c = reference.cfg.text
        self.device = reference.device
        self.decode_weights = decode_weights
        self.layers = decoder_weights(dec.layers)
        if decode_weights == "int8":
            for lw in self.layers:
                lw.add_int8()
        self.final_norm = dec.norm.weight
        # decode attention's split programs combine in the last one per (sequence, kv head) through these
        # counters (no second kernel); this decoder's steps run one at a time (one engine, one stream)
        self.attn_counters = new_counters(reference.device)
        self.lm_head = reference.lm_head.weight
        self.cos, self.sin = build_rope_cache(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                              device=reference.device)
        # attention of the packed prefill: "flash-varlen" (one variable-length causal flash call over all
        # prompts: no padding, no per-shape plan) where torch's flash kernel takes the call, else "sdpa" (per
        # prompt, torch SDPA in SDPA_ORDER)
        self.packed_attention = ("flash-varlen" if flash_varlen_supported(reference.device, reference.dtype,
                                                                           c.head_dim) else "sdpa")

    def weight_bytes(self) -> int:
        """Bytes of the matrices a decode step streams: every layer's four (with "int8": the int8 copies and
        their scales) and the lm head (always the model's dtype)."""
        if self.decode_weights == "int8":
            layers = sum(m.nbytes() for lw in self.layers for m in lw.int8.matrices())
        else:
            layers = sum(t.numel() * t.element_size() for lw in self.layers for t in lw.tensors())
        return layers + self.lm_head.numel() * self.lm_head.element_size()

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                rows: torch.Tensor | None, invariant: bool) -> torch.Tensor:
        """``AsrModel.decode`` (models/interface.py): embeddings (B, T, hidden) at positions (B, T), sequence b in
        cache row ``rows[b]`` (default b); returns final-normed hidden states. A prefill (T > 1) starts at slot
        0 (kv_len == T)."""
        c = self.cfg
        b, t, hidden = embeds.shape
        nq, nk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        prefill = t > 1
        if prefill and kv_len != t:
            raise ValueError("the fast path prefills from slot 0 only (kv_len must equal the prompt length)")
        eps = c.rms_norm_eps
        int8 = self.decode_weights == "int8" and not prefill and (invariant or b <= INT8_MAX_ROWS)
        rope_in_qkv = b * t == 1 and not invariant and self._rope_in_qkv(embeds, int8)
        residual = embeds
        lengths = positions[:, 0] + 1 if not prefill else None  # an ordinary launch: settled (SETTLED_INPUTS_EARLY)
        h = rms_norm(embeds, self.layers[0].ln1, eps)
        linear, linear_swiglu = self._linears(prefill, invariant)
        for i, lw in enumerate(self.layers):
            (w_qkv, s_qkv), (w_o, s_o), (w_gate_up, s_gate_up), (w_down, s_down) = self._matrices(lw, int8)
            if rope_in_qkv:
                rope = cuda_gemv.RopeAppend(positions.reshape(1), self.cos, self.sin, cache.k[i], cache.v[i], nq, nk,
                                            d, None if rows is None else rows.reshape(1), settled=SETTLED_INPUTS_EARLY)
                q = cuda_gemv.gemv_qkv_rope(h, w_qkv, rope, scale=s_qkv).view(b, t, nq, d)
            else:
                qkv = linear(h, w_qkv, scale=s_qkv)
                q = qkv[..., : nq * d].view(b, t, nq, d)
                k = qkv[..., nq * d:(nq + nk) * d].view(b, t, nk, d)
                v = qkv[..., (nq + nk) * d:].view(b, t, nk, d)
                rope_and_append(q, k, v, positions, self.cos, self.sin, cache.k[i], cache.v[i], cache_rows=rows)
            if prefill:
                with sdpa_backends():
                    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True, scale=d ** -0.5, enable_gqa=nq != nk)
                attn = attn.transpose(1, 2).reshape(b, t, nq * d)
            else:
                attn = decode_attention(q[:, 0], cache.k[i], cache.v[i], lengths, max_len=kv_len, cache_rows=rows,
                                        sm_scale=d ** -0.5, num_splits=1 if invariant else None,
                                        counters=self.attn_counters,
                                        lengths_settled=SETTLED_INPUTS_EARLY).reshape(b, 1, nq * d)
            h, residual = rms_norm(linear(attn, w_o, scale=s_o), lw.ln2, eps, residual=residual)
            mlp = linear(linear_swiglu(h, w_gate_up, scale=s_gate_up), w_down, scale=s_down)
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.final_norm
            h, residual = rms_norm(mlp, nxt, eps, residual=residual)
        return h

    def _rope_in_qkv(self, embeds: torch.Tensor, int8: bool) -> bool:
        """Whether a one-row decode step runs RoPE + KV append in the qkv GEMV (``QKV_ROPE_WEIGHTS``): its weights'
        kind listed, the qkv GEMV on the CUDA GEMV, bf16 activations, full-width rotary."""
        if ("int8" if int8 else "bf16") not in QKV_ROPE_WEIGHTS or embeds.dtype != torch.bfloat16 \
                or self.cos.shape[1] * 2 != self.cfg.head_dim:
            return False
        w, scale = self._matrices(self.layers[0], int8)[0]
        return _cuda_gemv_routes(w, scale, 1, False, embeds.device)

    @staticmethod
    def _matrices(lw, int8: bool) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight, scale) of a layer's qkv, o, gate|up and down GEMMs: the int8 copies with their row scales, or
        the model's matrices with no scale."""
        if int8:
            return tuple((m.q, m.scale) for m in lw.int8.matrices())
        return tuple((w, None) for w in lw.tensors())

    def prefill(self, embeds: list[torch.Tensor], cache: KVCache, rows: list[int]) -> torch.Tensor:
        """``AsrModel.prefill``: prompts ``embeds[i]`` (L_i, hidden) into cache row ``rows[i]`` from slot 0, packed
        (module docstring). Returns the final-normed hidden state of each prompt's last token (len(embeds),
        hidden)."""
        c = self.cfg
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
        h = rms_norm(x, self.layers[0].ln1, eps)
        for i, lw in enumerate(self.layers):
            qkv = F.linear(h, lw.w_qkv)
            q = qkv[..., : nq * d].view(1, n, nq, d)
            k = qkv[..., nq * d:(nq + nk) * d].view(1, n, nk, d)
            v = qkv[..., (nq + nk) * d:].view(1, n, nk, d)
            rope_and_append(q, k, v, positions, self.cos, self.sin, cache.k[i], cache.v[i], cache_rows=tok_rows)
            attn = self._packed_attention(q[0], k[0], v[0], cu, starts, max_len).view(1, n, nq * d)
            h, residual = rms_norm(F.linear(attn, lw.w_o), lw.ln2, eps, residual=residual)
            if i + 1 == len(self.layers):  # only the last tokens' hidden states are read
                h, residual = h[:, last], residual[:, last]
            mlp = F.linear(swiglu(F.linear(h, lw.w_gate_up)), lw.w_down)
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.final_norm
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
        with sdpa_backends():
            for s, e in zip(starts, starts[1:]):
                out[s:e] = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    is_causal=True, scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
        return out

    @staticmethod
    def _linears(prefill: bool, invariant: bool):
        """(linear, linear_swiglu) for a call, each ``f(x, w, scale=None)``: a prefill's GEMMs on cuBLAS (+ the
        SwiGLU kernel), a decode step's on the skinny GEMV kernels (their batch-invariant dispatchers with
        ``invariant``), which take an int8 ``w`` with its ``scale``."""
        if prefill:
            return _cublas, _cublas_swiglu
        if invariant:
            return skinny_gemm.linear_invariant, skinny_gemm.linear_swiglu_invariant
        return _decode_linear, _decode_linear_swiglu

    def logits(self, hidden: torch.Tensor, upcast: bool, invariant: bool) -> torch.Tensor:
        """lm head; fp32 unless ``upcast=False`` (the model dtype: the engine's greedy_commit reads it as is and
        casts each element to fp32 in registers, exactly what ``.float()`` gives, for both the argmax and the
        log-sum-exp of the chosen token's log-probability, so the cast kernel per step is saved)."""
        linear, _ = self._linears(hidden.dim() > 2 and hidden.shape[-2] > 1, invariant)
        y = linear(hidden, self.lm_head)
        return y.float() if upcast else y
