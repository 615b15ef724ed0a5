"""Segment.avg_logprob end to end: the mean, over a segment's tokens, of each token's log-probability under the
greedy step that chose it, held to transformers' teacher-forced logits on the tiny checkpoint (fp32, CPU).

Which tokens: exactly ``Segment.token_ids`` (every generated token of the segment's prompt). The stop token (the
eos id that ended the segment) is the one generated token left out: it is not in ``token_ids`` and not in the text.

Tolerance: our fp32 logits equal transformers' to 1e-5 of the largest logit (tests/test_end_to_end.py holds that;
observed ~1e-7), a log-softmax entry moves by at most twice the largest logit change, and a mean of such entries
no more; so |ours - transformers| <= 2e-5 * max|logit| (~2e-4 on the tiny checkpoint, whose logits reach ~11),
plus the fp32 rounding of log_softmax itself (~1e-6).
"""

import json
import shutil

import pytest
import torch

import glmasr
from glmasr.results import Segment
from glmasr.writers import verbose_segment
from glmasr.writers import render

from conftest import noise

MAX_NEW = 24


def hf_logits(oracle, audio, forced):
    """transformers' fp32 logits predicting each forced token (len(forced) rows), for one single-prompt audio."""
    processor, model = oracle
    inputs = processor.apply_transcription_request([audio])
    prompt_len = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([forced], dtype=torch.long)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=inputs["input_features"],
                       input_features_mask=inputs["input_features_mask"]).logits[0]
    return logits[prompt_len - 1: prompt_len - 1 + len(forced)].float()


def mean_logprob(logits, tokens):
    lp = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    return lp.mean().item()


def tolerance(logits) -> float:
    return 2e-5 * logits.abs().max().item() + 1e-6


def check_segment(seg, logits):
    assert len(seg.token_ids) > 0 and logits.shape[0] == len(seg.token_ids)
    want = mean_logprob(logits, seg.token_ids)
    assert want < 0.0
    assert seg.avg_logprob == pytest.approx(want, abs=tolerance(logits)), (seg.avg_logprob, want)


@pytest.mark.parametrize("seconds", [[3.5], [30.0], [70.0], [1.0, 12.0, 45.0]],
                         ids=["3.5s", "30s", "70s-3windows", "batch-1-12-45s"])
def test_avg_logprob_equals_transformers_teacher_forced(tiny_asr, hf_oracle, seconds):
    audios = [noise(s, seed=50 + i + int(10 * s)) for i, s in enumerate(seconds)]
    results = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    for r, audio in zip(results, audios):
        (seg,) = r.segments
        assert seg.token_ids == r.token_ids
        check_segment(seg, hf_logits(hf_oracle, audio, seg.token_ids))


@pytest.fixture(scope="module")
def stopping(tiny_shipped, tmp_path_factory):
    """A copy of the tiny checkpoint whose eos set includes a token the model emits mid-sequence on this clip
    (the random model never picks its own eos ids), so the segment ends with "stop" before its budget."""
    audio = noise(3.5, 61)
    free = glmasr.transcribe(audio, model=glmasr.load(tiny_shipped, device="cpu"), sampling_rate=16000,
                             max_new_tokens=12).token_ids
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    folder = tmp_path_factory.mktemp("stop") / "ckpt"
    shutil.copytree(tiny_shipped, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = [cfg["text_config"]["eos_token_id"][0], stop]
    (folder / "config.json").write_text(json.dumps(cfg))
    return glmasr.load(folder, device="cpu"), audio, stop, free[: free.index(stop)]


def test_stop_token_is_not_counted(stopping, hf_oracle):
    """The segment stops at the added eos id: its avg_logprob is the mean over token_ids alone, not over
    token_ids + the stop token (which the model also chose, with its own log-probability)."""
    asr, audio, stop, expected = stopping
    r = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=12)
    (seg,) = r.segments
    assert seg.finish_reason == "stop" and seg.token_ids == expected
    logits = hf_logits(hf_oracle, audio, expected + [stop])  # the last row predicts the stop token
    check_segment(seg, logits[: len(expected)])
    with_stop = mean_logprob(logits, expected + [stop])
    assert abs(with_stop - seg.avg_logprob) > 10 * tolerance(logits), "the stop token would change the mean"


def group_logits(asr, prompt_embeds, forced):
    """Our model's fp32 teacher-forced logits predicting each forced token after an embedded prompt (what
    glmasr.pipeline.teacher_forced_logits does for one prompt of the default budget)."""
    from glmasr.models.kv_cache import KVCache

    with torch.inference_mode():
        embeds = torch.cat([prompt_embeds, asr.model.embed_tokens(torch.tensor(forced))])[None]
        total = embeds.shape[1]
        cache = KVCache(asr.config.text, 1, total, asr.device, asr.dtype)
        hidden = asr.model.decode(embeds, torch.arange(total)[None], cache, kv_len=total)
        start = prompt_embeds.shape[0] - 1
        return asr.model.logits(hidden[0, start: start + len(forced)])


def test_each_prompt_group_is_its_own_segment(tiny_asr):
    """650 s at a small budget: two prompts (21 windows = 630 s, then 20 s), so two segments; each one's
    avg_logprob is the mean over its own tokens, held to our model's teacher-forced logits after that group's
    prompt (our fp32 logits equal transformers' to ~1e-7: tests/test_end_to_end.py)."""
    from glmasr.options import DecodeOptions
    from glmasr.pipeline import prepare_requests

    audio = noise(650.0, 62)
    r = glmasr.transcribe(audio, model=tiny_asr, sampling_rate=16000, max_new_tokens=5)
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 630.0), (630.0, 650.0)]
    requests, _ = prepare_requests(tiny_asr, [audio], DecodeOptions(max_new_tokens=5), 16000)
    assert len(requests) == 2
    for seg, req in zip(r.segments, requests):
        check_segment(seg, group_logits(tiny_asr, req.prompt_embeds, seg.token_ids))
    assert r.segments[0].avg_logprob != r.segments[1].avg_logprob


def test_streaming_gives_the_same_avg_logprob(tiny_asr):
    audios = [noise(3.0, 63), noise(40.0, 64)]
    full = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=10)
    finals = {d.index: d.result for d in glmasr.transcribe_stream(audios, model=tiny_asr, sampling_rate=16000,
                                                                   max_new_tokens=10) if d.finished}
    for i, r in enumerate(full):
        assert [s.avg_logprob for s in finals[i].segments] == [s.avg_logprob for s in r.segments]
        assert all(s.avg_logprob < 0 for s in r.segments)


def test_writers_json_and_verbose_json_carry_avg_logprob(tiny_asr):
    r = glmasr.transcribe(noise(5.0, 65), model=tiny_asr, sampling_rate=16000, max_new_tokens=6)
    (seg,) = r.segments
    data = json.loads(render(r, "json"))
    assert data["segments"][0]["avg_logprob"] == seg.avg_logprob
    verbose = verbose_segment(seg)
    assert verbose["avg_logprob"] == seg.avg_logprob and isinstance(verbose["avg_logprob"], float)
    empty = Segment(1, 0.0, 1.0, "", [], "stop")  # no token: 0.0 (a mean over nothing)
    assert verbose_segment(empty)["avg_logprob"] == 0.0
