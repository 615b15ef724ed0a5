"""The engine's own types: what a request brings (``GroupPlan``s: one prompt each, planned above the engine by
``glmasr.pipeline``, or ``GenerationRequest``s: prompts already embedded), how the scheduler tracks it
(``RequestState`` and its ``Sequence``s: one per prompt, one cache slot each while running) and what comes out
(``SequenceOutput`` per round; ``GenerationResult`` of the reference loop). ``Priority``: the request classes the
scheduler ranks by (lower runs first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch


class Priority(IntEnum):
    """A request's class: the scheduler encodes and admits by (priority, arrival), a LOWER value first. Any int
    is accepted as a priority; these are the ones the package uses. A running request of priority >= ``DRAFT``
    is preemptible: it is aborted (``errors.RequestPreempted``) when a better one needs its slot."""

    LIVE_FINAL = 0  # a live session's committed turn: owed to the caller, latency-critical
    UPLOAD = 1  # the server's HTTP transcription requests
    BATCH = 2  # transcribe() / GlmAsr.submit / the CLI
    DRAFT = 3  # a live session's partial: optional work, preemptible


@dataclass
class GroupPlan:
    """One prompt: consecutive 30 s windows of one audio and its token budget. ``prefix_ids``: tokens forced as
    the start of the answer; they are already the last entries of ``prompt_ids`` (prefilled with the prompt), the
    budget counts only the tokens generated after them."""

    windows: list[np.ndarray] | None  # samples of each window (views); dropped once encoded
    window_tokens: list[int]  # audio tokens each window yields (0: a tail too short to encode)
    seconds: float
    max_new_tokens: int
    prompt_ids: list[int]
    start_s: float = 0.0  # where its first window starts in the recording
    prefix_ids: list[int] = field(default_factory=list)

    @property
    def audio_tokens(self) -> int:
        return sum(self.window_tokens)

    @property
    def num_windows(self) -> int:
        return len(self.window_tokens)


@dataclass
class Sequence:
    request_id: int
    index: int  # which group of its request
    prompt_len: int
    max_new_tokens: int
    ignore_eos: bool
    plan: GroupPlan | None = None  # while it waits for the encoder
    prompt_embeds: torch.Tensor | None = None  # (prompt_len, hidden) once encoded
    slot: int | None = None
    host_pos: int = 0  # position of the last token fed (mirror of the device's)
    host_left: int = 0  # budget left (mirror)
    finished: bool = False
    repetition_stop: int | None = None  # see engine/repetition.py
    tokens: list[int] | None = None  # its tokens so far (forced prefix first), kept only with the repetition guard
    priority: int = Priority.BATCH  # its request's (the queues' first key)
    arrival: int = 0  # its request's arrival number in the scheduler (the second key; then ``index``)

    @property
    def num_windows(self) -> int:
        return self.plan.num_windows if self.plan is not None else 0


@dataclass
class RequestState:
    request_id: int
    sequences: list[Sequence]
    unfinished: int
    timing: dict = field(default_factory=dict)  # filled by the engine (added, encoder events, ...)
    deadline: float | None = None  # time.monotonic() instant after which the engine aborts it
    timeout_s: float | None = None  # the timeout that deadline came from (named in the error)
    priority: int = Priority.BATCH  # lower runs first (``Priority``); >= Priority.DRAFT is preemptible

    @property
    def running(self) -> bool:
        """Some sequence of it holds a slot."""
        return any(s.slot is not None for s in self.sequences)


@dataclass
class SequenceOutput:
    """New tokens of one sequence (group ``index`` of request ``request_id``) from one round."""

    request_id: int
    index: int
    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length" once the sequence has finished
    stop_token_id: int | None = None
    request_finished: bool = False  # the last sequence of its request finished with this output
    timing: dict | None = None  # with request_finished: the request's engine-side timings (ms)
    # logprobs[i]: natural-log probability of tokens[i] under the step's softmax (fp32 over the whole vocabulary),
    # one per token; the stop token is not in tokens and has none
    logprobs: list[float] = field(default_factory=list)


@dataclass
class GenerationRequest:
    prompt_embeds: torch.Tensor  # (L, hidden)
    max_new_tokens: int


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, without the stop token
    finish_reason: str  # "stop" or "length"
    stop_token_id: int | None = None
    logprobs: list[float] = field(default_factory=list)  # log_softmax of each token_ids entry at its step
