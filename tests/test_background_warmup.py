"""Background warm-up: ``EngineLoop.run_when_idle`` runs its units one at a time only while nothing else is pending
(requests go first and wait for at most one unit), settles its future with ms per stage, survives a failing unit
and drops what is left at close; ``load(warmup="background")`` on a GPU captures every graph of the full warm-up
while requests run, with transcripts equal to a foreground warm-up's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from glmasr.engine import loop as loop_module
from glmasr.engine.loop import EngineLoop
from glmasr.engine.request import SequenceOutput

from conftest import bounded, gpu_only, noise


class _StepEngine:
    """An engine whose requests each take ``steps`` rounds of ``step_s`` seconds; it logs what ran when."""

    def __init__(self, steps: int = 3, step_s: float = 0.01):
        self.model = type("M", (), {"device": torch.device("cpu")})()
        self.steps, self.step_s = steps, step_s
        self.left: dict[int, int] = {}
        self.log: list[tuple[str, object, float]] = []

    def add_request(self, request_id, **kwargs):
        self.left[request_id] = self.steps
        self.log.append(("add", request_id, time.monotonic()))

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
                self.log.append(("done", rid, time.monotonic()))
            outs.append(SequenceOutput(rid, 0, [1], "length" if done else None, request_finished=done))
        return outs

    def take_preempted(self):
        return []

    def abort(self, rid):
        return self.left.pop(rid, None) is not None

    def set_deadline(self, *a):
        return False

    def expire(self, now=None):
        return []


def _unit(engine_log, name, seconds, fail=False):
    def run(engine):
        engine.log.append(("unit-start", name, time.monotonic()))
        time.sleep(seconds)
        engine.log.append(("unit-end", name, time.monotonic()))
        if fail:
            raise RuntimeError(f"capture {name} broke")
    return (name.split(":")[0], run)


def test_units_run_in_order_and_the_future_has_ms_per_stage():
    engine = _StepEngine()
    loop = EngineLoop(engine, name="idle-order")
    try:
        units = [_unit(engine.log, f"{stage}:{i}", 0.01) for i, stage in enumerate(("enc", "enc", "dec", "pre"))]
        got = bounded(lambda: loop.run_when_idle(units).result(timeout=10), 15.0)
        ran = [name for kind, name, _ in engine.log if kind == "unit-start"]
        assert ran == ["enc:0", "enc:1", "dec:2", "pre:3"]
        assert set(got) == {"enc_ms", "dec_ms", "pre_ms"}
        assert got["enc_ms"] >= 20.0 and got["dec_ms"] >= 10.0  # two units of >= 10 ms each summed
        assert bounded(lambda: loop.run_when_idle([]).result(timeout=5), 10.0) == {}
    finally:
        loop.close()


def test_a_request_waits_for_at_most_one_unit():
    engine = _StepEngine(steps=3, step_s=0.01)
    loop = EngineLoop(engine, name="idle-priority")
    try:
        fut = loop.run_when_idle([_unit(engine.log, f"dec:{i}", 0.1) for i in range(6)])
        deadline = time.monotonic() + 5
        while not any(k == "unit-start" for k, _, _ in engine.log) and time.monotonic() < deadline:
            time.sleep(0.005)
        t_submit = time.monotonic()
        stream = loop.submit(None, prompt_embeds=[torch.randn(3, 4)], max_new_tokens=[3])
        bounded(lambda: list(stream), 10.0)
        done_at = next(t for k, _, t in engine.log if k == "done")
        started_before = [n for k, n, t in engine.log if k == "unit-start" and t < done_at]
        # the unit running when it came, at most; never one started after it arrived
        assert len(started_before) == 1, engine.log
        assert done_at - t_submit < 0.1 + 3 * 0.01 + 0.2
        got = bounded(lambda: fut.result(timeout=10), 15.0)
        assert [n for k, n, _ in engine.log if k == "unit-start"] == [f"dec:{i}" for i in range(6)]
        assert got["dec_ms"] >= 6 * 100.0
    finally:
        loop.close()


def test_units_wait_while_requests_keep_the_engine_busy(monkeypatch):
    monkeypatch.setattr(loop_module, "IDLE_GRACE_S", 0.2)
    engine = _StepEngine(steps=2, step_s=0.005)
    loop = EngineLoop(engine, name="idle-grace")
    try:
        fut = loop.run_when_idle([_unit(engine.log, "dec:0", 0.01)])
        t_end = time.monotonic() + 0.6
        while time.monotonic() < t_end:  # back-to-back requests, each submitted as the previous one ends
            bounded(lambda: list(loop.submit(None, prompt_embeds=[torch.randn(3, 4)], max_new_tokens=[2])), 10.0)
        last_done = max(t for k, _, t in engine.log if k == "done")
        bounded(lambda: fut.result(timeout=10), 15.0)
        start = next(t for k, _, t in engine.log if k == "unit-start")
        assert start >= last_done + 0.15  # it waited for the quiet moment after the last request
    finally:
        loop.close()


def test_a_failing_unit_is_reported_and_the_rest_still_run(caplog):
    engine = _StepEngine()
    loop = EngineLoop(engine, name="idle-fail")
    try:
        units = [_unit(engine.log, "dec:0", 0.0), _unit(engine.log, "dec:1", 0.0, fail=True),
                 _unit(engine.log, "pre:2", 0.0)]
        with caplog.at_level("WARNING", logger="glmasr.engine"):
            got = bounded(lambda: loop.run_when_idle(units).result(timeout=10), 15.0)
        assert [n for k, n, _ in engine.log if k == "unit-end"] == ["dec:0", "dec:1", "pre:2"]
        assert got["errors"] == ["dec: RuntimeError: capture dec:1 broke"]
        assert "background warm-up step dec failed" in caplog.text
        # the loop still serves
        assert len(bounded(lambda: list(loop.submit(None, prompt_embeds=[torch.randn(3, 4)],
                                                    max_new_tokens=[3])), 10.0)) == 3
    finally:
        loop.close()


def test_close_drops_the_units_not_yet_run():
    engine = _StepEngine()
    loop = EngineLoop(engine, name="idle-close")
    started = threading.Event()

    def first(eng):
        started.set()
        time.sleep(0.1)

    units = [("dec", first)] + [_unit(engine.log, f"dec:{i}", 0.05) for i in range(1, 5)]
    fut = loop.run_when_idle(units)
    assert started.wait(5)
    loop.close()  # waits for the unit in hand, then drops the rest
    got = fut.result(timeout=5)
    assert got["dropped"] == 4
    assert not [n for k, n, _ in engine.log if k == "unit-start"]
    with pytest.raises(Exception, match="shut down"):
        loop.run_when_idle(units)


def test_load_rejects_an_unknown_warmup_mode(tiny_shipped):
    import glmasr

    for bad in ("full", 1, None):
        with pytest.raises(ValueError, match="warmup must be one of"):
            glmasr.load(tiny_shipped, device="cpu", warmup=bad)


@gpu_only
def test_background_warmup_captures_everything_while_requests_run(tiny_shipped):
    """Every graph of the full warm-up gets captured in the background while requests (and the caller's own CUDA
    work) run alongside; the transcripts equal those of a handle warmed up in the foreground."""
    import glmasr
    clips = [noise(s, seed=70 + i) for i, s in enumerate((1.0, 4.0, 9.0, 2.5))]
    ref = glmasr.load(tiny_shipped, device="cuda", max_batch=8, warmup=True)
    try:
        want = [r.token_ids for r in glmasr.transcribe(clips, model=ref, sampling_rate=16000, max_new_tokens=12, ignore_eos=True)]
        want_graphs = set(ref.engine.runner.graphs)
    finally:
        ref.close()
    asr = glmasr.load(tiny_shipped, device="cuda", max_batch=8, warmup="background")
    try:
        fut = asr.background_warmup
        assert fut is not None
        got = []
        for _ in range(3):  # requests while the captures go on, and the caller's own CUDA work
            torch.manual_seed(0)
            _ = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
            got.append([r.token_ids for r in glmasr.transcribe(clips, model=asr, sampling_rate=16000, max_new_tokens=12, ignore_eos=True)])
        stages = fut.result(timeout=300)
        assert "errors" not in stages and "dropped" not in stages, stages
        assert stages.get("decode_graphs_ms", 0) > 0
        assert want_graphs <= set(asr.engine.runner.graphs)
        for g in got:
            assert g == want
    finally:
        asr.close()
