"""From one request's engine outputs to text: streamed deltas as tokens arrive, then the ``Transcription``.

An audio's groups decode at the same time in different slots, but its text is their texts in order, each
stripped, joined with a space. So a group's text is streamed once every group before it has finished (until
then it is detokenized and held back); leading whitespace of a group and trailing whitespace not yet followed
by more text are held back too. The final text is decoded once, exactly, from all tokens; the deltas add up
to it (the last delta carries whatever the incremental detokenizer had not emitted yet).

A group planned with a forced answer start (``GroupPlan.prefix_ids``, from ``DecodeOptions.forced_prefix_ids``)
starts from those tokens: its text and ``token_ids`` include them (text = decode(prefix + generated).strip()), and
its streamed text begins with theirs (out with the request's first delta).

Each group's token log-probabilities (``SequenceOutput.logprobs``, one per generated token) are summed as they
arrive; its segment's ``avg_logprob`` is their mean over the generated tokens (a forced prefix has none). The
stop token (the eos id that ended the group) is the one token left out: it is neither in ``token_ids`` nor in the
text. A group with no generated token gets 0.0.
"""

from __future__ import annotations

import time
import zlib

from .results import Segment, Transcription, TranscriptDelta
from .checkpoint.tokenizer import IncrementalDetokenizer


def compression_ratio(text: str) -> float:
    """UTF-8 bytes over zlib-compressed bytes: ~1-2 for ordinary text, well above 2.4 for text stuck in a loop
    (the measure whisper users filter on). 0 for empty text."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class _GroupText:
    def __init__(self, prompts, prefix_ids=()):
        self.detok = IncrementalDetokenizer(prompts)
        self.finish_reason: str | None = None
        self.started = False  # some non-space text of this group was released
        self.joined = False  # its first piece went out (after a space, if text came before it)
        self.held_space = ""
        self.pending: list[str] = []  # released text not yet emitted (an earlier group is unfinished)
        self.logprob_sum = 0.0  # of its tokens' log-probabilities
        self.logprob_count = 0
        if prefix_ids:  # the forced answer start: its text goes out first
            self.release(self.detok.push(list(prefix_ids)))

    @property
    def avg_logprob(self) -> float:
        return self.logprob_sum / self.logprob_count if self.logprob_count else 0.0

    def release(self, piece: str) -> None:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return
        piece = self.held_space + piece
        body = piece.rstrip()
        self.held_space = piece[len(body):]
        if body:
            self.started = True
            self.pending.append(body)


class TranscriptAssembler:
    """Consumes ``SequenceOutput``s of one request (``feed``) and produces ``TranscriptDelta``s."""

    def __init__(self, prompts, plans, duration_s: float, num_windows: int, index: int = 0,
                 t_start: float | None = None, audio_ms: float = 0.0, missing_s: float = 0.0):
        self.prompts = prompts
        self.plans = plans
        self.duration_s = duration_s
        self.num_windows = num_windows
        self.index = index
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.audio_ms = audio_ms
        self.missing_s = missing_s
        self.groups = [_GroupText(prompts, p.prefix_ids) for p in plans]
        self._current = 0  # first unfinished group: its text may be emitted as it comes
        self._emitted: list[str] = []
        self.result: Transcription | None = None

    def feed(self, out, stream: bool = True) -> list[TranscriptDelta]:
        """Take one output; with ``stream=False`` only collect its tokens (the text is decoded once at the end,
        and the only delta is the last one, with the whole text)."""
        if not self.groups:  # nothing was decoded (no speech): the one output ends it
            return [self._finish("", out.timing or {})]
        g = self.groups[out.index]
        if out.tokens:
            if stream:
                g.release(g.detok.push(out.tokens))
            else:
                g.detok.ids += out.tokens
            g.logprob_sum += sum(out.logprobs)
            g.logprob_count += len(out.logprobs)
        if out.finish_reason is not None:
            g.finish_reason = out.finish_reason
        text = self._drain() if stream else ""
        if out.request_finished:
            return [self._finish(text, out.timing or {})]
        return [TranscriptDelta(self.index, text)] if text else []

    def _drain(self) -> str:
        parts = []
        while self._current < len(self.groups):
            g = self.groups[self._current]
            if g.pending:
                if not g.joined and (self._emitted or parts):
                    parts.append(" ")
                g.joined = True
                parts += g.pending
                g.pending = []
            if g.finish_reason is None:
                break
            self._current += 1
        text = "".join(parts)
        if text:
            self._emitted.append(text)
        return text

    def _finish(self, last: str, engine_timing: dict) -> TranscriptDelta:
        texts = [self.prompts.decode(g.detok.ids).strip() for g in self.groups]
        segments = [Segment(i, p.start_s, p.start_s + p.seconds, t, list(g.detok.ids), g.finish_reason or "stop",
                            compression_ratio(t), g.avg_logprob)
                    for i, (p, g, t) in enumerate(zip(self.plans, self.groups, texts))]
        text = " ".join(t for t in texts if t)
        emitted = "".join(self._emitted)
        tail = text[len(emitted):] if text.startswith(emitted) else ""  # rare revision: the result is exact
        total_ms = 1e3 * (time.perf_counter() - self.t_start)
        timings = {"audio_ms": self.audio_ms, "features_ms": engine_timing.get("features_ms", 0.0),
                   "encoder_ms": engine_timing.get("encoder_ms", 0.0)}
        for key in ("queue_ms", "admit_ms", "engine_ms"):
            if key in engine_timing:
                timings[key] = engine_timing[key]
        timings["decoder_ms"] = total_ms - timings["audio_ms"] - timings["encoder_ms"]
        timings["total_ms"] = total_ms
        self.result = Transcription(
            text=text, token_ids=[t for g in self.groups for t in g.detok.ids],
            finish_reason=next((r for r in ("repetition", "length") if any(g.finish_reason == r for g in self.groups)),
                               "stop"),
            duration_s=self.duration_s, num_windows=self.num_windows,
            num_audio_tokens=sum(p.audio_tokens for p in self.plans), num_groups=len(self.plans), timings_ms=timings,
            segments=segments, truncated=self.missing_s > 0, missing_s=self.missing_s)
        return TranscriptDelta(self.index, last + tail, True, self.result)
