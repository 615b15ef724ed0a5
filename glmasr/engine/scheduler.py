"""Host side of the engine: requests, their sequences, the queue, the slots, budgets, admission and abort.

A request is one audio; its sequences are its window groups (prompts), each decoded in one slot (a KV-cache
row). A sequence moves WAITING (its windows need encoding) -> READY (prompt embeddings on the device) ->
RUNNING (in a slot) -> finished. Per step the scheduler picks

- the encoder work: waiting sequences in arrival order, at most ``encoder_chunk`` windows (at least one
  sequence; a multiple of it when that many slots are free), and only as many as the free slots will take, so
  encoder output never piles up: memory is bounded by the slots and the chunk, not by the length of the audio;
- the admissions: ready sequences into free slots, at most ``max_prefill_tokens`` prompt positions together;
- the decode round: how many steps until the next read-back (at most ``sync_every``, never past every running
  budget) over the first ``b`` slots, from its mirror of each slot's position and remaining budget, so the host
  never reads the GPU to plan.

A request may carry a ``deadline`` (a ``time.monotonic()`` instant): ``expired(now)`` names the requests past
theirs, waiting or running, and the engine aborts them between rounds like any abort. ``priority`` rides along
for callers that will rank requests; admission does not look at it yet (arrival order).
"""

from __future__ import annotations

from collections import deque

from .request import RequestState, Sequence


class Scheduler:
    def __init__(self, max_batch: int, encoder_chunk: int, max_prefill_tokens: int, sync_every: int):
        self.max_batch = max_batch
        self.encoder_chunk = encoder_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.sync_every = sync_every
        self.requests: dict[int, RequestState] = {}
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * max_batch

    # ---- requests ----
    def add(self, request: RequestState) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        self.requests[request.request_id] = request
        for s in request.sequences:
            (self.ready if s.prompt_embeds is not None else self.waiting).append(s)

    def abort(self, request_id: int) -> list[int]:
        """Forget a request; returns the slots it held (the device must stop decoding them)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.ready = deque(s for s in self.ready if s.request_id != request_id)
        freed = []
        for s in req.sequences:
            s.prompt_embeds = s.plan = None
            if s.slot is not None and self.slots[s.slot] is s:
                self.slots[s.slot] = None
                freed.append(s.slot)
            s.slot = None
        return freed

    def set_deadline(self, request_id: int, deadline: float, timeout_s: float | None) -> bool:
        """Give a request a deadline (an earlier existing one stays); False if it is not here."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.deadline is None or deadline < req.deadline:
            req.deadline, req.timeout_s = deadline, timeout_s
        return True

    def expired(self, now: float) -> list[RequestState]:
        """The requests whose deadline is at or before ``now`` (still here: the caller aborts them)."""
        return [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]

    def clear(self) -> list[RequestState]:
        """Forget everything (after a device error); returns the requests that were in the engine."""
        reqs = list(self.requests.values())
        self.requests.clear()
        self.waiting.clear()
        self.ready.clear()
        self.slots = [None] * self.max_batch
        return reqs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    # ---- one step ----
    def next_encode(self) -> list[Sequence]:
        room = len(self.free_slots()) - len(self.ready)
        # One encoder chunk per step; more when many slots are free (a batch starting up: the first step then
        # fills every slot, as encoding everything first did, instead of ramping up 32 slots per round).
        limit = self.encoder_chunk * max(1, room // self.encoder_chunk)
        chosen, windows = [], 0
        while self.waiting and room > 0:
            s = self.waiting[0]
            if chosen and windows + s.num_windows > limit:
                break
            chosen.append(self.waiting.popleft())
            windows += s.num_windows
            room -= 1
        return chosen

    def mark_ready(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.plan = None  # its samples are no longer needed
            self.ready.append(s)

    def next_admit(self) -> list[Sequence]:
        free = self.free_slots()
        admitted, tokens = [], 0
        while free and self.ready:
            s = self.ready[0]
            if admitted and tokens + s.prompt_len > self.max_prefill_tokens:
                break
            self.ready.popleft()
            s.slot = free.pop(0)
            self.slots[s.slot] = s
            s.host_pos = s.prompt_len - 1
            s.host_left = s.max_new_tokens
            tokens += s.prompt_len
            admitted.append(s)
        return admitted

    def after_prefill(self, admitted: list[Sequence]) -> None:
        for s in admitted:
            s.prompt_embeds = None
            s.host_pos += 1
            s.host_left -= 1

    def next_decode(self, steps_taken: int) -> tuple[int, int, int] | None:
        """(b, highest position + 1 after the round, steps) for the round's decode steps, or None."""
        busy = [s for s in self.slots if s is not None and s.host_left > 0]
        if not busy:
            return None
        n = min(self.sync_every - steps_taken, max(s.host_left for s in busy))
        if n <= 0:
            return None
        b = max(s.slot for s in busy) + 1
        top = max(s.host_pos for s in busy) + n + 1
        for s in busy:
            s.host_pos += n
            s.host_left -= n
        return b, top, n

    def finish(self, seq: Sequence) -> bool:
        """Free a finished sequence's slot; True if that finished its request."""
        seq.finished = True
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        seq.slot = None
        req = self.requests.get(seq.request_id)
        if req is None:
            return False
        req.unfinished -= 1
        if req.unfinished == 0:
            del self.requests[seq.request_id]
            return True
        return False
