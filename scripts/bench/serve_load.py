"""The server under load beside offline throughput, in one run (issue 11's load benchmark).

    bash benchmark.sh --only serve                   # as a benchmark.sh section (full-size checkpoint, H200)
    python -m scripts.bench.serve_load --model FOLDER --device cuda [--clients 1,8,64,256] [--seconds 30]

Starts ``glmasr serve`` in its own process on a free 127.0.0.1 port (full warm-up before /health is ok; slots =
the offline model's, queue 2 x the highest concurrency), then runs ``glmasr.server.loadgen``'s clients (the
real ``openai`` client, streamed requests, mixed 1-30 s WAV clips) for each concurrency level, then stops the
server (SIGTERM: it drains) and measures the offline reference on the same clips with the model of this process:
``transcribe()`` of as many clips as the highest concurrency at once, and each clip alone in-process. Tokens:
the default budget (32 + 6 per second of audio) with random weights, which never emit EOS early, so each clip
decodes the same count in the server and offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_server(folder, device: str, max_batch: int | None, max_queue: int | None, log_path: Path, extra=(),
                 tokens_per_s: float | None = None, tokens: int | None = None):
    """``glmasr serve`` (``python -m glmasr.cli serve``) in its own process on a free 127.0.0.1 port, its output
    in ``log_path``; ``extra``: more flags; ``tokens_per_s``: every prompt's budget forced to that many tokens per
    second of audio (``scripts.bench.forced_serve``). Returns (process, port, log file)."""
    from glmasr.server.loadgen import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    log = open(log_path, "w")
    sizes = [*(["--max-batch", str(max_batch)] if max_batch else []),
             *(["--max-queue", str(max_queue)] if max_queue else [])]
    launcher = (["-m", "scripts.bench.forced_serve", "--tokens", str(tokens)] if tokens is not None
                else ["-m", "glmasr.cli", "serve"] if tokens_per_s is None
                else ["-m", "scripts.bench.forced_serve", "--tokens-per-s", str(tokens_per_s)])
    where = ["--device", device] if device else []  # None: the flags in extra say (--data-parallel, --devices)
    proc = subprocess.Popen([sys.executable, *launcher, "--model", str(folder), *where,
                             *sizes, "--port", str(port), "--log-level", "warning", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, port, log


def stop_server(proc, timeout_s: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def run(asr, folder, levels=(1, 8, 64, 256), seconds: float = 30.0, num_clips: int = 32, device: str = "cuda",
        grace: float = 60.0, out_dir: Path | None = None, health_timeout_s: float = 300.0) -> dict:
    from glmasr.server import loadgen

    out_dir = Path(out_dir or ".")
    clips = loadgen.make_clips(num_clips)
    max_batch = asr.options.max_batch
    proc, port, log = start_server(folder, device, max_batch, 2 * max(levels), out_dir / "serve_load_server.log")
    report = {"clips": {"count": len(clips), "seconds": round(sum(d for _, d in clips), 1)}, "max_batch": max_batch,
              "seconds_per_level": seconds, "levels": []}
    try:
        report["server_ready_s"] = round(loadgen.wait_healthy(port, health_timeout_s, lambda: proc.poll() is None), 1)
        url = f"http://127.0.0.1:{port}/v1"
        for c in levels:
            row = asyncio.run(loadgen.run_load(url, "none", "glm-asr-nano-2512", c, seconds, clips, grace))
            report["levels"].append(row)
            print(f"[serve] {json.dumps(row)}", flush=True)
    finally:
        report["server_exit_status"] = stop_server(proc)
        log.close()
    report["reference"] = loadgen.offline_reference(asr, clips, batch=max(levels))
    report["compare"] = loadgen.compare(report)
    report["table"] = loadgen.table(report["levels"]) + (
        f"\noffline on the same clips: {report['reference']}; {report['compare']}")
    print(report["table"], flush=True)
    return report


def first_mixed(folder, device: str = "cuda", n: int = 300, new_tokens: int = 40, slots: int = 128, calls: int = 2,
                out_dir: Path | None = None, health_timeout_s: float = 300.0, server_flags=(),
                client_procs: int = 1) -> dict:
    """A fresh server's first mixed workload (issue 27, item 4): ``glmasr serve`` (full warm-up before /health
    is ok) with every prompt forced to ``new_tokens`` tokens, then issue 13's ``n`` clips of 1-30 s
    (scripts/bench/workloads.py, as 16-bit WAV uploads) sent at once by the real openai client, ``calls`` times in
    a row; RTFx = the clips' seconds / the wall from the first send to the last answer. The server admits every
    upload at once (``--max-uploads`` / ``--max-connections`` above ``n``); ``server_flags``: more flags (e.g.
    ``--frontends 4``). ``client_procs``: the clips dealt round-robin over that many client processes that start
    sending at one instant (one Python client encoding 146 MB of multipart uploads can be the bottleneck); each
    call reports the clients' CPU seconds, so a client-bound figure shows."""
    import io
    import time

    import soundfile as sf

    from scripts.bench.workloads import mixed_clips

    out_dir = Path(out_dir or ".")
    clips = []
    for a in mixed_clips(n):
        buf = io.BytesIO()
        sf.write(buf, a, 16000, format="WAV", subtype="PCM_16")
        clips.append((buf.getvalue(), len(a) / 16000))
    audio_s = sum(d for _, d in clips)
    t_start = time.monotonic()
    extra = ["--max-uploads", str(2 * n), "--max-connections", str(max(1024, 2 * n)), *server_flags]
    proc, port, log = start_server(folder, device, slots, 2 * n, out_dir / "first_mixed_server.log", extra,
                                   tokens=new_tokens)
    report = {"clips": n, "audio_s": round(audio_s, 1), "new_tokens": new_tokens, "slots": slots,
              "server_flags": list(server_flags), "client_procs": client_procs, "calls": []}
    try:
        report["server_ready_s"] = round(loadgen_wait(port, health_timeout_s, proc), 2)
        report["process_start_to_ready_s"] = round(time.monotonic() - t_start, 2)
        for i in range(calls):
            row = _send_from_procs(f"http://127.0.0.1:{port}/v1", clips, client_procs)
            row["RTFx"] = round(audio_s / row["wall_s"], 1)
            report["calls"].append(row)
            print(f"[first-mixed] call {i + 1}: {json.dumps(row)}", flush=True)
    finally:
        report["server_exit_status"] = stop_server(proc)
        log.close()
    return report


def loadgen_wait(port: int, timeout_s: float, proc) -> float:
    from glmasr.server import loadgen

    return loadgen.wait_healthy(port, timeout_s, lambda: proc.poll() is None)


_START_BARRIER = None  # a client process's barrier (``_send_from_procs``), set by the pool's initializer


def _init_client(barrier) -> None:
    global _START_BARRIER
    _START_BARRIER = barrier


def _client_proc(base_url: str, clips) -> dict:
    """One client process: once every client holds its clips and its imports (the barrier), sends its clips."""
    import time

    import httpx2  # noqa: F401  (imported before the start, not inside the timed part)
    import openai  # noqa: F401

    _START_BARRIER.wait(timeout=600)
    start = time.monotonic()  # CLOCK_MONOTONIC is system-wide: the processes' starts compare
    cpu0 = time.process_time()
    row = asyncio.run(_send_all(base_url, clips))
    row["start"] = start
    row["end"] = time.monotonic()
    row["client_cpu_s"] = time.process_time() - cpu0
    return row


def _send_from_procs(base_url: str, clips, procs: int) -> dict:
    """The clips over ``procs`` client processes (1: this one); wall from the common start to the last answer.
    The start is when every client process is ready (its clips received through the pool's pipe, openai imported:
    a barrier), not a fixed delay after the pool starts: shipping 146 MB of clips to fresh processes took longer
    than any fixed head start on a loaded machine, and the wall then counted the clients' own start-up."""
    import multiprocessing as mp
    import time

    if procs <= 1:
        cpu0 = time.process_time()
        row = asyncio.run(_send_all(base_url, clips))
        row["client_cpu_s"] = round(time.process_time() - cpu0, 2)
        return _answer_times(row, row["t0"])
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    # one task per process: each blocks at the barrier until all are taken, so no process takes two
    with ctx.Pool(procs, initializer=_init_client, initargs=(barrier,)) as pool:
        rows = pool.starmap(_client_proc, [(base_url, clips[i::procs]) for i in range(procs)], chunksize=1)
    start = min(r["start"] for r in rows)
    row = {"wall_s": round(max(r["end"] for r in rows) - start, 3), "ok": sum(r["ok"] for r in rows),
           "failed": sum(r["failed"] for r in rows), "errors": [e for r in rows for e in r["errors"]][:5],
           "client_cpu_s": [round(r["client_cpu_s"], 2) for r in rows], "done": [t for r in rows for t in r["done"]],
           "sent": [t for r in rows for t in r["sent"]],
           "clients_start_spread_s": round(max(r["start"] for r in rows) - start, 4)}
    return _answer_times(row, start)


async def _send_all(base_url: str, clips) -> dict:
    """Every clip as its own request, all at once; wall from the first send to the last answer."""
    import time

    import httpx2
    import openai

    sent: list[float] = []

    async def on_request(request) -> None:  # the request built by the SDK, about to go out
        sent.append(time.monotonic())

    http = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_connections=len(clips) + 8,
                                                              max_keepalive_connections=len(clips) + 8),
                                          timeout=httpx2.Timeout(600), event_hooks={"request": [on_request]})
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", http_client=http, max_retries=0)
    errors = []

    done: list[float] = []

    async def one(data):
        try:
            r = await client.audio.transcriptions.create(file=("clip.wav", data), model="glm-asr-nano-2512")
            done.append(time.monotonic())
            return r.text
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
            return None

    t0 = time.monotonic()
    texts = await asyncio.gather(*(one(data) for data, _ in clips))
    wall = time.monotonic() - t0
    await client.close()
    return {"wall_s": round(wall, 3), "ok": sum(t is not None for t in texts), "failed": len(errors),
            "errors": errors[:5], "t0": t0, "done": done, "sent": sent}


def _answer_times(row: dict, start: float) -> dict:
    """Seconds from the start to the first, 10th, 50th and 90th percentile and last answers (where the wall goes:
    late first answers mean the uploads' way in, a long spread the engine), and the same for the instants the
    clients' HTTP layer got each request to send (``sent_s``: late ones mean the clients' own work, building the
    requests, held the uploads back)."""
    import numpy as np

    row.pop("t0", None)
    for key, out in (("done", "answers_s"), ("sent", "sent_s")):
        d = np.sort(np.asarray(row.pop(key, []), dtype=np.float64) - start)
        if d.size:
            row[out] = {q: round(float(np.quantile(d, f)), 3) for q, f in
                        (("first", 0.0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("last", 1.0))}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--clients", default="1,8,64,256")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--json", default=None)
    p.add_argument("--first-mixed", action="store_true",
                   help="only a fresh server's first mixed workload (first_mixed), no load levels")
    p.add_argument("--client-procs", type=int, default=1,
                   help="--first-mixed: client processes the uploads are spread over (default 1)")
    p.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                   help="--first-mixed: a flag for glmasr serve (repeatable; e.g. --server-flag=--frontends=4)")
    args = p.parse_args(argv)
    import glmasr
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

    folder = args.model or ensure_full_size_checkpoint()
    if args.first_mixed:
        flags = [f for flag in args.server_flag for f in flag.split("=", 1)]
        report = first_mixed(folder, args.device, server_flags=tuple(flags),
                             out_dir=Path(os.environ.get("OUT", ".")), client_procs=args.client_procs)
        print(json.dumps(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0 if all(c["failed"] == 0 for c in report["calls"]) else 1
    asr = glmasr.load(folder, device=args.device)
    report = run(asr, folder, tuple(int(c) for c in args.clients.split(",")), args.seconds, device=args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["failed"] == 0 and r["lost"] == 0 for r in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
