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

Realtime mode (``--realtime``): N live sessions on ``GET /v1/realtime?intent=transcription`` (OpenAI's Realtime
transcription protocol, ``server_vad`` turns), each streaming speech with pauses at real-time pace in
``--chunk-ms`` chunks (20-100 ms) for ``--seconds``:

    python -m glmasr.server.loadgen --realtime --url http://127.0.0.1:8000/v1 --sessions 1,32,256 --seconds 30 \
        [--audio a.wav b.flac] [--partials] [--server-pid PID] [--procs 4] [--json out.json]

The audio is ``--audio`` files, or English sentences synthesized with espeak-ng with 1.0-1.6 s pauses; each pass of
it ends with silence and the session loops it. Each session starts in a pause of it drawn at random, at a time drawn
evenly over ``--ramp`` s (default: the audio's mean time from one turn to the next, so that ends of speech spread
evenly over time instead of arriving in bursts) from the level's start, which comes once every session of every
client process has connected and configured (``StartGate``: else sessions that connect late start together, and
their turns arrive in bursts; ``session_start_late_ms`` in the row says how far behind its schedule each began) and,
once ``--seconds`` have been streamed, goes on to the next pause, so every turn it streams is whole. The turns a
session should get are the server's own turn detector (``glmasr.live.turns``) run offline on the Silero
probabilities of the same audio; per N it reports those turns against what the server committed, completed and
failed (lost = committed but never finished within ``--grace`` s, plus expected but never committed), the time from
end of speech to ``completed`` (end of speech = the ``speech_stopped`` event's ``audio_end_ms``, which includes
``silence_duration_ms``, mapped to the wall time at which the chunk holding that audio was sent) and to the turn's
first delta after it, the partial update interval (``--partials``: the gaps between what a person sees change while
they speak: from the turn's onset through its deltas to its end of speech) and the first of those gaps alone (onset
to the turn's first words), how far the client fell behind its real-time schedule, and the server's CPU use (the
process ``--server-pid`` and its children, from /proc; ``--serve``: this process) and GPU use (``nvidia-smi``, when
it exists), sampled every second.
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
from dataclasses import dataclass, field

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


# --- realtime mode -------------------------------------------------------------------------------------------

REALTIME_RATE = 24000  # the audio/pcm rate sessions send
# The server's opt-in partials extension (fields of audio.input.transcription): agreed text of the open turn goes
# out early as ordinary delta events, a draft every partial_hop_ms.
PARTIALS_FIELD = "interim_results"
SENTENCES = ("the quick brown fox jumps over the lazy dog", "please call stella and ask her to bring these things",
             "six spoons of fresh snow peas and five thick slabs of blue cheese",
             "we also need a small plastic snake and a big toy frog for the kids",
             "she can scoop these things into three red bags", "the birch canoe slid on the smooth planks",
             "glue the sheet to the dark blue background", "it is easy to tell the depth of a well",
             "these days a chicken leg is a rare dish", "rice is often served in round bowls",
             "the juice of lemons makes fine punch", "the box was thrown beside the parked truck")


@dataclass
class RealtimeSettings:
    """What every session sends in its ``session.update`` (server_vad turns) and how it streams."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    partials: bool = False
    partial_hop_ms: int | None = None  # None: the server's default
    chunk_ms: int = 40
    model: str = "glm-asr-nano-2512"

    def __post_init__(self):
        if not 20 <= self.chunk_ms <= 100 or (REALTIME_RATE * self.chunk_ms) % 1000:
            raise ValueError(f"chunk_ms must be a whole number of 24 kHz samples in 20-100 ms, got {self.chunk_ms}")

    @property
    def chunk_samples(self) -> int:
        return REALTIME_RATE * self.chunk_ms // 1000

    def session_update(self) -> dict:
        transcription = {"model": self.model}
        if self.partials:
            transcription[PARTIALS_FIELD] = True
            if self.partial_hop_ms is not None:
                transcription["partial_hop_ms"] = self.partial_hop_ms
        return {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": REALTIME_RATE}, "transcription": transcription,
            "turn_detection": {"type": "server_vad", "threshold": self.threshold,
                               "prefix_padding_ms": self.prefix_padding_ms,
                               "silence_duration_ms": self.silence_duration_ms}}}}}


@dataclass
class SpeechPass:
    """One pass of a session's looped audio: ``pcm`` (24 kHz mono int16, ending in silence), the turns a server_vad
    session finds in it (``turns``: (start, stop) in 24 kHz samples of the pass, as ``audio_start_ms`` /
    ``audio_end_ms`` count them: start = onset - prefix padding, stop = end of speech + silence duration; a turn
    may wrap past the pass's end only if the audio has speech there, which the trailing silence prevents) and
    ``cuts``: points in the pauses between turns where a stream may begin or end without splitting a turn."""

    name: str
    pcm: np.ndarray
    turns: list[tuple[int, int]]
    cuts: list[int]

    @property
    def seconds(self) -> float:
        return len(self.pcm) / REALTIME_RATE


def synthesize_speech(seconds: float = 20.0, seed: int = 0, pauses: tuple[float, float] = (1.0, 1.6)) -> np.ndarray:
    """About ``seconds`` of English sentences spoken by espeak-ng with pauses drawn from ``pauses`` (s) between
    them, at 24 kHz (float32); 0.4 s of silence first. Needs the ``espeak-ng`` program."""
    import shutil
    import subprocess
    import tempfile

    import soundfile as sf

    from ..audio import resample

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("the realtime load needs speech: install espeak-ng (Debian: apt-get install espeak-ng) "
                           "or give --audio FILES")
    rng = np.random.default_rng(seed)
    parts, total = [np.zeros(int(0.4 * REALTIME_RATE), np.float32)], 0.4
    with tempfile.TemporaryDirectory() as tmp:
        for i in rng.permutation(len(SENTENCES)).tolist() * 4:
            if total >= seconds:
                break
            path = f"{tmp}/s.wav"
            subprocess.run(["espeak-ng", "-v", "en", "-s", "165", "-w", path, SENTENCES[i]], check=True,
                           capture_output=True)
            x, rate = sf.read(path, dtype="float32")
            x = resample(np.asarray(x, np.float32), rate, REALTIME_RATE)
            pause = np.zeros(int(rng.uniform(*pauses) * REALTIME_RATE), np.float32)
            parts += [0.8 * x / max(1e-6, float(np.abs(x).max())), pause]
            total += (len(x) + len(pause)) / REALTIME_RATE
    return np.concatenate(parts)


def _to_pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1.0, 1.0) * 32767).astype("<i2")


def speech_pass(samples_24k: np.ndarray, settings: RealtimeSettings, name: str = "speech") -> SpeechPass:
    """The pass for these samples: silence appended (``silence_duration_ms`` + 1 s), then the turns the server's
    detector finds when the pass is looped (``glmasr.live.turns`` on ``glmasr.audio.vad`` probabilities of three
    passes in a row; the middle one's turns), and the cuts (the middle of each pause between turns at least two
    chunks long). ValueError naming ``name`` when the audio has no speech."""
    from ..audio import resample
    from ..audio.vad import speech_probabilities
    from ..live.turns import TurnDetector, TurnSettings

    pad = np.zeros(int((settings.silence_duration_ms / 1000 + 1.0) * REALTIME_RATE), np.float32)
    pcm = _to_pcm16(np.concatenate([np.asarray(samples_24k, np.float32), pad]))
    n = len(pcm)
    x16 = resample(np.tile(pcm, 3).astype(np.float32) / 32768, REALTIME_RATE, 16000)
    det = TurnDetector(TurnSettings(threshold=settings.threshold, prefix_padding_ms=settings.prefix_padding_ms,
                                    silence_duration_ms=settings.silence_duration_ms))
    turns, start = [], None
    for e in det.feed(0, speech_probabilities(x16)):
        pos = round(e.sample * REALTIME_RATE / 16000)
        if e.kind == "started":
            start = pos
        elif e.kind == "stopped" and start is not None:
            if n <= start < 2 * n:
                turns.append((start - n, pos - n))
            start = None
    if not turns:
        raise ValueError(f"{name}: no speech found (the server's turn detector finds no turn in it)")
    cuts = []
    for k, (_, stop) in enumerate(turns):
        nxt = turns[k + 1][0] if k + 1 < len(turns) else turns[0][0] + n
        if nxt - stop >= 2 * settings.chunk_samples:
            cuts.append(((stop + nxt) // 2) % n)
    if not cuts:
        raise ValueError(f"{name}: no pause long enough between its turns to start a stream in")
    return SpeechPass(name, pcm, turns, sorted(cuts))


def load_speech_pass(path: str, settings: RealtimeSettings) -> SpeechPass:
    """A file (any format ``glmasr.audio.load_audio`` reads) as a pass: its 16 kHz samples at 24 kHz."""
    from ..audio import load_audio, resample

    x = resample(load_audio(path).samples, 16000, REALTIME_RATE)
    return speech_pass(x, settings, name=str(path))


@dataclass
class StreamPlan:
    """What one session streams: the pass looped from ``offset`` (a cut), ``total`` samples (the first cut at or
    after the wanted length), and the turns it should get (``turns``, in samples since the session's start)."""

    offset: int
    total: int
    turns: list[tuple[int, int]]

    @classmethod
    def make(cls, sp: SpeechPass, offset: int, samples: int) -> StreamPlan:
        n = len(sp.pcm)
        ends = sorted({(c - offset) % n for c in sp.cuts})
        k, total = 0, None
        while total is None:
            total = next((k * n + e for e in ends if k * n + e >= max(1, samples)), None)
            k += 1
        turns = []
        for k in range(total // n + 2):
            for a, b in sp.turns:
                a0, b0 = (a - offset) % n + k * n, (a - offset) % n + k * n + (b - a)
                if b0 <= total:
                    turns.append((a0, b0))
        return cls(offset, total, sorted(turns))

    def chunk(self, sp: SpeechPass, start: int, count: int) -> bytes:
        n = len(sp.pcm)
        idx = (self.offset + start + np.arange(min(count, self.total - start))) % n
        return sp.pcm[idx].tobytes()


@dataclass
class _Turn:
    start_ms: int | None = None
    end_ms: int | None = None
    t_stopped: float | None = None
    t_committed: float | None = None
    t_first_delta: float | None = None
    t_done: float | None = None
    failed: str | None = None
    updates: list = field(default_factory=list)


START_MARGIN_S = 0.3  # from the gate opening to the level's start: every session is scheduled, none is late


class StartGate:
    """Holds a level's sessions (those of this process) until every one has connected and configured, or failed
    to, then gives each the level's start (a ``time.time()``); with ``barrier`` (a ``multiprocessing.Manager``
    barrier of the client processes) every process's sessions first. A session that connected after its
    scheduled start would otherwise start streaming at once: when connecting the whole level takes longer than
    the ramp, the sessions' starts bunch at the end of the connection storm, and so do their ends of speech,
    turn after turn (the turn period of the audio repeats the bunching)."""

    def __init__(self, sessions: int, barrier=None, timeout: float = 180.0):
        self.waiting, self.barrier, self.timeout = sessions, barrier, timeout
        self._go = asyncio.Event()
        self.start = None

    async def arrive(self, wait: bool = True) -> float | None:
        """This session is connected (``wait``) or failed (``wait=False``: it counts, and returns at once)."""
        self.waiting -= 1
        if self.waiting == 0:
            if self.barrier is not None:
                try:
                    await asyncio.to_thread(self.barrier.wait, self.timeout)
                except Exception:  # noqa: BLE001 - broken or timed out: another process is stuck; start anyway
                    pass
            self.start = time.time() + START_MARGIN_S
            self._go.set()
        if not wait:
            return None
        await self._go.wait()
        return self.start


async def realtime_session(ws_url: str, api_key: str, sp: SpeechPass, plan: StreamPlan,
                           settings: RealtimeSettings, gate: StartGate, start_offset: float,
                           grace: float = 30.0) -> dict:
    """One live session: connect, configure, wait at ``gate`` for the level's start, stream ``plan`` at real-time
    pace (chunks on an absolute schedule from ``start_offset`` s after it), then wait (at most ``grace`` s) for
    every turn to finish. Returns its raw measurements (lists in seconds) and counts; a session that fails to
    connect or configure is counted and named in ``errors``."""
    import base64

    import websockets

    res = {"latency": [], "first_delta": [], "stop_delay": [], "partial_gaps": [], "first_update": [],
           "boundary_ms": [],
           "send_lag": [], "start_late": [], "expected": len(plan.turns), "committed": 0, "completed": 0,
           "failed": 0, "unfinished": 0, "missed": 0, "extra": 0, "session_failed": 0, "partial_updates": 0,
           "errors": [], "audio_s": 0.0}
    arrived = False
    cs = settings.chunk_samples
    n_chunks = -(-plan.total // cs)
    sent_at = np.zeros(n_chunks)
    turns: dict[str, _Turn] = {}
    committed: list[str] = []
    all_done = asyncio.Event()
    streamed = False

    def note_error(text: str) -> None:
        if len(res["errors"]) < 5:
            res["errors"].append(text[:300])

    def wall_of(ms: int) -> float:
        """When the chunk holding the audio just before ``ms`` (ms since the session's first sample) was sent."""
        k = min(n_chunks - 1, max(0, (ms * REALTIME_RATE // 1000 - 1) // cs))
        return float(sent_at[k])

    def check_done() -> None:
        finished = sum(1 for i in committed if turns[i].t_done is not None or turns[i].failed is not None)
        if streamed and finished == len(committed) and len(committed) >= len(plan.turns):
            all_done.set()

    async def receive(ws) -> None:
        async for raw in ws:
            now = time.perf_counter()
            try:
                ev = json.loads(raw)
            except ValueError:
                note_error(f"not JSON: {raw[:100]!r}")
                continue
            kind, item = str(ev.get("type") or ""), ev.get("item_id")
            t = turns.setdefault(item, _Turn()) if item is not None else None
            if kind == "input_audio_buffer.speech_started":
                t.start_ms = ev.get("audio_start_ms")
            elif kind == "input_audio_buffer.speech_stopped":
                t.end_ms, t.t_stopped = ev.get("audio_end_ms"), now
            elif kind == "input_audio_buffer.committed":
                t.t_committed = now
                committed.append(item)
            elif kind == "conversation.item.input_audio_transcription.delta":
                if t.t_stopped is None and t.t_committed is None:
                    t.updates.append(now)
                elif t.t_first_delta is None:
                    t.t_first_delta = now
            elif kind == "conversation.item.input_audio_transcription.completed":
                t.t_done = now
            elif kind == "conversation.item.input_audio_transcription.failed":
                t.failed = str((ev.get("error") or {}).get("code") or "failed")
                note_error(f"failed {item}: {ev.get('error')}")
            elif kind == "error":
                note_error(f"error: {ev.get('error')}")
            check_done()

    try:
        async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {api_key}"},
                                      max_size=None, open_timeout=60, ping_interval=None) as ws:
            await ws.send(json.dumps(settings.session_update()))
            while True:  # session.created, then the answer to our update
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev.get("type") == "session.updated":
                    break
                if ev.get("type") == "error":
                    raise RuntimeError(f"session.update refused: {ev.get('error')}")
            rx = asyncio.create_task(receive(ws))
            rx.add_done_callback(_receiver_ended(all_done, note_error))
            arrived = True
            start_at = await gate.arrive() + start_offset
            delay = start_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            res["start_late"].append(max(0.0, time.time() - start_at))
            t0 = time.perf_counter()
            for k in range(n_chunks):
                due = t0 + k * settings.chunk_ms / 1000
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                data = plan.chunk(sp, k * cs, cs)
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(data).decode()}))
                sent_at[k] = time.perf_counter()
                res["send_lag"].append(max(0.0, sent_at[k] - due))
            res["audio_s"] = plan.total / REALTIME_RATE
            streamed = True
            check_done()
            try:
                await asyncio.wait_for(all_done.wait(), grace)
            except asyncio.TimeoutError:
                pass
            rx.cancel()
    except Exception as e:  # noqa: BLE001 - counted and named: one session's failure must not end the level
        res["session_failed"] = 1
        note_error(f"{type(e).__name__}: {e}")
    finally:
        if not arrived:  # failed before the gate: it must not hold the others
            await gate.arrive(wait=False)
    stops = [b for _, b in plan.turns]
    for item in committed:
        t = turns[item]
        if t.failed is not None:
            res["failed"] += 1
        elif t.t_done is None:
            res["unfinished"] += 1
        else:
            res["completed"] += 1
        if t.end_ms is not None and t.t_done is not None and streamed:
            t_end = wall_of(t.end_ms)
            res["latency"].append(t.t_done - t_end)
            if t.t_first_delta is not None:
                res["first_delta"].append(t.t_first_delta - t_end)
            if t.t_stopped is not None:
                res["stop_delay"].append(t.t_stopped - t_end)
        if t.end_ms is not None and stops:
            end = t.end_ms * REALTIME_RATE // 1000
            res["boundary_ms"].append(min(abs(end - s) for s in stops) * 1000 / REALTIME_RATE)
        res["partial_updates"] += len(t.updates)
        if settings.partials and streamed and t.start_ms is not None and t.end_ms is not None:
            # while the person speaks (onset to end of speech), the gaps between what they see change: a turn
            # with no update at all counts as one gap as long as its speech
            onset = wall_of(min(t.start_ms + settings.prefix_padding_ms, t.end_ms))
            end = wall_of(max(t.end_ms - settings.silence_duration_ms, t.start_ms))
            if end > onset:
                times = [onset] + [u for u in sorted(t.updates) if onset < u < end] + [end]
                res["partial_gaps"] += np.diff(times).tolist()
                res["first_update"].append(times[1] - onset)  # the turn's first words (none: its speech)
    res["committed"] = len(committed)
    res["missed"] = max(0, len(plan.turns) - len(committed))
    res["extra"] = max(0, len(committed) - len(plan.turns))
    return res


def _receiver_ended(all_done: asyncio.Event, note_error):
    """The receive task's end: the server closed (or the task failed), so nothing more will come; stop waiting."""
    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            note_error(f"receiving: {type(e).__name__}: {e}")
        all_done.set()

    return done


def realtime_ws_url(url: str) -> str:
    """The WebSocket URL of the realtime endpoint from a server's base URL (``http://host:port`` or its ``/v1``,
    ``ws://`` or ``wss://`` too)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.scheme not in ("http", "https", "ws", "wss") or not u.netloc:
        raise ValueError(f"--url must be http(s)://HOST:PORT[/v1], got {url!r}")
    scheme = "wss" if u.scheme in ("https", "wss") else "ws"
    path = u.path.rstrip("/")
    if path.endswith("/v1/realtime"):
        path = path[: -len("/realtime")]
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{scheme}://{u.netloc}{path}/realtime?intent=transcription"


def session_plans(passes: list[SpeechPass], sessions: int, seconds: float, seed: int = 0):
    """(pass index, StreamPlan) per session: passes round-robin, each session starting at a cut of its pass drawn
    at random (seeded)."""
    rng = np.random.default_rng(seed)
    plans = []
    for i in range(sessions):
        j = i % len(passes)
        sp = passes[j]
        offset = sp.cuts[int(rng.integers(len(sp.cuts)))]
        plans.append((j, StreamPlan.make(sp, offset, int(seconds * REALTIME_RATE))))
    return plans


async def _run_sessions(ws_url, api_key, passes, plans, settings, barrier, ramp_s, total, grace):
    gate = StartGate(len(plans), barrier)
    tasks = [realtime_session(ws_url, api_key, passes[j], plan, settings, gate, ramp_s * i / max(1, total), grace)
             for i, (j, plan) in plans]
    return await asyncio.gather(*tasks)


def _sessions_process(payload) -> list[dict]:
    """A client process's share of the sessions (``--procs``)."""
    return asyncio.run(_run_sessions(*payload))


class ServerUsage:
    """The server's CPU use (process ``pid`` and its descendants, utime + stime from /proc) and every GPU's use
    (``nvidia-smi``, when it exists), sampled every ``period`` s in a thread between ``start()`` and ``stop()``.
    CPU percent: 100 = one core busy."""

    def __init__(self, pid: int | None, period: float = 1.0):
        import os
        import shutil

        self.pid, self.period = pid, period
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.smi = shutil.which("nvidia-smi")
        self.cpu, self.gpu = [], []
        self._stop = threading.Event()
        self._thread = None

    def cpu_seconds(self) -> float | None:
        import os

        if self.pid is None or not os.path.exists(f"/proc/{self.pid}/stat"):
            return None
        stats = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        rest = f.read().rsplit(")", 1)[1].split()
                    stats[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / self.ticks)
                except (OSError, IndexError, ValueError):
                    pass
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            p = frontier.pop()
            kids = [c for c, (pp, _) in stats.items() if pp == p and c not in tree]
            tree.update(kids)
            frontier += kids
        return sum(stats[p][1] for p in tree if p in stats)

    def gpu_sample(self) -> list | None:
        import subprocess

        if not self.smi:
            return None
        try:
            out = subprocess.run([self.smi, "--query-gpu=index,utilization.gpu,memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                                 check=False)
            return [tuple(float(v) for v in line.split(",")) for line in out.stdout.strip().splitlines() if line]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def _loop(self) -> None:
        last = (time.perf_counter(), self.cpu_seconds())
        while not self._stop.wait(self.period):
            now = (time.perf_counter(), self.cpu_seconds())
            if now[1] is not None and last[1] is not None:
                self.cpu.append(100 * (now[1] - last[1]) / (now[0] - last[0]))
            last = now
            g = self.gpu_sample()
            if g:
                self.gpu.append(g)

    def start(self) -> ServerUsage:
        self._t0, self._c0 = time.perf_counter(), self.cpu_seconds()
        self._thread = threading.Thread(target=self._loop, name="glmasr-loadgen-usage", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(15)
        c1, wall = self.cpu_seconds(), time.perf_counter() - self._t0
        import os

        out = {"cpu_percent": None if c1 is None or self._c0 is None else round(100 * (c1 - self._c0) / wall, 1),
               "cpu_percent_max": round(max(self.cpu), 1) if self.cpu else None, "cpu_count": os.cpu_count(),
               "gpus": None}
        if self.gpu:
            gpus = {}
            for sample in self.gpu:
                for idx, util, mem in sample:
                    gpus.setdefault(int(idx), []).append((util, mem))
            out["gpus"] = [{"index": i, "util_percent_mean": round(float(np.mean([u for u, _ in v])), 1),
                            "util_percent_max": max(u for u, _ in v), "memory_mib_max": max(m for _, m in v)}
                           for i, v in sorted(gpus.items())]
        return out


def _dist(values: list[float], to_ms: float = 1e3) -> dict:
    """n, p50/p95/p99 and max of ``values`` in ms (``to_ms``: ms per unit of the values)."""
    def ms(v):
        return None if v is None else round(v * to_ms, 1)

    return {"n": len(values), **{f"p{q}": ms(percentile(values, q)) for q in (50, 95, 99)},
            "max": ms(max(values)) if values else None}


def run_realtime(url: str, api_key: str, passes: list[SpeechPass], sessions: int, seconds: float,
                 settings: RealtimeSettings, server_pid: int | None = None, procs: int = 1,
                 ramp_s: float | None = None, grace: float = 30.0, seed: int = 0) -> dict:
    """One level: ``sessions`` live sessions for ``seconds`` (each to its next pause) over ``procs`` client
    processes (1: this one, in an event loop here), their starts spread over ``ramp_s`` (None: the mean time
    between turns of the audio, at least 1 s); returns the level's row (see the module docstring)."""
    import concurrent.futures
    import multiprocessing

    if ramp_s is None:
        ramp_s = max(1.0, float(np.mean([sp.seconds / len(sp.cuts) for sp in passes])))
    ws_url = realtime_ws_url(url)
    plans = list(enumerate(session_plans(passes, sessions, seconds, seed)))
    usage = ServerUsage(server_pid).start()
    t0 = time.perf_counter()
    if procs <= 1:
        results = asyncio.run(_run_sessions(ws_url, api_key, passes, plans, settings, None, ramp_s, sessions,
                                            grace))
    else:
        shares = [share for share in (plans[p::procs] for p in range(procs)) if share]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as ex:
            barrier = manager.Barrier(len(shares))  # every process's sessions connected: the level starts
            futs = [ex.submit(_sessions_process, (ws_url, api_key, passes, share, settings, barrier, ramp_s,
                                                  sessions, grace)) for share in shares]
            results = [r for f in futs for r in f.result()]
    wall = time.perf_counter() - t0
    server = usage.stop()
    merged = {k: [] for k in ("latency", "first_delta", "stop_delay", "partial_gaps", "first_update", "boundary_ms",
                              "send_lag", "start_late", "errors")}
    counts = {k: 0 for k in ("expected", "committed", "completed", "failed", "unfinished", "missed", "extra",
                             "session_failed", "partial_updates")}
    audio_s = 0.0
    for r in results:
        for k in merged:
            merged[k] += r[k]
        for k in counts:
            counts[k] += r[k]
        audio_s += r["audio_s"]
    turns = {k: counts[k] for k in ("expected", "committed", "completed", "failed", "unfinished", "missed",
                                    "extra")}
    turns["lost"] = counts["unfinished"] + counts["missed"]
    return {"sessions": sessions, "seconds": seconds, "partials": settings.partials, "chunk_ms": settings.chunk_ms,
            "ramp_s": round(ramp_s, 2), "wall_s": round(wall, 2), "audio_s": round(audio_s, 1),
            "sessions_failed": counts["session_failed"],
            "turns": turns,
            "end_of_speech_to_completed_ms": _dist(merged["latency"]),
            "end_of_speech_to_first_delta_ms": _dist(merged["first_delta"]),
            "end_of_speech_to_speech_stopped_ms": _dist(merged["stop_delay"]),
            "partial_interval_ms": _dist(merged["partial_gaps"]), "partial_updates": counts["partial_updates"],
            "onset_to_first_update_ms": _dist(merged["first_update"]),
            "turn_end_vs_offline_ms": _dist(merged["boundary_ms"], to_ms=1.0),
            "client_send_lag_ms": _dist(merged["send_lag"]),
            "session_start_late_ms": _dist(merged["start_late"]),
            "server": server, "errors": merged["errors"][:10]}


def realtime_table(rows: list[dict]) -> str:
    def d(r, key, qs=(50, 95, 99)):
        return " / ".join(str(r[key][f"p{q}"]) for q in qs)

    def gpu(r):
        g = r["server"]["gpus"]
        return " ".join(f"{x['util_percent_mean']}" for x in g) if g else "-"

    head = ("| sessions | partials | turns expected / completed / failed / lost | end of speech -> completed "
            "p50 / p95 / p99 ms | -> first delta p50 / p95 ms | partial interval p50 / p95 ms | server CPU % | "
            "GPU util % | client lag p99 ms | session start late max ms |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['sessions']} | {'on' if r['partials'] else 'off'} | {r['turns']['expected']} / "
        f"{r['turns']['completed']} / {r['turns']['failed']} / {r['turns']['lost']} | "
        f"{d(r, 'end_of_speech_to_completed_ms')} | {d(r, 'end_of_speech_to_first_delta_ms', (50, 95))} | "
        f"{d(r, 'partial_interval_ms', (50, 95))} | {r['server']['cpu_percent']} | {gpu(r)} | "
        f"{r['client_send_lag_ms']['p99']} | {r.get('session_start_late_ms', {}).get('max')} |\n" for r in rows)


def realtime_ok(rows: list[dict]) -> bool:
    """Every level lost and failed nothing, and every session connected."""
    return all(r["turns"]["lost"] == 0 and r["turns"]["failed"] == 0 and r["sessions_failed"] == 0 for r in rows)


def realtime_passes(files, settings: RealtimeSettings, seconds: float = 20.0, seed: int = 0) -> list[SpeechPass]:
    """The passes sessions loop: one per file, else one of synthesized speech (``synthesize_speech``)."""
    if files:
        return [load_speech_pass(f, settings) for f in files]
    return [speech_pass(synthesize_speech(seconds, seed), settings, name="espeak-ng speech")]


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
    rt = p.add_argument_group("realtime mode (--realtime: live sessions on /v1/realtime)")
    rt.add_argument("--realtime", action="store_true", help="run live sessions instead of uploads")
    rt.add_argument("--sessions", default="1,8,32", help="comma-separated numbers of concurrent sessions")
    rt.add_argument("--audio", nargs="+", default=None, metavar="FILE",
                    help="speech with pauses to stream (default: sentences synthesized with espeak-ng)")
    rt.add_argument("--speech-seconds", type=float, default=20.0, help="length of the synthesized speech")
    rt.add_argument("--chunk-ms", type=int, default=40, help="audio per append, 20-100 ms (default 40)")
    rt.add_argument("--partials", action="store_true", help="ask for partial results (the opt-in extension)")
    rt.add_argument("--partial-hop-ms", type=int, default=None, help="with --partials: the draft hop (server default)")
    rt.add_argument("--threshold", type=float, default=0.5, help="server_vad threshold")
    rt.add_argument("--prefix-padding-ms", type=int, default=300)
    rt.add_argument("--silence-duration-ms", type=int, default=500)
    rt.add_argument("--server-pid", type=int, default=None, help="measure this process's (and children's) CPU")
    rt.add_argument("--procs", type=int, default=1, help="client processes the sessions are spread over")
    rt.add_argument("--ramp", type=float, default=None,
                    help="seconds over which the sessions start streaming (default: the audio's mean turn period)")
    args = p.parse_args(argv)
    if (args.url is None) == (not args.serve):
        p.error("give --url or --serve")
    if args.realtime:
        return main_realtime(p, args)
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


def _levels(p, text: str, flag: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        p.error(f"{flag} must be comma-separated positive integers, got {text!r}")
    return levels


def main_realtime(p, args) -> int:
    """``--realtime``: the levels of live sessions; JSON on stdout (and ``--json``), the table on stderr; exit
    status 1 when a turn was lost or failed or a session could not connect."""
    import os

    from ..checkpoint.weights import DEFAULT_MODEL_ID

    levels = _levels(p, args.sessions, "--sessions")
    try:
        settings = RealtimeSettings(threshold=args.threshold, prefix_padding_ms=args.prefix_padding_ms,
                                    silence_duration_ms=args.silence_duration_ms, partials=args.partials,
                                    partial_hop_ms=args.partial_hop_ms, chunk_ms=args.chunk_ms,
                                    model=args.served_name)
        passes = realtime_passes(args.audio, settings, args.speech_seconds)
    except (ValueError, RuntimeError, OSError) as e:
        p.error(str(e))
    out = {"mode": "realtime", "settings": {k: getattr(settings, k) for k in (
               "threshold", "prefix_padding_ms", "silence_duration_ms", "partials", "partial_hop_ms", "chunk_ms",
               "model")},
           "audio": [{"name": sp.name, "seconds": round(sp.seconds, 2), "turns": len(sp.turns)} for sp in passes],
           "levels": []}
    server, url, pid = None, args.url, args.server_pid
    if args.serve:
        import glmasr

        asr = glmasr.load(args.model or DEFAULT_MODEL_ID, device=args.device, max_batch=args.max_batch)
        server = BackgroundServer(asr)
        server.wait_ready()
        url, pid = server.url, os.getpid()
    try:
        for n in levels:
            row = run_realtime(url, args.api_key, passes, n, args.seconds, settings, server_pid=pid,
                               procs=args.procs, ramp_s=args.ramp, grace=args.grace)
            out["levels"].append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    print(realtime_table(out["levels"]), file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if realtime_ok(out["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
