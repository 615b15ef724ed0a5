"""The model handle: ``load`` a checkpoint into a ``GlmAsr``, which owns one engine and the thread that runs it.

Every entry point (``transcribe``, ``transcribe_stream``, the CLI, a server) is a client of the handle's
``EngineLoop``: audio is loaded, checked and planned in the caller's thread (``submit``), the engine thread does
all the device work, and the caller assembles its text from its request's stream. So any number of threads (or
coroutines) can share one loaded model and each gets exactly what it would get alone.

A handle lives until ``close()`` (or the end of its ``with`` block): that finishes the requests in hand, stops
the engine thread and releases the model's tensors; later use raises ``EngineClosed``. A request may carry a
timeout (``submit(..., timeout=)``, ``job.result(timeout=)``): the engine drops it once that has passed, queued
or running, and the job raises ``RequestTimeoutError``. And a priority class (``submit(..., priority=)``,
``Priority``: default ``BATCH``): the engine serves better classes first, and a ``DRAFT`` may be preempted
(``RequestPreempted``).

Word times: ``load(..., aligner=PATH)`` gives the handle an aligner (``glmasr.align``); a request with
``DecodeOptions(word_timestamps=True)`` then gets each segment's ``words``, aligned in the caller's thread once
the transcript is final (after the engine is done with it; the time is ``timings_ms["align_ms"]``). Without an
aligner such a request is refused at ``submit`` with a ValueError (never made-up times).

Speakers: a request with ``DecodeOptions(diarize=True)`` gets ``Segment.speaker`` and ``Word.speaker``
(``glmasr.diarize``). At ``submit``, in the caller's thread, the known speakers are checked
(``InvalidSpeakerReference``) and the handle's ``Diarizer`` is built on first use (``DiarizationUnavailableError``
without the ``glmasr[diarize]`` weights); the diarization then starts at once on the handle's diarization thread
(on CUDA on a stream of its own), beside the transcription. Once the transcript is final (and its words aligned)
the result waits for it and each segment and word gets the speaker it overlaps most (``diarize.assign``; None
when no speech was found). ``timings_ms["diarize_ms"]``: the diarization's own run time;
``["diarize_wait_ms"]``: how long the finished transcript waited for it (added to ``total_ms``). ``abort()``
cancels it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .align import AlignSegment, Aligner, load_aligner
from .audio import SAMPLE_RATE, Audio, load_audio
from .models.config import GlmAsrConfig
from .models.device import resolve_device, resolve_dtype
from .engine.engine import Engine
from .engine.loop import EngineLoop, check_priority, check_timeout
from .engine.request import Priority
from .errors import EngineClosed
from .engine.model_runner import check_batch_invariance
from .models.fast_weights import check_decode_weights
from .models.glmasr import GlmAsrModel
from .options import DecodeOptions, EngineOptions
from .pipeline import plan_audio, plan_pieces
from .results import Transcription, TranscriptDelta
from .checkpoint.tokenizer import PromptBuilder
from .transcript import TranscriptAssembler
from .checkpoint.weights import DEFAULT_MODEL_ID, load_state_dict, read_config, resolve_checkpoint

BACKENDS = ("auto", "torch", "triton")
WARMUPS = (False, True, "background")
# The KV lengths and prompt lengths a warm-up captures graphs for (every batch bucket at each KV length): a
# server's usual range; longer ones are captured when first used.
WARMUP_KV_LENS = (256, 512, 1024)
WARMUP_PREFILL_LENGTHS = (64, 128, 256, 512, 1024)
# diarizations run at once per handle: one keeps a CPU's cores for the engine and gives each its full device time;
# the others wait in its queue (each started at submit, so the first overlaps its own transcription)
DIARIZE_WORKERS = 1


class GlmAsr:
    """A loaded checkpoint (config, model, prompt builder, device, dtype) and its shared engine.

    A context manager: ``with glmasr.load(path) as asr: ...`` closes (frees) it at the end of the block."""

    def __init__(self, config: GlmAsrConfig, model, prompts: PromptBuilder, folder: Path, frontend="torch",
                 options: EngineOptions | None = None, load_timings: dict | None = None,
                 aligner: Aligner | None = None):
        self.config = config
        # word times for requests with DecodeOptions.word_timestamps (glmasr.align), bound to ``model``; or None
        self.aligner = aligner
        self.model = model  # GlmAsrModel (plain torch) or FastGlmAsrModel (Triton kernels)
        self.prompts = prompts
        self.folder = folder
        # "torch" (features.py) or "cuda" (fused cuFFTDx kernel, kernels/logmel); while its cubin is still being
        # built in the background (load), the build, joined on first use
        self._frontend = frontend
        self.options = (options or EngineOptions()).resolved(model.device.type)
        check_batch_invariance(model, self.options)
        self.load_timings = load_timings or {}
        self._device, self._dtype = model.device, model.dtype  # kept past close() (repr, error messages)
        self._engine: Engine | None = None
        self._loop: EngineLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.background_warmup: Future | None = None  # warmup_in_background's, while or after it runs
        self._close_hooks: list = []  # fn(handle), called once by close() (the api's shared-model cache)
        # DecodeOptions.diarize: glmasr.diarize.Diarizer, its thread and (CUDA) stream, built on first use
        self._diarize_lock = threading.Lock()
        self._diarizer = None
        self._diarize_pool: ThreadPoolExecutor | None = None
        self._diarize_stream = None

    @property
    def frontend(self) -> str:
        if isinstance(self._frontend, _Background):
            self._frontend = self._frontend.result(self.load_timings) or "torch"
        return self._frontend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        if self._closed:
            return f"GlmAsr(folder={str(self.folder)!r}, device={self.device}, dtype={self.dtype}, closed)"
        return (f"GlmAsr(folder={str(self.folder)!r}, device={self.device}, dtype={self.dtype}, "
                f"model={type(self.model).__name__}, frontend={self.frontend!r}, max_batch={self.options.max_batch})")

    def __enter__(self) -> "GlmAsr":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _closed_error(self) -> EngineClosed:
        return EngineClosed(f"this GlmAsr ({self.folder} on {self.device}) was closed and its model freed; "
                            f"load the checkpoint again (glmasr.load) to use it")

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    # ---- the engine ----
    @property
    def engine(self) -> Engine:
        with self._lock:
            self._check_open()
            if self._engine is None:
                self._engine = Engine(self.model, self.options, lambda: self.frontend)
            return self._engine

    @property
    def loop(self) -> EngineLoop:
        engine = self.engine
        with self._lock:
            self._check_open()
            if self._loop is None:
                self._loop = EngineLoop(engine)
            return self._loop

    def reconfigure(self, **options) -> None:
        """New engine options (e.g. ``max_batch``): waits for the requests in hand, then rebuilds the engine."""
        self._check_open()
        new = dataclasses.replace(self.options, **options).resolved(self.device.type)
        check_batch_invariance(self.model, new)
        if new == self.options:
            return
        self._stop_engine()
        with self._lock:
            self.options = new

    def _stop_engine(self) -> None:
        """Finish the requests in hand and stop the engine thread, keeping the model (the next request builds a
        new engine): ``reconfigure``'s rebuild, not the public ``close``."""
        with self._lock:
            loop, self._loop, self._engine = self._loop, None, None
        if loop is not None:
            loop.close()

    def close(self) -> None:
        """Free the handle: the requests in hand finish (their jobs still deliver), the engine thread stops, and
        the model's tensors, KV cache and graphs are released (on CUDA the cached blocks are returned to the
        device). Later use (``submit``, ``transcribe(model=...)``, ``warmup``...) raises ``EngineClosed``.
        Idempotent; thread-safe."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        """``close``; ``wait=False`` returns without waiting for the requests in hand (the engine thread lets
        go of the model once they are done)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, self._loop, self._engine = self._loop, None, None
            # the jobs in flight hold what they need (their assembler, their aligner: freed after the last)
            self.model = self.prompts = self.aligner = None
            hooks, self._close_hooks = self._close_hooks, []
        with self._diarize_lock:  # the jobs in flight hold their diarizer; queued diarizations still run
            pool, self._diarize_pool, self._diarizer, self._diarize_stream = self._diarize_pool, None, None, None
        if loop is not None:
            loop.close(None if wait else 0)
        del loop
        if pool is not None:
            pool.shutdown(wait=wait)
        if wait and self._device.type == "cuda":
            import gc

            gc.collect()  # graphs and their pools can sit in reference cycles
            torch.cuda.empty_cache()
        for hook in hooks:
            hook(self)

    def prime(self) -> dict:
        """Make the one-clip path ready: compile its kernels and capture its graphs on the engine thread (encoder
        bucket 1, the 64- and 128-position prefills: clips up to ~5 s, the batch-1 decode step), then run one
        short request end to end (the frontend's first launch and the eager glue around the graphs). ``load``
        does this on CUDA, so the first request finds it all ready; the graphs' part overlaps the frontend's
        NVRTC build, which goes on in its background thread. Returns ms per stage."""
        import numpy as np

        timings = self.loop.call(lambda eng: eng.warmup(batch_sizes=(1,), kv_lens=(256,), prefill_lengths=(64, 128),
                                                        encoder_windows=(1,), compile_ahead=False)).result()
        t0 = time.perf_counter()
        noise = (np.random.default_rng(0).standard_normal(32000) * 0.1).astype(np.float32)
        self.submit(noise, DecodeOptions(max_new_tokens=2, ignore_eos=True), sampling_rate=16000).result()
        timings["first_request_ms"] = 1e3 * (time.perf_counter() - t0)
        return timings

    def warmup(self, batch_sizes=None, kv_lens=WARMUP_KV_LENS, prefill_lengths=WARMUP_PREFILL_LENGTHS) -> dict:
        """Compile every kernel and capture the CUDA graphs a server needs before it answers: one short request
        end to end (frontend, encoder, prefill, decode), then the decode graphs for ``batch_sizes`` (default:
        every batch bucket up to max_batch) x ``kv_lens`` and the prefill graphs for ``prefill_lengths``.
        Returns ms per stage. Runs on the engine thread when it is idle."""
        import numpy as np

        t0 = time.perf_counter()
        noise = (np.random.default_rng(0).standard_normal(16000) * 0.1).astype(np.float32)
        self.submit(noise, DecodeOptions(max_new_tokens=16, ignore_eos=True), sampling_rate=16000).result()
        timings = {"first_request_ms": 1e3 * (time.perf_counter() - t0)}
        if batch_sizes is None:
            batch_sizes = self.engine.runner.buckets
        timings.update(self.loop.call(lambda eng: eng.warmup(
            batch_sizes=batch_sizes, kv_lens=kv_lens, prefill_lengths=prefill_lengths)).result())
        timings["total_ms"] = 1e3 * (time.perf_counter() - t0)
        return timings

    def warmup_in_background(self, batch_sizes=None, kv_lens=WARMUP_KV_LENS,
                             prefill_lengths=WARMUP_PREFILL_LENGTHS) -> Future:
        """``warmup``'s graph captures, one at a time on the engine thread whenever it has nothing else to do, so
        requests go first and wait for at most one capture (~0.1 s; seconds where a capture meets a cold Triton
        cache: ``glmasr compile`` fills it ahead). Returns at once; the future's result is ms per stage once
        every capture has run (a failed one is logged, listed under "errors", and left to the first request that
        needs it). ``load(warmup="background")`` calls this after the one-clip path is ready."""
        if batch_sizes is None:
            batch_sizes = self.engine.runner.buckets
        units = self.loop.call(lambda eng: eng.warmup_units(
            batch_sizes=batch_sizes, kv_lens=kv_lens, prefill_lengths=prefill_lengths)).result()
        fut = self.loop.run_when_idle([(stage, lambda eng, unit=unit: unit()) for stage, unit in units])
        self.background_warmup = fut
        return fut

    # ---- speakers ----
    def _diarization(self):
        """(diarizer, its thread pool, its CUDA stream or None), built on first use in the caller's thread:
        ``DiarizationUnavailableError`` (naming ``pip install 'glmasr[diarize]'``) without the weights."""
        with self._diarize_lock:
            self._check_open()
            if self._diarizer is None:
                from .diarize import Diarizer, weights

                for name in (weights.SEGMENTATION_FILE, weights.EMBEDDING_FILE):  # the wheel, not a cached copy
                    weights.data_file(name)
                diarizer = Diarizer(self.device)  # raises before anything is kept
                stream = None
                if self.device.type == "cuda":  # its own stream, after the weights' copies on this one
                    stream = torch.cuda.Stream(self.device)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                self._diarize_pool = ThreadPoolExecutor(DIARIZE_WORKERS, thread_name_prefix="glmasr-diarize")
                self._diarizer, self._diarize_stream = diarizer, stream
            return self._diarizer, self._diarize_pool, self._diarize_stream

    # ---- requests ----
    def submit(self, audio, decode: DecodeOptions | None = None, sampling_rate: int | None = None,
               index: int = 0, pieces: list[tuple[float, float]] | None = None, *, timeout: float | None = None,
               priority: int = Priority.BATCH) -> "TranscriptionJob":
        """Load and plan one audio in this thread, queue it on the engine; returns at once. ``pieces``: your own
        segmentation, (start_s, end_s) stretches of at most 30 s, one prompt each (instead of
        ``decode.segmentation``); each becomes a segment with those times. ``timeout``: seconds from this call
        after which the engine drops the request, queued or running, and the job raises
        ``RequestTimeoutError``. ``priority``: the request's class (``Priority``, or any int: lower is encoded and
        admitted first); a running request of ``Priority.DRAFT`` or worse is preempted when better ones need its
        slot, and the job raises ``RequestPreempted``."""
        deadline, timeout = self._deadline(timeout)
        priority = check_priority(priority)
        self._check_open()
        decode = decode or DecodeOptions()
        t0 = time.perf_counter()
        a = load_audio(audio, sampling_rate)  # an Audio passes through as it is
        return self._submit(a, decode, index, t0, 1e3 * (time.perf_counter() - t0), pieces, deadline, timeout,
                            priority)

    def submit_loaded(self, audio: Audio, decode: DecodeOptions, index: int = 0, t_start: float | None = None,
                      audio_ms: float = 0.0, pieces: list[tuple[float, float]] | None = None, *,
                      timeout: float | None = None, priority: int = Priority.BATCH) -> "TranscriptionJob":
        """``submit`` for audio already loaded (``t_start``: when the caller's request began, perf_counter;
        ``audio_ms``: what loading it took, both for the timings). ``timeout``: seconds from this call, enforced
        by the engine (``RequestTimeoutError``); ``priority`` as in ``submit``."""
        deadline, timeout = self._deadline(timeout)
        return self._submit(audio, decode, index, t_start, audio_ms, pieces, deadline, timeout,
                            check_priority(priority))

    @staticmethod
    def _deadline(timeout) -> tuple[float | None, float | None]:
        timeout = check_timeout(timeout)
        return (None if timeout is None else time.monotonic() + timeout), timeout

    def _submit(self, audio: Audio, decode: DecodeOptions, index: int, t_start: float | None, audio_ms: float,
                pieces, deadline: float | None, timeout_s: float | None,
                priority: int = Priority.BATCH) -> "TranscriptionJob":
        """Plan and queue; ``deadline``: a ``time.monotonic()`` instant (``timeout_s``: the timeout it stands
        for, named in the error)."""
        self._check_open()
        aligner = self.aligner
        if decode.word_timestamps and aligner is None:
            raise ValueError("word_timestamps=True needs an aligner, and this model was loaded without one: load it "
                             "with glmasr.load(model, aligner=PATH) (transcribe(..., aligner=PATH); the CLI and "
                             "server: --aligner PATH), PATH a glm-asr-ctc head folder or its hub id "
                             "(JazerJu/glm-asr-ctc)")
        speakers = None
        if decode.diarize:  # refused before any work: bad references, missing weights
            from .diarize import check_known

            known = check_known(decode.known_speakers)
            diarizer, pool, side_stream = self._diarization()
            # started now, so that it overlaps the planning (VAD) as well as the transcription
            speakers = _Speakers(diarizer, pool, side_stream, audio, decode, known)
        try:
            t_start = time.perf_counter() if t_start is None else t_start
            if pieces is not None:
                plans = plan_pieces(audio, pieces, self.prompts, self.config, decode)
            else:
                plans = plan_audio(audio, self.prompts, self.config, decode, device=self.device)
            assembler = TranscriptAssembler(self.prompts, plans, audio.duration_s,
                                            sum(p.num_windows for p in plans), index, t_start, audio_ms,
                                            audio.missing_s if audio.truncated else 0.0)
            words = _WordTimes(aligner, audio, plans) if decode.word_timestamps else None
            if not plans:  # nothing to decode (no speech found): the job is done already, no segment to label
                if speakers is not None:
                    speakers.skip()
                return TranscriptionJob(_DoneStream(assembler), assembler, words, speakers)
            stream = self._queue(plans, decode, deadline, timeout_s, priority)
        except BaseException:
            if speakers is not None:
                speakers.cancel()
            raise
        return TranscriptionJob(stream, assembler, words, speakers)

    def _queue(self, plans, decode: DecodeOptions, deadline, timeout_s, priority):
        """The plans on the engine: their stream."""
        for attempt in (0, 1):
            loop = self.loop
            try:
                stream = loop.submit(plans, ignore_eos=decode.ignore_eos, repetition_stop=decode.repetition_stop,
                                     deadline=deadline, timeout_s=timeout_s, priority=priority)
                break
            except EngineClosed:
                self._check_open()  # closed meanwhile: say so
                if attempt:
                    raise
                # else reconfigure() stopped that engine between the two lines: the next one takes it
        return stream


class _WordTimes:
    """A job's word-time pass: the aligner and each segment's samples (views of the recording, kept from
    submit, since the engine drops its copies once encoded), applied once to the final ``Transcription``."""

    def __init__(self, aligner: Aligner, audio: Audio, plans):
        self.aligner = aligner
        self.samples = audio.samples
        # each plan's windows are consecutive samples from start_s (30 s windows, or one piece)
        self.spans = []
        for p in plans:
            a = int(round(p.start_s * SAMPLE_RATE))
            n = sum(w.shape[0] for w in p.windows) if p.windows is not None else int(round(p.seconds * SAMPLE_RATE))
            self.spans.append((a, a + n))
        self.done = False

    def apply(self, result: Transcription) -> None:
        if self.done or result is None:
            return
        self.done = True
        t0 = time.perf_counter()
        segments = [AlignSegment(self.samples[a:b], a / SAMPLE_RATE, seg.text)
                    for (a, b), seg in zip(self.spans, result.segments)]
        words = self.aligner.align(segments) if segments else []
        for seg, w in zip(result.segments, words):
            seg.words = w
        align_ms = 1e3 * (time.perf_counter() - t0)
        result.timings_ms["align_ms"] = align_ms
        result.timings_ms["total_ms"] = result.timings_ms.get("total_ms", 0.0) + align_ms


class _Speakers:
    """A job's diarization: started on the handle's diarization thread when the job is made (so it runs beside the
    transcription), applied once to the final ``Transcription`` (``apply`` waits for it)."""

    def __init__(self, diarizer, pool: ThreadPoolExecutor, stream, audio: Audio, decode: DecodeOptions,
                 known: dict | None):
        self.done = False
        self.run_ms = 0.0
        self.started: float | None = None  # perf_counter when the diarization began (tests, timings)
        self._cancel = threading.Event()
        self._future = pool.submit(self._run, diarizer, stream, audio.samples, decode.min_speakers,
                                   decode.max_speakers, known)

    def skip(self) -> None:
        """Nothing to label (no segments): stop the diarization; ``apply`` then records no run."""
        self.cancel()
        self._future = None

    def _run(self, diarizer, stream, samples, min_speakers, max_speakers, known):
        self.started = t0 = time.perf_counter()
        try:
            if stream is None:
                return diarizer.diarize(samples, min_speakers, max_speakers, known, cancel=self._cancel)
            # its own stream: it neither waits for the engine's work nor is captured into its graphs
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                turns = diarizer.diarize(samples, min_speakers, max_speakers, known, cancel=self._cancel)
            stream.synchronize()
            return turns
        finally:
            self.run_ms = 1e3 * (time.perf_counter() - t0)

    def cancel(self) -> None:
        """Stop the diarization (queued: never started; running: at its next batch)."""
        self._cancel.set()
        if self._future is not None:
            self._future.cancel()

    def apply(self, result: Transcription) -> None:
        """Wait for the diarization and label ``result``'s segments and words (raises the diarization's error)."""
        from .diarize import assign

        if self.done or result is None:
            return
        self.done = True
        t0 = time.perf_counter()
        turns = self._future.result() if self._future is not None else []
        wait_ms = 1e3 * (time.perf_counter() - t0)
        for seg, who in zip(result.segments, assign(turns, result.segments)):
            seg.speaker = who
        words = [w for seg in result.segments for w in (seg.words or ())]
        for w, who in zip(words, assign(turns, words)):
            w.speaker = who
        result.timings_ms["diarize_ms"] = self.run_ms if self._future is not None else 0.0
        result.timings_ms["diarize_wait_ms"] = wait_ms
        result.timings_ms["total_ms"] = result.timings_ms.get("total_ms", 0.0) + wait_ms


class _DoneStream:
    """The stream of a request that needs no engine work: one final output, then the end."""

    request_id = -1
    finished = exhausted = True

    def __init__(self, assembler):
        from .engine.request import SequenceOutput

        self._items = [SequenceOutput(-1, 0, [], None, None, True, {})] if not assembler.plans else []

    def __iter__(self):
        items, self._items = self._items, []
        return iter(items)

    async def __aiter__(self):
        for item in self.__iter__():
            yield item

    def poll(self):
        return list(self.__iter__())

    def set_listener(self, fn):
        fn()

    def set_timeout(self, timeout):
        check_timeout(timeout)

    def close(self):
        pass


class TranscriptionJob:
    """One submitted audio: iterate ``deltas()`` (or ``async for`` over ``adeltas()``) for streamed text, or
    wait for ``result()``; ``abort()`` (or closing the delta iterator early) frees its engine slots."""

    def __init__(self, stream, assembler: TranscriptAssembler, words: "_WordTimes | None" = None,
                 speakers: "_Speakers | None" = None):
        self.stream = stream
        self.assembler = assembler
        self._words = words  # with DecodeOptions.word_timestamps: applied to the final result before it is given
        self._speakers = speakers  # with DecodeOptions.diarize: applied after the words

    def _finish(self, result) -> None:
        """The final result's word times, then its speakers (both in the calling thread)."""
        if self._words is not None:
            self._words.apply(result)
        if self._speakers is not None:
            self._speakers.apply(result)

    def _close(self) -> None:
        self.stream.close()  # no-op once finished; an abandoned iteration aborts the request
        if self._speakers is not None and not self._speakers.done:
            self._speakers.cancel()

    @property
    def request_id(self) -> int:
        return self.stream.request_id

    def _complete(self, deltas: list[TranscriptDelta]) -> list[TranscriptDelta]:
        for d in deltas:
            if d.finished:
                self._finish(d.result)
        return deltas

    def deltas(self, stream: bool = True):
        try:
            for out in self.stream:
                yield from self._complete(self.assembler.feed(out, stream))
        finally:
            self._close()

    async def adeltas(self, stream: bool = True):
        import asyncio

        try:
            async for out in self.stream:
                for d in self.assembler.feed(out, stream):
                    if d.finished and (self._words is not None or self._speakers is not None):
                        await asyncio.to_thread(self._finish, d.result)  # model work, a wait: off the event loop
                    yield d
        finally:
            self._close()

    def poll(self) -> list[TranscriptDelta]:
        """The deltas available now, without waiting; ``done`` once the last one was taken (with word
        times, the last one is aligned in this call; with speakers, it waits for the diarization)."""
        return self._complete([d for out in self.stream.poll() for d in self.assembler.feed(out)])

    @property
    def done(self) -> bool:
        return self.stream.exhausted

    def result(self, timeout: float | None = None) -> Transcription:
        """The transcription, once the engine is done. ``timeout``: seconds from now; past it the engine drops
        the request (an earlier timeout it has stays) and this raises ``RequestTimeoutError``."""
        if timeout is not None:
            self.stream.set_timeout(timeout)
        for _ in self.deltas(stream=False):  # no incremental detokenizing: the text is decoded once
            pass
        return self._final()

    async def aresult(self, timeout: float | None = None) -> Transcription:
        """``result`` for asyncio code."""
        if timeout is not None:
            self.stream.set_timeout(timeout)
        async for _ in self.adeltas(stream=False):
            pass
        return self._final()

    def _final(self) -> Transcription:
        if self.assembler.result is None:  # the stream ended without its last output: it was aborted
            raise RuntimeError(f"request {self.request_id} was aborted")
        return self.assembler.result

    def abort(self) -> None:
        """Drop the request (a no-op once finished) and cancel its diarization if it has not been applied."""
        self._close()


def load(model: str | os.PathLike = DEFAULT_MODEL_ID, device=None, dtype=None, backend: str = "auto",
         warmup: bool | str = False, aligner=None, decode_weights: str = "bf16", **engine_options) -> GlmAsr:
    """Load a GLM-ASR checkpoint (local folder or hub id) onto ``device`` (default: CUDA if present) in
    ``dtype`` (default: bf16 on CUDA, fp32 on CPU). ``backend``: "torch" (plain-PyTorch reference path),
    "triton" (Triton kernels + fused weight cache, CUDA only) or "auto" (triton on CUDA, torch on CPU).
    ``engine_options``: fields of ``EngineOptions`` (max_batch, encoder_chunk, ...), over ``GLMASR_*``
    variables. ``warmup``: False (default): on CUDA the one-clip path (encoder bucket 1, the 64-position
    prefill, the batch-1 decode step) is made ready before ``load`` returns, other graphs when first used;
    True: every kernel and graph now (``GlmAsr.warmup``, what a server does before it answers); "background":
    the one-clip path now, the rest on the engine thread while it is idle (``GlmAsr.warmup_in_background``).
    ``aligner``: word times for ``DecodeOptions(word_timestamps=True)``: a glm-asr-ctc head folder or hub id
    (``glmasr.align.CtcAligner``, loaded and checked before the model's weights), or an ``glmasr.align.Aligner``
    instance; None: no word times. ``decode_weights``: "bf16" (default) or "int8", opt-in: the decode step's
    GEMVs stream per-row int8 copies of the decoder's matrices (Triton path only; ~1.35 GB more memory for the
    full-size model, the bf16 matrices stay for the prefill; changes the logits slightly: check WER on your data;
    ``glmasr/models/fast_decoder.py``). ``load_timings`` on the result has ms per stage.

    The tokenizer (importing transformers is most of its cost) and, on CUDA, the log-mel frontend's cubin (an
    NVRTC compile when its cache is cold) are prepared in background threads while the weights stream in."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    check_decode_weights(decode_weights)
    if not (isinstance(warmup, bool) or warmup == "background"):
        raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    options = EngineOptions.from_env(**engine_options)
    if backend == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU testing), got {dev}")
    folder = resolve_checkpoint(model)
    cfg = read_config(folder)
    timings["config_ms"] = 1e3 * (time.perf_counter() - t_start)
    if dev.type == "cuda":  # the CUDA context: a fixed cost of the process, measured apart
        t = time.perf_counter()
        torch.empty(1, device=dev)
        torch.cuda.synchronize(dev)
        timings["cuda_init_ms"] = 1e3 * (time.perf_counter() - t)
    if aligner is not None:  # before the weights: a bad aligner folder fails fast
        t = time.perf_counter()
        aligner = load_aligner(aligner, folder, dev, cfg)
        timings["aligner_ms"] = 1e3 * (time.perf_counter() - t)
    fast = backend == "triton" or (backend == "auto" and dev.type == "cuda")
    if decode_weights != "bf16" and not fast:
        raise ValueError(f"decode_weights={decode_weights!r} needs the Triton path (backend='triton' or 'auto' on a "
                         f"CUDA device; TRITON_INTERPRET=1 with backend='triton' for CPU testing); this load runs "
                         f"the plain PyTorch path (backend={backend!r} on {dev})")
    if fast:  # imported here, before the threads start, so no two threads import the same modules at once
        from .models.fast import FastGlmAsrModel
        if dev.type == "cuda":
            import glmasr_kernels.logmel  # noqa: F401
    tokenizer = _Background("tokenizer_ms", PromptBuilder.from_folder, folder, cfg.audio_token_id)
    frontend_build = gemv_build = triton_setup = None
    if fast and dev.type == "cuda":
        from .models.fast_decoder import prebuild_cuda_gemv

        from glmasr_kernels._triton_utils import prepare_runtime

        frontend_build = _Background("frontend_build_ms", _prepare_frontend, cfg, dev)
        gemv_build = _Background("gemv_build_ms", prebuild_cuda_gemv, dev)
        triton_setup = _Background("triton_setup_ms", prepare_runtime, dev)
    t = time.perf_counter()
    with torch.device("meta"):
        net = GlmAsrModel(cfg)
    timings["meta_model_ms"] = 1e3 * (time.perf_counter() - t)
    state = load_state_dict(folder, net, dev, dt, timings=timings)
    t_assign = time.perf_counter()
    net.load_state_dict(state, strict=True, assign=True)
    net.eval().requires_grad_(False)
    del state
    timings["weights_assign_ms"] = 1e3 * (time.perf_counter() - t_assign)
    # meta model + load_state_dict + assign; on the H200 (2026-12-01) 5.6-6.7 s against 0.4-0.65 s inside
    # load_state_dict: the two stages above say where the rest goes
    timings["weights_ms"] = 1e3 * (time.perf_counter() - t)
    frontend = "torch"
    if fast:
        t = time.perf_counter()
        net = FastGlmAsrModel(net, decode_weights=decode_weights)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        timings["weight_fusion_ms"] = 1e3 * (time.perf_counter() - t)
        if frontend_build is not None:
            frontend = frontend_build  # joined when the engine first needs it
    prompts = tokenizer.result(timings)
    if aligner is not None:
        aligner.bind(net)
    timings["total_ms"] = 1e3 * (time.perf_counter() - t_start)
    asr = GlmAsr(cfg, net, prompts, folder, frontend, options, timings, aligner)
    for build in (gemv_build, triton_setup):  # before the first kernel launches
        if build is not None:
            build.result(timings)
    if warmup is True:
        timings.update({f"warmup_{k}": v for k, v in asr.warmup().items()})
    elif dev.type == "cuda" and fast:
        t = time.perf_counter()
        asr.prime()
        timings["prime_ms"] = 1e3 * (time.perf_counter() - t)
        if warmup == "background":
            asr.warmup_in_background()
    return asr


def _prepare_frontend(cfg, dev: torch.device) -> str | None:
    """"cuda" when the fused log-mel frontend can serve this config on this machine (its cubin built or loaded
    now), else None, with one warning saying why when the config is the reason."""
    import warnings

    from glmasr_kernels.logmel import is_available, prebuild

    from .errors import KernelFallbackWarning
    from .models.kernel_support import kernel_support

    reason = kernel_support(cfg)["frontend"]
    if reason is not None:
        warnings.warn(f"log-mel frontend: {reason}; using the plain-torch features", KernelFallbackWarning)
        return None
    if not is_available():
        return None
    prebuild(cfg.audio.num_mel_bins, dev)
    return "cuda"


class _Background:
    """``fn(*args)`` in a daemon thread; ``result(timings)`` joins it, records its wall time under ``name``, and
    returns its value or raises its exception in the caller."""

    def __init__(self, name: str, fn, *args):
        self.name = name
        self._out: dict = {}

        def run():
            t0 = time.perf_counter()
            try:
                self._out["value"] = fn(*args)
            except BaseException as e:  # re-raised by result()
                self._out["error"] = e
            self._out["ms"] = 1e3 * (time.perf_counter() - t0)

        self._thread = threading.Thread(target=run, name=f"glmasr-load-{name}", daemon=True)
        self._thread.start()

    def result(self, timings: dict):
        self._thread.join()
        timings[self.name] = self._out["ms"]
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]
