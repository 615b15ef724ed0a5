"""The routes of the server (``app.py`` sets the app up: its state, lifespan and error handlers, then calls
``add_routes``): the transcription endpoint, the model list, health and metrics. Every handler reads the server's
parts from one ``ServerContext``; the formats are rendered by ``glmasr.writers``.

    POST /v1/audio/transcriptions   upload (uploads.py) -> admission -> decode, plan, submit (serving.py) -> answer
    GET  /v1/models, /v1/models/{name}
    GET  /health, /health/live, /health/ready   the status; the details with the key
    GET  /metrics                               Prometheus text
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from .. import writers
from . import protocol
from .metrics import Metrics, outcome_for
from .protocol import APIError
from .serving import ClientGone, Slots, TranscriptionService
from .uploads import MIB, ShuttingDown, read_form

log = logging.getLogger("glmasr.server")


@dataclass
class ServerContext:
    """What the routes share: the config, the state, the engine client, the served names, the metrics, the
    admission and upload slots and the transcription service."""

    config: object  # app.ServerConfig
    state: object  # app.ServerState
    engine: object  # workers.engine_client.EngineClient
    names: tuple[str, ...]
    metrics: Metrics
    admitted: Slots
    uploads: Slots
    service: TranscriptionService
    max_queue: int
    lookup: dict = field(init=False)  # lower-case name -> served name

    def __post_init__(self):
        self.lookup = {n.lower(): n for n in self.names}


def error_response(e: APIError) -> JSONResponse:
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


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "?"


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    def authorized(request: Request) -> bool:
        if ctx.config.api_key is None:
            return False
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), ctx.config.api_key.encode())

    def check_auth(request: Request) -> None:
        if ctx.config.api_key is not None and not authorized(request):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": ctx.config.created, "owned_by": "glmasr"}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card(n) for n in ctx.names]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        check_auth(request)
        if name.lower() not in ctx.lookup:
            raise _unknown_model(name, ctx.names)
        return model_card(ctx.lookup[name.lower()])

    def status() -> str:
        if ctx.state.draining.is_set():
            return "draining"
        if not ctx.state.ready:
            return "error" if ctx.state.warmup_error else "warming_up"
        workers = ctx.engine.workers()
        if workers is not None:
            up = sum(w["state"] == "ready" for w in workers)
            return "ok" if up == len(workers) else ("degraded" if up else "unavailable")
        return "ok"

    def health_body(request: Request, st: str) -> dict:
        body = {"status": st}
        if authorized(request):
            body.update(models=list(ctx.names), in_flight=ctx.admitted.active, max_queue=ctx.max_queue,
                        uploads=ctx.uploads.active, max_uploads=ctx.uploads.limit)
            if ctx.state.warmup_error:
                body["error"] = ctx.state.warmup_error
            workers = ctx.engine.workers()
            if workers is not None:
                body["workers"] = workers
            frontend = ctx.state.frontend
            if frontend is not None:
                body["frontend"] = {"index": frontend.index, "pid": frontend.pid, "frontends": frontend.count,
                                    "threads": frontend.threads}
        return body

    @app.get("/health")
    async def health(request: Request):
        st = status()
        return JSONResponse(health_body(request, st), status_code=200 if st in ("ok", "degraded") else 503)

    @app.get("/health/live")
    async def health_live(request: Request):
        return JSONResponse(health_body(request, "ok"))

    @app.get("/health/ready")
    async def health_ready(request: Request):
        st = status()
        return JSONResponse(health_body(request, st), status_code=200 if st in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def get_metrics():
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    def refuse_if_not_taking() -> None:
        if ctx.state.draining.is_set():
            raise ShuttingDown()
        if not ctx.state.ready:
            raise APIError(503, "the model is warming up; see GET /health/ready", type="server_error",
                           code="not_ready", headers={"Retry-After": "1"})

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        t0 = time.perf_counter()
        ticket = form = None
        ctx.metrics.reached("transcription")
        try:
            check_auth(request)
            refuse_if_not_taking()
            with ctx.uploads.enter():
                form = await read_form(request, ctx.config.max_upload_bytes, ctx.config.limits, ctx.state.draining)
            req = _request_from_form(form, ctx.config.max_upload_bytes)
            if req.model.lower() not in ctx.lookup:
                raise _unknown_model(req.model, ctx.names)
            refuse_if_not_taking()
            ticket = ctx.admitted.enter()
            started = await ctx.service.start(req, t0)
        except APIError as e:
            _release(ticket)
            await _close(form)
            ctx.metrics.requests.labels(outcome_for(e.status)).inc()
            return error_response(e)
        except ClientDisconnect:  # the client went away while sending: one log line, nothing to answer
            _release(ticket)
            await _close(form)
            ctx.metrics.requests.labels("aborted").inc()
            log.info("client %s disconnected during its upload", _client(request))
            return Response(status_code=499)
        except asyncio.CancelledError:  # the server's hard stop
            _release(ticket)
            await _close(form)
            ctx.metrics.requests.labels("aborted").inc()
            raise
        except Exception as e:
            _release(ticket)
            await _close(form)
            ctx.metrics.requests.labels("error").inc()
            return error_response(internal_error(e))
        await _close(form)  # decoded: the spooled upload is no longer needed

        if req.stream:
            outcome = {"value": "aborted"}

            async def body():
                async for chunk in ctx.service.events(started, req):
                    yield chunk
                outcome["value"] = "ok" if started.job.result is not None else "error"

            def on_close():
                started.job.abort()
                ticket.release()
                ctx.metrics.requests.labels(outcome["value"]).inc()
                if outcome["value"] == "ok":
                    ctx.metrics.latency.labels("true").observe(time.perf_counter() - t0)

            return _EventStream(body(), on_close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            result = await ctx.service.transcribe(started, _disconnected(request), req)
        except ClientGone:
            ctx.metrics.requests.labels("aborted").inc()
            log.info("client %s disconnected while its transcription ran; it was stopped", _client(request))
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except APIError as e:
            ctx.metrics.requests.labels(outcome_for(e.status)).inc()
            return error_response(e)
        finally:
            ticket.release()
        ctx.metrics.requests.labels("ok").inc()
        ctx.metrics.latency.labels("false").observe(time.perf_counter() - t0)
        return _render(req, started, result)


def _release(ticket) -> None:
    if ticket is not None:
        ticket.release()


async def _close(form) -> None:
    if form is not None:
        await form.close()


def internal_error(e: BaseException) -> APIError:
    """A bug or an unexpected failure: logged once with its traceback under an id; the client gets the id only (the
    exception's text may hold server paths)."""
    ref = uuid.uuid4().hex[:12]
    log.error("internal error %s: %s: %s", ref, type(e).__name__, e, exc_info=e)
    return APIError(500, f"internal error (reference {ref}; the server's log has the details)", type="server_error",
                    code="internal_error")


def _request_from_form(form, max_upload: int) -> protocol.TranscriptionRequest:
    uploads = form.getlist("file")
    if not uploads:
        raise protocol.bad_request("you must provide a file parameter (the audio)", "file",
                                   "missing_required_parameter")
    if len(uploads) > 1:
        raise protocol.bad_request(f"file was sent {len(uploads)} times; send one audio per request", "file")
    upload = uploads[0]
    if isinstance(upload, str):
        raise protocol.bad_request("file must be a file upload (multipart part with a filename), not a text field",
                                   "file", "invalid_type")
    size = upload.size if upload.size is not None else 0
    if size > max_upload:
        raise APIError(413, f"the file is {size / MIB:.2f} MiB; this server accepts at most {max_upload / MIB:g} MiB "
                            "(--max-upload-mb)", param="file", code="file_too_large")
    upload.file.seek(0)
    return protocol.parse_form(form, upload.file, size, upload.filename or "upload")


def _unknown_model(name: str, names) -> APIError:
    return APIError(404, f"the model {name!r} does not exist on this server; it serves {', '.join(names)}",
                    param="model", code="model_not_found")


def _render(req: protocol.TranscriptionRequest, started, result) -> Response:
    if req.response_format == "diarized_json":
        return JSONResponse(protocol.diarized_body(result, started.audio.duration_s))
    body, media_type = writers.render_openai(result, req.response_format, started.audio.duration_s, req.language,
                                             req.granularities)
    return Response(body, media_type=media_type)
