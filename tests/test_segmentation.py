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
