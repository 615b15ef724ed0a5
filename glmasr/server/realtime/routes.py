"""The WebSocket route ``GET /v1/realtime`` (OpenAI's Realtime transcription sessions) and its limits.

Connecting: ``ws://HOST/v1/realtime?intent=transcription`` (``intent`` may be left out; any other value is refused),
optionally ``&model=NAME`` (a served name: the session's transcription model). With an API key, the key comes as
``Authorization: Bearer KEY`` or, from a browser (which cannot set headers), as the subprotocol
``openai-insecure-api-key.KEY``. The server answers the subprotocol ``realtime`` when the client offers it (else the
first one offered: a browser fails a connection whose offered subprotocols all go unanswered). A refused connection is
still accepted, so that the client can read why: one ``error`` event, then the close code:

| refusal | error code | close code |
|---|---|---|
| a browser page of another origin than the server's own or ``--allowed-origins`` (``http.OriginGuard``) | origin_not_allowed | 1008 |
| no or wrong API key | invalid_api_key | 1008 (policy violation) |
| ``intent`` other than transcription | invalid_intent | 1008 |
| ``model`` not served | model_not_found | 1008 |
| ``--max-realtime-sessions`` sessions already open | session_limit | 1013 (try again later) |
| warming up / draining (SIGTERM) | not_ready / shutting_down | 1013 |
| the VAD network could not be loaded (no silero-vad weights) | vad_unavailable | 1011 |

A plain HTTP ``GET /v1/realtime`` (no upgrade) is answered 426 (``upgrade_required``) in the OpenAI envelope.
Then: ``session.created``, and the session runs (``protocol`` has the events, ``glmasr.live.session`` the turns).
Limits of a session (``RealtimeLimits``; ``glmasr serve`` flags):

- ``max_session_s`` (``--realtime-max-session-s``, default 3600): then ``error`` ``session_expired`` and close 1000
  (audio beyond that many seconds, sent faster than real time, is refused earlier: ``session_too_long``);
- ``idle_timeout_s`` (``--realtime-idle-timeout-s``, default 120): no event either way for this long, and no
  committed turn still being transcribed: ``error`` ``idle_timeout`` and close 1000 (a live microphone sends audio
  all the time; this catches clients gone silent);
- ``max_buffer_s`` (``--realtime-max-buffer-s``, default 60): audio appended and not yet committed; an append past
  it is refused whole (``buffer_too_large``; the session goes on: commit or clear);
- ``max_event_bytes`` (4 MiB): one client event; larger ones are refused (``event_too_large``), and a WebSocket
  message over twice this size closes the connection (1009, uvicorn's frame limit, set by ``glmasr serve``).

A disconnect (or any end) closes the session: its engine requests are aborted, their slots freed. When the server
drains (SIGTERM), every open session gets ``error`` ``shutting_down`` and close 1012 (service restart); its turns in
flight are aborted. The connection limits of ``http`` apply: a WebSocket counts against ``--max-connections``; the
header timeout covers the upgrade request's head only, and the keep-alive timeout does not apply to an open
WebSocket (uvicorn pings it every 20 s instead).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, WebSocket

from ...audio.features import SAMPLE_RATE
from ...audio.stream import StreamDecoder
from ..http import origin_allowed, origin_refusal
from ..protocol import APIError
from . import protocol as rp
from .protocol import ProtocolError, SessionConfig

log = logging.getLogger("glmasr.server")

MIB = 1024 * 1024
KEY_SUBPROTOCOL = "openai-insecure-api-key."
MAX_PENDING_EVENTS = 10_000  # server events queued for a client that does not read them: then it is dropped
CLOSE_GRACE_S = 5.0  # a close that cannot be sent (the client stopped reading) ends the connection after this
WATCHDOG_S = 0.25  # how often the session limits are checked


@dataclass(frozen=True)
class RealtimeLimits:
    """Limits of the realtime sessions (see the module docstring). ``max_sessions`` None: 8 x the engines' slots
    (512 on one GPU engine with 64 slots; a live session holds a slot only while a turn is transcribed)."""

    max_sessions: int | None = None
    max_session_s: float = 3600.0
    idle_timeout_s: float = 120.0
    max_buffer_s: float = 60.0
    max_event_bytes: int = 4 * MIB

    def __post_init__(self):
        if self.max_sessions is not None and (isinstance(self.max_sessions, bool) or self.max_sessions < 1):
            raise ValueError(f"max_sessions must be a positive integer (or None), got {self.max_sessions!r}")
        for name in ("max_session_s", "idle_timeout_s", "max_buffer_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_event_bytes, bool) or not isinstance(self.max_event_bytes, int) \
                or self.max_event_bytes < 1024:
            raise ValueError(f"max_event_bytes must be an integer >= 1024, got {self.max_event_bytes!r}")

    @property
    def ws_max_size(self) -> int:
        """uvicorn's WebSocket message limit: above ``max_event_bytes`` so that an oversized event gets an error
        event, bounded so that one message cannot take unbounded memory."""
        return 2 * self.max_event_bytes


class RealtimeService:
    """What every realtime connection shares: the engine client, the tokenizer (token ids -> text), the one
    ``VadStreams`` (started and stopped with the app), the metrics and the count of open sessions."""

    def __init__(self, engine, limits: RealtimeLimits, metrics, state, sessions=None):
        self.engine = engine
        self.prompts = None  # the checkpoint's PromptBuilder (token ids -> text), set by the app's warm-up
        self.limits = limits
        self.state = state  # app.ServerState: ``draining``
        self.max_sessions = live_limit(limits, engine)
        # the open sessions of every front-end (``frontends.SharedCount``: reserve / release / total), or None
        self.sessions = sessions
        self.metrics = metrics
        self.hook = metrics.live()
        self.vads = None
        self.vad_error: str | None = None
        self.active = 0
        self.connections: set = set()

    async def start(self) -> None:
        """Load the VAD network (CPU: the GPU stays the engine's) and start its ticker. Without the silero-vad
        weights the endpoint refuses sessions (``vad_unavailable``)."""
        from ...live.vad_stream import VadStreams

        try:
            self.vads = await asyncio.to_thread(VadStreams, "cpu")
        except Exception as e:  # VadUnavailableError (no weights) or a broken install: the endpoint says why
            self.vad_error = f"{type(e).__name__}: {e}"
            log.error("realtime sessions are unavailable: the VAD could not be loaded: %s", self.vad_error)
            return
        await self.vads.start()

    async def close_sessions(self) -> None:
        """Every open session gets ``error`` ``shutting_down`` and close 1012; returns once they ended (at most
        CLOSE_GRACE_S). Run before the HTTP server closes its connections: its own close (1012 too) carries no
        event, and on a busy loop it would otherwise come first."""
        for conn in list(self.connections):
            conn.finish("the server is shutting down", "shutting_down", 1012, type="server_error")
        if self.connections:
            await asyncio.wait([c.done for c in self.connections], timeout=CLOSE_GRACE_S)

    async def stop(self) -> None:
        await self.close_sessions()
        if self.vads is not None:
            await self.vads.stop()


def live_limit(limits: RealtimeLimits, engine) -> int:
    """The most open realtime sessions: ``max_sessions``, else 8 x the engines' slots."""
    return limits.max_sessions or 8 * engine.slots


def _offered_key(subprotocols) -> str | None:
    for p in subprotocols:
        if p.startswith(KEY_SUBPROTOCOL):
            return p[len(KEY_SUBPROTOCOL):]
    return None


def _answer_subprotocol(subprotocols) -> str | None:
    if "realtime" in subprotocols:
        return "realtime"
    return subprotocols[0] if subprotocols else None


def add_realtime_route(app: FastAPI, ctx, service: RealtimeService) -> None:
    """Mount ``GET /v1/realtime`` (``ctx``: the routes' ``ServerContext``: config, state, served names)."""

    def key_ok(ws: WebSocket) -> bool:
        expected = ctx.config.api_key
        if expected is None:
            return True
        header = ws.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), expected.encode()):
            return True
        offered = _offered_key(ws.scope.get("subprotocols") or [])
        return offered is not None and secrets.compare_digest(offered.encode(), expected.encode())

    def refusal(ws: WebSocket) -> tuple[str, str, str | None, int, str] | None:
        """(message, code, param, close code, error type) of a connection that is refused, else None."""
        origin = ws.headers.get("origin")
        if not origin_allowed(origin, ws.headers.get("host"), ctx.config.allowed_origins):
            return (origin_refusal(origin, ctx.config.allowed_origins), "origin_not_allowed", None, 1008,
                    "invalid_request_error")
        if not key_ok(ws):
            return ("missing or incorrect API key: send 'Authorization: Bearer <key>' or the subprotocol "
                    f"'{KEY_SUBPROTOCOL}<key>'", "invalid_api_key", None, 1008, "invalid_request_error")
        intent = ws.query_params.get("intent")
        if intent is not None and intent != "transcription":
            return (f"this server serves transcription sessions only: intent must be 'transcription', got "
                    f"{intent[:100]!r}", "invalid_intent", "intent", 1008, "invalid_request_error")
        model = ws.query_params.get("model")
        if model is not None and model.strip().lower() not in ctx.lookup:
            return (f"the model {model[:100]!r} does not exist on this server; it serves {', '.join(ctx.names)}",
                    "model_not_found", "model", 1008, "invalid_request_error")
        if ctx.state.draining.is_set():
            return ("the server is shutting down; connect to another replica or retry later", "shutting_down", None,
                    1013, "server_error")
        if not ctx.state.ready or service.vads is None or service.prompts is None:
            if service.vad_error:
                return (f"realtime sessions are unavailable: the VAD could not be loaded ({service.vad_error})",
                        "vad_unavailable", None, 1011, "server_error")
            return ("the model is warming up; see GET /health/ready", "not_ready", None, 1013, "server_error")
        if service.sessions is not None:  # counted over every front-end; reserved here, released at the end
            if not service.sessions.reserve():
                return (f"the server has {service.sessions.total()} realtime sessions open (its limit, "
                        "--max-realtime-sessions); retry later", "session_limit", None, 1013, "server_error")
        elif service.active >= service.max_sessions:
            return (f"the server has {service.active} realtime sessions open (its limit, --max-realtime-sessions); "
                    "retry later", "session_limit", None, 1013, "server_error")
        return None

    @app.get("/v1/realtime", include_in_schema=False)
    async def realtime_http():  # a plain HTTP request: say what the endpoint is
        raise APIError(426, "/v1/realtime is a WebSocket endpoint: connect to ws://HOST/v1/realtime?intent="
                            "transcription with a WebSocket client (e.g. the openai SDK's client.realtime.connect)",
                       code="upgrade_required", headers={"Upgrade": "websocket"})

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        offered = ws.scope.get("subprotocols") or []
        frontend = ctx.state.frontend
        await ws.accept(subprotocol=_answer_subprotocol(offered),
                        headers=None if frontend is None else [frontend.header])
        if frontend is not None:
            service.metrics.reached("realtime")
        refused = refusal(ws)
        if refused is not None:
            message, code, param, close_code, kind = refused
            service.metrics.live_errors.labels(code).inc()
            try:
                await ws.send_text(rp.dumps(rp.error(message, code, param, type=kind)))
                await ws.close(close_code, reason=code)
            except Exception:  # the client is already gone
                pass
            return
        model = ws.query_params.get("model")
        names = ctx.lookup
        default_model = names[model.strip().lower()] if model is not None else \
            names.get(rp.DEFAULT_MODEL_NAME, ctx.names[0])
        beta = "realtime=v1" in ws.headers.get("openai-beta", "")
        conn = Connection(ws, service, SessionConfig(model=default_model, shape="beta" if beta else "ga"), names)
        service.active += 1
        service.metrics.live_sessions.set(service.active)
        service.metrics.live_sessions_total.inc()
        service.connections.add(conn)
        try:
            await conn.run()
        finally:
            service.connections.discard(conn)
            service.active -= 1
            if service.sessions is not None:
                service.sessions.release()
            service.metrics.live_sessions.set(service.active)


class Connection:
    """One realtime WebSocket: reads client events, drives a ``LiveSession``, writes server events in order."""

    def __init__(self, ws: WebSocket, service: RealtimeService, cfg: SessionConfig, names: dict):
        self.ws = ws
        self.service = service
        self.cfg = cfg
        self.names = names
        self.session_id = rp.new_session_id()
        self.out: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.last_activity = self.loop.time()
        self.closing = False
        self.done = self.loop.create_future()
        self.session = None
        self.decoder = None
        self.in_flight: set[str] = set()  # committed items not yet completed or failed: the session is not idle

    # ---- output ----
    def send(self, event: dict) -> None:
        """Queue a server event (in order); the writer task sends it."""
        if self.closing:
            return
        if event["type"] == "error":
            self.service.metrics.live_errors.labels(event["error"]["code"] or "error").inc()
        if self.out.qsize() >= MAX_PENDING_EVENTS:  # the client does not read: drop it rather than grow
            log.info("realtime session %s: the client reads no events (%d queued); closing it", self.session_id,
                     self.out.qsize())
            self.closing = True
            self._cancel_reader()
            return
        self.last_activity = self.loop.time()
        self.out.put_nowait(rp.dumps(event))

    def emit(self, ev) -> None:
        """The ``LiveSession``'s ``emit``: a session event -> its server event."""
        event = rp.render(ev)
        kind = event["type"]
        if kind == "input_audio_buffer.committed":
            self.in_flight.add(event["item_id"])
        elif kind in (rp.COMPLETED, rp.FAILED):
            self.in_flight.discard(event["item_id"])
        self.send(event)

    def finish(self, message: str, code: str, close_code: int, type: str = "invalid_request_error") -> None:
        """Send an ``error`` event, then close the connection with ``close_code`` (the reader then ends)."""
        if self.closing:
            return
        self.send(rp.error(message, code, type=type))
        self.closing = True
        self.out.put_nowait((close_code, code))
        # a writer blocked on a client that stopped reading would never send the close: end the reader anyway
        self.loop.call_later(CLOSE_GRACE_S, self._cancel_reader)

    def _cancel_reader(self) -> None:
        task = getattr(self, "_reader", None)
        if task is not None and not task.done():
            task.cancel()

    async def _writer(self) -> None:
        try:
            while True:
                item = await self.out.get()
                if isinstance(item, tuple):
                    code, reason = item
                    await self.ws.close(code, reason=reason)
                    return
                await self.ws.send_text(item)
        except asyncio.CancelledError:
            raise
        except Exception:  # the client went away: the reader sees the disconnect
            return

    async def _watchdog(self) -> None:
        started = self.loop.time()
        drain = self.loop.create_task(self.service.state.draining.wait())
        try:
            await self._watch(drain, started)
        finally:
            drain.cancel()

    async def _watch(self, drain: asyncio.Task, started: float) -> None:
        limits = self.service.limits
        while not self.closing:
            now = self.loop.time()
            if drain.done():
                self.finish("the server is shutting down; its open sessions are closed", "shutting_down", 1012,
                            type="server_error")
            elif now - started >= limits.max_session_s:
                self.finish(f"the session reached its maximum length of {limits.max_session_s:g} s "
                            "(--realtime-max-session-s); open a new one", "session_expired", 1000)
            elif now - self.last_activity >= limits.idle_timeout_s and not self.in_flight:
                self.finish(f"no event for {limits.idle_timeout_s:g} s (--realtime-idle-timeout-s); the session is "
                            "closed", "idle_timeout", 1000)
            else:  # woken at once by a drain, else every WATCHDOG_S
                await asyncio.wait({drain}, timeout=WATCHDOG_S)

    # ---- the session ----
    async def run(self) -> None:
        from ...live.session import LiveLimits, LiveSession

        service = self.service
        # the idle timeout is the watchdog's (events either way, not only audio); the session bounds the audio
        limits = LiveLimits(max_session_s=service.limits.max_session_s, max_buffer_s=service.limits.max_buffer_s,
                            idle_s=None)
        try:
            self.decoder = StreamDecoder(self.cfg.input_format())
            self.session = LiveSession(service.engine, service.prompts, service.vads, self.cfg.live_settings(),
                                       limits, self.emit, metrics=service.hook)
        except Exception as e:  # a bug or a broken install: said to the client, logged under a reference
            event = rp.error(self._internal(e), "internal_error", type="server_error")
            self.service.metrics.live_errors.labels("internal_error").inc()
            try:
                await self.ws.send_text(rp.dumps(event))
                await self.ws.close(1011, reason="internal_error")
            except Exception:
                pass
            self.done.set_result(None)
            return
        self.send(rp.session_created(self.cfg, self.session_id))
        writer = self.loop.create_task(self._writer())
        watchdog = self.loop.create_task(self._watchdog())
        self._reader = self.loop.create_task(self._read())
        try:
            await asyncio.wait({self._reader})
        finally:
            self.closing = True
            watchdog.cancel()
            if not self._reader.done():
                self._reader.cancel()
            try:
                await self.session.aclose()
            finally:
                writer.cancel()
                if not self.done.done():
                    self.done.set_result(None)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.last_activity = self.loop.time()
            if self.closing:
                continue
            text = message.get("text")
            try:
                if text is None:
                    raise ProtocolError("binary messages are not events: send each event as a JSON text message",
                                        "invalid_json")
                self.handle(rp.parse_client_event(text, self.service.limits.max_event_bytes))
            except ProtocolError as e:
                self.send(rp.error_from(e))
            except Exception as e:  # a bug: the session may be broken, so it ends
                self.finish(self._internal(e), "internal_error", 1011, type="server_error")

    def _internal(self, e: BaseException) -> str:
        """Log an unexpected failure with its traceback under a reference; the client's message carries only that
        reference (the exception's text may hold server paths)."""
        ref = uuid.uuid4().hex[:12]
        log.error("realtime session %s: internal error %s: %s: %s", self.session_id, ref, type(e).__name__, e,
                  exc_info=e)
        return f"internal error (reference {ref}; the server's log has the details)"

    def handle(self, ev) -> None:
        from ...live.session import EmptyBuffer, LiveLimitError

        if isinstance(ev, rp.Append):
            fmt = self.decoder.format
            if fmt.bytes_per_sample == 2 and len(ev.audio) % 2:
                raise ProtocolError(f"audio holds {len(ev.audio)} bytes: 16-bit PCM appends must hold whole samples "
                                    "(an even number of bytes); nothing of this append was used", "invalid_audio",
                                    "audio", ev.event_id)
            if not ev.audio:
                return
            # refused before decoding (the decoder then holds nothing the session did not take), counting what the
            # resampler still holds of earlier appends, so that the tail a commit flushes always fits
            max_buffer = self.service.limits.max_buffer_s
            incoming = len(ev.audio) // fmt.bytes_per_sample
            if self.session.buffered_s * SAMPLE_RATE + self.decoder.max_output(incoming) > max_buffer * SAMPLE_RATE:
                raise ProtocolError(f"the uncommitted audio would exceed the limit of {max_buffer:g} s "
                                    "(--realtime-max-buffer-s); commit or clear it; nothing of this append was used",
                                    "buffer_too_large", "audio", ev.event_id)
            try:
                self.session.append(self.decoder.push(ev.audio))
            except LiveLimitError as e:
                self.decoder.reset()  # what it holds of the refused audio must not reach the next append
                raise ProtocolError(str(e), e.code, "audio", ev.event_id) from None
        elif isinstance(ev, rp.Commit):
            try:
                self.session.append(self.decoder.flush())
            except LiveLimitError:  # only the session's total length can refuse a tail: the next append says so
                pass
            try:
                self.session.commit()
            except EmptyBuffer:
                raise ProtocolError("the input audio buffer is empty: append audio before committing (with server "
                                    "VAD, a turn that already ended was committed by the server)",
                                    "input_audio_buffer_commit_empty", None, ev.event_id) from None
        elif isinstance(ev, rp.Clear):
            self.decoder.reset()
            self.session.clear()
        elif isinstance(ev, rp.SessionUpdate):
            cfg = self.cfg.updated(ev, self.names, self.service.engine.word_timestamps)
            fmt = cfg.input_format()
            if fmt != self.decoder.format:
                try:  # the audio so far was decoded in the old format: its tail joins the buffer
                    self.session.append(self.decoder.flush())
                except LiveLimitError:
                    pass
                self.decoder = StreamDecoder(fmt)
            try:
                self.session.update(cfg.live_settings())
            except ValueError as e:
                raise ProtocolError(str(e), "invalid_value", "session", ev.event_id) from None
            self.cfg = cfg
            self.send(rp.session_updated(cfg, self.session_id))

