"""One way to capture a CUDA graph, shared by the encoder graphs (models/fast.py) and the engine's prefill and
decode-step graphs (engine/model_runner.py).

``capture(fn, device, pool)`` runs ``fn`` ``warmup`` times on a side stream first (Triton compiles, cuBLAS and
SDPA pick their kernels, the caching allocator sees the sizes), makes the current stream wait for it, then
captures one call into a graph that allocates from ``pool``; it returns the graph and what the captured call
returned (static tensors that each replay rewrites). The warm-up calls really run: ``fn`` must be safe to run
on the state it finds (callers save and restore state they care about; ``before_warmup`` runs eagerly before
each warm-up call and is not captured).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], device: torch.device, pool=None, warmup: int = 1,
            before_warmup: Callable[[], Any] | None = None) -> tuple["torch.cuda.CUDAGraph", Any]:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            if before_warmup is not None:
                before_warmup()
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (callers loading audio or another model, a server's threads)
    # neither fail nor invalidate a capture on the engine's thread
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


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
