"""Where the batch-1 latency goes beyond the GPU's own work: the 3.5 s / 13-token case of benchmark.sh, traced.

    python -m scripts.bench.latency_trace --out DIR     (H200; full-size random-weight checkpoint)

Writes DIR/latency_trace.json (chrome trace of 2 runs: CPU ops + CUDA kernels, graphs included) and
DIR/latency_cprofile.txt (host functions by own time over 20 runs), and prints per run: wall time, GPU busy time
(union of kernel intervals) and the largest GPU-idle gaps with the host functions running during them. Also
checks that the stage timings of the GPU path add up (audio + encoder span + decoder = total), and says so.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

import glmasr
from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint


def gpu_gaps(trace: dict, top: int = 12) -> dict:
    """GPU busy time and idle gaps between the first and last kernel of each profiled run (runs are split at
    gaps over 5 ms, the pause between runs), with the CPU ops overlapping each gap."""
    ev = trace["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                    "gpu_memset") and "dur" in e)
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "cuda_driver")
           and "dur" in e]
    runs, cur = [], [kernels[0]]
    for k in kernels[1:]:
        if k[0] - max(e for _, e in cur) > 5000:
            runs.append(cur)
            cur = []
        cur.append(k)
    runs.append(cur)
    report = []
    for r in runs:
        busy, gaps, end = 0.0, [], r[0][0]
        for s, e in r:
            if s > end:
                gaps.append((s - end, end, s))
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        span = end - r[0][0]
        gaps.sort(reverse=True)
        named = []
        for g, a, b in gaps[:top]:
            during = sorted({c["name"][:60] for c in cpu if c["ts"] < b and c["ts"] + c["dur"] > a
                             and c["dur"] < 5000}, key=len)[:8]
            named.append({"gap_us": round(g, 1), "at_us": round(a - r[0][0], 1), "host": during})
        report.append({"kernel_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
                       "gaps_over_20us": sum(1 for g in gaps if g[0] > 20), "largest_gaps": named})
    return {"runs": report}


def stage_timings_add_up(stages: list[dict]):
    """True when every run's ``timings_ms`` add up on the GPU path (audio + encoder span, features included, +
    decoder = total; 0 < features <= encoder; decoder > 0), else the first run that does not (as a string)."""
    for t in stages:
        try:
            ok = (abs(t["audio_ms"] + t["encoder_ms"] + t["decoder_ms"] - t["total_ms"]) < 1e-6 * t["total_ms"]
                  and 0 < t["features_ms"] <= t["encoder_ms"] and t["decoder_ms"] > 0)
        except (KeyError, TypeError) as e:
            return f"FAILED: {e!r} in {t}"
        if not ok:
            return f"FAILED: {t}"
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asr = glmasr.load(ensure_full_size_checkpoint(), device="cuda", dtype=torch.bfloat16, backend="triton")
    audio = (torch.randn(56000, generator=torch.Generator().manual_seed(0)) * 0.1).numpy()

    def once():
        return glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True,
                                 max_batch=1)

    for _ in range(5):
        once()
    torch.cuda.synchronize()
    walls, stages = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        r = once()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
        stages.append(r.timings_ms)
    summary = {"wall_ms_median": statistics.median(walls),
               "stages_ms_median": {k: statistics.median(s[k] for s in stages) for k in stages[0]},
               "stage_timings_add_up": stage_timings_add_up(stages)}
    print(summary, flush=True)
    print("stage timings add up:", "OK" if summary["stage_timings_add_up"] is True else summary["stage_timings_add_up"],
          flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        once()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    (out / "latency_cprofile.txt").write_text(buf.getvalue())

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as p:
        for _ in range(2):
            once()
            torch.cuda.synchronize()
            time.sleep(0.02)
    path = out / "latency_trace.json"
    p.export_chrome_trace(str(path))
    summary["gpu"] = gpu_gaps(json.loads(path.read_text()))
    (out / "latency_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["gpu"], indent=1)[:6000])


if __name__ == "__main__":
    main()
