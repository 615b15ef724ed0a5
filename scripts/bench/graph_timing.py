"""CUDA-graph timing shared by the kernel benchmarks: per-call time of small launches without launch overhead."""

from __future__ import annotations

import torch


def graph_call_us(calls: list, repeats: int, replays: int = 9, warmup_passes: int = 1) -> float:
    """Median microseconds per call: ``calls`` (closures), ``repeats`` times over, run ``warmup_passes`` times
    eagerly on a side stream (Triton compiles, cuBLAS picks algorithms), then captured into one graph
    (``glmasr.engine.cuda_graphs.capture``), replayed twice untimed and ``replays`` times timed with CUDA events."""
    from glmasr.engine.cuda_graphs import capture

    def all_calls():
        for _ in range(repeats):
            for fn in calls:
                fn()

    # the warm-up runs the whole captured sequence eagerly (on a side stream) before the capture
    graph, _ = capture(all_calls, torch.device("cuda", torch.cuda.current_device()), warmup=warmup_passes)
    torch.cuda.synchronize()
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
