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
                 tokens_per_s: float | None = None):
    """``glmasr serve`` (``python -m glmasr.cli serve``) in its own process on a free 127.0.0.1 port, its output
    in ``log_path``; ``extra``: more flags; ``tokens_per_s``: every prompt's budget forced to that many tokens per
    second of audio (``scripts.bench.forced_serve``). Returns (process, port, log file)."""
    from glmasr.server.loadgen import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    log = open(log_path, "w")
    sizes = [*(["--max-batch", str(max_batch)] if max_batch else []),
             *(["--max-queue", str(max_queue)] if max_queue else [])]
    launcher = (["-m", "glmasr.cli", "serve"] if tokens_per_s is None
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--clients", default="1,8,64,256")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import glmasr
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

    folder = args.model or ensure_full_size_checkpoint()
    asr = glmasr.load(folder, device=args.device)
    report = run(asr, folder, tuple(int(c) for c in args.clients.split(",")), args.seconds, device=args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["failed"] == 0 and r["lost"] == 0 for r in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
