"""Pieces as prompts: each (start, end) stretch of at most 30 s is its own prompt and segment, with its true
times, decoding in parallel like separate short files."""

import pytest

import glmasr
from glmasr.options import DecodeOptions

from conftest import noise


def test_pieces_are_segments_with_their_true_times(tiny_asr):
    audio = noise(75.0, 8)
    pieces = [(1.25, 4.0), (10.0, 39.5), (60.0, 75.0)]
    r = tiny_asr.submit(audio, DecodeOptions(max_new_tokens=6), sampling_rate=16000, pieces=pieces).result()
    assert [(s.start, s.end) for s in r.segments] == pieces
    for seg, (a, b) in zip(r.segments, pieces):  # each piece gives what that stretch gives alone
        alone = glmasr.transcribe(audio[int(a * 16000): int(b * 16000)], model=tiny_asr, sampling_rate=16000,
                                  max_new_tokens=6)
        assert seg.token_ids == alone.token_ids and seg.text == alone.text
    assert r.num_groups == 3 and r.token_ids == [t for s in r.segments for t in s.token_ids]


def test_bad_and_empty_pieces(tiny_asr):
    audio = noise(10.0, 9)
    with pytest.raises(ValueError, match="at most 30 s"):
        tiny_asr.submit(audio, sampling_rate=16000, pieces=[(0.0, 31.0)])
    with pytest.raises(ValueError, match="a piece must lie"):
        tiny_asr.submit(audio, sampling_rate=16000, pieces=[(5.0, 4.0)])
    r = tiny_asr.submit(audio, sampling_rate=16000, pieces=[(1.0, 1.01)]).result()  # too short for a token
    assert r.text == "" and r.segments == [] and r.token_ids == [] and r.finish_reason == "stop"
    r = tiny_asr.submit(audio, sampling_rate=16000, pieces=[]).result()
    assert r.text == "" and r.num_groups == 0


def test_unknown_segmentation():
    with pytest.raises(ValueError, match="segmentation"):
        DecodeOptions(segmentation="energy")


def test_vad_segmentation_finds_the_speech(tiny_asr, tmp_path):
    """segmentation="vad": Silero VAD regions merged into <= 30 s pieces become the prompts; every stretch of
    synthesized speech lies inside a segment (0.1 s tolerance), and each segment gives what its stretch gives."""
    import shutil

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install -y espeak-ng sox)")
    from test_vad import SENTENCES, _extent, _place, _synthesize

    clips = []
    for text in SENTENCES[:3]:
        x = 0.5 * _synthesize(text, str(tmp_path))
        clips.append((x, _extent(x)))
    audio, truth = _place(clips, 70.0, seed=5)
    r = tiny_asr.submit(audio, DecodeOptions(max_new_tokens=5, segmentation="vad"), sampling_rate=16000).result()
    assert r.segments and all(s.end - s.start <= 30.0 + 1e-6 for s in r.segments)
    for a, b in truth:
        assert any(s.start - 0.1 <= a and b <= s.end + 0.1 for s in r.segments), (a, b, r.segments)
    assert r.segments[0].start >= truth[0][0] - 0.5  # the silence before the first speech is left out
    for s in r.segments:
        alone = glmasr.transcribe(audio[int(round(s.start * 16000)): int(round(s.end * 16000))], model=tiny_asr,
                                  sampling_rate=16000, max_new_tokens=5)
        assert s.token_ids == alone.token_ids
    # the same through the public function, streamed or not
    via_api = glmasr.transcribe(audio, model=tiny_asr, sampling_rate=16000, max_new_tokens=5, segmentation="vad")
    assert [(s.start, s.end, s.token_ids) for s in via_api.segments] == [(s.start, s.end, s.token_ids)
                                                                          for s in r.segments]
    last = list(glmasr.transcribe_stream(audio, model=tiny_asr, sampling_rate=16000, max_new_tokens=5,
                                         segmentation="vad"))[-1]
    assert last.finished and last.result.token_ids == r.token_ids
    with pytest.raises(ValueError, match="segmentation"):
        glmasr.transcribe(audio, model=tiny_asr, sampling_rate=16000, segmentation="silence")


def test_truncated_file_is_flagged_on_the_result(tiny_asr, tmp_path):
    import warnings

    import soundfile as sf

    path = tmp_path / "cut.wav"
    sf.write(path, noise(6.0, 3), 16000, subtype="PCM_16")
    data = path.read_bytes()
    path.write_bytes(data[: 44 + 2 * 16000 * 2])  # the header still says 6 s; 2 s of samples remain
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = glmasr.transcribe(str(path), model=tiny_asr, max_new_tokens=3)
    assert any(issubclass(w.category, glmasr.AudioWarning) and "cut.wav" in str(w.message) for w in caught)
    assert r.truncated and r.missing_s == pytest.approx(4.0, abs=0.01) and r.duration_s == pytest.approx(2.0)
    whole = glmasr.transcribe(noise(2.0, 3), model=tiny_asr, sampling_rate=16000, max_new_tokens=3)
    assert not whole.truncated and whole.missing_s == 0.0


def test_plan_groups_packs_windows_like_the_reference():
    """The prompt grouping token parity depends on (the reference processor puts up to 21 windows in one prompt;
    we never drop audio, so windows past what fits the context start the next prompt). Real sizes: 375 audio tokens
    per full 30 s window, a 15-token prompt overhead, 8192 positions, the default budget 32 + ceil(6 s)."""
    from glmasr.pipeline import MAX_WINDOWS_PER_PROMPT, default_max_new_tokens, plan_groups

    assert MAX_WINDOWS_PER_PROMPT == 21 and default_max_new_tokens(30.0) == 212
    # one full window and a 10 s tail: one prompt, its budget from the whole duration
    assert plan_groups([375, 125], [30.0, 10.0], 15, 8192, None) == [([0, 1], default_max_new_tokens(40.0))]
    # 40 full windows with the default budget: each group ends where the next window + its grown budget would pass
    # 8192 positions (15 + 375 k + 32 + ceil(180 k) <= 8192 -> k = 14)
    groups = plan_groups([375] * 40, [30.0] * 40, 15, 8192, None)
    assert [len(g) for g, _ in groups] == [14, 14, 12]
    assert [i for g, _ in groups for i in g] == list(range(40))  # every window once, in order
    assert all(15 + 375 * len(g) + b <= 8192 for g, b in groups)
    # a fixed small budget: the 21-window cap binds first
    groups = plan_groups([375] * 45, [30.0] * 45, 15, 8192, 16)
    assert [len(g) for g, _ in groups] == [21, 21, 3] and {b for _, b in groups} == {16}
    # a window that yields no token (a tail under 60 ms) still belongs to its group
    assert plan_groups([375, 0], [30.0, 0.05], 15, 8192, None) == [([0, 1], default_max_new_tokens(30.05))]
    # a budget that leaves no room for one window is refused, naming it
    with pytest.raises(ValueError, match="max_new_tokens=8000 leaves no room"):
        plan_groups([375], [30.0], 15, 8192, 8000)
