"""The model interface the engine runs: what ``engine/model_runner.py`` may call, and nothing else (plus
``encode_states``, which only aligners call, outside the engine and its graphs).

Two implementations satisfy it: ``GlmAsrModel`` (models/glmasr.py, the plain-PyTorch reference, any device) and
``FastGlmAsrModel`` (models/fast.py, the GPU path on Triton kernels). A model is graph-free: CUDA graphs of
its calls (encoder window buckets, prefill length buckets, decode batch x KV-length buckets) are captured and
held by the runner, through ``glmasr.engine.cuda_graphs``, so every call below must be capturable when it runs on
CUDA with the Triton decoder or encoder (no host sync, no allocation that outlives the call except its output).

Capability flags (plain attributes, fixed at construction):

- ``triton_encoder``: the encoder runs on the Triton kernels. The runner then replays launch-bound window
  counts from CUDA graphs and compiles the encoder's kernels in its dry pass (``compile_kernels``).
- ``triton_decoder``: the decoder runs on the Triton kernels. The runner then commits a decode step's tokens
  with the fused ``greedy_commit`` kernel on ``logits(..., upcast=False)`` (the model dtype; the kernel casts to
  fp32 in registers), and ``batch_invariant`` is honoured on CUDA (``model_runner.check_batch_invariance``).

``batch_invariant`` (settable; the runner sets it before each of its prefills, decode rounds and dry passes,
since two runners may share one model): a decode row's numerics must not depend on the rows beside it. A
model without row-count-dependent kernels ignores it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .config import GlmAsrConfig
from .kv_cache import KVCache


@runtime_checkable
class AsrModel(Protocol):
    cfg: GlmAsrConfig
    triton_encoder: bool
    triton_decoder: bool
    batch_invariant: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel windows (W, n_mels, 3000) -> projected audio embeddings (W, 375, text_hidden)."""
        ...

    def encode_states(self, features: torch.Tensor, frames=None) -> torch.Tensor:
        """Log-mel windows (W, n_mels, F) of any length F <= 3000 (unpadded audio gives states of exactly that
        audio) -> the audio encoder's final-normed states before the projector, (W, ceil(F / 2), audio_hidden),
        50 per second, in the model dtype. ``frames`` (W,): windows of different lengths in one call, window i
        computed as if alone at frames[i] frames (its first ceil(frames[i] / 2) states; the rest mean nothing).
        For aligners (glmasr.align); an eager call, never graph-captured."""
        ...

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (...) -> embeddings (..., text_hidden) in the model dtype."""
        ...

    def prefill(self, embeds: list[torch.Tensor], cache: KVCache, rows: list[int]) -> torch.Tensor:
        """Prompts ``embeds[i]`` (L_i, hidden) into cache row ``rows[i]`` from slot 0, all in one call; returns
        the final-normed hidden state of each prompt's last token (len(embeds), hidden)."""
        ...

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder over embeddings (B, T, hidden) at ``positions`` (B, T), sequence b in cache row ``rows[b]``
        (default b), attending to cache slots [0, kv_len); returns final-normed hidden states (B, T, hidden).
        Either one decode step (T == 1, per-sequence positions) or a prefill from slot 0 (positions 0..T-1 in every row, kv_len == T: the runner's one-prompt prefill graphs,
        right-padded to their bucket)."""
        ...

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The lm head on hidden states (..., hidden) -> (..., vocab): fp32, or the model dtype with
        ``upcast=False``."""
        ...
