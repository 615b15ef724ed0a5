"""Subtitles and word times (issue 25, outputs): cues cut at word times and wrapped into lines
(``glmasr.writers.CueOptions``), no invented times without words, the files read back by third-party readers
(``srt``, webvtt-py, pysubs2, ffmpeg; csv and pandas for tsv), the server's ``verbose_json`` ``words[]`` parsed by
the openai client's types, the speech-shaped defaults of the server and the CLI, and the CLI's flags.

The expected cues are checked against the rules themselves (line widths, cue durations, which word times a cue
starts and ends on, greedy filling, pauses at the cuts), written here on their own, not with the writer's helpers.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import re
from datetime import timedelta

import numpy as np
import pytest
import soundfile as sf
import srt

import glmasr
from glmasr.results import Segment, Transcription, Word
from glmasr.writers import SUBTITLE_MAX_SEGMENT_S, CueOptions, render, render_openai

from conftest import noise, wait_healthy
from test_writers import (HOSTILE, expected_text, fuzz_texts, read_ffmpeg, read_pysubs2, read_srt, read_tsv,
                          read_webvtt)

CLOSING = "，。！？、：；」』）"
OPENING = "「『（"
CJK_CHARS = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后"
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def one(text: str, start: float, end: float, words=None, sid: int = 0) -> Transcription:
    seg = Segment(sid, start, end, text, [1], "stop", words=words)
    return Transcription(text, [1], "stop", end, 1, segments=[seg])


def cues_of(doc: str) -> list[tuple[int, int, list[str]]]:
    """(start ms, end ms, lines) of every cue, read by ``srt.parse``."""
    ms = timedelta(milliseconds=1)
    return [(c.start // ms, c.end // ms, c.content.split("\n")) for c in srt.parse(doc)]


def english_words(rng: random.Random, n: int, digits: bool = False) -> list[str]:
    out = []
    for _ in range(n):
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 12)))
        if digits and rng.random() < 0.2:
            w = str(rng.randint(0, 99999))
        out.append(w + rng.choice(["", "", "", ",", ".", "?"]))
    return out


def timed(words: list[str], rng: random.Random, t0: float = 0.0, pause_p: float = 0.1) -> list[Word]:
    """Words with fresh random times: 0.1-0.6 s each, gaps of 0-80 ms, now and then a pause of 0.2-2 s."""
    out, t = [], t0
    for w in words:
        d = rng.uniform(0.1, 0.6)
        out.append(Word(w, t, t + d, rng.random()))
        t += d + (rng.uniform(0.2, 2.0) if rng.random() < pause_p else rng.uniform(0.0, 0.08))
    return out


# ---- options ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_line_width": 0}, ValueError, "max_line_width"), ({"max_line_width": 1001}, ValueError, "max_line_width"),
    ({"max_line_width": 4.5}, TypeError, "max_line_width"), ({"max_line_count": 0}, ValueError, "max_line_count"),
    ({"max_line_count": True}, TypeError, "max_line_count"), ({"max_cue_s": 0}, ValueError, "max_cue_s"),
    ({"max_cue_s": float("inf")}, ValueError, "max_cue_s"), ({"max_cue_s": float("nan")}, ValueError, "max_cue_s"),
    ({"max_cue_s": "7"}, TypeError, "max_cue_s"), ({"highlight_words": 1}, TypeError, "highlight_words"),
])
def test_cue_options_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        CueOptions(**kwargs)
    assert CueOptions() == CueOptions(42, 2, 7.0, False)


# ---- without word times: a cue per segment, wrapped -----------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_lines_wrap_greedily_at_word_boundaries(seed):
    """Each segment is one cue with its own times; its lines hold whole words, at most ``width`` characters (a
    longer word alone), each as full as the next line's first word allows; as many lines as the text needs."""
    rng = random.Random(seed)
    width = rng.randint(6, 60)
    texts = [" ".join(english_words(rng, rng.randint(1, 40))) for _ in range(30)]
    t, segs = rng.uniform(0, 100), []
    for i, text in enumerate(texts):
        segs.append(Segment(i, t, t + rng.uniform(0.5, 30.0), text, [i], "stop"))
        t = segs[-1].end + rng.uniform(0, 3)
    r = Transcription(" ".join(texts), [], "stop", t, 1, segments=segs)
    opts = CueOptions(max_line_width=width, max_line_count=1, max_cue_s=0.5)  # no words: neither applies
    for fmt in ("srt", "vtt"):
        doc = render(r, fmt, opts)
        cues = cues_of(doc) if fmt == "srt" else [(a, b, t.split("\n")) for a, b, t in read_webvtt(doc)]
        assert [(a, b) for a, b, _ in cues] == [(round(1000 * s.start), round(1000 * s.end)) for s in segs]
        for (_, _, lines), text in zip(cues, texts):
            assert " ".join(lines) == text
            for k, line in enumerate(lines):
                assert len(line) <= width or " " not in line, (width, line)
                if k + 1 < len(lines):
                    assert len(line) + 1 + len(lines[k + 1].split(" ")[0]) > width, (width, lines)
        assert sum(len(lines) > 1 for _, _, lines in cues) > 5  # the test wraps


@pytest.mark.parametrize("seed", range(3))
def test_chinese_wraps_by_characters_never_before_closing_punctuation(seed):
    rng = random.Random(100 + seed)
    width = rng.randint(5, 20)
    for _ in range(20):
        parts = []
        for _ in range(rng.randint(1, 80)):
            ch = rng.choice(CJK_CHARS)
            if rng.random() < 0.1:
                ch = rng.choice(OPENING) + ch
            if rng.random() < 0.2:
                ch += rng.choice(CLOSING)
            parts.append(ch)
        text = "".join(parts)
        (cue,) = cues_of(render(one(text, 1.0, 9.0), "srt", CueOptions(max_line_width=width)))
        lines = cue[2]
        assert cue[:2] == (1000, 9000) and "".join(lines) == text
        for k, line in enumerate(lines):
            assert len(line) <= width and line[0] not in CLOSING and line[-1] not in OPENING, (width, lines)
            if k + 1 < len(lines):
                assert len(line) > width - 3, (width, lines)  # a break unit is at most 3 characters here


def test_mixed_scripts_and_no_break_spaces():
    """Breaks at spaces and between CJK characters (also next to Latin), never at a no-break space nor inside a
    Latin or Hangul word; punctuation stays on its line; a tab is a break like a space."""
    r = one("GLM模型很好。「真的」 a\xa0b\tcd 한국어 문장", 0.0, 2.0)
    assert cues_of(render(r, "srt", CueOptions(max_line_width=4)))[0][2] == \
        ["GLM模", "型很好。", "「真的」", "a\xa0b", "cd", "한국어", "문장"]
    assert cues_of(render(r, "srt", CueOptions(max_line_width=12)))[0][2] == \
        ["GLM模型很好。「真的」", "a\xa0b\tcd 한국어", "문장"]
    assert cues_of(render(r, "srt", CueOptions(max_line_width=10)))[0][2] == \
        ["GLM模型很好。「真", "的」 a\xa0b\tcd", "한국어 문장"]


def test_no_time_is_invented_without_words(tmp_path):
    """Without word times (None, an empty list, or words not found in the text) a cue is a segment with its own
    times, whatever max_cue_s and max_line_count say: never times made up from character counts."""
    rng = random.Random(5)
    segs, t = [], 0.0
    for i in range(12):
        text = " ".join(english_words(rng, rng.randint(5, 60)))
        words = [None, [], [Word("notintext", t, t + 0.5)]][i % 3]
        segs.append(Segment(i, t, t + rng.uniform(10.0, 30.0), text, [i], "stop", words=words))
        t = segs[-1].end
    r = Transcription("", [], "stop", t, 1, segments=segs)
    opts = CueOptions(max_line_width=20, max_line_count=1, max_cue_s=1.0, highlight_words=True)
    cues = cues_of(render(r, "srt", opts))
    assert [(a, b) for a, b, _ in cues] == [(round(1000 * s.start), round(1000 * s.end)) for s in segs]
    assert all(len(lines) > 1 for _, _, lines in cues) and "<u>" not in render(r, "srt", opts)


# ---- with word times: cues cut at word times ----------------------------------------------------------------

def check_word_cues(r: Transcription, opts: CueOptions, doc: str) -> list[list[int]]:
    """The srt ``doc`` against the rules: each cue is a run of consecutive words of one segment, from the first
    one's start to the last one's end; the runs cover every word in order; a cue of more than one word lasts at most
    max_cue_s and has at most max_line_count lines of at most max_line_width characters (a longer word alone on
    its line); a pause of 1 s or more between words is a cue edge. Returns the runs (word indices per cue)."""
    cues = cues_of(doc)
    runs, k = [], 0
    flat = [(s, i) for s in r.segments for i in range(len(s.words))]
    for a, b, lines in cues:
        seg, i = flat[k]
        words = seg.words
        text = " ".join(lines)
        j = i
        while " ".join(w.word for w in words[i:j + 1]) != text:
            j += 1
            assert j < len(words), (text, [w.word for w in words[i:]])
        assert (a, b) == (round(1000 * words[i].start), round(1000 * max(w.end for w in words[i:j + 1])))
        if j > i:
            assert words[j].end - words[i].start <= opts.max_cue_s + 1e-9
            assert len(lines) <= opts.max_line_count
            assert all(len(line) <= opts.max_line_width or " " not in line for line in lines), lines
        runs.append(list(range(i, j + 1)))
        k += j - i + 1
    assert k == len(flat)
    edges = {(run[-1], run[-1] + 1) for run in runs}
    for seg in r.segments:
        for i in range(len(seg.words) - 1):
            if seg.words[i + 1].start - seg.words[i].end >= 1.0 + 1e-6:
                assert (i, i + 1) in edges
    return runs


@pytest.mark.parametrize("seed", range(6))
def test_cues_follow_the_limits_at_word_times(seed):
    rng = random.Random(200 + seed)
    opts = CueOptions(max_line_width=rng.randint(12, 60), max_line_count=rng.randint(1, 3),
                      max_cue_s=rng.uniform(2.0, 8.0))
    segs, t = [], rng.uniform(0, 50)
    for i in range(4):
        words = timed(english_words(rng, rng.randint(1, 90)), rng, t)
        segs.append(Segment(i, t, words[-1].end + 0.1, " ".join(w.word for w in words), [i], "stop", words=words))
        t = segs[-1].end + rng.uniform(0.5, 3)
    r = Transcription("", [], "stop", t, 1, segments=segs)
    runs = check_word_cues(r, opts, render(r, "srt", opts))
    assert len(runs) > len(segs)


@pytest.mark.parametrize("seed", range(6))
def test_a_cue_that_must_be_cut_is_cut_at_the_largest_pause(seed):
    """24 words of 0.3 s with gaps of 20 ms (7.7 s: two cues at most 7 s), one 0.5 s pause after word k (both
    sides fit): the cut is there. Without the pause, a sentence end is taken instead."""
    rng = random.Random(300 + seed)
    texts = english_words(random.Random(seed), 24)
    texts = [w.rstrip(",.?") for w in texts]
    opts = CueOptions(max_line_width=400, max_line_count=2, max_cue_s=7.0)
    for k in (rng.randint(3, 10), rng.randint(12, 19)):
        for pause, mark in ((0.5, ""), (0.02, ".")):
            words, t = [], 10.0
            for i, w in enumerate(texts):
                words.append(Word(w + (mark if i == k else ""), t, t + 0.3))
                t += 0.3 + (pause if i == k else 0.02)
            r = one(" ".join(w.word for w in words), 10.0, t, words)
            runs = check_word_cues(r, opts, render(r, "srt", opts))
            assert [run[-1] for run in runs] == [k, 23], (k, pause, mark)


def test_pauses_of_a_second_always_end_a_cue_shorter_ones_do_not():
    opts = CueOptions()
    for gap, n_cues in ((1.0, 2), (1.7, 2), (0.4, 1), (0.9, 1)):
        words = [Word("one", 0.0, 0.3), Word("two", 0.35, 0.6), Word("three", 0.6 + gap, 1.0 + gap)]
        r = one("one two three", 0.0, 1.5 + gap, words)
        assert len(cues_of(render(r, "srt", opts))) == n_cues, gap


def test_chinese_words_and_their_punctuation():
    """Per-character words with their punctuation (as the aligner groups them): cues of whole characters, lines by
    characters, punctuation never first on a line, and text between words (an opening quote) kept."""
    rng = random.Random(7)
    text, words, t = "", [], 0.0
    for i in range(60):
        ch = rng.choice(CJK_CHARS) + (rng.choice("，。") if rng.random() < 0.2 else "")
        lead = "「" if rng.random() < 0.05 else ""
        text += lead + ch
        words.append(Word(ch, t, t + 0.2))
        t += 0.22
    opts = CueOptions(max_line_width=10)
    cues = cues_of(render(one(text, 0.0, t, words), "srt", opts))
    assert "".join("".join(lines) for _, _, lines in cues) == text
    starts = {round(1000 * w.start) for w in words}
    ends = {round(1000 * w.end) for w in words}
    for a, b, lines in cues:
        assert a in starts and b in ends and b - a <= 7000 and len(lines) <= 2
        assert all(len(line) <= 10 and line[0] not in CLOSING and line[-1] not in OPENING for line in lines)


def test_words_between_text_and_edge_cases():
    """Text around the words (quotes, punctuation, a dash) stays with the neighbouring word; a word made only of
    removed characters is skipped; words that overlap or run backwards do not break the cue times."""
    words = [Word("Hello", 1.0, 1.4), Word("\x00", 1.4, 1.5), Word("world", 1.5, 1.9), Word("again", 1.8, 1.7)]
    r = one("“Hello,” - world! again.", 0.5, 3.0, words)
    assert cues_of(render(r, "srt")) == [(1000, 1900, ["“Hello,” - world! again."])]
    narrow = cues_of(render(r, "srt", CueOptions(max_line_width=9, max_line_count=1)))
    assert narrow == [(1000, 1400, ["“Hello,”"]), (1500, 1900, ["- world!"]), (1800, 1800, ["again."])]
    early = one("a b", 0.0, 1.0, [Word("a", -0.02, 0.2), Word("b", 0.3, 0.5)])  # an aligner's bias past 0
    assert cues_of(render(early, "srt", CueOptions(highlight_words=True)))[0][:2] == (0, 200)


def test_highlighted_words(tmp_path):
    """One cue per word, the word underlined in the cue's text, the plain cue between words; readers give the
    underline back as a tag (srt, ffmpeg), an ASS override (pysubs2) or drop it (webvtt-py)."""
    rng = random.Random(11)
    words = timed(english_words(rng, 30), rng, 2.0, pause_p=0.3)
    r = one(" ".join(w.word for w in words), 2.0, words[-1].end, words)
    plain_opts, opts = CueOptions(max_line_width=30), CueOptions(max_line_width=30, highlight_words=True)
    plain = cues_of(render(r, "srt", plain_opts))
    runs = check_word_cues(r, plain_opts, render(r, "srt", plain_opts))
    lit = cues_of(render(r, "srt", opts))
    want = []
    for (a, b, lines), run in zip(plain, runs):
        last = a
        for i in run:
            w = words[i]
            s, e = round(1000 * w.start), round(1000 * w.end)
            if s > last:
                want.append((last, s, None))
            want.append((s, e, w.word))
            last = e
    assert [(a, b) for a, b, _ in lit] == [(a, b) for a, b, _ in want]
    for (a, b, lines), (_, _, word) in zip(lit, want):
        text = "\n".join(lines)
        tags = re.findall(r"<u>(.*?)</u>", text)
        assert tags == ([] if word is None else [word])
        assert text.replace("<u>", "").replace("</u>", "") in ["\n".join(p[2]) for p in plain]
    vtt = render(r, "vtt", opts)
    assert vtt.count("<u>") == len(words) and read_webvtt(vtt)[0][2] == "\n".join(plain[0][2])
    assert read_pysubs2(render(r, "srt", opts), "srt")[0][2].startswith("{\\u1}" + words[0].word + "{\\u0}")
    assert read_ffmpeg(render(r, "srt", opts), "srt", tmp_path) == read_srt(render(r, "srt", opts))


def test_escaping_in_word_cues():
    words = [Word(w, i * 0.5, i * 0.5 + 0.4) for i, w in enumerate(["R&D", "<b>x</b>", "a-->b", "1<2>0", "c\x07"])]
    r = one("R&D <b>x</b>\n\na-->b 1<2>0 c\x07", 0.0, 3.0, words)
    vtt = render(r, "vtt", CueOptions(max_line_width=14))
    assert "R&amp;D &lt;b&gt;x&lt;/b&gt;\na-&gt;b 1&lt;2&gt;0 c\n" in vtt
    assert render(r, "srt", CueOptions(max_line_width=14)).endswith("R&D ‹b>x‹/b>\na->b 1‹2>0 c\n\n")
    lit = render(r, "vtt", CueOptions(max_line_width=14, highlight_words=True))
    assert "<u>R&amp;D</u> &lt;b&gt;x&lt;/b&gt;" in lit and "\x07" not in lit and "\n\n\n" not in lit


def test_a_bare_number_never_ends_a_cue_alone():
    """pysubs2 drops a cue's last line when it is a bare number (any digits, as Python's \\d): the number takes
    the word before it along (or joins the line before when that holds one word)."""
    for text, width, lines in [("the year was 1995", 12, ["the year", "was 1995"]),
                               ("x 42", 1, ["x 42"]), ("in ٢٠٢٤", 3, ["in ٢٠٢٤"]),
                               ("spoken 12 34", 9, ["spoken", "12 34"])]:
        r = one(text, 0.0, 1.0)
        got = cues_of(render(r, "srt", CueOptions(max_line_width=width)))
        assert got[0][2] == lines, text
        for fmt in ("srt", "vtt"):
            assert read_pysubs2(render(r, fmt, CueOptions(max_line_width=width)), fmt)[0][2] == "\\N".join(lines)


# ---- every reader gives the cues back --------------------------------------------------------------------------

def _squashed(text: str) -> str:
    """The text without white space, "‹" read as "<" (the srt rule's)."""
    return re.sub(r"\s+", "", text.replace("\u2039", "<"))


def _plain(text: str) -> str:
    return text.replace("<u>", "").replace("</u>", "").replace("{\\u1}", "").replace("{\\u0}", "")


@pytest.mark.parametrize("seed", range(3))
def test_readers_give_word_cues_back(seed, tmp_path):
    """Hostile words (markup, arrows, controls, CJK, digits) with times: srt.parse, webvtt-py, pysubs2 and ffmpeg
    give back the same cues (times and text, underline tags aside); the cue texts hold the segments' texts as the
    writers' text rules say."""
    rng = random.Random(400 + seed)
    segs, t = [], 1.0
    for i in range(25):
        words = [w for w in fuzz_texts(rng.randint(0, 10**6), rng.randint(1, 30), HOSTILE) if w.split()]
        words = [w.strip() for w in words]
        tw = timed(words, rng, t, pause_p=0.15)
        text = " ".join(words)
        segs.append(Segment(i, t, (tw[-1].end if tw else t) + 0.2, text, [i], "stop", words=tw))
        t = segs[-1].end + 0.5
    r = Transcription("", [], "stop", t, 1, segments=segs)
    for opts in (CueOptions(), CueOptions(max_line_width=16, max_line_count=1, max_cue_s=3.0),
                 CueOptions(max_line_width=20, highlight_words=True)):
        srt_doc, vtt_doc = render(r, "srt", opts), render(r, "vtt", opts)
        ref = [(a, b, _plain(t)) for a, b, t in read_srt(srt_doc)]
        assert len(ref) == srt_doc.count(" --> ") > len(segs)
        want_vtt = [(a, b, _plain(t).replace("\u2039", "<")) for a, b, t in ref]
        assert [(a, b, _plain(t)) for a, b, t in read_pysubs2(srt_doc, "srt")] == \
            [(a, b, t.replace("\n", "\\N")) for a, b, t in ref]
        assert [(a, b, _plain(t)) for a, b, t in read_ffmpeg(srt_doc, "srt", tmp_path)] == ref
        # the srt rule turns "<" into "‹" where a ">" follows; vtt escapes instead, so its text has "<"
        got_vtt = [(a, b, t.replace("\u2039", "<")) for a, b, t in read_webvtt(vtt_doc)]
        assert got_vtt == want_vtt
        assert [(a, b, _plain(t).replace("\u2039", "<")) for a, b, t in read_pysubs2(vtt_doc, "vtt")] == \
            [(a, b, t.replace("\n", "\\N")) for a, b, t in want_vtt]
        assert [(a, b, _plain(t).replace("\u2039", "<")) for a, b, t in read_ffmpeg(vtt_doc, "vtt", tmp_path)] \
            == want_vtt
        if not opts.highlight_words:  # every cue's text, white space aside, is its segment's text in order
            seen = "".join(t for _, _, t in ref)
            want = "".join(expected_text(s.text, "srt") for s in segs)
            assert _squashed(seen) == _squashed(want)


def test_tsv_word_rows_and_json_words():
    """tsv with words: start, end, segment, probability, word per row (a segment without words: one row with its
    text); csv and pandas read every row back. json: ``words`` on the segments that have them."""
    rng = random.Random(9)
    ws = timed([w for w in fuzz_texts(3, 40, HOSTILE) if w.strip()] + ['"quoted', "tab\there"], rng, 3.0)
    segs = [Segment(0, 3.0, 30.0, "whatever text", [1], "stop", words=ws),
            Segment(1, 30.0, 40.0, "no\twords here", [2], "stop"),
            Segment(2, 40.0, 41.0, "", [], "stop", words=[])]
    r = Transcription("", [1, 2], "stop", 41.0, 1, segments=segs)
    want = [("start", "end", "segment", "probability", "word")]
    want += [(str(round(1000 * w.start)), str(round(1000 * w.end)), "0", f"{w.probability:.3f}",
              expected_text(w.word, "tsv")) for w in ws]
    want += [("30000", "40000", "1", "", "no words here")]
    for name, rows in read_tsv(render(r, "tsv")).items():
        assert rows == want, name
    data = json.loads(render(r, "json"))
    assert [w["word"] for w in data["segments"][0]["words"]] == [expected_text(w.word, "json") for w in ws]
    assert data["segments"][0]["words"][5] == {"word": expected_text(ws[5].word, "json"), "start": ws[5].start,
                                               "end": ws[5].end, "probability": ws[5].probability}
    assert "words" not in data["segments"][1] and data["segments"][2]["words"] == []
    # without any words: the segment form, unchanged
    assert render(one("a b", 0.0, 1.0), "tsv") == "start\tend\ttext\n0\t1000\ta b\n"


def test_render_openai_words_and_segments():
    pytest.importorskip("openai")
    from openai.types.audio import TranscriptionVerbose, TranscriptionWord

    rng = random.Random(12)
    ws = timed(english_words(rng, 10), rng, 0.5)
    r = one(" ".join(w.word for w in ws), 0.0, 8.0, ws)
    cases = {(): (True, False), ("segment",): (True, False), ("word",): (False, True),
             ("word", "segment"): (True, True)}
    for granularities, (segments, words) in cases.items():
        body, media = render_openai(r, "verbose_json", 8.0, "en", granularities)
        data = json.loads(body)
        assert media == "application/json" and ("segments" in data) == segments and ("words" in data) == words
        v = TranscriptionVerbose.model_validate(data)
        if words:
            assert all(set(w) == {"word", "start", "end"} for w in data["words"])
            assert [TranscriptionWord.model_validate(w) for w in data["words"]] == v.words
            assert [(w.word, w.start, w.end) for w in v.words] == \
                [(w.word, round(w.start, 3), round(w.end, 3)) for w in ws]


# ---- the server ---------------------------------------------------------------------------------------------------

def server_extra():
    """The openai client module, when the server's extra is installed (else the test skips)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("multipart")
    return pytest.importorskip("openai")


def speech_audio(pause_s: float = 1.5, reps: int = 3) -> np.ndarray:
    """The shipped English sample ``reps`` times with ``pause_s`` of faint noise between (fresh, not zeros)."""
    from glmasr.audio import load_audio
    from glmasr.checkpoint.resources import sample_audio

    speech = load_audio(str(sample_audio())).samples
    quiet = (np.random.default_rng(1).standard_normal(int(16000 * pause_s)) * 1e-4).astype(np.float32)
    parts = []
    for _ in range(reps):
        parts += [speech, quiet]
    return np.concatenate(parts[:-1])


def flac(samples: np.ndarray) -> bytes:
    b = io.BytesIO()
    sf.write(b, samples, 16000, format="FLAC")
    return b.getvalue()


def decoded(data: bytes):
    from glmasr.audio import load_audio

    return load_audio(sf.read(io.BytesIO(data), dtype="float32")[0], 16000)


def fake_words(result: Transcription) -> Transcription:
    """A stand-in aligner: each segment's whitespace words at random, increasing times inside it (seeded by the
    result's tokens: the same result gets the same words)."""
    rng = random.Random(repr(result.token_ids))
    out = dataclasses.replace(result, segments=[dataclasses.replace(s) for s in result.segments])
    for s in out.segments:
        names = s.text.split()
        cuts = sorted(rng.uniform(s.start, s.end) for _ in range(2 * len(names)))
        s.words = [Word(w, cuts[2 * i], cuts[2 * i + 1], rng.random()) for i, w in enumerate(names)]
    return out


class _WordsRequest:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def result(self):
        r = self.inner.result
        return None if r is None else fake_words(r)

    async def aresult(self):
        return fake_words(await self.inner.aresult())


@pytest.fixture(scope="module")
def served(asr):
    """A server over the in-process engine; ``words``: the same, its engine client giving every result words
    from the stand-in aligner (where the engine client hands results to the server)."""
    openai = server_extra()
    from live_server import KEY
    from starlette.testclient import TestClient

    from glmasr.server import ServerConfig, create_app
    from glmasr.workers.engine_client import LocalEngineClient

    class WordsClient(LocalEngineClient):
        def __init__(self, asr):
            super().__init__(asr)
            self.decodes = []

        def submit(self, audio, decode, *args, **kwargs):
            self.decodes.append(decode)
            plain = dataclasses.replace(decode, word_timestamps=False)  # the engine's own aligner is not used
            return _WordsRequest(super().submit(audio, plain, *args, **kwargs))

    class HasAligner:  # what the server checks: the engine's handle has an aligner
        def __init__(self, asr):
            self._asr, self.aligner = asr, object()

        def __getattr__(self, name):
            return getattr(self._asr, name)

    clients = {}
    with TestClient(create_app(LocalEngineClient(asr), ServerConfig(api_key=KEY, close_engine=False,
                                                                      warmup="none"))) as plain:
        words_client = WordsClient(HasAligner(asr))
        with TestClient(create_app(words_client, ServerConfig(api_key=KEY, close_engine=False,
                                                              warmup="none"))) as with_words:
            for name, tc in (("plain", plain), ("words", with_words)):
                wait_healthy(tc.get)
                clients[name] = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc,
                                              max_retries=0)
            clients["engine"] = words_client
            clients["tc"] = plain
            yield clients


def test_server_words_are_what_the_openai_client_types(served, asr):
    from live_server import MODEL
    from openai.types.audio import TranscriptionVerbose, TranscriptionWord

    data = flac(speech_audio(reps=2))
    engine = served["engine"]
    v = served["words"].audio.transcriptions.create(file=("a.flac", data), model=MODEL,
                                                    response_format="verbose_json", timestamp_granularities=["word"])
    decode = engine.decodes[-1]
    assert decode.word_timestamps and decode.segmentation == "vad" and decode.max_segment_s == SUBTITLE_MAX_SEGMENT_S
    # the engine's result for the same pieces, with the stand-in's words
    from glmasr.audio import vad

    audio = decoded(data)
    pieces = vad.segment(audio.samples, device="cpu", **vad.segment_options(SUBTITLE_MAX_SEGMENT_S))
    plain = dataclasses.replace(decode, word_timestamps=False)
    ref = fake_words(asr.submit_loaded(audio, plain, pieces=pieces).result())
    want = [(w.word, round(w.start, 3), round(w.end, 3)) for s in ref.segments for w in s.words]
    assert isinstance(v, TranscriptionVerbose) and v.segments is None and len(want) > 0
    assert all(isinstance(w, TranscriptionWord) for w in v.words)
    assert [(w.word, w.start, w.end) for w in v.words] == want
    both = served["words"].audio.transcriptions.create(file=("a.flac", data), model=MODEL,
                                                       response_format="verbose_json",
                                                       timestamp_granularities=["word", "segment"])
    assert [(w.word, w.start, w.end) for w in both.words] == want
    assert [(s.start, s.end, s.tokens) for s in both.segments] == \
        [(round(s.start, 3), round(s.end, 3), s.token_ids) for s in ref.segments]


def test_server_without_an_aligner_refuses_word_times(served):
    from live_server import KEY, MODEL

    data = flac(noise(2.0, 21))
    with pytest.raises(server_extra().BadRequestError) as e:
        served["plain"].audio.transcriptions.create(file=("a.flac", data), model=MODEL,
                                                    response_format="verbose_json", timestamp_granularities=["word"])
    assert e.value.param == "timestamp_granularities" and e.value.code == "unsupported_value"
    assert "--aligner" in e.value.message and "timestamp_granularities" in e.value.message
    r = served["tc"].post("/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                          data={"model": MODEL, "response_format": "verbose_json",
                                "timestamp_granularities[]": "word"}, files={"file": ("a.flac", data)})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_subtitle_formats_follow_the_speech(served, asr):
    """srt, vtt and verbose_json default to speech-shaped segments (VAD pieces of at most SUBTITLE_MAX_SEGMENT_S, cut at pauses);
    json and text keep the reference windows; chunking_strategy with json packs 30 s pieces as before."""
    from live_server import MODEL

    from glmasr import writers
    from glmasr.audio import vad

    data = flac(speech_audio())
    audio = decoded(data)
    client = served["plain"]
    shaped = vad.segment(audio.samples, device="cpu", **vad.segment_options(SUBTITLE_MAX_SEGMENT_S))
    assert len(shaped) >= 3 and all(b - a <= SUBTITLE_MAX_SEGMENT_S + 1e-6 for a, b in shaped)
    ref = asr.submit_loaded(audio, glmasr.DecodeOptions(segmentation="vad", max_segment_s=SUBTITLE_MAX_SEGMENT_S),
                            pieces=shaped).result()
    v = client.audio.transcriptions.create(file=("a.flac", data), model=MODEL, response_format="verbose_json")
    assert [(s.start, s.end, s.tokens) for s in v.segments] == \
        [(round(a, 3), round(b, 3), s.token_ids) for (a, b), s in zip(shaped, ref.segments)]
    assert client.audio.transcriptions.create(file=("a.flac", data), model=MODEL, response_format="srt") == \
        writers.to_srt(ref)
    assert client.audio.transcriptions.create(file=("a.flac", data), model=MODEL, response_format="vtt") == \
        writers.to_vtt(ref)
    windows = asr.submit_loaded(audio, glmasr.DecodeOptions()).result()
    assert client.audio.transcriptions.create(file=("a.flac", data), model=MODEL).text == windows.text
    packed = vad.segment(audio.samples, device="cpu", **vad.segment_options(None))
    assert len(packed) < len(shaped)
    chunked = asr.submit_loaded(audio, glmasr.DecodeOptions(), pieces=packed).result()
    assert client.audio.transcriptions.create(file=("a.flac", data), model=MODEL,
                                              chunking_strategy="auto").text == chunked.text


# ---- the CLI ------------------------------------------------------------------------------------------------------

def cli_main(argv):
    from glmasr.cli.main import main

    return main(argv)


@pytest.mark.parametrize("flags, words", [
    (["--word-timestamps"], ["--word-timestamps", "--aligner"]),
    (["--highlight-words"], ["--highlight-words", "--word-timestamps", "--aligner"]),
    (["--max-segment-s", "7", "--segmentation", "windows"], ["--max-segment-s", "--segmentation"]),
])
def test_cli_flags_that_do_not_go_together(flags, words, tmp_path, tiny_shipped, capsys):
    sf.write(tmp_path / "x.wav", noise(1.0, 3), 16000)
    rc = cli_main(["transcribe", str(tmp_path / "x.wav"), "--model", str(tiny_shipped), "-q", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words) and "Traceback" not in err, err
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("flags, match", [
    (["--max-segment-s", "0.5"], "between 1 and 30"), (["--max-segment-s", "31"], "between 1 and 30"),
    (["--max-line-width", "1001"], "at most 1000"), (["--max-line-count", "0"], "at least 1"),
    (["--max-cue-s", "0"], "positive"), (["--max-cue-s", "nan"], "positive"),
])
def test_cli_flag_values_are_checked(flags, match, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["transcribe", "x.wav", *flags])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_bad_aligner_fails_before_any_worker_starts(tmp_path, tiny_shipped, capsys):
    """With several engine processes (serve --data-parallel, transcribe --devices) the head is found and checked
    once, in the parent: exit status 2 with the loader's message, no worker spawned, no output written."""
    pytest.importorskip("uvicorn")
    sf.write(tmp_path / "x.wav", noise(1.0, 5), 16000)
    missing = tmp_path / "no_head"
    for argv in (["serve", "--data-parallel", "2", "--devices", "cpu,cpu"],
                 ["transcribe", str(tmp_path / "x.wav"), "-q", "--devices", "cpu,cpu"]):
        rc = cli_main(argv + ["--model", str(tiny_shipped), "--aligner", str(missing)])
        err = capsys.readouterr().err
        assert rc == 2 and f"aligner {str(missing)!r}" in err and "Traceback" not in err, err
    assert not (tmp_path / "x.txt").exists()


def test_a_pool_takes_the_aligner_as_a_folder(tiny_shipped, aligned):
    """Worker processes load the head themselves: an ``Aligner`` object is refused (TypeError naming what to
    give) before any worker starts."""
    from glmasr.workers import DevicePool

    with pytest.raises(TypeError, match="head folder or hub id"):
        DevicePool(["cpu"], model=tiny_shipped, aligner=aligned.aligner)


def test_a_bad_aligner_is_an_error_naming_it(tmp_path, tiny_shipped, capsys):
    """transcribe and serve: an --aligner that is no head folder is exit status 2 with the loader's message."""
    pytest.importorskip("uvicorn")
    sf.write(tmp_path / "x.wav", noise(1.0, 4), 16000)
    missing = tmp_path / "no_head"
    for argv in (["transcribe", str(tmp_path / "x.wav"), "-q"], ["serve"]):
        rc = cli_main(argv + ["--model", str(tiny_shipped), "--device", "cpu", "--aligner", str(missing)])
        err = capsys.readouterr().err
        assert rc == 2 and f"aligner {str(missing)!r}" in err and "Traceback" not in err, err
    assert not (tmp_path / "x.txt").exists()


def _json_without_logprobs(text: str) -> dict:
    data = json.loads(text)
    for s in data["segments"]:
        s.pop("avg_logprob")
    return data


def test_cli_subtitles_default_to_short_speech_segments(tmp_path, tiny_shipped, tiny_asr):
    """-f srt (with VAD, the CLI's default) decodes speech-shaped segments of at most SUBTITLE_MAX_SEGMENT_S; without srt/vtt the
    speech is packed into 30 s pieces; --max-segment-s and the line flags reach the decoder and the writer."""
    path = tmp_path / "talk.flac"
    sf.write(path, speech_audio(), 16000)
    base = ["transcribe", str(path), "--model", str(tiny_shipped), "--device", "cpu", "--max-new-tokens", "6", "-q",
            "--overwrite"]

    def ref(max_segment_s):
        return glmasr.transcribe(str(path), model=tiny_asr, max_new_tokens=6, segmentation="vad",
                                 max_segment_s=max_segment_s)

    for formats, flags, max_s, opts in [
        ("srt,json", [], SUBTITLE_MAX_SEGMENT_S, CueOptions()),
        ("txt,json", [], None, None),
        ("vtt,json", ["--max-segment-s", "4", "--max-line-width", "12"], 4.0, CueOptions(max_line_width=12)),
        ("srt,json", ["--max-line-width", "0"], SUBTITLE_MAX_SEGMENT_S, CueOptions(max_line_width=None)),
    ]:
        assert cli_main(base + ["-f", formats, *flags]) == 0
        r = ref(max_s)
        assert _json_without_logprobs((tmp_path / "talk.json").read_text(encoding="utf-8")) == \
            _json_without_logprobs(render(r, "json"))
        sub = formats.split(",")[0]
        if sub != "txt":
            assert (tmp_path / f"talk.{sub}").read_text(encoding="utf-8") == render(r, sub, opts)
    assert len(ref(SUBTITLE_MAX_SEGMENT_S).segments) > len(ref(None).segments)


# ---- end to end with the real aligner (a random-weights head in the published layout) -------------------------

@pytest.fixture(scope="module")
def head_folder(tiny_shipped, tmp_path_factory):
    from glmasr.align.random_head import build_head_for_checkpoint

    return build_head_for_checkpoint(tmp_path_factory.mktemp("head"), tiny_shipped, size="small", seed=31)


@pytest.fixture(scope="module")
def aligned(tiny_shipped, head_folder):
    asr = glmasr.load(tiny_shipped, device="cpu", aligner=head_folder)
    yield asr
    asr.close()


def test_cli_word_times_end_to_end(tmp_path, tiny_shipped, head_folder, aligned):
    """--aligner: json segments carry words, tsv has a row per word, srt/vtt cues start and end at word times;
    each output is what the writers make of the handle's own result; --highlight-words underlines them."""
    path = tmp_path / "talk.flac"
    sf.write(path, speech_audio(reps=2), 16000)
    base = ["transcribe", str(path), "--model", str(tiny_shipped), "--device", "cpu", "--max-new-tokens", "12",
            "-q", "--aligner", str(head_folder), "-f", "all"]
    assert cli_main(base) == 0
    decode = glmasr.DecodeOptions(max_new_tokens=12, segmentation="vad", max_segment_s=SUBTITLE_MAX_SEGMENT_S,
                                  word_timestamps=True)
    ref = aligned.submit(str(path), decode).result()
    words = [w for s in ref.segments for w in s.words]
    assert len(words) >= 2 and all(s.words is not None for s in ref.segments)
    assert _json_without_logprobs((tmp_path / "talk.json").read_text(encoding="utf-8")) == \
        _json_without_logprobs(render(ref, "json"))
    for fmt in ("srt", "vtt", "tsv"):
        assert (tmp_path / f"talk.{fmt}").read_text(encoding="utf-8") == render(ref, fmt), fmt
    assert (tmp_path / "talk.tsv").read_text(encoding="utf-8").count("\n") == len(words) + 1
    starts = {round(1000 * w.start) for w in words} | {round(1000 * s.start) for s in ref.segments if not s.words}
    ends = {round(1000 * w.end) for w in words} | {round(1000 * s.end) for s in ref.segments if not s.words}
    for a, b, _ in cues_of((tmp_path / "talk.srt").read_text(encoding="utf-8")):
        assert a in starts and b in ends
    assert cli_main(base + ["--overwrite", "--highlight-words", "-f", "srt"]) == 0
    lit = (tmp_path / "talk.srt").read_text(encoding="utf-8")
    assert lit == render(ref, "srt", CueOptions(highlight_words=True)) and lit.count("<u>") == len(words)
    assert cli_main(base + ["--overwrite", "-f", "vtt", "--max-line-count", "1", "--max-cue-s", "1.5",
                            "--max-line-width", "10"]) == 0
    assert (tmp_path / "talk.vtt").read_text(encoding="utf-8") == \
        render(ref, "vtt", CueOptions(max_line_width=10, max_line_count=1, max_cue_s=1.5))


def test_cli_word_times_on_two_workers(tmp_path, tiny_shipped, head_folder, aligned):
    """--devices cpu,cpu --aligner: each worker process loads the head; two files come out as the handle in this
    process writes them (json words, srt cues at word times)."""
    names = []
    for k in range(2):
        path = tmp_path / f"talk{k}.flac"
        sf.write(path, speech_audio(reps=2 + k), 16000)
        names.append(path)
    assert cli_main(["transcribe", *map(str, names), "--model", str(tiny_shipped), "--devices", "cpu,cpu",
                     "--max-new-tokens", "12", "-q", "--aligner", str(head_folder), "-f", "json,srt"]) == 0
    decode = glmasr.DecodeOptions(max_new_tokens=12, segmentation="vad", max_segment_s=SUBTITLE_MAX_SEGMENT_S,
                                  word_timestamps=True)
    for path in names:
        ref = aligned.submit(str(path), decode).result()
        assert sum(len(s.words) for s in ref.segments) >= 2
        assert _json_without_logprobs(path.with_suffix(".json").read_text(encoding="utf-8")) == \
            _json_without_logprobs(render(ref, "json"))
        assert path.with_suffix(".srt").read_text(encoding="utf-8") == render(ref, "srt")


def test_server_word_times_end_to_end(aligned):
    """A server over a handle loaded with the aligner: verbose_json words[] are the handle's words for the
    speech-shaped segments, typed by the openai client."""
    openai = server_extra()
    from live_server import KEY, MODEL
    from starlette.testclient import TestClient

    from glmasr.audio import vad
    from glmasr.server import ServerConfig, create_app

    data = flac(speech_audio(reps=2))
    audio = decoded(data)
    pieces = vad.segment(audio.samples, device="cpu", **vad.segment_options(SUBTITLE_MAX_SEGMENT_S))
    ref = aligned.submit_loaded(audio, glmasr.DecodeOptions(segmentation="vad", max_segment_s=SUBTITLE_MAX_SEGMENT_S,
                                                            word_timestamps=True), pieces=pieces).result()
    want = [(w.word, round(w.start, 3), round(w.end, 3)) for s in ref.segments for w in s.words]
    assert want
    with TestClient(create_app(aligned, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))) as tc:
        wait_healthy(tc.get)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)
        v = client.audio.transcriptions.create(file=("a.flac", data), model=MODEL, response_format="verbose_json",
                                               timestamp_granularities=["word", "segment"])
    assert [(w.word, w.start, w.end) for w in v.words] == want
    assert [s.text for s in v.segments] == [s.text for s in ref.segments]
