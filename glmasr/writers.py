"""Result writers: one ``Transcription`` as txt, srt, vtt, tsv or json text (the CLI and the server use these).

- txt: the transcript, one line.
- srt: numbered cues from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` (hours always), the text, a blank line after each.
- vtt: ``WEBVTT``, a blank line, then cues ``[HH:]MM:SS.mmm --> [HH:]MM:SS.mmm`` (hours only when non-zero).
- tsv: a header ``start	end	text``, then one line per segment, times in integer milliseconds.
- json: the text, duration, finish reason and the segments (id, start, end, text, tokens, finish_reason,
  compression_ratio, avg_logprob: the mean log-probability of the segment's tokens, ``Segment.avg_logprob``).

Times are rounded to the millisecond. Segment times are what the result has: today one segment per prompt (window
group), so cues span whole 30 s windows.

Text, so that third-party readers (players, ffmpeg, subtitle and TSV libraries) give back what we meant:

- every format: a lone surrogate (U+D800..U+DFFF, not encodable as UTF-8) becomes U+FFFD. json writes the texts
  otherwise as they are (it escapes control characters itself).
- txt, srt, vtt and tsv make each text one line: line breaks (CR, LF, CRLF, and the others ``str.splitlines``
  breaks at: VT, FF, FS, GS, RS, NEL, U+2028, U+2029) cut it into pieces; control characters (C0 other than tab,
  DEL, C1) and Unicode noncharacters (U+FDD0..U+FDEF, the last two code points of every plane) are removed; each
  piece is stripped (``str.strip``) and the non-empty ones are joined by one space. So no cue holds an empty line
  (which ends the cue), a NUL (after which ffmpeg dropped every later cue), a U+FFFE (ffmpeg drops the cue) or a
  bare CR. The text's own line breaks are not kept: a segment of speech has no line structure, and readers
  disagree on them (pysubs2 drops a cue's last line when it is a bare number, taking it for the next cue's).
- srt and vtt: ``-->`` becomes ``->`` until none is left (so does any run of two or more hyphens before ``>``): it
  would end the timing line of a cue. A segment whose text is then empty gets no cue. Tabs stay.
- vtt: ``&``, ``<`` and ``>`` are written ``&amp;``, ``&lt;`` and ``&gt;``: WebVTT readers decode these, and no text
  reads as a tag. A cue is one line (ffmpeg reads long vtt lines whole).
- srt has no escapes, and its readers (ffmpeg, players, pysubs2) take ``<...>`` for a formatting tag and drop it: a
  ``<`` with a ``>`` after it in the cue becomes ``‹`` (U+2039); other ``<`` stay. A cue longer than
  ``SRT_LINE_CHARS`` (1000) characters is broken into lines: at the last space within the first 1000 characters
  (the space goes), after the 1000th where there is none, then the same on the rest; each line is stripped, empty
  ones dropped. ffmpeg (so mpv and other players built on it) cuts an srt line at 4095 bytes and drops the whole
  cue when the cut splits a UTF-8 character, and a segment holds up to 21 windows (630 s) of speech.
- left as they are in srt and vtt, as neither format can escape them, and read otherwise by some readers:
  backslashes and braces (ffmpeg and libass players read the text as ASS: ``\\N`` or ``\\n`` as a line break,
  ``{...}`` as an override block); two timestamps in one line (pysubs2 takes it for a timing line: srt.parse,
  webvtt-py and ffmpeg do not); the last line of a broken srt cue when it is a bare number (pysubs2 drops it).
- tsv: tabs become spaces (the text is the last column, so it holds no tab or line break), and a text that starts
  with ``"`` gets one space in front: readers that take a leading quote for CSV quoting (Python's ``csv`` and
  pandas with their defaults, spreadsheets) would otherwise join the following rows into that field. No other
  quoting: read it as plain TSV (``csv.reader(f, delimiter="\\t")``, with or without ``quoting=csv.QUOTE_NONE``).
  A segment with empty text keeps its row.
"""

from __future__ import annotations

import json
import re

from .results import Transcription

FORMATS = ("txt", "srt", "vtt", "tsv", "json")
# longest srt cue line, in characters: at most 4000 bytes as UTF-8, under the 4095 at which ffmpeg cuts
SRT_LINE_CHARS = 1000


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


def _encodable(text: str) -> str:
    return _SURROGATES.sub("\ufffd", text)


def _one_line(text: str) -> str:
    """``text`` as one line: no line break, no control character, no surrounding whitespace (module docstring)."""
    pieces = (_REMOVED.sub("", piece).strip() for piece in _LINE_BREAKS.split(_encodable(text)))
    return " ".join(piece for piece in pieces if piece)


def _cue_text(text: str) -> str:
    return _ARROW.sub("->", _one_line(text))


def _srt_text(text: str) -> str:
    cue = _cue_text(text)
    last = cue.rfind(">")
    if last > 0:  # only a "<" with a ">" after it can open a tag
        cue = cue[:last].replace("<", "\u2039") + cue[last:]
    lines = []
    while len(cue) > SRT_LINE_CHARS:
        cut = cue.rfind(" ", 0, SRT_LINE_CHARS + 1)
        head, cue = (cue[:cut], cue[cut + 1:]) if cut > 0 else (cue[:SRT_LINE_CHARS], cue[SRT_LINE_CHARS:])
        lines.append(head.strip())
        cue = cue.strip()
    lines.append(cue)
    return "\n".join(line for line in lines if line)


def _vtt_text(text: str) -> str:
    return _cue_text(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _tsv_text(text: str) -> str:
    line = _one_line(text).replace("\t", " ")
    return " " + line if line.startswith('"') else line


def to_txt(result: Transcription) -> str:
    return _one_line(result.text) + "\n"


def to_srt(result: Transcription) -> str:
    cues = [(s, text) for s in result.segments if (text := _srt_text(s.text))]
    return "".join(f"{i}\n{timestamp(s.start)} --> {timestamp(s.end)}\n{text}\n\n"
                   for i, (s, text) in enumerate(cues, 1))


def to_vtt(result: Transcription) -> str:
    cues = [(s, text) for s in result.segments if (text := _vtt_text(s.text))]
    body = "".join(f"{timestamp(s.start, '.', False)} --> {timestamp(s.end, '.', False)}\n{text}\n\n"
                   for s, text in cues)
    return "WEBVTT\n\n" + body


def to_tsv(result: Transcription) -> str:
    rows = ["start\tend\ttext"]
    for s in result.segments:
        rows.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{_tsv_text(s.text)}")
    return "\n".join(rows) + "\n"


def to_json(result: Transcription) -> str:
    return json.dumps({
        "text": _encodable(result.text), "duration": result.duration_s, "finish_reason": result.finish_reason,
        "segments": [{"id": s.id, "start": s.start, "end": s.end, "text": _encodable(s.text), "tokens": s.token_ids,
                      "finish_reason": s.finish_reason, "compression_ratio": s.compression_ratio,
                      "avg_logprob": s.avg_logprob}
                     for s in result.segments],
    }, ensure_ascii=False, indent=2) + "\n"


_WRITERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "tsv": to_tsv, "json": to_json}


def render(result: Transcription, fmt: str) -> str:
    """The result in ``fmt`` (one of ``FORMATS``)."""
    if fmt not in _WRITERS:
        raise ValueError(f"unknown output format {fmt!r}: use one of {', '.join(FORMATS)}")
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


def render_openai(result: Transcription, response_format: str, seconds: float, language: str | None = None
                  ) -> tuple[str, str]:
    """(body, media type) of the OpenAI API's ``response_format``: json ``{text, usage}``, text (the transcript,
    raw), srt, vtt (this module's subtitles), verbose_json (duration, language, text, segments, usage)."""
    if response_format not in OPENAI_FORMATS:
        raise ValueError(f"unknown response_format {response_format!r}: use one of {', '.join(OPENAI_FORMATS)}")
    if response_format == "json":
        body = json.dumps({"text": result.text, "usage": duration_usage(seconds)}, ensure_ascii=False)
    elif response_format == "text":
        body = result.text
    elif response_format in ("srt", "vtt"):
        body = _WRITERS[response_format](result)
    else:
        body = json.dumps({"task": "transcribe", "language": language or "unknown", "duration": round(seconds, 3),
                           "text": result.text, "segments": [verbose_segment(s) for s in result.segments],
                           "usage": duration_usage(seconds)}, ensure_ascii=False)
    return body, OPENAI_FORMATS[response_format]
