"""``glmasr serve --data-parallel``: one front end, two CPU engine worker processes on the tiny checkpoint
(``glmasr.workers.requests``), tested with the real ``openai`` client in-process (Starlette's TestClient) and
against a real ``glmasr serve --data-parallel 2 --devices cpu,cpu`` (uvicorn) on 127.0.0.1.

The reference is the single-engine server (``create_app(asr)``) answering the same bytes: every format, stream
and error must be what it answers. Worker hooks (``workers/process.py``): ``step_delay`` slows every engine step
while a flag file exists (a request then lasts long enough to be killed or cut off), ``crash_on_prompt`` makes
a worker ``os._exit`` on that instruction. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
from starlette.testclient import TestClient  # noqa: E402

import glmasr  # noqa: E402
from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.cli import serve as server_cli  # noqa: E402
from glmasr.workers.requests import DataParallelEngineClient  # noqa: E402

from asgi_client import DisconnectingUpload  # noqa: E402
from conftest import noise  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # /health shows the workers only to a caller with the key
MODEL = "glm-asr-nano-2512"
MAGIC = "glmasr-test: crash this worker"
STEP_DELAY = 0.2
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def encode(samples: np.ndarray, fmt: str = "WAV", rate: int = 16000) -> bytes:
    b = io.BytesIO()
    sf.write(b, samples, rate, format=fmt)
    return b.getvalue()


def wait_for(cond, timeout: float, what: str, interval: float = 0.02):
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


def worker_metric(text: str, name: str, worker: int) -> float:
    return metric(text, f'{name}{{device="cpu",worker="{worker}"}}')


@pytest.fixture(scope="module")
def clips():
    """name -> upload bytes: mixed formats, rates and lengths (d.wav: one full 30 s window)."""
    out = {}
    for name, seconds, seed, fmt, rate in [("a.wav", 5, 2, "WAV", 16000), ("b.flac", 10, 3, "FLAC", 16000),
                                           ("c.ogg", 3, 4, "OGG", 22050), ("d.wav", 30, 2, "WAV", 8000)]:
        out[name] = encode(noise(seconds, seed, rate=rate), fmt, rate)
    for i in range(8):  # for the concurrent clients: a different file each, as long as each other
        out[f"k{i}.wav"] = encode(noise(3.0, 100 + i))
    return out


@pytest.fixture(scope="module")
def single(asr):
    """The single-engine server: the reference."""
    app = create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))
    with TestClient(app, base_url="http://testserver") as tc:
        wait_for(lambda: tc.get("/health", headers=AUTH).status_code == 200, 30, "the single-engine server")
        yield tc


class DP:
    def __init__(self, tc, engine, slow_flag):
        self.tc, self.engine, self.slow_flag = tc, engine, slow_flag
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)

    def health(self) -> dict:
        return self.tc.get("/health", headers=AUTH).json()

    def metrics(self) -> str:
        return self.tc.get("/metrics").text

    @contextmanager
    def slow(self):
        self.slow_flag.write_text("1")
        try:
            yield
        finally:
            self.slow_flag.unlink()

    def wait_all_ready(self, timeout=60.0):
        wait_for(lambda: self.health()["status"] == "ok", timeout, "every worker ready", 0.05)


@pytest.fixture(scope="module")
def dp(tiny_shipped, tmp_path_factory):
    flag = tmp_path_factory.mktemp("dp") / "slow"
    engine = DataParallelEngineClient(["cpu", "cpu"], model=tiny_shipped, max_batch=8, drain_timeout_s=10,
                                      _test_hooks={"step_delay": (str(flag), STEP_DELAY), "crash_on_prompt": MAGIC})
    app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup="request"))
    try:
        with TestClient(app, base_url="http://testserver") as tc:
            wait_for(lambda: tc.get("/health", headers=AUTH).status_code == 200, 60, "the engine workers")
            yield DP(tc, engine, flag)
    finally:
        engine.close(timeout=10)


def post(tc, data, files, key=KEY):
    return tc.post("/v1/audio/transcriptions", data=data, files=files, headers={"Authorization": f"Bearer {key}"})


def _has_vad() -> bool:
    try:
        from glmasr.audio.vad import load_vad

        load_vad("cpu")
        return True
    except Exception:  # noqa: BLE001 - no vad extra: that part is left out
        return False


def same_verbose(a: dict, b: dict) -> None:
    """verbose_json bodies equal; a segment's avg_logprob to fp32 rounding (the workers run one torch thread)."""
    sa, sb = a.pop("segments"), b.pop("segments")
    assert a == b
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        lx, ly = x.pop("avg_logprob"), y.pop("avg_logprob")
        assert x == y
        assert lx == pytest.approx(ly, rel=1e-4, abs=1e-5)


# ---- in-process front end, two CPU engine workers ----
def test_health_lists_the_workers_and_metrics_have_per_worker_series(dp):
    h = dp.health()
    assert h["status"] == "ok" and len(h["workers"]) == 2
    pids = {w["pid"] for w in h["workers"]}
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(w["state"] == "ready" and w["device"] == "cpu" for w in h["workers"])
    assert h["max_queue"] == 4 * 16  # 4 x the slots of both engines
    m = dp.metrics()
    for name in ("glmasr_requests_total", "glmasr_audio_seconds_total", "glmasr_queue_depth",
                 "glmasr_engine_pending_requests", "glmasr_time_to_first_token_seconds_bucket",
                 "glmasr_request_latency_seconds_bucket", "glmasr_generated_tokens_total",
                 "glmasr_prompt_tokens_total"):
        assert name in m
    for name in ("glmasr_worker_up", "glmasr_worker_in_flight_requests", "glmasr_worker_in_flight_audio_seconds",
                 "glmasr_worker_requests_total", "glmasr_worker_failures_total", "glmasr_worker_restarts_total"):
        for w in (0, 1):
            worker_metric(m, name, w)
    assert worker_metric(m, "glmasr_worker_up", 0) == worker_metric(m, "glmasr_worker_up", 1) == 1.0


def test_every_format_equals_the_single_engine_server(dp, single, clips):
    before = dp.metrics()
    n = 0
    decoded = 0  # requests with engine work: srt, vtt and verbose_json follow the speech, and these clips are noise
    for name in ("a.wav", "c.ogg", "d.wav"):
        for fmt in FORMATS:
            fields = {"model": MODEL, "response_format": fmt}
            if fmt == "verbose_json":
                fields["timestamp_granularities[]"] = "segment"
            got, want = (post(tc, fields, {"file": (name, clips[name])}) for tc in (dp.tc, single))
            n += 1
            decoded += fmt in ("json", "text")
            assert got.status_code == want.status_code == 200, got.text
            assert got.headers["content-type"] == want.headers["content-type"]
            if fmt == "verbose_json":
                same_verbose(got.json(), want.json())
            else:
                assert got.text == want.text, (name, fmt)
    # the instruction (prompt + keywords) reaches the worker's model
    fields = {"model": MODEL, "prompt": "Transcribe this, please", "keywords[]": ["GLM", "Zhipu AI"]}
    got, want = (post(tc, fields, {"file": ("b.flac", clips["b.flac"])}) for tc in (dp.tc, single))
    n += 1
    decoded += 1
    assert got.status_code == want.status_code == 200 and got.json() == want.json()
    # chunking_strategy: the front end's VAD pieces travel with the samples (one segment each, true times)
    if _has_vad():
        from glmasr.checkpoint.resources import sample_audio

        speech = sample_audio().read_bytes()
        fields = {"model": MODEL, "chunking_strategy": "auto", "response_format": "verbose_json"}
        got, want = (post(tc, fields, {"file": ("speech", speech)}) for tc in (dp.tc, single))
        n += 1
        decoded += 1
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["segments"][-1]["end"] < got.json()["duration"]  # a VAD piece, not the 30 s window
        same_verbose(got.json(), want.json())
    # errors the engine raises while planning come back from the worker as the same 400
    too_short = encode(noise(0.02, 1))
    got, want = (post(tc, {"model": MODEL}, {"file": ("x.wav", too_short)}) for tc in (dp.tc, single))
    assert got.status_code == want.status_code == 400 and got.json() == want.json()
    after = dp.metrics()
    ok = 'glmasr_requests_total{outcome="ok"}'
    assert metric(after, ok) - metric(before, ok) == n
    assert metric(after, 'glmasr_request_latency_seconds_count{stream="false"}') - \
        metric(before, 'glmasr_request_latency_seconds_count{stream="false"}') == n
    # a request whose audio has no speech gets its answer without a first token
    assert metric(after, "glmasr_time_to_first_token_seconds_count") - \
        metric(before, "glmasr_time_to_first_token_seconds_count") == decoded
    assert metric(after, "glmasr_generated_tokens_total") > metric(before, "glmasr_generated_tokens_total")
    assert metric(after, "glmasr_prompt_tokens_total") > metric(before, "glmasr_prompt_tokens_total")
    routed = sum(worker_metric(after, "glmasr_worker_requests_total", w)
                 - worker_metric(before, "glmasr_worker_requests_total", w) for w in (0, 1))
    assert routed == n + 1  # the too-short one went to a worker too (its planning refused it)


def test_streaming_equals_the_single_engine_server(dp, single, clips):
    ref = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=single, max_retries=0)
    for name in ("a.wav", "d.wav"):
        got = list(dp.client.audio.transcriptions.create(file=(name, clips[name]), model=MODEL, stream=True))
        want = list(ref.audio.transcriptions.create(file=(name, clips[name]), model=MODEL, stream=True))
        assert [e.model_dump() for e in got] == [e.model_dump() for e in want]
        assert got[-1].type == "transcript.text.done" and len(got) >= 2
        assert "".join(e.delta for e in got[:-1]) == got[-1].text
    resp = post(dp.tc, {"model": MODEL, "stream": "true"}, {"file": ("upload", clips["a.wav"])})
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["type"] == "transcript.text.done"


def test_concurrent_clients_get_their_own_text_and_both_workers_work(dp, single, clips):
    names = [f"k{i}.wav" for i in range(8)]
    ref = {n: post(single, {"model": MODEL}, {"file": (n, clips[n])}).json()["text"] for n in names}
    before = dp.metrics()

    def one(i, n):
        if i % 2:
            events = list(dp.client.audio.transcriptions.create(file=(n, clips[n]), model=MODEL, stream=True))
            return events[-1].text
        return dp.client.audio.transcriptions.create(file=(n, clips[n]), model=MODEL).text

    with dp.slow(), ThreadPoolExecutor(8) as pool:  # slowed: all eight are in flight at once
        texts = list(pool.map(lambda a: one(*a), enumerate(names), timeout=60))
    assert texts == [ref[n] for n in names]
    after = dp.metrics()
    got = [worker_metric(after, "glmasr_worker_requests_total", w)
           - worker_metric(before, "glmasr_worker_requests_total", w) for w in (0, 1)]
    assert sum(got) == 8 and min(got) >= 2, got  # balanced by audio seconds in flight (4 + 4 when all overlap)
    idle(dp)


def idle(dp, timeout=5.0):
    """Nothing left in the server or its workers (a worker's end follows its last output by a moment)."""
    wait_for(lambda: (lambda m: metric(m, "glmasr_engine_pending_requests") == 0
                      and metric(m, "glmasr_queue_depth") == 0)(dp.metrics()), timeout, "an idle server")


def _outcome(fn):
    try:
        return "ok", fn(), time.monotonic()
    except openai.APIError as e:
        return "error", e, time.monotonic()


def test_killed_worker_fails_its_requests_with_503_and_is_restarted(dp, single, clips):
    data = clips["d.wav"]  # 30 s: ~140 tokens, >= 3.4 s of slowed steps
    ref = post(single, {"model": MODEL}, {"file": ("d.wav", data)}).json()["text"]
    idle(dp)
    before = dp.metrics()
    victim = dp.health()["workers"][0]

    def plain():
        return dp.client.audio.transcriptions.create(file=("d.wav", data), model=MODEL).text

    def streamed():
        return list(dp.client.audio.transcriptions.create(file=("d.wav", data), model=MODEL, stream=True))[-1].text

    with dp.slow(), ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_outcome, fn) for fn in (plain, streamed, plain, streamed)]
        wait_for(lambda: [w["in_flight"] for w in dp.health()["workers"]] == [2, 2], 20, "two requests per worker")
        t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        # while it restarts the server is degraded, not down: the other worker takes every request
        h = wait_for(lambda: (lambda h: h if h["status"] == "degraded" else None)(dp.tc.get("/health", headers=AUTH).json()), 5,
                     "a degraded health")
        assert [w["state"] for w in h["workers"]] == ["starting", "ready"]
        assert dp.tc.get("/health", headers=AUTH).status_code == 200
        outcomes = [f.result(timeout=30) for f in futs]
    failed = [o for o in outcomes if o[0] == "error"]
    assert len(failed) == 2, outcomes
    for _, e, t_end in failed:
        assert "died" in str(e) and getattr(e, "code", None) == "worker_died", e
        if isinstance(e, openai.APIStatusError):  # a plain request (a stream got a 200 and an error event)
            assert e.status_code == 503
        assert t_end - t_kill < 3.0  # at once, not when the request would have finished
    assert [o[1] for o in outcomes if o[0] == "ok"] == [ref, ref]  # the other worker's requests finished
    plain_failed = sum(isinstance(o[1], openai.APIStatusError) for o in failed)
    dp.wait_all_ready()  # restarted, loaded and warmed up again
    h = dp.health()["workers"]
    assert h[0]["restarts"] == 1 and h[0]["pid"] != victim["pid"] and h[1]["restarts"] == 0
    texts = [r.text for r in ThreadPoolExecutor(4).map(
        lambda _: dp.client.audio.transcriptions.create(file=("d.wav", data), model=MODEL), range(4))]
    assert texts == [ref] * 4
    after = dp.metrics()
    assert worker_metric(after, "glmasr_worker_restarts_total", 0) == 1
    assert worker_metric(after, "glmasr_worker_failures_total", 0) - \
        worker_metric(before, "glmasr_worker_failures_total", 0) == 2
    assert worker_metric(after, "glmasr_worker_requests_total", 0) - \
        worker_metric(before, "glmasr_worker_requests_total", 0) >= 3  # it serves again after its restart
    assert metric(after, 'glmasr_requests_total{outcome="unavailable"}') - \
        metric(before, 'glmasr_requests_total{outcome="unavailable"}') == plain_failed
    idle(dp)


def test_a_request_that_crashes_its_worker_gets_503_and_the_next_is_served(dp, clips):
    restarts = sum(w["restarts"] for w in dp.health()["workers"])
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        dp.client.audio.transcriptions.create(file=("a.wav", clips["a.wav"]), model=MODEL, prompt=MAGIC)
    assert e.value.status_code == 503 and e.value.code == "worker_died" and time.monotonic() - t0 < 10
    with pytest.raises(openai.APIError, match="died"):  # a stream: the error event
        list(dp.client.audio.transcriptions.create(file=("a.wav", clips["a.wav"]), model=MODEL, prompt=MAGIC,
                                                   stream=True))
    h = dp.health()  # both workers may be restarting now: with none ready a request is a 503 too, never a hang
    assert h["status"] in ("ok", "degraded", "unavailable")
    dp.wait_all_ready()
    assert sum(w["restarts"] for w in dp.health()["workers"]) == restarts + 2
    text = dp.client.audio.transcriptions.create(file=("a.wav", clips["a.wav"]), model=MODEL).text
    assert isinstance(text, str)


def _multipart(fields: dict, file_bytes: bytes) -> tuple[bytes, str]:
    boundary = "glmasrtestboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="upload"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n".encode() + file_bytes + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request_in_its_worker(dp, clips, stream):
    """Drive the ASGI app directly: the client goes away while a worker decodes its request (a stream: after
    the first delta); the worker must free it at once (its ``end`` arrives), long before it would finish."""
    engine = dp.engine
    app = create_app(engine, ServerConfig(close_engine=False, warmup="none"))
    body, ctype = _multipart({"model": MODEL, "stream": "true" if stream else "false"}, clips["d.wav"])

    def held() -> int:
        return sum(w["in_flight"] for w in engine.workers())

    async def run():
        upload = DisconnectingUpload(body, ctype)
        gone = upload.gone
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(_until(lambda: app.state.glmasr.ready), 30)
            task = upload.start(app)
            if not stream:  # disconnect once a worker is decoding it
                await asyncio.wait_for(_until(lambda: held() == 1), 20)
                await asyncio.sleep(0.5)
                gone.set()
            await asyncio.wait_for(gone.wait(), 20)
            t_gone = time.monotonic()
            await asyncio.wait_for(task, 10)
            await asyncio.wait_for(_until(lambda: held() == 0), 5)
            return upload.sent, time.monotonic() - t_gone

    with dp.slow():
        sent, elapsed = asyncio.run(run())
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"transcript.text.done" not in bodies and b'"text"' not in bodies
    assert elapsed < 2.5  # the request had >= 2.5 s of slowed steps left
    m = app.state.metrics.render().decode()
    assert metric(m, 'glmasr_requests_total{outcome="aborted"}') == 1
    assert worker_metric(m, "glmasr_worker_in_flight_requests", 0) == 0


async def _until(cond, interval=0.01):
    while not cond():
        await asyncio.sleep(interval)


def test_cli_refuses_inconsistent_data_parallel_flags(tiny_shipped, capsys):
    for argv, match in [(["--data-parallel", "2", "--devices", "cpu"], "names 1 devices"),
                        (["--data-parallel", "2", "--device", "cpu"], "--devices"),
                        (["--data-parallel", "0", "--devices", "cpu"], "at least 1"),
                        (["--devices", "cpu,tpu"], "unknown device")]:
        assert server_cli.main(["--model", str(tiny_shipped), *argv]) == 2
        assert match in capsys.readouterr().err


# ---- a real glmasr serve --data-parallel 2 under uvicorn ----
LAUNCHER = """
import json, os, sys
if __name__ == "__main__":
    from glmasr.workers import requests as data_parallel
    data_parallel._TEST_HOOKS = json.loads(os.environ["GLMASR_TEST_WORKER_HOOKS"])
    from glmasr.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def test_live_data_parallel_server_serves_and_sigterm_drains_the_workers(tiny_shipped, tmp_path, clips, single):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    flag = tmp_path / "slow"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               GLMASR_TEST_WORKER_HOOKS=json.dumps({"step_delay": [str(flag), STEP_DELAY]}))
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, str(launcher), "serve", "--model", str(tiny_shipped), "--data-parallel",
                             "2", "--devices", "cpu,cpu", "--host", "127.0.0.1", "--port", str(port), "--api-key",
                             KEY, "--max-batch", "8", "--warmup", "request", "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)

    def output():
        log.flush()
        log.seek(0)
        return log.read()[-3000:]

    http = httpx2.Client(base_url=base, timeout=30)
    try:
        def healthy():
            assert proc.poll() is None, output()
            try:
                return http.get("/health", headers=AUTH).status_code == 200
            except httpx2.TransportError:
                return False
        wait_for(healthy, 60, "the live server", 0.1)
        pids = [w["pid"] for w in http.get("/health", headers=AUTH).json()["workers"]]
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
        data = clips["d.wav"]
        ref = post(single, {"model": MODEL}, {"file": ("d.wav", data)}).json()["text"]
        assert c.audio.transcriptions.create(file=("d.wav", data), model=MODEL).text == ref
        # SIGTERM while a stream and a plain request are in flight: both finish, the workers stop, exit 0
        results = {}

        def stream_one():
            results["stream"] = list(c.audio.transcriptions.create(file=data, model=MODEL, stream=True))[-1]

        def plain_one():
            results["plain"] = c.audio.transcriptions.create(file=("x.wav", data), model=MODEL).text

        flag.write_text("1")
        threads = [threading.Thread(target=stream_one), threading.Thread(target=plain_one)]
        for t in threads:
            t.start()
        wait_for(lambda: metric(http.get("/metrics").text, "glmasr_engine_pending_requests") >= 2, 20,
                 "both requests in the workers")
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0, output()
        assert results["stream"].type == "transcript.text.done"
        assert results["stream"].text == results["plain"] == ref
        for pid in pids:  # the workers are gone too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_two_gpu_workers_sharing_cuda0_equal_the_single_engine_server(tiny_shipped, clips):
    """On the GPU: two engine workers on cuda:0 behind one front end answer concurrent clients with exactly the
    texts and tokens of the single-engine CUDA server, and both get work. fp32 on both sides: in bf16 the
    requests batched beside a clip (which differ between the two servers) may change its logits' last bits."""
    handle = glmasr.load(tiny_shipped, device="cuda", dtype="float32", max_batch=8)
    engine = DataParallelEngineClient(["cuda:0", "cuda:0"], model=tiny_shipped, dtype="float32", max_batch=8,
                                      drain_timeout_s=10)
    names = ["a.wav", "b.flac", "c.ogg", "d.wav"] + [f"k{i}.wav" for i in range(8)]
    try:
        ref_app = create_app(handle, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))
        with TestClient(ref_app, base_url="http://testserver") as ref:
            want = {n: post(ref, {"model": MODEL, "response_format": "verbose_json"}, {"file": (n, clips[n])}).json()
                    for n in names}
        app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup="request"))
        with TestClient(app, base_url="http://testserver") as tc:
            wait_for(lambda: tc.get("/health", headers=AUTH).status_code == 200, 300, "the GPU engine workers", 0.1)
            with ThreadPoolExecutor(len(names)) as pool:
                got = dict(zip(names, pool.map(
                    lambda n: post(tc, {"model": MODEL, "response_format": "verbose_json"},
                                   {"file": (n, clips[n])}).json(), names)))
            requests = [w.get("requests", 0) for w in tc.get("/health", headers=AUTH).json()["workers"]]
        for n in names:
            assert got[n]["text"] == want[n]["text"], n
            assert [s["tokens"] for s in got[n]["segments"]] == [s["tokens"] for s in want[n]["segments"]], n
        assert len(requests) == 2 and all(r > 0 for r in requests), requests
    finally:
        engine.close(timeout=30)
        handle.close()


def test_a_worker_whose_engine_stalls_is_killed_its_requests_get_503_and_it_restarts(tiny_shipped, clips,
                                                                                      tmp_path, single):
    """The watchdog: a worker holding requests whose engine makes no step for ``worker_timeout_s`` (here a step
    that sleeps 60 s: a stuck kernel, a deadlock) is killed, its requests fail with 503 ``worker_died`` naming the
    stall instead of hanging, and it is restarted; an idle worker is never killed for being idle."""
    flag = tmp_path / "stall"
    engine = DataParallelEngineClient(["cpu"], model=tiny_shipped, max_batch=8, drain_timeout_s=10,
                                      worker_timeout_s=2.0, _test_hooks={"step_delay": (str(flag), 60.0)})
    app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup="request"))
    data = clips["a.wav"]
    ref = post(single, {"model": MODEL}, {"file": ("a.wav", data)}).json()["text"]
    try:
        with TestClient(app, base_url="http://testserver") as tc:
            wait_for(lambda: tc.get("/health", headers=AUTH).status_code == 200, 60, "the engine worker")
            client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)
            time.sleep(3.0)  # idle for longer than the timeout: not a stall
            assert tc.get("/health", headers=AUTH).json()["workers"][0]["restarts"] == 0
            pid = tc.get("/health", headers=AUTH).json()["workers"][0]["pid"]
            flag.write_text("1")
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as err:
                client.audio.transcriptions.create(file=("a.wav", data), model=MODEL)
            flag.unlink()
            assert err.value.status_code == 503 and "no progress" in str(err.value), err.value
            assert time.monotonic() - t0 < 15  # the timeout and one watchdog period, not the 60 s step
            wait_for(lambda: tc.get("/health", headers=AUTH).json()["status"] == "ok", 60, "the restarted worker")
            w = tc.get("/health", headers=AUTH).json()["workers"][0]
            assert w["restarts"] == 1 and w["stalls"] == 1 and w["pid"] != pid
            assert client.audio.transcriptions.create(file=("a.wav", data), model=MODEL).text == ref
    finally:
        engine.close(timeout=10)
