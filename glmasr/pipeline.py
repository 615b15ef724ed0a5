"""Audio -> engine work: 30 s windows and the prompts ("groups") they are packed into.

- ``plan_audio`` (host, cheap, the caller's thread): split 16 kHz samples into 30 s windows like the reference
  processor, count each window's audio tokens, pack consecutive windows into groups whose prompt + token budget
  fits the decoder's positions (at most 21 windows, the reference's cap), tokenize each group's prompt. The
  windows stay views into the caller's samples until they are encoded. ``plan_pieces``: one group per given
  piece of at most 30 s (the VAD's, up to ``DecodeOptions.max_segment_s`` with segmentation "vad", or the
  caller's); each piece is its own padded 30 s encoder window and its own prompt.
  ``DecodeOptions.forced_prefix_ids`` (a forced answer start) are appended to the prompt ids of the one group such
  audio must form (``GroupPlan.prefix_ids``), so the engine prefills them with the prompt and decodes on from there.
- The engine encodes the groups (``engine/encode.py``: features, encoder + projector, prompt embeddings).
- ``teacher_forced_logits``: our model's logits for forced tokens after an audio's prompt (the comparisons with
  transformers in the tests and the device checks).
- ``prepare_requests``: planning and encoding at once for a list of audios -> ``GenerationRequest``s (tests,
  the logits oracle, benchmarks that drive the engine below the request level).
"""

from __future__ import annotations

import math

import torch

from .audio import Audio, load_audio, split_windows
from .errors import AudioError
from .engine.encode import encode_groups
from .engine.request import GenerationRequest, GroupPlan
from .audio.features import SAMPLE_RATE, frames_to_audio_tokens, min_samples_for_one_token, num_valid_frames
from .models.kv_cache import KVCache
from .options import DecodeOptions

# The reference processor keeps at most int(655 // 30) = 21 windows (630 s) per prompt.
MAX_WINDOWS_PER_PROMPT = 21
# Default token budget: a generous bound on speech rate (fast speech is ~4-5 tokens/s) plus a margin,
# so long audio is never cut at a fixed count the way a fixed max_new_tokens=128 would cut it.
DEFAULT_TOKENS_PER_SECOND = 6.0
DEFAULT_MIN_NEW_TOKENS = 32


def default_max_new_tokens(seconds: float) -> int:
    return DEFAULT_MIN_NEW_TOKENS + math.ceil(DEFAULT_TOKENS_PER_SECOND * seconds)


def plan_groups(window_tokens: list[int], window_seconds: list[float], overhead: int, max_positions: int,
                max_new_tokens: int | None) -> list[tuple[list[int], int]]:
    """Pack windows into prompts that fit the context (prompt + token budget <= max_positions); returns
    (window indices, budget) per group."""
    groups: list[list[int]] = []
    tokens = seconds = 0.0
    for w, (t, s) in enumerate(zip(window_tokens, window_seconds)):
        if groups:
            budget = max_new_tokens or default_max_new_tokens(seconds + s)
            if len(groups[-1]) < MAX_WINDOWS_PER_PROMPT and overhead + tokens + t + budget <= max_positions:
                groups[-1].append(w)
                tokens += t
                seconds += s
                continue
        budget = max_new_tokens or default_max_new_tokens(s)
        if overhead + t + budget > max_positions:
            raise ValueError(f"max_new_tokens={budget} leaves no room for one 30 s window: the prompt needs "
                             f"{overhead + t} of the model's {max_positions} positions")
        groups.append([w])
        tokens, seconds = t, s
    return [(g, max_new_tokens or default_max_new_tokens(sum(window_seconds[w] for w in g))) for g in groups]


def check_duration(audio: Audio, merge_factor: int) -> None:
    min_samples = min_samples_for_one_token(merge_factor)
    n = audio.samples.shape[0]
    if n < min_samples:
        raise AudioError(f"{audio.source}: audio is too short ({n} samples = {1000 * audio.duration_s:.1f} ms at "
                         f"16 kHz); at least {min_samples} samples ({1000 * min_samples / SAMPLE_RATE:.1f} ms) "
                         f"are needed for one audio token")


def plan_audio(audio: Audio, prompts, config, decode: DecodeOptions, device=None) -> list[GroupPlan]:
    """The groups of one audio (see the module docstring); raises AudioError / ValueError naming the problem.
    ``decode.segmentation`` "windows": 30 s windows grouped like the reference processor (token-exact with
    transformers); "vad": speech regions (Silero VAD, ``glmasr.audio.vad``, on ``device``) merged into pieces, one
    prompt each, each a segment with the piece's own start and end (speech times, not window times):
    ``decode.max_segment_s`` None packs them into pieces of up to 30 s (the fewest prompts); a number S gives
    speech-shaped pieces of at most S seconds cut at pauses (``vad.segment_options``, ``vad.merge_regions``).
    ``max_segment_s`` is not used with "windows"."""
    check_duration(audio, config.merge_factor)
    if decode.segmentation == "vad":
        from .audio.vad import segment, segment_options

        pieces = segment(audio.samples, device=device, **segment_options(decode.max_segment_s))
        return plan_pieces(audio, pieces, prompts, config, decode)
    overhead = len(prompts.encode(1, decode.prompt)) - 1 + len(decode.forced_prefix_ids)
    windows = split_windows(audio.samples)
    tokens = [max(0, int(frames_to_audio_tokens(num_valid_frames(w.shape[0]), config.merge_factor)))
              for w in windows]
    seconds = [w.shape[0] / SAMPLE_RATE for w in windows]
    try:
        groups = plan_groups(tokens, seconds, overhead, config.text.max_position_embeddings, decode.max_new_tokens)
    except ValueError as e:
        if not decode.forced_prefix_ids:
            raise
        raise ValueError(f"{e} (forced_prefix_ids are {len(decode.forced_prefix_ids)} of them)") from None
    plans = []
    for idx, budget in groups:
        wt = [tokens[i] for i in idx]
        plans.append(GroupPlan([windows[i] for i in idx], wt, sum(seconds[i] for i in idx), budget,
                               prompts.encode(sum(wt), decode.prompt), start_s=sum(seconds[: idx[0]])))
    return force_prefix(plans, audio, config, decode)


def plan_pieces(audio: Audio, pieces: list[tuple[float, float]], prompts, config, decode: DecodeOptions
                ) -> list[GroupPlan]:
    """One prompt per piece (start_s, end_s) of the recording, each at most 30 s: its samples, its true start and
    length. Pieces too short for one audio token are dropped (no text can come from them); none left: no prompt."""
    n = audio.samples.shape[0]
    plans = []
    for start_s, end_s in pieces:
        if not 0 <= start_s < end_s or end_s - start_s > 30.0 + 1e-6:
            raise ValueError(f"{audio.source}: a piece must lie in [0, duration) and last at most 30 s, got "
                             f"({start_s:.3f}, {end_s:.3f})")
        a, b = int(round(start_s * SAMPLE_RATE)), min(n, int(round(end_s * SAMPLE_RATE)))
        tokens = max(0, int(frames_to_audio_tokens(num_valid_frames(b - a), config.merge_factor))) if b > a else 0
        if tokens == 0:
            continue
        seconds = (b - a) / SAMPLE_RATE
        plans.append(GroupPlan([audio.samples[a:b]], [tokens], seconds, decode.max_new_tokens or
                               default_max_new_tokens(seconds), prompts.encode(tokens, decode.prompt),
                               start_s=a / SAMPLE_RATE))
    return force_prefix(plans, audio, config, decode)


def force_prefix(plans: list[GroupPlan], audio: Audio, config, decode: DecodeOptions) -> list[GroupPlan]:
    """``decode.forced_prefix_ids`` appended to the prompt of the one group (``GroupPlan.prefix_ids``); a
    ValueError naming the field for audio that forms another number of groups, an id outside the model's
    vocabulary or equal to its audio placeholder, or a prompt + prefix + budget past the model's positions."""
    prefix = list(decode.forced_prefix_ids)
    if not prefix:
        return plans
    if len(plans) != 1:
        raise ValueError(f"{audio.source}: forced_prefix_ids needs audio that forms one prompt group (a 30 s "
                         f"window, or one piece); this audio ({audio.duration_s:.1f} s) forms {len(plans)}")
    vocab = config.text.vocab_size
    for i, t in enumerate(prefix):
        if t >= vocab:
            raise ValueError(f"forced_prefix_ids[{i}] = {t} is outside the model's vocabulary (size {vocab})")
        if t == config.audio_token_id:
            raise ValueError(f"forced_prefix_ids[{i}] = {t} is the audio placeholder token, which cannot be "
                             f"forced")
    plan = plans[0]
    positions = len(plan.prompt_ids) + len(prefix) + plan.max_new_tokens
    limit = config.text.max_position_embeddings
    if positions > limit:
        raise ValueError(f"forced_prefix_ids ({len(prefix)} tokens) + the prompt ({len(plan.prompt_ids)}) + "
                         f"max_new_tokens ({plan.max_new_tokens}) need {positions} positions, more than the "
                         f"model's {limit}")
    plan.prompt_ids = plan.prompt_ids + prefix
    plan.prefix_ids = prefix
    return plans


def prepare_requests(asr, audios: list, decode: DecodeOptions | None = None, sampling_rate: int | None = None
                     ) -> tuple[list[GenerationRequest], list[GroupPlan]]:
    """All groups of all ``audios``, encoded now (eagerly: no graph), as ``GenerationRequest``s (in order) and their
    plans."""
    decode = decode or DecodeOptions()
    plans = [p for a in audios for p in plan_audio(load_audio(a, sampling_rate), asr.prompts, asr.config, decode)]
    with torch.inference_mode():
        embeds, _ = encode_groups(asr.model, asr.frontend, plans, asr.options.encoder_chunk,
                                  asr.config.audio_token_id, asr.config.audio.num_mel_bins)
    return [GenerationRequest(e, p.max_new_tokens) for e, p in zip(embeds, plans)], plans


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
