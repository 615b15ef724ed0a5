"""The server's way in for uploads, without a model: ``glmasr serve``'s app (``server.create_app``, one process,
uvicorn on 127.0.0.1 as ``glmasr serve`` configures it) over an engine client that answers each request at once
with an empty transcript, fed the 300 WAV clips of the first-mixed workload (scripts/bench/workloads.py, 4568 s,
146 MB) all at once by the real openai client from several client processes (``serve_load._send_from_procs``).

What it shows: how fast uploads get from the clients to the point where the engine would take them (the
host-side ceiling of ``serve_load --first-mixed`` on the same machine), and where each upload's time goes on
the server: ``audio_ms`` (its decoding, in the worker thread) and ``received_to_submit_ms`` (from the server
receiving the request to the engine's ``submit``: the body, the multipart parse, the decoding and the queue
for a worker thread). Needs no GPU; the numbers are this machine's.

    python -m scripts.bench.ingest [--clips 300] [--client-procs 4] [--calls 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from glmasr.results import Transcription
from glmasr.workers.engine_client import EngineClient, EngineRequest


class _Answered(EngineRequest):
    def __init__(self, result: Transcription):
        self._result = result

    @property
    def result(self):
        return self._result

    async def started(self) -> None:
        return None

    async def aresult(self):
        return self._result

    async def adeltas(self):
        raise NotImplementedError("the ingestion benchmark sends no streamed requests")
        yield  # pragma: no cover

    def abort(self) -> None:
        pass


class InstantEngine(EngineClient):
    """Takes every request and answers it at once (empty text); records when each reached ``submit``."""

    def __init__(self, folder: Path, slots: int = 128):
        self._folder, self._slots = Path(folder), slots
        self.lock = threading.Lock()
        self.seen: list[tuple[float, float, int, float]] = []  # (perf_counter at submit, audio_ms, bytes, t_start)

    @property
    def folder(self) -> Path:
        return self._folder

    @property
    def slots(self) -> int:
        return self._slots

    def submit(self, audio, decode, t_start, audio_ms=0.0, pieces=None, stream=False, timeout=None,
               priority=None) -> _Answered:
        with self.lock:
            self.seen.append((time.perf_counter(), audio_ms, int(audio.samples.nbytes), t_start))
        return _Answered(Transcription(text="", token_ids=[], finish_reason="stop", duration_s=audio.duration_s,
                                       num_windows=1))

    def warmup(self, mode: str) -> dict:
        return {}

    @property
    def num_pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _quantiles(v) -> dict:
    a = np.asarray(v, dtype=np.float64)
    return {q: round(float(np.quantile(a, f)), 2) for q, f in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))}


def run(clips: int = 300, client_procs: int = 4, calls: int = 2) -> dict:
    import soundfile as sf

    from glmasr.checkpoint.random_weights import ensure_tiny_checkpoint
    from glmasr.server import ServerConfig, create_app
    from glmasr.server.http import SWITCH_INTERVAL_S, HttpLimits, make_server, uvicorn_config
    from glmasr.server.loadgen import free_port, wait_healthy
    from scripts.bench.serve_load import _send_from_procs
    from scripts.bench.workloads import mixed_clips

    data = []
    for a in mixed_clips(clips):
        buf = io.BytesIO()
        sf.write(buf, a, 16000, format="WAV", subtype="PCM_16")
        data.append((buf.getvalue(), len(a) / 16000))
    mb = sum(len(d) for d, _ in data) / 1e6
    audio_s = sum(s for _, s in data)
    engine = InstantEngine(ensure_tiny_checkpoint())
    config = ServerConfig(warmup="none", limits=HttpLimits(max_connections=4 * clips, max_uploads=2 * clips),
                          max_queue=4 * clips)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as glmasr serve sets it
    app = create_app(engine, config)
    port = free_port()
    server = make_server(uvicorn_config(app, "127.0.0.1", port, config.limits, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    report = {"clips": clips, "upload_mb": round(mb, 1), "audio_s": round(audio_s, 1), "client_procs": client_procs,
              "calls": []}
    try:
        wait_healthy(port, 60, thread.is_alive)
        for _ in range(calls):
            engine.seen.clear()
            row = _send_from_procs(f"http://127.0.0.1:{port}/v1", data, client_procs)
            seen = list(engine.seen)
            row["MB_per_s"] = round(mb / row["wall_s"], 1)
            row["audio_ms"] = _quantiles([s[1] for s in seen])
            row["received_to_submit_ms"] = _quantiles([1e3 * (s[0] - s[3]) for s in seen])
            row["submitted"] = len(seen)
            report["calls"].append(row)
            print(f"[ingest] {json.dumps(row)}", flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=300)
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = run(args.clips, args.client_procs, args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(c["failed"] == 0 and c["submitted"] == args.clips for c in report["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
