"""Web origins (``glmasr serve --allowed-origins``; ``server.http.OriginGuard``, the ``/v1/realtime`` refusal):
a browser request from a page of another origin is refused before any route runs (HTTP: 403 in the OpenAI
envelope; WebSocket: a Realtime ``error`` event ``origin_not_allowed`` and close 1008), the server's own page and
clients that send no ``Origin`` (SDKs, curl) are served as before, and allowed origins get CORS headers.

In-process (Starlette's TestClient on the tiny checkpoint), plus the flag through the real CLI parser and
ServerConfig. A real Chromium page of another origin against a real server: tests/test_browser.py.
"""

from __future__ import annotations

import io

import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
from starlette.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.server.http import normalize_origin, origin_allowed  # noqa: E402

from conftest import noise  # noqa: E402

KEY = "origin-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SELF = "http://testserver"  # TestClient's Host is "testserver"
EVIL = "https://evil.example"
APP = "https://app.example:8443"


def _wav() -> bytes:
    b = io.BytesIO()
    sf.write(b, noise(0.5, 3), 16000, format="WAV")
    return b.getvalue()


def _post(c, origin=None, **extra):
    headers = dict(AUTH, **({"Origin": origin} if origin is not None else {}), **extra)
    return c.post("/v1/audio/transcriptions", headers=headers, files={"file": ("a.wav", _wav(), "audio/wav")},
                  data={"model": "glm-asr-nano-2512"})


@pytest.fixture(scope="module")
def clients(asr):
    """Two apps on one model: the default policy, and one allowing APP."""
    out = {}
    with TestClient(create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))) as c0, \
            TestClient(create_app(asr, ServerConfig(api_key=KEY, close_engine=False, warmup="none",
                                                    allowed_origins=(APP + "/",)))) as c1:
        out["default"], out["allowed"] = c0, c1
        yield out


def test_origin_rules():
    assert origin_allowed(None, "h:1")  # not a browser
    assert origin_allowed("http://h:1", "h:1") and origin_allowed("HTTP://H:1/", "h:1")  # the server's own page
    assert not origin_allowed("http://h:2", "h:1") and not origin_allowed("https://evil.example", "h:1")
    assert not origin_allowed("null", "h:1") and origin_allowed("null", "h:1", ("null",))
    assert not origin_allowed("http://h:1", None)  # no Host: nothing to be the same as
    assert origin_allowed("https://a.b", "h:1", ("https://a.b",)) and origin_allowed("http://x", "h", ("*",))
    assert normalize_origin(" HTTPS://App.Example:8443/ ") == "https://app.example:8443"
    for bad in ("app.example", "ftp://a.b", "https://a.b/path", "https://a.b?x=1", "https://u@a.b", "", "*.example"):
        with pytest.raises(ValueError, match="an allowed origin is scheme://host"):
            normalize_origin(bad)
    with pytest.raises(ValueError, match="an allowed origin is scheme://host"):
        ServerConfig(allowed_origins=("https://a.b/x",))
    assert ServerConfig(allowed_origins=("https://A.b/", "https://a.b")).allowed_origins == ("https://a.b",)


def test_cross_origin_upload_is_refused_before_any_work(clients):
    c = clients["default"]
    before = c.get("/metrics").text
    r = _post(c, EVIL)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "origin_not_allowed" and err["type"] == "invalid_request_error"
    assert EVIL in err["message"] and "--allowed-origins" in err["message"]
    assert "access-control-allow-origin" not in r.headers
    # the refusal ran before the route: the request counters did not move
    count = [ln for ln in before.splitlines() if ln.startswith("glmasr_requests_total")]
    assert [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("glmasr_requests_total")] == count
    for path in ("/v1/models", "/health"):
        assert c.get(path, headers={"Origin": EVIL, **AUTH}).status_code == 403


def test_own_page_and_plain_clients_are_served(clients):
    c = clients["default"]
    ok = _post(c)
    assert ok.status_code == 200, ok.text
    same = _post(c, SELF)
    assert same.status_code == 200 and same.json() == ok.json()
    assert "access-control-allow-origin" not in same.headers
    assert c.get("/", headers={"Origin": SELF}).status_code == 200


def test_allowed_origin_gets_cors(clients):
    c = clients["allowed"]
    r = _post(c, APP)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP
    pre = c.options("/v1/audio/transcriptions", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert _post(c, EVIL).status_code == 403  # the list is not "anyone"
    assert _post(c, SELF).status_code == 200  # the own page still is


def _realtime(c, origin):
    headers = {"origin": origin} if origin is not None else {}
    with c.websocket_connect("/v1/realtime?intent=transcription", headers=headers,
                             subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        first = ws.receive_json()
        if first["type"] != "error":
            return first, None
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        return first, closed.value.code


@pytest.mark.parametrize("which,origin,refused", [
    ("default", EVIL, True), ("default", "null", True), ("default", SELF, False), ("default", None, False),
    ("allowed", APP, False), ("allowed", EVIL, True)])
def test_realtime_sessions_follow_the_same_policy(clients, which, origin, refused):
    first, code = _realtime(clients[which], origin)
    if refused:
        assert first["type"] == "error" and first["error"]["code"] == "origin_not_allowed", first
        assert code == 1008
        assert origin in first["error"]["message"]
    else:
        assert first["type"] == "session.created", first


def test_cli_flag_reaches_the_config(tiny_shipped, monkeypatch):
    from glmasr.cli import serve

    args = serve.build_parser().parse_args(["--allowed-origins", "https://a.example, http://localhost:3000,"])
    assert args.allowed_origins == ("https://a.example", "http://localhost:3000")
    assert serve.build_parser().parse_args([]).allowed_origins == ()


def test_cli_refuses_a_malformed_origin(tiny_shipped, capsys, monkeypatch):
    """Before anything is loaded (the model load would fail the test)."""
    import glmasr
    from glmasr.cli import serve

    monkeypatch.setattr(glmasr, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    rc = serve.main(["--model", str(tiny_shipped), "--device", "cpu", "--allowed-origins", "https://a.example/app"])
    assert rc == 2
    assert "an allowed origin is scheme://host[:port]" in capsys.readouterr().err
