"""``glmasr serve --frontends 2``: a supervisor, two front-end processes (uvicorn each, one port through
SO_REUSEPORT) and one CPU engine process on the tiny checkpoint (``glmasr.server.frontends``,
``glmasr.workers.attached``), on 127.0.0.1, driven by the real ``openai`` client, ``httpx2`` and ``websockets``.

The references are the single-engine server (``create_app(asr)``, in this process) for uploads and the engine
itself (``asr.submit``) for realtime turns: texts must be token-exact. The engine's ``step_delay`` hook
(``workers/process.py``) slows every step while a flag file exists, so requests are in flight when a process is
killed. Each answer names its front-end (``X-Glmasr-Frontend``); ``/health`` with the key gives its pid. One
server serves the whole module (a front-end and the engine are killed and come back); the SIGTERM test is last.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
websockets = pytest.importorskip("websockets")
from starlette.testclient import TestClient  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from glmasr.cli import serve as server_cli  # noqa: E402
from glmasr.options import DecodeOptions  # noqa: E402
from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.server.frontends import SharedCount, frontend_threads, share  # noqa: E402
from glmasr.workers.process import cores  # noqa: E402

from conftest import noise  # noqa: E402
from live_server import ready_frontends  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "glm-asr-nano-2512"
STEP_DELAY = 0.2
COMPLETED = "conversation.item.input_audio_transcription.completed"
FAILED = "conversation.item.input_audio_transcription.failed"
MANUAL = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}

LAUNCHER = """
import json, os, sys
if __name__ == "__main__":
    from glmasr.workers import requests as data_parallel
    data_parallel._TEST_HOOKS = json.loads(os.environ["GLMASR_TEST_WORKER_HOOKS"])
    from glmasr.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def encode(samples: np.ndarray, rate: int = 16000) -> bytes:
    b = io.BytesIO()
    sf.write(b, samples, rate, format="WAV")
    return b.getvalue()


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1 - 2 ** -15) * 32768).astype("<i2").tobytes()


def as_float(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics")


def reached(text: str, frontend: int, kind: str = "transcription") -> float:
    return metric(text, f'glmasr_frontend_requests_total{{frontend="{frontend}",kind="{kind}"}}')


class Frontends:
    """``glmasr serve --frontends 2`` in a subprocess."""

    def __init__(self, folder, tmp):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.flag = tmp / "slow"
        launcher = tmp / "launch.py"
        launcher.write_text(LAUNCHER)
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   GLMASR_TEST_WORKER_HOOKS=json.dumps({"step_delay": [str(self.flag), STEP_DELAY]}))
        self.log_path = tmp / "server.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(launcher), "serve", "--model", str(folder), "--device", "cpu", "--frontends", "2",
             "--host", "127.0.0.1", "--port", str(self.port), "--api-key", KEY, "--max-batch", "8", "--warmup",
             "request", "--max-realtime-sessions", "40", "--drain-timeout", "20", "--log-level", "warning"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, timeout=60)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def get(self, path: str, **kw):
        """A request on a fresh connection (each may reach either front-end)."""
        with httpx2.Client(base_url=self.base, timeout=30) as c:
            return c.get(path, **kw)

    def health(self) -> dict:
        return self.get("/health", headers=AUTH).json()

    def healthy(self) -> bool:
        assert self.proc.poll() is None, self.output()
        try:
            return self.get("/health").status_code == 200
        except httpx2.TransportError:
            return False

    def frontend_pids(self, timeout: float = 30.0) -> dict[int, int]:
        """front-end index -> pid, once both answered ready on fresh connections (the fixture's wait sees only
        whichever front-end answers first; the other may still be warming up)."""
        return ready_frontends(self.base, 2, timeout)

    def metrics(self) -> str:
        return self.get("/metrics").text

    @contextmanager
    def slow(self):
        self.flag.write_text("1")
        try:
            yield
        finally:
            self.flag.unlink()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def fe(tiny_shipped, tmp_path_factory):
    server = Frontends(tiny_shipped, tmp_path_factory.mktemp("frontends"))
    try:
        wait_for(server.healthy, 90, "the front-ends and the engine", 0.1)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def single(asr):
    app = create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))
    with TestClient(app, base_url="http://testserver") as tc:
        wait_for(lambda: tc.get("/health", headers=AUTH).status_code == 200, 30, "the single-engine server")
        yield tc


@pytest.fixture(scope="module")
def clips():
    return {f"k{i}.wav": encode(noise(2.0 + 0.25 * (i % 4), 300 + i)) for i in range(12)} | \
        {"long.wav": encode(noise(30.0, 7, rate=8000), 8000)}


def ref_text(single, name, data) -> str:
    r = single.post("/v1/audio/transcriptions", data={"model": MODEL}, files={"file": (name, data)}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["text"]


# ---- no server: flags and the shared counts ----
def test_bad_flag_combinations_are_refused_with_a_clear_error(tiny_shipped, capsys):
    for argv, match in [(["--frontends", "2", "--aligner", str(tiny_shipped / "no_head")], "aligner '"),
                        (["--frontends", "2", "--data-parallel", "2", "--device", "cpu"], "--devices"),
                        (["--frontends", "2", "--data-parallel", "2", "--devices", "cpu"], "names 1 devices"),
                        (["--frontends", "4", "--device", "cpu", "--max-connections", "3"],
                         "--max-connections 3 is split over the front-ends"),
                        (["--frontends", "3", "--device", "cpu", "--max-uploads", "2"], "--max-uploads 2")]:
        assert server_cli.main(["--model", str(tiny_shipped), *argv]) == 2, argv
        assert match in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as e:
        server_cli.main(["--model", str(tiny_shipped), "--frontends", "0"])
    assert e.value.code == 2 and "--frontends" in capsys.readouterr().err


def test_split_limits_sum_to_the_flag_and_shared_counts_never_pass_the_limit():
    from multiprocessing.sharedctypes import RawArray

    rng = np.random.default_rng(5)
    for n, k in [(1024, 4), (7, 3), (5, 5), (int(rng.integers(10, 500)), int(rng.integers(1, 9)))]:
        parts = [share(n, k, i) for i in range(k)]
        assert sum(parts) == n and max(parts) - min(parts) <= 1
    array = RawArray("q", 3)
    counts = [SharedCount(array, i, 5) for i in range(3)]
    held = [0, 0, 0]
    for i in rng.integers(0, 3, 40):  # random reservations and releases over three "front-ends"
        if rng.random() < 0.3 and held[i]:
            counts[i].release()
            held[i] -= 1
        elif counts[i].reserve():
            held[i] += 1
        assert sum(held) == counts[0].total() <= 5
    while counts[0].reserve():  # the rest of the limit, then no more on any front-end
        held[0] += 1
    assert counts[0].total() == sum(held) == 5 and not counts[1].reserve() and not counts[2].reserve()


# ---- a live --frontends 2 server ----
def test_health_metrics_and_both_frontends_answer(fe):
    pids = fe.frontend_pids()
    h = fe.health()
    assert h["status"] == "ok" and h["max_queue"] == 4 * 8
    engine_pid = h["workers"][0]["pid"]
    assert len(set(pids.values()) | {engine_pid, fe.proc.pid, os.getpid()}) == 5  # five distinct processes
    # the cores split over the two front-ends' VAD pools (torch's default would be one thread per core in each)
    assert h["frontend"]["threads"] == frontend_threads(2) == max(1, cores() // 2)
    m = fe.metrics()
    for name in ("glmasr_requests_total", "glmasr_queue_depth", "glmasr_engine_pending_requests",
                 "glmasr_realtime_drafts_total", "glmasr_realtime_active_sessions"):
        assert name in m
    assert fe.get("/health").headers["x-glmasr-frontend"] in ("0", "1")


def test_concurrent_uploads_equal_the_single_server_and_spread_over_both_frontends(fe, single, clips):
    names = [f"k{i}.wav" for i in range(12)]
    want = {n: ref_text(single, n, clips[n]) for n in names}
    before = fe.metrics()

    def one(i, n):  # each on its own connection: the kernel's hash picks the front-end
        with httpx2.Client(base_url=fe.base, timeout=60) as c:
            fields = {"model": MODEL, "stream": "true" if i % 3 == 0 else "false"}
            r = c.post("/v1/audio/transcriptions", data=fields, files={"file": (n, clips[n])}, headers=AUTH)
            assert r.status_code == 200, r.text
            if i % 3 == 0:
                events = [json.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: {")]
                assert events[-1]["type"] == "transcript.text.done"
                assert "".join(e["delta"] for e in events[:-1]) == events[-1]["text"]
                return events[-1]["text"], r.headers["x-glmasr-frontend"]
            return r.json()["text"], r.headers["x-glmasr-frontend"]

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda a: one(*a), enumerate(names), timeout=90))
    assert [t for t, _ in got] == [want[n] for n in names]
    assert {f for _, f in got} == {"0", "1"}, got
    after = fe.metrics()
    per = [reached(after, i) - reached(before, i) for i in (0, 1)]
    assert sum(per) == 12 and min(per) >= 1, per  # the scrape sums both front-ends' counters
    ok = 'glmasr_requests_total{outcome="ok"}'
    assert metric(after, ok) - metric(before, ok) == 12
    # the openai client too
    assert fe.client.audio.transcriptions.create(file=("k0.wav", clips["k0.wav"]), model=MODEL).text == want["k0.wav"]
    wait_for(lambda: metric(fe.metrics(), "glmasr_engine_pending_requests") == 0, 10, "an idle engine")


def chunks(data: bytes, seed: int):
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(data):
        n = int(rng.integers(480, 2400)) * 2
        out.append(data[i:i + n])
        i += n
    return out


async def realtime_turn(base: str, raw: bytes, seed: int, started=None) -> tuple[str, dict]:
    """One manual turn of 24 kHz PCM: (the front-end that served it, its completed or failed event)."""
    url = base.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    async with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        frontend = ws.response.headers["x-glmasr-frontend"]
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": MANUAL}))
        assert json.loads(await ws.recv())["type"] == "session.updated"
        for piece in chunks(raw, seed):
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(piece).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        if started is not None:
            started.set()
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] in (COMPLETED, FAILED, "error"):
                return frontend, ev


def test_realtime_sessions_equal_the_engine_and_spread(fe, asr):
    raws = [pcm16(noise(1.5 + 0.25 * i, 400 + i, rate=24000)) for i in range(8)]
    want = [asr.submit(as_float(r), DecodeOptions(), sampling_rate=24000).result().text for r in raws]
    before = fe.metrics()

    async def main():
        return await asyncio.gather(*(realtime_turn(fe.base, r, i) for i, r in enumerate(raws)))

    got = asyncio.run(asyncio.wait_for(main(), 90))
    assert [ev["type"] for _, ev in got] == [COMPLETED] * 8, got
    assert [ev["transcript"] for _, ev in got] == want
    after = fe.metrics()
    per = [reached(after, i, "realtime") - reached(before, i, "realtime") for i in (0, 1)]
    assert per == [sum(f == str(i) for f, _ in got) for i in (0, 1)] and sum(per) == 8
    assert metric(after, "glmasr_realtime_sessions_total") - metric(before, "glmasr_realtime_sessions_total") == 8
    assert metric(after, "glmasr_realtime_turns_total") - metric(before, "glmasr_realtime_turns_total") == 8


def test_a_killed_frontend_loses_only_its_requests_and_comes_back(fe, single, clips):
    data = clips["long.wav"]
    want = ref_text(single, "long.wav", data)
    pids = fe.frontend_pids()
    streams = []  # (front-end, client, response) of streamed requests whose answers have begun

    def open_stream():
        c = httpx2.Client(base_url=fe.base, timeout=60)
        req = c.build_request("POST", "/v1/audio/transcriptions", data={"model": MODEL, "stream": "true"},
                              files={"file": ("long.wav", data)}, headers=AUTH)
        r = c.send(req, stream=True)
        assert r.status_code == 200
        streams.append((r.headers["x-glmasr-frontend"], c, r))

    def finish(item):
        _, c, r = item
        try:
            text = "".join(r.iter_text())
            events = [json.loads(ln[6:]) for ln in text.split("\n") if ln.startswith("data: {")]
            return events[-1]["text"] if events and events[-1]["type"] == "transcript.text.done" else "incomplete"
        except httpx2.TransportError:
            return "lost"
        finally:
            r.close()
            c.close()

    with fe.slow():
        for _ in range(12):  # until both front-ends hold some (each connection is hashed anew)
            open_stream()
            if len(streams) >= 4 and {f for f, _, _ in streams} == {"0", "1"}:
                break
        assert {f for f, _, _ in streams} == {"0", "1"}
        victim = int(streams[0][0])
        os.kill(pids[victim], signal.SIGKILL)
        with ThreadPoolExecutor(len(streams)) as pool:
            outcomes = list(pool.map(finish, streams, timeout=90))
    for (f, _, _), got in zip(streams, outcomes):
        if int(f) == victim:
            assert got in ("lost", "incomplete"), got
        else:
            assert got == want
    # it comes back with a new pid, and serves again
    new = wait_for(lambda: (lambda p: p if p[victim] != pids[victim] else None)(fe.frontend_pids()), 60,
                   "the restarted front-end")
    assert new[1 - victim] == pids[1 - victim]
    assert "restarting it" in fe.output()
    # the restarted one listens once warmed up: every answer from now on is a healthy one
    statuses = {fe.health()["status"] for _ in range(10)}
    assert statuses == {"ok"}, statuses
    texts = [fe.client.audio.transcriptions.create(file=("k1.wav", clips["k1.wav"]), model=MODEL).text
             for _ in range(3)]
    assert texts == [ref_text(single, "k1.wav", clips["k1.wav"])] * 3
    wait_for(lambda: metric(fe.metrics(), "glmasr_engine_pending_requests") == 0, 10, "an idle engine")


def test_a_killed_engine_gives_503s_and_the_frontends_reconnect(fe, single, clips):
    data = clips["long.wav"]
    want = ref_text(single, "long.wav", data)
    engine_pid = fe.health()["workers"][0]["pid"]
    raw = pcm16(noise(2.0, 77, rate=24000))

    def plain():
        try:
            return fe.client.audio.transcriptions.create(file=("long.wav", data), model=MODEL).text, time.monotonic()
        except openai.APIStatusError as e:
            return e, time.monotonic()

    with fe.slow(), ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(plain) for _ in range(3)]
        turn = pool.submit(lambda: asyncio.run(asyncio.wait_for(realtime_turn(fe.base, raw, 3), 60)))
        wait_for(lambda: metric(fe.metrics(), "glmasr_engine_pending_requests") >= 4, 20, "4 requests in the engine")
        t_kill = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        outcomes = [f.result(timeout=30) for f in futs]
        _, ev = turn.result(timeout=30)
    for e, t in outcomes:
        assert isinstance(e, openai.APIStatusError), e
        assert e.status_code == 503 and e.code == "worker_died", e
        assert t - t_kill < 3.0  # at once, not when the request would have finished
    assert ev["type"] == FAILED and ev["error"]["code"] == "worker_died", ev
    # while the engine restarts: unavailable, never a hang; then the front-ends reconnect
    wait_for(lambda: fe.health()["status"] == "ok", 60, "the restarted engine")
    h = fe.health()["workers"][0]
    assert h["pid"] != engine_pid and h["restarts"] >= 1
    assert fe.client.audio.transcriptions.create(file=("long.wav", data), model=MODEL).text == want


def test_sigterm_drains_everything_and_exits_0(fe, single, clips):
    """Last: stops the module's server."""
    data = clips["long.wav"]
    want = ref_text(single, "long.wav", data)
    pids = fe.frontend_pids()
    engine_pid = fe.health()["workers"][0]["pid"]
    results = {}

    def stream_one():
        results["stream"] = list(fe.client.audio.transcriptions.create(file=("a.wav", data), model=MODEL,
                                                                       stream=True))[-1]

    def plain_one():
        results["plain"] = fe.client.audio.transcriptions.create(file=("b.wav", data), model=MODEL).text

    with fe.slow(), ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(stream_one), pool.submit(plain_one)]
        wait_for(lambda: metric(fe.metrics(), "glmasr_engine_pending_requests") >= 2, 20, "both in the engine")
        fe.proc.send_signal(signal.SIGTERM)
        for f in futs:
            f.result(timeout=60)
    assert fe.proc.wait(60) == 0, fe.output()
    assert results["stream"].type == "transcript.text.done"
    assert results["stream"].text == results["plain"] == want
    for pid in [*pids.values(), engine_pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
