"""Public API: ``transcribe`` and ``transcribe_stream``, clients of a loaded model's shared engine.

Data flow: inputs and options are checked, every audio is loaded (16 kHz mono, ``audio.py``) and planned into
window groups (``pipeline.plan_audio``) in the caller's thread, before any model work; each audio becomes one
engine request (``GlmAsr.submit``). The engine thread encodes, prefills and decodes them together with every
other caller's requests; the caller turns its requests' tokens into text (``transcript.py``).
"""

from __future__ import annotations

import numbers
import os
import time
from typing import Iterator

import numpy as np
import torch

from .audio import Audio, AudioError, load_audio
from .device import resolve_device, same_device
from .handle import GlmAsr, load
from .options import DecodeOptions
from .results import TranscriptDelta
from .weights import DEFAULT_MODEL_ID

_AUDIO_TYPES = (str, os.PathLike, np.ndarray, torch.Tensor, Audio)


def _as_batch(audio) -> tuple[list, bool]:
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise AudioError("transcribe() got an empty list of audio")
        if all(isinstance(x, numbers.Number) for x in audio):
            raise AudioError(f"transcribe() got a list of {len(audio)} numbers: a list is a batch of audios; pass "
                             f"one audio as a numpy array or torch tensor (with sampling_rate=)")
        for i, x in enumerate(audio):
            if not isinstance(x, _AUDIO_TYPES):
                raise AudioError(f"audio[{i}]: unsupported input type {type(x).__name__}: pass a file path, a "
                                 f"numpy array or a torch tensor")
        return list(audio), True
    return [audio], False


def _model_for(model, device) -> GlmAsr:
    if isinstance(model, GlmAsr):
        if device is not None and not same_device(resolve_device(device), model.device):
            raise ValueError(f"device={device!r} contradicts the loaded model, which is on {model.device}; "
                             f"load it on {device!r} or leave device= out")
        return model
    return load(model, device=device)


def _load_all(items: list, batched: bool, sampling_rate) -> list[tuple[Audio, float]]:
    loaded = []
    for i, item in enumerate(items):
        t0 = time.perf_counter()
        try:
            a = load_audio(item, sampling_rate)
        except AudioError as e:
            raise AudioError(f"audio[{i}]: {e}" if batched else str(e)) from None
        loaded.append((a, 1e3 * (time.perf_counter() - t0)))
    return loaded


def _submit_all(asr: GlmAsr, audio, decode: DecodeOptions, sampling_rate, max_batch):
    t0 = time.perf_counter()
    items, batched = _as_batch(audio)
    if max_batch is not None:
        asr.reconfigure(max_batch=max_batch)
    loaded = _load_all(items, batched, sampling_rate)
    jobs = []
    try:
        for i, (a, audio_ms) in enumerate(loaded):
            jobs.append(asr.submit_loaded(a, decode, i, t0, audio_ms))
    except BaseException:
        for j in jobs:
            j.abort()
        raise
    return jobs, batched


def transcribe(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
               sampling_rate: int | None = None, device=None, ignore_eos: bool = False, max_batch: int | None = None,
               repetition_stop: int | None = None, segmentation: str = "windows"):
    """Transcribe one audio input or a list of them.

    audio: a file path, a numpy array or a torch tensor (then ``sampling_rate`` is required), or a list of
    these. model: a ``GlmAsr`` from ``load`` or anything ``load`` accepts. prompt: replaces the default
    instruction. max_new_tokens: token budget per prompt (default grows with duration). ignore_eos: decode
    exactly max_new_tokens tokens (benchmarking). max_batch: sequence slots of the shared engine (changing it
    rebuilds the engine once the requests in hand are done). repetition_stop: opt-in runaway guard (see
    ``DecodeOptions``). segmentation: "windows" (30 s windows grouped as the reference processor groups them:
    token-exact with transformers, the default here) or "vad" (speech regions cut at silences into pieces of at
    most 30 s, decoded in parallel, each a segment with its own times: for long recordings and subtitles; the
    CLI's default). Thread-safe: calls from many threads share the model's engine. Returns a
    ``Transcription`` or a list of them, in input order.
    """
    decode = DecodeOptions(prompt, max_new_tokens, ignore_eos, repetition_stop, segmentation)  # checked before loading
    asr = _model_for(model, device)
    jobs, batched = _submit_all(asr, audio, decode, sampling_rate, max_batch)
    try:
        out = [j.result() for j in jobs]
    finally:
        for j in jobs:
            j.abort()  # no-op for finished ones; an interrupted call leaves nothing running
    return out if batched else out[0]


def transcribe_stream(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
                      sampling_rate: int | None = None, device=None, max_batch: int | None = None,
                      repetition_stop: int | None = None, segmentation: str = "windows"
                      ) -> Iterator[TranscriptDelta]:
    """Like ``transcribe``, but yields ``TranscriptDelta``s as text is produced (every few decode steps): for a
    list, deltas of different inputs interleave (``.index`` says which); each input's last delta has
    ``finished=True`` and the complete ``Transcription`` in ``.result``. Closing the iterator early aborts the
    requests still running."""
    decode = DecodeOptions(prompt, max_new_tokens, repetition_stop=repetition_stop, segmentation=segmentation)
    asr = _model_for(model, device)
    jobs, _ = _submit_all(asr, audio, decode, sampling_rate, max_batch)
    return _merge(jobs)


def _merge(jobs) -> Iterator[TranscriptDelta]:
    """Deltas of several jobs in the order the engine produced them (one engine thread feeds all streams)."""
    import queue

    if len(jobs) == 1:
        yield from jobs[0].deltas()
        return
    ready: queue.SimpleQueue = queue.SimpleQueue()
    for i, j in enumerate(jobs):
        j.stream.set_listener(lambda i=i: ready.put(i))
    pending = set(range(len(jobs)))
    try:
        while pending:
            i = ready.get()
            if i not in pending:
                continue
            yield from jobs[i].poll()
            if jobs[i].done:
                pending.discard(i)
    finally:
        for j in jobs:
            j.abort()
