"""The server against slow, hostile and malformed clients: connection and upload timeouts, uploads counted apart
from engine work, framing (request smuggling), drain on SIGTERM, what strangers may see, request timeouts, and
fuzzed fields and file headers. Everything runs on 127.0.0.1 (real uvicorn processes) or in-process, bounded in
count and time."""

from __future__ import annotations

import io
import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")
from starlette.testclient import TestClient  # noqa: E402

from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.server.app import served_names  # noqa: E402

from conftest import noise, wait_healthy  # noqa: E402
from live_server import KEY, MODEL, ServerProcess, body_of, multipart, post_head, read_response, status_of  # noqa: E402

ENVELOPE = {"message", "type", "param", "code"}
AUTH = {"Authorization": f"Bearer {KEY}"}


def wav(seconds: float, seed: int, rate: int = 16000) -> bytes:
    b = io.BytesIO()
    sf.write(b, noise(seconds, seed, rate=rate), rate, format="WAV")
    return b.getvalue()


def envelope(raw_body: bytes) -> dict:
    err = json.loads(raw_body)["error"]
    assert set(err) == ENVELOPE, err
    return err


@pytest.fixture(scope="module")
def clip(asr, tmp_path_factory):
    """A 3 s wav upload and the text the engine gives for that file."""
    data = wav(3, 11)
    path = tmp_path_factory.mktemp("clip") / "a.wav"
    path.write_bytes(data)
    return data, asr.submit(str(path)).result().text




@pytest.fixture(scope="module")
def tc(asr):
    app = create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none", max_audio_s=5))
    with TestClient(app, base_url="http://testserver") as client:
        wait_healthy(client.get)
        yield client


def post(tc, data=None, files=None, key=KEY):
    return tc.post("/v1/audio/transcriptions", data=data or {}, files=files,
                   headers={"Authorization": f"Bearer {key}"} if key else {})


# ---- in-process ----
def test_json_accepts_the_segment_granularity_as_openai_does(tc, clip):
    """OpenAI refuses only ``word`` with ``json``; ``segment`` with ``json`` (or ``text``) is accepted."""
    data, text = clip
    for fmt in ("json", "text"):
        r = post(tc, {"model": MODEL, "response_format": fmt, "timestamp_granularities[]": "segment"},
                 {"file": ("a.wav", data)})
        assert r.status_code == 200, r.text
        assert (r.json()["text"] if fmt == "json" else r.text) == text
    r = post(tc, {"model": MODEL, "timestamp_granularities[]": "word"}, {"file": ("a.wav", data)})
    assert r.status_code == 400 and envelope(r.content)["param"] == "timestamp_granularities"


def test_deeply_nested_chunking_strategy_is_a_400(tc, clip):
    data, _ = clip
    for raw in ("[" * 30_000 + "]" * 30_000, '{"type": "server_vad", "threshold": ' + "[" * 400 + "]" * 400 + "}",
                '{"type": ' + "{" * 100 + "}" * 100 + "}"):
        r = post(tc, {"model": MODEL, "chunking_strategy": raw}, {"file": ("a.wav", data)})
        assert r.status_code == 400, r.text[:200]
        assert envelope(r.content)["param"] == "chunking_strategy"


def test_health_tells_strangers_only_the_status(asr, tc, tmp_path):
    for path in ("/health", "/health/live", "/health/ready"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = tc.get(path, headers=headers)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, (path, r.text)
        detailed = tc.get(path, headers=AUTH).json()
        assert detailed["status"] == "ok" and {"in_flight", "max_queue", "uploads", "models"} <= set(detailed)
        assert str(asr.folder) not in json.dumps(detailed)
    # a server without a key shows nobody the details
    app = create_app(asr, ServerConfig(close_engine=False, warmup="none"))
    with TestClient(app, base_url="http://testserver") as open_tc:
        wait_healthy(open_tc.get)
        assert open_tc.get("/health", headers=AUTH).json() == {"status": "ok"}
        # served model ids are names: an absolute checkpoint path (glmasr serve --model /abs/path) is left out
        names = served_names(app.state.engine, [str(asr.folder), str(tmp_path), "my-asr", "org/model"])
        assert names == ("glm-asr-nano-2512", asr.folder.name, "my-asr", "org/model")
        r = open_tc.post("/v1/audio/transcriptions", data={"model": "nope"}, files={"file": ("a.wav", wav(1, 1))})
        assert r.status_code == 404 and str(asr.folder.parent) not in r.text
        ids = [m["id"] for m in open_tc.get("/v1/models").json()["data"]]
        assert all(not i.startswith("/") and str(asr.folder) not in i for i in ids)
    with pytest.raises(ValueError, match="path"):
        ServerConfig(served_names=(str(asr.folder),))


def test_an_internal_error_is_a_500_with_a_reference_only(asr, tc, clip, monkeypatch, caplog):
    """An unexpected exception (a bug) is answered in the envelope with an id; its text, which may hold server
    paths, goes to the log only."""
    from glmasr.server import serving

    def boom(*a, **k):
        raise OSError(f"cannot open {asr.folder}/secret.bin")

    monkeypatch.setattr(serving, "decode_upload", boom)
    with caplog.at_level("ERROR", logger="glmasr.server"):
        r = post(tc, {"model": MODEL}, {"file": ("a.wav", clip[0])})
    assert r.status_code == 500
    err = envelope(r.content)
    assert err["code"] == "internal_error" and "secret" not in err["message"] and str(asr.folder) not in r.text
    ref = re.search(r"reference (\w+)", err["message"]).group(1)
    assert any(ref in rec.getMessage() and "secret.bin" in rec.getMessage() for rec in caplog.records)
    monkeypatch.undo()
    assert post(tc, {"model": MODEL}, {"file": ("a.wav", clip[0])}).json()["text"] == clip[1]


def test_request_timeout_is_a_504_the_engine_stops_it_and_frees_its_slots(asr, clip, monkeypatch):
    from glmasr.engine.engine import Engine

    step = Engine.step

    def slow_step(self):
        time.sleep(0.05)
        return step(self)

    long_clip = wav(30, 12)  # ~200 tokens of budget: ~10 s at 0.05 s per engine step
    app = create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none", request_timeout_s=0.5))
    with TestClient(app, base_url="http://testserver") as tc:
        wait_healthy(tc.get)
        monkeypatch.setattr(Engine, "step", slow_step)
        t0 = time.monotonic()
        r = post(tc, {"model": MODEL}, {"file": ("long.wav", long_clip)})
        assert r.status_code == 504, r.text
        assert envelope(r.content)["code"] == "request_timeout" and time.monotonic() - t0 < 5
        # streamed: the stream ends with an error event naming the timeout
        r = post(tc, {"model": MODEL, "stream": "true"}, {"file": ("long.wav", long_clip)})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "request_timeout"
        deadline = time.monotonic() + 5
        while asr.loop.num_pending or any(s is not None for s in asr.engine.scheduler.slots):
            assert time.monotonic() < deadline, "the timed-out requests still hold the engine"
            time.sleep(0.02)
        monkeypatch.undo()
        assert post(tc, {"model": MODEL}, {"file": ("a.wav", clip[0])}).json()["text"] == clip[1]


def _mutations(rng, data: bytes, count: int):
    head = bytearray(data)
    for _ in range(count):
        b = bytearray(head)
        for _ in range(int(rng.integers(1, 6))):
            i = int(rng.integers(0, min(64, len(b))))
            b[i] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            b = b[: int(rng.integers(0, len(b)))]
        yield bytes(b)


FIELD_VALUES = ["", " ", "0", "-1", "1e309", "nan", "true", "auto", "server_vad", "\x00", "\ud7ff" * 3, "é" * 50,
                "x" * 70_000, "[" * 300, '{"type": "server_vad", "threshold": 0.5}', '{"type": null}', "verbose_json",
                "srt", "word", "segment", "en", "zz"]
FIELD_NAMES = ["model", "prompt", "language", "temperature", "response_format", "stream", "keywords[]",
               "timestamp_granularities[]", "chunking_strategy", "chunking_strategy[type]",
               "chunking_strategy[threshold]", "include[]", "unknown", "file", "x" * 300, "\u00e9t\u00e9"]


def test_fuzzed_fields_and_file_headers_never_get_a_5xx(tc, clip):
    """Seeded fuzz: random form fields (names, values, repeats) and random bytes in the first 64 bytes of real
    wav / flac / ogg files. Every answer is a 200 or a 4xx in the envelope."""
    rng = np.random.default_rng(7)
    files = []
    for fmt, sub in (("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", None), ("OGG", None)):
        b = io.BytesIO()
        sf.write(b, noise(1.0, 3), 16000, format=fmt, subtype=sub)
        files.append(b.getvalue())
    statuses = {}
    for i in range(160):
        data = {"model": MODEL}
        for _ in range(int(rng.integers(0, 4))):
            data[FIELD_NAMES[int(rng.integers(len(FIELD_NAMES)))]] = FIELD_VALUES[int(rng.integers(len(FIELD_VALUES)))]
        audio = files[i % len(files)] if i % 3 == 0 else next(_mutations(rng, files[i % len(files)], 1))
        r = post(tc, data, {"file": ("f", audio)})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (data, r.text[:300])
        if r.status_code != 200:
            envelope(r.content)
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses


# ---- real uvicorn on 127.0.0.1 ----
GUARD_FLAGS = ["--max-queue", "2", "--header-timeout", "1", "--read-timeout", "1.5", "--upload-timeout", "4",
               "--keep-alive-timeout", "1"]


@pytest.fixture(scope="module")
def guarded(tiny_shipped, tmp_path_factory):
    server = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("guarded"), extra=GUARD_FLAGS, log_level="info")
    yield server
    server.stop()


def _stalled_upload(server, body: bytes, ctype: str, sent: int):
    s = server.connect()
    s.sendall(post_head("/v1/audio/transcriptions", len(body), ctype) + body[:sent])
    return s


def test_stalled_uploads_do_not_lock_other_clients_out(guarded, clip):
    """Twice --max-queue clients stall mid-upload; others are served at once (uploads are not engine work), and
    each stalled one gets a 408 in the envelope after --read-timeout and is disconnected."""
    data, text = clip
    body, ctype = multipart({"model": MODEL}, ("a.wav", data))
    stalled = [_stalled_upload(guarded, body, ctype, len(body) // 2) for _ in range(4)]
    t0 = time.monotonic()
    c = guarded.client()
    with ThreadPoolExecutor(2) as pool:  # as many at once as --max-queue admits
        texts = list(pool.map(lambda _: c.audio.transcriptions.create(file=("a.wav", data), model=MODEL).text,
                              range(4)))
    assert texts == [text] * 4 and time.monotonic() - t0 < 10
    for s in stalled:
        raw = read_response(s, timeout=6)
        assert status_of(raw) == 408, raw[:200]
        assert envelope(body_of(raw))["code"] == "upload_timeout"
        s.close()


def test_idle_and_header_stalled_connections_are_closed(guarded):
    idle = guarded.connect()
    trickle = guarded.connect()
    t0 = time.monotonic()
    head = b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    closed_at = None
    for i in range(40):  # one byte every 0.1 s: active, but never a complete head
        try:
            trickle.sendall(head[i:i + 1] if i < len(head) else b"a")
        except OSError:
            closed_at = time.monotonic() - t0
            break
        trickle.settimeout(0.1)
        try:
            if trickle.recv(1024) == b"":
                closed_at = time.monotonic() - t0
                break
        except OSError:
            pass
    assert closed_at is not None and closed_at < 3.5, closed_at
    raw = read_response(idle, timeout=3)
    assert time.monotonic() - t0 < 4 and status_of(raw) == 408, raw
    for s in (idle, trickle):
        s.close()


def test_a_trickled_body_hits_the_upload_timeout(guarded, clip):
    body, ctype = multipart({"model": MODEL}, ("a.wav", clip[0]))
    s = guarded.connect()
    s.sendall(post_head("/v1/audio/transcriptions", len(body), ctype))
    t0 = time.monotonic()
    raw = b""
    for i in range(0, len(body), 50):  # 50 bytes every 0.5 s: never idle for --read-timeout
        try:
            s.sendall(body[i:i + 50])
        except OSError:
            break
        s.settimeout(0.5)
        try:
            chunk = s.recv(65536)
            raw += chunk
            if raw and (not chunk or b"\r\n\r\n" in raw):
                break
        except OSError:
            pass
    raw += read_response(s, timeout=3)
    assert status_of(raw) == 408 and 3.5 < time.monotonic() - t0 < 8, raw[:300]
    assert envelope(body_of(raw))["code"] == "upload_timeout"
    s.close()


def test_ambiguous_framing_is_refused_and_nothing_behind_it_runs(guarded):
    """Request smuggling: a body framed both by Content-Length and Transfer-Encoding carries a second request;
    the server answers one 400 and closes the connection, and the hidden request never runs."""
    before = guarded.metrics()
    hidden = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Length: 0\r\n\r\n")
    cases = []
    body = b"0\r\n\r\n" + hidden
    cases.append(b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
                 % len(body) + body)
    cases.append(b"POST /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
                 b"0\r\n\r\n" + hidden)
    cases.append(b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 50\r\n\r\n" + hidden)
    for raw_req in cases:
        s = guarded.connect()
        s.sendall(raw_req)
        raw = read_response(s, timeout=3)
        s.close()
        assert raw.count(b"HTTP/1.1 ") == 1 and status_of(raw) == 400, raw
        if b"application/json" in raw.split(b"\r\n\r\n")[0]:
            assert envelope(body_of(raw))["code"] == "invalid_framing"
    after = guarded.metrics()
    assert re.findall(r'glmasr_requests_total\{outcome="bad_request"\} (\S+)', before) == \
        re.findall(r'glmasr_requests_total\{outcome="bad_request"\} (\S+)', after)  # the hidden POSTs never ran


def test_a_client_gone_mid_upload_is_one_log_line(guarded, clip):
    body, ctype = multipart({"model": MODEL}, ("a.wav", clip[0]))
    start = len(guarded.output(tail=10**7))
    for _ in range(3):
        s = _stalled_upload(guarded, body, ctype, len(body) // 3)
        time.sleep(0.2)
        s.close()
    deadline = time.monotonic() + 5
    while guarded.output(tail=10**7)[start:].count("disconnected during its upload") < 3:
        assert time.monotonic() < deadline, guarded.output()
        time.sleep(0.05)
    log = guarded.output(tail=10**7)[start:]
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert len([ln for ln in log.splitlines() if "disconnected" in ln]) == 3, log


def test_sigterm_refuses_a_stalled_upload_at_once_and_exits(tiny_shipped, tmp_path, clip):
    """SIGTERM: a body still arriving is refused at once (503 in the envelope), not held for --drain-timeout; the
    process exits 0 promptly."""
    server = ServerProcess(tiny_shipped, tmp_path, extra=["--drain-timeout", "30", "--read-timeout", "30"])
    try:
        body, ctype = multipart({"model": MODEL}, ("a.wav", clip[0]))
        s = _stalled_upload(server, body, ctype, len(body) // 2)
        time.sleep(0.3)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        raw = read_response(s, timeout=10)
        assert status_of(raw) == 503 and time.monotonic() - t0 < 3, raw[:300]
        assert envelope(body_of(raw))["code"] == "shutting_down"
        assert server.proc.wait(10) == 0, server.output()
        assert time.monotonic() - t0 < 8
    finally:
        server.stop()


def test_memory_bomb_upload_is_refused_before_decoding(tc):
    """A small FLAC declaring 655,350 Hz (a decompression bomb: 41 x the samples of 16 kHz) is a 400 naming the
    sample-rate limit, answered without decoding it."""
    b = io.BytesIO()
    sf.write(b, (np.random.default_rng(1).standard_normal(655_350 * 2) * 0.1).astype(np.float32), 655_350,
             format="FLAC")
    t0 = time.monotonic()
    r = post(tc, {"model": MODEL}, {"file": ("bomb.flac", b.getvalue())})
    assert r.status_code == 400 and time.monotonic() - t0 < 5, r.text
    err = envelope(r.content)
    assert err["param"] == "file" and "384000" in err["message"], err


def test_the_drain_watch_cancels_the_upload_and_lets_a_cancellation_through():
    """``uploads._unless_draining`` (one watch per upload): the work's own result or error comes through as it is;
    the drain starting mid-upload cancels the work and answers ``ShuttingDown``; a drain already on refuses before
    any work; and when the request itself is cancelled (its handler), the cancellation goes on, it is not turned
    into a 503, and the work is cancelled with it."""
    import asyncio

    from glmasr.server.uploads import ShuttingDown, _unless_draining

    async def scenario():
        draining = asyncio.Event()
        assert await _unless_draining(asyncio.sleep(0, "form"), draining) == "form"

        async def fails():
            raise ValueError("bad body")

        with pytest.raises(ValueError, match="bad body"):
            await _unless_draining(fails(), draining)
        started, cancelled = asyncio.Event(), []

        async def slow():
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        async def drain_soon():
            await started.wait()
            draining.set()

        asyncio.ensure_future(drain_soon())
        with pytest.raises(ShuttingDown):
            await _unless_draining(slow(), draining)
        assert cancelled == [True]
        with pytest.raises(ShuttingDown):
            await _unless_draining(slow(), draining)  # drain already on: refused at once
        assert cancelled == [True]
        started.clear()
        outer = asyncio.ensure_future(_unless_draining(slow(), asyncio.Event()))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)
        assert cancelled == [True, True]

    asyncio.run(scenario())
