"""Result writers against their formats (SRT/VTT as whisper's writers have them), and segment times from the
engine's window groups."""

import json

import pytest

import glmasr
from glmasr.results import Segment, Transcription
from glmasr.writers import FORMATS, render, timestamp

from conftest import noise


def result():
    segs = [Segment(0, 0.0, 630.0, " Hello --> world ", [1, 2], "stop"),
            Segment(1, 630.0, 3725.4996, "", [], "stop"),
            Segment(2, 3725.4996, 3731.0, "Tab\there", [3], "length", avg_logprob=-0.25)]
    return Transcription("Hello --> world Tab\there", [1, 2, 3], "length", 3731.0, 125, segments=segs,
                         num_groups=3)


@pytest.mark.parametrize("seconds, srt, vtt", [
    (0.0, "00:00:00,000", "00:00.000"),
    (59.9994, "00:00:59,999", "00:59.999"),
    (59.9996, "00:01:00,000", "01:00.000"),
    (3600.0, "01:00:00,000", "01:00:00.000"),
    (3725.4996, "01:02:05,500", "01:02:05.500"),
    (360000.0, "100:00:00,000", "100:00:00.000"),
])
def test_timestamps(seconds, srt, vtt):
    assert timestamp(seconds) == srt
    assert timestamp(seconds, ".", False) == vtt


def test_negative_timestamp_is_refused():
    with pytest.raises(ValueError, match="negative"):
        timestamp(-0.1)


def test_srt():
    assert render(result(), "srt") == ("1\n00:00:00,000 --> 00:10:30,000\nHello -> world\n\n"
                                       "2\n01:02:05,500 --> 01:02:11,000\nTab\there\n\n")


def test_vtt():
    assert render(result(), "vtt") == ("WEBVTT\n\n00:00.000 --> 10:30.000\nHello -> world\n\n"
                                       "01:02:05.500 --> 01:02:11.000\nTab\there\n\n")


def test_tsv_txt_json():
    assert render(result(), "tsv") == "start\tend\ttext\n0\t630000\tHello --> world\n630000\t3725500\t\n" \
                                      "3725500\t3731000\tTab here\n"
    assert render(result(), "txt") == "Hello --> world Tab\there\n"
    data = json.loads(render(result(), "json"))
    assert data["text"] == result().text and [s["start"] for s in data["segments"]] == [0.0, 630.0, 3725.4996]
    assert data["segments"][2]["tokens"] == [3] and data["segments"][2]["finish_reason"] == "length"
    assert [s["avg_logprob"] for s in data["segments"]] == [0.0, 0.0, -0.25]


def test_unknown_format():
    assert set(FORMATS) == {"txt", "srt", "vtt", "tsv", "json"}
    with pytest.raises(ValueError, match="unknown output format 'doc'"):
        render(result(), "doc")


def test_segments_follow_the_window_groups(tiny_asr):
    """650 s: two prompts (21 windows = 630 s, then 20 s); each segment holds its group's tokens and text."""
    r = glmasr.transcribe(noise(650.0, 3), model=tiny_asr, sampling_rate=16000, max_new_tokens=4)
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 630.0), (630.0, 650.0)]
    assert [t for s in r.segments for t in s.token_ids] == r.token_ids
    assert " ".join(s.text for s in r.segments if s.text) == r.text
    short = glmasr.transcribe(noise(3.5, 4), model=tiny_asr, sampling_rate=16000, max_new_tokens=4)
    assert [(s.id, s.start, s.end) for s in short.segments] == [(0, 0.0, 3.5)]
