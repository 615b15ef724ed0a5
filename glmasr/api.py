"""Public API: ``transcribe`` and ``transcribe_stream``, clients of a loaded model's shared engine.

Data flow: inputs and options are checked, every audio is loaded (16 kHz mono, ``audio.py``) and planned into
window groups (``pipeline.plan_audio``) in the caller's thread, before any model work; each audio becomes one
engine request (``GlmAsr.submit``). The engine thread encodes, prefills and decodes them together with every
other caller's requests; the caller turns its requests' tokens into text (``transcript.py``).

``model=`` that is not a handle (a folder or hub id) is loaded once and kept (``_SharedModel``): the loop
``for f in files: transcribe(f, model=path)`` reuses it; a call naming another checkpoint, device, dtype or
backend replaces it (the old one is closed and freed); ``close_shared_model()`` frees it. ``timeout=`` bounds a
call: the engine drops its requests once it has passed and the call raises ``RequestTimeoutError``.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
from typing import Iterator, NamedTuple

import numpy as np
import torch

from . import handle as _handle
from .audio import Audio, load_audio
from .models.device import resolve_device, resolve_dtype, same_device
from .engine.loop import check_timeout
from .errors import AudioError, RequestTimeoutError
from .handle import GlmAsr
from .options import DecodeOptions
from .results import TranscriptDelta
from .checkpoint.weights import DEFAULT_MODEL_ID, resolve_checkpoint

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


class _ModelKey(NamedTuple):
    """What identifies a loaded model: the same key, the same weights on the same device, the same path."""

    folder: str
    device: torch.device
    dtype: torch.dtype
    backend: str
    aligner: object = None  # load's aligner=: a head folder (resolved), a hub id, an Aligner instance, or None


def _model_key(model, device, aligner=None) -> _ModelKey:
    if isinstance(aligner, (str, os.PathLike)) and os.path.isdir(aligner):
        aligner = os.path.realpath(aligner)
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" are one device when 0 is current
        dev = torch.device("cuda", torch.cuda.current_device())
    backend = "triton" if dev.type == "cuda" else "torch"  # what load's backend "auto" picks
    return _ModelKey(str(resolve_checkpoint(model).resolve()), dev, resolve_dtype(None, dev), backend, aligner)


class _SharedModel:
    """The model ``transcribe`` / ``transcribe_stream`` loaded for a ``model=`` that is not a handle, kept for
    the next call. One at a time: a call with another key loads that one and the old one is closed (freed)
    first, or, while another call is between looking it up and submitting to it, by the last such call (the
    requests already submitted finish either way). Thread-safe: concurrent calls for one model wait for one
    load. A user who closes the kept handle makes it forget it."""

    def __init__(self):
        self._lock = threading.RLock()  # re-entered by the close hook when it closes the old model itself
        self._key: _ModelKey | None = None
        self._asr: GlmAsr | None = None
        self._users: dict[GlmAsr, int] = {}  # calls between acquire and release, per handle

    def acquire(self, model, device, aligner=None) -> GlmAsr:
        key = _model_key(model, device, aligner)
        with self._lock:
            if self._key != key or self._asr is None or self._asr.closed:
                old, self._asr, self._key = self._asr, None, None
                if old is not None and not self._users.get(old):
                    old.close()  # before the new load: one model in memory at a time
                asr = _handle.load(key.folder, device=key.device, dtype=key.dtype, backend=key.backend,
                                   aligner=key.aligner)
                asr._close_hooks.append(self._forget)
                self._asr, self._key = asr, key
            self._users[self._asr] = self._users.get(self._asr, 0) + 1
            return self._asr

    def release(self, asr: GlmAsr) -> None:
        with self._lock:
            n = self._users.pop(asr, 0) - 1
            if n > 0:
                self._users[asr] = n
                return
            retired = asr is not self._asr
        if retired:  # replaced while this call used it: its requests are in, let it go once they are done
            asr._close(wait=False)

    def _forget(self, asr: GlmAsr) -> None:
        with self._lock:
            if self._asr is asr:
                self._asr = self._key = None

    def close(self) -> None:
        with self._lock:
            asr, self._asr, self._key = self._asr, None, None
            busy = asr is not None and self._users.get(asr)
        if asr is not None and not busy:  # a busy one is closed by its last call's release
            asr.close()

    @property
    def current(self) -> GlmAsr | None:
        return self._asr


_shared = _SharedModel()


def close_shared_model() -> None:
    """Free the model that ``transcribe`` / ``transcribe_stream`` keep for a ``model=`` path or hub id (after
    the requests in hand). The next such call loads it again."""
    _shared.close()


@contextlib.contextmanager
def _model_for(model, device, aligner=None):
    """The handle to submit to, held until the block ends (the shared model is not closed under a caller)."""
    if isinstance(model, GlmAsr):
        if aligner is not None:
            raise ValueError("aligner= is for a model transcribe() loads itself; this model was loaded already: "
                             "load it with glmasr.load(model, aligner=PATH) instead")
        if device is not None and not same_device(resolve_device(device), model.device):
            raise ValueError(f"device={device!r} contradicts the loaded model, which is on {model.device}; "
                             f"load it on {device!r} or leave device= out")
        model._check_open()
        yield model
        return
    asr = _shared.acquire(model, device, aligner)
    try:
        yield asr
    finally:
        _shared.release(asr)


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


def _submit_all(asr: GlmAsr, audio, decode: DecodeOptions, sampling_rate, max_batch, timeout: float | None):
    t0 = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout  # the model is ready: its load not counted
    items, batched = _as_batch(audio)
    if max_batch is not None:
        asr.reconfigure(max_batch=max_batch)
    loaded = _load_all(items, batched, sampling_rate)
    jobs = []
    try:
        for i, (a, audio_ms) in enumerate(loaded):
            if deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeoutError(f"the call did not finish within its timeout of {timeout:g} s: it ran "
                                          f"out before audio[{i}] was submitted")
            jobs.append(asr._submit(a, decode, i, t0, audio_ms, None, deadline, timeout))
    except BaseException:
        for j in jobs:
            j.abort()
        raise
    return jobs, batched


def _decode_options(**fields) -> DecodeOptions:
    """The call's ``DecodeOptions`` (checked there); ``max_segment_s`` without segmentation "vad" is refused
    rather than ignored (30 s windows are not shaped by it); with diarize, the known speakers
    (``InvalidSpeakerReference``) and the weights (``DiarizationUnavailableError``) are checked here, before any
    model is loaded."""
    decode = DecodeOptions(**fields)
    if decode.diarize:
        from .diarize import check_known, weights

        check_known(decode.known_speakers)
        for name in (weights.SEGMENTATION_FILE, weights.EMBEDDING_FILE):
            weights.data_file(name)
    if decode.max_segment_s is not None and decode.segmentation != "vad":
        raise ValueError(f"max_segment_s={decode.max_segment_s:g} shapes the segments of segmentation='vad'; with "
                         f"segmentation={decode.segmentation!r} the segments are 30 s windows: pass "
                         f"segmentation='vad' as well")
    return decode


def transcribe(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
               sampling_rate: int | None = None, device=None, ignore_eos: bool = False, max_batch: int | None = None,
               repetition_stop: int | None = None, segmentation: str = "windows", timeout: float | None = None,
               max_segment_s: float | None = None, word_timestamps: bool = False, aligner=None,
               diarize: bool = False, min_speakers: int | None = None, max_speakers: int | None = None,
               known_speakers: dict | None = None):
    """Transcribe one audio input or a list of them.

    audio: a file path, a numpy array or a torch tensor (then ``sampling_rate`` is required), or a list of
    these. model: a ``GlmAsr`` from ``load`` or anything ``load`` accepts (loaded on the first call and kept
    for the next ones with the same checkpoint, device, dtype and backend; another one replaces it;
    ``close_shared_model()`` frees it). prompt: replaces the default
    instruction. max_new_tokens: token budget per prompt (default grows with duration). ignore_eos: decode
    exactly max_new_tokens tokens (benchmarking). max_batch: sequence slots of the shared engine (changing it
    rebuilds the engine once the requests in hand are done). repetition_stop: opt-in runaway guard (see
    ``DecodeOptions``). segmentation: "windows" (30 s windows grouped as the reference processor groups them:
    token-exact with transformers, the default here) or "vad" (speech regions cut at silences into pieces of at
    most 30 s, decoded in parallel, each a segment with its own times: for long recordings and subtitles; the
    CLI's default). max_segment_s (with segmentation="vad" only, else a ValueError): None packs the speech into
    pieces of up to 30 s (the fewest prompts); a number of seconds (1-30) gives speech-shaped segments: at most
    that long, cut at the longest pauses (never merged across a pause of 1 s or more), starting 0.1 s before
    and ending 0.06 s after the speech the VAD finds; each is its own prompt and its own 30 s encoder window, so
    short ones cost more encoder work (about 6 s suits two-line subtitle cues). timeout: seconds for the whole
    call, counted once the model is ready (loading it is not counted); past it the engine drops the call's
    requests and this raises ``RequestTimeoutError``.
    word_timestamps: each segment's ``words`` with their times, from the model's aligner (a ValueError when it
    has none). aligner: for a model this call loads itself, ``load``'s ``aligner=`` (a glm-asr-ctc head folder
    or hub id; part of what identifies the kept model); for a loaded handle, pass it to ``glmasr.load`` instead.
    diarize: each segment's ``speaker`` (and each word's, with word_timestamps): "A", "B", ... in order of first
    appearance, or a known speaker's name (``glmasr.diarize``; needs ``pip install 'glmasr[diarize]'``, else
    ``DiarizationUnavailableError`` before any work); it runs beside the transcription, its cost in
    ``timings_ms["diarize_ms"]`` (and ``["diarize_wait_ms"]``, the time the transcript waited for it).
    min_speakers / max_speakers: bounds on the number of speakers (1-26), with diarize=True only.
    known_speakers: {name: clip or [clips]} (at most 4 names, 1-4 clips each, 1-D float arrays of 2-10 s at
    16 kHz): a speaker whose voice matches a name's clips is given that name; bad ones raise
    ``InvalidSpeakerReference`` naming the speaker before any work.
    Thread-safe: calls from many threads share the model's engine. Returns a ``Transcription`` or a list of
    them, in input order.
    """
    decode = _decode_options(prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                             repetition_stop=repetition_stop, segmentation=segmentation,
                             max_segment_s=max_segment_s, word_timestamps=word_timestamps, diarize=diarize,
                             min_speakers=min_speakers, max_speakers=max_speakers,
                             known_speakers=known_speakers)  # checked before loading
    timeout = check_timeout(timeout)
    with _model_for(model, device, aligner) as asr:
        jobs, batched = _submit_all(asr, audio, decode, sampling_rate, max_batch, timeout)
    try:
        out = [j.result() for j in jobs]
    finally:
        for j in jobs:
            j.abort()  # no-op for finished ones; an interrupted call leaves nothing running
    return out if batched else out[0]


def transcribe_stream(audio, model=DEFAULT_MODEL_ID, prompt: str | None = None, max_new_tokens: int | None = None,
                      sampling_rate: int | None = None, device=None, max_batch: int | None = None,
                      repetition_stop: int | None = None, segmentation: str = "windows",
                      timeout: float | None = None, max_segment_s: float | None = None, word_timestamps: bool = False,
                      aligner=None, diarize: bool = False, min_speakers: int | None = None,
                      max_speakers: int | None = None, known_speakers: dict | None = None
                      ) -> Iterator[TranscriptDelta]:
    """Like ``transcribe``, but yields ``TranscriptDelta``s as text is produced (every few decode steps): for a
    list, deltas of different inputs interleave (``.index`` says which); each input's last delta has
    ``finished=True`` and the complete ``Transcription`` in ``.result``. Closing the iterator early aborts the
    requests still running. timeout: as for ``transcribe``, for all of the call's requests (the iterator
    raises ``RequestTimeoutError``). segmentation, max_segment_s, word_timestamps, aligner, diarize,
    min_speakers, max_speakers, known_speakers: as for ``transcribe`` (the last delta's result carries the words
    and speakers; the deltas before it have none)."""
    decode = _decode_options(prompt=prompt, max_new_tokens=max_new_tokens, repetition_stop=repetition_stop,
                             segmentation=segmentation, max_segment_s=max_segment_s, word_timestamps=word_timestamps,
                             diarize=diarize, min_speakers=min_speakers, max_speakers=max_speakers,
                             known_speakers=known_speakers)
    timeout = check_timeout(timeout)
    with _model_for(model, device, aligner) as asr:
        jobs, _ = _submit_all(asr, audio, decode, sampling_rate, max_batch, timeout)
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
