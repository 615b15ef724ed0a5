"""The page at ``GET /`` (glmasr/server/static/) in a real headless Chromium with a fake microphone, against a real
``glmasr serve`` (tiny checkpoint, CPU), driven over the Chrome DevTools Protocol.

Chromium plays speech.wav (espeak-ng: two sentences and pauses, looped by Chromium) as the microphone. The page
captures it through its AudioWorklet, resamples it to 24 kHz PCM16 and streams it over ``/v1/realtime``. Its
resampling and Chromium's own are not reproducible from Python, so the reference is built from what the page
actually sent: with ``?record=1`` the page keeps every client event it sent, as the exact JSON text, and the test
replays those messages on a new session of the same server from Python. Same bytes, same settings, same server:
the completed transcripts of the replay are the server's transcripts for that audio, and the page must show
exactly them (the tiny checkpoint's text is arbitrary but deterministic).

- Manual turns (``?vad=0``): the page sends appends, then on "stop" flushes its resampler and commits once. One
  item; the replay (appends + commit) is exact.
- server_vad: the test stops the page right after the second ``speech_stopped``. Turns ended by the server's VAD
  depend only on the samples (positions, not timing), so the replay's first items are the page's VAD items. The
  page commits a turn still open at stop; when a commit is recorded, the replay leaves it out (in a VAD session a
  commit's extent depends on how far the VAD had got, i.e. on timing) and that last item is not compared.
- The file picker: the page's POST /v1/audio/transcriptions shows what the server answers a plain HTTP client
  for the same file.
- The audio the page sent is the fake microphone's speech (normalized cross-correlation with speech.wav), so
  the comparison is not between transcripts of silence.

Skips only when Chromium is missing and GLMASR_REQUIRE_BROWSER is unset (CI sets it). Screenshots go to the
test's tmp_path and, when GLMASR_ARTIFACTS is set, to $GLMASR_ARTIFACTS/browser/.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

websockets = pytest.importorskip("websockets")
httpx2 = pytest.importorskip("httpx2")
from websockets.sync.client import connect  # noqa: E402

from live_server import KEY, ServerProcess  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = bool(os.environ.get("GLMASR_REQUIRE_BROWSER"))
RATE = 24000
APPEND = "input_audio_buffer.append"


@pytest.fixture(scope="module")
def speech_wav(chromium, tmp_path_factory):
    """Two espeak-ng sentences, 0.3 s of silence first and 1.2 s after each, 48 kHz 16-bit mono."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.fail("espeak-ng and sox are needed (Debian: apt-get install -y espeak-ng sox)")
    d = tmp_path_factory.mktemp("speech")
    parts = []
    for i, text in enumerate(["the birch canoe slid on the smooth planks", "glue the sheet to the dark blue paper"]):
        raw, out = d / f"s{i}.wav", d / f"p{i}.wav"
        subprocess.run(["espeak-ng", "-v", "en", "-s", "165", "-w", str(raw), text], check=True, capture_output=True)
        subprocess.run(["sox", str(raw), "-r", "48000", "-b", "16", str(out), "pad", "0.3" if i == 0 else "0", "1.2"],
                       check=True, capture_output=True)
        parts.append(str(out))
    wav = d / "speech.wav"
    subprocess.run(["sox", *parts, str(wav)], check=True, capture_output=True)
    return wav


@pytest.fixture(scope="module")
def chromium():
    if CHROMIUM is None:
        if REQUIRED:
            pytest.fail("GLMASR_REQUIRE_BROWSER is set but chromium is not installed (Debian: apt-get install "
                        "chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); GLMASR_REQUIRE_BROWSER=1 makes "
                    "this a failure")
    return CHROMIUM


@pytest.fixture(scope="module")
def server(chromium, tiny_shipped, tmp_path_factory):
    s = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("browser_server"))
    yield s
    s.stop()


class Browser:
    """Headless Chromium with a fake microphone playing ``wav``, one page, driven over the DevTools protocol."""

    def __init__(self, chromium: str, wav: Path, tmp: Path):
        self.stack = contextlib.ExitStack()
        self.profile = tmp / "chromium-profile"
        self.log = open(tmp / "chromium.log", "w")
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
             "--disable-extensions", "--disable-background-networking", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={wav}", "--autoplay-policy=no-user-gesture-required",
             "--window-size=1000,1200", "about:blank"], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            port_file = self.profile / "DevToolsActivePort"
            deadline = time.monotonic() + 20
            while not (port_file.exists() and port_file.read_text().strip()):
                assert self.proc.poll() is None, f"chromium exited: {(tmp / 'chromium.log').read_text()[-2000:]}"
                assert time.monotonic() < deadline, "chromium did not open its DevTools port"
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            targets = httpx2.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            page = next(t for t in targets if t["type"] == "page")
            self.ws = self.stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
            self.n = 0
        except BaseException:
            self.close()
            raise

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:  # events (no domain sends any unless enabled) are skipped
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self.n:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True, userGesture=True)
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            v = self.js(expr)
            if v:
                return v
            assert time.monotonic() < deadline, f"timed out waiting for {what}; status: {self.status()}"
            time.sleep(0.1)

    def status(self) -> str:
        return self.js("document.getElementById('status').textContent + ' | events: ' + "
                       "JSON.stringify(window.glmasr && window.glmasr.events.slice(-12))")

    def open(self, url: str):
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && !!window.glmasr", 15, "the page to load")

    def screenshot(self, path: Path):
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self):
        self.stack.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def browser(chromium, speech_wav, tmp_path):
    b = Browser(chromium, speech_wav, tmp_path)
    yield b
    b.close()


def artifact(tmp_path: Path, name: str) -> list[Path]:
    """Where a screenshot goes: tmp_path, and $GLMASR_ARTIFACTS/browser/ when that is set."""
    paths = [tmp_path / name]
    if os.environ.get("GLMASR_ARTIFACTS"):
        d = Path(os.environ["GLMASR_ARTIFACTS"]) / "browser"
        d.mkdir(parents=True, exist_ok=True)
        paths.append(d / name)
    return paths


def replay(server, messages: list[str], items: int, timeout: float = 30.0) -> list[str]:
    """Send ``messages`` (the page's exact client events) on a new session; the completed transcripts of the first
    ``items`` committed items (at most one more is waited for briefly), in commit order."""
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
    committed, done, errors = [], {}, []
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None) as ws:
        for m in messages:
            ws.send(m)
        deadline = time.monotonic() + timeout
        while True:
            have = len(committed) >= items and all(i in done for i in committed[:items])
            try:
                ev = json.loads(ws.recv(timeout=1.0 if have else max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                if have:
                    break
                assert time.monotonic() < deadline, f"the replay got {committed} / {done} / {errors}"
                continue
            if ev["type"] == "input_audio_buffer.committed":
                committed.append(ev["item_id"])
            elif ev["type"] == "conversation.item.input_audio_transcription.completed":
                done[ev["item_id"]] = ev["transcript"]
            elif ev["type"] in ("error", "conversation.item.input_audio_transcription.failed"):
                errors.append(ev)
    assert not errors, errors
    return [done[i] for i in committed if i in done]


def sent_audio(messages: list[str]) -> np.ndarray:
    return np.concatenate([np.frombuffer(base64.b64decode(json.loads(m)["audio"]), "<i2") for m in messages
                           if json.loads(m)["type"] == APPEND]).astype(np.float32) / 32768


def speech_match(x: np.ndarray, ref: np.ndarray, piece: int = RATE // 5) -> tuple[int, int]:
    """How many of ``x``'s voiced pieces (``piece`` samples, RMS > 0.01) appear in the looped ``ref``: (matched,
    voiced). Each piece is aligned on its own (best normalized cross-correlation over every lag of the loop,
    > 0.9 matches): a loaded machine's fake capture may drop or repeat a buffer, which shifts all later audio, so
    one alignment for the whole recording would test the machine's load, not the page."""
    loop = np.tile(ref, 3).astype(np.float64)
    energy = np.concatenate([[0.0], np.cumsum(loop ** 2)])
    window_norm = np.sqrt(np.maximum(energy[piece:] - energy[:-piece], 0.0))[: len(loop) - piece]
    n = 1 << int(np.ceil(np.log2(len(loop) + piece)))
    loop_f = np.fft.rfft(loop, n)
    matched = voiced = 0
    for start in range(0, len(x) - piece + 1, piece):
        p = x[start: start + piece].astype(np.float64)
        if np.sqrt(np.mean(p ** 2)) <= 0.01:
            continue
        voiced += 1
        corr = np.fft.irfft(loop_f * np.conj(np.fft.rfft(p, n)), n)[: len(loop) - piece]
        matched += float(np.max(corr / (window_norm * np.linalg.norm(p) + 1e-12))) > 0.9
    return matched, voiced


def speech_at_rate(wav: Path) -> np.ndarray:
    """The file's samples at the page's RATE."""
    import soundfile as sf

    from glmasr.audio import resample

    x, rate = sf.read(str(wav), dtype="float32")
    return resample(x, rate, RATE)


def assert_is_the_speech(x: np.ndarray, wav: Path):
    """``x`` (24 kHz) is the looped speech.wav up to Chromium's processing: at least 5 voiced 0.2 s pieces, and
    4 in 5 of them found in the speech (a wrong rate, noise or other speech match none:
    test_speech_match_tolerates_drops_and_fails_on_other_audio)."""
    matched, voiced = speech_match(x, speech_at_rate(wav))
    assert voiced >= 5 and matched >= 0.8 * voiced, (matched, voiced)


def test_speech_match_tolerates_drops_and_fails_on_other_audio(speech_wav, tmp_path):
    """The check above, without a browser: the speech passes, also with a dropped and a repeated 10 ms buffer (the
    pieces across them may miss); the speech 5 % fast, noise of its loudness and another espeak-ng sentence fail."""
    from glmasr.audio import resample

    ref = speech_at_rate(speech_wav)
    x = np.tile(ref, 2)[int(0.2 * RATE): int(2.7 * RATE)]
    hop = RATE // 100
    glitched = np.concatenate([x[:hop * 30], x[hop * 31: hop * 120], x[hop * 119: hop * 121], x[hop * 121:]])
    assert speech_match(x, ref) == (12, 12)
    matched, voiced = speech_match(glitched, ref)
    assert voiced == 12 and matched >= 0.8 * voiced, (matched, voiced)
    other = tmp_path / "other.wav"
    subprocess.run(["espeak-ng", "-v", "en", "-s", "165", "-w", str(other), "a large size in stockings is hard to "
                    "sell"], check=True, capture_output=True)
    noise = (np.random.default_rng(0).standard_normal(len(x)) * np.sqrt(np.mean(x ** 2))).astype(np.float32)
    for bad in (resample(x, RATE, int(RATE * 1.05))[: len(x)], noise, speech_at_rate(other)[: len(x)]):
        matched, voiced = speech_match(bad, ref)
        assert voiced >= 5 and matched <= 0.2 * voiced, (matched, voiced)


ITEMS_DONE = ("[...document.querySelectorAll('#final .item')]"
              ".map(e => [e.dataset.itemId, e.dataset.state, e.textContent])")


def test_page_transcribes_the_microphone_and_a_file(server, browser, speech_wav, tmp_path):
    t_start = time.monotonic()
    base = server.base
    # 1. manual turns: record ~2.5 s, stop (the page commits once), compare with the replay of what it sent
    browser.open(f"{base}/?vad=0&record=1")
    assert browser.js("document.getElementById('turns').value") == "manual"
    browser.js(f"(() => {{ const k = document.getElementById('api-key'); k.value = {json.dumps(KEY)}; "
               "k.dispatchEvent(new Event('change')); })()")
    browser.js("document.getElementById('mic').click()")
    browser.wait(f"window.glmasr.sentSamples >= {int(2.5 * RATE)}", 20, "2.5 s of audio sent")
    browser.js("document.getElementById('mic').click()")
    browser.wait("window.glmasr.state === 'stopped'", 30, "the page to stop")
    items = browser.js(ITEMS_DONE)
    messages = browser.js("window.glmasr.recording")
    assert [json.loads(m)["type"] for m in messages[:1] + messages[-1:]] == ["session.update",
                                                                             "input_audio_buffer.commit"]
    update = json.loads(messages[0])["session"]["audio"]["input"]
    assert update["turn_detection"] is None and update["format"] == {"type": "audio/pcm", "rate": RATE}
    assert_is_the_speech(sent_audio(messages), speech_wav)
    assert len(items) == 1 and items[0][1] == "done", items
    expected = replay(server, messages, 1)
    assert expected and expected[0], expected  # non-empty: the comparison means something
    assert [text for _, _, text in items] == expected
    assert browser.js("document.getElementById('status').textContent") == "Stopped."

    # 2. server_vad: stop right after the second turn ended; the key survives the reload (local storage)
    browser.open(f"{base}/?record=1")
    assert browser.js("document.getElementById('api-key').value") == KEY
    browser.js("document.getElementById('mic').click()")
    browser.wait("window.glmasr.events.filter(t => t === 'input_audio_buffer.speech_stopped').length >= 2", 25,
                 "two turns")
    for path in artifact(tmp_path, "page-live.png"):  # listening: the button says stop, earlier turns shown
        browser.screenshot(path)
    browser.js("document.getElementById('mic').click()")
    browser.wait("window.glmasr.state === 'stopped'", 30, "the page to stop")
    items = browser.js(ITEMS_DONE)
    messages = browser.js("window.glmasr.recording")
    manual = json.loads(messages[-1])["type"] == "input_audio_buffer.commit"
    appends = [m for m in messages if json.loads(m)["type"] != "input_audio_buffer.commit"]
    assert len(appends) == len(messages) - manual  # a commit only ever comes last, at stop
    vad_items = items[:-1] if manual else items
    assert len(vad_items) >= 2 and all(state == "done" for _, state, _ in items), items
    expected = replay(server, appends, len(vad_items))
    assert [text for _, _, text in vad_items] == expected[: len(vad_items)]
    assert len(expected) <= len(vad_items) + 1  # (the texts compared in order: the DOM keeps commit order)

    # 3. the file picker: the page shows what the server answers for the same file
    doc = browser.call("DOM.getDocument")
    node = browser.call("DOM.querySelector", nodeId=doc["root"]["nodeId"], selector="#file")["nodeId"]
    browser.call("DOM.setFileInputFiles", nodeId=node, files=[str(speech_wav)])
    browser.wait("document.getElementById('upload-text').dataset.state === 'done'", 20, "the upload's text")
    shown = browser.js("document.getElementById('upload-text').textContent")
    models = server.http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    r = server.http.post("/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                         data={"model": models[0]["id"], "response_format": "json"},
                         files={"file": ("speech.wav", speech_wav.read_bytes(), "audio/wav")})
    assert r.status_code == 200 and shown == r.json()["text"] and shown
    assert "speech.wav: done" in browser.js("document.getElementById('file-status').textContent")
    for path in artifact(tmp_path, "page.png"):
        browser.screenshot(path)
    assert (tmp_path / "page.png").stat().st_size > 10_000
    assert time.monotonic() - t_start < 60


def test_page_reports_a_wrong_key(server, browser, tmp_path):
    """A refused session (wrong key): the server's error message is on the status line, the buttons reset."""
    browser.open(f"{server.base}/")
    browser.js("(() => { const k = document.getElementById('api-key'); k.value = 'wrong-key'; "
               "k.dispatchEvent(new Event('change')); })()")
    browser.js("document.getElementById('mic').click()")
    status = browser.wait("window.glmasr.state === 'idle' && document.getElementById('status').classList.contains"
                          "('error') && document.getElementById('status').textContent", 20, "the refusal")
    assert "incorrect API key" in status and "1008" in status, status
    assert browser.js("document.getElementById('mic').getAttribute('aria-pressed')") == "false"
    for path in artifact(tmp_path, "page-wrong-key.png"):
        browser.screenshot(path)


@contextlib.contextmanager
def other_origin_page(tmp: Path):
    """A blank page served from another port of 127.0.0.1: another web origin than the glmasr server's."""
    import functools
    import http.server
    import threading

    root = tmp / "other-origin"
    root.mkdir()
    (root / "index.html").write_text("<!doctype html><title>another site</title><p>another site</p>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_page_of_another_origin_is_refused(server, browser, tmp_path):
    """A page of another origin (another port) opens /v1/realtime with the right key: Chromium sends its Origin,
    the server answers with one error event (origin_not_allowed) and close 1008; its upload fetch is refused too
    (the server's 403 is not readable cross-origin: the page sees a failed fetch)."""
    with other_origin_page(tmp_path) as other:
        browser.call("Page.navigate", url=f"{other}/index.html")
        browser.wait("document.readyState === 'complete' && document.title === 'another site'", 15, "the page")
        ws_url = server.base.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        browser.js(f"""(() => {{
            window.got = {{events: [], close: null}};
            const ws = new WebSocket({json.dumps(ws_url)}, ["realtime", {json.dumps("openai-insecure-api-key." + KEY)}]);
            ws.onmessage = (e) => window.got.events.push(JSON.parse(e.data));
            ws.onclose = (e) => {{ window.got.close = e.code; }};
        }})()""")
        got = browser.wait("window.got.close !== null && window.got", 20, "the connection to close")
        fetched = browser.js(f"""fetch({json.dumps(server.base + "/v1/models")},
            {{headers: {{"Authorization": "Bearer {KEY}"}}}}).then(r => "read " + r.status, e => "failed: " + e)""")
    assert got["close"] == 1008, got
    assert [e["type"] for e in got["events"]] == ["error"], got
    err = got["events"][0]["error"]
    assert err["code"] == "origin_not_allowed" and other in err["message"], err
    assert fetched.startswith("failed"), fetched
