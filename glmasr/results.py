"""Result types: plain dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Word:
    """One word with its times (seconds in the recording) from an aligner; probability: the aligner's mean
    posterior over the word's frames (0-1). A CJK character is a word of its own."""

    word: str
    start: float
    end: float
    probability: float = 0.0
    speaker: str | None = None  # with DecodeOptions(diarize=True): who said it ("A", "B", ... or a known name)


@dataclass
class Segment:
    """A stretch of the audio and its text. Today one per prompt (window group): consecutive 30 s windows from
    ``start`` to ``end`` seconds of the recording, so segment times are window boundaries, not speech times."""

    id: int
    start: float
    end: float
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "repetition"
    compression_ratio: float = 0.0  # text bytes / zlib-compressed bytes: high (> ~2.4) for runaway text
    # mean natural-log probability of token_ids, each under its greedy step's softmax over the whole vocabulary
    # (the stop token that ended the segment is not in token_ids and not counted); 0.0 for a segment with no token
    avg_logprob: float = 0.0
    words: list[Word] | None = None  # with DecodeOptions(word_timestamps=True): the words and their times
    speaker: str | None = None  # with DecodeOptions(diarize=True): the speaker it overlaps most


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    # "stop": an eos token ended every group; "length": a token budget ran out; "repetition": the opt-in
    # runaway guard (DecodeOptions.repetition_stop) ended a group stuck in a loop
    finish_reason: str
    duration_s: float
    num_windows: int
    num_audio_tokens: int = 0
    num_groups: int = 1
    # audio_ms (loading, caller's thread), encoder_ms (frontend + encoder + prompt embeddings; on CUDA the GPU
    # span of the encoder chunks that held this audio), features_ms (host packing, part of encoder_ms),
    # queue_ms (submitted -> first encoder work), decoder_ms (the rest), total_ms; from the engine (where it ran
    # the request): admit_ms (its arrival there -> its first prefill launched), engine_ms (-> its end read back)
    timings_ms: dict = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    # the file's header promised more audio than it held (an AudioWarning said so): how much is missing
    truncated: bool = False
    missing_s: float = 0.0


@dataclass
class TranscriptDelta:
    """A piece of streamed text: ``text`` extends the transcript of input ``index``; ``finished`` with the
    last piece, which also carries the complete ``Transcription``."""

    index: int
    text: str
    finished: bool = False
    result: Transcription | None = None
