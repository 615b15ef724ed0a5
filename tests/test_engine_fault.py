"""Faults the engine cannot recover from, and graphs that must survive other code's use of cuBLAS.

- A device fault whose reset fails too (a sticky CUDA error, e.g. an illegal memory access) ends every request in
  hand with an ``EngineError`` at once and closes the loop: before, the engine thread died and its callers waited
  forever.
- (GPU) Our captured graphs own their cuBLAS workspace: freeing every cuBLAS workspace (what torch.compile's
  CUDA-graph trees do when they record) and reusing the freed memory leaves our replays exact. Before, the graphs
  used a workspace made outside their pool, and a replay after a compiled transformers model ran wrote to freed
  memory (an illegal address on the H200, in benchmark.sh's latency section).
"""

from __future__ import annotations

import time

import pytest
import torch

from glmasr.engine.loop import EngineLoop
from glmasr.errors import EngineClosed, EngineError

from conftest import bounded, gpu_only, noise


class _DeadDevice(Exception):
    pass


class _BrokenEngine:
    """An engine whose device breaks at the first step and cannot be reset."""

    def __init__(self):
        self.model = type("M", (), {"device": torch.device("cpu")})()
        self.requests: set[int] = set()

    def add_request(self, request_id, **kwargs):
        self.requests.add(request_id)
        return request_id

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        if len(self.requests) < 3:  # let the test's three requests all arrive first
            time.sleep(0.001)
            return []
        raise _DeadDevice("an illegal memory access was encountered")

    def reset(self):
        raise _DeadDevice("an illegal memory access was encountered (sticky)")

    def take_preempted(self):
        return []

    def abort(self, rid):
        self.requests.discard(rid)
        return True

    def set_deadline(self, *a):
        return False

    def expire(self, now=None):
        return []


def test_unrecoverable_device_fault_fails_every_request_and_closes_the_loop():
    loop = EngineLoop(_BrokenEngine(), name="broken-engine")
    streams = [loop.submit(None, prompt_embeds=[torch.randn(3, 4)], max_new_tokens=[2]) for _ in range(3)]

    def drain(stream):
        with pytest.raises(EngineError, match="device fault it could not recover from"):
            list(stream)

    for s in streams:
        bounded(lambda: drain(s), 10.0)  # before: the engine thread died and these waited forever
    deadline = time.monotonic() + 5
    while loop._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop._thread.is_alive()
    with pytest.raises(EngineClosed, match="device fault"):
        loop.submit(None, prompt_embeds=[torch.randn(3, 4)], max_new_tokens=[2])
    assert loop.num_pending == 0


@gpu_only
def test_graph_replays_survive_freed_cublas_workspaces(asr):
    import glmasr

    audio = noise(3.5, seed=71)
    kwargs = dict(model=asr, sampling_rate=16000, max_new_tokens=24, ignore_eos=True)
    first = glmasr.transcribe(audio, **kwargs)  # captures the prefill and decode graphs
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # what torch.compile's CUDA-graph trees do before they record
    torch.cuda.empty_cache()
    # take the freed memory back and fill it with garbage, so a stale workspace pointer would corrupt or fault
    junk = [torch.full((64, 1 << 20), float("nan"), device="cuda") for _ in range(8)]
    again = glmasr.transcribe(audio, **kwargs)
    torch.cuda.synchronize()
    assert again.token_ids == first.token_ids
    del junk
