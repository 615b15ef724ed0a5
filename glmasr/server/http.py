"""The HTTP connection layer under the routes: connection timeouts, request framing, and uvicorn's settings.

What happens before a route runs is where a slow or hostile client can hold a server's resources for free, so the
limits live here, each with its ``glmasr serve`` flag:

- **Header timeout** (``--header-timeout``, default 10 s): a connection must deliver a complete request line and
  headers within this time from when it opened (or from the first byte of its next request on a kept-alive
  connection); otherwise it is closed (with a bare ``408`` when nothing of a response was sent). Without it a
  connection that sends nothing, or headers one byte at a time, is held forever (uvicorn times out only idle
  kept-alive connections).
- **Keep-alive timeout** (``--keep-alive-timeout``, default 5 s): uvicorn's own, for idle connections between
  requests.
- **Framing** (``FramingGuard``): a request carrying both ``Content-Length`` and ``Transfer-Encoding``, several
  ``Content-Length`` values, or a ``Transfer-Encoding`` other than ``chunked`` is refused with a 400 in the OpenAI
  envelope and the connection is closed, whatever the parser beneath made of it: a front proxy and this server could
  otherwise disagree on where the body ends, and a second request hidden in the body would run (request smuggling).
  Some malformed requests are refused by the HTTP parser (h11) itself before any of our code runs: those get
  uvicorn's plain-text ``400 Invalid HTTP request received.``, and a connection over ``--max-connections`` gets
  uvicorn's plain-text ``503``; these are the only answers not in the envelope.
- **Web origins** (``OriginGuard``, ``--allowed-origins``): a browser tells the server which page sends a request
  (the ``Origin`` header), and any page a user visits may send one to a server on their machine or network (an
  upload is a "simple" cross-origin request: it runs even though the page cannot read the answer; WebSockets have
  no same-origin rule at all). So a request with an ``Origin`` is served only when that origin is the server's own
  (its host and port are the request's ``Host``: the microphone page at ``/``) or one the operator allowed;
  others get a 403 in the envelope (``origin_not_allowed``; ``/v1/realtime`` answers with a Realtime ``error``
  event and close 1008). Requests without an ``Origin`` (the openai SDK, curl, servers) are not affected. Allowed
  origins also get CORS headers (preflights answered), so a web app on another origin can use the API.

The body's own limits (idle time between chunks, total upload time, size) are the upload reader's
(``uploads.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpLimits:
    """Connection and upload timeouts, in seconds (``glmasr serve`` flags in brackets):

    header_timeout_s [--header-timeout]: request line + headers; read_timeout_s [--read-timeout]: the longest pause
    while a request body is received; upload_timeout_s [--upload-timeout]: the whole body; keep_alive_s
    [--keep-alive-timeout]: an idle connection between requests; max_connections [--max-connections]: open
    connections (uvicorn answers 503 beyond); max_uploads [--max-uploads]: request bodies being received at once
    (one more gets a 503 in the envelope; uploads are spooled to disk past 1 MiB, so each costs ~1 MiB of memory).
    """

    header_timeout_s: float = 10.0
    read_timeout_s: float = 15.0
    upload_timeout_s: float = 300.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024
    max_uploads: int = 256

    def __post_init__(self):
        for name in ("header_timeout_s", "read_timeout_s", "upload_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_connections", "max_uploads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def framing_error(headers) -> str | None:
    """Why a request's framing headers are refused (None: they are fine). ``headers``: (name, value) byte pairs as
    ASGI gives them (names lower-case)."""
    lengths = [v for k, v in headers if k == b"content-length"]
    encodings = [v for k, v in headers if k == b"transfer-encoding"]
    if lengths and encodings:
        return "the request has both Content-Length and Transfer-Encoding headers; send one of them"
    if len(lengths) > 1:
        return "the request has more than one Content-Length header"
    if lengths and not lengths[0].strip().isdigit():
        return "the Content-Length header is not a non-negative integer"
    if len(encodings) > 1 or (encodings and encodings[0].strip().lower() != b"chunked"):
        return "Transfer-Encoding must be exactly 'chunked'"
    return None


class FramingGuard:
    """ASGI middleware: refuse requests whose framing is ambiguous (``framing_error``) before the app sees them,
    with a 400 in the OpenAI envelope and ``Connection: close`` (so nothing pipelined behind it is read)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            why = framing_error(scope["headers"])
            if why is not None:
                await send_refusal(send, 400, why, "invalid_framing", close=True)
                return
        await self.app(scope, receive, send)


async def send_refusal(send, status: int, message: str, code: str, close: bool = False) -> None:
    """An answer in the OpenAI envelope (``invalid_request_error``) sent by a middleware before any route runs;
    ``close``: with ``Connection: close``."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), *([(b"connection", b"close")] if close else []),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _canonical_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def normalize_origin(origin: str) -> str:
    """An ``--allowed-origins`` entry as browsers send it: ``scheme://host[:port]`` in lower case, or ``*`` (every
    origin) or ``null`` (pages without one, e.g. ``file://``). ValueError names what is wrong."""
    o = _canonical_origin(origin)
    if o in ("*", "null"):
        return o
    parts = urlsplit(o)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment \
            or parts.username is not None:
        raise ValueError(f"an allowed origin is scheme://host[:port] (http or https, no path), '*' or 'null'; "
                         f"got {origin!r}")
    return o


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a request with this ``Origin`` header (None: not sent, i.e. not from a browser page) may be served:
    no origin, the server's own (the origin's host[:port] is the request's ``Host``), or one of ``allowed``
    (normalized entries; ``*``: any)."""
    if origin is None:
        return True
    o = _canonical_origin(origin)
    if "*" in allowed or o in allowed:
        return True
    parts = urlsplit(o)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and host is not None \
        and parts.netloc == host.strip().lower()


def origin_refusal(origin: str, allowed: tuple[str, ...]) -> str:
    """The message for a refused origin."""
    also = f" and from {', '.join(allowed)}" if allowed else ""
    return (f"requests from the web page origin {origin[:200]!r} are not allowed: this server accepts browser "
            f"requests from its own origin{also} (glmasr serve --allowed-origins)")


class OriginGuard:
    """ASGI middleware: an HTTP request whose ``Origin`` is not allowed (``origin_allowed``) gets a 403 in the
    OpenAI envelope before any route runs. WebSockets pass: ``/v1/realtime`` refuses them itself, with an ``error``
    event the client can read."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin, host = headers.get(b"origin"), headers.get(b"host")
            if origin is not None and not origin_allowed(origin.decode("latin-1"),
                                                         None if host is None else host.decode("latin-1"),
                                                         self.allowed):
                await send_refusal(send, 403, origin_refusal(origin.decode("latin-1"), self.allowed),
                                   "origin_not_allowed")
                return
        await self.app(scope, receive, send)


_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout: a connection that has not delivered a complete request head
    within ``header_timeout`` (from its opening, or from the first byte of its next request) is closed. The
    timeout comes from ``protocol_class(header_timeout)``."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # a request head has begun (or not) but is not complete
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of a response is on the wire: say why it is closed
            self.transport.write(_TIMEOUT_408)
        self.logger.info("closed a connection from %s: no complete request head within %g s (--header-timeout)",
                         "%s:%d" % self.client if self.client else "?", self.header_timeout)
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` subclass with this header timeout (uvicorn's ``http=`` takes a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": float(header_timeout_s)})


def uvicorn_config(app, host: str, port: int, limits: HttpLimits, **kwargs):
    """A ``uvicorn.Config`` serving ``app`` with these limits (the h11 protocol with the header timeout).

    WebSocket compression (permessage-deflate) is declined: realtime sessions send base64 PCM, which deflate
    shrinks little, and inflating every append costs the one event loop that carries all sessions."""
    import uvicorn

    kwargs.setdefault("ws_per_message_deflate", False)
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits.header_timeout_s),
                          timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections,
                          **kwargs)


# sys.setswitchinterval of a server process. One interpreter runs the event loop (every session's appends), the VAD
# workers and the engine thread. A thread that comes back from C code which released the GIL (a CUDA wait, soxr,
# zlib, epoll) waits for the holder to reach the switch interval; Python's 5 ms default then adds milliseconds to
# every engine step and every append under load, so the server switches at 0.5 ms.
SWITCH_INTERVAL_S = 0.0005


def log_config(level: str) -> dict:
    """uvicorn's logging set-up, with the server's own logger (``glmasr``: one line per event, e.g. a client gone
    mid-upload, a refused request head) on the same handler and level."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["glmasr"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def _server_class():
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM/SIGINT that led to a graceful shutdown is not re-raised at the
        end (uvicorn re-raises it, so the process would die of the signal): the drained server exits with 0.
        ``on_exit``: called at the signal (the engine workers stop being restarted). ``before_shutdown``: awaited
        before uvicorn closes the open connections (the realtime sessions close with their ``error`` event)."""

        on_exit = None
        before_shutdown = None
        ignore_sigint = False  # a front-end of --frontends: Ctrl-C reaches the process group; the supervisor decides

        def handle_exit(self, sig, frame):
            if self.ignore_sigint and sig == signal.SIGINT:
                return
            if self.on_exit is not None:
                self.on_exit()
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def shutdown(self, sockets=None):
            if self.before_shutdown is not None:
                try:
                    await self.before_shutdown()
                except Exception as e:  # the connections are closed below either way
                    logging.getLogger(__name__).error("before shutdown: %s: %s", type(e).__name__, e)
            await super().shutdown(sockets)

    return Server


def make_server(config, on_exit=None, ignore_sigint: bool = False, before_shutdown=None):
    server = _server_class()(config)
    server.on_exit = on_exit
    server.ignore_sigint = ignore_sigint
    server.before_shutdown = before_shutdown
    return server
