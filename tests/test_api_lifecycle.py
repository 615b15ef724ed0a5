"""The lifecycle of loaded models and of requests with deadlines.

- ``transcribe(model=PATH)`` keeps the model it loaded: a loop of calls loads once and runs one engine thread;
  a call naming another checkpoint replaces it (the old one closed and freed).
- ``GlmAsr`` is a context manager; ``close()`` stops its engine thread and releases the model (a weakref to it
  dies), and later use is a clear error.
- Timeouts are enforced by the engine: a request past its deadline is dropped between rounds, queued or
  running, its slots freed, and its caller gets ``RequestTimeoutError``; the requests beside it get exactly the
  tokens they get alone.
"""

import asyncio
import gc
import shutil
import threading
import time
import weakref

import pytest
import torch

import glmasr
import glmasr.handle
from glmasr import RequestTimeoutError
from glmasr.api import _shared
from glmasr.options import Priority, DecodeOptions

from conftest import bounded, noise

LONG = DecodeOptions(max_new_tokens=7000, ignore_eos=True)  # tens of seconds on the CPU: it never finishes here


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "glmasr-engine" and t.is_alive()]


@pytest.fixture
def fresh_cache():
    glmasr.close_shared_model()
    yield
    glmasr.close_shared_model()


@pytest.fixture
def count_loads(monkeypatch):
    """The folders of the handles built from now on (every load builds one)."""
    loads = []
    real = glmasr.handle.GlmAsr.__init__

    def counted(self, config, model, prompts, folder, *args, **kwargs):
        loads.append(folder)
        real(self, config, model, prompts, folder, *args, **kwargs)

    monkeypatch.setattr(glmasr.handle.GlmAsr, "__init__", counted)
    return loads


def key(r):
    return r.token_ids, r.text, r.finish_reason


def settle(asr, seconds=10.0):
    """Wait until the engine holds nothing (an abort or expiry is applied at its next round)."""
    deadline = time.perf_counter() + seconds
    while asr.engine.has_unfinished() and time.perf_counter() < deadline:
        time.sleep(0.01)
    sched = asr.engine.scheduler
    assert not asr.engine.has_unfinished()
    assert sched.num_running == 0 and not sched.requests and not sched.waiting and not sched.ready


# ---- the kept model ----

def test_calls_with_a_path_load_the_model_once(tiny_shipped, fresh_cache, count_loads):
    audios = [noise(s, 40 + i) for i, s in enumerate((2.0, 3.5, 1.0, 5.0))]
    before = len(engine_threads())
    got = [key(glmasr.transcribe(a, model=str(tiny_shipped), device="cpu", sampling_rate=16000, max_new_tokens=6))
           for a in audios]
    assert len(count_loads) == 1, f"{len(count_loads)} loads for 4 calls"
    assert len(engine_threads()) - before <= 1
    kept = _shared.current
    assert kept is not None and not kept.closed
    streamed = [d.result for d in glmasr.transcribe_stream(audios[0], model=tiny_shipped, device="cpu",
                                                             sampling_rate=16000, max_new_tokens=6) if d.finished]
    assert len(count_loads) == 1 and _shared.current is kept  # the same model under another spelling of the path
    with glmasr.load(tiny_shipped, device="cpu") as asr:  # the reference: an explicit handle
        ref = [key(glmasr.transcribe(a, model=asr, sampling_rate=16000, max_new_tokens=6)) for a in audios]
    assert got == ref and key(streamed[0]) == ref[0]


def test_another_model_replaces_the_kept_one(tiny_shipped, tmp_path, fresh_cache, count_loads):
    other = tmp_path / "other"
    shutil.copytree(tiny_shipped, other)  # another folder: another model as far as the cache can tell
    audio = noise(2.0, 50)
    a = glmasr.transcribe(audio, model=tiny_shipped, device="cpu", sampling_rate=16000, max_new_tokens=5)
    first = _shared.current
    first_model = weakref.ref(first.model)
    first_thread = first.loop._thread
    b = glmasr.transcribe(audio, model=other, device="cpu", sampling_rate=16000, max_new_tokens=5)
    assert len(count_loads) == 2 and _shared.current is not first and first.closed
    assert not first_thread.is_alive()
    gc.collect()
    assert first_model() is None, "the replaced model is still alive"
    assert key(a) == key(b)  # the same weights
    with pytest.raises(glmasr.EngineClosed, match="was closed"):
        first.submit(audio, sampling_rate=16000)


def test_closing_the_kept_handle_makes_the_cache_forget_it(tiny_shipped, fresh_cache, count_loads):
    audio = noise(2.0, 51)
    a = glmasr.transcribe(audio, model=tiny_shipped, device="cpu", sampling_rate=16000, max_new_tokens=5)
    kept = _shared.current
    kept.close()
    assert _shared.current is None
    b = glmasr.transcribe(audio, model=tiny_shipped, device="cpu", sampling_rate=16000, max_new_tokens=5)
    assert len(count_loads) == 2 and key(a) == key(b)
    glmasr.close_shared_model()
    assert _shared.current is None


def test_close_frees_the_model_and_later_use_is_a_clear_error(tiny_shipped):
    audio = noise(2.0, 52)
    with glmasr.load(tiny_shipped, device="cpu", max_batch=4) as asr:
        a = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=6)
        asr.reconfigure(max_batch=2)  # the internal rebuild keeps the model
        assert not asr.closed and asr.model is not None
        b = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=6)
        assert key(a) == key(b)
        model = weakref.ref(asr.model)
        cache = weakref.ref(asr.engine.runner.cache.k)
        thread = asr.loop._thread
        pending = asr.submit(noise(1.5, 53), DecodeOptions(max_new_tokens=30, ignore_eos=True), sampling_rate=16000)
    assert asr.closed and not thread.is_alive()
    gc.collect()
    assert model() is None and cache() is None, "close() left the model or its KV cache alive"
    assert len(pending.result().token_ids) == 30, "a request in hand at close finishes (a job outlives the model)"
    for use in (lambda: asr.submit(audio, sampling_rate=16000),
                lambda: glmasr.transcribe(audio, model=asr, sampling_rate=16000),
                lambda: asr.warmup(),
                lambda: asr.reconfigure(max_batch=3)):
        with pytest.raises(glmasr.EngineClosed, match=r"was closed .*load the checkpoint again"):
            use()
    asr.close()  # idempotent
    assert "closed" in repr(asr)


# ---- deadlines ----

def test_a_running_request_times_out_and_its_neighbour_is_untouched(tiny_shipped):
    asr = glmasr.load(tiny_shipped, device="cpu", max_batch=4)
    try:
        side_audio, side_opts = noise(2.5, 60), DecodeOptions(max_new_tokens=400, ignore_eos=True)
        alone = key(asr.submit(side_audio, side_opts, sampling_rate=16000).result())
        t0 = time.perf_counter()
        long_job = asr.submit(noise(3.0, 61), LONG, sampling_rate=16000, timeout=0.5)
        side = asr.submit(side_audio, side_opts, sampling_rate=16000)
        with pytest.raises(RequestTimeoutError, match=r"timeout of 0.5 s.*while decoding"):
            bounded(long_job.result, 30)
        assert time.perf_counter() - t0 < 10
        assert not side.stream.finished, "the neighbour finished before the expiry: the test proves nothing"
        assert key(bounded(side.result, 60)) == alone
        settle(asr)
        later = asr.submit(noise(1.0, 62), DecodeOptions(max_new_tokens=8, ignore_eos=True), sampling_rate=16000)
        assert len(bounded(later.result, 30).token_ids) == 8
    finally:
        asr.close()


def test_a_queued_request_expires_before_it_gets_a_slot(tiny_shipped):
    asr = glmasr.load(tiny_shipped, device="cpu", max_batch=1)
    try:
        running = asr.submit(noise(2.0, 63), DecodeOptions(max_new_tokens=600, ignore_eos=True), sampling_rate=16000)
        queued = asr.submit(noise(2.0, 64), LONG, sampling_rate=16000, timeout=0.3)
        with pytest.raises(RequestTimeoutError, match=r"timeout of 0.3 s.*queued"):
            bounded(queued.result, 30)
        assert not running.stream.finished, "the slot was free: the queued request was never queued"
        assert len(bounded(running.result, 60).token_ids) == 600
        settle(asr)
    finally:
        asr.close()


def test_result_timeout_on_a_job_submitted_without_one(tiny_shipped):
    asr = glmasr.load(tiny_shipped, device="cpu", max_batch=2)
    try:
        job = asr.submit(noise(2.0, 65), LONG, sampling_rate=16000)
        t0 = time.perf_counter()
        with pytest.raises(RequestTimeoutError, match="timeout of 0.4 s"):
            bounded(lambda: job.result(timeout=0.4), 30)
        assert time.perf_counter() - t0 < 10
        settle(asr)

        async def waits():
            j = asr.submit(noise(2.0, 66), LONG, sampling_rate=16000)
            await j.aresult(timeout=0.3)

        with pytest.raises(RequestTimeoutError, match="timeout of 0.3 s"):
            bounded(lambda: asyncio.run(waits()), 30)
        settle(asr)
        # a timeout that is not reached changes nothing
        opts = DecodeOptions(max_new_tokens=12, ignore_eos=True)
        audio = noise(1.5, 67)
        assert key(asr.submit(audio, opts, sampling_rate=16000, timeout=60).result(timeout=60)) == \
            key(asr.submit(audio, opts, sampling_rate=16000).result())
    finally:
        asr.close()


def test_transcribe_timeout_covers_the_whole_call(tiny_shipped):
    asr = glmasr.load(tiny_shipped, device="cpu", max_batch=1)
    try:
        audios = [noise(2.0, 70), noise(3.0, 71)]
        t0 = time.perf_counter()
        with pytest.raises(RequestTimeoutError, match="timeout of 0.5 s"):  # one runs, the other waits
            bounded(lambda: glmasr.transcribe(audios, model=asr, sampling_rate=16000, max_new_tokens=7000,
                                              ignore_eos=True, timeout=0.5), 30)
        assert time.perf_counter() - t0 < 10
        settle(asr)

        def stream():
            return [d for d in glmasr.transcribe_stream(audios[0], model=asr, sampling_rate=16000, timeout=0.5)]

        blocker = asr.submit(noise(2.0, 72), LONG, sampling_rate=16000)  # holds the only slot
        with pytest.raises(RequestTimeoutError, match=r"timeout of 0.5 s.*queued"):
            bounded(stream, 30)
        blocker.abort()
        settle(asr)
        ok = glmasr.transcribe(audios[1], model=asr, sampling_rate=16000, max_new_tokens=5, timeout=60)
        assert len(ok.token_ids) <= 5
    finally:
        asr.close()


def test_priority_and_deadline_reach_the_engine_request(tiny_asr, monkeypatch):
    from glmasr.engine.engine import Engine

    seen = []
    real = Engine.add_request

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("priority"), kwargs.get("deadline"), kwargs.get("timeout_s")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    before = time.monotonic()
    tiny_asr.submit(noise(1.0, 80), DecodeOptions(max_new_tokens=2), sampling_rate=16000, priority=3,
                    timeout=30).result()
    tiny_asr.submit(noise(1.0, 81), DecodeOptions(max_new_tokens=2), sampling_rate=16000).result()
    (p1, d1, t1), (p2, d2, t2) = seen
    assert p1 == 3 and t1 == 30 and before + 30 <= d1 <= time.monotonic() + 30
    assert p2 == Priority.BATCH and d2 is None and t2 is None  # the default class of GlmAsr.submit


@pytest.mark.parametrize("bad, error, message", [(0, ValueError, "positive"), (-1.0, ValueError, "positive"),
                                                 (float("nan"), ValueError, "finite"),
                                                 ("5", TypeError, "number of seconds"),
                                                 (True, TypeError, "number of seconds")])
def test_bad_timeouts_are_refused_before_anything_runs(tiny_asr, tmp_path, bad, error, message):
    with pytest.raises(error, match=f"timeout must be .*{message}"):
        glmasr.transcribe(noise(1.0, 1), model=str(tmp_path / "no-such-model"), sampling_rate=16000, timeout=bad)
    with pytest.raises(error, match=f"timeout must be .*{message}"):
        tiny_asr.submit(noise(1.0, 1), sampling_rate=16000, timeout=bad)
    with pytest.raises(TypeError, match="priority must be an int"):
        tiny_asr.submit(noise(1.0, 1), sampling_rate=16000, priority=1.5)
    assert not tiny_asr.engine.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_close_returns_the_gpu_memory(tiny_shipped, fresh_cache):
    """On the GPU path (fused weights, CUDA graphs, the frontend) close() releases the model: its weights and KV
    cache are no longer allocated, and a loop of ``transcribe(model=PATH)`` holds one model's memory, not one per
    call. (cuBLAS keeps a workspace per thread handle and stream for the life of the process; those are not the
    model's and are left alone: freeing them under another live graph would corrupt it.)"""
    audio = noise(3.0, 90)
    with glmasr.load(tiny_shipped, device="cuda") as asr:
        a = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=8)
        model = weakref.ref(asr.model)
        net = getattr(asr.model, "reference", asr.model)  # the GPU path wraps the plain model
        tensors = list(net.state_dict().values()) + [asr.engine.runner.cache.k, asr.engine.runner.cache.v]
        del net
        owned = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors if t.is_cuda}.values())
        del tensors
        loaded = torch.cuda.memory_allocated()
    gc.collect()
    assert model() is None, "close() left the model alive"
    assert torch.cuda.memory_allocated() <= loaded - owned
    held = []
    for _ in range(3):
        r = glmasr.transcribe(audio, model=tiny_shipped, device="cuda", sampling_rate=16000, max_new_tokens=8)
        assert key(r) == key(a)
        held.append(torch.cuda.memory_allocated())
    assert held[2] <= held[0], f"memory grows call after call: {held}"
    kept = weakref.ref(_shared.current.model)
    glmasr.close_shared_model()
    gc.collect()
    assert kept() is None
