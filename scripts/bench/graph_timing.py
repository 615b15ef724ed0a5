"""CUDA-graph timing shared by the kernel benchmarks: per-call time of small launches without launch overhead."""

from __future__ import annotations

import torch


def graph_call_us(calls: list, repeats: int, replays: int = 9, warmup_passes: int = 1) -> float:
    """Median microseconds per call: ``calls`` (closures) run ``warmup_passes`` times eagerly on a side stream
    (Triton compiles, cuBLAS picks algorithms), then captured ``repeats`` times over into one graph, replayed
    twice untimed and ``replays`` times timed with CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_passes):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for fn in calls:
                fn()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (repeats * len(calls)))
    del graph
    times.sort()
    return times[len(times) // 2]
