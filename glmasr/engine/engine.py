"""The engine: a request lifecycle over continuous batching with CUDA-graph decode and on-device stopping.

    engine = Engine(model, frontend="cuda", max_batch=64)
    rid = engine.add_request(plans)          # window groups of one audio (pipeline.plan_audio)
    while engine.has_unfinished():
        for out in engine.step():            # one scheduling round
            ...                              # SequenceOutput: new tokens of one group, finish reason
    engine.abort(rid)                        # frees its slots at the next step
    for rid, timeout_s, stage in engine.expire(time.monotonic()): ...   # between steps: abort the late ones
    for rid, priority in engine.take_preempted(): ...   # drafts a step dropped for a better request

A step (0) preempts: running requests of priority >= ``Priority.DRAFT`` are dropped, newest first, while better
sequences wait for more slots than are free (``Scheduler.preempt``; the caller learns of them from
``take_preempted`` and ends them with ``errors.RequestPreempted``), (1) enqueues encoder work for sequences the
free slots will take (``Scheduler.next_encode``), (2) waits for the previous round's read-back and turns it into
outputs, freeing finished slots, (3) prefills ready sequences into free slots and enqueues the next decode round
(up to ``sync_every`` steps), then returns the outputs: the GPU works on the next round, and on the encoder chunk
before it, while the caller handles these.
So a short request that arrives while a long one decodes is encoded between two rounds and decodes with it.
Encoding and admission go by (priority, arrival): a request's ``priority`` (``request.Priority``; lower first).

The engine is not thread-safe: one thread steps it (``engine.loop.EngineLoop`` for many callers). Its greedy
tokens equal ``engine.generate.greedy_generate`` (the plain reference loop) token for token.
"""

from __future__ import annotations

import itertools
import time

import torch

from glmasr_kernels.greedy_commit import RUNNING, STOPPED

from .options import EngineOptions
from .repetition import check_repetition_stop, is_stuck
from .model_runner import ModelRunner
from .request import GenerationRequest, GenerationResult, Priority, RequestState, Sequence, SequenceOutput
from .scheduler import Scheduler


class Engine:
    def __init__(self, model, options: EngineOptions | None = None, frontend: str = "torch", **overrides):
        opts = options or EngineOptions()
        if overrides:
            import dataclasses

            opts = dataclasses.replace(opts, **overrides)
        self.options = opts.resolved(model.device.type)
        self.model = model
        self.runner = ModelRunner(model, self.options, frontend)
        self.scheduler = Scheduler(self.options.max_batch, self.options.encoder_chunk,
                                   self.options.max_prefill_tokens, self.options.sync_every)
        self.max_positions = model.cfg.text.max_position_embeddings
        self._ids = itertools.count()
        self._in_flight = False
        self._preempted: list[tuple[int, int]] = []  # (request id, priority) dropped by steps, not yet taken

    @property
    def max_batch(self) -> int:
        return self.options.max_batch

    # ---- requests ----
    def add_request(self, plans=None, *, prompt_embeds: list[torch.Tensor] | None = None,
                    max_new_tokens: list[int] | None = None, ignore_eos: bool = False,
                    repetition_stop: int | None = None, request_id: int | None = None,
                    deadline: float | None = None, timeout_s: float | None = None,
                    priority: int = Priority.BATCH) -> int:
        """Queue one request: window groups to encode (``plans``, from ``pipeline.plan_audio``), or prompts
        already embedded (``prompt_embeds`` with their ``max_new_tokens``). Checked here, before any work.
        ``repetition_stop``: end a sequence stuck repeating an n-gram (``repetition.is_stuck``) with
        finish_reason "repetition". ``deadline``: a ``time.monotonic()`` instant after which ``expire`` drops
        it (``timeout_s``: the timeout it came from, for the caller's error). ``priority``: its class (any int,
        lower first; ``Priority``): encoding and admission go by (priority, arrival), and a running request of
        priority >= ``Priority.DRAFT`` is preempted when better ones need its slot. A plan's ``prefix_ids`` (a
        forced answer start, already in its ``prompt_ids``) count for the repetition guard."""
        rid = next(self._ids) if request_id is None else request_id
        seqs = []
        if plans is not None:
            for i, p in enumerate(plans):
                seqs.append(Sequence(rid, i, len(p.prompt_ids), p.max_new_tokens, ignore_eos, plan=p))
        else:
            if prompt_embeds is None or max_new_tokens is None or len(prompt_embeds) != len(max_new_tokens):
                raise ValueError("add_request needs plans, or prompt_embeds with one max_new_tokens each")
            for i, (e, m) in enumerate(zip(prompt_embeds, max_new_tokens)):
                seqs.append(Sequence(rid, i, int(e.shape[0]), m, ignore_eos, prompt_embeds=e))
        if not seqs:
            raise ValueError(f"request {rid} has no sequence to decode")
        check_repetition_stop(repetition_stop)
        if repetition_stop is not None:
            for s in seqs:
                s.repetition_stop, s.tokens = repetition_stop, list(s.plan.prefix_ids) if s.plan is not None else []
        for s in seqs:
            if isinstance(s.max_new_tokens, bool) or not isinstance(s.max_new_tokens, int) or s.max_new_tokens < 1:
                raise ValueError(f"request {rid}, group {s.index}: max_new_tokens must be >= 1, got {s.max_new_tokens}")
            if s.prompt_len + s.max_new_tokens > self.max_positions:
                raise ValueError(f"request {rid}, group {s.index} needs {s.prompt_len + s.max_new_tokens} positions "
                                 f"(prompt + max_new_tokens), more than the model's {self.max_positions}")
        self.scheduler.add(RequestState(rid, seqs, len(seqs), {"added": time.perf_counter(), "encodes": []},
                                        deadline=deadline, timeout_s=timeout_s, priority=priority))
        return rid

    def abort(self, request_id: int) -> bool:
        """Drop a request; its slots are free for the next admission. False if it was not in the engine."""
        known = request_id in self.scheduler.requests
        self.runner.deactivate(self.scheduler.abort(request_id))
        return known

    def set_deadline(self, request_id: int, deadline: float, timeout_s: float | None = None) -> bool:
        """Give a queued or running request a deadline (``time.monotonic()``; an earlier one it has stays).
        False if it is not in the engine (finished, aborted or unknown)."""
        return self.scheduler.set_deadline(request_id, deadline, timeout_s)

    def expire(self, now: float | None = None) -> list[tuple[int, float | None, str]]:
        """Abort every request past its deadline, waiting or running (its slots freed on the device, as
        ``abort`` does); returns (request_id, timeout_s, "queued" | "running") for each. Called between steps."""
        now = time.monotonic() if now is None else now
        out = []
        for req in self.scheduler.expired(now):
            out.append((req.request_id, req.timeout_s, "running" if req.running else "queued"))
            self.abort(req.request_id)
        return out

    def take_preempted(self) -> list[tuple[int, int]]:
        """(request id, priority) of each request the steps since the last call preempted (dropped to free its
        slots for a better class; nothing more of it comes out of ``step``). Its caller ends it with
        ``errors.RequestPreempted``; taken once."""
        out, self._preempted = self._preempted, []
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight

    def reset(self) -> list[int]:
        """Forget every request (after a device error); returns their ids."""
        self._in_flight = False
        self.runner.reset()
        return [r.request_id for r in self.scheduler.clear()]

    # ---- one round ----
    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        sched, runner = self.scheduler, self.runner
        for req, slots in sched.preempt():  # before encoding: the freed slots take the better ones this step
            runner.deactivate(slots)
            self._preempted.append((req.request_id, req.priority))
        to_encode = sched.next_encode()
        if to_encode:
            now = time.perf_counter()
            embeds, timing = runner.encode([s.plan for s in to_encode])
            for s, e in zip(to_encode, embeds):
                s.prompt_embeds = e
            for rid in {s.request_id for s in to_encode}:
                t = sched.requests[rid].timing
                t.setdefault("first_encode", now)
                t["encodes"].append(timing)
            sched.mark_ready(to_encode)
        outputs = self._collect() if self._in_flight else []
        self._launch()
        return outputs

    def _launch(self) -> None:
        sched, runner = self.scheduler, self.runner
        admitted = sched.next_admit()
        if not admitted and sched.num_running == 0:
            return
        # positions a slot may still need: up to its prompt length + budget (host_pos + host_left + 1)
        runner.ensure_capacity(max((s.host_pos + s.host_left + 1 for s in sched.slots if s is not None), default=0))
        runner.begin_round()
        steps = 0
        if admitted:
            runner.prefill([s.slot for s in admitted], [s.prompt_embeds for s in admitted],
                           [s.max_new_tokens for s in admitted], [s.ignore_eos for s in admitted])
            sched.after_prefill(admitted)
            now = time.perf_counter()
            for s in admitted:
                req = sched.requests.get(s.request_id)
                if req is not None:
                    req.timing.setdefault("prefill", now)
            steps = 1
        plan = sched.next_decode(steps)
        if plan is not None:
            b, top, n = plan
            runner.decode(b, top, n)
            steps += n
        if steps:
            runner.start_readback(steps)
            self._in_flight = True

    def _collect(self) -> list[SequenceOutput]:
        self._in_flight = False
        steps, rows, logprob_rows = self.runner.finish_readback()
        outputs = []
        for slot, (row, lp_row) in enumerate(zip(rows, logprob_rows)):
            seq = self.scheduler.slots[slot]
            if seq is None:
                continue
            new = [t for t in row[:steps] if t >= 0]
            new_lp = [lp for t, lp in zip(row[:steps], lp_row) if t >= 0]
            status, reason, stop_token = row[steps], None, None
            finished = False
            timing = None
            if status != RUNNING:
                reason = "stop" if status == STOPPED else "length"
                if reason == "stop":
                    stop_token = row[steps + 1]
            elif seq.tokens is not None:
                seq.tokens += new
                if is_stuck(seq.tokens, seq.repetition_stop):  # end it here; its slot stops decoding at once
                    reason = "repetition"
                    self.runner.deactivate([slot])
            if reason is not None:
                req = self.scheduler.requests.get(seq.request_id)
                finished = self.scheduler.finish(seq)
                if finished:
                    req.timing["finished"] = time.perf_counter()
                    timing = _request_timing(req.timing)
            if new or reason is not None:
                outputs.append(SequenceOutput(seq.request_id, seq.index, new, reason, stop_token, finished, timing,
                                              new_lp))
        return outputs

    # ---- conveniences ----
    def warmup(self, **kwargs) -> dict:
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        return self.runner.warmup(**kwargs)

    def warmup_units(self, **kwargs) -> list:
        """``warmup``'s captures one unit at a time (``ModelRunner.warmup_units``), for ``EngineLoop.run_when_idle``."""
        return self.runner.warmup_units(**kwargs)

    def generate(self, requests: list[GenerationRequest], ignore_eos: bool = False) -> list[GenerationResult]:
        """Decode prompts that are already embedded, all at once (each request is one sequence)."""
        ids = [self.add_request(prompt_embeds=[r.prompt_embeds], max_new_tokens=[r.max_new_tokens],
                                ignore_eos=ignore_eos) for r in requests]
        tokens = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        results = {}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.tokens
                logprobs[out.request_id] += out.logprobs
                if out.finish_reason is not None:
                    results[out.request_id] = GenerationResult(tokens[out.request_id], out.finish_reason,
                                                               out.stop_token_id, logprobs[out.request_id])
        return [results[rid] for rid in ids]


def _request_timing(t: dict) -> dict:
    """Engine-side timings of a finished request (ms): queue (added -> first encoder work), encoder (GPU spans
    of its encoder calls, or their wall time on the CPU), features (host packing, part of encoder), admit (added ->
    its first prefill launched), engine (added -> its end read back). The host's clock: a prefill is launched, not
    yet run, at its mark."""
    encoder_ms = 0.0
    features_s = 0.0
    for e in t["encodes"]:
        features_s += e["features_s"]
        if "events" in e:
            encoder_ms += e["events"][0].elapsed_time(e["events"][1])  # complete: tokens were read back after them
        else:
            encoder_ms += 1e3 * e["encoder_s"]
    out = {"encoder_ms": encoder_ms, "features_ms": 1e3 * features_s}
    if "first_encode" in t:
        out["queue_ms"] = 1e3 * (t["first_encode"] - t["added"])
    if "prefill" in t:
        out["admit_ms"] = 1e3 * (t["prefill"] - t["added"])
    if "finished" in t:
        out["engine_ms"] = 1e3 * (t["finished"] - t["added"])
    return out
