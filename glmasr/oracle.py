"""Teacher-forced logits of our model, to compare with other implementations (tests, device checks)."""

from __future__ import annotations

import torch

from .models.kv_cache import KVCache
from .options import DecodeOptions
from .pipeline import prepare_requests


@torch.inference_mode()
def teacher_forced_logits(asr, audio, forced_ids: list[int], prompt: str | None = None,
                          sampling_rate: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits (len(forced_ids) + 1, vocab), fp32, predicting each forced token and the one after it, for one
    audio of at most one window group. Also returns the prompt ids."""
    requests, plans = prepare_requests(asr, [audio], DecodeOptions(prompt=prompt), sampling_rate)
    if len(requests) != 1:
        raise ValueError("teacher forcing takes audio that fits one prompt (<= 630 s)")
    prompt_embeds = requests[0].prompt_embeds
    forced = torch.tensor(forced_ids, device=asr.device, dtype=torch.long)
    embeds = torch.cat([prompt_embeds, asr.model.embed_tokens(forced)])[None]
    total = embeds.shape[1]
    cache = KVCache(asr.config.text, 1, total, asr.device, asr.dtype)
    positions = torch.arange(total, device=asr.device)[None]
    hidden = asr.model.decode(embeds, positions, cache, kv_len=total)
    start = prompt_embeds.shape[0] - 1
    return asr.model.logits(hidden[0, start:]), plans[0].prompt_ids
