"""The OpenAI Realtime endpoint (GET /v1/realtime) through real ``glmasr serve`` processes (uvicorn on 127.0.0.1, the
tiny checkpoint on the CPU), driven by the real ``openai`` SDK (``client.realtime.connect``) and by a plain
``websockets`` client. Every final text is compared with what the engine gives for the same samples
(``asr.submit``, in this process), so the checks are exact."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import connect  # noqa: E402

from openai.types import realtime as rt  # noqa: E402

from glmasr.live.session import live_instruction  # noqa: E402
from glmasr.options import DecodeOptions  # noqa: E402

from conftest import noise  # noqa: E402
from live_server import KEY, MODEL, ServerProcess  # noqa: E402

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
FAILED = "conversation.item.input_audio_transcription.failed"
MANUAL = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}


# ---- servers ----
@pytest.fixture(scope="module")
def server(tiny_shipped, tmp_path_factory):
    s = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("rt"), extra=("--max-realtime-sessions", "40"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def limited(tiny_shipped, tmp_path_factory):
    """Small limits, short connection timeouts (which must not touch an open WebSocket), and slow engine steps (so
    that a final is still running when its client goes away)."""
    s = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("rt_limits"), delay=0.5, extra=(
        "--max-realtime-sessions", "2", "--realtime-idle-timeout-s", "2", "--realtime-max-session-s", "8",
        "--realtime-max-buffer-s", "2", "--header-timeout", "1", "--keep-alive-timeout", "1"))
    yield s
    s.stop()


# ---- audio ----
def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1 - 2 ** -15) * 32768).astype("<i2").tobytes()


def as_float(raw: bytes) -> np.ndarray:
    """16-bit PCM bytes -> the float samples they stand for (what a file reader gives)."""
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768


def ffmpeg(args, data: bytes) -> bytes:
    if shutil.which("ffmpeg") is None:  # the reference G.711 coder (CI installs it; the H200 image has none)
        pytest.skip("ffmpeg is not installed (Debian: apt-get install -y ffmpeg); the G.711 references need it")
    return subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", *args], input=data, check=True,
                          capture_output=True).stdout


def g711(x8: np.ndarray, law: str) -> tuple[bytes, np.ndarray]:
    """8 kHz samples -> G.711 bytes (FFmpeg's encoder) and the samples FFmpeg decodes them to (the reference)."""
    codec = {"mulaw": "mulaw", "alaw": "alaw"}[law]
    enc = ffmpeg(["-f", "s16le", "-ar", "8000", "-ac", "1", "-i", "pipe:", "-f", codec, "pipe:"], pcm16(x8))
    dec = ffmpeg(["-f", codec, "-ar", "8000", "-ac", "1", "-i", "pipe:", "-f", "s16le", "pipe:"], enc)
    return enc, as_float(dec)


def chunks(data: bytes, rate: int, width: int, seed: int, ms=(20, 100)):
    """``data`` in pieces of 20-100 ms of whole samples (random sizes)."""
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(data):
        n = int(rng.integers(int(ms[0] * rate / 1000), int(ms[1] * rate / 1000) + 1)) * width
        out.append(data[i:i + n])
        i += n
    return out


def append(audio: bytes) -> dict:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()}


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """Synthesized speech at 24 kHz: two sentences separated by a known 1.2 s pause, with silence around, and the
    sample positions where each sentence's sound ends."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install -y espeak-ng); the VAD tests need it")
    import soundfile as sf
    import soxr

    tmp = tmp_path_factory.mktemp("espeak")
    parts = []
    for i, text in enumerate(["My mother made a warm meal for the whole family.",
                              "We will meet again in the morning."]):
        path = str(tmp / f"s{i}.wav")
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", path, text], check=True, capture_output=True)
        x, sr = sf.read(path, dtype="float32")
        x = soxr.resample(x, sr, 24000).astype(np.float32)
        f = 240  # 10 ms frames: the sentence is where frames are within 40 dB of the loudest (test_vad's rule)
        rms = np.sqrt((x[:len(x) // f * f].reshape(-1, f).astype(np.float64) ** 2).mean(1) + 1e-20)
        loud = np.nonzero(20 * np.log10(rms / rms.max()) > -40)[0]
        parts.append(0.5 * x[loud[0] * f:(loud[-1] + 1) * f])
    rng = np.random.default_rng(5)

    def quiet(s):
        return (rng.standard_normal(int(s * 24000)) * 1e-3).astype(np.float32)

    audio = np.concatenate([quiet(0.6), parts[0], quiet(1.2), parts[1], quiet(1.5)])
    ends = [int(0.6 * 24000) + len(parts[0]), int(0.6 * 24000) + len(parts[0]) + int(1.2 * 24000) + len(parts[1])]
    return audio, ends


# ---- a plain websockets client ----
class Session:
    def __init__(self, ws):
        self.ws = ws
        self.events: list[dict] = []

    @classmethod
    async def open(cls, server, query="?intent=transcription", key=KEY, subprotocol_key=False, headers=None):
        url = f"ws://127.0.0.1:{server.port}/v1/realtime{query}"
        extra = dict(headers or {})
        protocols = ["realtime"]
        if key is not None and not subprotocol_key:
            extra["Authorization"] = f"Bearer {key}"
        if key is not None and subprotocol_key:
            protocols.append(f"openai-insecure-api-key.{key}")
        ws = await connect(url, additional_headers=extra, subprotocols=protocols, max_size=None,
                           open_timeout=30)
        return cls(ws)

    async def send(self, obj) -> None:
        await self.ws.send(obj if isinstance(obj, (str, bytes)) else json.dumps(obj))

    async def recv(self, timeout: float = 30.0) -> dict:
        e = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.events.append(e)
        return e

    async def until(self, pred, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            e = await self.recv(max(0.1, deadline - time.monotonic()))
            if pred(e):
                return e

    async def error(self, timeout: float = 30.0) -> dict:
        return (await self.until(lambda e: e["type"] == "error", timeout))["error"]

    async def update(self, session: dict, kind: str = "session.update") -> dict:
        await self.send({"type": kind, "session": session})
        return await self.until(lambda e: e["type"] in ("session.updated", "transcription_session.updated",
                                                        "error"))

    async def turn(self, audio: bytes, rate: int = 24000, width: int = 2, seed: int = 0) -> dict:
        """Append ``audio`` in 20-100 ms pieces, commit, and wait for the item's completion; returns
        {item_id, previous_item_id, deltas, transcript}."""
        for piece in chunks(audio, rate, width, seed):
            await self.send(append(piece))
        await self.send({"type": "input_audio_buffer.commit"})
        committed = await self.until(lambda e: e["type"] in ("input_audio_buffer.committed", "error"))
        assert committed["type"] == "input_audio_buffer.committed", committed
        item = committed["item_id"]
        done = await self.until(lambda e: e.get("item_id") == item and e["type"] in (COMPLETED, FAILED), 60)
        assert done["type"] == COMPLETED, done
        deltas = [e["delta"] for e in self.events if e["type"] == DELTA and e["item_id"] == item]
        return {"item_id": item, "previous_item_id": committed["previous_item_id"], "deltas": deltas,
                "transcript": done["transcript"], "usage": done["usage"]}

    async def close(self):
        await self.ws.close()


def run(coro, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def reference(asr, x: np.ndarray, rate: int, prompt: str | None = None) -> str:
    return asr.submit(x, DecodeOptions(prompt=prompt), sampling_rate=rate).result().text


def metric(server, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", server.metrics(), re.M)
    return float(m.group(1)) if m else float("nan")


def wait_idle(server, timeout: float = 20.0) -> None:
    """The engine holds no request and no realtime session is open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "glmasr_engine_pending_requests") == 0 and \
                metric(server, "glmasr_realtime_active_sessions") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine or the sessions did not go idle: {server.metrics()[-2000:]}")


# ---- the openai SDK ----
# the SDK's sync reader calls websockets' connect() outside a context manager (its own code, websockets >= 14)
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_openai_sdk_session(server, asr):
    """The unpatched SDK: connect with intent=transcription, configure, stream 24 kHz PCM, commit; the completed
    transcript equals transcribe() of the same samples and the deltas concatenate to it."""
    raw = pcm16(noise(2.5, 21, rate=24000))
    expect = reference(asr, as_float(raw), 24000)
    audio_before = metric(server, "glmasr_realtime_audio_seconds_total")
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0)
    with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = conn.recv()
        assert isinstance(created, rt.SessionCreatedEvent) and created.session.type == "transcription"
        conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None,
            "transcription": {"model": MODEL, "language": "en"}}}})
        updated = conn.recv()
        assert isinstance(updated, rt.SessionUpdatedEvent), updated
        assert updated.session.audio.input.turn_detection is None
        assert updated.session.audio.input.transcription.language == "en"
        for piece in chunks(raw, 24000, 2, seed=3):
            conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        conn.input_audio_buffer.commit()
        events = []
        for event in conn:
            events.append(event)
            if isinstance(event, (rt.ConversationItemInputAudioTranscriptionCompletedEvent,
                                  rt.ConversationItemInputAudioTranscriptionFailedEvent, rt.RealtimeErrorEvent)):
                break
    committed, *deltas, done = events
    assert isinstance(committed, rt.InputAudioBufferCommittedEvent) and committed.previous_item_id is None
    assert isinstance(done, rt.ConversationItemInputAudioTranscriptionCompletedEvent), done
    assert all(isinstance(d, rt.ConversationItemInputAudioTranscriptionDeltaEvent) for d in deltas)
    assert {d.item_id for d in deltas} | {done.item_id} == {committed.item_id}
    assert done.transcript == expect
    assert "".join(d.delta for d in deltas) == done.transcript
    assert done.usage.type == "duration" and done.usage.seconds == pytest.approx(2.5, abs=0.01)
    assert metric(server, "glmasr_realtime_audio_seconds_total") - audio_before == pytest.approx(2.5, abs=1e-6)
    assert metric(server, "glmasr_realtime_sessions_total") >= 1


# ---- formats: each gives transcribe()'s text for the same samples ----
def test_formats_equal_transcribe(server, asr):
    x24 = noise(2.0, 31, rate=24000)
    x16 = noise(2.0, 32, rate=16000)
    x8 = noise(2.0, 33, rate=8000)
    mu, mu_ref = g711(x8, "mulaw")
    al, al_ref = g711(x8, "alaw")
    cases = [  # (session format, bytes, rate, bytes per sample, reference samples)
        ({"type": "audio/pcm", "rate": 24000}, pcm16(x24), 24000, 2, as_float(pcm16(x24))),
        ({"type": "audio/pcm", "rate": 16000}, pcm16(x16), 16000, 2, as_float(pcm16(x16))),
        ({"type": "audio/pcmu"}, mu, 8000, 1, mu_ref),
        ({"type": "audio/pcma"}, al, 8000, 1, al_ref),
    ]
    expected = [reference(asr, ref, rate) for _, _, rate, _, ref in cases]

    async def one(fmt, data, rate, width, seed):
        s = await Session.open(server)
        try:
            assert (await s.recv())["type"] == "session.created"
            u = await s.update({"type": "transcription", "audio": {"input": {"format": fmt, "turn_detection": None}}})
            assert u["type"] == "session.updated" and u["session"]["audio"]["input"]["format"]["type"] == fmt["type"]
            return await s.turn(data, rate, width, seed)
        finally:
            await s.close()

    async def main():
        return await asyncio.gather(*(one(f, d, r, w, i) for i, (f, d, r, w, _) in enumerate(cases)))

    for (fmt, *_), got, want in zip(cases, run(main()), expected):
        assert got["transcript"] == want, fmt
        assert "".join(got["deltas"]) == got["transcript"]


def test_beta_shape_16k(server, asr):
    """The beta transcription_session.update (NVIDIA Riva's 16 kHz field) is answered in the beta shape."""
    raw = pcm16(noise(1.5, 41, rate=16000))

    async def main():
        s = await Session.open(server, headers={"OpenAI-Beta": "realtime=v1"})
        created = await s.recv()
        assert created["type"] == "session.created" and created["session"]["input_audio_format"] == "pcm16"
        u = await s.update({"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": 16000},
                            "turn_detection": None}, kind="transcription_session.update")
        assert u["type"] == "transcription_session.updated", u
        assert u["session"]["input_audio_params"]["sample_rate_hz"] == 16000 and u["session"]["turn_detection"] is None
        got = await s.turn(raw, 16000)
        await s.close()
        return got

    assert run(main())["transcript"] == reference(asr, as_float(raw), 16000)


# ---- order, linkage, commit, clear ----
def test_manual_turns_order_and_linkage(server, asr):
    """Committed turns: committed -> deltas -> completed per item, previous_item_id links them, each event has
    its own event_id; the second turn carries the first's text as context (the session's documented instruction)
    and equals transcribe() with that instruction; with context off, a turn equals plain transcribe()."""
    a, b, c = (pcm16(noise(s, 51 + i, rate=24000)) for i, s in enumerate((1.5, 2.0, 1.2)))

    async def main():
        s = await Session.open(server)
        await s.recv()
        await s.update(MANUAL)
        first = await s.turn(a, seed=1)
        second = await s.turn(b, seed=2)
        u = await s.update({"type": "transcription", "audio": {"input": {"transcription": {"context": False}}}})
        assert u["session"]["audio"]["input"]["transcription"]["context"] is False
        third = await s.turn(c, seed=3)
        await s.close()
        return s.events, first, second, third

    events, first, second, third = run(main())
    assert first["transcript"] == reference(asr, as_float(a), 24000)
    prompt = live_instruction(None, (), first["transcript"], asr.prompts.default_prompt)
    assert second["transcript"] == reference(asr, as_float(b), 24000, prompt)
    assert third["transcript"] == reference(asr, as_float(c), 24000)
    assert third["previous_item_id"] == second["item_id"]
    assert (first["previous_item_id"], second["previous_item_id"]) == (None, first["item_id"])
    kinds = [(e["type"], e.get("item_id")) for e in events if e["type"] != "session.updated"]
    for t in (first, second):
        mine = [k for k in kinds if k[1] == t["item_id"]]
        assert mine[0][0] == "input_audio_buffer.committed" and mine[-1][0] == COMPLETED
        assert all(k[0] == DELTA for k in mine[1:-1])
        assert "".join(t["deltas"]) == t["transcript"]
    assert kinds.index(("input_audio_buffer.committed", second["item_id"])) > kinds.index((COMPLETED, first["item_id"]))
    assert len({e["event_id"] for e in events}) == len(events)


def test_clear_and_empty_commit(server, asr):
    """clear drops the buffered audio (cleared; a commit then is input_audio_buffer_commit_empty, naming the
    problem) and the session goes on with the next audio alone."""
    junk, raw = pcm16(noise(1.0, 61, rate=24000)), pcm16(noise(1.5, 62, rate=24000))

    async def main():
        s = await Session.open(server)
        await s.recv()
        await s.update(MANUAL)
        await s.send({"type": "input_audio_buffer.commit", "event_id": "c0"})
        e0 = await s.error()
        await s.send(append(junk))
        await s.send({"type": "input_audio_buffer.clear"})
        await s.until(lambda e: e["type"] == "input_audio_buffer.cleared")
        await s.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
        e1 = await s.error()
        got = await s.turn(raw)
        await s.close()
        return e0, e1, got

    e0, e1, got = run(main())
    for e, eid in ((e0, "c0"), (e1, "c1")):
        assert e["code"] == "input_audio_buffer_commit_empty" and e["event_id"] == eid and "empty" in e["message"]
    assert got["transcript"] == reference(asr, as_float(raw), 24000) and got["previous_item_id"] is None


# ---- server VAD ----
def test_server_vad_turns(server, asr, speech):
    """server_vad on two sentences with a known pause, streamed at real-time pace: two turns, each
    speech_started -> speech_stopped -> committed -> deltas -> completed, linked; each stop lands within 100 ms of
    the sentence's end plus silence_duration_ms; each final equals transcribe() of the turn's samples."""
    audio, ends = speech
    raw = pcm16(audio)
    silence_ms = 500

    async def main():
        s = await Session.open(server)
        await s.recv()
        await s.update({"type": "transcription", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": silence_ms}}}})
        t0 = time.monotonic()
        sent = 0
        for piece in chunks(raw, 24000, 2, seed=9, ms=(40, 40)):
            await s.send(append(piece))
            sent += len(piece) // 2
            await asyncio.sleep(max(0.0, t0 + sent / 24000 - time.monotonic()))  # real-time pace
        done = set()
        while len(done) < 2:
            e = await s.recv(30)
            if e["type"] == COMPLETED:
                done.add(e["item_id"])
        await s.close()
        return s.events

    events = run(main())
    by_type = {}
    for e in events:
        by_type.setdefault(e["type"], []).append(e)
    started, stopped = by_type["input_audio_buffer.speech_started"], by_type["input_audio_buffer.speech_stopped"]
    committed, completed = by_type["input_audio_buffer.committed"], by_type[COMPLETED]
    assert len(started) == len(stopped) == len(committed) == len(completed) == 2
    for i in range(2):
        item = started[i]["item_id"]
        assert stopped[i]["item_id"] == committed[i]["item_id"] == completed[i]["item_id"] == item
        seq = [e["type"] for e in events if e.get("item_id") == item]
        assert seq[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                           "input_audio_buffer.committed"] and seq[-1] == COMPLETED
        true_end_ms = ends[i] / 24 + silence_ms
        assert abs(stopped[i]["audio_end_ms"] - true_end_ms) <= 100, (stopped[i], true_end_ms)
        # the turn's audio is [audio_start_ms, audio_end_ms): transcribe() of those 16 kHz samples
        from glmasr.audio import load_audio

        x16 = load_audio(as_float(raw), sampling_rate=24000).samples
        a, b = started[i]["audio_start_ms"] * 16, stopped[i]["audio_end_ms"] * 16
        prev = completed[i - 1]["transcript"] if i else None
        prompt = live_instruction(None, (), prev, asr.prompts.default_prompt)
        assert completed[i]["transcript"] == reference(asr, x16[a:b], 16000, prompt)
        deltas = "".join(e["delta"] for e in events if e["type"] == DELTA and e["item_id"] == item)
        assert deltas == completed[i]["transcript"]
    assert committed[0]["previous_item_id"] is None and committed[1]["previous_item_id"] == started[0]["item_id"]


def test_partials_never_retract(server, speech):
    """interim_results: while a turn is open, drafts run and any agreed text goes out as deltas; whatever was
    sent is a prefix of the final transcript (never retracted) and all deltas concatenate to it."""
    audio, _ = speech
    raw = pcm16(audio)
    before = metric(server, 'glmasr_realtime_drafts_total{outcome="sent"}')

    async def main():
        s = await Session.open(server)
        await s.recv()
        u = await s.update({"type": "transcription", "audio": {"input": {
            "transcription": {"interim_results": True, "partial_hop_ms": 250},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
        assert u["session"]["audio"]["input"]["transcription"]["interim_results"] is True
        t0, sent = time.monotonic(), 0
        for piece in chunks(raw, 24000, 2, seed=4, ms=(40, 40)):
            await s.send(append(piece))
            sent += len(piece) // 2
            await asyncio.sleep(max(0.0, t0 + sent / 24000 - time.monotonic()))
        n = 0
        while n < 2:
            n += (await s.recv(30))["type"] == COMPLETED
        await s.close()
        return s.events

    events = run(main())
    finals = {e["item_id"]: e["transcript"] for e in events if e["type"] == COMPLETED}
    assert len(finals) == 2
    for item, text in finals.items():
        sent = ""
        for e in events:
            if e["type"] == DELTA and e["item_id"] == item:
                sent += e["delta"]
                assert text.startswith(sent)  # never retracted
        assert sent == text
    assert metric(server, 'glmasr_realtime_drafts_total{outcome="sent"}') > before


# ---- bad input ----
def test_bad_input_keeps_the_session_usable(server, asr):
    """Each bad event gets an error event naming the problem (code, param, the client's event_id); the session
    then still transcribes exactly."""
    raw = pcm16(noise(1.5, 71, rate=24000))
    bad = [
        ('{"type": "input_audio_buffer.append", "event_id": "b1", "audio": "%%%"}', "invalid_audio", "audio"),
        (json.dumps({**append(b"\x01\x02\x03"), "event_id": "b2"}), "invalid_audio", "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "event_id": "b3", "audio": "A" * (5 * 1024 * 1024)}),
         "event_too_large", None),
        (b"\x00\x01binary", "invalid_json", None),
        ("{oops", "invalid_json", None),
        ('{"type": "input_audio_buffer.flush", "event_id": "b6"}', "unknown_event_type", "type"),
        ('{"type": "response.create", "event_id": "b7"}', "unsupported_event", "type"),
        ('{"type": "input_audio_buffer.commit", "event_id": "b8", "x": 1}', "unknown_parameter", "x"),
        (json.dumps({"type": "session.update", "event_id": "b9", "session": {"type": "transcription", "audio": {
            "input": {"turn_detection": {"type": "semantic_vad"}}}}}), "unsupported_value",
         "session.audio.input.turn_detection.type"),
        (json.dumps({"type": "session.update", "event_id": "b10", "session": {"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 44100}}}}}), "unsupported_value",
         "session.audio.input.format.rate"),
        (json.dumps({"type": "session.update", "event_id": "b11", "session": {"type": "transcription", "audio": {
            "input": {"transcription": {"model": "whisper-1"}}}}}), "model_not_found",
         "session.audio.input.transcription.model"),
    ]

    async def main():
        s = await Session.open(server)
        await s.recv()
        await s.update(MANUAL)
        await s.send(append(raw[:4800]))  # audio already buffered must survive the bad events
        errors = []
        for message, *_ in bad:
            await s.send(message)
            errors.append(await s.error())
        got = await s.turn(raw[4800:])
        await s.close()
        return errors, got

    errors, got = run(main())
    for (message, code, param), e in zip(bad, errors):
        assert (e["code"], e["param"]) == (code, param), (message[:80], e)
        assert e["message"] and e["type"] == "invalid_request_error"
        m = re.search(r'"event_id": "(b\d+)"', message if isinstance(message, str) else "")
        assert e["event_id"] == (m.group(1) if m and code != "event_too_large" else None)  # too large: unread
    assert got["transcript"] == reference(asr, as_float(raw), 24000)


# ---- auth and connection refusals ----
def test_websockets_subprotocol_auth(server, asr):
    """A plain websockets client with the key as a subprotocol (a browser's way): the server answers 'realtime';
    without a key, or with a wrong one, an error event then close 1008; unknown model 1008; a served one works."""
    raw = pcm16(noise(1.0, 81, rate=24000))

    async def refused(**kw):
        s = await Session.open(server, **kw)
        e = await s.recv()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await s.recv(10)
        return e, closed.value.rcvd.code

    async def main():
        s = await Session.open(server, subprotocol_key=True)
        assert s.ws.subprotocol == "realtime"
        # the client offers permessage-deflate (websockets does by default); the server declines it (http.py)
        assert s.ws.protocol.extensions == []
        created = await s.recv()
        assert created["type"] == "session.created"
        await s.update(MANUAL)
        got = await s.turn(raw)
        await s.close()
        outcomes = [await refused(key=None), await refused(key="wrong", subprotocol_key=True),
                    await refused(key="wrong"), await refused(query="?intent=transcription&model=whisper-1"),
                    await refused(query="?intent=conversation")]
        s = await Session.open(server, query=f"?intent=transcription&model={MODEL}")
        created = await s.recv()
        await s.close()
        return got, outcomes, created

    got, outcomes, created = run(main())
    assert got["transcript"] == reference(asr, as_float(raw), 24000)
    codes = [(e["type"], e["error"]["code"], close) for e, close in outcomes]
    assert codes == [("error", "invalid_api_key", 1008)] * 3 + [("error", "model_not_found", 1008),
                                                                ("error", "invalid_intent", 1008)]
    assert created["session"]["audio"]["input"]["transcription"]["model"] == MODEL


def test_http_get_is_not_upgraded(server):
    r = server.http.get("/v1/realtime?intent=transcription", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 426 and r.json()["error"]["code"] == "upgrade_required"
    assert "WebSocket" in r.json()["error"]["message"]


def test_oversized_message_closes_1009(server):
    """A WebSocket message over uvicorn's frame limit (twice the 4 MiB event limit) ends the connection with
    1009 (message too big) before it is buffered whole; the server's session count goes back down."""
    async def main():
        s = await Session.open(server)
        await s.recv()
        # uncompressed (the server declines permessage-deflate), so the server may close while the frame is
        # still being sent: then the send itself sees the close
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await s.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (9 * 1024 * 1024)}))
            await s.recv(20)
        return closed.value.rcvd.code

    assert run(main()) == 1009
    wait_idle(server)


def test_page_is_served(server):
    """The browser page at / and /demo and its assets under /static/, open without a key."""
    import glmasr.server.app as app_module

    if not (app_module.STATIC / "index.html").is_file():
        pytest.skip("this checkout has no browser page (glmasr/server/static/index.html)")
    html = (app_module.STATIC / "index.html").read_text()
    for path in ("/", "/demo"):
        r = server.http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and r.text == html
        assert r.headers["x-frame-options"] == "DENY"
    r = server.http.get("/static/app.js")
    assert r.status_code == 200 and r.text == (app_module.STATIC / "app.js").read_text()
    assert server.http.get("/static/../app.py").status_code == 404
    assert server.http.get("/static/missing.js").status_code == 404


# ---- limits ----
def test_session_limit_1013_and_disconnect_frees_slots(limited):
    """Over --max-realtime-sessions: an error event then close 1013. A client that disconnects with five turns
    committed (their finals run one after another, ~1.5 s each with this server's slow engine steps) has its engine
    requests aborted: the engine is idle within a fraction of the time the finals would take, and the session
    slots are free again."""
    async def main():
        a = await Session.open(limited)
        b = await Session.open(limited)
        await a.recv(), await b.recv()
        c = await Session.open(limited)
        e = await c.recv()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await c.recv(10)
        await b.close()
        await a.update(MANUAL)
        for k in range(5):
            await a.send(append(pcm16(noise(0.3, 90 + k, rate=24000))))
            await a.send({"type": "input_audio_buffer.commit"})
            await a.until(lambda ev: ev["type"] == "input_audio_buffer.committed")
        deadline = time.monotonic() + 20
        while metric(limited, "glmasr_engine_pending_requests") < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        held = metric(limited, "glmasr_engine_pending_requests")
        a.ws.transport.abort()  # gone without a close frame
        return e, closed.value.rcvd.code, held, [ev["type"] for ev in a.events]

    e, code, held, seen = run(main())
    assert (e["type"], e["error"]["code"], code) == ("error", "session_limit", 1013)
    assert "--max-realtime-sessions" in e["error"]["message"]
    assert held >= 1 and seen.count(COMPLETED) <= 1
    t = time.monotonic()
    wait_idle(limited, timeout=20)
    assert time.monotonic() - t < 3.0  # the four or five finals left would take ~6 s or more

    async def again():  # both slots are free again
        s1, s2 = await Session.open(limited), await Session.open(limited)
        out = [(await s1.recv())["type"], (await s2.recv())["type"]]
        await s1.close(), await s2.close()
        return out

    assert run(again()) == ["session.created", "session.created"]
    wait_idle(limited)


def test_buffer_limit_idle_timeout_and_timeouts(limited):
    """The buffered-audio limit refuses an append (the session goes on); an open WebSocket outlives the header
    and keep-alive timeouts (1 s here) while it is active; a silent one is closed by the idle timeout (2 s) with an
    error event and close 1000."""
    async def main():
        s = await Session.open(limited)
        await s.recv()
        await s.update(MANUAL)
        await s.send(append(pcm16(noise(1.5, 101, rate=24000))))
        await s.send({**append(pcm16(noise(1.0, 102, rate=24000))), "event_id": "big"})
        e = await s.error()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:  # active past the header and keep-alive timeouts
            await s.send(append(pcm16(noise(0.04, 103, rate=24000))))
            await asyncio.sleep(0.2)
        await s.send({"type": "input_audio_buffer.commit"})
        done = await s.until(lambda ev: ev["type"] in (COMPLETED, FAILED), 60)
        t1 = time.monotonic()
        idle = await s.error(10)  # nothing more is sent: the idle timeout
        waited = time.monotonic() - t1
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await s.recv(10)
        return e, done, idle, waited, closed.value.rcvd.code

    e, done, idle, waited, code = run(main())
    assert (e["code"], e["param"], e["event_id"]) == ("buffer_too_large", "audio", "big")
    assert "--realtime-max-buffer-s" in e["message"]
    assert done["type"] == COMPLETED and done["usage"]["seconds"] > 1.5
    assert idle["code"] == "idle_timeout" and code == 1000 and 1.5 <= waited <= 4.0
    wait_idle(limited)


def test_max_session_length(limited):
    async def main():
        s = await Session.open(limited)
        await s.recv()
        t0 = time.monotonic()
        while True:  # keep it active: only the session length can end it
            await s.send(append(pcm16(noise(0.02, 111, rate=24000))))
            try:
                e = await asyncio.wait_for(s.ws.recv(), 0.5)
            except asyncio.TimeoutError:
                continue
            e = json.loads(e)
            if e["type"] == "error":
                break
        took = time.monotonic() - t0
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await s.recv(10)
        return e, took, closed.value.rcvd.code

    e, took, code = run(main(), timeout=60)
    assert e["error"]["code"] == "session_expired" and "--realtime-max-session-s" in e["error"]["message"]
    assert 7.5 <= took <= 10 and code == 1000
    wait_idle(limited)


def test_drain_closes_sessions_1012(limited):
    """SIGTERM: an open session gets an error event (shutting_down) and close 1012; the server exits with 0. (Runs
    last on this server.)"""
    import signal

    async def main():
        s = await Session.open(limited)
        await s.recv()
        await s.send(append(pcm16(noise(0.2, 121, rate=24000))))
        limited.proc.send_signal(signal.SIGTERM)
        e = await s.error(10)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await s.recv(10)
        return e, closed.value.rcvd.code

    e, code = run(main())
    assert (e["code"], e["type"], code) == ("shutting_down", "server_error", 1012)
    assert limited.proc.wait(30) == 0, limited.output()


# ---- load ----
def test_32_sessions_at_real_time_lose_nothing(server, asr):
    """32 sessions at once, each streaming two short turns at real-time pace (40 ms appends) with manual commits:
    every turn completes, with exactly transcribe()'s text; no error; the engine is idle afterwards."""
    n, secs = 32, 1.0
    clips = [[pcm16(noise(secs, 1000 + 2 * i + k, rate=24000)) for k in range(2)] for i in range(n)]
    firsts = [reference(asr, as_float(c[0]), 24000) for c in clips]

    async def one(i):
        s = await Session.open(server)
        await s.recv()
        await s.update(MANUAL)
        out = []
        for k, clip in enumerate(clips[i]):
            t0, sent = time.monotonic(), 0
            for piece in chunks(clip, 24000, 2, seed=i, ms=(40, 40)):
                await s.send(append(piece))
                sent += len(piece) // 2
                await asyncio.sleep(max(0.0, t0 + sent / 24000 - time.monotonic()))
            await s.send({"type": "input_audio_buffer.commit"})
            c = await s.until(lambda e: e["type"] in ("input_audio_buffer.committed", "error"))
            assert c["type"] == "input_audio_buffer.committed", c
            out.append(c["item_id"])
        def done():
            return {e["item_id"]: e["transcript"] for e in s.events if e["type"] == COMPLETED}

        while len(done()) < 2:  # (the first may have come while the second turn streamed)
            e = await s.recv(60)
            assert e["type"] not in ("error", FAILED), e
        done = done()
        await s.close()
        assert not [e for e in s.events if e["type"] == "error"]
        return [done[item] for item in out]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    t = time.monotonic()
    results = run(main(), timeout=90)
    assert time.monotonic() - t < 60
    for i, (a, b) in enumerate(results):
        assert a == firsts[i]
        prompt = live_instruction(None, (), a, asr.prompts.default_prompt)
        assert b == reference(asr, as_float(clips[i][1]), 24000, prompt)
    wait_idle(server)
    text = server.metrics()
    assert metric(server, "glmasr_realtime_turns_total") >= 2 * n
    assert 'glmasr_realtime_turns_failed_total{' not in text
    assert re.search(r"^glmasr_realtime_completed_seconds_count ([0-9.]+)", text, re.M)
    # every final's engine request: its stages
    for stage in ("queue", "encode", "decode", "transit"):
        assert metric(server, f'glmasr_request_stage_seconds_count{{kind="realtime",stage="{stage}"}}') >= 2 * n


def test_data_parallel_engine_workers(tiny_shipped, asr):
    """With engine worker processes (--data-parallel) the front end loads its own tokenizer for the sessions and
    the turns run in the workers: the final is still transcribe()'s text (in-process app, one CPU worker)."""
    from starlette.testclient import TestClient

    from glmasr.server import ServerConfig, create_app
    from glmasr.workers.requests import DataParallelEngineClient

    raw = pcm16(noise(1.5, 131, rate=24000))
    engine = DataParallelEngineClient(["cpu"], model=tiny_shipped, max_batch=8, drain_timeout_s=10)
    try:
        app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))
        with TestClient(app) as c:
            deadline = time.monotonic() + 90
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline, c.get("/health", headers={"Authorization": f"Bearer {KEY}"}).text
                time.sleep(0.1)
            with c.websocket_connect("/v1/realtime?intent=transcription", subprotocols=[
                    "realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
                assert ws.receive_json()["type"] == "session.created"
                ws.send_json({"type": "session.update", "session": MANUAL})
                assert ws.receive_json()["type"] == "session.updated"
                for piece in chunks(raw, 24000, 2, seed=5):
                    ws.send_json(append(piece))
                ws.send_json({"type": "input_audio_buffer.commit"})
                events = []
                while not events or events[-1]["type"] not in (COMPLETED, FAILED, "error"):
                    events.append(ws.receive_json())
    finally:
        engine.close(timeout=10)
    assert events[-1]["type"] == COMPLETED, events[-1]
    assert events[-1]["transcript"] == reference(asr, as_float(raw), 24000)
    assert "".join(e["delta"] for e in events if e["type"] == DELTA) == events[-1]["transcript"]


def test_live_sessions_close_before_uvicorn_closes_the_connections():
    """The drain's order, without timing: the server awaits ``before_shutdown`` (the realtime sessions' error event
    and close) before uvicorn closes every connection with its own bare 1012 (on a busy event loop that close used
    to come first, and the client saw no ``shutting_down`` event)."""
    import uvicorn

    from glmasr.server.http import make_server

    order = []

    class Connection:
        def shutdown(self):
            order.append("uvicorn closes the connection")

    async def before():
        await asyncio.sleep(0.05)
        order.append("sessions closed")

    server = make_server(uvicorn.Config(lambda scope, receive, send: None), before_shutdown=before)
    server.server_state.connections.add(Connection())
    server.servers, server.force_exit = [], True  # not started: no listening sockets, no lifespan to end
    asyncio.run(server.shutdown())
    assert order == ["sessions closed", "uvicorn closes the connection"]
