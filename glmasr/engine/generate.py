"""Greedy decoding over a batch of prompts of different lengths (reference engine loop).

Each prompt is given as embeddings (text tokens with the audio rows already in place). The batch is
prefilled right-padded in one forward pass; every sequence keeps its own positions (0..L_i-1 for the prompt,
then L_i, L_i+1, ... for generated tokens), which are also its KV cache slots. Decoding then feeds one token
per sequence per step. A sequence stops at the first eos id ("stop") or after its own ``max_new_tokens``
("length"); finished sequences idle in place until the whole batch is done.
"""

from __future__ import annotations


import torch

from glmasr_kernels.greedy_commit import greedy_pick

from ..models.kv_cache import KVCache
from .request import GenerationRequest, GenerationResult


@torch.inference_mode()
def greedy_generate(model, requests: list[GenerationRequest], eos_token_ids, ignore_eos: bool = False
                    ) -> list[GenerationResult]:
    """Greedy decoding; ``ignore_eos`` forces exactly ``max_new_tokens`` tokens (for timing)."""
    if not requests:
        return []
    device, dtype = model.device, model.dtype
    batch = len(requests)
    lengths = [int(r.prompt_embeds.shape[0]) for r in requests]
    budgets = [int(r.max_new_tokens) for r in requests]
    if min(budgets) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
    capacity = max(l + m for l, m in zip(lengths, budgets))
    cache = KVCache(model.cfg.text, batch, capacity, device, dtype)

    longest = max(lengths)
    embeds = torch.zeros(batch, longest, requests[0].prompt_embeds.shape[1], device=device, dtype=dtype)
    for i, r in enumerate(requests):
        embeds[i, : lengths[i]] = r.prompt_embeds
    positions = torch.arange(longest, device=device).expand(batch, longest)
    hidden = model.decode(embeds, positions, cache, kv_len=longest)
    lengths_t = torch.tensor(lengths, device=device)
    last = hidden[torch.arange(batch, device=device), lengths_t - 1]
    next_tokens, next_logprobs = greedy_pick(model.logits(last))

    eos = set(int(e) for e in eos_token_ids)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    results: list[GenerationResult | None] = [None] * batch
    position = lengths_t.clone()  # where each sequence's next fed token goes
    for _ in range(max(budgets)):
        for i, (tok, lp) in enumerate(zip(next_tokens.tolist(), next_logprobs.tolist())):
            if results[i] is not None:
                continue
            if tok in eos and not ignore_eos:
                results[i] = GenerationResult(outputs[i], "stop", tok, logprobs[i])
                continue
            outputs[i].append(tok)
            logprobs[i].append(lp)
            if len(outputs[i]) >= budgets[i]:
                results[i] = GenerationResult(outputs[i], "length", None, logprobs[i])
        if all(r is not None for r in results):
            break
        # Finished rows keep feeding at a fixed, in-range slot; their outputs are ignored.
        feed_pos = torch.clamp(position, max=capacity - 1)
        hidden = model.decode(model.embed_tokens(next_tokens)[:, None], feed_pos[:, None], cache, kv_len=int(feed_pos.max()) + 1)
        next_tokens, next_logprobs = greedy_pick(model.logits(hidden[:, 0]))
        active = torch.tensor([r is None for r in results], device=device)
        position = position + active.to(position.dtype)
    return [r if r is not None else GenerationResult(outputs[i], "length", None, logprobs[i])
            for i, r in enumerate(results)]
