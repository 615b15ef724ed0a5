"""The engine loop: continuous batching over fixed sequence slots, decode steps replayed as CUDA graphs.

- **Slots.** The engine owns one KV cache of (max_batch rows, capacity positions) and per-slot state on the
  device: the last token, its position, an active flag, the remaining token budget, why it finished. A request
  is prefilled into a free slot (cache row) and decoded there; when it finishes its slot is refilled from the
  queue (offline continuous batching), so one long transcript does not hold the others up.
- **Decode step.** One function does a whole step for the first ``b`` slots: embed the last tokens, all decoder
  layers, lm head, greedy argmax, and the bookkeeping (eos -> stop, budget -> length, append the token to a
  small on-device output buffer). On CUDA it is captured once per (batch bucket, KV-length bucket) and
  replayed; there is no host sync per token: the host reads the output buffer back every ``sync_every`` steps
  (and exactly when budgets run out, which the host can predict), then refills freed slots. The next round is
  enqueued before the previous round's tokens are yielded, so the consumer's work overlaps the GPU.
- **Prefill** of newly admitted requests is one batched forward pass (right-padded, each sequence from slot 0
  of its own cache row); its argmax goes through the same bookkeeping as a decode step.

The greedy tokens equal ``engine.generate.greedy_generate`` (the plain reference loop) token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .generate import GenerationRequest, GenerationResult
from .kv_cache import KVCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
MIN_KV_BUCKET = 256
RUNNING, STOPPED, LENGTH = 0, 1, 2


@dataclass
class TokenEvent:
    """New tokens of one request, and ``finish_reason`` once it has finished."""

    request: int
    tokens: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 list -> tensor on ``device``; on CUDA through pinned memory, so the copy does not sync the host
    (``torch.tensor(values, device="cuda")`` waits for the GPU to drain)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def commit_tokens(next_tokens, mask, eos_ids, ignore_eos, out, step_index, remaining, status, stop_token, active,
                  tokens, positions) -> None:
    """Per-slot bookkeeping of one greedy step for slots [0, b), b = len(next_tokens), those in ``mask``: eos
    -> STOPPED, budget exhausted -> LENGTH, the token appended to column ``step_index`` of ``out``. Plain torch
    (the reference of kernels/greedy_commit.py, which fuses it with the argmax); ``step_index`` not advanced."""
    b = next_tokens.shape[0]
    is_eos = (next_tokens[:, None] == eos_ids[None, :]).any(-1) & ~ignore_eos[:b]
    stop = mask & is_eos
    append = mask & ~is_eos
    out[:b].index_copy_(1, step_index, torch.where(append, next_tokens, -1)[:, None])
    rem = remaining[:b] - append.long()
    remaining[:b] = rem
    hit_length = append & (rem <= 0)
    status[:b] = torch.where(stop, STOPPED, torch.where(hit_length, LENGTH, status[:b]))
    stop_token[:b] = torch.where(stop, next_tokens, stop_token[:b])
    active[:b] = mask.logical_not().logical_and(active[:b]) | (append & ~hit_length)
    tokens[:b] = torch.where(append, next_tokens, tokens[:b])
    positions[:b] += append.long()


class Engine:
    """Continuous-batching greedy decoder over a loaded model (``GlmAsrModel`` or ``FastGlmAsrModel``)."""

    def __init__(self, model, max_batch: int = 64, capacity: int | None = None, use_graphs: bool | None = None,
                 sync_every: int = 8, max_prefill_tokens: int = 65536, prefill_graphs: bool = False):
        cfg = model.cfg.text
        self.model = model
        self.device = model.device
        self.capacity = min(capacity or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.sync_every = max(1, sync_every)
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = KVCache(cfg, max_batch, self.capacity, self.device, model.dtype)
        dev, n = self.device, max_batch
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # slot of the token in ``tokens``
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)
        self.remaining = torch.zeros(n, dtype=torch.long, device=dev)
        self.ignore_eos = torch.zeros(n, dtype=torch.bool, device=dev)
        self.status = torch.zeros(n, dtype=torch.long, device=dev)
        self.stop_token = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.out = torch.full((n, self.sync_every), -1, dtype=torch.long, device=dev)
        self.step_index = torch.zeros(1, dtype=torch.long, device=dev)
        self.eos_ids = torch.tensor(sorted(set(cfg.eos_token_ids)), dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        # Single-request prefill as a CUDA graph per prompt-length bucket (the latency path: an eager prefill is
        # ~300 launches from Python). glmasr.transcribe turns it on (GLMASR_PREFILL_GRAPHS=0: off); it is in
        # every measured latency, but was not timed against the eager prefill on its own.
        self.prefill_graphs = prefill_graphs and self.use_graphs
        self._prefill_graphs: dict[int, tuple] = {}
        # The Triton model path also fuses the step's argmax and bookkeeping into one kernel (~30 launches less).
        self.fused_commit = bool(getattr(model, "uses_triton", False))

    # ---- device-side bookkeeping shared by prefill and decode ----
    def _state(self) -> dict:
        return dict(eos_ids=self.eos_ids, ignore_eos=self.ignore_eos, out=self.out, step_index=self.step_index,
                    remaining=self.remaining, status=self.status, stop_token=self.stop_token, active=self.active,
                    tokens=self.tokens, positions=self.positions)

    def _commit(self, next_tokens: torch.Tensor, b: int, mask: torch.Tensor) -> None:
        """Apply the greedy step result ``next_tokens`` (b,) to slots [0, b) selected by ``mask``."""
        commit_tokens(next_tokens, mask, **self._state())
        self.step_index += 1

    def _decode_step(self, b: int, kv_len: int) -> None:
        model = self.model
        hidden = model.decode(model.embed_tokens(self.tokens[:b])[:, None], self.positions[:b, None], self.cache,
                              kv_len=kv_len)
        logits = model.logits(hidden[:, 0], upcast=not self.fused_commit)
        if self.fused_commit:
            from glmasr_kernels.greedy_commit import greedy_commit

            greedy_commit(logits, self.active[:b], **self._state())  # argmax + bookkeeping, one launch
            self.step_index += 1
        else:
            self._commit(logits.argmax(-1), b, self.active[:b])

    def _run_steps(self, b: int, kv_len: int, steps: int) -> None:
        if not self.use_graphs:
            for _ in range(steps):
                self._decode_step(b, kv_len)
            return
        key = (b, kv_len)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(b, kv_len)
        for _ in range(steps):
            graph.replay()

    def _capture(self, b: int, kv_len: int) -> "torch.cuda.CUDAGraph":
        # Warm up on a side stream (compiles Triton kernels, picks cuBLAS algorithms) with the state saved,
        # since the warm-up steps really run.
        state = (self.tokens, self.positions, self.active, self.remaining, self.status, self.stop_token, self.out,
                 self.step_index)
        saved = [t.clone() for t in state]
        self.step_index.zero_()  # the warm-up steps really run: keep their output column in range
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_step(b, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self._decode_step(b, kv_len)
        for t, s in zip(state, saved):
            t.copy_(s)
        self.graphs[(b, kv_len)] = graph
        return graph

    # ---- prefill ----
    @torch.inference_mode()
    def _prefill(self, slots: list[int], requests: list[GenerationRequest], ignore_eos: bool) -> None:
        # Nothing here waits for the GPU (index lists go through pinned memory, scalars through index_fill_;
        # ``t[idx] = python_scalar`` would copy the scalar to the GPU synchronously), so on the latency path the
        # prefill and the first decode round are enqueued while the encoder still runs.
        dev = self.device
        lengths = [int(r.prompt_embeds.shape[0]) for r in requests]
        longest = max(lengths)
        rows = host_to_device(slots, dev)
        lengths_t = host_to_device(lengths, dev)
        bucket = _bucket(longest, PREFILL_BUCKETS)
        if self.prefill_graphs and len(requests) == 1 and longest <= bucket <= self.capacity:
            first = self._graphed_prefill(bucket, requests[0].prompt_embeds, lengths[0], slots[0])
        else:
            hidden_size = requests[0].prompt_embeds.shape[1]
            embeds = torch.zeros(len(requests), longest, hidden_size, device=dev, dtype=self.model.dtype)
            for i, r in enumerate(requests):
                embeds[i, : lengths[i]] = r.prompt_embeds
            positions = torch.arange(longest, device=dev).expand(len(requests), longest)
            hidden = self.model.decode(embeds, positions, self.cache, kv_len=longest, rows=rows)
            first = self.model.logits(hidden[torch.arange(len(requests), device=dev), lengths_t - 1]).argmax(-1)
        # Scatter into a full-width step result and commit only the admitted slots.
        b = max(slots) + 1
        next_tokens = torch.zeros(b, dtype=torch.long, device=dev)
        next_tokens[rows] = first
        mask = torch.zeros(b, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
        self.positions[rows] = lengths_t - 1  # commit moves it to the first generated token's slot
        self.remaining[rows] = host_to_device([r.max_new_tokens for r in requests], dev)
        self.ignore_eos.index_fill_(0, rows, ignore_eos)
        self.status.index_fill_(0, rows, RUNNING)
        self.stop_token.index_fill_(0, rows, -1)
        self._commit(next_tokens, b, mask)

    def _graphed_prefill(self, bucket: int, embeds: torch.Tensor, length: int, slot: int) -> torch.Tensor:
        """Prefill one prompt, right-padded to ``bucket`` positions, from a CUDA graph; returns its first token.
        The padding writes KV slots [length, bucket) of the row, which decoding overwrites before it reads them."""
        entry = self._prefill_graphs.get(bucket)
        if entry is None:
            dev = self.device
            static = {"embeds": torch.zeros(1, bucket, embeds.shape[-1], device=dev, dtype=self.model.dtype),
                      "last": torch.zeros(1, dtype=torch.long, device=dev),
                      "row": torch.zeros(1, dtype=torch.long, device=dev),
                      "positions": torch.arange(bucket, device=dev)[None],
                      "first": torch.zeros(1, dtype=torch.long, device=dev)}

            def run():
                hidden = self.model.decode(static["embeds"], static["positions"], self.cache, kv_len=bucket,
                                           rows=static["row"])
                static["first"].copy_(self.model.logits(hidden[0].index_select(0, static["last"])).argmax(-1))

            static["row"].fill_(slot)  # warm-up writes go to the row being admitted, which the replay rewrites
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                run()
            entry = self._prefill_graphs[bucket] = (graph, static)
        graph, static = entry
        static["embeds"][0, :length] = embeds[:length]
        static["embeds"][0, length:].zero_()
        static["last"].fill_(length - 1)
        static["row"].fill_(slot)
        graph.replay()
        return static["first"].clone()

    # ---- the loop ----
    def run(self, requests: list[GenerationRequest] | Iterator[GenerationRequest], ignore_eos: bool = False
            ) -> Iterator[TokenEvent]:
        """Decode every request greedily; yields ``TokenEvent``s as tokens become known (every few steps).

        Rounds are pipelined: after a round's read-back the next round (refills, prefill, decode steps) is put
        on the GPU *before* the round's events are yielded, so the consumer's work (detokenizing, streaming)
        overlaps the GPU instead of leaving it idle."""
        queue = list(requests)
        for i, r in enumerate(queue):
            need = r.prompt_embeds.shape[0] + r.max_new_tokens
            if r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
            if need > self.capacity:
                raise ValueError(f"request {i} needs {need} positions (prompt + max_new_tokens), more than the "
                                 f"engine's capacity {self.capacity}")
        rounds = _Rounds(self, queue, ignore_eos)
        with torch.inference_mode():
            steps = rounds.launch()
            while steps:
                events = rounds.collect(steps)  # the one host sync of the round
                steps = rounds.launch()  # the GPU works on the next round ...
                yield from events  # ... while the consumer handles this one

    def generate(self, requests: list[GenerationRequest], ignore_eos: bool = False) -> list[GenerationResult]:
        """All results at once (``run`` yields them as they come)."""
        results: dict[int, GenerationResult] = {}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
        for ev in self.run(requests, ignore_eos=ignore_eos):
            tokens[ev.request] += ev.tokens
            if ev.finish_reason is not None:
                results[ev.request] = GenerationResult(tokens[ev.request], ev.finish_reason, ev.stop_token_id)
        return [results[i] for i in range(len(requests))]


class _Rounds:
    """Host side of ``Engine.run``: which request owns which slot, and a mirror of each slot's position bound
    and remaining budget (so the host knows, without reading the GPU, how many steps a round may take)."""

    def __init__(self, engine: Engine, queue: list[GenerationRequest], ignore_eos: bool):
        self.engine, self.queue, self.ignore_eos = engine, queue, ignore_eos
        n = engine.max_batch
        self.owner: list[int | None] = [None] * n
        self.host_pos = [0] * n
        self.host_left = [0] * n
        self.next_request = 0

    def launch(self) -> int:
        """Admit queued requests into free slots (batched prefill) and decode up to ``sync_every`` steps, all
        enqueued on the GPU without waiting for it; returns the number of steps put in the output buffer
        (0: nothing left to do)."""
        eng, queue, owner = self.engine, self.queue, self.owner
        free = [s for s in range(eng.max_batch) if owner[s] is None]
        admit_slots, admit_reqs, tokens = [], [], 0
        while free and self.next_request < len(queue):
            r = queue[self.next_request]
            if admit_reqs and tokens + r.prompt_embeds.shape[0] > eng.max_prefill_tokens:
                break
            s = free.pop(0)
            admit_slots.append(s)
            admit_reqs.append(r)
            tokens += r.prompt_embeds.shape[0]
            owner[s] = self.next_request
            self.host_pos[s] = r.prompt_embeds.shape[0] - 1
            self.host_left[s] = r.max_new_tokens
            self.next_request += 1
        if not admit_reqs and all(o is None for o in owner):
            return 0
        eng.step_index.zero_()
        eng.out.fill_(-1)
        steps = 0
        if admit_reqs:
            eng._prefill(admit_slots, admit_reqs, self.ignore_eos)
            steps = 1
            for s in admit_slots:
                self.host_pos[s] += 1
                self.host_left[s] -= 1
        busy = [s for s in range(eng.max_batch) if owner[s] is not None and self.host_left[s] > 0]
        if busy:
            # decode until the next read-back: at most sync_every in total, never past every budget
            n = min(eng.sync_every - steps, max(self.host_left[s] for s in busy))
            if n > 0:
                b = _bucket(max(busy) + 1, eng.buckets)
                kv_len = min(eng.capacity, _bucket_kv(max(self.host_pos[s] for s in busy) + n + 1, eng.capacity))
                eng._run_steps(b, kv_len, n)
                for s in busy:
                    self.host_pos[s] += n
                    self.host_left[s] -= n
                steps += n
        return steps

    def collect(self, steps: int) -> list[TokenEvent]:
        """Read the round's tokens and every slot's status back (one sync), free the finished slots and return
        the round's events."""
        eng = self.engine
        state = torch.cat([eng.out[:, :steps], eng.status[:, None], eng.stop_token[:, None]], 1).tolist()
        events = []
        for s, row in enumerate(state):
            owner = self.owner[s]
            if owner is None:
                continue
            new = [t for t in row[:steps] if t >= 0]
            status, reason, stop_token = row[steps], None, None
            if status != RUNNING:
                reason = "stop" if status == STOPPED else "length"
                if reason == "stop":
                    stop_token = row[steps + 1]
                self.owner[s] = None
            if new or reason is not None:
                events.append(TokenEvent(owner, new, reason, stop_token))
        return events


def _bucket_kv(n: int, capacity: int) -> int:
    b = MIN_KV_BUCKET
    while b < n:
        b *= 2
    return min(b, capacity)
