"""The live session (glmasr/live/session.py, agreement.py, events.py) over a real tiny GlmAsr through
``LocalEngineClient``: manual commits give exactly ``transcribe()``'s text with deltas that add up to it; event
order and item linkage; the previous turn as context; partials (LocalAgreement-2 drafts) that never retract and a
forced final that continues them; stale drafts aborted, drafts skipped on a full engine; ``aclose`` frees the
engine; an engine failure fails one turn only; limits and settings errors; server-VAD turns through the real
``VadStreams`` on synthesized speech (espeak-ng), and the turn logic (forced cuts, idle timeout, commit/clear/update
during a turn) through a stand-in VAD whose probabilities the test knows, against the ``TurnDetector``'s own events.
The agreement functions against a brute-force reference on random drafts.

Partials need drafts that agree. The random tiny model's text changes completely with every 80 ms of audio, so
the partial tests use ``chain_asr``: the same checkpoint with its text decoder turned into a near-deterministic
chain over "abc defgh" (each token's embedding points the LM head at the next), the decoder layers scaled down so
the audio still changes the text now and then: drafts agree on a growing prefix and disagree after it, like a
real model on a growing utterance.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import noise

import glmasr
from glmasr.audio import load_audio
from glmasr.errors import EngineError, RequestPreempted
from glmasr.live import events as ev
from glmasr.live.agreement import REPLACEMENT, agree, agreed_text, common_prefix, is_word_boundary, is_word_start
from glmasr.live.session import (
    EmptyBuffer,
    LiveLimitError,
    LiveLimits,
    LiveSession,
    LiveSettings,
    SessionClosed,
    context_text,
    live_instruction,
)
from glmasr.live.turns import TurnDetector, TurnSettings
from glmasr.options import DecodeOptions, Priority
from glmasr.workers.engine_client import LocalEngineClient

SR = 16000
ITEM = re.compile(r"^item_[0-9a-f]{20}$")
MANUAL = LiveSettings(turn_detection=None)


# ---------------------------------------------------------------------------------------------------- helpers
class Recorder:
    """The ``emit`` callback: every event, in order."""

    def __init__(self):
        self.events: list = []

    def __call__(self, e) -> None:
        self.events.append(e)

    def of(self, item_id: str) -> list:
        return [e for e in self.events if getattr(e, "item_id", None) == item_id]

    def deltas(self, item_id: str) -> list[str]:
        return [e.delta for e in self.of(item_id) if isinstance(e, ev.TranscriptDelta)]

    def completed(self, item_id: str) -> ev.TranscriptCompleted:
        done = [e for e in self.of(item_id) if isinstance(e, (ev.TranscriptCompleted, ev.TranscriptFailed))]
        assert len(done) == 1, done
        return done[0]

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


class Metrics:
    """A metrics hook that counts what it is told."""

    def __init__(self):
        self.drafts: dict[str, int] = {}
        self.turns = 0
        self.audio = 0.0
        self.first_delta: list[float] = []
        self.completed: list[float] = []
        self.failed: list[str] = []
        self.forcing: list[bool] = []
        self.mismatches = 0

    def on_audio(self, seconds):
        self.audio += seconds

    def on_turn(self):
        self.turns += 1

    def on_draft(self, outcome):
        assert outcome in ev.DRAFT_OUTCOMES
        self.drafts[outcome] = self.drafts.get(outcome, 0) + 1

    def on_first_delta(self, seconds):
        self.first_delta.append(seconds)

    def on_completed(self, seconds):
        self.completed.append(seconds)

    def on_failed(self, code):
        self.failed.append(code)

    def on_forcing(self, changed):
        self.forcing.append(changed)

    def on_mismatch(self):
        self.mismatches += 1


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def engine_idle(client, timeout: float = 10.0) -> None:
    """The engine holds no request (aborts are taken by the engine thread between rounds)."""
    for _ in range(int(timeout / 0.01)):
        if client.num_pending == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine still holds {client.num_pending} request(s)")


def reference(asr, samples, prompt=None, prefix=()) -> str:
    return asr.submit(samples, DecodeOptions(prompt=prompt, forced_prefix_ids=tuple(prefix)),
                      sampling_rate=SR).result().text


def append_chunked(s: LiveSession, x: np.ndarray, rng, lo_ms=20, hi_ms=100) -> None:
    at = 0
    while at < len(x):
        n = int(rng.integers(lo_ms * SR // 1000, hi_ms * SR // 1000))
        s.append(x[at:at + n])
        at += n


def partial_text(rec: Recorder, item_id: str) -> str:
    """The deltas of an item sent before its Committed event (the agreed partial text)."""
    out = []
    for e in rec.of(item_id):
        if isinstance(e, ev.Committed):
            return "".join(out)
        if isinstance(e, ev.TranscriptDelta):
            out.append(e.delta)
    raise AssertionError(f"{item_id} was never committed")


def check_item(rec: Recorder, item_id: str) -> str:
    """Every delta of the item non-empty, and all of them concatenated == its completed transcript."""
    done = rec.completed(item_id)
    assert isinstance(done, ev.TranscriptCompleted), done
    deltas = rec.deltas(item_id)
    assert all(deltas), deltas
    assert "".join(deltas) == done.transcript
    return done.transcript


@pytest.fixture(scope="module")
def client(asr):
    return LocalEngineClient(asr)


@pytest.fixture(scope="module")
def chain_asr(tiny_shipped):
    """The tiny checkpoint with its text decoder made a chain over "abc defgh" (see the module docstring)."""
    handle = glmasr.load(tiny_shipped, device="cpu", max_batch=8)
    tok = handle.prompts.tokenizer
    ids = [tok.convert_tokens_to_ids(["\u0120" if c == " " else c])[0] for c in "abc defgh"]  # byte-level names
    newline = tok.convert_tokens_to_ids(["\u010a"])[0]
    params = dict(handle.model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.startswith("language_model.layers") and ("o_proj" in name or "down_proj" in name):
                p.mul_(0.03)
        emb, head = params["language_model.embed_tokens.weight"], params["lm_head.weight"]
        keep = set(ids)
        for j in range(head.shape[0]):
            if j not in keep:
                head[j] *= 0.1
        for a, b in zip([newline, *ids], [*ids, ids[0]]):
            head[b] = emb[a] / emb[a].norm() * 6.0
    yield handle
    handle.close()


# ---------------------------------------------------------------------------------------------------- agreement
@pytest.fixture(scope="module")
def prompts(asr):
    return asr.prompts


def _ids(prompts, text: str) -> list[int]:
    return list(prompts.tokenizer(text, add_special_tokens=False)["input_ids"])


def _reference_agree(prev_text_ids, cur_ids, agreed, decode) -> int:
    """Brute force: the longest k (> len(agreed), <= the common prefix) whose cut ends a word in both drafts,
    decided on the decoded texts of every prefix."""
    best = len(agreed)
    for k in range(len(agreed) + 1, min(len(prev_text_ids), len(cur_ids))):
        if prev_text_ids[:k] != cur_ids[:k]:
            break
        ok = True
        for d in (prev_text_ids, cur_ids):
            head, nxt = decode(d[:k]), decode(d[:k + 1])
            rest = decode(d)[len(head):]
            ok &= (bool(head) and not head.endswith(REPLACEMENT) and nxt.startswith(head)
                   and decode(d).startswith(head) and bool(rest) and is_word_start(rest[0]))
        if ok:
            best = k
    return best


def test_agreement_against_a_brute_force_reference(prompts):
    """Random drafts of random words (ASCII, CJK, punctuation) sharing random prefixes: ``agree`` finds exactly
    the longest word-ending common prefix, never shrinks, and its text is a prefix of both drafts' texts."""
    rng = np.random.default_rng(7)
    words = ["the", "cat", "sat", "on", "mat", "engine", "live", "你好", "世界", "語", "hello,", "ok.", "naïve",
             "x", "déjà"]
    decode = prompts.decode
    grown = 0
    for trial in range(150):
        base = " ".join(rng.choice(words, rng.integers(1, 8)))
        a = _ids(prompts, base + " " + " ".join(rng.choice(words, rng.integers(0, 4))))
        b = _ids(prompts, base + rng.choice(["", " ", "!"]) + " ".join(rng.choice(words, rng.integers(0, 4))))
        n = common_prefix(a, b)
        assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
        agreed = a[:int(rng.integers(0, n + 1))] if trial % 3 == 0 else []
        got = agree(a, b, agreed, decode)
        assert got[:len(agreed)] == agreed
        if len(got) > len(agreed):
            grown += 1
        assert len(got) == _reference_agree(a, b, agreed, decode), (decode(a), decode(b), decode(agreed))
        text = agreed_text(got, decode)
        assert decode(a).strip().startswith(text) and decode(b).strip().startswith(text)
    assert grown > 30  # the reference and the function agree on many non-trivial cases


def test_agreement_word_boundaries(prompts):
    decode = prompts.decode
    a = _ids(prompts, "hello world again")
    b = _ids(prompts, "hello world agree")
    assert agreed_text(agree(a, b, [], decode), decode) == "hello world"
    c = _ids(prompts, "hello worldwide")  # the common "hello world" ends mid-word in c
    assert agreed_text(agree(a, c, [], decode), decode) == "hello"
    assert agree(a, _ids(prompts, "goodbye"), [], decode) == []
    # a draft that does not start with what was agreed agrees on nothing new
    agreed = _ids(prompts, "hello")
    assert agree(_ids(prompts, "help me now"), _ids(prompts, "help me now"), agreed, decode) == agreed
    # punctuation stays with its word; CJK characters are words of their own
    d1, d2 = _ids(prompts, "yes, sure thing"), _ids(prompts, "yes, sure thang")
    assert agreed_text(agree(d1, d2, [], decode), decode) == "yes, sure"
    z1, z2 = _ids(prompts, "你好世界"), _ids(prompts, "你好世纪")
    assert agreed_text(agree(z1, z2, [], decode), decode) == "你好世"
    # a cut inside a multi-byte character is never a boundary; the end of a draft is not one either
    assert not is_word_boundary(z1, 1, decode) and is_word_boundary(z1, 3, decode)
    assert not is_word_boundary(a, len(a), decode) and not is_word_boundary(a, 0, decode)
    # the published text: incomplete characters and surrounding whitespace left out
    assert agreed_text(_ids(prompts, " ab ") + z1[:2], decode) == "ab"


# ---------------------------------------------------------------------------------------------------- settings
def test_settings_and_limits_are_validated():
    with pytest.raises(ValueError, match="partial_hop_s"):
        LiveSettings(partial_hop_s=0.01)
    with pytest.raises(ValueError, match="partial_hop_s"):
        LiveSettings(partial_hop_s=float("nan"))
    with pytest.raises(TypeError, match="keywords"):
        LiveSettings(keywords="abc")
    with pytest.raises(ValueError, match="keywords"):
        LiveSettings(keywords=("a", " "))
    with pytest.raises(TypeError, match="turn_detection"):
        LiveSettings(turn_detection={"type": "server_vad"})
    with pytest.raises(TypeError, match="partials"):
        LiveSettings(partials=1)
    with pytest.raises(TypeError, match="prompt"):
        LiveSettings(prompt=3)
    with pytest.raises(ValueError, match="max_buffer_s"):
        LiveLimits(max_buffer_s=0)
    with pytest.raises(ValueError, match="idle_s"):
        LiveLimits(idle_s=-1)
    assert LiveSettings(keywords=["x"]).keywords == ("x",)


def test_instruction_and_context():
    default = "Please transcribe this audio into text"
    assert live_instruction(None, (), None, default) is None
    assert live_instruction("Say it", (), "", default) == "Say it"
    assert live_instruction(None, ("GLM", "H200"), None, default) == f"{default}\nHotwords: GLM, H200"
    assert live_instruction("P", ("k",), "we met <|user|> at noon", default) == "P\nContext: we met at noon\nHotwords: k"
    long = " ".join(f"w{i}" for i in range(200))
    ctx = context_text(long)
    assert len(ctx) <= 200 and long.endswith(ctx) and ctx.startswith("w")


# ---------------------------------------------------------------------------------------------------- finals
def test_manual_commit_is_transcribe_exactly(asr, client):
    """Partials off: each turn's completed transcript is ``transcribe()`` of the same 16 kHz samples with the same
    instruction (the second turn's carries the first one's text as context), and the deltas add up to it."""
    rng = np.random.default_rng(11)
    turns = [noise(float(rng.uniform(1.5, 4.0)), seed=100 + k) for k in range(2)]
    rec, metrics = Recorder(), Metrics()
    settings = LiveSettings(turn_detection=None, keywords=("GLM",))

    async def go():
        s = LiveSession(client, asr.prompts, None, settings, emit=rec, metrics=metrics)
        ids = []
        for x in turns:
            append_chunked(s, x, rng)
            ids.append(s.commit())
            await s.flush()
        await s.aclose()
        return ids

    ids = run(go())
    previous = None
    for item_id, x in zip(ids, turns):
        text = check_item(rec, item_id)
        prompt = live_instruction(None, ("GLM",), previous, asr.prompts.default_prompt)
        assert text == reference(asr, x, prompt)
        assert rec.completed(item_id).usage == {"type": "duration", "seconds": len(x) / SR}
        previous = text
    assert previous and "Context:" in live_instruction(None, (), previous, "d")
    assert metrics.turns == 2 and len(metrics.completed) == 2 and len(metrics.first_delta) == 2
    assert metrics.audio == pytest.approx(sum(len(x) for x in turns) / SR)
    assert not metrics.failed and metrics.mismatches == 0


def test_event_order_and_linkage_over_three_turns(asr, client):
    """Three turns committed back to back (before any final ran): Committed events at once, linked to the one
    before; finals complete in commit order, each with its deltas between its Committed and its Completed."""
    rng = np.random.default_rng(12)
    turns = [noise(float(rng.uniform(1.0, 3.0)), seed=200 + k) for k in range(3)]
    rec = Recorder()

    async def go():
        s = LiveSession(client, asr.prompts, None, LiveSettings(turn_detection=None, context=False), emit=rec)
        ids = []
        for x in turns:
            s.append(x)
            ids.append(s.commit())
        assert rec.kinds() == ["Committed"] * 3  # emitted synchronously by commit()
        await s.flush()
        await s.aclose()
        return ids

    ids = run(go())
    assert len(set(ids)) == 3 and all(ITEM.match(i) for i in ids)
    committed = [e for e in rec.events if isinstance(e, ev.Committed)]
    assert [(e.item_id, e.previous_item_id) for e in committed] == [(ids[0], None), (ids[1], ids[0]),
                                                                     (ids[2], ids[1])]
    done_order = [e.item_id for e in rec.events if isinstance(e, ev.TranscriptCompleted)]
    assert done_order == ids
    for item_id, x in zip(ids, turns):
        pos = [k for k, e in enumerate(rec.events) if getattr(e, "item_id", None) == item_id]
        assert isinstance(rec.events[pos[0]], ev.Committed) and isinstance(rec.events[pos[-1]], ev.TranscriptCompleted)
        assert check_item(rec, item_id) == reference(asr, x)  # context off: the plain instruction


def test_engine_failure_fails_one_turn(asr, client, monkeypatch):
    """The engine faults while decoding the first turn: TranscriptFailed (engine_error) for it; the next turn
    completes normally, with no context from the failed one."""
    rng = np.random.default_rng(13)
    x1, x2 = noise(2.0, seed=301), noise(2.5, seed=302)
    engine = asr.engine
    real_step = engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    rec, metrics = Recorder(), Metrics()

    async def go():
        s = LiveSession(client, asr.prompts, None, MANUAL, emit=rec, metrics=metrics)
        append_chunked(s, x1, rng)
        first = s.commit()
        await s.flush()
        append_chunked(s, x2, rng)
        second = s.commit()
        await s.flush()
        await s.aclose()
        return first, second

    first, second = run(go())
    failed = rec.completed(first)
    assert isinstance(failed, ev.TranscriptFailed) and failed.code == EngineError.code
    assert "injected device fault" in failed.message
    monkeypatch.undo()
    assert check_item(rec, second) == reference(asr, x2)  # no context from a failed turn
    assert metrics.failed == ["engine_error"]


def test_aclose_aborts_and_frees_the_engine(asr, client):
    """A long final and a draft in flight when the session closes: both aborted, no event after, the engine
    holds nothing and serves the next request."""
    x = noise(20.0, seed=401)
    rec = Recorder()

    async def go():
        s = LiveSession(client, asr.prompts, None,
                        LiveSettings(turn_detection=None, partials=True, partial_hop_s=5.0), emit=rec)
        s.append(x[: 10 * SR])  # a draft is due
        s.commit()
        s.append(x[10 * SR:])  # the next turn's draft
        for _ in range(200):  # until the engine holds the requests
            await asyncio.sleep(0.005)
            if client.num_pending >= 2:
                break
        assert client.num_pending >= 1
        n_events = len(rec.events)
        await s.aclose()
        await s.aclose()  # idempotent
        assert len(rec.events) == n_events
        await engine_idle(client)
        with pytest.raises(SessionClosed):
            s.append(x[:SR])
        with pytest.raises(SessionClosed):
            s.commit()

    run(go())
    assert not any(isinstance(e, (ev.TranscriptCompleted, ev.TranscriptFailed)) for e in rec.events)
    assert isinstance(reference(asr, x[:SR]), str)  # the engine serves the next request


# ---------------------------------------------------------------------------------------------------- limits
def test_limits_and_bad_input(asr, client):
    rec = Recorder()

    async def go():
        limits = LiveLimits(max_session_s=5.0, max_buffer_s=2.0, idle_s=0.05)
        s = LiveSession(client, asr.prompts, None, MANUAL, limits, emit=rec)
        with pytest.raises(EmptyBuffer) as e:
            s.commit()
        assert e.value.code == "input_audio_buffer_commit_empty" and "100 ms" in str(e.value)
        x = noise(1.5, seed=501)
        s.append(x)
        with pytest.raises(LiveLimitError) as e:
            s.append(noise(0.6, seed=502))  # 2.1 s uncommitted: refused, not taken
        assert e.value.code == "buffer_too_large" and "2 s" in e.value.message
        assert s.buffered_s == pytest.approx(1.5)
        with pytest.raises(ValueError, match="1-D"):
            s.append(np.zeros((2, 100), np.float32))
        with pytest.raises(ValueError, match="1-D array of float"):
            s.append(np.ones(100, np.int16))
        with pytest.raises(ValueError, match="finite"):
            s.append(np.full(100, np.nan, np.float32))
        item = s.commit()  # the session is still usable
        await s.flush()
        assert check_item(rec, item) == reference(asr, x)
        s.append(noise(1.5, seed=503))
        s.clear()
        assert isinstance(rec.events[-1], ev.Cleared) and s.buffered_s == 0
        with pytest.raises(EmptyBuffer):
            s.commit()
        s.append(noise(1.9, seed=504))
        with pytest.raises(LiveLimitError) as e:  # 1.5 + 1.5 + 1.9 + 0.2 > 5 s in all
            s.append(noise(0.2, seed=505))
        assert e.value.code == "session_too_long" and "5 s" in str(e.value)
        await asyncio.sleep(0.06)
        with pytest.raises(LiveLimitError) as e:
            s.check_idle()
        assert e.value.code == "idle_timeout"
        await s.aclose()

    run(go())


# ---------------------------------------------------------------------------------------------------- partials
async def _stream_with_partials(s: LiveSession, x: np.ndarray, step_s: float = 0.1) -> None:
    """Append ``x`` in ``step_s`` chunks, letting each draft finish before more audio comes (a fast engine)."""
    n = int(step_s * SR)
    for at in range(0, len(x), n):
        s.append(x[at:at + n])
        await s.flush()


def test_partials_never_retract(chain_asr):
    """Drafts every 0.25 s on a growing turn: the agreed text goes out while the turn is open, every delta only
    appends, the final (forced to start with the agreed ids) starts with what was sent and the deltas add up to
    it; it equals the engine's forced decode of the same samples; the forcing audit ran."""
    client = LocalEngineClient(chain_asr)
    prompts = chain_asr.prompts
    rec, metrics = Recorder(), Metrics()
    turns = [noise(4.0, seed=601), noise(3.0, seed=602)]

    async def go():
        s = LiveSession(client, prompts, None, LiveSettings(turn_detection=None, partials=True,
                                                            partial_hop_s=0.25), emit=rec, metrics=metrics)
        out = []
        for x in turns:
            await _stream_with_partials(s, x)
            out.append(s.commit())
            await s.flush()
        await s.aclose()
        await engine_idle(client)
        return out

    items = run(go())
    previous = None
    for item, x in zip(items, turns):
        sent = partial_text(rec, item)
        assert sent, "drafts must have agreed on some text before the commit"
        text = check_item(rec, item)
        assert text.startswith(sent) and len(text) > len(sent)
        # the same forced decode, outside the session: the agreed ids are the sent text's bytes
        prefix = _ids(prompts, sent)
        assert prompts.decode(prefix) == sent
        prompt = live_instruction(None, (), previous, prompts.default_prompt)
        assert text == reference(chain_asr, x, prompt, prefix)
        previous = text
    assert metrics.drafts.get("sent", 0) >= 20 and metrics.drafts.get("failed", 0) == 0
    assert metrics.mismatches == 0
    assert len(metrics.forcing) == 2  # the audit ran for both forced finals


def test_partials_over_30_s_final_in_two_parts(chain_asr):
    """A manual turn longer than 30 s with agreed text: drafts stop at 30 s, the final is the first 30 s forced
    plus the rest, joined like the groups of one request; nothing sent is retracted."""
    client = LocalEngineClient(chain_asr)
    rec, metrics = Recorder(), Metrics()
    x = noise(33.0, seed=701)

    async def go():
        s = LiveSession(client, chain_asr.prompts, None, LiveSettings(turn_detection=None, partials=True,
                                                                      partial_hop_s=5.0, context=False),
                        emit=rec, metrics=metrics)
        await _stream_with_partials(s, x, step_s=1.0)
        item = s.commit()
        await s.flush()
        await s.aclose()
        return item

    item = run(go())
    sent = partial_text(rec, item)
    text = check_item(rec, item)
    assert sent and text.startswith(sent)
    prefix = _ids(chain_asr.prompts, sent)
    first = reference(chain_asr, x[:30 * SR], None, prefix)
    rest = reference(chain_asr, x[30 * SR:])
    assert text == " ".join(t for t in (first, rest) if t)
    assert metrics.drafts["sent"] == 6 and metrics.mismatches == 0


def test_a_newer_hop_aborts_a_stale_draft_and_a_full_engine_skips(chain_asr):
    client = LocalEngineClient(chain_asr)
    metrics = Metrics()

    async def go():
        s = LiveSession(client, chain_asr.prompts, None, LiveSettings(turn_detection=None, partials=True,
                                                                      partial_hop_s=0.25), metrics=metrics)
        x = noise(2.0, seed=801)
        s.append(x[:int(0.3 * SR)])  # a draft is due ...
        s.append(x[int(0.3 * SR):int(0.6 * SR)])  # ... and the next hop comes before it ran: the first is aborted
        await s.flush()
        assert metrics.drafts == {"sent": 2, "aborted": 1}
        # the engine full (num_pending >= slots): the next hop's draft is skipped
        hogs = [chain_asr.submit(noise(2.0, seed=810 + k), DecodeOptions(max_new_tokens=400, ignore_eos=True),
                                 sampling_rate=SR) for k in range(client.slots)]
        s.append(x[int(0.6 * SR):int(0.9 * SR)])
        assert metrics.drafts.get("skipped") == 1
        for h in hogs:
            h.abort()
        await engine_idle(client)
        s.append(x[int(0.9 * SR):int(1.2 * SR)])  # room again: drafts go out
        await s.flush()
        assert metrics.drafts["sent"] == 3
        # the commit aborts a draft in flight
        s.append(x[int(1.2 * SR):int(1.5 * SR)])
        s.commit()
        await s.flush()
        assert metrics.drafts["aborted"] == 2
        await s.aclose()
        await engine_idle(client)

    run(go())


def test_draft_outcomes_preempted_and_failed(asr):
    """A draft the engine preempts counts as aborted, one that fails otherwise as failed (a stub client)."""

    class Req:
        def __init__(self, error):
            self.error = error

        async def started(self):
            return None

        async def aresult(self):
            raise self.error

        def abort(self):
            pass

    class Stub:
        slots, num_pending = 4, 0

        def __init__(self):
            self.errors = [RequestPreempted("preempted for a final"), EngineError("boom")]
            self.priorities = []

        def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
                   priority=Priority.UPLOAD):
            self.priorities.append(priority)
            return Req(self.errors.pop(0))

    metrics, stub = Metrics(), Stub()

    async def go():
        s = LiveSession(stub, asr.prompts, None, LiveSettings(turn_detection=None, partials=True,
                                                              partial_hop_s=0.2), metrics=metrics)
        s.append(noise(0.25, seed=901))
        await s.flush()
        s.append(noise(0.2, seed=902))
        await s.flush()
        await s.aclose()

    run(go())
    assert metrics.drafts == {"sent": 2, "aborted": 1, "failed": 1}
    assert stub.priorities == [Priority.DRAFT, Priority.DRAFT]


class ScriptedDrafts:
    """An engine client whose drafts return scripted texts in order (ids from the checkpoint's tokenizer) and that
    records each draft's audio length; ``hold=True`` keeps every draft in flight until ``release()``."""

    slots, num_pending = 8, 0

    def __init__(self, prompts, texts, hold=False):
        self.prompts, self.texts, self.hold = prompts, list(texts), hold
        self.seconds: list[float] = []
        self.gate = asyncio.Event()

    def release(self):
        self.gate.set()

    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
               priority=Priority.UPLOAD):
        assert priority == Priority.DRAFT
        self.seconds.append(round(len(audio.samples) / SR, 2))
        ids = _ids(self.prompts, self.texts.pop(0))
        client = self

        class Req:
            async def started(self):
                return None

            async def aresult(self):
                if client.hold:
                    await client.gate.wait()
                return SimpleNamespace(token_ids=ids)

            def abort(self):
                pass

        return Req()


def test_first_words_drafts_every_half_hop(prompts):
    """Until a turn has agreed text, drafts come every half hop (the first at one hop), so the first words show
    ~1.5 hops in; from the first agreement on, one every hop after that draft's audio. Drafts that never agree
    keep the half-hop cadence."""

    def schedule(texts, seconds=4.0, hold=False):
        stub, metrics, rec = ScriptedDrafts(prompts, texts, hold), Metrics(), Recorder()

        async def go():
            s = LiveSession(stub, prompts, None, LiveSettings(turn_detection=None, partials=True, partial_hop_s=1.0,
                                                              context=False), emit=rec, metrics=metrics)
            x = noise(seconds, seed=951)
            for at in range(0, len(x), SR // 10):
                s.append(x[at:at + SR // 10])
                if hold:
                    await asyncio.sleep(0.02)  # the draft's submit (a worker thread) happens; its result never
                else:
                    await s.flush()  # each draft finishes before more audio comes
            await s.aclose()

        run(go())
        return stub.seconds, metrics.drafts, rec

    words = ["one two", "one two three", "one two three four", "one two three four five", "one two three four five six"]
    seconds, drafts, rec = schedule(words)
    assert seconds == [1.0, 1.5, 2.5, 3.5], seconds  # agreed after the second draft: then every hop after 1.5 s
    deltas = [e.delta for e in rec.events if isinstance(e, ev.TranscriptDelta)]
    assert deltas[0] == "one" and "".join(deltas).split() == ["one", "two", "three"], deltas
    seconds, _, _ = schedule(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"])
    assert seconds == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0], seconds  # no agreement: half hops throughout
    # a half-hop draft is not sent while one is in flight; a whole hop aborts the stale one
    seconds, drafts, _ = schedule(["alpha", "beta", "gamma"], seconds=2.3, hold=True)
    assert seconds == [1.0, 2.0] and drafts == {"sent": 2, "aborted": 2}, (seconds, drafts)  # 2nd: by the close


# ---------------------------------------------------------------------------------------------------- turn logic
W = 512  # samples per VAD window


class FakeVads:
    """``VadStreams``' interface with a stand-in network: each complete 512-sample window scores 0.9 where its RMS
    is above 0.05, else 0.02, handed to ``on_probs`` at once (inside ``push``). For the session's turn logic."""

    def __init__(self):
        self.streams: list = []

    def open(self, on_probs, on_error=None):
        stream = FakeStream(on_probs)
        self.streams.append(stream)
        return stream


class FakeStream:
    def __init__(self, on_probs):
        self.on_probs = on_probs
        self.pending = np.zeros(0, np.float32)
        self.windows = 0
        self.closed = False

    def push(self, x):
        assert not self.closed
        self.pending = np.concatenate([self.pending, x])
        k = len(self.pending) // W
        if k:
            probs = fake_probs(self.pending[:k * W])
            self.pending = self.pending[k * W:]
            first, self.windows = self.windows, self.windows + k
            self.on_probs(first, probs)

    def close(self):
        self.closed = True


def fake_probs(x: np.ndarray) -> np.ndarray:
    rms = np.sqrt((x[: len(x) // W * W].reshape(-1, W).astype(np.float64) ** 2).mean(1))
    return np.where(rms > 0.05, 0.9, 0.02).astype(np.float32)


def speech_like(parts, seed: int) -> np.ndarray:
    """("s", seconds): loud noise (speech to the fake VAD); ("q", seconds): quiet noise (silence)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([(rng.standard_normal(int(sec * SR)) * (0.3 if kind == "s" else 0.003)).astype(np.float32)
                           for kind, sec in parts])


def test_vad_turns_follow_the_detector(asr, client):
    """The session's SpeechStarted/SpeechStopped/Committed are exactly the TurnDetector's events on the same
    probabilities (a forced cut at max_turn_s included, and the idle timeout); each turn's transcript is
    transcribe() of exactly [started, stopped)."""
    x = speech_like([("q", 0.5), ("s", 1.5), ("q", 1.0), ("s", 3.2), ("q", 2.2)], seed=31)
    settings = TurnSettings(silence_duration_ms=400, max_turn_s=2.5, idle_timeout_ms=1500)
    expected = TurnDetector(settings).feed(0, fake_probs(x))
    rng = np.random.default_rng(32)
    rec = Recorder()

    async def go():
        s = LiveSession(client, asr.prompts, FakeVads(), LiveSettings(turn_detection=settings, context=False),
                        emit=rec)
        append_chunked(s, x, rng)
        await s.flush()
        await s.aclose()

    run(go())
    kinds = [e.kind for e in expected]
    assert kinds == ["started", "stopped"] * 3 and [e.forced for e in expected] == [False] * 3 + [True] * 2 + [False]
    got = [e for e in rec.events if isinstance(e, (ev.SpeechStarted, ev.SpeechStopped))]
    assert [(type(e).__name__, e.audio_start_ms if isinstance(e, ev.SpeechStarted) else e.audio_end_ms)
            for e in got] == [("SpeechStarted" if e.kind == "started" else "SpeechStopped", e.ms) for e in expected]
    # the idle timeout after the last turn: its silent stretch committed as an item of its own
    timeouts = [e for e in rec.events if isinstance(e, ev.TimeoutTriggered)]
    idle_at = expected[-1].sample + 1500 * SR // 1000
    assert len(timeouts) == 1 and timeouts[0].audio_end_ms == idle_at * 1000 // SR
    assert timeouts[0].audio_start_ms == expected[-1].ms
    committed = [e for e in rec.events if isinstance(e, ev.Committed)]
    assert len(committed) == 4 and committed[-1].item_id == timeouts[0].item_id
    assert [c.previous_item_id for c in committed] == [None] + [c.item_id for c in committed[:-1]]
    for k in range(3):
        item = got[2 * k].item_id
        assert got[2 * k + 1].item_id == item and committed[k].item_id == item
        lo, hi = expected[2 * k].sample, expected[2 * k + 1].sample
        assert check_item(rec, item) == reference(asr, x[lo:hi])
    check_item(rec, timeouts[0].item_id)


def test_manual_commit_and_clear_during_a_vad_turn(asr, client):
    """commit() during an open VAD turn commits it (no SpeechStopped) and, as the speech goes on, a new turn starts
    exactly at the commit point; clear() drops an open turn and the next one starts after the clear."""
    x = speech_like([("q", 0.6), ("s", 3.0), ("q", 1.0)], seed=41)
    rec = Recorder()

    async def go():
        s = LiveSession(client, asr.prompts, FakeVads(), LiveSettings(context=False), emit=rec)
        cut = int(1.6 * SR) // W * W  # a window edge inside the speech
        s.append(x[:cut])
        first = rec.events[-1].item_id
        assert isinstance(rec.events[-1], ev.SpeechStarted)
        assert s.commit() == first
        s.append(x[cut:cut + int(0.5 * SR)])
        restarted = rec.events[-1]
        assert isinstance(restarted, ev.SpeechStarted) and restarted.audio_start_ms == cut * 1000 // SR
        s.clear()
        s.append(x[cut + int(0.5 * SR):])
        await s.flush()
        await s.aclose()
        return first, restarted.item_id, cut

    first, dropped, cut = run(go())
    assert [type(e).__name__ for e in rec.of(first)][:2] == ["SpeechStarted", "Committed"]
    assert check_item(rec, first) == reference(asr, x[int(0.6 * SR) // W * W - 300 * SR // 1000:cut])
    assert [type(e).__name__ for e in rec.of(dropped)] == ["SpeechStarted"]  # cleared: never committed
    later = [e for e in rec.events if isinstance(e, ev.SpeechStarted)][-1]
    assert later.item_id not in (first, dropped) and later.audio_start_ms >= (cut + int(0.5 * SR)) * 1000 // SR
    assert isinstance(rec.completed(later.item_id), ev.TranscriptCompleted)


def test_update_turn_detection_and_partials(chain_asr):
    """update(): partials off aborts the draft in flight; detection off keeps the open turn as the manual one;
    detection on again commits nothing old and detects afresh."""
    client = LocalEngineClient(chain_asr)
    x = speech_like([("q", 0.5), ("s", 2.5), ("q", 0.3)], seed=51)
    rec, metrics = Recorder(), Metrics()

    async def go():
        on = LiveSettings(context=False, partials=True, partial_hop_s=0.5)
        s = LiveSession(client, chain_asr.prompts, FakeVads(), on, emit=rec, metrics=metrics)
        s.append(x[:int(1.6 * SR)])  # a turn is open, its draft due
        assert metrics.drafts.get("sent") == 1
        s.update(LiveSettings(context=False, partials=False))
        assert metrics.drafts.get("aborted") == 1
        item = rec.events[-1].item_id
        s.update(LiveSettings(context=False, turn_detection=None))  # the open turn becomes the manual one
        s.append(x[int(1.6 * SR):])
        assert s.commit() == item
        await s.flush()
        with pytest.raises(ValueError, match="VadStreams"):
            LiveSession(client, chain_asr.prompts, None, LiveSettings())
        await s.aclose()
        return item

    item = run(go())
    lo = int(0.5 * SR) // W * W - 300 * SR // 1000
    assert check_item(rec, item) == reference(chain_asr, x[lo:])


# ---------------------------------------------------------------------------------------------------- server VAD
def _say(tmp_path, text: str, name: str) -> np.ndarray:
    raw, wav = tmp_path / f"{name}.raw.wav", tmp_path / f"{name}.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(raw), text], check=True, capture_output=True)
    subprocess.run(["sox", str(raw), "-r", str(SR), "-c", "1", "-b", "16", str(wav)], check=True,
                   capture_output=True)
    return load_audio(str(wav)).samples


@pytest.fixture(scope="module")
def vads():
    pytest.importorskip("silero_vad")
    from glmasr.live.vad_stream import VadStreams

    return VadStreams(device="cpu")


def test_server_vad_turns(asr, client, vads, tmp_path):
    """Two phrases of synthesized speech with pauses, streamed in 20-100 ms chunks through the real VadStreams:
    SpeechStarted / SpeechStopped + Committed for each, item linkage, each turn's transcript == transcribe() of
    exactly the turn's samples; audio outside turns is not kept."""
    for prog in ("espeak-ng", "sox"):
        if shutil.which(prog) is None:
            pytest.skip(f"{prog} is not installed")
    rng = np.random.default_rng(21)
    a = _say(tmp_path, "My mother made a warm meal for the whole family.", "a")
    b = _say(tmp_path, "We will meet again in the morning.", "b")
    gap = lambda s: (rng.standard_normal(int(s * SR)) * 1e-3).astype(np.float32)
    x = np.concatenate([gap(0.8), a, gap(1.2), b, gap(1.5)])
    x = (x + rng.standard_normal(len(x)).astype(np.float32) * 1e-3).astype(np.float32)
    rec, metrics = Recorder(), Metrics()

    async def go():
        s = LiveSession(client, asr.prompts, vads, LiveSettings(context=False), emit=rec, metrics=metrics)
        at = 0
        while at < len(x):
            n = int(rng.integers(20 * SR // 1000, 100 * SR // 1000))
            s.append(x[at:at + n])
            at += n
            await vads.run_pending()
            assert s.buffered_s < 12.0
        while await vads.run_pending():
            pass
        await s.flush()
        # outside turns only the prefix padding's reach is kept (0.3 s + 1 s behind the VAD, + a partial window)
        assert s.buffered_s <= 0.3 + 1.0 + 0.032
        await s.aclose()

    run(go())
    started = [e for e in rec.events if isinstance(e, ev.SpeechStarted)]
    stopped = [e for e in rec.events if isinstance(e, ev.SpeechStopped)]
    committed = [e for e in rec.events if isinstance(e, ev.Committed)]
    assert len(started) == len(stopped) == len(committed) == 2, rec.kinds()
    ids = [e.item_id for e in started]
    assert [e.item_id for e in stopped] == ids and [(e.item_id, e.previous_item_id) for e in committed] == [
        (ids[0], None), (ids[1], ids[0])]
    for k, item in enumerate(ids):
        kinds = [type(e).__name__ for e in rec.of(item)]
        assert kinds[:3] == ["SpeechStarted", "SpeechStopped", "Committed"] and kinds[-1] == "TranscriptCompleted"
        lo, hi = started[k].audio_start_ms * SR // 1000, stopped[k].audio_end_ms * SR // 1000
        assert rec.completed(item).usage["seconds"] == (hi - lo) / SR
        assert check_item(rec, item) == reference(asr, x[lo:hi])
    # the turns cover the phrases (prefix padding before, silence duration after)
    a_at, b_at = int(0.8 * SR), int((0.8 + 1.2) * SR) + len(a)
    assert started[0].audio_start_ms < a_at * 1000 // SR < stopped[0].audio_end_ms < started[1].audio_start_ms
    assert started[1].audio_start_ms < b_at * 1000 // SR < stopped[1].audio_end_ms
    assert metrics.turns == 2 and len(metrics.completed) == 2
