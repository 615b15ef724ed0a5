"""``DecodeOptions.forced_prefix_ids``: tokens forced as the start of the answer, prefilled after the prompt.

- Teacher forcing: forcing the first k tokens T[:k] of a request's own greedy answer T (budget N - k) gives exactly
  T (tokens, text, finish reason) on fresh random-weight models and random noise audio; the segment's avg_logprob
  is the mean over the generated tokens only.
- Forcing another prefix P: the tokens start with P, the text is decode(P + generated).strip(), the streamed
  deltas start with P's text and add up to the text.
- Bad input: a prefix with audio that forms more than one prompt group, an id outside the vocabulary or equal to
  the audio placeholder, a prefix that pushes the request past the model's positions: a ValueError naming
  forced_prefix_ids, in the caller's thread, before any engine work.
"""

from dataclasses import replace

import numpy as np
import pytest

import glmasr
from glmasr.audio import load_audio
from glmasr.checkpoint.random_weights import build_checkpoint
from glmasr.options import DecodeOptions
from glmasr.pipeline import plan_audio

from conftest import noise

N = 24  # the unforced budget: the forced requests get N - k
# avg_logprob of the forced run against the same sums from unforced runs: fp32 rounding of log-softmax entries
# computed in other prefill/decode shapes (see tests/test_engine.py's LOGPROB_TOL), averaged.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=[11, 12])
def fresh_asr(request, tmp_path_factory):
    """A tiny checkpoint with its own random weights (seed), on the CPU."""
    folder = build_checkpoint(tmp_path_factory.mktemp(f"prefix{request.param}"), size="tiny", layout="shipped",
                              seed=request.param)
    asr = glmasr.load(folder, device="cpu", max_batch=4)
    yield asr
    asr.close()


def run(asr, x, **decode):
    return asr.submit(x, DecodeOptions(**decode), sampling_rate=16000).result(timeout=60)


@pytest.mark.parametrize("seconds, seed", [(2.5, 301), (9.0, 302)])
def test_forcing_the_models_own_answer_gives_that_answer(fresh_asr, seconds, seed):
    x = noise(seconds, seed)
    ref = run(fresh_asr, x, max_new_tokens=N)
    t = ref.token_ids
    assert len(t) >= 4, f"the random model stopped after {len(t)} tokens: too few to force a prefix of"
    for k in sorted({1, 3, len(t) // 2, len(t) - 1}):
        got = run(fresh_asr, x, max_new_tokens=N - k, forced_prefix_ids=t[:k])
        assert got.token_ids == t, f"forcing {k} tokens"
        assert got.text == ref.text and got.finish_reason == ref.finish_reason
        assert got.segments[0].token_ids == t
        # avg_logprob over the generated tokens t[k:] only: their log-prob sum from two unforced runs
        head = run(fresh_asr, x, max_new_tokens=k, ignore_eos=True)
        assert head.token_ids == t[:k]
        expected = (len(t) * ref.segments[0].avg_logprob - k * head.segments[0].avg_logprob) / (len(t) - k)
        assert got.segments[0].avg_logprob == pytest.approx(expected, abs=LOGPROB_TOL)


def byte_ids(asr, text: str) -> list[int]:
    return list(asr.prompts.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_another_prefix_starts_the_answer_and_streams_first(fresh_asr):
    x = noise(4.0, 310)
    prefix = byte_ids(fresh_asr, "hello world")
    assert prefix and fresh_asr.prompts.decode(prefix) == "hello world"
    decode = DecodeOptions(max_new_tokens=12, forced_prefix_ids=tuple(prefix))
    job = fresh_asr.submit(x, decode, sampling_rate=16000)
    deltas = list(job.deltas())
    result = deltas[-1].result
    assert deltas[-1].finished and result is not None
    assert result.token_ids[: len(prefix)] == prefix and len(result.token_ids) > len(prefix)
    assert result.text == fresh_asr.prompts.decode(result.token_ids).strip()
    assert result.segments[0].token_ids == result.token_ids
    assert deltas[0].text.startswith("hello world"), deltas[0].text
    assert "".join(d.text for d in deltas) == result.text
    # the same request without streaming: the same result
    again = fresh_asr.submit(x, decode, sampling_rate=16000).result(timeout=60)
    assert (again.token_ids, again.text) == (result.token_ids, result.text)


def test_a_random_prefix_and_a_prefix_given_as_a_list(tiny_asr):
    rng = np.random.default_rng(320)
    x = noise(3.0, 321)
    audio_id = tiny_asr.config.audio_token_id
    prefix = [int(t) for t in rng.integers(0, tiny_asr.config.text.vocab_size, 6) if t != audio_id]
    got = run(tiny_asr, x, max_new_tokens=10, forced_prefix_ids=prefix)
    assert DecodeOptions(forced_prefix_ids=prefix).forced_prefix_ids == tuple(prefix)
    assert got.token_ids[: len(prefix)] == prefix
    assert got.text == tiny_asr.prompts.decode(got.token_ids).strip()


def test_bad_prefixes_are_refused_naming_the_field(tiny_asr):
    x = noise(3.0, 330)
    vocab = tiny_asr.config.text.vocab_size
    for bad, what in ([vocab], "vocabulary"), ([5, vocab + 7], "vocabulary"), ([tiny_asr.config.audio_token_id],
                                                                             "audio placeholder"):
        with pytest.raises(ValueError, match=f"forced_prefix_ids.*{what}"):
            tiny_asr.submit(x, DecodeOptions(forced_prefix_ids=bad), sampling_rate=16000)
    with pytest.raises(ValueError, match="forced_prefix_ids.*one prompt group.*forms 2"):
        tiny_asr.submit(x, DecodeOptions(forced_prefix_ids=(5,)), sampling_rate=16000,
                        pieces=[(0.0, 1.5), (1.5, 3.0)])
    long = noise(650.0, 331, scale=0.05)  # 22 windows: more than the 21 one prompt takes
    with pytest.raises(ValueError, match="forced_prefix_ids.*one prompt group.*forms 2"):
        tiny_asr.submit(long, DecodeOptions(forced_prefix_ids=(5,), max_new_tokens=8), sampling_rate=16000)
    # the positions check counts the prefix: a budget that fits alone is one too many with it
    limit = tiny_asr.config.text.max_position_embeddings
    audio = load_audio(x, 16000)
    prompt_len = len(plan_audio(audio, tiny_asr.prompts, tiny_asr.config, DecodeOptions())[0].prompt_ids)
    fits = DecodeOptions(max_new_tokens=limit - prompt_len)
    assert plan_audio(audio, tiny_asr.prompts, tiny_asr.config, fits)[0].max_new_tokens == limit - prompt_len
    with pytest.raises(ValueError, match="forced_prefix_ids"):
        plan_audio(audio, tiny_asr.prompts, tiny_asr.config, replace(fits, forced_prefix_ids=(5, 6, 7)))
    with pytest.raises(ValueError, match=f"forced_prefix_ids.*{limit + 3} positions"):
        tiny_asr.submit(x, replace(fits, forced_prefix_ids=(5, 6, 7)), sampling_rate=16000, pieces=[(0.0, 3.0)])
    assert fits.max_new_tokens + prompt_len == limit


def test_forced_prefix_ids_are_checked_when_the_options_are_made():
    assert DecodeOptions().forced_prefix_ids == ()
    assert DecodeOptions(forced_prefix_ids=[3, np.int64(4)]).forced_prefix_ids == (3, 4)
    for bad, err, what in (((-1,), ValueError, r"forced_prefix_ids\[0\] must be a token id >= 0"),
                           ((2, 1.5), TypeError, r"forced_prefix_ids\[1\] must be an int"),
                           ((True,), TypeError, r"forced_prefix_ids\[0\] must be an int"),
                           ("abc", TypeError, "forced_prefix_ids must be a tuple or list"),
                           (7, TypeError, "forced_prefix_ids must be a tuple or list")):
        with pytest.raises(err, match=what):
            DecodeOptions(forced_prefix_ids=bad)
