"""The HTTP layer: FastAPI routes, bearer-key auth, upload limits, admission, metrics, warm-up and health.

    app = create_app(asr, ServerConfig(api_key="KEY"))     # asr: a loaded glmasr.GlmAsr (one in-process engine)
    app = create_app(DataParallelEngineClient(["cuda:0", "cuda:1"], model=folder), config)   # N engine processes
    uvicorn.run(app, host="127.0.0.1", port=8000)         # or: glmasr serve --model ... (cli.py)

Routes: ``POST /v1/audio/transcriptions`` (``protocol``'s docstring has the fields and formats), ``GET /v1/models``,
``GET /v1/models/{name}``, ``GET /health`` (200 once warmed up, else 503), ``GET /metrics`` (Prometheus text,
``metrics``). With an API key every ``/v1/`` route needs ``Authorization: Bearer KEY`` (else 401); ``/health`` and
``/metrics`` stay open (a load balancer's probe and a scraper carry no key). Errors are answered in the OpenAI
envelope ``{"error": {"message", "type", "param", "code"}}``.

Limits (``ServerConfig``): the upload (``max_upload_bytes``, default 25 MiB: a larger file is a 413; the request
body is counted while it is read and refused once it exceeds the limit plus 1 MiB for the other form fields),
the decoded duration (``max_audio_s``, enforced while decoding: 413 naming the limit), and the requests inside the
server at once (``max_queue``: reading, decoding, queued or running; one more is a 429 with ``Retry-After``;
default 4 x the engines' slots). Transcription requests that arrive before the warm-up has finished get a 503.

With engine workers (``data_parallel``), ``/health`` lists them (``workers``: state, pid, in-flight requests and
audio seconds, counters) and its ``status`` is "warming_up" (503) until every worker has loaded and warmed up,
then "ok" (200) while every worker is ready, "degraded" (200: the ready workers take every request) while some
worker is restarting or was given up, and "unavailable" (503) when none is ready.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import writers
from . import protocol
from .engine_client import WARMUPS, EngineClient, LocalEngineClient
from .metrics import Metrics, outcome_for
from .protocol import APIError, bad_request
from .serving import Admission, ClientGone, TranscriptionService

MIB = 1024 * 1024
FORM_OVERHEAD = MIB  # bytes allowed in the body beyond the file: the other fields and the multipart framing
DRAIN_LIMIT = 64 * MIB  # an oversized body is read (and dropped) up to this much, so the client sees the 413


@dataclass
class ServerConfig:
    """served_names: the names ``model`` may take (default: ``DEFAULT_MODEL_NAME`` and the checkpoint folder's
    name); api_key: None = no auth; max_audio_s: None/0 = no limit; max_queue: None = 4 x the engines' slots
    (max_batch, summed over the engine workers); warmup: "full" (``GlmAsr.warmup``: every kernel and graph a server
    needs), "request" (one short request), "none" (each engine worker does it before it reports ready);
    close_engine: close the engine (stop the engine workers) when the app shuts down (after the in-flight
    requests)."""

    served_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_upload_bytes: int = 25 * MIB
    max_audio_s: float | None = 3600.0
    max_queue: int | None = None
    warmup: str = "full"
    close_engine: bool = True
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be positive, got {self.max_upload_bytes}")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {self.max_queue}")


def served_names(asr, extra=()) -> tuple[str, ...]:
    """The default name, the checkpoint folder's name (``asr``: a ``GlmAsr`` or an engine client) and ``extra``."""
    names = [protocol.DEFAULT_MODEL_NAME, asr.folder.name, *extra]
    out = []
    for n in names:
        if n and n not in out:
            out.append(n)
    return tuple(out)


class ServerState:
    def __init__(self):
        self.ready = False
        self.warmup_error: str | None = None
        self.warmup_ms: dict = {}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _EventStream(StreamingResponse):
    """A streaming response whose ``on_close`` runs however it ends (finished, client gone, never started)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    """Completes when the client closes the connection (the body has been read, so the next message is it)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body(request: Request, limit: int) -> bytes:
    cap = limit + FORM_OVERHEAD
    too_large = APIError(413, f"the upload exceeds this server's limit of {limit / MIB:g} MiB (--max-upload-mb)",
                         param="file", code="file_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap + DRAIN_LIMIT:
        raise too_large
    body, seen = bytearray(), 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen <= cap:
            body += chunk
        elif seen > cap + DRAIN_LIMIT:
            break
    if seen > cap:
        raise too_large
    return bytes(body)


def create_app(asr, config: ServerConfig | None = None) -> FastAPI:
    """``asr``: a loaded ``GlmAsr`` (served by its in-process engine) or an ``EngineClient``."""
    config = config or ServerConfig()
    engine = asr if isinstance(asr, EngineClient) else LocalEngineClient(asr)
    names = config.served_names or served_names(engine)
    lookup = {n.lower(): n for n in names}
    max_queue = config.max_queue or 4 * engine.slots
    state = ServerState()
    metrics = Metrics(engine_pending=lambda: engine.num_pending,
                      workers=engine.workers if engine.workers() is not None else None)
    admission = Admission(max_queue, metrics)
    service = TranscriptionService(engine, metrics, config.max_audio_s)

    def warm() -> None:
        t = time.perf_counter()
        state.warmup_ms = engine.warmup(config.warmup)
        if config.warmup != "none":
            try:  # the VAD of chunking_strategy (CPU, in this process), if this install has it: loaded now
                from ..vad import load_vad

                load_vad("cpu")
            except ImportError:
                pass
        state.warmup_ms["server_warmup_ms"] = 1e3 * (time.perf_counter() - t)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def warm_up():
            try:
                await asyncio.to_thread(warm)
                state.ready = True
            except Exception as e:  # reported by /health; the server stays unhealthy
                state.warmup_error = f"{type(e).__name__}: {e}"

        task = asyncio.create_task(warm_up())
        try:
            yield
        finally:
            state.ready = False
            if not task.done():
                await asyncio.wait({task}, timeout=60)
            if config.close_engine:
                await asyncio.to_thread(engine.close)

    app = FastAPI(title="glmasr", summary="OpenAI-compatible transcription server for GLM-ASR-Nano-2512",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.glmasr = state
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.engine = engine
    app.state.asr = getattr(engine, "asr", None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error_response(APIError(e.status_code, str(e.detail), code={404: "not_found", 405:
                                        "method_not_allowed"}.get(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                                        code="internal_error"))

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": config.created, "owned_by": "glmasr"}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        check_auth(request)
        if name.lower() not in lookup:
            raise _unknown_model(name, names)
        return model_card(lookup[name.lower()])

    @app.get("/health")
    async def health():
        status = "ok" if state.ready else ("error" if state.warmup_error else "warming_up")
        workers = engine.workers()
        if workers is not None and state.ready:
            up = sum(w["state"] == "ready" for w in workers)
            status = "ok" if up == len(workers) else ("degraded" if up else "unavailable")
        body = {"status": status, "models": list(names), "in_flight": admission.active, "max_queue": max_queue}
        if state.warmup_error:
            body["error"] = state.warmup_error
        if workers is not None:
            body["workers"] = workers
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        t0 = time.perf_counter()
        ticket = None
        try:
            check_auth(request)
            if not state.ready:
                raise APIError(503, "the model is warming up (or the server is shutting down); see GET /health",
                               type="server_error", code="not_ready", headers={"Retry-After": "1"})
            ticket = admission.enter()
            req = await _parse_request(request, config.max_upload_bytes)
            if req.model.lower() not in lookup:
                raise _unknown_model(req.model, names)
            started = await service.start(req, t0)
        except APIError as e:
            if ticket is not None:
                ticket.release()
            metrics.requests.labels(outcome_for(e.status)).inc()
            return _error_response(e)
        except (asyncio.CancelledError, ClientDisconnect):  # the client went away while sending or waiting
            if ticket is not None:
                ticket.release()
            metrics.requests.labels("aborted").inc()
            raise
        except BaseException:
            if ticket is not None:
                ticket.release()
            metrics.requests.labels("error").inc()
            raise

        if req.stream:
            status = {"outcome": "aborted"}

            async def body():
                async for chunk in service.events(started, req):
                    yield chunk
                status["outcome"] = "ok" if started.job.result is not None else "error"

            def on_close():
                started.job.abort()
                ticket.release()
                metrics.requests.labels(status["outcome"]).inc()
                if status["outcome"] == "ok":
                    metrics.latency.labels("true").observe(time.perf_counter() - t0)

            return _EventStream(body(), on_close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            result = await service.transcribe(started, _disconnected(request))
        except ClientGone:
            metrics.requests.labels("aborted").inc()
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except APIError as e:
            metrics.requests.labels(outcome_for(e.status)).inc()
            return _error_response(e)
        finally:
            ticket.release()
        metrics.requests.labels("ok").inc()
        metrics.latency.labels("false").observe(time.perf_counter() - t0)
        return _render(req, started, result)

    return app


def _unknown_model(name: str, names) -> APIError:
    return APIError(404, f"the model {name!r} does not exist on this server; it serves {', '.join(names)}",
                    param="model", code="model_not_found")


async def _parse_request(request: Request, max_upload: int) -> protocol.TranscriptionRequest:
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request(f"the request body must be multipart/form-data (as the OpenAI clients send it), got "
                          f"{content_type or 'no content type'!r}", None, "invalid_content_type")
    request._body = await _read_body(request, max_upload)  # form() parses the body read (and bounded) here
    try:
        form = await request.form(max_files=4, max_fields=256)
    except Exception as e:
        detail = getattr(e, "detail", None) or str(e)
        raise bad_request(f"malformed multipart body: {detail}", None, "invalid_multipart") from None
    uploads = form.getlist("file")
    if not uploads:
        raise bad_request("you must provide a file parameter (the audio)", "file", "missing_required_parameter")
    if len(uploads) > 1:
        raise bad_request(f"file was sent {len(uploads)} times; send one audio per request", "file")
    upload = uploads[0]
    if isinstance(upload, str):
        raise bad_request("file must be a file upload (multipart part with a filename), not a text field", "file",
                          "invalid_type")
    data = await upload.read()
    await upload.close()
    if len(data) > max_upload:
        raise APIError(413, f"the file is {len(data) / MIB:.2f} MiB; this server accepts at most "
                            f"{max_upload / MIB:g} MiB (--max-upload-mb)", param="file", code="file_too_large")
    return protocol.parse_form(form, data, upload.filename or "upload")


def _render(req: protocol.TranscriptionRequest, started, result):
    seconds = started.audio.duration_s
    fmt = req.response_format
    if fmt == "json":
        return JSONResponse(protocol.json_body(result.text, seconds))
    if fmt == "text":
        return PlainTextResponse(result.text)
    if fmt == "srt":
        return PlainTextResponse(writers.to_srt(result), media_type="application/x-subrip")
    if fmt == "vtt":
        return PlainTextResponse(writers.to_vtt(result), media_type="text/vtt")
    return JSONResponse(protocol.verbose_body(result, seconds, req.language))
