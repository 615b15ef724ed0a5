"""Device side of the engine: the KV cache, the per-slot state tensors, encoder calls, prefill and the decode
steps, every CUDA graph of the model's calls, the sync-free read-back, warm-up.

The model is anything that satisfies ``models.interface.AsrModel`` (the plain ``GlmAsrModel`` or the GPU
``FastGlmAsrModel``); the runner calls only that interface.

- **Slot state** on the device: the last token, its position, an active flag, the remaining budget, ignore_eos,
  why it finished, and small output buffers of ``sync_every`` columns: the tokens and their log-probabilities.
  A decode step for the first ``b`` slots (embed, all decoder layers, lm head, greedy argmax and the chosen
  token's log-probability, eos/budget bookkeeping, append to the buffers) is one function, captured once per
  (batch bucket, KV-length bucket) and replayed; nothing in it syncs the host.
- **Prefill** of newly admitted sequences from slot 0 of each cache row: one packed pass over all of them
  (``model.prefill``: the prompts' tokens concatenated, no padding), or for a single sequence a CUDA graph per
  prompt-length bucket (``model.decode`` over the prompt right-padded to the bucket); the argmax and
  log-probability go through the same bookkeeping.
- **Encoder**: up to the largest of ``ENCODER_BUCKETS`` windows replay CUDA graphs of ``model.encode_audio`` (one
  per bucket, a count made of buckets: ``encoder_pieces``; an eager pass is ~400 launches) when the model's
  encoder runs on the Triton kernels; larger counts run eagerly.
- **Read-back**: after a round, the token buffer, the status, the stop token and the log-probabilities (float64,
  bit-cast to int64 so they travel in the same tensor) go to pinned host memory in one non-blocking copy with
  an event; ``finish_readback`` waits for that event only, so encoder work enqueued after the round keeps the
  GPU busy while the host handles the round.
- **KV capacity** grows by powers of two when a longer sequence is admitted (the cache is copied, the prefill and
  decode graphs are recaptured), so a short-audio workload does not hold 8192 positions per slot.

Graphs are on wherever CUDA is (the ``graphs`` / ``prefill_graphs`` constructor arguments turn them off for tests
that compare a graph with eager launches; they are not engine options).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time

import torch

from glmasr_kernels.greedy_commit import RUNNING, commit_tokens, greedy_pick

from . import cuda_graphs
from ..models.device import host_to_device
from ..models.interface import AsrModel
from ..models.kv_cache import KVCache
from .encode import encode_groups

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Encoder window counts replayed from CUDA graphs. A count up to the largest runs as replays of these (7 = 4 + 2 +
# 1): alone, a pass of 3 or more windows is GPU-bound and an eager one costs no more GPU time, but its ~400
# launches hold the engine thread ~15-30 ms that it needs for the step's prefill and decode launches; under live
# load (several turns per engine step) that made the steps, and so the turns per step, grow together. Above the
# largest (offline chunks of up to 32) the eager pass runs: its launches are few against its GPU time.
ENCODER_BUCKETS = (1, 2, 4, 8)
MIN_KV_BUCKET = 256
# Decode steps whose eager host time pays for capturing their bucket's graph (``ModelRunner.decode``).
CAPTURE_STEPS = 4
MIN_CAPACITY = {"cuda": 1024, "cpu": 256}


def check_batch_invariance(model: AsrModel, options) -> None:
    """ValueError when ``options.batch_invariant`` asks for what this model cannot give: on CUDA the mode needs
    the Triton decoder path (the plain path's cuBLAS GEMMs pick their algorithms by the number of rows)."""
    if options.batch_invariant and model.device.type == "cuda" and not model.triton_decoder:
        raise ValueError("batch_invariant=True needs the Triton decoder path on CUDA (backend='triton'): this "
                         "model's decoder runs on the plain PyTorch path, whose cuBLAS GEMMs pick their "
                         "algorithms by the number of rows")


def _joined(picks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probabilities) of several prefill passes, concatenated in pass order."""
    if len(picks) == 1:
        return picks[0]
    return torch.cat([p[0] for p in picks]), torch.cat([p[1] for p in picks])


def bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def kv_bucket(n: int, capacity: int) -> int:
    b = MIN_KV_BUCKET
    while b < n:
        b *= 2
    return min(b, capacity)


def encoder_pieces(windows: int, buckets: tuple[int, ...]) -> list[int]:
    """The graph buckets that together make ``windows`` (largest first, e.g. 7 -> [4, 2, 1] with buckets 1, 2,
    4, 8); [] when ``windows`` exceeds the largest bucket or no bucket can make it (then the eager pass runs)."""
    if not buckets or windows > max(buckets) or windows < 1:
        return []
    pieces, left = [], windows
    for b in sorted(buckets, reverse=True):
        while b <= left:
            pieces.append(b)
            left -= b
    return pieces if left == 0 else []


class ModelRunner:
    """Runs a loaded model (``models.interface.AsrModel``) for the engine; see the module docstring.

    ``graphs`` (every CUDA graph) and ``prefill_graphs`` (the one-prompt prefill graphs) off: the same work as
    eager launches, for tests that compare the two."""

    def __init__(self, model: AsrModel, options, frontend="torch", capacity: int | None = None, *,
                 graphs: bool = True, prefill_graphs: bool = True):
        cfg = model.cfg.text
        self.model = model
        self.cfg = model.cfg
        self.device = model.device
        self._frontend = frontend  # "torch" | "cuda", or a callable giving it on first use
        self.options = options
        self.max_batch = n = options.max_batch
        self.sync_every = options.sync_every
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < n) + (n,)
        self.use_graphs = graphs and self.device.type == "cuda"
        # Batch invariance (EngineOptions.batch_invariant): one window per encoder call, one prompt per prefill
        # pass on a path its own length chooses (``_prefill_alone``), and the model's row-count-independent
        # decode kernels, switched by the model's flag. This runner sets the flag before each of its prefills,
        # decode rounds and dry passes (another engine on the same model, e.g. a benchmark's, may have set its
        # own), so its graphs are captured in its own mode.
        self.batch_invariant = options.batch_invariant
        check_batch_invariance(model, options)
        self._use_mode()
        self.prefill_graphs = prefill_graphs and self.use_graphs
        # Encoder graphs (ENCODER_BUCKETS) where the encoder runs on the Triton kernels: an eager pass of one or
        # two windows is launch-bound (H200: 23.6 ms per window eager against 5.3 ms from the graph), and one of
        # up to 8 holds the engine thread that live steps need. They live in a pool of their own and survive the
        # KV capacity growth.
        self.encoder_buckets = ENCODER_BUCKETS if self.use_graphs and model.triton_encoder else ()
        self._encoder_graphs: dict[int, tuple] = {}
        self._encoder_pool = cuda_graphs.GraphPool()
        self.max_positions = cfg.max_position_embeddings
        start = capacity or MIN_CAPACITY["cuda" if self.device.type == "cuda" else "cpu"]
        self.capacity = min(start, self.max_positions)
        self.cache = KVCache(cfg, n, self.capacity, self.device, model.dtype)
        dev = self.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # slot of the token in ``tokens``
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)
        self.remaining = torch.zeros(n, dtype=torch.long, device=dev)
        self.ignore_eos = torch.zeros(n, dtype=torch.bool, device=dev)
        self.status = torch.zeros(n, dtype=torch.long, device=dev)
        self.stop_token = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.out = torch.full((n, self.sync_every), -1, dtype=torch.long, device=dev)
        # log-probability of each token in ``out`` (0.0 where out is -1); float64 so that the read-back can carry
        # its bits in the int64 tensor of the tokens (one copy)
        self.out_logprob = torch.zeros((n, self.sync_every), dtype=torch.float64, device=dev)
        self.step_index = torch.zeros(1, dtype=torch.long, device=dev)
        self.eos_ids = torch.tensor(sorted(set(cfg.eos_token_ids)), dtype=torch.long, device=dev)
        cuda = dev.type == "cuda"
        # flat, so the (n, 2 * steps + 2) view of a round is contiguous (a strided pinned target would be staged)
        self._host = torch.empty(n * (2 * self.sync_every + 2), dtype=torch.long, pin_memory=cuda)
        self._readback_event = torch.cuda.Event() if cuda else None
        self._readback_steps = 0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._seen_buckets: set[tuple[int, int]] = set()  # decode buckets that ran once without a graph
        self._prefill_graphs: dict[int, tuple] = {}
        # What the device side did, for breakdowns (benchmarks, /metrics): graph captures and their host ms,
        # decode rounds run eagerly (a bucket's first round), prefills by kind. Counts only; nothing syncs for it.
        self.stats: collections.Counter = collections.Counter()
        self.pool = cuda_graphs.GraphPool()  # the prefill and decode graphs (they depend on the KV buffer)
        # The Triton decoder path fuses the step's argmax and bookkeeping into one kernel (~30 launches less).
        self.fused_commit = model.triton_decoder

    @property
    def frontend(self) -> str:
        if callable(self._frontend):
            self._frontend = self._frontend()
        return self._frontend

    def _use_mode(self) -> None:
        self.model.batch_invariant = self.batch_invariant

    # ---- encoder ----
    @torch.inference_mode()
    def encode(self, plans) -> tuple[list[torch.Tensor], dict]:
        """Prompt embeddings of window groups; enqueued without a host sync. Returns them and the timing
        ({"features_s": host packing seconds, "events": (start, end) CUDA events or "encoder_s" on the CPU})."""
        t0 = time.perf_counter()
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        chunk = 1 if self.batch_invariant else self.options.encoder_chunk
        embeds, packing_s = encode_groups(self.model, self.frontend, plans, chunk, self.cfg.audio_token_id,
                                          self.cfg.audio.num_mel_bins, self.encode_audio)
        timing = {"features_s": packing_s}
        if events is not None:
            events[1].record()
            timing["events"] = events
        else:
            timing["encoder_s"] = time.perf_counter() - t0
        return embeds, timing

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """``model.encode_audio``, from CUDA graphs (``encoder_buckets``; each captured on first use) for up to
        the largest bucket's windows (``encoder_pieces``), eagerly above."""
        w = features.shape[0]
        pieces = encoder_pieces(w, self.encoder_buckets)
        if not pieces:
            return self.model.encode_audio(features)
        if len(pieces) == 1:
            return self._encode_graphed(features).clone()
        out, a = None, 0
        for n in pieces:
            piece = self._encode_graphed(features[a: a + n])
            if out is None:
                out = piece.new_empty((w, *piece.shape[1:]))
            out[a: a + n].copy_(piece)  # each piece straight from its graph's output into the whole
            a += n
        return out

    def _encode_graphed(self, features: torch.Tensor) -> torch.Tensor:
        """Replays the graph of ``features``' window count; returns its static output (the next replay
        overwrites it: copy before that)."""
        w = features.shape[0]
        entry = self._encoder_graphs.get(w)
        if entry is None:
            t0 = time.perf_counter()
            static_in = torch.zeros_like(features)
            graph, static_out = cuda_graphs.capture(lambda: self.model.encode_audio(static_in), self.device,
                                                    self._encoder_pool.handle)
            entry = self._encoder_graphs[w] = (graph, static_in, static_out)
            self.stats["encoder_captures"] += 1
            self.stats["encoder_capture_ms"] += 1e3 * (time.perf_counter() - t0)
        graph, static_in, static_out = entry
        static_in.copy_(features)
        graph.replay()
        return static_out

    # ---- KV capacity ----
    def ensure_capacity(self, need: int) -> None:
        """Grow the KV cache to hold ``need`` positions per slot (a power of two; contents kept)."""
        if need <= self.capacity:
            return
        if need > self.max_positions:
            raise ValueError(f"a sequence needs {need} positions, more than the model's {self.max_positions}")
        cap = self.capacity
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_positions)
        old = self.cache
        new = KVCache(self.cfg.text, self.max_batch, cap, self.device, self.model.dtype)
        new.k[..., : old.capacity, :].copy_(old.k)
        new.v[..., : old.capacity, :].copy_(old.v)
        self.cache, self.capacity = new, cap
        del old
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Drop the prefill and decode graphs (they read the KV buffer); the encoder graphs stay."""
        self.graphs.clear()
        self._prefill_graphs.clear()
        self.pool.reset()

    # ---- bookkeeping shared by prefill and decode ----
    def _state(self) -> dict:
        return dict(eos_ids=self.eos_ids, ignore_eos=self.ignore_eos, out=self.out, out_logprob=self.out_logprob,
                    step_index=self.step_index, remaining=self.remaining, status=self.status,
                    stop_token=self.stop_token, active=self.active, tokens=self.tokens, positions=self.positions)

    def begin_round(self) -> None:
        self.step_index.zero_()
        self.out.fill_(-1)

    def deactivate(self, slots: list[int]) -> None:
        """Stop decoding these slots (an aborted request); enqueued, no sync."""
        if slots:
            self.active.index_fill_(0, host_to_device(slots, self.device), False)

    def reset(self) -> None:
        """All slots idle (after an error)."""
        self.active.zero_()
        self.status.zero_()

    # ---- prefill ----
    @torch.inference_mode()
    def prefill(self, slots: list[int], embeds: list[torch.Tensor], budgets: list[int],
                ignore_eos: list[bool]) -> None:
        # Nothing here waits for the GPU (index lists go through pinned memory, scalars through index_fill_;
        # ``t[idx] = python_scalar`` would copy the scalar to the GPU synchronously), so on the latency path the
        # prefill and the first decode round are enqueued while the encoder still runs.
        self._use_mode()
        dev = self.device
        lengths = [int(e.shape[0]) for e in embeds]
        longest = max(lengths)
        bkt = bucket(longest, PREFILL_BUCKETS)
        if self.batch_invariant:
            first, first_logprob = _joined([self._prefill_alone(e, n, s) for e, n, s in zip(embeds, lengths, slots)])
        elif self.prefill_graphs and len(embeds) == 1 and longest <= bkt <= self.capacity:
            first, first_logprob = self._graphed_prefill(bkt, embeds[0], lengths[0], slots[0])
        else:
            self.stats["prefills_packed"] += 1
            first, first_logprob = greedy_pick(self.model.logits(self.model.prefill(embeds, self.cache, slots)))
        rows = host_to_device(slots, dev)
        lengths_t = host_to_device(lengths, dev)
        # Scatter into a full-width step result and commit only the admitted slots.
        b = max(slots) + 1
        next_tokens = torch.zeros(b, dtype=torch.long, device=dev)
        next_tokens[rows] = first
        next_logprobs = torch.zeros(b, dtype=torch.float32, device=dev)
        next_logprobs[rows] = first_logprob
        mask = torch.zeros(b, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
        self.positions[rows] = lengths_t - 1  # commit moves it to the first generated token's slot
        self.remaining[rows] = host_to_device(budgets, dev)
        for flag in (False, True):
            chosen = [s for s, f in zip(slots, ignore_eos) if f == flag]
            if chosen:
                self.ignore_eos.index_fill_(0, host_to_device(chosen, dev), flag)
        self.status.index_fill_(0, rows, RUNNING)
        self.stop_token.index_fill_(0, rows, -1)
        commit_tokens(next_tokens, next_logprobs, mask, **self._state())
        self.step_index += 1

    def _prefill_alone(self, embeds: torch.Tensor, length: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch invariance: one prompt, on a path chosen by its own length only: its bucket's graph (the KV
        capacity grown to the bucket first, normally a no-op: the capacity is a power of two >= the prompt), or
        one packed pass where there is no graph (prefill graphs off, or longer than the largest bucket)."""
        bkt = bucket(length, PREFILL_BUCKETS)
        if self.prefill_graphs and length <= bkt <= self.max_positions:
            self.ensure_capacity(bkt)
            return self._graphed_prefill(bkt, embeds, length, slot)
        self.stats["prefills_packed"] += 1
        return greedy_pick(self.model.logits(self.model.prefill([embeds], self.cache, [slot])))

    def _graphed_prefill(self, bkt: int, embeds: torch.Tensor, length: int, slot: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill one prompt, right-padded to ``bkt`` positions, from a CUDA graph; returns its first token and
        that token's log-probability.
        The padding writes KV slots [length, bkt) of the row, which decoding overwrites before it reads them."""
        entry = self._prefill_graphs.get(bkt)
        if entry is None:
            t0 = time.perf_counter()
            static = self._prefill_buffers(bkt)
            static["row"].fill_(slot)  # warm-up writes go to the row being admitted, which the replay rewrites
            graph, _ = cuda_graphs.capture(lambda: self._prefill_forward(static, bkt), self.device, self.pool.handle)
            entry = self._prefill_graphs[bkt] = (graph, static)
            self.stats["prefill_captures"] += 1
            self.stats["prefill_capture_ms"] += 1e3 * (time.perf_counter() - t0)
        self.stats["prefills_graphed"] += 1
        graph, static = entry
        static["embeds"][0, :length] = embeds[:length]
        static["embeds"][0, length:].zero_()
        static["last"].fill_(length - 1)
        static["row"].fill_(slot)
        graph.replay()
        return static["first"].clone(), static["first_logprob"].clone()

    def _prefill_buffers(self, bkt: int) -> dict:
        """The static tensors of a one-prompt prefill graph for ``bkt`` positions."""
        dev = self.device
        return {"embeds": torch.zeros(1, bkt, self.cfg.text.hidden_size, device=dev, dtype=self.model.dtype),
                "last": torch.zeros(1, dtype=torch.long, device=dev),
                "row": torch.zeros(1, dtype=torch.long, device=dev),
                "positions": torch.arange(bkt, device=dev)[None],
                "first": torch.zeros(1, dtype=torch.long, device=dev),
                "first_logprob": torch.zeros(1, dtype=torch.float32, device=dev)}

    def _prefill_forward(self, static: dict, bkt: int) -> None:
        """The body of a prefill graph (also the dry compile pass's prefill, so both compile the same kernels)."""
        hidden = self.model.decode(static["embeds"], static["positions"], self.cache, kv_len=bkt, rows=static["row"])
        tok, logp = greedy_pick(self.model.logits(hidden[0].index_select(0, static["last"])))
        static["first"].copy_(tok)
        static["first_logprob"].copy_(logp)

    # ---- decode ----
    def _decode_step(self, b: int, kv_len: int) -> None:
        model = self.model
        hidden = model.decode(model.embed_tokens(self.tokens[:b])[:, None], self.positions[:b, None], self.cache,
                              kv_len=kv_len)
        logits = model.logits(hidden[:, 0], upcast=not self.fused_commit)
        if self.fused_commit:
            from glmasr_kernels.greedy_commit import greedy_commit

            greedy_commit(logits, self.active[:b], **self._state())  # argmax, log-prob + bookkeeping, one launch
        else:
            commit_tokens(*greedy_pick(logits), self.active[:b], **self._state())
        self.step_index += 1

    @torch.inference_mode()
    def decode(self, b: int, top_position: int, steps: int) -> None:
        """``steps`` decode steps over slots [0, b); ``top_position`` bounds every position they reach."""
        self._use_mode()
        b = bucket(b, self.buckets)
        kv_len = kv_bucket(top_position, self.capacity)
        if not self.use_graphs:
            for _ in range(steps):
                self._decode_step(b, kv_len)
            return
        graph = self.graphs.get((b, kv_len))
        if graph is None:
            # A capture costs about CAPTURE_STEPS eager steps of host time (H200, 2026-12-01: ~98 ms per capture,
            # ~23 ms per eager step of the full-size model), so a round of at least that many steps captures its
            # bucket at once; a shorter round of a new bucket runs eagerly (the same kernels, so the same tokens)
            # and the bucket's next round captures it. warmup() captures ahead.
            if steps < CAPTURE_STEPS and (b, kv_len) not in self._seen_buckets:
                self._seen_buckets.add((b, kv_len))
                self.stats["decode_rounds_eager"] += 1
                for _ in range(steps):
                    self._decode_step(b, kv_len)
                return
            t0 = time.perf_counter()
            graph = self._capture_decode(b, kv_len)
            self.stats["decode_captures"] += 1
            self.stats["decode_capture_ms"] += 1e3 * (time.perf_counter() - t0)
        self.stats["decode_rounds_graphed"] += 1
        for _ in range(steps):
            graph.replay()

    @contextlib.contextmanager
    def _slot_state_kept(self):
        """Decode steps run inside (a capture's warm-up steps, a dry compile pass) leave the slot state as it was."""
        state = (self.tokens, self.positions, self.active, self.remaining, self.status, self.stop_token, self.out,
                 self.out_logprob, self.step_index)
        saved = [t.clone() for t in state]
        try:
            yield
        finally:
            for t, s in zip(state, saved):
                t.copy_(s)

    def _capture_decode(self, b: int, kv_len: int) -> "torch.cuda.CUDAGraph":
        # The warm-up steps really run (each writes output column 0)
        with self._slot_state_kept():
            graph, _ = cuda_graphs.capture(lambda: self._decode_step(b, kv_len), self.device, self.pool.handle,
                                           warmup=2, before_warmup=self.step_index.zero_)
        self.graphs[(b, kv_len)] = graph
        return graph

    # ---- read-back ----
    def start_readback(self, steps: int) -> None:
        """Copy the round's tokens, every slot's status/stop token and the tokens' log-probabilities to pinned
        host memory, one tensor in one copy (enqueued)."""
        state = torch.cat([self.out[:, :steps], self.status[:, None], self.stop_token[:, None],
                           self.out_logprob[:, :steps].view(torch.long)], 1)  # bit-cast, no conversion
        self._host[: state.numel()].view(state.shape).copy_(state, non_blocking=self._readback_event is not None)
        if self._readback_event is not None:
            self._readback_event.record()
        self._readback_steps = steps

    def finish_readback(self) -> tuple[int, list[list[int]], list[list[float]]]:
        """Wait for the round's copy; (steps, rows, logprobs): row s = s's tokens of the round (-1 where none),
        then status, stop token; logprobs[s][i] = the log-probability of token i of row s (0.0 where none)."""
        if self._readback_event is not None:
            self._readback_event.synchronize()
        steps = self._readback_steps
        n = self.max_batch * (2 * steps + 2)
        host = self._host[:n].view(self.max_batch, 2 * steps + 2)
        return steps, host[:, : steps + 2].tolist(), host[:, steps + 2:].view(torch.float64).tolist()

    # ---- warm-up ----
    @torch.inference_mode()
    def compile_kernels(self, batch_sizes=None, kv_lens=None, prefill_lengths=None, encoder_windows=None) -> bool:
        """Compile the Triton kernels of the paths ``warmup`` takes, all at once on a thread pool (a dry pass:
        ``compile_ahead`` turns this thread's launches into compiles); False where there is nothing to do (the
        CPU, the interpreter). The slot state the dry decode steps touch is restored. ``encoder_windows``
        default: ``encoder_buckets``."""
        from glmasr_kernels._triton_utils import compile_ahead

        if not self.use_graphs:
            return False
        self._use_mode()
        with self._slot_state_kept(), compile_ahead() as active:
            if active:
                # the model's eager pass (a graph captured here would lack the Triton kernels); an encoder on the
                # plain path (a kernel fallback) has nothing to compile
                windows = self.encoder_buckets if encoder_windows is None else encoder_windows
                for w in windows if self.model.triton_encoder else ():
                    self.model.encode_audio(torch.zeros(w, self.cfg.audio.num_mel_bins, 3000, device=self.device))
                for bkt in sorted({bucket(n, PREFILL_BUCKETS) for n in (prefill_lengths or ())}):
                    if bkt <= self.capacity:
                        self._prefill_forward(self._prefill_buffers(bkt), bkt)
                for b in sorted({bucket(n, self.buckets) for n in (batch_sizes or (1,))}):
                    for kv in sorted({kv_bucket(n, self.capacity) for n in (kv_lens or (MIN_KV_BUCKET,))}):
                        self._decode_step(b, kv)
        return active

    @torch.inference_mode()
    def warmup(self, batch_sizes=None, kv_lens=None, prefill_lengths=None, encoder_windows=None,
               compile_ahead: bool = True) -> dict:
        """Capture the encoder graphs for ``encoder_windows`` (default: ``encoder_buckets``; another count runs
        its eager pass once), the decode graphs for ``batch_sizes`` x ``kv_lens`` buckets and the prefill graphs
        for ``prefill_lengths`` buckets now, so no request pays for it; ms per stage. ``compile_ahead``: their kernels compiled first, all at once (``compile_kernels``): it
        pays where many buckets meet cold caches (a full warm-up), not for the few kernels of one clip's path,
        where the dry pass costs more than it saves (notes/measurements.md). Needs an idle engine (it writes
        slot 0's cache row)."""
        timings = {}
        if not self.use_graphs:
            return timings
        self._use_mode()
        if compile_ahead:
            t0 = time.perf_counter()
            self.compile_kernels(batch_sizes, kv_lens, prefill_lengths, encoder_windows)
            torch.cuda.synchronize(self.device)
            timings["kernel_compiles_ms"] = 1e3 * (time.perf_counter() - t0)
        for stage in ("encoder_graphs", "prefill_graphs", "decode_graphs"):
            timings[f"{stage}_ms"] = 0.0
        for stage, unit in self.warmup_units(batch_sizes, kv_lens, prefill_lengths, encoder_windows):
            t0 = time.perf_counter()
            unit()
            torch.cuda.synchronize(self.device)
            timings[f"{stage}_ms"] += 1e3 * (time.perf_counter() - t0)
        return timings

    def warmup_units(self, batch_sizes=None, kv_lens=None, prefill_lengths=None, encoder_windows=None
                     ) -> list[tuple[str, functools.partial]]:
        """``warmup``'s captures as (stage, unit) pairs in its order, each unit one graph (or an encoder bucket's
        eager pass), skipping at run time what exists by then: the engine loop runs them one at a time while it
        is idle (``EngineLoop.run_when_idle``), so a request waits for at most one capture. Each unit needs an
        idle engine (it writes slot 0's cache row); none where graphs are off."""
        if not self.use_graphs:
            return []
        units = []
        for w in self.encoder_buckets if encoder_windows is None else encoder_windows:
            units.append(("encoder_graphs", functools.partial(self._warm_encoder, w)))
        for bkt in sorted({bucket(n, PREFILL_BUCKETS) for n in (prefill_lengths or ())}):
            units.append(("prefill_graphs", functools.partial(self._warm_prefill, bkt)))
        for b in sorted({bucket(n, self.buckets) for n in (batch_sizes or (1,))}):
            for kv in sorted({kv_bucket(n, self.capacity) for n in (kv_lens or (MIN_KV_BUCKET,))}):
                units.append(("decode_graphs", functools.partial(self._warm_decode, b, kv)))
        return units

    @torch.inference_mode()
    def _warm_encoder(self, windows: int) -> None:
        self._use_mode()
        # features need not be real: only the kernels and graphs are wanted here
        self.encode_audio(torch.zeros(windows, self.cfg.audio.num_mel_bins, 3000, device=self.device))

    @torch.inference_mode()
    def _warm_prefill(self, bkt: int) -> None:
        if bkt <= self.capacity and self.prefill_graphs and bkt not in self._prefill_graphs:
            self._use_mode()
            # writes only slot 0's cache row and the graph's own buffers, no slot state
            dummy = torch.zeros(1, self.cfg.text.hidden_size, device=self.device, dtype=self.model.dtype)
            self._graphed_prefill(bkt, dummy.expand(bkt, -1), bkt, 0)

    @torch.inference_mode()
    def _warm_decode(self, b: int, kv: int) -> None:
        # the capacity may have changed since the plan was made (a long request grew the cache): a bucket past
        # it is not needed, one below it is captured for the cache of now
        if kv <= self.capacity and (b, kv) not in self.graphs:
            self._use_mode()
            self._capture_decode(b, kv)
