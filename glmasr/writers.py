"""Result writers: one ``Transcription`` as txt, srt, vtt, tsv or json text (the CLI and the server use these).

- txt: the transcript, one line.
- srt: numbered cues from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` (hours always), the text, a blank line after each.
- vtt: ``WEBVTT``, a blank line, then cues ``[HH:]MM:SS.mmm --> [HH:]MM:SS.mmm`` (hours only when non-zero).
- tsv: a header ``start	end	text``, then one line per segment, times in integer milliseconds.
- json: the text, duration, finish reason and the segments (id, start, end, text, tokens, finish_reason,
  compression_ratio, avg_logprob: the mean log-probability of the segment's tokens, ``Segment.avg_logprob``).

In srt and vtt a ``-->`` inside the text becomes ``->`` (it would end the timing line of a cue), and segments with
no text get no cue. Times are rounded to the millisecond. Segment times are what the result has: today one
segment per prompt (window group), so cues span whole 30 s windows.
"""

from __future__ import annotations

import json

from .results import Transcription

FORMATS = ("txt", "srt", "vtt", "tsv", "json")


def timestamp(seconds: float, decimal: str = ",", always_hours: bool = True) -> str:
    if seconds < 0:
        raise ValueError(f"a timestamp must not be negative, got {seconds}")
    ms = round(seconds * 1000.0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    head = f"{hours:02d}:" if always_hours or hours else ""
    return f"{head}{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _cue_text(text: str) -> str:
    return text.replace("-->", "->")


def to_txt(result: Transcription) -> str:
    return result.text + "\n"


def to_srt(result: Transcription) -> str:
    cues = [s for s in result.segments if s.text.strip()]
    return "".join(f"{i}\n{timestamp(s.start)} --> {timestamp(s.end)}\n{_cue_text(s.text.strip())}\n\n"
                   for i, s in enumerate(cues, 1))


def to_vtt(result: Transcription) -> str:
    cues = [s for s in result.segments if s.text.strip()]
    body = "".join(f"{timestamp(s.start, '.', False)} --> {timestamp(s.end, '.', False)}\n"
                   f"{_cue_text(s.text.strip())}\n\n" for s in cues)
    return "WEBVTT\n\n" + body


def to_tsv(result: Transcription) -> str:
    rows = ["start\tend\ttext"]
    for s in result.segments:
        text = s.text.strip().replace("\t", " ").replace("\n", " ")
        rows.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{text}")
    return "\n".join(rows) + "\n"


def to_json(result: Transcription) -> str:
    return json.dumps({
        "text": result.text, "duration": result.duration_s, "finish_reason": result.finish_reason,
        "segments": [{"id": s.id, "start": s.start, "end": s.end, "text": s.text, "tokens": s.token_ids,
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
