"""One way to capture a CUDA graph: the engine's runner (engine/model_runner.py) captures every graph of the
model's calls with it (encoder window buckets, one-prompt prefill buckets, decode batch x KV-length buckets).

``capture(fn, device, pool)`` runs ``fn`` ``warmup`` times on a side stream first (Triton compiles, cuBLAS and
SDPA pick their kernels, the caching allocator sees the sizes), makes the current stream wait for it, then
captures one call into a graph that allocates from ``pool``; it returns the graph and what the captured call
returned (static tensors that each replay rewrites). The warm-up calls really run: ``fn`` must be safe to run
on the state it finds (callers save and restore state they care about; ``before_warmup`` runs eagerly before
each warm-up call and is not captured). Each graph owns the cuBLAS workspace its GEMMs use (allocated in its
pool during the capture), so freeing cuBLAS workspaces elsewhere (torch.compile's CUDA-graph trees do) cannot
break a replay.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


_WARMUP_STREAMS: dict = {}  # one side stream per device for the warm-up runs


def _warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    # One per device, not one per capture: PyTorch keeps a cuBLAS workspace for every (thread, stream) pair it has
    # seen, so a new stream per capture grew the GPU memory of every load/close cycle (~97 MiB each on the H200).
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[key] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[key]


def capture(fn: Callable[[], Any], device: torch.device, pool=None, warmup: int = 1,
            before_warmup: Callable[[], Any] | None = None) -> tuple["torch.cuda.CUDAGraph", Any]:
    stream = _warmup_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            if before_warmup is not None:
                before_warmup()
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # The captured GEMMs use the cuBLAS workspace of the capture stream. One made before the capture lies outside
    # the graph's pool, and torch.compile's CUDA-graph trees free every cuBLAS workspace when they record: a replay
    # then wrote to freed memory (an illegal address after a compiled transformers model ran in the same
    # process). Dropping the workspaces first makes the capture allocate its own inside the graph's pool, which
    # lives as long as the graph; dropping them after keeps it from being handed to uncaptured work.
    _clear_cublas_workspaces()
    try:
        # thread_local: CUDA calls of other threads (callers loading audio or another model, a server's threads)
        # neither fail nor invalidate a capture on the engine's thread
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    finally:
        _clear_cublas_workspaces()
    return graph, out


def _clear_cublas_workspaces() -> None:
    torch._C._cuda_clearCublasWorkspaces()


class GraphPool:
    """A memory pool handle for a family of graphs, made on first use and dropped with them (capturing into the
    pool of graphs that were freed trips the caching allocator)."""

    def __init__(self):
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def reset(self) -> None:
        self._handle = None
