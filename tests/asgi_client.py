"""A raw ASGI upload whose client goes away: the disconnect tests of both servers (single engine and data
parallel) drive the app with it instead of an HTTP client, so the moment of the disconnect is theirs."""

from __future__ import annotations

import asyncio


class DisconnectingUpload:
    """POST /v1/audio/transcriptions with ``body`` (multipart, ``ctype``); the client disconnects once ``gone``
    is set, which the first streamed delta event does by itself. ``sent`` collects what the app sent."""

    def __init__(self, body: bytes, ctype: str):
        self.body, self.sent, self.gone = body, [], asyncio.Event()
        self._body_sent = False
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                      "scheme": "http", "path": "/v1/audio/transcriptions",
                      "raw_path": b"/v1/audio/transcriptions", "query_string": b"", "root_path": "",
                      "client": ("127.0.0.1", 1), "server": ("testserver", 80),
                      "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]}

    async def receive(self):
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)
        if message["type"] == "http.response.body" and b"transcript.text.delta" in message.get("body", b""):
            self.gone.set()

    def start(self, app) -> asyncio.Task:
        return asyncio.create_task(app(self.scope, self.receive, self.send))

    def bodies(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
