"""Result writers against their formats (SRT/VTT as whisper's writers have them), and segment times from the
engine's window groups.

Third-party readers read our files back: ``srt.parse``, webvtt-py, pysubs2 (srt and vtt), ffmpeg (converting our
srt and vtt to srt, which ``srt.parse`` reads), Python's ``csv`` and pandas (tsv). Each must give back every cue or
row with its times and the text ``expected_text`` says: the normalisation the module docstring of
``glmasr.writers`` states, written here again on its own (not with the writer's helpers)."""

import csv
import html
import io
import json
import random
import shutil
import subprocess
import unicodedata
from datetime import timedelta

import pysubs2
import pytest
import srt
import webvtt

import glmasr
from glmasr.results import Segment, Transcription
from glmasr.writers import FORMATS, SRT_LINE_CHARS, CueOptions, render, timestamp

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
    assert render(result(), "vtt") == ("WEBVTT\n\n00:00.000 --> 10:30.000\nHello -&gt; world\n\n"
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


# ---- what a reader should give back ------------------------------------------------------------------------------

# CRLF and these split a text into lines (str.splitlines breaks at all of them)
_BREAKS = "\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"


def _dropped(ch: str) -> bool:
    """A control character other than tab (C0, DEL, C1) or a Unicode noncharacter."""
    cp = ord(ch)
    return (unicodedata.category(ch) == "Cc" and ch != "\t") or 0xFDD0 <= cp <= 0xFDEF or cp & 0xFFFE == 0xFFFE


def expected_text(text: str, fmt: str) -> str:
    """The text a reader of ``fmt`` should give back for a segment's ``text`` ("" in srt/vtt: no cue); vtt after
    decoding character references, as WebVTT readers must."""
    text = "".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)
    if fmt == "json":
        return text
    text = text.replace("\r\n", "\n")
    for ch in _BREAKS:
        text = text.replace(ch, "\n")
    lines = ("".join(ch for ch in line if not _dropped(ch)).strip() for line in text.split("\n"))
    text = " ".join(line for line in lines if line)
    if fmt in ("srt", "vtt"):
        while "-->" in text:
            text = text.replace("-->", "->")
    if fmt == "srt" and ">" in text:
        cut = text.rindex(">")
        text = text[:cut].replace("<", "\u2039") + text[cut:]
    if fmt == "srt":
        text = "\n".join(_srt_lines(text))
    if fmt == "tsv":
        text = text.replace("\t", " ")
        if text.startswith('"'):
            text = " " + text
    return text


def _srt_lines(text: str) -> list[str]:
    """A long srt cue in lines of at most SRT_LINE_CHARS characters, broken at a space where there is one."""
    lines = []
    while len(text) > SRT_LINE_CHARS:
        space = text.rfind(" ", 0, SRT_LINE_CHARS + 1)
        end, skip = (space, 1) if space > 0 else (SRT_LINE_CHARS, 0)
        lines.append(text[:end].strip())
        text = text[end + skip:].strip()
    return [line for line in lines + [text] if line]


def expected_cues(r: Transcription, fmt: str) -> list[tuple[int, int, str]]:
    cues = [(round(1000 * s.start), round(1000 * s.end), expected_text(s.text, fmt)) for s in r.segments]
    return [c for c in cues if c[2]]


# ---- the readers: (start ms, end ms, text) per cue ---------------------------------------------------------------

def _ms(stamp: str) -> int:
    """Milliseconds of a ``HH:MM:SS.mmm`` timestamp."""
    hours, minutes, seconds = stamp.split(":")
    secs, millis = seconds.split(".")
    return ((int(hours) * 60 + int(minutes)) * 60 + int(secs)) * 1000 + int(millis)


def read_srt(doc: str) -> list:
    one = timedelta(milliseconds=1)
    return [(c.start // one, c.end // one, c.content) for c in srt.parse(doc)]


def read_webvtt(doc: str) -> list:
    # webvtt-py strips tags but leaves character references as they are: decode them, as WebVTT says
    return [(_ms(c.start), _ms(c.end), html.unescape(c.text)) for c in webvtt.from_string(doc)]


def read_pysubs2(doc: str, fmt: str) -> list:
    # pysubs2 does not decode vtt character references either; .text is the cue text in pysubs2's own (ASS) form,
    # where a line break is "\N" (check_subtitles writes the expected text so)
    decode = html.unescape if fmt == "vtt" else str
    return [(e.start, e.end, decode(e.text)) for e in pysubs2.SSAFile.from_string(doc, format_=fmt)]


def read_ffmpeg(doc: str, fmt: str, tmp_path) -> list:
    """ffmpeg reads our file and writes it as srt, which srt.parse reads; any ffmpeg complaint fails."""
    if shutil.which("ffmpeg") is None:
        pytest.skip("the ffmpeg binary is not on PATH")
    src, out = tmp_path / f"in.{fmt}", tmp_path / "out.srt"
    src.write_text(doc, encoding="utf-8")
    run = subprocess.run(["ffmpeg", "-nostdin", "-hide_banner", "-v", "error", "-y", "-i", str(src), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    return read_srt(out.read_text(encoding="utf-8"))


SUBTITLE_READERS = {
    "srt": {"srt": read_srt, "pysubs2": lambda d: read_pysubs2(d, "srt")},
    "vtt": {"webvtt": read_webvtt, "pysubs2": lambda d: read_pysubs2(d, "vtt")},
}


def check_subtitles(r: Transcription, tmp_path, without: tuple[str, ...] = ()):
    """Every reader but those named in ``without`` gives back ``expected_cues`` (cues unwrapped, one line each:
    the text rules alone; wrapping is tests/test_subtitles.py's)."""
    for fmt, readers in SUBTITLE_READERS.items():
        doc = render(r, fmt, CueOptions(max_line_width=None))
        want = expected_cues(r, fmt)
        for name, read in readers.items():
            if name not in without:
                line_break = "\\N" if name == "pysubs2" else "\n"
                assert read(doc) == [(a, b, t.replace("\n", line_break)) for a, b, t in want], \
                    f"{name} reading our {fmt}"
        if "ffmpeg" not in without:
            # ffmpeg decodes the vtt references itself; its srt output holds the text as it was
            assert read_ffmpeg(doc, fmt, tmp_path) == want, f"ffmpeg reading our {fmt}"


def read_tsv(doc: str) -> dict:
    """Rows (start, end, text) as each reader gives them."""
    rows = {"csv": [tuple(row) for row in csv.reader(io.StringIO(doc, newline=""), delimiter="\t")],
            "csv QUOTE_NONE": [tuple(row) for row in csv.reader(io.StringIO(doc, newline=""), delimiter="\t",
                                                                quoting=csv.QUOTE_NONE)]}
    try:
        import pandas as pd
    except ImportError:
        pd = None
    if pd is not None:
        # text as text: pandas otherwise reads "" or "NA" as a missing value
        frame = pd.read_csv(io.StringIO(doc), sep="\t", dtype=str, keep_default_na=False)
        rows["pandas"] = [tuple(frame.columns)] + [tuple(row) for row in frame.itertuples(index=False)]
    return rows


def check_tsv(r: Transcription):
    want = [("start", "end", "text")] + [(str(round(1000 * s.start)), str(round(1000 * s.end)),
                                          expected_text(s.text, "tsv")) for s in r.segments]
    for name, rows in read_tsv(render(r, "tsv")).items():
        assert rows == want, f"{name} reading our tsv"


def check_txt_json(r: Transcription):
    txt = render(r, "txt")
    assert txt.splitlines() == [expected_text(r.text, "txt")] and txt.endswith("\n")
    txt.encode("utf-8")  # what the CLI writes: it must encode
    data = json.loads(render(r, "json").encode("utf-8"))
    assert data["text"] == expected_text(r.text, "json")
    assert [s["text"] for s in data["segments"]] == [expected_text(s.text, "json") for s in r.segments]


def transcription(texts: list[str], seed: int) -> Transcription:
    """One segment per text at fresh random times from somewhere in the first hour on, so later ones pass it."""
    rng = random.Random(seed)
    t, segs = rng.uniform(0.0, 3000.0), []
    for i, text in enumerate(texts):
        start = t
        t += rng.uniform(0.05, 60.0)
        segs.append(Segment(i, start, t, text, [i], "stop"))
        t += rng.choice([0.0, rng.uniform(0.0, 5.0)])
    return Transcription(" ".join(texts), list(range(len(texts))), "stop", t, 1, segments=segs,
                         num_groups=len(segs))


# ---- hand-picked texts -------------------------------------------------------------------------------------------

def _long_text(seed: int) -> str:
    rng = random.Random(seed)
    words = ["speech", "R&D", "a<b", "中文", "😀", "-->", "x", "\t", "\n", "\r\n", "long", "text"]
    return " ".join(rng.choice(words) for _ in range(1500))


CASES = [
    # the reported ones
    "R&D <3 a -> b", "before\x00after the NUL", "bell\x07 rings", "first\n\nsecond paragraph", "row\rsplit",
    # controls
    "esc \x1b[31mred\x1b[0m", "del\x7fete", "c1 \x80\x81\x9b\x9f end", "nel\x85next", "vt\vff\fsep\x1c\x1d\x1e\x1f",
    "".join(map(chr, range(32))) + "all C0", "\x00\x00lead", "trail\x00",
    # blank lines, whitespace lines, CR / CRLF
    "a\n \nb", "a\n\t\nb", "a\n\u3000\nb", "\n\nleading blank", "trailing blank\n\n\n", "a\r\n\r\nb",
    "a\r\nb", "a\rb", "\r\r", "a\u2028b\u2029\u2029c", "one\ntwo\nthree",
    # tabs
    "a\tb", "\ttab lead", "tab trail\t", "x\t\ty",
    # CJK, emoji and other scripts
    "你好，世界。这是一个测试", "日本語のテキストです", "한국어 문장", "😀 👨\u200d👩\u200d👧 🇨🇳 emoji",
    "مرحبا بالعالم", "e\u0301 combining",
    # leading / trailing whitespace of all kinds
    "   spaces around   ", "\u3000ideographic\u3000", "\xa0nbsp\xa0", " \t\n mixed \r\n\t ",
    # arrows
    "a --> b", "a ---> b", "a ----> b", "-->", "<-- x -->", "00:00:01,000 --> x", "- > -- >",
    # tag-like text and references
    "<b>bold</b>", "<i>it</i> <u>u</u> <s>s</s>", "<font color=red>red</font>", "<c.yellow>c</c>", "<v Bob>hi",
    "<00:00:01.000>karaoke", "a<b", "a > b", "1 < 2 > 0", "<>", "<<>>", "&amp; &lt; &gt; &#65; &nbsp; & ;",
    "&", "<", ">",
    # quotes, digits, format words
    '"quoted" start', '"', '"unclosed', 'mid "q" x', "'single'", "42", "1\n2", "WEBVTT", "NOTE this",
    "STYLE",
    # what Python strings may hold and UTF-8 cannot / must not carry
    "bad \ud800 half", "\udfff", "x\ufffey\uffffz\ufdd0\U0001fffe", "\ufeffbom", "zw\u200bsp \u202eRTL",
    # no cue
    "", "   ", "\n\n", "\x00", "\r\n\t\x07",
    _long_text(7), "中文" * 1300 + "。", "x" * 2345, "a" * 999 + " " + "b" * 1001 + "   " + "c" * 10,
    "\u3000" * 1200 + "x", ("word " * 199 + "\t" + "😀" * 1200) * 2,
]
# ASS syntax: written as it is; ffmpeg reads it as ASS (module docstring), the other readers give it back
ASS_CASES = ["{\\an8}top", "brace {x} y", "back\\slash \\N \\n \\h", "a\\{b\\}"]
# two timestamps in a line: pysubs2 takes the line for a timing line (module docstring), the others give it back
TIMING_CASES = ["00:00:01,000 --> 00:00:02,000", "from 1:02:03.5 to 1:02:04.5", "00:01.000 --> 00:02.000"]


def test_reported_defects_are_fixed():
    """The issue's examples, checked on the documents themselves."""
    r = transcription(["R&D <3 a -> b", "a\x00b", "c", "first\n\nsecond", "row\rsplit\ttab"], seed=11)
    vtt_doc, srt_doc, tsv_doc = render(r, "vtt"), render(r, "srt"), render(r, "tsv")
    assert "R&amp;D &lt;3 a -&gt; b\n" in vtt_doc
    for doc in (vtt_doc, srt_doc, tsv_doc):
        assert not any(_dropped(ch) for ch in doc.replace("\n", "")) and "\r" not in doc
    assert "\n\n\n" not in srt_doc and "first second\n" in srt_doc and "first second\n" in vtt_doc
    assert tsv_doc.count("\n") == 6 and tsv_doc.endswith("\trow split tab\n")


def test_readers_give_the_cases_back(tmp_path):
    r = transcription(CASES * 2, seed=1)
    assert len(expected_cues(r, "srt")) > 100 and r.segments[-1].end > 3600.0
    srt_doc = render(r, "srt")
    assert sum(len(t.split("\n")) for _, _, t in expected_cues(r, "srt")) > len(expected_cues(r, "srt")) + 10
    assert max(len(line.encode("utf-8")) for line in srt_doc.split("\n")) <= 4000
    check_subtitles(r, tmp_path)
    check_tsv(r)
    check_txt_json(r)


def test_ass_syntax_is_written_as_it_is(tmp_path):
    r = transcription(ASS_CASES * 3, seed=2)
    check_subtitles(r, tmp_path, without=("ffmpeg",))
    check_tsv(r)
    assert "{\\an8}top" in render(r, "srt") and "back\\slash \\N \\n \\h" in render(r, "vtt")


def test_timestamps_in_the_text_are_written_as_they_are(tmp_path):
    r = transcription(TIMING_CASES * 2, seed=3)
    check_subtitles(r, tmp_path, without=("pysubs2",))
    check_tsv(r)


# a hostile alphabet: markup, arrows, quotes, every C0 control, DEL, C1, line breaks of all kinds, odd code points
HOSTILE = (list("abcXYZ019 :,.;#&<>-/=\"'!?") + ["-->", "<b>", "</i>", "&amp;", "&lt;", "\n\n", "\r\n", "\r", "\t"]
           + [chr(c) for c in range(32)] + ["\x7f", "\x80", "\x85", "\x9b", "\x9f", "\u2028", "\u2029", "\xa0",
           "\u3000", "\u200b", "\ufeff", "\u202e", "\u0301", "中", "文", "😀", "👨\u200d👩", "\ufffe", "\uffff",
           "\ufdd0", "\U0010ffff", "\ud800", "\udc00"])
ASS_CHARS = ["\\", "{", "}", "\\N"]


def fuzz_texts(seed: int, n: int, alphabet: list[str]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_readers_give_random_texts_back(seed, tmp_path):
    texts = fuzz_texts(seed, 300, HOSTILE)
    check_subtitles(transcription(texts, seed), tmp_path)
    with_ass = fuzz_texts(100 + seed, 300, HOSTILE + ASS_CHARS)
    r = transcription(with_ass, seed)
    check_subtitles(r, tmp_path, without=("ffmpeg",))
    check_tsv(r)
    check_txt_json(r)
