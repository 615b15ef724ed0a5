"""Host side of the engine: requests, their sequences, the queue, the slots, budgets, admission and abort.

A request is one audio; its sequences are its window groups (prompts), each decoded in one slot (a KV-cache
row). A sequence moves WAITING (its windows need encoding) -> READY (prompt embeddings on the device) ->
RUNNING (in a slot) -> finished. Both queues are ordered by (priority, arrival): a request's ``priority``
(``request.Priority``, a LOWER value first; any int) and then the order requests were added, so encoding and
admission serve the best class first and each class first come, first served. Per step the scheduler picks

- the preemptions (``preempt``): while sequences of a class better than ``Priority.DRAFT`` wait (for the encoder
  or for a slot) and outnumber the free slots, the newest running request of priority >= DRAFT is dropped
  (every sequence of it, its slots freed); the caller ends it with ``errors.RequestPreempted``. Drafts never
  delay a better request by more than the round in flight;
- the encoder work: waiting sequences in queue order, at most ``encoder_chunk`` windows (at least one
  sequence; a multiple of it when that many slots are free), and only as many as the free slots will take (less
  the ready sequences that go first), so encoder output never piles up: memory is bounded by the slots and the
  chunk, not by the length of the audio. The queue's order is never skipped: a waiting draft is not encoded while
  a better sequence still waits;
- the admissions: ready sequences in queue order into free slots, at most ``max_prefill_tokens`` prompt positions
  together;
- the decode round: how many steps until the next read-back (at most ``sync_every``, never past every running
  budget) over the first ``b`` slots, from its mirror of each slot's position and remaining budget, so the host
  never reads the GPU to plan.

A request may carry a ``deadline`` (a ``time.monotonic()`` instant): ``expired(now)`` names the requests past
theirs, waiting or running, and the engine aborts them between rounds like any abort.
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections import deque

from .request import Priority, RequestState, Sequence


class SequenceQueue:
    """Sequences in (priority, arrival, index) order: one deque per priority value present (a handful), each in
    arrival order, so adding a newcomer and taking the first are O(number of classes)."""

    def __init__(self):
        self._classes: dict[int, deque[Sequence]] = {}
        self._keys: list[int] = []  # the priorities present, ascending

    def append(self, s: Sequence) -> None:
        q = self._classes.get(s.priority)
        if q is None:
            q = self._classes[s.priority] = deque()
            insort(self._keys, s.priority)
        i = len(q)  # a newcomer goes last; one added earlier but encoded later goes back to its arrival place
        while i and (q[i - 1].arrival, q[i - 1].index) > (s.arrival, s.index):
            i -= 1
        q.insert(i, s)

    def first(self) -> Sequence | None:
        return self._classes[self._keys[0]][0] if self._keys else None

    def popleft(self) -> Sequence:
        p = self._keys[0]
        q = self._classes[p]
        s = q.popleft()
        if not q:
            del self._classes[p]
            self._keys.pop(0)
        return s

    def remove_request(self, request_id: int) -> None:
        for p in list(self._keys):
            q = self._classes[p]
            if any(s.request_id == request_id for s in q):
                q = self._classes[p] = deque(s for s in q if s.request_id != request_id)
                if not q:
                    del self._classes[p]
                    self._keys.remove(p)

    def count_better_than(self, priority: int) -> int:
        """Sequences of a priority lower (better) than ``priority``."""
        return sum(len(self._classes[p]) for p in self._keys if p < priority)

    def count_at_most(self, priority: int) -> int:
        """Sequences of a priority at most ``priority`` (they go before a sequence of that priority)."""
        return sum(len(self._classes[p]) for p in self._keys if p <= priority)

    def clear(self) -> None:
        self._classes.clear()
        self._keys.clear()

    def __iter__(self):
        for p in self._keys:
            yield from self._classes[p]

    def __len__(self) -> int:
        return sum(len(q) for q in self._classes.values())

    def __bool__(self) -> bool:
        return bool(self._keys)


class Scheduler:
    def __init__(self, max_batch: int, encoder_chunk: int, max_prefill_tokens: int, sync_every: int):
        self.max_batch = max_batch
        self.encoder_chunk = encoder_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.sync_every = sync_every
        self.requests: dict[int, RequestState] = {}  # in arrival order
        self.waiting = SequenceQueue()
        self.ready = SequenceQueue()
        self.slots: list[Sequence | None] = [None] * max_batch
        self._arrivals = itertools.count()

    # ---- requests ----
    def add(self, request: RequestState) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        self.requests[request.request_id] = request
        arrival = next(self._arrivals)
        for s in request.sequences:
            s.priority, s.arrival = request.priority, arrival
            (self.ready if s.prompt_embeds is not None else self.waiting).append(s)

    def abort(self, request_id: int) -> list[int]:
        """Forget a request; returns the slots it held (the device must stop decoding them)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.waiting.remove_request(request_id)
        self.ready.remove_request(request_id)
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

    def preempt(self) -> list[tuple[RequestState, list[int]]]:
        """Drop running preemptible requests (priority >= ``Priority.DRAFT``), newest first, while the sequences of
        a better class that wait for a slot (waiting or ready) outnumber the free slots. Returns each dropped
        request with the slots it held (the device must stop decoding them); the caller tells its owner."""
        need = self.waiting.count_better_than(Priority.DRAFT) + self.ready.count_better_than(Priority.DRAFT)
        if not need:
            return []
        free = len(self.free_slots())
        if need <= free:
            return []
        victims = [r for r in reversed(self.requests.values()) if r.priority >= Priority.DRAFT and r.running]
        out = []
        for req in victims:
            if need <= free:
                break
            slots = self.abort(req.request_id)
            free += len(slots)
            out.append((req, slots))
        return out

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
        head = self.waiting.first()
        if head is None:
            return []
        free = len(self.free_slots())
        # A sequence's room: the free slots less the ready sequences admitted before it (its class or a better one)
        # and those chosen before it here.
        room = free - self.ready.count_at_most(head.priority)
        # One encoder chunk per step; more when many slots are free (a batch starting up: the first step then
        # fills every slot, as encoding everything first did, instead of ramping up 32 slots per round).
        limit = self.encoder_chunk * max(1, room // self.encoder_chunk)
        chosen, windows = [], 0
        while self.waiting:
            s = self.waiting.first()
            if len(chosen) + self.ready.count_at_most(s.priority) >= free:
                break
            if chosen and windows + s.num_windows > limit:
                break
            chosen.append(self.waiting.popleft())
            windows += s.num_windows
        return chosen

    def mark_ready(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.plan = None  # its samples are no longer needed
            self.ready.append(s)

    def next_admit(self) -> list[Sequence]:
        free = self.free_slots()
        admitted, tokens = [], 0
        while free and self.ready:
            s = self.ready.first()
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
