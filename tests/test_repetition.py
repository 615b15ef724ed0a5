"""The opt-in runaway guard and the compression ratio."""

import pytest

import glmasr
from glmasr.engine.repetition import MIN_SPAN, is_stuck
from glmasr.transcript import compression_ratio

from conftest import noise


@pytest.mark.parametrize("tokens, repeats, stuck", [
    ([7] * 16, 4, True),                       # one token 16 times (the span bound, not 4 copies, decides)
    ([7] * 15, 4, False),
    ([1, 2] * 8, 4, True),
    ([1, 2] * 7, 4, False),
    ([9, 9] + [1, 2, 3, 4] * 4, 4, True),      # 4 copies of a 4-gram = 16 tokens
    ([1, 2, 3, 4] * 3 + [1, 2, 3], 4, False),  # not at the end
    (list(range(40)) + list(range(8)) * 3, 3, True),
    (list(range(40)) + list(range(8)) * 3, 4, False),
    (list(range(100)), 2, False),
    ([5] * 100, None, False),                   # off
])
def test_is_stuck(tokens, repeats, stuck):
    assert is_stuck(tokens, repeats) is stuck


def test_bad_repetition_stop(tiny_asr):
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match="repetition_stop"):
            glmasr.transcribe(noise(1.0, 1), model=tiny_asr, sampling_rate=16000, repetition_stop=bad)


@pytest.fixture(scope="module")
def looping_asr(tiny_shipped, tmp_path_factory):
    """The tiny checkpoint with every decoder layer's output projections zeroed: the next token then depends on
    the current token alone, so greedy decoding iterates a function on the vocabulary and ends in a cycle."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("looping") / "ckpt"
    shutil.copytree(tiny_shipped, folder)
    state = load_file(folder / "model.safetensors")
    for k in state:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) and "language_model" in k:
            state[k].zero_()
    save_file(state, folder / "model.safetensors")
    return glmasr.load(folder, device="cpu")


def test_guard_ends_a_looping_sequence(looping_asr):
    """Under a long forced budget the sequence loops: with the guard it ends with finish_reason "repetition",
    its tokens are a prefix of the unguarded run, and its tail is the loop."""
    audio = noise(3.5, 2)
    free = glmasr.transcribe(audio, model=looping_asr, sampling_rate=16000, max_new_tokens=300, ignore_eos=True)
    assert free.finish_reason == "length" and len(free.token_ids) == 300
    guarded = glmasr.transcribe(audio, model=looping_asr, sampling_rate=16000, max_new_tokens=300,
                                ignore_eos=True, repetition_stop=4)
    assert guarded.finish_reason == "repetition" and guarded.segments[0].finish_reason == "repetition"
    n = len(guarded.token_ids)
    assert MIN_SPAN <= n < 300 and guarded.token_ids == free.token_ids[:n]
    # stopped at the first read-back that showed the loop: at most one round (8 steps) past where it was visible
    assert is_stuck(guarded.token_ids, 4) and not is_stuck(guarded.token_ids[: n - 8], 4)


def test_compression_ratio():
    assert compression_ratio("") == 0.0
    assert compression_ratio("the cat sat on the mat " * 20) > 2.4 > compression_ratio("The quick brown fox.")
