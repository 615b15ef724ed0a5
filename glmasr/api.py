"""Public API: ``load`` a checkpoint, ``transcribe`` audio.

Data flow of ``transcribe``: audio inputs -> 16 kHz mono (``audio.py``) -> 30 s windows -> groups of windows
that fit the decoder's context (one group per audio up to 630 s, the reference's cap) -> log-mel features of
all windows at once (``features.py``) -> encoder + projector over all windows -> one prompt per group with its
audio rows in place (``tokenizer.py``) -> greedy decoding of all groups as one batch (``engine/generate.py``)
-> text per audio (groups of one audio joined with a space).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .audio import Audio, AudioError, load_audio, split_windows
from .config import GlmAsrConfig
from .engine.engine import Engine, host_to_device
from .engine.generate import GenerationRequest
from .engine.kv_cache import KVCache
from .features import (SAMPLE_RATE, frames_to_audio_tokens, min_samples_for_one_token, num_valid_frames,
                       whisper_features)
from .models.glmasr import GlmAsrModel
from .tokenizer import PromptBuilder
from .weights import DEFAULT_MODEL_ID, load_state_dict, read_config, resolve_checkpoint

# The reference processor keeps at most int(655 // 30) = 21 windows (630 s) per prompt.
MAX_WINDOWS_PER_PROMPT = 21
# Default token budget: a generous bound on speech rate (fast speech is ~4-5 tokens/s) plus a margin,
# so long audio is never cut at a fixed count the way a fixed max_new_tokens=128 would cut it.
DEFAULT_TOKENS_PER_SECOND = 6.0
DEFAULT_MIN_NEW_TOKENS = 32
# Windows encoded per encoder call (bounds activation memory; attention is 1500 x 1500 per head).
ENCODER_BATCH = 32
# Sequence slots of the engine on CUDA (its KV cache is slots x capacity).
DEFAULT_MAX_BATCH = 64


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop": an eos token ended every group; "length": a token budget ran out
    duration_s: float
    num_windows: int
    num_audio_tokens: int = 0
    num_groups: int = 1
    timings_ms: dict = field(default_factory=dict)


class GlmAsr:
    """A loaded checkpoint: config, model, prompt builder, device and dtype."""

    def __init__(self, config: GlmAsrConfig, model, prompts: PromptBuilder, folder: Path, frontend: str = "torch"):
        self.config = config
        self.model = model  # GlmAsrModel (plain torch) or FastGlmAsrModel (Triton kernels)
        self.prompts = prompts
        self.folder = folder
        self.frontend = frontend  # "torch" (features.py) or "cuda" (fused cuFFTDx kernel, kernels/logmel)
        self._engine = None  # built on first use by _engine_for (KV cache, CUDA graphs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def __repr__(self) -> str:
        return (f"GlmAsr(folder={str(self.folder)!r}, device={self.device}, dtype={self.dtype}, "
                f"model={type(self.model).__name__}, frontend={self.frontend!r})")


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}: use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


BACKENDS = ("auto", "torch", "triton")


def load(model: str | os.PathLike = DEFAULT_MODEL_ID, device=None, dtype=None, backend: str = "auto") -> GlmAsr:
    """Load a GLM-ASR checkpoint (local folder or hub id) onto ``device`` (default: CUDA if present) in
    ``dtype`` (default: bf16 on CUDA, fp32 on CPU). ``backend``: "torch" (plain-PyTorch reference path),
    "triton" (Triton kernels + fused weight cache, CUDA only) or "auto" (triton on CUDA, torch on CPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if backend == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU testing), got {dev}")
    folder = resolve_checkpoint(model)
    cfg = read_config(folder)
    with torch.device("meta"):
        net = GlmAsrModel(cfg)
    state = load_state_dict(folder, net, dev, dt)
    net.load_state_dict(state, strict=True, assign=True)
    net.eval().requires_grad_(False)
    prompts = PromptBuilder.from_folder(folder, cfg.audio_token_id)
    frontend = "torch"
    if backend == "triton" or (backend == "auto" and dev.type == "cuda"):
        from .models.fast import FastGlmAsrModel

        net = FastGlmAsrModel(net, encoder_graphs=os.environ.get("GLMASR_ENCODER_GRAPHS", "1") != "0",
                              decode_gemm=os.environ.get("GLMASR_DECODE_GEMM", "skinny"))
        if dev.type == "cuda":
            from glmasr_kernels.logmel import is_available

            frontend = "cuda" if is_available() else "torch"
    return GlmAsr(cfg, net, prompts, folder, frontend)


@dataclass
class _Group:
    item: int
    windows: list[int]  # indices into the flat window list
    audio_tokens: int
    seconds: float
    max_new_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)


def default_max_new_tokens(seconds: float) -> int:
    return DEFAULT_MIN_NEW_TOKENS + math.ceil(DEFAULT_TOKENS_PER_SECOND * seconds)


def _plan_groups(item: int, window_tokens: list[int], window_seconds: list[float], first_window: int,
                 overhead: int, max_positions: int, max_new_tokens: int | None) -> list[_Group]:
    """Pack an audio's windows into prompts that fit the context: prompt + token budget <= max_positions."""
    groups: list[_Group] = []
    current: _Group | None = None
    for offset, (tokens, seconds) in enumerate(zip(window_tokens, window_seconds)):
        if current is not None:
            grown_tokens = current.audio_tokens + tokens
            grown_budget = max_new_tokens or default_max_new_tokens(current.seconds + seconds)
            if (len(current.windows) < MAX_WINDOWS_PER_PROMPT
                    and overhead + grown_tokens + grown_budget <= max_positions):
                current.windows.append(first_window + offset)
                current.audio_tokens = grown_tokens
                current.seconds += seconds
                continue
        current = _Group(item, [first_window + offset], tokens, seconds)
        budget = max_new_tokens or default_max_new_tokens(seconds)
        if overhead + tokens + budget > max_positions:
            raise ValueError(f"max_new_tokens={budget} leaves no room for one 30 s window: the prompt needs "
                             f"{overhead + tokens} of the model's {max_positions} positions")
        groups.append(current)
    for g in groups:
        g.max_new_tokens = max_new_tokens or default_max_new_tokens(g.seconds)
    return groups


def _as_batch(audio) -> tuple[list, bool]:
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise AudioError("transcribe() got an empty list of audio")
        return list(audio), True
    return [audio], False


@dataclass
class _Prepared:
    audios: list[Audio]
    groups: list[_Group]
    requests: list[GenerationRequest]
    windows_per_item: list[int]
    timings_ms: dict  # audio_ms, features_ms; encoder_ms once known (``stage_timings``)
    encoder_events: tuple | None = None  # CUDA events around features + encoder + prompt embeddings

    def stage_timings(self, total_ms: float) -> dict:
        """Stages that add up to ``total_ms``: audio (loading, host), encoder (from the first feature launch to
        the prompt embeddings: frontend, encoder, projector; on CUDA the GPU span between two events, which
        starts with an idle GPU), decoder (the rest: prefill, decode, host). features_ms is the host time of
        packing the windows for the frontend, a part of encoder_ms (overlapped with the GPU after the first
        chunk of 32 windows), not a separate stage."""
        t = dict(self.timings_ms)
        if self.encoder_events is not None:  # complete by now: the engine has read tokens back after them
            t["encoder_ms"] = self.encoder_events[0].elapsed_time(self.encoder_events[1])
        t["decoder_ms"] = total_ms - t["audio_ms"] - t["encoder_ms"]
        t["total_ms"] = total_ms
        return t


def _prepare(asr: GlmAsr, items: list, prompt: str | None, max_new_tokens: int | None,
             sampling_rate: int | None) -> _Prepared:
    """Audio -> windows -> groups -> features -> encoder/projector -> prompt embeddings, one per group."""
    t0 = time.perf_counter()
    audios: list[Audio] = [load_audio(a, sampling_rate) for a in items]
    min_samples = min_samples_for_one_token(asr.config.merge_factor)
    for a in audios:
        if a.samples.shape[0] < min_samples:
            raise AudioError(f"{a.source}: audio is too short ({a.samples.shape[0]} samples = "
                             f"{1000 * a.duration_s:.1f} ms at 16 kHz); at least {min_samples} samples "
                             f"({1000 * min_samples / 16000:.1f} ms) are needed for one audio token")
    t_audio = time.perf_counter()

    overhead = len(asr.prompts.encode(1, prompt)) - 1
    max_positions = asr.config.text.max_position_embeddings
    pieces: list[np.ndarray] = []
    tokens_of: list[int] = []  # audio tokens each window contributes
    groups: list[_Group] = []
    windows_per_item: list[int] = []
    for idx, a in enumerate(audios):
        wins = split_windows(a.samples)
        windows_per_item.append(len(wins))
        tokens = [max(0, int(frames_to_audio_tokens(num_valid_frames(w.shape[0])))) for w in wins]
        groups += _plan_groups(idx, tokens, [w.shape[0] / SAMPLE_RATE for w in wins], len(pieces), overhead,
                               max_positions, max_new_tokens)
        pieces += wins
        tokens_of += tokens

    # A window that yields no audio token (a tail under 60 ms after full windows) needs no encoding.
    needed = [w for w in range(len(pieces)) if tokens_of[w] > 0]
    # Features + encoder chunk by chunk, all enqueued without a host sync: the host packs chunk i+1 while the
    # GPU encodes chunk i (packing 32 windows is a few ms of host copies, encoding them ~150 ms on the H200).
    features_s = 0.0
    cuda = asr.device.type == "cuda"
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
    t_enc0 = time.perf_counter()
    with torch.inference_mode():
        if cuda:
            events[0].record()
        encoded = []
        for i in range(0, len(needed), ENCODER_BATCH):
            tf = time.perf_counter()
            feats = _features([pieces[w] for w in needed[i: i + ENCODER_BATCH]], asr)
            features_s += time.perf_counter() - tf
            encoded.append(asr.model.encode_audio(feats))
        embeds = encoded[0] if len(encoded) == 1 else torch.cat(encoded)
        requests = _prompt_requests(asr, groups, embeds, needed, tokens_of, prompt)
        if cuda:
            events[1].record()  # no sync: the engine's prefill is enqueued behind the encoder
    # encoder_ms (features included): on CUDA the GPU span between the two events, read once the tokens are
    # back (``_Prepared.stage_timings``); on the CPU the wall time
    timings = {"audio_ms": 1e3 * (t_audio - t0), "features_ms": 1e3 * features_s}
    if not cuda:
        timings["encoder_ms"] = 1e3 * (time.perf_counter() - t_enc0)
    return _Prepared(audios, groups, requests, windows_per_item, timings, events)


def _prompt_requests(asr: GlmAsr, groups: list[_Group], embeds: torch.Tensor, needed: list[int],
                     tokens_of: list[int], prompt: str | None) -> list[GenerationRequest]:
    """One request per group: the token embeddings of its prompt with the audio placeholders replaced, in
    order, by the audio rows of its windows (``embeds`` (len(needed), 375, hidden), row i = window
    needed[i]). All groups in one gather/scatter: the placeholder positions are known on the host, so
    nothing waits for the GPU."""
    row_of = {w: i for i, w in enumerate(needed)}
    per_window = embeds.shape[1]
    ids: list[int] = []
    dst: list[int] = []  # rows of the flat prompt embeddings that take audio rows
    src: list[int] = []  # rows of the flat audio embeddings, in prompt order
    spans = []
    for g in groups:
        g.prompt_ids = asr.prompts.encode(g.audio_tokens, prompt)  # checks: exactly g.audio_tokens placeholders
        base = len(ids)
        dst += [base + j for j, t in enumerate(g.prompt_ids) if t == asr.config.audio_token_id]
        src += [row_of[w] * per_window + j for w in g.windows for j in range(tokens_of[w])]
        spans.append((base, len(g.prompt_ids)))
        ids += g.prompt_ids
    if len(dst) != len(src):  # encode() already guarantees it; a mismatch here would be silent corruption
        raise RuntimeError(f"{len(dst)} audio placeholders in the prompts but {len(src)} audio rows")
    dev = asr.device
    flat = asr.model.embed_tokens(host_to_device(ids, dev))
    audio = embeds.reshape(-1, embeds.shape[-1]).index_select(0, host_to_device(src, dev))
    flat.index_copy_(0, host_to_device(dst, dev), audio.to(flat.dtype))
    return [GenerationRequest(flat[b: b + n], g.max_new_tokens) for (b, n), g in zip(spans, groups)]


def _features(pieces: list[np.ndarray], asr: GlmAsr) -> torch.Tensor:
    """Log-mel features of window pieces on the model's device: the fused CUDA frontend on the Triton path
    when its toolchain is installed, else the plain-torch recipe."""
    n_mels = asr.config.audio.num_mel_bins
    if asr.frontend == "cuda":
        from glmasr_kernels.logmel import whisper_features as fused_whisper_features

        lengths = [int(p.shape[0]) for p in pieces]
        # Filled in place in a pinned buffer (torch's caching host allocator: reused, no page faults) and
        # copied without a host sync. No zero fill: the kernel reads samples at or past a row's length as 0.
        host = torch.empty((len(pieces), max(lengths)), dtype=torch.float32, pin_memory=True)
        rows = host.numpy()
        for i, p in enumerate(pieces):
            rows[i, : lengths[i]] = p
        pcm = host.to(asr.device, non_blocking=True)
        return fused_whisper_features(pcm, host_to_device(lengths, asr.device), n_mels)[0]
    return whisper_features(pieces, n_mels, device=asr.device)[0]


def _check_options(max_new_tokens, prompt) -> None:
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")


@dataclass
class TranscriptDelta:
    """A piece of streamed text: ``text`` extends the transcript of input ``index``; ``finished`` with the
    last piece, which also carries the complete ``Transcription``."""

    index: int
    text: str
    finished: bool = False
    result: Transcription | None = None


def _engine_for(asr: GlmAsr, requests: list[GenerationRequest], max_batch: int | None) -> Engine:
    """The model's engine, (re)built when the slot count or the KV capacity it needs grows.
    On CUDA: 64 slots by default and a power-of-two capacity (graphs are kept per engine); on CPU: exact sizes."""
    need = max(r.prompt_embeds.shape[0] + r.max_new_tokens for r in requests)
    cuda = asr.device.type == "cuda"
    slots = max_batch or (DEFAULT_MAX_BATCH if cuda else len(requests))
    if slots < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    capacity = need
    if cuda:
        capacity = 1024
        while capacity < need:
            capacity *= 2
    capacity = min(capacity, asr.config.text.max_position_embeddings)
    engine = asr._engine
    if engine is None or engine.max_batch != slots or engine.capacity < need or (not cuda and engine.capacity != capacity):
        asr._engine = None  # free the old cache before allocating the new one
        engine = Engine(asr.model, max_batch=slots, capacity=capacity,
                        prefill_graphs=os.environ.get("GLMASR_PREFILL_GRAPHS", "1") != "0")
        asr._engine = engine
    return engine


def _stream(asr: GlmAsr, items: list, prompt, max_new_tokens, sampling_rate, ignore_eos, max_batch, t0
            ) -> Iterator[TranscriptDelta]:
    prep = _prepare(asr, items, prompt, max_new_tokens, sampling_rate)
    engine = _engine_for(asr, prep.requests, max_batch)
    groups_of = [[gi for gi, g in enumerate(prep.groups) if g.item == idx] for idx in range(len(prep.audios))]
    tokens = [[] for _ in prep.groups]
    finish = [None] * len(prep.groups)
    emitted = [""] * len(prep.audios)
    done = [False] * len(prep.audios)

    def text_of(idx: int) -> tuple[str, bool]:
        """Text of audio idx that is final so far: finished groups, then the first unfinished one."""
        parts = []
        for gi in groups_of[idx]:
            t = asr.prompts.decode(tokens[gi]).strip()
            if t:
                parts.append(t)
            if finish[gi] is None:
                break
        text = " ".join(parts)
        return text, all(finish[gi] is not None for gi in groups_of[idx])

    for ev in engine.run(prep.requests, ignore_eos=ignore_eos):
        tokens[ev.request] += ev.tokens
        if ev.finish_reason is not None:
            finish[ev.request] = ev.finish_reason
        idx = prep.groups[ev.request].item
        text, complete = text_of(idx)
        if not complete:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for its other bytes
        if text.startswith(emitted[idx]) and len(text) > len(emitted[idx]):
            delta = text[len(emitted[idx]):]
        else:
            delta = ""  # detokenization revised earlier text (rare); the final result has the exact text
        emitted[idx] = text if delta else emitted[idx]
        if complete and not done[idx]:
            done[idx] = True
            mine = groups_of[idx]
            a = prep.audios[idx]
            timings = prep.stage_timings(1e3 * (time.perf_counter() - t0))
            result = Transcription(
                text=text, token_ids=[t for gi in mine for t in tokens[gi]],
                finish_reason="length" if any(finish[gi] == "length" for gi in mine) else "stop",
                duration_s=a.duration_s, num_windows=prep.windows_per_item[idx],
                num_audio_tokens=sum(prep.groups[gi].audio_tokens for gi in mine), num_groups=len(mine),
                timings_ms=timings)
            yield TranscriptDelta(idx, delta, True, result)
        elif delta:
            yield TranscriptDelta(idx, delta)


def transcribe(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
               sampling_rate: int | None = None, device=None, ignore_eos: bool = False, max_batch: int | None = None):
    """Transcribe one audio input or a list of them.

    audio: a file path, a numpy array or a torch tensor (then ``sampling_rate`` is required), or a list of
    these. model: a ``GlmAsr`` from ``load`` or anything ``load`` accepts. prompt: replaces the default
    instruction. max_new_tokens: token budget per prompt (default grows with duration). ignore_eos: decode
    exactly max_new_tokens tokens (benchmarking). max_batch: sequence slots of the continuous-batching engine
    (default 64 on CUDA). Returns a ``Transcription`` or a list of them, in input order.
    """
    t0 = time.perf_counter()
    _check_options(max_new_tokens, prompt)
    asr = model if isinstance(model, GlmAsr) else load(model, device=device)
    items, batched = _as_batch(audio)
    results: dict[int, Transcription] = {}
    for delta in _stream(asr, items, prompt, max_new_tokens, sampling_rate, ignore_eos, max_batch, t0):
        if delta.finished:
            results[delta.index] = delta.result
    out = [results[i] for i in range(len(items))]
    return out if batched else out[0]


def transcribe_stream(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
                      sampling_rate: int | None = None, device=None, max_batch: int | None = None
                      ) -> Iterator[TranscriptDelta]:
    """Like ``transcribe``, but yields ``TranscriptDelta``s as text is produced (every few decode steps): for a
    list, deltas of different inputs interleave (``.index`` says which); each input's last delta has
    ``finished=True`` and the complete ``Transcription`` in ``.result``."""
    t0 = time.perf_counter()
    _check_options(max_new_tokens, prompt)
    asr = model if isinstance(model, GlmAsr) else load(model, device=device)
    items, _ = _as_batch(audio)
    yield from _stream(asr, items, prompt, max_new_tokens, sampling_rate, False, max_batch, t0)


@torch.inference_mode()
def teacher_forced_logits(asr: GlmAsr, audio, forced_ids: list[int], prompt: str | None = None,
                          sampling_rate: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits (len(forced_ids) + 1, vocab), fp32, predicting each forced token and the one after it, for one
    audio of at most one window group. Also returns the prompt ids. Used to compare with other implementations."""
    prep = _prepare(asr, [audio], prompt, None, sampling_rate)
    if len(prep.requests) != 1:
        raise ValueError("teacher forcing takes audio that fits one prompt (<= 630 s)")
    prompt_embeds = prep.requests[0].prompt_embeds
    forced = torch.tensor(forced_ids, device=asr.device, dtype=torch.long)
    embeds = torch.cat([prompt_embeds, asr.model.embed_tokens(forced)])[None]
    total = embeds.shape[1]
    cache = KVCache(asr.config.text, 1, total, asr.device, asr.dtype)
    positions = torch.arange(total, device=asr.device)[None]
    hidden = asr.model.decode(embeds, positions, cache, kv_len=total)
    start = prompt_embeds.shape[0] - 1
    return asr.model.logits(hidden[0, start:]), prep.groups[0].prompt_ids
