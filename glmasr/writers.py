"""Result writers: one ``Transcription`` as txt, srt, vtt, tsv or json text (the CLI and the server use these).

- txt: the transcript, one line.
- srt: numbered cues from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` (hours always), the text, a blank line after each.
- vtt: ``WEBVTT``, a blank line, then cues ``[HH:]MM:SS.mmm --> [HH:]MM:SS.mmm`` (hours only when non-zero).
- tsv: a header ``start	end	text``, then one line per segment, times in integer milliseconds. When a segment
  has word times (``Segment.words`` is not None: ``DecodeOptions(word_timestamps=True)``), the word form instead:
  a header ``start	end	segment	probability	word``, then one row per word (its times in integer milliseconds,
  the id of its segment, the aligner's probability with three decimals, the word); a segment without words
  (``words`` None) gives one row with its own times, an empty probability and its whole text.
- json: the text, duration, finish reason and the segments (id, start, end, text, tokens, finish_reason,
  compression_ratio, avg_logprob: the mean log-probability of the segment's tokens, ``Segment.avg_logprob``; and
  ``words``, a list of {word, start, end, probability}, for a segment that has word times).

Times are rounded to the millisecond.

Speakers (``DecodeOptions(diarize=True)``: ``Segment.speaker``, ``Word.speaker``). A result is diarized when any of
its segments has a speaker; then:

- vtt: each cue's text is a voice span, ``<v A>text`` (WebVTT's voice tag; the name one line, ``&``, ``<`` and
  ``>`` escaped as in the text, ``-->`` as below); srt: each cue's first line starts with ``[A] `` (srt has no
  voice tag; readers keep the prefix as text). A cue never spans two speakers: a segment whose words have
  speakers is cut into runs of one speaker (a unit of words that no line break may split takes its first word's
  speaker), each run cut into cues as below; a segment without words is one cue with the segment's speaker. The
  prefix is not counted in ``max_line_width``. A cue without a speaker (None) has no tag.
- tsv: a ``speaker`` column before the text (``start	end	speaker	text``; the word form
  ``start	end	segment	probability	speaker	word``, a word's own speaker, else its segment's), empty for None.
- json: every segment has ``speaker``, and so has every word (a string or null).

Subtitle cues (srt, vtt; ``CueOptions``). A cue never spans two segments, and no time is invented:

- A segment with word times gets cues cut at word times: each cue holds whole words, at most ``max_cue_s``
  seconds and at most ``max_line_count`` lines of at most ``max_line_width`` characters; a single word longer
  than that is a cue of its own. Of the ways to cut, the one of least cost: a second for each cue, less the pause
  at each cut (up to 2 s, in tenths of a second; an end of sentence adds 0.3 s, a comma 0.1 s); then the most even
  cue lengths. So a pause of 1 s or more always ends a cue, and a cue that must be cut is cut at its largest
  pauses and sentence ends. Cue times are word times: its first word's start, the latest end of its words (a
  negative time, which an aligner should not give, is written as 0). The words must be found, in order, in the
  segment's text (they are the transcript's own words); text between them stays with the word before it (an
  opening bracket or quote with the word after it). Where they cannot be found, the segment is written as one
  without words.
- ``highlight_words`` (whisper's ``--highlight_words``): each cue of a segment with words is written once per
  word, from the word's start to its end, with that word underlined (``<u>word</u>``), and the cue's plain text
  fills the gaps between words.
- A segment without word times is one cue with the segment's own times (a stretch of audio: window groups, or
  with VAD the speech pieces), its text wrapped into lines of at most ``max_line_width`` characters; it gets more
  than ``max_line_count`` lines when its text needs them. Readable cues then come from short segments
  (``SUBTITLE_MAX_SEGMENT_S``, the subtitle default of ``DecodeOptions.max_segment_s`` in the CLI and the server).
- Lines break at white space (not at no-break spaces) and, in CJK text (ideographs, kana), between characters,
  never before closing punctuation (``，。！？」`` ...) or after an opening bracket; never inside a word otherwise.
  Line width is counted in characters (code points); each line is stripped (``str.strip``: a no-break space at
  either end goes, as readers strip it). A piece with no break in it longer than ``SRT_LINE_CHARS`` is
  cut every ``SRT_LINE_CHARS`` characters. The last line of a cue of two or more lines is never a bare number
  (pysubs2 drops it, taking it for the next cue's number): it takes the word before it along, which may make it
  longer than ``max_line_width``.
- ``max_line_width`` None: no wrapping, each cue one line (srt lines are still broken at ``SRT_LINE_CHARS``,
  below).

Text, so that third-party readers (players, ffmpeg, subtitle and TSV libraries) give back what we meant:

- every format: a lone surrogate (U+D800..U+DFFF, not encodable as UTF-8) becomes U+FFFD. json writes the texts
  otherwise as they are (it escapes control characters itself).
- txt, srt, vtt and tsv first make each text one line: line breaks (CR, LF, CRLF, and the others
  ``str.splitlines`` breaks at: VT, FF, FS, GS, RS, NEL, U+2028, U+2029) cut it into pieces; control characters (C0
  other than tab, DEL, C1) and Unicode noncharacters (U+FDD0..U+FDEF, the last two code points of every plane) are
  removed; each piece is stripped (``str.strip``) and the non-empty ones are joined by one space. So no cue holds an
  empty line (which ends the cue), a NUL (after which ffmpeg dropped every later cue), a U+FFFE (ffmpeg drops the
  cue) or a bare CR. The text's own line breaks are not kept: a segment of speech has no line structure, and readers
  disagree on them (pysubs2 drops a cue's last line when it is a bare number, taking it for the next cue's). The
  only line breaks in a cue are the wrapping's.
- srt and vtt: ``-->`` becomes ``->`` until none is left (so does any run of two or more hyphens before ``>``): it
  would end the timing line of a cue. A segment whose text is then empty gets no cue. Tabs stay.
- vtt: ``&``, ``<`` and ``>`` are written ``&amp;``, ``&lt;`` and ``&gt;``: WebVTT readers decode these, and no text
  reads as a tag.
- srt has no escapes, and its readers (ffmpeg, players, pysubs2) take ``<...>`` for a formatting tag and drop it: a
  ``<`` of the text with a ``>`` after it in the cue (the text's, or a highlight tag's) becomes ``‹`` (U+2039); other
  ``<`` stay. A cue line longer than ``SRT_LINE_CHARS`` (1000) characters (only without wrapping, or a piece with
  no break) is broken into lines: at the last space within the first 1000 characters (the space goes), after the
  1000th where there is none, then the same on the rest; each line is stripped, empty ones dropped. ffmpeg (so
  mpv and other players built on it) cuts an srt line at 4095 bytes and drops the whole cue when the cut splits a
  UTF-8 character, and a segment holds up to 21 windows (630 s) of speech.
- left as they are in srt and vtt, as neither format can escape them, and read otherwise by some readers:
  backslashes and braces (ffmpeg and libass players read the text as ASS: ``\\N`` or ``\\n`` as a line break,
  ``{...}`` as an override block); two timestamps in one line (pysubs2 takes it for a timing line: srt.parse,
  webvtt-py and ffmpeg do not).
- tsv: tabs become spaces (the text is the last column, so it holds no tab or line break), and a text that starts
  with ``"`` gets one space in front: readers that take a leading quote for CSV quoting (Python's ``csv`` and
  pandas with their defaults, spreadsheets) would otherwise join the following rows into that field. No other
  quoting: read it as plain TSV (``csv.reader(f, delimiter="\\t")``, with or without ``quoting=csv.QUOTE_NONE``).
  A segment with empty text keeps its row.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass

from .results import Segment, Transcription

FORMATS = ("txt", "srt", "vtt", "tsv", "json")
# longest srt cue line, in characters: at most 4000 bytes as UTF-8, under the 4095 at which ffmpeg cuts
SRT_LINE_CHARS = 1000
# the subtitle default of DecodeOptions.max_segment_s (CLI srt/vtt, server srt/vtt/verbose_json): a speech piece of
# up to 7 s holds about two lines of 42 characters at a usual speaking rate (~15 characters a second)
SUBTITLE_MAX_SEGMENT_S = 6.0
CUE_COST = 10  # of a cue, when words are cut into cues: what a cut at a pause of 1 s gains (_cut_score)


@dataclass(frozen=True)
class CueOptions:
    """How srt/vtt cues are cut and wrapped (module docstring; whisper's option names). max_line_width: characters
    per line, 1..``SRT_LINE_CHARS``, or None (no wrapping: one line per cue); max_line_count: lines per cue
    (>= 1) where word times allow cutting; max_cue_s: longest cue in seconds (> 0) where word times allow cutting;
    highlight_words: one cue per word with that word underlined (segments with word times only)."""

    max_line_width: int | None = 42
    max_line_count: int = 2
    max_cue_s: float = 7.0
    highlight_words: bool = False

    def __post_init__(self):
        width = self.max_line_width
        if width is not None:
            if isinstance(width, bool) or not isinstance(width, numbers.Integral):
                raise TypeError(f"max_line_width must be a whole number of characters or None, got {width!r}")
            if not 1 <= width <= SRT_LINE_CHARS:
                raise ValueError(f"max_line_width must be between 1 and {SRT_LINE_CHARS} characters, got {width}")
        count = self.max_line_count
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise TypeError(f"max_line_count must be a whole number of lines, got {count!r}")
        if count < 1:
            raise ValueError(f"max_line_count must be at least 1, got {count}")
        cue_s = self.max_cue_s
        if isinstance(cue_s, bool) or not isinstance(cue_s, numbers.Real):
            raise TypeError(f"max_cue_s must be a number of seconds, got {cue_s!r}")
        if not (0.0 < float(cue_s) < math.inf):
            raise ValueError(f"max_cue_s must be a positive number of seconds, got {cue_s!r}")
        if not isinstance(self.highlight_words, bool):
            raise TypeError(f"highlight_words must be True or False, got {self.highlight_words!r}")


def timestamp(seconds: float, decimal: str = ",", always_hours: bool = True) -> str:
    if seconds < 0:
        raise ValueError(f"a timestamp must not be negative, got {seconds}")
    ms = round(seconds * 1000.0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    head = f"{hours:02d}:" if always_hours or hours else ""
    return f"{head}{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


_SURROGATES = re.compile("[\ud800-\udfff]")
# CR, LF (so CRLF too) and the other characters str.splitlines breaks at: a reader may break a line at any of them
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_NONCHARACTERS = "\ufdd0-\ufdef" + "".join(chr(plane + 0xFFFE) + chr(plane + 0xFFFF)
                                             for plane in range(0, 0x110000, 0x10000))
# C0 but tab (line breaks are split off first), DEL, C1, noncharacters
_REMOVED = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f" + _NONCHARACTERS + "]")
_ARROW = re.compile("-{2,}>")
# white space a line may break at: every str.isspace character but the no-break spaces
_BREAK_SPACE = re.compile("[^\\S\xa0\u2007\u202f]+")
# scripts written without spaces, where a line may break between any two characters: CJK ideographs, kana, bopomofo,
# and their punctuation (CJK symbols and punctuation, the fullwidth and halfwidth forms' punctuation)
_CJK = re.compile("[\u2e80-\u2fff\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf"
                  "\u4e00-\u9fff\uf900-\ufaff\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"
                  "\U00020000-\U0003ffff]")
# kinsoku: no line starts with closing punctuation, none ends with an opening bracket or quote
_NO_LINE_START = frozenset("、。，．・：；？！）］｝〕〉》」』】〙〗〟’”｠»…‥ー々ゝゞヽヾぁぃぅぇぉっゃゅょゎァィゥェォッャュョヮヵヶ"
                           ",.;:!?)]}%")
_NO_LINE_END = frozenset("（［｛〔〈《「『【〘〖〝‘“｟«([{")
_SENTENCE_END = frozenset(".?!。？！…‼⁇⁈⁉")
_CLAUSE_END = frozenset(",;:，；：、")
_CLOSERS = "\"'”’」』）)]】》〉»"
_BARE_NUMBER = re.compile(r"\s*\d+\s*")  # what pysubs2 takes for the next cue's number when it ends a cue


def _encodable(text: str) -> str:
    return _SURROGATES.sub("\ufffd", text)


def _one_line(text: str) -> str:
    """``text`` as one line: no line break, no control character, no surrounding whitespace (module docstring)."""
    pieces = (_REMOVED.sub("", piece).strip() for piece in _LINE_BREAKS.split(_encodable(text)))
    return " ".join(piece for piece in pieces if piece)


def _cue_text(text: str) -> str:
    return _ARROW.sub("->", _one_line(text))


def _tsv_text(text: str) -> str:
    line = _one_line(text).replace("\t", " ")
    return " " + line if line.startswith('"') else line


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---- cues -------------------------------------------------------------------------------------------------------

@dataclass
class _Part:
    """Text of a cue that belongs to one word (``word``: its index in the segment's words, None without words)."""

    text: str
    word: int | None = None


@dataclass
class _Unit:
    """What no line break may split: parts joined without a break. ``sep``: the white space before it in the text
    ("" where the break is between CJK characters), dropped where a line starts with it."""

    sep: str
    parts: list[_Part]
    start: float = 0.0
    end: float = 0.0

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)


@dataclass
class _Cue:
    start: float
    end: float
    lines: list[list[_Unit]]
    highlight: int | None = None  # the word underlined (highlight_words)
    speaker: str | None = None  # Segment.speaker / Word.speaker: a vtt voice span, an srt prefix


def _may_break(left: str, right: str) -> bool:
    """May a line break between ``left`` and ``right`` (no white space between them)?"""
    if not left or not right or right[0] in _NO_LINE_START or left[-1] in _NO_LINE_END:
        return False
    return bool(_CJK.match(left[-1]) or _CJK.match(right[0]))


def _pieces(text: str) -> list[tuple[str, str]]:
    """``text`` (one line, stripped) as (separator, piece) pairs, cut where a line may break (module docstring)."""
    pairs: list[tuple[str, str]] = []
    sep, pos = "", 0
    for m in [*_BREAK_SPACE.finditer(text), None]:
        chunk = text[pos:m.start()] if m is not None else text[pos:]
        start = 0
        for i in range(1, len(chunk)):
            if _may_break(chunk[i - 1], chunk[i]):
                pairs.append((sep, chunk[start:i]))
                sep, start = "", i
        if chunk:
            pairs.append((sep, chunk[start:]))
        if m is not None:
            sep, pos = m.group(), m.end()
    return pairs


def _long_pieces_cut(units: list[_Unit]) -> list[_Unit]:
    """Units longer than ``SRT_LINE_CHARS`` cut into pieces of that many characters (each a unit of its own)."""
    out = []
    for u in units:
        if len(u.text) <= SRT_LINE_CHARS:
            out.append(u)
            continue
        sep, chunk, room = u.sep, [], SRT_LINE_CHARS
        for p in u.parts:
            text = p.text
            while text:
                take = text[:room]
                chunk.append(_Part(take, p.word))
                text, room = text[len(take):], room - len(take)
                if room == 0:
                    out.append(_Unit(sep, chunk, u.start, u.end))
                    sep, chunk, room = "", [], SRT_LINE_CHARS
        if chunk:
            out.append(_Unit(sep, chunk, u.start, u.end))
    return out


def _text_units(text: str) -> list[_Unit]:
    return [_Unit(sep, [_Part(piece)]) for sep, piece in _pieces(text)]


def _word_units(text: str, seg: Segment) -> list[_Unit] | None:
    """The segment's words found in order in ``text`` (its cue text), as units with word times and the text
    between them attached (module docstring); None when a word is not found or no word has text."""
    units: list[_Unit] = []
    pos = 0
    for k, w in enumerate(seg.words or ()):
        word = _cue_text(w.word)
        if not word:
            continue
        at = text.find(word, pos)
        if at < 0:
            return None
        gap = text[pos:at]
        space = _BREAK_SPACE.search(gap)
        if space is not None:
            back, sep, front = gap[:space.start()], space.group(), gap[space.end():]
        else:
            cut = next((i for i, ch in enumerate(gap) if ch in _NO_LINE_END), len(gap))
            back, sep, front = gap[:cut], "", gap[cut:]
        if units:
            units[-1].parts[-1].text += back
        else:
            front = back + front
        part = _Part(front + word, k)
        start = max(0.0, float(w.start))  # a timestamp is never negative, whatever an aligner gives
        end = max(start, float(w.end))
        prev = units[-1] if units else None
        if prev is not None and not sep and not _may_break(prev.text, part.text):
            prev.parts.append(part)
            prev.end = max(prev.end, end)
        else:
            units.append(_Unit(sep, [part], start, end))
        pos = at + len(word)
    if not units:
        return None
    units[-1].parts[-1].text += text[pos:]
    return units


def _wrap(units: list[_Unit], width: int | None) -> list[list[_Unit]]:
    """Units into lines of at most ``width`` characters (greedy; None: one line); a last line that is a bare number
    takes the unit before it along (or joins the line before, when that holds one unit)."""
    lines: list[list[_Unit]] = []
    cur: list[_Unit] = []
    size = 0
    for u in units:
        if cur and width is not None and size + len(u.sep) + len(u.text) > width:
            lines.append(cur)
            cur, size = [], 0
        size += (len(u.sep) if cur else 0) + len(u.text)
        cur.append(u)
    if cur:
        lines.append(cur)
    if len(lines) >= 2 and _BARE_NUMBER.fullmatch(_line_text(lines[-1])):
        if len(lines[-2]) >= 2:
            lines[-1].insert(0, lines[-2].pop())
        else:
            lines[-2:] = [lines[-2] + lines[-1]]
    return lines


def _line_text(line: list[_Unit]) -> str:
    return "".join((u.sep if i else "") + u.text for i, u in enumerate(line))


def _cut_score(left: _Unit, right: _Unit) -> int:
    """How good a cue edge between two units is: the pause in tenths of a second (up to 2 s), plus 3 after the end
    of a sentence, 1 after a comma."""
    pause = max(0.0, min(right.start - left.end, 2.0))
    score = int(pause * 10 + 1e-6)
    last = left.text.rstrip(_CLOSERS)[-1:]
    return score + (3 if last in _SENTENCE_END else 1 if last in _CLAUSE_END else 0)


def _split_cues(units: list[_Unit], opts: CueOptions) -> list[list[_Unit]]:
    """Units with times into cues (module docstring): the least cost, ``CUE_COST`` per cue less the ``_cut_score``
    of each cut, then the smallest sum of squared cue lengths. Dynamic programming over cut positions; a cue grows
    only while it fits, so the cost is linear in the words per cue."""
    n = len(units)
    width, eps = opts.max_line_width, 1e-9
    best: list[tuple[int, int] | None] = [None] * (n + 1)
    back = [0] * (n + 1)
    best[0] = (0, 0)
    for i in range(n):
        if best[i] is None:
            continue
        lines, size, chars = 1, 0, 0
        for j in range(i, n):
            u = units[j]
            if j == i:
                size = chars = len(u.text)
            else:
                chars += len(u.sep) + len(u.text)
                if width is not None and size + len(u.sep) + len(u.text) > width:
                    lines, size = lines + 1, len(u.text)
                else:
                    size += len(u.sep) + len(u.text)
                if lines > opts.max_line_count or u.end - units[i].start > opts.max_cue_s + eps:
                    break
            cost = CUE_COST - (_cut_score(u, units[j + 1]) if j + 1 < n else 0)
            total = (best[i][0] + cost, best[i][1] + chars * chars)
            if best[j + 1] is None or total < best[j + 1]:
                best[j + 1], back[j + 1] = total, i
    cues, j = [], n
    while j > 0:
        cues.append(units[back[j]:j])
        j = back[j]
    return cues[::-1]


def _speaker_runs(units: list[_Unit], seg: Segment) -> list[tuple[str | None, list[_Unit]]]:
    """Consecutive units of one speaker (each unit's first word's speaker, else the segment's)."""
    runs: list[tuple[str | None, list[_Unit]]] = []
    for u in units:
        k = next((p.word for p in u.parts if p.word is not None), None)
        who = seg.words[k].speaker if k is not None and seg.words[k].speaker is not None else seg.speaker
        if runs and runs[-1][0] == who:
            runs[-1][1].append(u)
        else:
            runs.append((who, [u]))
    return runs


def _segment_cues(seg: Segment, opts: CueOptions) -> list[_Cue]:
    text = _cue_text(seg.text)
    if not text:
        return []
    units = _word_units(text, seg) if seg.words else None
    if units is None:
        units = _long_pieces_cut(_text_units(text))
        return [_Cue(seg.start, seg.end, _wrap(units, opts.max_line_width), speaker=seg.speaker)]
    out = []
    for who, run in _speaker_runs(_long_pieces_cut(units), seg):
        for group in _split_cues(run, opts):
            start, end = group[0].start, max(group[0].start, max(u.end for u in group))
            lines = _wrap(group, opts.max_line_width)
            if not opts.highlight_words:
                out.append(_Cue(start, end, lines, speaker=who))
                continue
            words = sorted({p.word for u in group for p in u.parts if p.word is not None})
            last = start
            for k in words:
                w = seg.words[k]
                w_start = max(0.0, float(w.start))
                w_end = max(w_start, float(w.end))
                if w_start > last:
                    out.append(_Cue(last, w_start, lines, speaker=who))
                out.append(_Cue(w_start, w_end, lines, k, speaker=who))
                last = max(last, w_end)
    return out


def _cues(result: Transcription, opts: CueOptions | None) -> list[_Cue]:
    opts = opts or CueOptions()
    return [c for s in result.segments for c in _segment_cues(s, opts)]


def _spans(line: list[_Unit], highlight: int | None) -> list[tuple[str, bool]]:
    """A line as (text, underlined) spans."""
    spans = []
    for i, u in enumerate(line):
        if i and u.sep:
            spans.append((u.sep, False))
        for p in u.parts:
            spans.append((p.text, highlight is not None and p.word == highlight))
    return spans


def _stripped(text: str, lo: int, hi: int) -> tuple[int, int]:
    """The offsets of ``text[lo:hi].strip()``."""
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    return lo, hi


def _srt_breaks(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the lines a long srt line is broken into (module docstring)."""
    out, a, n = [], 0, len(text)

    def strip(lo: int, hi: int) -> tuple[int, int]:
        return _stripped(text, lo, hi)

    while n - a > SRT_LINE_CHARS:
        cut = text.rfind(" ", a, a + SRT_LINE_CHARS + 1)
        if cut > a:
            out.append(strip(a, cut))
            a = cut + 1
        else:
            out.append(strip(a, a + SRT_LINE_CHARS))
            a += SRT_LINE_CHARS
        a = strip(a, n)[0]
    out.append(strip(a, n))
    return [(lo, hi) for lo, hi in out if hi > lo]


def _cut_spans(spans: list[tuple[str, bool]], lo: int, hi: int) -> list[tuple[str, bool]]:
    out, pos = [], 0
    for text, mark in spans:
        a, b = max(lo, pos), min(hi, pos + len(text))
        if a < b:
            out.append((text[a - pos:b - pos], mark))
        pos += len(text)
    return out


def _render_cue(cue: _Cue, fmt: str) -> str:
    lines: list[list[tuple[str, bool]]] = []
    for line in cue.lines:
        spans = _spans(line, cue.highlight)
        plain = "".join(t for t, _ in spans)
        if fmt == "srt" and len(plain) > SRT_LINE_CHARS:
            lines.extend(_cut_spans(spans, lo, hi) for lo, hi in _srt_breaks(plain))
        else:  # stripped: a piece may start or end with a no-break space, which readers strip
            lo, hi = _stripped(plain, 0, len(plain))
            if hi > lo:
                lines.append(_cut_spans(spans, lo, hi))
    pieces: list[tuple[str, bool]] = []  # (text, is markup)
    name = _cue_text(cue.speaker) if cue.speaker is not None else ""
    if name and lines:
        # vtt: a voice span (its annotation escaped like text); srt: a prefix that is text (so a "<" in the name
        # is treated as the text's are, below)
        pieces.append((f"<v {_vtt_escape(name)}>", True) if fmt == "vtt" else (f"[{name}] ", False))
    for i, spans in enumerate(lines):
        if i:
            pieces.append(("\n", True))
        for text, mark in spans:
            if fmt == "vtt":
                text = _vtt_escape(text)
            pieces.extend([("<u>", True), (text, False), ("</u>", True)] if mark else [(text, False)])
    if fmt == "srt":  # a "<" of the text opens a tag if any ">" follows it in the cue
        last = "".join(t for t, _ in pieces).rfind(">")
        out, pos = [], 0
        for text, markup in pieces:
            if not markup and pos < last:
                head = last - pos
                text = text[:head].replace("<", "\u2039") + text[head:]
            out.append(text)
            pos += len(text)
        return "".join(out)
    return "".join(t for t, _ in pieces)


def to_txt(result: Transcription) -> str:
    return _one_line(result.text) + "\n"


def to_srt(result: Transcription, cues: CueOptions | None = None) -> str:
    items = [(c, text) for c in _cues(result, cues) if (text := _render_cue(c, "srt"))]
    return "".join(f"{i}\n{timestamp(c.start)} --> {timestamp(c.end)}\n{text}\n\n"
                   for i, (c, text) in enumerate(items, 1))


def to_vtt(result: Transcription, cues: CueOptions | None = None) -> str:
    items = [(c, text) for c in _cues(result, cues) if (text := _render_cue(c, "vtt"))]
    body = "".join(f"{timestamp(c.start, '.', False)} --> {timestamp(c.end, '.', False)}\n{text}\n\n"
                   for c, text in items)
    return "WEBVTT\n\n" + body


def _diarized(result: Transcription) -> bool:
    return any(s.speaker is not None for s in result.segments)


def _tsv_speaker(who: str | None) -> str:
    return "" if who is None else _one_line(who).replace("\t", " ")


def to_tsv(result: Transcription) -> str:
    diarized = _diarized(result)
    head = "speaker\t" if diarized else ""

    def who(speaker) -> str:
        return f"{_tsv_speaker(speaker)}\t" if diarized else ""

    if not any(s.words is not None for s in result.segments):
        rows = [f"start\tend\t{head}text"]
        for s in result.segments:
            rows.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{who(s.speaker)}{_tsv_text(s.text)}")
        return "\n".join(rows) + "\n"
    rows = [f"start\tend\tsegment\tprobability\t{head}word"]
    for s in result.segments:
        if s.words is None:
            rows.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{s.id}\t\t{who(s.speaker)}"
                        f"{_tsv_text(s.text)}")
            continue
        for w in s.words:
            rows.append(f"{round(1000 * w.start)}\t{round(1000 * w.end)}\t{s.id}\t{w.probability:.3f}\t"
                        f"{who(w.speaker if w.speaker is not None else s.speaker)}{_tsv_text(w.word)}")
    return "\n".join(rows) + "\n"


def _json_speaker(who: str | None, diarized: bool) -> dict:
    return {"speaker": None if who is None else _encodable(who)} if diarized else {}


def _json_words(seg: Segment, diarized: bool = False) -> dict:
    if seg.words is None:
        return {}
    return {"words": [{"word": _encodable(w.word), "start": w.start, "end": w.end, "probability": w.probability,
                       **_json_speaker(w.speaker, diarized)}
                      for w in seg.words]}


def to_json(result: Transcription) -> str:
    diarized = _diarized(result)
    return json.dumps({
        "text": _encodable(result.text), "duration": result.duration_s, "finish_reason": result.finish_reason,
        "segments": [{"id": s.id, "start": s.start, "end": s.end, "text": _encodable(s.text), "tokens": s.token_ids,
                      "finish_reason": s.finish_reason, "compression_ratio": s.compression_ratio,
                      "avg_logprob": s.avg_logprob, **_json_speaker(s.speaker, diarized), **_json_words(s, diarized)}
                     for s in result.segments],
    }, ensure_ascii=False, indent=2) + "\n"


_WRITERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "tsv": to_tsv, "json": to_json}


def render(result: Transcription, fmt: str, cues: CueOptions | None = None) -> str:
    """The result in ``fmt`` (one of ``FORMATS``); ``cues``: how srt/vtt cues are cut (default ``CueOptions()``)."""
    if fmt not in _WRITERS:
        raise ValueError(f"unknown output format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt in ("srt", "vtt"):
        return _WRITERS[fmt](result, cues)
    return _WRITERS[fmt](result)


# ---- the OpenAI transcription API's response formats (the server's answers)
OPENAI_FORMATS = {"json": "application/json", "text": "text/plain; charset=utf-8", "srt": "application/x-subrip",
                  "vtt": "text/vtt", "verbose_json": "application/json"}


def duration_usage(seconds: float) -> dict:
    return {"type": "duration", "seconds": round(seconds, 3)}


def verbose_segment(seg) -> dict:
    """One ``glmasr.results.Segment`` as the OpenAI client's ``TranscriptionSegment``: ``seek`` is the start in
    10 ms frames, ``temperature`` 0.0 (greedy), ``no_speech_prob`` 0.0 (not computed)."""
    return {"id": seg.id, "seek": int(round(seg.start * 100)), "start": round(seg.start, 3), "end": round(seg.end, 3),
            "text": seg.text, "tokens": list(seg.token_ids), "temperature": 0.0,
            "avg_logprob": float(seg.avg_logprob),
            "compression_ratio": float(seg.compression_ratio), "no_speech_prob": 0.0}


def verbose_words(result: Transcription) -> list[dict]:
    """Every segment's words as the OpenAI client's ``TranscriptionWord``s (word, start, end; seconds rounded to
    the millisecond), in order."""
    return [{"word": _encodable(w.word), "start": round(w.start, 3), "end": round(w.end, 3)}
            for s in result.segments for w in (s.words or ())]


def render_openai(result: Transcription, response_format: str, seconds: float, language: str | None = None,
                  granularities=(), cues: CueOptions | None = None) -> tuple[str, str]:
    """(body, media type) of the OpenAI API's ``response_format``: json ``{text, usage}``, text (the transcript,
    raw), srt, vtt (this module's subtitles, ``cues``), verbose_json (duration, language, text, usage, and as
    ``granularities`` (``timestamp_granularities[]``) say: ``segments`` with "segment" or none given, ``words``
    with "word", as OpenAI answers)."""
    if response_format not in OPENAI_FORMATS:
        raise ValueError(f"unknown response_format {response_format!r}: use one of {', '.join(OPENAI_FORMATS)}")
    if response_format == "json":
        body = json.dumps({"text": result.text, "usage": duration_usage(seconds)}, ensure_ascii=False)
    elif response_format == "text":
        body = result.text
    elif response_format in ("srt", "vtt"):
        body = _WRITERS[response_format](result, cues)
    else:
        data = {"task": "transcribe", "language": language or "unknown", "duration": round(seconds, 3),
                "text": result.text}
        if not granularities or "segment" in granularities:
            data["segments"] = [verbose_segment(s) for s in result.segments]
        if "word" in granularities:
            data["words"] = verbose_words(result)
        data["usage"] = duration_usage(seconds)
        body = json.dumps(data, ensure_ascii=False)
    return body, OPENAI_FORMATS[response_format]
