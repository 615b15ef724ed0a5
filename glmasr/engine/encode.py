"""The engine's encode stage: window groups -> prompt embeddings, on the device, without a host sync.

- ``window_features``: log-mel features (W, n_mels, 3000) of 30 s window pieces on the model's device: the
  fused CUDA frontend (``kernels/logmel``) or the plain-torch recipe (``glmasr.audio.features``).
- ``encode_groups``: the features + encoder + projector of the groups' windows in chunks of ``chunk`` windows,
  then each group's prompt embeddings with its audio placeholders replaced by its windows' audio rows.

A group (``pipeline.GroupPlan``, planned in the caller's thread) is read through three fields only:
``windows`` (sample arrays), ``window_tokens`` (audio tokens of each; 0: not encoded) and ``prompt_ids``.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..models.device import host_to_device
from ..audio.features import whisper_features


def window_features(pieces: list[np.ndarray], device: torch.device, frontend: str, n_mels: int) -> torch.Tensor:
    """Log-mel features (W, n_mels, 3000) of window pieces on ``device``: the fused CUDA frontend
    (``frontend="cuda"``), else the plain-torch recipe."""
    if frontend == "cuda":
        from glmasr_kernels.logmel import whisper_features as fused_whisper_features

        lengths = [int(p.shape[0]) for p in pieces]
        # Filled in place in a pinned buffer (torch's caching host allocator: reused, no page faults) and
        # copied without a host sync. No zero fill: the kernel reads samples at or past a row's length as 0.
        host = torch.empty((len(pieces), max(lengths)), dtype=torch.float32, pin_memory=True)
        rows = host.numpy()
        for i, p in enumerate(pieces):
            rows[i, : lengths[i]] = p
        pcm = host.to(device, non_blocking=True)
        return fused_whisper_features(pcm, host_to_device(lengths, device), n_mels)[0]
    return whisper_features(pieces, n_mels, device=device)[0]


def encode_groups(model, frontend: str, plans: list, chunk: int, audio_token_id: int, n_mels: int,
                  encode_audio: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[list[torch.Tensor], float]:
    """Prompt embeddings (L_g, hidden) of each group, and the host seconds spent packing samples. ``model``
    supplies ``device`` and ``embed_tokens``; the encoder is ``encode_audio`` (default ``model.encode_audio``;
    the runner passes its own, which replays CUDA graphs).

    Features + encoder run chunk by chunk with nothing waiting for the GPU, so the host packs chunk i+1 while
    the GPU encodes chunk i. A window that yields no audio token (a tail under 60 ms) is not encoded. The
    groups' prompts are embedded in one gather/scatter: the placeholder positions are known on the host."""
    encode_audio = encode_audio or model.encode_audio
    dev = model.device
    pieces, src_rows, row = [], [], 0
    for g in plans:
        rows_of_g = []
        for samples, tokens in zip(g.windows, g.window_tokens):
            if tokens > 0:
                pieces.append(samples)
                rows_of_g.append((row, tokens))
                row += 1
        src_rows.append(rows_of_g)
    packing_s = 0.0
    encoded = []
    for i in range(0, len(pieces), chunk):
        t0 = time.perf_counter()
        feats = window_features(pieces[i: i + chunk], dev, frontend, n_mels)
        packing_s += time.perf_counter() - t0
        encoded.append(encode_audio(feats))
    embeds = encoded[0] if len(encoded) == 1 else torch.cat(encoded)
    per_window = embeds.shape[1]

    ids: list[int] = []
    dst: list[int] = []  # rows of the flat prompt embeddings that take audio rows
    src: list[int] = []  # rows of the flat audio embeddings, in prompt order
    spans = []
    for g, rows_of_g in zip(plans, src_rows):
        base = len(ids)
        dst += [base + j for j, t in enumerate(g.prompt_ids) if t == audio_token_id]
        src += [r * per_window + j for r, tokens in rows_of_g for j in range(tokens)]
        spans.append((base, len(g.prompt_ids)))
        ids += g.prompt_ids
    if len(dst) != len(src):  # PromptBuilder.encode guarantees it; a mismatch here would be silent corruption
        raise RuntimeError(f"{len(dst)} audio placeholders in the prompts but {len(src)} audio rows")
    flat = model.embed_tokens(host_to_device(ids, dev))
    audio = embeds.reshape(-1, embeds.shape[-1]).index_select(0, host_to_device(src, dev))
    flat.index_copy_(0, host_to_device(dst, dev), audio.to(flat.dtype))
    return [flat[b: b + n] for b, n in spans], packing_s
