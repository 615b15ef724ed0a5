"""Request priority classes (``glmasr.options.Priority``: LIVE_FINAL 0, UPLOAD 1, BATCH 2, DRAFT 3; lower first).

- Under a full engine, waiting requests are encoded and admitted by (priority, arrival); a waiting draft is never
  encoded while a better sequence waits; every request still gets the tokens it gets alone.
- A running request of priority >= DRAFT is preempted (newest first) when better ones wait for more slots than
  are free; nothing else is ever preempted. Through the engine loop its stream ends with ``RequestPreempted``
  (code "preempted"), the better request gets exactly its tokens alone, and the engine is left idle.
- The data-parallel client carries the priority and a forced prefix to its worker's engine, and a preempted
  draft surfaces there as ``RequestPreempted`` too.
"""

import asyncio
import time

import pytest

import glmasr
from glmasr.audio import load_audio
from glmasr.engine.engine import Engine
from glmasr.errors import EngineError, RequestPreempted, error_code, from_code
from glmasr.options import DecodeOptions, Priority
from glmasr.pipeline import plan_audio

from conftest import bounded, noise

LONG = DecodeOptions(max_new_tokens=7000, ignore_eos=True)  # seconds on the CPU: still running when preempted


def plans_for(asr, seed: int, budget: int, seconds: float = 2.0):
    audio = load_audio(noise(seconds + 0.25 * (seed % 5), seed), 16000)
    return plan_audio(audio, asr.prompts, asr.config, DecodeOptions(max_new_tokens=budget))


def alone(asr, seed: int, budget: int, seconds: float = 2.0) -> list[int]:
    engine = Engine(asr.model, max_batch=1)
    rid = engine.add_request(plans_for(asr, seed, budget, seconds))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.tokens]
    return tokens


def run(engine, tokens: dict) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.tokens)


def test_priority_values_and_the_error():
    assert [(p.name, int(p)) for p in Priority] == [("LIVE_FINAL", 0), ("UPLOAD", 1), ("BATCH", 2), ("DRAFT", 3)]
    err = from_code("preempted", "dropped")
    assert isinstance(err, RequestPreempted) and not isinstance(err, EngineError)
    assert error_code(RequestPreempted("x")) == "preempted"


def test_the_default_classes_reach_the_engine(tiny_asr, monkeypatch):
    """GlmAsr.submit / submit_loaded: BATCH; the server's LocalEngineClient.submit: UPLOAD; an explicit class
    passes through; a non-int is refused in the caller's thread."""
    from glmasr.workers.engine_client import LocalEngineClient

    seen = []
    real = Engine.add_request

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("priority"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    x = noise(1.0, 5)
    decode = DecodeOptions(max_new_tokens=2)
    tiny_asr.submit(x, decode, sampling_rate=16000).result(timeout=60)
    tiny_asr.submit_loaded(load_audio(x, 16000), decode).result(timeout=60)
    tiny_asr.submit(x, decode, sampling_rate=16000, priority=Priority.DRAFT).result(timeout=60)
    client = LocalEngineClient(tiny_asr)
    asyncio.run(client.submit(load_audio(x, 16000), decode, time.perf_counter()).aresult())
    asyncio.run(client.submit(load_audio(x, 16000), decode, time.perf_counter(),
                              priority=Priority.LIVE_FINAL).aresult())
    assert seen == [Priority.BATCH, Priority.BATCH, Priority.DRAFT, Priority.UPLOAD, Priority.LIVE_FINAL]
    with pytest.raises(TypeError, match="priority must be an int"):
        client.submit(load_audio(x, 16000), decode, time.perf_counter(), priority="high")


def test_a_full_engine_encodes_and_admits_by_class_then_arrival(tiny_asr):
    engine = Engine(tiny_asr.model, max_batch=2, sync_every=4)
    sched = engine.scheduler
    encoded, admitted = [], []
    next_encode, next_admit = sched.next_encode, sched.next_admit

    def record_encode():
        chosen = next_encode()
        left = list(sched.waiting)
        if chosen and left:  # queue order: nothing chosen ranks after what is left waiting
            last = chosen[-1]
            assert (last.priority, last.arrival) <= (left[0].priority, left[0].arrival)
        encoded.extend(s.request_id for s in chosen)
        return chosen

    def record_admit():
        chosen = next_admit()
        admitted.extend(s.request_id for s in chosen)
        return chosen

    sched.next_encode, sched.next_admit = record_encode, record_admit
    budgets = {}
    first = []
    for seed in (1, 2):
        first.append(engine.add_request(plans_for(tiny_asr, seed, 10)))
        budgets[first[-1]] = (seed, 10)
    engine.step()
    assert sched.num_running == 2  # full from here on
    classes = [Priority.DRAFT, Priority.BATCH, Priority.UPLOAD, Priority.LIVE_FINAL, Priority.DRAFT, Priority.UPLOAD,
               Priority.LIVE_FINAL, 7, Priority.BATCH]
    later = []
    for i, p in enumerate(classes):
        later.append(engine.add_request(plans_for(tiny_asr, 10 + i, 4 + i), priority=p))
        budgets[later[-1]] = (10 + i, 4 + i)
    tokens = {}
    run(engine, tokens)
    order = [rid for _, _, rid in sorted((int(p), n, rid) for n, (p, rid) in enumerate(zip(classes, later)))]
    assert admitted == first + order
    assert encoded == first + order
    assert engine.take_preempted() == []  # the drafts ran last: nothing better waited behind them
    for rid, (seed, budget) in budgets.items():
        assert tokens[rid] == alone(tiny_asr, seed, budget), f"request {rid}"


def test_waiting_better_requests_preempt_the_newest_running_drafts_only(tiny_asr):
    engine = Engine(tiny_asr.model, max_batch=3, sync_every=4)
    sched = engine.scheduler
    batch = engine.add_request(plans_for(tiny_asr, 20, 40), priority=Priority.BATCH)
    d1 = engine.add_request(plans_for(tiny_asr, 21, 40), priority=Priority.DRAFT)
    d2 = engine.add_request(plans_for(tiny_asr, 22, 40), priority=5)  # worse than DRAFT: preemptible too
    tokens = {}
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.tokens)
    assert {s.request_id for s in sched.slots if s} == {batch, d1, d2}

    def step():
        for out in engine.step():
            assert out.request_id not in (d1, d2) or (out.request_id == d1 and d1 in sched.requests)
            tokens.setdefault(out.request_id, []).extend(out.tokens)

    final = engine.add_request(plans_for(tiny_asr, 23, 8), priority=Priority.LIVE_FINAL)
    step()
    assert engine.take_preempted() == [(d2, 5)]  # the newest draft
    assert {s.request_id for s in sched.slots if s} == {batch, d1, final}  # admitted in the same step
    upload = engine.add_request(plans_for(tiny_asr, 24, 8), priority=Priority.UPLOAD)
    step()
    assert engine.take_preempted() == [(d1, Priority.DRAFT)]
    assert d1 not in sched.requests and upload in {s.request_id for s in sched.slots if s}
    final2 = engine.add_request(plans_for(tiny_asr, 25, 8), priority=Priority.LIVE_FINAL)
    while engine.has_unfinished():  # no draft left: the final waits for a slot, the batch request is never dropped
        step()
        assert engine.take_preempted() == []
    assert not sched.requests and sched.num_running == 0 and not sched.waiting and not sched.ready
    for rid, seed, budget in ((batch, 20, 40), (final, 23, 8), (upload, 24, 8), (final2, 25, 8)):
        assert tokens[rid] == alone(tiny_asr, seed, budget), f"request {rid}"


@pytest.fixture(scope="module")
def two_slots(tiny_shipped):
    asr = glmasr.load(tiny_shipped, device="cpu", max_batch=2)
    yield asr
    asr.close()


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def running(asr, job) -> bool:
    req = asr.engine.scheduler.requests.get(job.request_id)
    return req is not None and req.running


def test_drafts_in_every_slot_are_preempted_by_live_finals(two_slots):
    asr = two_slots
    finals = [(noise(2.5, 40), DecodeOptions(max_new_tokens=16)), (noise(4.0, 41), DecodeOptions(max_new_tokens=9))]
    ref = [asr.submit(x, d, sampling_rate=16000, priority=Priority.LIVE_FINAL).result(timeout=60) for x, d in finals]
    drafts = [asr.submit(noise(2.0, 42 + i), LONG, sampling_rate=16000, priority=Priority.DRAFT) for i in range(2)]
    wait_for(lambda: all(running(asr, d) for d in drafts), 30, "both drafts in a slot")
    jobs = [asr.submit(x, d, sampling_rate=16000, priority=Priority.LIVE_FINAL) for x, d in finals]
    got = [bounded(lambda j=j: j.result(), 60) for j in jobs]
    for g, r in zip(got, ref):
        assert (g.token_ids, g.text) == (r.token_ids, r.text)
    with pytest.raises(RequestPreempted, match="priority DRAFT") as err:
        bounded(lambda: list(drafts[0].deltas()), 60)  # a streaming consumer
    assert err.value.code == "preempted"
    with pytest.raises(RequestPreempted):
        bounded(drafts[1].result, 60)
    wait_for(lambda: not asr.engine.has_unfinished() and asr.loop.num_pending == 0, 10, "an idle engine")
    sched = asr.engine.scheduler
    assert sched.num_running == 0 and not sched.requests and not sched.waiting and not sched.ready
    assert asr.submit(*finals[0], sampling_rate=16000).result(timeout=60).token_ids == ref[0].token_ids


def test_the_data_parallel_client_carries_priority_and_prefix(tiny_shipped, tiny_asr):
    from glmasr.workers.requests import DataParallelEngineClient

    final_x = noise(3.0, 50)
    prefix = (65, 66, 67)
    decode = DecodeOptions(max_new_tokens=10, forced_prefix_ids=prefix)
    ref = tiny_asr.submit(final_x, decode, sampling_rate=16000).result(timeout=60)
    client = DataParallelEngineClient(["cpu"], model=tiny_shipped, max_batch=1, drain_timeout_s=10)
    try:
        client.warmup("none")

        async def go():
            draft = client.submit(load_audio(noise(2.0, 51), 16000), LONG, time.perf_counter(), stream=True,
                                  priority=Priority.DRAFT)
            await draft.started()
            while draft.first_output_at is None:  # it holds the worker's only slot
                await asyncio.sleep(0.01)
            final = client.submit(load_audio(final_x, 16000), decode, time.perf_counter(),
                                  priority=Priority.LIVE_FINAL)
            await final.started()
            result = await final.aresult()
            with pytest.raises(RequestPreempted, match="priority DRAFT"):
                await draft.aresult()
            return result

        got = asyncio.run(asyncio.wait_for(go(), 60))
        assert got.token_ids[:3] == list(prefix) and got.token_ids == ref.token_ids and got.text == ref.text
        with pytest.raises(TypeError, match="priority"):
            client.submit(load_audio(final_x, 16000), decode, time.perf_counter(), priority=1.5)
        wait_for(lambda: client.num_pending == 0, 10, "the worker to hold nothing")
    finally:
        client.close(timeout=10)
