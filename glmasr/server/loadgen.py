"""Load generator for the server (issue 11's load benchmark): C concurrent ``openai`` clients, each sending one
streamed transcription after another for a fixed time, over mixed synthetic clips (1-30 s).

    python -m glmasr.server.loadgen --url http://127.0.0.1:8000/v1 --api-key KEY --clients 1,8,64,256 --seconds 30
    python -m glmasr.server.loadgen --serve --model PATH --device cuda --clients 1,8,64,256 --seconds 30

The offline reference, on the same clips in the same run: the offline throughput (``glmasr.transcribe`` of a
batch of clips: audio seconds per second) and the in-process latency of one call at a time. With ``--url`` it is
measured after the load levels on a model this process loads (``--offline-model``, with ``--device``), the
server being idle by then; ``--serve`` loads the model here, serves it on a free 127.0.0.1 port (uvicorn in a
thread) and measures the reference on the same handle. For the benchmark's numbers run the server in its own
process (``glmasr serve``) and use ``--url``: with ``--serve`` the clients, the HTTP layer and the engine's host
work share one interpreter (one GIL), which costs the server throughput at high concurrency.

Per concurrency it reports requests/s, audio seconds per second (RTFx), p50/p95/p99 latency (request sent -> done
event) and time to first delta event, failed requests (an error status or event) and lost
ones (sent before the deadline, not finished within ``--grace`` s after it). JSON on stdout (``--json FILE``
too), a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import sys
import threading
import time

import numpy as np


def make_clips(n: int = 32, seed: int = 0, min_s: float = 1.0, max_s: float = 30.0) -> list[tuple[bytes, float]]:
    """``n`` WAV clips (16 kHz, 16-bit) of durations spread over [min_s, max_s]: noise with a slow envelope."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    clips = []
    for _ in range(n):
        seconds = float(rng.uniform(min_s, max_s))
        k = int(seconds * 16000)
        env = 0.5 + 0.5 * np.sin(np.linspace(0, 2 * np.pi * max(1.0, seconds / 2), k)) ** 2
        samples = (rng.standard_normal(k) * 0.1 * env).astype(np.float32)
        buf = io.BytesIO()
        sf.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
        clips.append((buf.getvalue(), k / 16000))
    return clips


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    i = min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))
    return v[i]


async def run_load(base_url: str, api_key: str, model: str, clients: int, seconds: float, clips,
                   grace: float = 120.0) -> dict:
    """``clients`` workers for ``seconds``; returns the stats (see the module docstring)."""
    import httpx2
    import openai

    http = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_connections=clients + 8,
                                                              max_keepalive_connections=clients + 8),
                                          timeout=httpx2.Timeout(grace + seconds + 60))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0)
    latencies, ttfts, audio_done = [], [], []
    failed, errors = 0, []
    sent = 0
    t_start = time.perf_counter()
    deadline = t_start + seconds

    async def one(i: int) -> None:
        nonlocal failed
        data, dur = clips[i % len(clips)]
        t0 = time.perf_counter()
        first = None
        try:
            stream = await client.audio.transcriptions.create(file=data, model=model, stream=True)
            done = None
            async for event in stream:
                if event.type == "transcript.text.delta" and first is None:
                    first = time.perf_counter()
                elif event.type == "transcript.text.done":
                    done = event
            if done is None:
                raise RuntimeError("the stream ended without a done event")
        except Exception as e:
            failed += 1
            if len(errors) < 5:
                errors.append(f"{type(e).__name__}: {e}"[:300])
            return
        t1 = time.perf_counter()
        latencies.append(t1 - t0)
        ttfts.append((first or t1) - t0)  # a clip with no text: its first event is the done event
        audio_done.append(dur)

    async def worker(w: int) -> None:
        nonlocal sent
        k = 0
        while time.perf_counter() < deadline:
            sent += 1
            await one(w * 7919 + k)
            k += 1

    tasks = [asyncio.create_task(worker(w)) for w in range(clients)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + grace)
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - t_start
    await client.close()
    finished = len(latencies)
    return {"clients": clients, "seconds": seconds, "wall_s": round(wall, 3), "sent": sent, "ok": finished,
            "failed": failed, "lost": sent - finished - failed, "requests_per_s": round(finished / wall, 3),
            "audio_s_per_s": round(sum(audio_done) / wall, 2),
            **{f"latency_p{q}_ms": _ms(percentile(latencies, q)) for q in (50, 95, 99)},
            **{f"ttft_p{q}_ms": _ms(percentile(ttfts, q)) for q in (50, 95, 99)}, "errors": errors}


def _ms(v):
    return None if v is None else round(1e3 * v, 1)


def offline_reference(asr, clips, batch: int = 256) -> dict:
    """The same clips without the server: batch throughput (``glmasr.transcribe`` of ``batch`` clips at once) and
    the latency of one in-process call at a time (median over every clip once: one client cycles through all of
    them, so the two medians are over the same mix)."""
    import soundfile as sf

    import glmasr

    arrays = [sf.read(io.BytesIO(d), dtype="float32")[0] for d, _ in clips]
    items = [arrays[i % len(arrays)] for i in range(batch)]
    audio_s = sum(clips[i % len(clips)][1] for i in range(batch))
    glmasr.transcribe(items[:8], model=asr, sampling_rate=16000)  # warm
    t = time.perf_counter()
    glmasr.transcribe(items, model=asr, sampling_rate=16000)
    wall = time.perf_counter() - t
    single = []
    for a in arrays:
        t = time.perf_counter()
        asr.submit(a, sampling_rate=16000).result()
        single.append(time.perf_counter() - t)
    return {"offline_batch": batch, "offline_audio_s_per_s": round(audio_s / wall, 2),
            "in_process_latency_p50_ms": _ms(percentile(single, 50))}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, timeout: float, alive=lambda: True) -> float:
    """Poll http://127.0.0.1:PORT/health until it answers 200; seconds waited. ``alive()`` False (the server's
    process or thread ended) fails at once."""
    import httpx2

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not alive():
            raise RuntimeError("the server ended before it was healthy")
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx2.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server was not healthy after {timeout:.0f} s")


class BackgroundServer:
    """The server for ``asr`` on 127.0.0.1 (a free port), uvicorn in a daemon thread; ``stop()`` drains it."""

    def __init__(self, asr, api_key: str | None = None, **config):
        import uvicorn

        from .app import ServerConfig, create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        app = create_app(asr, ServerConfig(api_key=api_key, close_engine=False, **config))
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="glmasr-loadgen-server", daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        wait_healthy(self.port, timeout, self.thread.is_alive)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def compare(out: dict) -> dict:
    """The issue's two ratios: server RTFx at the highest concurrency over the offline RTFx, and the one-client
    p50 latency over the in-process p50."""
    ref, levels = out.get("reference"), out.get("levels", [])
    if not ref or not levels:
        return {}
    top = max(levels, key=lambda r: r["clients"])
    one = [r for r in levels if r["clients"] == 1]
    res = {"top_clients": top["clients"],
           "server_over_offline_rtfx": round(top["audio_s_per_s"] / ref["offline_audio_s_per_s"], 3)}
    if one and one[0]["latency_p50_ms"] and ref.get("in_process_latency_p50_ms"):
        res["one_client_p50_over_in_process_p50"] = round(one[0]["latency_p50_ms"] / ref["in_process_latency_p50_ms"], 3)
    return res


def table(rows: list[dict]) -> str:
    head = ("| clients | req/s | audio s/s (RTFx) | p50 / p95 / p99 latency ms | p50 / p95 / p99 TTFT ms | failed | "
            "lost |\n|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['clients']} | {r['requests_per_s']} | {r['audio_s_per_s']} | {r['latency_p50_ms']} / "
        f"{r['latency_p95_ms']} / {r['latency_p99_ms']} | {r['ttft_p50_ms']} / {r['ttft_p95_ms']} / "
        f"{r['ttft_p99_ms']} | {r['failed']} | {r['lost']} |\n" for r in rows)


def main(argv=None) -> int:
    from ..checkpoint.weights import DEFAULT_MODEL_ID

    p = argparse.ArgumentParser(prog="python -m glmasr.server.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="the server's /v1 base URL (else --serve)")
    p.add_argument("--serve", action="store_true", help="load --model here and serve it on a free local port")
    p.add_argument("--model", default=None, help="with --serve: checkpoint folder, hub id or tiny-random")
    p.add_argument("--offline-model", default=None,
                   help="with --url: load this checkpoint here after the load levels for the offline reference")
    p.add_argument("--device", default=None)
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--served-name", default="glm-asr-nano-2512", help="the `model` field sent")
    p.add_argument("--api-key", default="none")
    p.add_argument("--clients", default="1,8,64,256", help="comma-separated concurrency levels")
    p.add_argument("--seconds", type=float, default=30.0, help="duration of each level")
    p.add_argument("--grace", type=float, default=120.0, help="seconds after a level's end before a request is lost")
    p.add_argument("--num-clips", type=int, default=32)
    p.add_argument("--no-offline", action="store_true", help="with --serve: skip the offline reference")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if (args.url is None) == (not args.serve):
        p.error("give --url or --serve")
    levels = [int(c) for c in args.clients.split(",")]
    clips = make_clips(args.num_clips)
    out = {"levels": [], "clips": {"count": len(clips), "seconds": round(sum(d for _, d in clips), 1)}}
    server = None
    url = args.url
    if args.serve:
        import glmasr

        asr = glmasr.load(args.model or DEFAULT_MODEL_ID, device=args.device, max_batch=args.max_batch)
        server = BackgroundServer(asr, max_queue=max(levels) * 2)
        server.wait_ready()
        url = server.url
    try:
        for c in levels:
            row = asyncio.run(run_load(url, args.api_key, args.served_name, c, args.seconds, clips, args.grace))
            out["levels"].append(row)
            print(json.dumps(row), file=sys.stderr)
        if server is None and args.offline_model and not args.no_offline:
            import glmasr

            asr = glmasr.load(args.offline_model, device=args.device, max_batch=args.max_batch)
        if (server is not None or args.offline_model) and not args.no_offline:
            out["reference"] = offline_reference(asr, clips, batch=max(levels))
    finally:
        if server is not None:
            server.stop()
    print(table(out["levels"]), file=sys.stderr)
    if "reference" in out:
        out["compare"] = compare(out)
        print(f"reference: {out['reference']}; {out['compare']}", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["failed"] == 0 and r["lost"] == 0 for r in out["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
