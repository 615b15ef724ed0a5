"""The engine alone under a live-turn arrival rate: what its rounds are made of and what a turn waits for.

    python -m scripts.bench.engine_rounds [--model FOLDER] [--rate 96] [--seconds 20] [--audio FILE]
        [--configs "encoder_chunk=32;encoder_chunk=8,max_batch=128"] [--json FILE]

``realtime_load`` measures live turns end to end through ``glmasr serve`` (front-end processes, pipes, VAD);
this takes all of that away: one process, ``glmasr.load`` with each config's engine options (fields of
``EngineOptions``), and a submitter thread that queues turns at ``--rate`` per second, evenly spaced, for
``--seconds`` (512 sessions streaming ``realtime_speech.flac``, six turns in 32 s, make ~96 per second). Each turn
is a slice of 3-6 s of ``--audio`` (default: noise; the encoder always runs the padded 30 s window, so only the
length matters) with ``ceil(3 x seconds)`` tokens forced (``ignore_eos``), as the realtime benchmark forces them.

Per config: each turn's time from submission to the engine's last output for it (p50 / p95 / p99) and its
engine stages from ``timings_ms`` (queue: added -> first encoder work; encode: -> prefill launched; decode: -> end
read back); per
engine step (``Engine.step``, wrapped here): its host wall time, the windows it encoded, the prompts it admitted,
its decode steps, and the GPU time of its encoder, prefill and decode work (CUDA events around each, read after
the run), so the GPU's busy share and what a round is made of are measured rather than inferred from
nvidia-smi. Steady state only: the first and last ``--settle`` seconds of submissions are left out of the turn
statistics and the steps outside that span out of the round statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from glmasr.server.loadgen import percentile


def _pct(xs, q):
    v = percentile(xs, q)
    return None if v is None else round(v, 1)


def _parse_configs(text: str) -> list[dict]:
    out = []
    for part in text.split(";"):
        opts = {}
        for kv in filter(None, (x.strip() for x in part.split(","))):
            k, v = kv.split("=")
            opts[k.strip()] = int(v)
        out.append(opts)
    return out


class StepRecorder:
    """Wraps one engine's ``step`` and its runner's encode / prefill / decode: host wall per step, the work
    counts, and CUDA event pairs around each GPU phase (resolved in ``summary``, after a sync)."""

    def __init__(self, engine):
        self.steps, self._cur = [], None
        runner = engine.runner
        self.cuda = runner.device.type == "cuda"  # elsewhere: host wall times of the phases
        self._wrap(runner, "encode", "encode", lambda a, k: sum(p.num_windows for p in a[0]))
        self._wrap(runner, "prefill", "prefill", lambda a, k: len(a[0]))
        self._wrap(runner, "decode", "decode", lambda a, k: a[2])
        step = engine.step

        def recorded_step():
            self._cur = {"t0": time.perf_counter(), "encode": 0, "prefill": 0, "decode": 0, "events": []}
            try:
                return step()
            finally:
                self._cur["t1"] = time.perf_counter()
                self.steps.append(self._cur)
                self._cur = None

        engine.step = recorded_step

    def _wrap(self, obj, name, key, count):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            cur = self._cur
            if cur is None:
                return fn(*a, **k)
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            else:
                e0 = time.perf_counter()
            out = fn(*a, **k)
            if self.cuda:
                e1.record()
            else:
                e1 = time.perf_counter()
            cur[key] += count(a, k)
            cur["events"].append((key, e0, e1))
            return out

        setattr(obj, name, wrapped)

    def summary(self, t_from: float, t_to: float) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        steps = [s for s in self.steps if t_from <= s["t0"] and s["t1"] <= t_to]
        if not steps:
            return {}
        gpu = {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
        for s in steps:
            for key, e0, e1 in s["events"]:
                gpu[key] += e0.elapsed_time(e1) if self.cuda else 1e3 * (e1 - e0)
        span_ms = 1e3 * (steps[-1]["t1"] - steps[0]["t0"])
        walls = [1e3 * (s["t1"] - s["t0"]) for s in steps]
        enc_steps = [s for s in steps if s["encode"]]
        return {
            "steps": len(steps),
            "span_ms": round(span_ms, 1),
            "step_wall_ms": {"mean": round(statistics.mean(walls), 2), "p50": _pct(walls, 50), "p95": _pct(walls, 95)},
            "windows_per_encoding_step":
                round(statistics.mean([s["encode"] for s in enc_steps]), 2) if enc_steps else 0,
            "encoding_steps": len(enc_steps),
            "admitted_per_step": round(statistics.mean([s["prefill"] for s in steps]), 2),
            "decode_steps_per_step": round(statistics.mean([s["decode"] for s in steps]), 2),
            "gpu_ms_per_step": {k: round(v / len(steps), 2) for k, v in gpu.items()},
            # the phases' event spans: an upper bound of busy time (a span includes any wait for earlier work)
            "gpu_busy_share": round(sum(gpu.values()) / span_ms, 3) if span_ms else None,
            "encoder_ms_per_window": round(gpu["encode"] / max(1, sum(s["encode"] for s in steps)), 2),
            "prefill_ms_per_prompt": round(gpu["prefill"] / max(1, sum(s["prefill"] for s in steps)), 2),
            "decode_ms_per_step": round(gpu["decode"] / max(1, sum(s["decode"] for s in steps)), 3),
        }


def run_config(folder, device: str, opts: dict, rate: float, seconds: float, settle: float, audio: np.ndarray,
               seed: int, consumer: str = "listener") -> dict:
    import glmasr
    from glmasr.options import DecodeOptions, Priority

    asr = glmasr.load(folder, device=device, warmup=device == "cuda", **opts)
    try:
        asr.submit(audio[: 16000 * 4], sampling_rate=16000).result(timeout=120)  # the engine thread up
        engine = asr.engine
        rec = StepRecorder(engine)
        rng = np.random.default_rng(seed)
        n = int(rate * seconds)
        lengths = rng.uniform(3.0, 6.0, n)
        starts = rng.uniform(0, max(1.0, len(audio) / 16000 - 6.0), n)
        jobs, done = [], {}
        t0 = time.perf_counter() + 0.2

        def submitter():
            for i in range(n):
                when = t0 + i / rate
                wait = when - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                a = audio[int(starts[i] * 16000): int((starts[i] + lengths[i]) * 16000)]
                budget = math.ceil(3 * len(a) / 16000)
                t_submit = time.perf_counter()
                job = asr.submit(a, DecodeOptions(max_new_tokens=budget, ignore_eos=True), sampling_rate=16000,
                                 priority=Priority.LIVE_FINAL)
                jobs.append((t_submit, job))
                if aloop is None:
                    # the engine's thread calls this at each output; its last one ends the stream
                    job.stream.set_listener(
                        lambda i=i, s=job.stream: s.finished and done.setdefault(i, time.perf_counter()))
                else:
                    asyncio.run_coroutine_threadsafe(consume(i, job), aloop)

        aloop = None
        finals = {}
        if consumer == "stream":
            # what an engine process of `glmasr serve --frontends K` does per job on its event loop
            # (workers/process.py): the streamed deltas, each pickled as it would go to a front-end
            aloop = asyncio.new_event_loop()
            threading.Thread(target=aloop.run_forever, name="consumer", daemon=True).start()

            async def consume(i, job):
                async for d in job.adeltas(stream=True):
                    pickle.dumps(("delta", i, d), protocol=pickle.HIGHEST_PROTOCOL)
                    if d.finished:
                        finals[i] = d.result
                        done[i] = time.perf_counter()

        th = threading.Thread(target=submitter)
        th.start()
        th.join()
        if aloop is None:
            results = [(t, i, job.result(timeout=120)) for i, (t, job) in enumerate(jobs)]
        else:
            deadline = time.perf_counter() + 120
            while len(finals) < len(jobs) and time.perf_counter() < deadline:
                time.sleep(0.05)
            aloop.call_soon_threadsafe(aloop.stop)
            results = [(t, i, finals[i]) for i, (t, _) in enumerate(jobs)]
        lo, hi = t0 + settle, t0 + seconds - settle
        steady = [r for t, _, r in results if lo <= t <= hi]
        total = [1e3 * (done[i] - t) for t, i, _ in results if lo <= t <= hi]
        stages = {}
        for name, a, b in (("queue", None, "queue_ms"), ("encode", "queue_ms", "admit_ms"),
                           ("decode", "admit_ms", "engine_ms")):
            xs = [r.timings_ms[b] - (r.timings_ms[a] if a else 0.0) for r in steady]
            stages[name] = {"mean": round(statistics.mean(xs), 1), "p50": _pct(xs, 50), "p95": _pct(xs, 95)}
        late = time.perf_counter() - (t0 + seconds)
        return {"options": opts, "consumer": consumer, "turns": len(results), "steady_turns": len(steady),
                "drain_s_after_last_submission": round(late, 2),
                "submit_to_transcript_ms": {"p50": _pct(total, 50), "p95": _pct(total, 95), "p99": _pct(total, 99),
                                            "max": _pct(total, 100)},
                "stages_ms": stages, "rounds": rec.summary(lo, hi)}
    finally:
        asr.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rate", type=float, default=96.0, help="turns per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=4.0)
    p.add_argument("--audio", default=None, help="speech to slice turns from (default: noise)")
    p.add_argument("--consumers", default="listener",
                   help="',' list: listener (the time of the engine's last output, nothing else done) and/or stream "
                        "(each job's deltas streamed on an asyncio loop in another thread and pickled, as an "
                        "engine process of glmasr serve --frontends does; the time its final delta is out)")
    p.add_argument("--configs", default="encoder_chunk=32", help="';'-separated engine options, each 'k=v,k=v'")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

    folder = args.model or ensure_full_size_checkpoint()
    if args.audio:
        from glmasr.audio import load_audio

        audio = load_audio(args.audio).samples
        audio = np.asarray(audio.cpu() if hasattr(audio, "cpu") else audio, dtype=np.float32)
    else:
        audio = (0.1 * np.random.default_rng(0).standard_normal(16000 * 40)).astype(np.float32)
    rows = []
    for i, opts in enumerate(_parse_configs(args.configs)):
        for consumer in args.consumers.split(","):
            row = run_config(folder, args.device, opts, args.rate, args.seconds, args.settle, audio, seed=i,
                             consumer=consumer)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nengine alone, {args.rate:g} turns/s of 3-6 s for {args.seconds:g} s (steady state: "
          f"{args.settle:g} s cut at each end)")
    print("| options | consumer | p50 / p95 / p99 ms | queue / encode / decode mean ms | step ms | "
          "windows / encoding step | admitted / step | decode steps / step | GPU ms per step enc / pre / dec | "
          "GPU busy | enc ms/window | prefill ms/prompt | decode ms/step |")
    print("|" + "---|" * 13)
    for r in rows:
        t, s, rd = r["submit_to_transcript_ms"], r["stages_ms"], r["rounds"]
        g = rd.get("gpu_ms_per_step", {})
        print(f"| {r['options']} | {r['consumer']} | {t['p50']} / {t['p95']} / {t['p99']} | {s['queue']['mean']} / "
              f"{s['encode']['mean']} / {s['decode']['mean']} | {rd.get('step_wall_ms', {}).get('mean')} | "
              f"{rd.get('windows_per_encoding_step')} | {rd.get('admitted_per_step')} | "
              f"{rd.get('decode_steps_per_step')} | {g.get('encode')} / {g.get('prefill')} / {g.get('decode')} | "
              f"{rd.get('gpu_busy_share')} | {rd.get('encoder_ms_per_window')} | {rd.get('prefill_ms_per_prompt')} | "
              f"{rd.get('decode_ms_per_step')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": args.rate, "seconds": args.seconds, "settle": args.settle,
                                               "audio": args.audio, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
