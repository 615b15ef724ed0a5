"""The HTTP layer: FastAPI routes, bearer-key auth, upload limits, admission, metrics, warm-up and health.

    app = create_app(asr, ServerConfig(api_key="KEY"))     # asr: a loaded glmasr.GlmAsr (one in-process engine)
    app = create_app(DataParallelEngineClient(["cuda:0", "cuda:1"], model=folder), config)   # N engine processes
    uvicorn.run(app, host="127.0.0.1", port=8000)         # or: glmasr serve --model ... (glmasr.cli.serve)

Routes: ``POST /v1/audio/transcriptions`` (``protocol``'s docstring has the fields and formats), ``GET /v1/models``,
``GET /v1/models/{name}``, ``GET /health`` (200 once warmed up, else 503), ``GET /health/live`` (200 while the
process answers), ``GET /health/ready`` (200 while it takes requests: warmed up, not draining, an engine ready),
``GET /metrics`` (Prometheus text, ``metrics``: counts only), ``GET /v1/realtime`` (a WebSocket: OpenAI's Realtime
transcription sessions, ``realtime``), and, when the install has it, the browser page at ``GET /`` and ``GET /demo``
(assets under ``/static/``; open: the page asks for the key). With an API key every ``/v1/`` route needs
``Authorization: Bearer KEY`` (else 401; the WebSocket also takes the key as the subprotocol
``openai-insecure-api-key.KEY``); the health routes and ``/metrics`` stay open (a load balancer's probe and
a scraper carry no key), and the health routes then answer their status only: the details (engine workers, queue,
uploads, a warm-up error) are added for a caller that sends the key (never without one configured). Served model
ids are names, never server paths. Errors are answered in the OpenAI envelope ``{"error": {"message", "type",
"param", "code"}}``; an unexpected failure is a 500 whose message carries only an id for the server's log.

Limits (``ServerConfig``; the flags of ``glmasr serve``): connection timeouts and request framing
(``http.HttpLimits``, ``http.py``); the upload (``max_upload_bytes``, default 25 MiB: a 413), received under time
limits and counted apart from engine work (``uploads.py``: at most ``max_uploads`` at once, a 503 beyond); the
decoded audio (``max_audio_s``, enforced while decoding: a 413; sample rate and channels bounded before decoding,
``audio.decode_audio_file``); the requests admitted to transcription at once (``max_queue``: decoding, queued or
running; one more is a 429 with ``Retry-After``; default 4 x the engines' slots); the time an admitted request may
take (``request_timeout_s``: the engine aborts it, a 504). Transcription requests that arrive before the warm-up
has finished, or once the server drains (``begin_drain``, on SIGTERM), get a 503; a body still arriving when the
drain begins is refused at once with a 503, and only admitted work is finished.

With engine workers (``workers.requests``), the details list them (``workers``: state, in-flight requests and audio
seconds, counters) and the ``status`` is "warming_up" (503) until every worker has loaded and warmed up,
then "ok" (200) while every worker is ready, "degraded" (200: the ready workers take every request) while some
worker is restarting or was given up, and "unavailable" (503) when none is ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from . import protocol
from ..workers.engine_client import WARMUPS, EngineClient, LocalEngineClient
from .http import FramingGuard, HttpLimits, OriginGuard, normalize_origin
from .metrics import Metrics
from .protocol import APIError
from .realtime.routes import RealtimeLimits, RealtimeService, add_realtime_route, live_limit
from .routes import ServerContext, add_routes, error_response, internal_error
from .serving import TranscriptionService, admission, upload_slots
from .uploads import MIB

log = logging.getLogger("glmasr.server")


@dataclass
class ServerConfig:
    """served_names: the names ``model`` may take (default: ``DEFAULT_MODEL_NAME`` and the checkpoint folder's
    name; never a path); api_key: None = no auth; max_audio_s: None/0 = no limit; max_queue: None = 4 x the
    engines' slots (max_batch, summed over the engine workers); request_timeout_s: None = no limit; limits: the
    connection and upload limits (``http.HttpLimits``); warmup: "full" (``GlmAsr.warmup``: every kernel and graph a
    server needs), "request" (one short request), "none" (each engine worker does it before it reports ready);
    close_engine: close the engine (stop the engine workers) when the app shuts down (after the in-flight
    requests); realtime: the limits of the ``/v1/realtime`` sessions (``realtime.routes.RealtimeLimits``);
    allowed_origins: web page origins (``scheme://host[:port]``, ``*``, ``null``) whose browser requests are served
    besides the server's own, with CORS headers (``http.OriginGuard``)."""

    served_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_upload_bytes: int = 25 * MIB
    max_audio_s: float | None = 3600.0
    max_queue: int | None = None
    request_timeout_s: float | None = None
    limits: HttpLimits = field(default_factory=HttpLimits)
    warmup: str = "full"
    close_engine: bool = True
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)
    allowed_origins: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be positive, got {self.max_upload_bytes}")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {self.max_queue}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive (or None: no limit), got {self.request_timeout_s}")
        for n in self.served_names:
            if not is_model_name(n):
                raise ValueError(f"a served model name must be a plain name, not a path: {n!r}")
        self.allowed_origins = tuple(dict.fromkeys(normalize_origin(o) for o in self.allowed_origins))


def is_model_name(name: str) -> bool:
    """A name clients may send as ``model``: no path of this machine (a hub id ``owner/name`` is fine)."""
    if not name or name.startswith(("/", "~", ".")) or "\\" in name:
        return False
    return len(name.split("/")) <= 2 and not any(p in ("", ".", "..") for p in name.split("/"))


def served_names(asr, extra=()) -> tuple[str, ...]:
    """The default name, the checkpoint folder's name (``asr``: a ``GlmAsr`` or an engine client) and ``extra``;
    an entry that names a path on this machine is left out (model ids are shown to every client)."""
    names = [protocol.DEFAULT_MODEL_NAME, asr.folder.name, *extra]
    out = []
    for n in names:
        if n and n not in out and is_model_name(n) and not Path(n).expanduser().exists():
            out.append(n)
    return tuple(out)


class ServerState:
    def __init__(self):
        self.ready = False
        self.warmup_error: str | None = None
        self.warmup_ms: dict = {}
        self.draining = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.frontend = None  # frontends.Frontend: this app is one of several front-end processes


def create_app(asr, config: ServerConfig | None = None, frontend=None) -> FastAPI:
    """``asr``: a loaded ``GlmAsr`` (served by its in-process engine) or an ``EngineClient``. The returned app is
    wrapped in ``http.FramingGuard``; ``app.state.begin_drain()`` starts a drain (``glmasr serve`` calls it on
    SIGTERM). ``frontend``: a ``frontends.Frontend`` when this app is one of several front-end processes
    (``glmasr serve --frontends K``): ``max_queue`` and the realtime session limit are then counted over every
    front-end, the metrics summed over them, and each answer says which front-end gave it
    (``X-Glmasr-Frontend``)."""
    config = config or ServerConfig()
    engine = asr if isinstance(asr, EngineClient) else LocalEngineClient(asr)
    names = config.served_names or served_names(engine)
    max_queue = config.max_queue or 4 * engine.slots
    state = ServerState()
    state.frontend = frontend
    metrics = Metrics(engine_pending=lambda: engine.num_pending,
                      workers=engine.workers if engine.workers() is not None else None,
                      multiprocess_dir=frontend.metrics_dir if frontend is not None else None,
                      frontend=frontend.index if frontend is not None else None)
    admitted = admission(max_queue, metrics) if frontend is None else frontend.admission(max_queue, metrics)
    uploads = upload_slots(config.limits.max_uploads)
    service = TranscriptionService(engine, metrics, config.max_audio_s, config.request_timeout_s)
    live = RealtimeService(engine, config.realtime, metrics, state,
                           sessions=frontend.sessions(live_limit(config.realtime, engine)) if frontend else None)

    def warm() -> None:
        t = time.perf_counter()
        live.prompts = prompt_builder(engine)
        state.warmup_ms = engine.warmup(config.warmup)
        if config.warmup != "none":
            try:  # the VAD of chunking_strategy (CPU, in this process), if this install has it: loaded now
                from ..audio.vad import load_vad

                load_vad("cpu")
            except ImportError:
                pass
        state.warmup_ms["server_warmup_ms"] = 1e3 * (time.perf_counter() - t)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()

        async def warm_up():
            try:
                await live.start()  # the live sessions' VAD (its failure is the realtime endpoint's alone)
                await asyncio.to_thread(warm)
                state.ready = True
            except Exception as e:  # reported by /health (to the key's holder); the server stays unhealthy
                state.warmup_error = f"{type(e).__name__}: {e}"
                log.error("warm-up failed: %s", state.warmup_error)

        task = asyncio.create_task(warm_up())
        if frontend is not None and frontend.warm_first:
            await task  # a restarted front-end: it listens (uvicorn waits for this) once it can serve
        try:
            yield
        finally:
            state.ready = False
            if not task.done():
                await asyncio.wait({task}, timeout=60)
            await live.stop()
            if config.close_engine:
                await asyncio.to_thread(engine.close)

    def begin_drain() -> None:
        """Stop taking transcription requests and refuse the uploads still arriving (503); admitted ones finish.
        Safe from a signal handler or another thread."""
        loop = state.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(state.draining.set)
        else:
            state.draining.set()

    app = FastAPI(title="glmasr", summary="OpenAI-compatible transcription server for GLM-ASR-Nano-2512",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.glmasr = state
    app.state.metrics = metrics
    app.state.admission = admitted
    app.state.uploads = uploads
    app.state.engine = engine
    app.state.begin_drain = begin_drain
    app.state.close_live_sessions = live.close_sessions

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code={404: "not_found", 405:
                                        "method_not_allowed"}.get(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(internal_error(e))

    ctx = ServerContext(config, state, engine, names, metrics, admitted, uploads, service, max_queue)
    add_routes(app, ctx)
    add_realtime_route(app, ctx, live)
    app.state.realtime = live
    add_page(app)
    app.add_middleware(FramingGuard)
    app.add_middleware(OriginGuard, allowed=config.allowed_origins)
    if config.allowed_origins:  # outermost: preflights of allowed origins answered, their answers marked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "openai-beta"],
                           expose_headers=["x-request-id", "retry-after", "x-glmasr-frontend"], max_age=600)
    if frontend is not None:
        app.add_middleware(frontend.header_middleware())
    return app


def prompt_builder(engine):
    """The checkpoint's ``PromptBuilder`` (token ids -> text, the default instruction) for the live sessions: the
    in-process engine's own, else (engine worker processes) loaded from the checkpoint folder."""
    asr = getattr(engine, "asr", None)
    if asr is not None and getattr(asr, "prompts", None) is not None:
        return asr.prompts
    from ..checkpoint.tokenizer import PromptBuilder
    from ..checkpoint.weights import read_config

    return PromptBuilder.from_folder(engine.folder, read_config(engine.folder).audio_token_id)


STATIC = Path(__file__).parent / "static"
_PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                 "Referrer-Policy": "no-referrer"}


def add_page(app: FastAPI) -> None:
    """The browser page (``static/index.html``: microphone over ``/v1/realtime``, file upload) at ``GET /`` and
    ``GET /demo``, its assets under ``/static/``; open without a key (the page asks for it; every API call it makes
    carries it). Nothing is mounted when the install has no page."""
    index = STATIC / "index.html"
    if not index.is_file():
        return
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    async def page():
        return FileResponse(index, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/demo", page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
