"""The continuous-batching engine equals the plain reference loop, token for token, and reports the same
log-probability for each token (within LOGPROB_TOL)."""

import json
import os
import shutil

import pytest
import torch

import glmasr
from glmasr.engine.engine import Engine
from glmasr.engine.generate import greedy_generate
from glmasr.engine.request import GenerationRequest
from glmasr.engine.model_runner import ModelRunner
from glmasr.options import DecodeOptions
from glmasr.pipeline import prepare_requests

from conftest import noise

SECONDS = (3.5, 12.0, 1.0, 45.0, 7.0, 2.0, 30.0)
BUDGETS = (5, 20, 3, 17, 20, 9, 12)


def requests_for(asr, budgets=BUDGETS):
    reqs, _ = prepare_requests(asr, [noise(s, 100 + i) for i, s in enumerate(SECONDS)],
                               DecodeOptions(max_new_tokens=20), 16000)
    for r, b in zip(reqs, budgets):
        r.max_new_tokens = b
    return reqs


def same(a, b):
    return [(r.token_ids, r.finish_reason, r.stop_token_id) for r in a] == \
           [(r.token_ids, r.finish_reason, r.stop_token_id) for r in b]


# Engine vs reference loop, fp32: the same logits computed in other batch compositions (other padding, batch
# GEMM shapes, KV-length buckets; on the Triton path other kernels) differ by fp32 rounding, ~1e-6 of the largest
# logit (~11 on the tiny checkpoint); a log-softmax entry moves by at most twice the largest logit change.
# Observed <= 2e-5; 1e-4 is ~1e-5 of the largest logit, the bound the logits tests use.
LOGPROB_TOL = 1e-4


def close_logprobs(got, ref, tol=LOGPROB_TOL):
    """One log-probability per generated token (the stop token has none), each within ``tol`` of the reference,
    all finite and <= 0."""
    for g, r in zip(got, ref, strict=True):
        assert len(g.logprobs) == len(g.token_ids) == len(r.logprobs)
        assert all(lp <= 0.0 and lp == lp for lp in g.logprobs), g.logprobs
        diff = max((abs(a - b) for a, b in zip(g.logprobs, r.logprobs)), default=0.0)
        assert diff <= tol, f"log-probs differ by {diff:.2e}"


def poisoned_engine(model, graphs=True, prefill_graphs=True, **options):
    """An engine whose log-prob buffer is NaN from the start: a value the step did not write shows up.
    ``graphs`` / ``prefill_graphs`` off: a runner of eager launches (the runner's test-only arguments)."""
    engine = Engine(model, **options)
    if not (graphs and prefill_graphs):
        engine.runner = ModelRunner(model, engine.options, graphs=graphs, prefill_graphs=prefill_graphs)
    engine.runner.out_logprob.fill_(float("nan"))
    return engine


@pytest.mark.parametrize("max_batch, sync_every", [(3, 8), (2, 5), (8, 1), (1, 3), (7, 64)])
def test_engine_equals_reference_loop_with_refills(tiny_asr, max_batch, sync_every):
    reqs = requests_for(tiny_asr)
    ref = greedy_generate(tiny_asr.model, reqs, tiny_asr.config.text.eos_token_ids)
    got = poisoned_engine(tiny_asr.model, max_batch=max_batch, sync_every=sync_every).generate(reqs)
    assert same(got, ref)
    close_logprobs(got, ref)


def test_runner_counts_its_prefills(tiny_asr):
    """The runner's counters (what benchmarks report for a first call): every request is admitted through one
    counted prefill kind; on the CPU there are no graphs, so no capture is counted."""
    reqs = requests_for(tiny_asr)
    engine = Engine(tiny_asr.model, max_batch=3, sync_every=4)
    engine.generate(reqs)
    stats = engine.runner.stats
    kinds = ("prefills_packed", "prefills_graphed")
    assert 1 <= sum(stats[k] for k in kinds) <= len(reqs) and stats["prefills_packed"] >= 1
    assert stats["decode_captures"] == 0 and stats["prefill_captures"] == 0
    stats.clear()
    engine.generate(reqs[:1])
    assert sum(stats[k] for k in kinds) == 1


@pytest.fixture(scope="module")
def eos_asr(tiny_shipped, tmp_path_factory):
    """The tiny checkpoint with eos ids that the random model really produces (so sequences stop early)."""
    asr = glmasr.load(tiny_shipped, device="cpu")
    free = greedy_generate(asr.model, requests_for(asr, budgets=(12,) * len(SECONDS)), asr.config.text.eos_token_ids)
    counts = {}
    for r in free:
        for t in r.token_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    common = sorted(counts, key=counts.get, reverse=True)[:2]
    folder = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(tiny_shipped, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = common
    (folder / "config.json").write_text(json.dumps(cfg))
    return glmasr.load(folder, device="cpu")


def test_engine_stops_like_the_reference_and_reports_the_stop_token(eos_asr):
    reqs = requests_for(eos_asr)
    ref = greedy_generate(eos_asr.model, reqs, eos_asr.config.text.eos_token_ids)
    assert any(r.finish_reason == "stop" for r in ref) and any(r.finish_reason == "length" for r in ref)
    got = poisoned_engine(eos_asr.model, max_batch=3, sync_every=4).generate(reqs)
    assert same(got, ref)
    close_logprobs(got, ref)  # one per token_ids entry: the stop token's is not reported
    assert all(r.stop_token_id in eos_asr.config.text.eos_token_ids for r in got if r.finish_reason == "stop")
    forced = Engine(eos_asr.model, max_batch=3).generate(reqs, ignore_eos=True)
    assert [len(r.token_ids) for r in forced] == list(BUDGETS)


def test_streaming_deltas_add_up_to_the_transcript(eos_asr):
    audios = [noise(s, 200 + i) for i, s in enumerate((3.0, 20.0, 8.0))]
    full = glmasr.transcribe(audios, model=eos_asr, sampling_rate=16000, max_new_tokens=15)
    pieces = {0: "", 1: "", 2: ""}
    finals = {}
    for d in glmasr.transcribe_stream(audios, model=eos_asr, sampling_rate=16000, max_new_tokens=15, max_batch=2):
        assert not (d.index in finals), "no delta after an input's final one"
        pieces[d.index] += d.text
        if d.finished:
            finals[d.index] = d.result
    assert sorted(finals) == [0, 1, 2]
    for i, r in enumerate(full):
        assert finals[i].token_ids == r.token_ids and finals[i].text == r.text
        assert pieces[i] == r.text


def test_position_and_budget_errors(tiny_asr):
    reqs = requests_for(tiny_asr)
    engine = Engine(tiny_asr.model, max_batch=2)
    limit = tiny_asr.config.text.max_position_embeddings
    too_long = GenerationRequest(reqs[0].prompt_embeds, limit)
    with pytest.raises(ValueError, match=f"positions .*more than the model's {limit}"):
        engine.generate([too_long])
    bad = [GenerationRequest(reqs[0].prompt_embeds, 0)]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(bad)
    assert not engine.has_unfinished(), "a refused request leaves nothing behind"
    with pytest.raises(ValueError, match="max_batch"):
        Engine(tiny_asr.model, max_batch=0)


def test_a_request_that_needs_every_position(tiny_asr):
    """prompt + budget == the model's positions exactly is allowed, and the KV cache grows to hold it."""
    reqs = requests_for(tiny_asr)
    limit = tiny_asr.config.text.max_position_embeddings
    prompt = reqs[0].prompt_embeds
    full = GenerationRequest(prompt, limit - prompt.shape[0])
    ref = greedy_generate(tiny_asr.model, [GenerationRequest(prompt, 40)], tiny_asr.config.text.eos_token_ids)
    engine = Engine(tiny_asr.model, max_batch=2)
    got = engine.generate([full])[0]
    assert engine.runner.capacity == limit
    if ref[0].finish_reason == "stop":  # the random model stops early: the same tokens as the reference
        assert got.token_ids == ref[0].token_ids and got.finish_reason == "stop"
    else:
        assert got.token_ids[:40] == ref[0].token_ids


def test_kv_capacity_grows_with_a_longer_request(tiny_asr):
    """The KV cache starts small and grows (contents copied) when a longer sequence arrives mid-run."""
    reqs = requests_for(tiny_asr, budgets=(30, 6, 40, 5, 50, 9, 12))
    ref = greedy_generate(tiny_asr.model, reqs, tiny_asr.config.text.eos_token_ids)
    engine = Engine(tiny_asr.model, max_batch=2, sync_every=4)
    start = engine.runner.capacity
    got = engine.generate(reqs)
    assert same(got, ref)
    close_logprobs(got, ref)
    assert engine.runner.capacity > start


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA, or TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
def test_engine_on_the_triton_path(tiny_shipped):
    from glmasr.models.fast import FastGlmAsrModel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = glmasr.load(tiny_shipped, device=dev, dtype="float32", backend="torch")
    fast = FastGlmAsrModel(glmasr.load(tiny_shipped, device=dev, dtype="float32", backend="torch").model)
    reqs = requests_for(ref, budgets=(6, 4, 3, 5, 6, 2, 4))
    expected = greedy_generate(ref.model, reqs, ref.config.text.eos_token_ids)
    eager = poisoned_engine(fast, max_batch=3, sync_every=3, graphs=False)
    assert eager.runner.fused_commit, "decode steps go through the greedy_commit kernel"
    got = eager.generate(reqs)
    assert same(got, expected)
    close_logprobs(got, expected)  # the kernel's fused log-sum-exp vs log_softmax in the reference loop
    if torch.cuda.is_available():  # the same with every decode step replayed from a CUDA graph
        graphed = poisoned_engine(fast, max_batch=3, sync_every=3, prefill_graphs=False)
        got = graphed.generate(reqs)
        assert same(got, expected)
        close_logprobs(got, expected)  # log-probs come out of graph replay (the buffer started NaN)
        assert graphed.runner.graphs, "decode steps were captured"
        # single-request prefills replayed from graphs (max_batch=1 admits one request per round)
        prefill_graphed = poisoned_engine(fast, max_batch=1, sync_every=3)
        got = prefill_graphed.generate(reqs)
        assert same(got, expected)
        close_logprobs(got, expected)
        assert prefill_graphed.runner._prefill_graphs, "prefills were captured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, bf16 Triton path)")
def test_bf16_graph_replay_log_probs_equal_eager_steps(tiny_shipped):
    """The default GPU path (bf16, Triton kernels, skinny GEMVs, PDL): decode steps replayed from CUDA graphs
    give the tokens and log-probabilities of the same steps launched eagerly, exactly (same kernels on the same
    inputs in the same buckets; a graph only removes the launches). Prefill graphs are off on both sides: their
    right-padded bucket shapes may pick other cuBLAS kernels than an eager prefill."""
    asr = glmasr.load(tiny_shipped, device="cuda")
    assert asr.model.triton_decoder and asr.dtype == torch.bfloat16
    reqs = requests_for(asr, budgets=(12, 20, 5, 17, 20, 9, 12))
    eager = poisoned_engine(asr.model, max_batch=4, sync_every=5, graphs=False).generate(reqs)
    graphed_engine = poisoned_engine(asr.model, max_batch=4, sync_every=5, prefill_graphs=False)
    graphed = graphed_engine.generate(reqs)
    assert graphed_engine.runner.graphs
    assert same(graphed, eager)
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]
    close_logprobs(graphed, eager, tol=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_decode_round_captures_its_bucket_when_long_enough(tiny_shipped):
    """A round on a new decode bucket captures it when it has >= CAPTURE_STEPS steps, else runs eagerly (the
    bucket's next round captures it); every round is checked against that rule, and the tokens equal the eager
    engine's."""
    from glmasr.engine.model_runner import CAPTURE_STEPS, bucket, kv_bucket

    asr = glmasr.load(tiny_shipped, device="cuda")
    reqs = requests_for(asr, budgets=(9, 2, 13, 6, 3, 11, 7))
    eager = poisoned_engine(asr.model, max_batch=4, sync_every=8, graphs=False).generate(reqs)
    rounds = []
    for sync_every in (CAPTURE_STEPS + 2, CAPTURE_STEPS - 1):
        engine = poisoned_engine(asr.model, max_batch=4, sync_every=sync_every, prefill_graphs=False)
        runner, decode = engine.runner, engine.runner.decode

        def spy(b, top, steps, runner=runner, decode=decode):
            key = (bucket(b, runner.buckets), kv_bucket(top, runner.capacity))
            new = key not in runner.graphs and key not in runner._seen_buckets
            eager_before = runner.stats["decode_rounds_eager"]
            decode(b, top, steps)
            rounds.append((new, steps, runner.stats["decode_rounds_eager"] - eager_before, key in runner.graphs))

        runner.decode = spy
        assert same(engine.generate(reqs), eager)
    for new, steps, eager_round, captured in rounds:
        if new:
            assert (eager_round, captured) == ((0, True) if steps >= CAPTURE_STEPS else (1, False)), rounds
        else:
            assert eager_round == 0 and captured, rounds
    assert any(new and steps >= CAPTURE_STEPS for new, steps, _, _ in rounds), rounds


_COMPILE_AHEAD_PROBE = r"""
import json, sys, torch, glmasr
from triton.runtime.jit import JITFunction
asr = glmasr.load(sys.argv[1], device="cuda", warmup=False)  # warmup=False: nothing compiled at load
runner = asr.engine.runner
state = [t.clone() for t in (runner.tokens, runner.positions, runner.status, runner.step_index)]
shapes = dict(batch_sizes=(1, 2, 4), kv_lens=(256, 512), prefill_lengths=(64,), encoder_windows=(1, 2))
active = asr.loop.call(lambda eng: eng.runner.compile_kernels(**shapes)).result()
restored = all(torch.equal(a, b) for a, b in zip(state, (runner.tokens, runner.positions, runner.status,
                                                          runner.step_index)))
compiled = []
original = JITFunction._do_compile
def no_compile(self, *a, **k):
    compiled.append(self.fn.__name__)
    return original(self, *a, **k)
JITFunction._do_compile = no_compile
asr.loop.call(lambda eng: eng.runner.warmup(**shapes, compile_ahead=False)).result()  # the captures alone
print(json.dumps({"active": active, "restored": restored, "compiled_after": compiled}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles, CUDA graphs)")
def test_compile_ahead_covers_the_warmup(tiny_shipped, tmp_path):
    """The dry pass (kernels compiled all at once on a thread pool, nothing launched) compiles every Triton
    kernel the warm-up then needs: in a fresh process with an empty Triton cache, the warm-up after it compiles
    nothing, and the dry pass leaves the slot state as it found it."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), GLMASR_CACHE_DIR=str(tmp_path / "glmasr"))
    res = subprocess.run([sys.executable, "-c", _COMPILE_AHEAD_PROBE, str(tiny_shipped)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["active"] and out["restored"], out
    assert out["compiled_after"] == [], out


def test_engine_options_are_checked():
    """Only what users set is an option; the removed switches are refused by name."""
    import dataclasses

    from glmasr.options import EngineOptions

    assert [f.name for f in dataclasses.fields(EngineOptions)] == [
        "max_batch", "sync_every", "encoder_chunk", "max_prefill_tokens", "batch_invariant"]
    for removed in ("prefill", "decode_step", "decode_gemm", "cuda_graphs", "prefill_graphs", "encoder_graphs", "pdl",
                    "weights_reader"):
        with pytest.raises(TypeError, match=f"unknown engine option '{removed}'"):
            EngineOptions.from_env({}, **{removed: "x"})
    assert EngineOptions.from_env({"GLMASR_BATCH_INVARIANT": "1"}).batch_invariant is True
    assert EngineOptions.from_env({"GLMASR_SYNC_EVERY": "16"}).sync_every == 16
    assert EngineOptions.from_env({"GLMASR_SYNC_EVERY": "16"}, sync_every=4).sync_every == 4
    with pytest.raises(ValueError, match="GLMASR_SYNC_EVERY must be an integer"):
        EngineOptions.from_env({"GLMASR_SYNC_EVERY": "many"})
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        EngineOptions.from_env({"GLMASR_SYNC_EVERY": "0"})
    with pytest.raises(ValueError, match="GLMASR_BATCH_INVARIANT must be 0 or 1"):
        EngineOptions.from_env({"GLMASR_BATCH_INVARIANT": "yes"})
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineOptions(batch_invariant=1)


def test_expired_requests_are_dropped_between_steps(tiny_asr):
    """``Engine.expire(now)`` aborts the requests past their deadline, running (its slot freed and refilled) or
    queued; the others get the reference loop's tokens. ``set_deadline`` keeps the earlier of two deadlines."""
    reqs = requests_for(tiny_asr)
    ref = greedy_generate(tiny_asr.model, reqs, tiny_asr.config.text.eos_token_ids)
    engine = poisoned_engine(tiny_asr.model, max_batch=3, sync_every=4)
    deadlines = {1: 100.0, 5: 100.0}  # request 1 runs from the first step, 5 waits for a slot (max_batch 3)
    ids = [engine.add_request(prompt_embeds=[r.prompt_embeds], max_new_tokens=[r.max_new_tokens],
                              deadline=deadlines.get(i), timeout_s=1.5 if i in deadlines else None, priority=i)
           for i, r in enumerate(reqs)]
    assert [engine.scheduler.requests[rid].priority for rid in ids] == list(range(len(reqs)))
    assert engine.set_deadline(ids[3], 300.0, 9.0) and engine.set_deadline(ids[3], 200.0, 4.0)
    assert engine.set_deadline(ids[3], 250.0, 5.0)  # later than 200: 200 stays
    tokens = {rid: [] for rid in ids}
    results = {}

    def take(outs):
        for out in outs:
            tokens[out.request_id] += out.tokens
            if out.finish_reason is not None:
                results[out.request_id] = (tokens[out.request_id], out.finish_reason)

    take(engine.step())
    assert engine.expire(now=99.0) == []
    running_slot = engine.scheduler.requests[ids[1]].sequences[0].slot
    assert running_slot is not None and ids[5] not in {s.request_id for s in engine.scheduler.slots if s}
    assert sorted(engine.expire(now=100.0)) == [(ids[1], 1.5, "running"), (ids[5], 1.5, "queued")]
    assert engine.scheduler.slots[running_slot] is None
    assert ids[1] not in engine.scheduler.requests and not engine.set_deadline(ids[1], 1.0)
    assert engine.expire(now=199.0) == []
    take(engine.step())
    stage = "running" if engine.scheduler.requests[ids[3]].running else "queued"  # budget 17: not done yet
    assert engine.expire(now=200.0) == [(ids[3], 4.0, stage)]
    while engine.has_unfinished():
        take(engine.step())
    dropped = {ids[1], ids[3], ids[5]}
    assert set(results) == set(ids) - dropped
    for i, rid in enumerate(ids):
        if rid not in dropped:
            assert results[rid] == (ref[i].token_ids, ref[i].finish_reason), f"request {i} differs"
