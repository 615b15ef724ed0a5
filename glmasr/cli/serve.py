"""``glmasr serve`` (also ``python -m glmasr.cli serve``): load a checkpoint, warm it up, serve it with uvicorn.

SIGTERM or SIGINT: the listening socket closes, uploads still arriving are refused at once (a 503 in the envelope),
the admitted requests finish (up to ``--drain-timeout`` s; streams included), the live sessions of ``/v1/realtime``
get an ``error`` event (``shutting_down``) and close code 1012, the engine stops, and the process exits with
status 0.

``--aligner PATH``: a CTC aligner head loaded beside the model (``glmasr.load(..., aligner=PATH)``; with
``--data-parallel``, ``--devices`` or ``--frontends`` every engine process loads it): requests may ask for word times
(``verbose_json`` with ``timestamp_granularities[]=word``); without it such a request is a 400.

``--decode-weights int8`` (opt-in; default bf16): the decode step streams per-row int8 copies of the decoder's
matrices (``glmasr.load(..., decode_weights="int8")``: the CUDA Triton path, ~1.35 GB more memory for the full-size
model, slightly different logits; decode steps of one or two sequences); with ``--data-parallel`` every worker loads
them (CUDA devices only).

``--data-parallel N [--devices cuda:0,cuda:1,...]``: this process is the front end (HTTP, decoding, limits,
streaming, metrics) and N engine worker processes each own one loaded model (``glmasr.workers.requests``); devices
default to cuda:0..N-1 (``cpu`` entries work too; an entry may repeat). SIGTERM then drains the workers too.

``--frontends K`` (K > 1): this process supervises K front-end processes (HTTP and /v1/realtime, each its own
uvicorn on the same port through SO_REUSEPORT) over engine processes of their own (one on ``--device``, or one per
``--devices`` entry with ``--data-parallel N``) that batch every front-end's requests together
(``glmasr.server.frontends``: limits, metrics, restarts, drain). K = 1 (the default) is the single process above.
"""

from __future__ import annotations

import argparse
import os
import sys

from .common import non_negative_float, pick_model, port, positive_float, positive_int


def origin_list(text: str) -> tuple[str, ...]:
    """argparse type of --allowed-origins: the comma-separated entries (each checked by ServerConfig, whose
    message names a malformed one)."""
    return tuple(o.strip() for o in text.split(",") if o.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glmasr serve",
                                description="OpenAI-compatible transcription server (POST /v1/audio/transcriptions)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder, hub id, or 'tiny-random'; default as for `glmasr`: local "
                        "weights/GLM-ASR-Nano-2512 if present, else zai-org/GLM-ASR-Nano-2512")
    p.add_argument("--aligner", default=None, metavar="PATH",
                   help="a CTC aligner head's folder (the glm-asr-ctc layout) or hub id: requests may then ask for "
                        "word times (verbose_json with timestamp_granularities[]=word); every engine process loads it")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may send as `model` (repeatable); always served: glm-asr-nano-2512 "
                        "and the checkpoint folder's name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $GLMASR_API_KEY, else none)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--data-parallel", type=int, default=None, metavar="N",
                   help="N engine worker processes, one model each (one per GPU), behind this front end")
    p.add_argument("--frontends", type=positive_int, default=1, metavar="K",
                   help="K front-end processes (HTTP + realtime WebSocket, one uvicorn each on the same port via "
                        "SO_REUSEPORT) over engine process(es) of their own, which batch every front-end's "
                        "requests (default 1: one process). --max-queue and --max-realtime-sessions stay global "
                        "(counted over all front-ends); --max-connections and --max-uploads are split evenly "
                        "(each >= K); /metrics sums every front-end; a dead front-end or engine process is "
                        "restarted")
    p.add_argument("--worker-timeout", type=non_negative_float, default=120.0, metavar="S",
                   help="with --data-parallel: a worker whose engine makes no step for S seconds while it holds "
                        "requests is killed (its requests get a 503) and restarted (default 120; 0 = never)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="the workers' devices with --data-parallel, comma-separated (default cuda:0..N-1; cpu "
                        "allowed, repeats allowed: cuda:0,cuda:0 runs two engines on one GPU)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--decode-weights", choices=("bf16", "int8"), default="bf16",
                   help="weights the decode step streams (default bf16); int8 (opt-in, CUDA Triton path, every "
                        "worker with --data-parallel): per-row int8 copies of the decoder's matrices, faster decoding "
                        "of one or two sequences for ~1.35 GB more GPU memory, slightly different logits (check WER "
                        "on your data)")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="engine sequence slots (default 64 on CUDA, 8 on CPU)")
    p.add_argument("--max-upload-mb", type=positive_float, default=25.0, help="largest upload in MiB (default 25)")
    p.add_argument("--max-audio-s", type=non_negative_float, default=3600.0,
                   help="longest decoded audio per request in seconds (default 3600; 0 = no limit)")
    p.add_argument("--max-queue", type=positive_int, default=None,
                   help="requests admitted to transcription at once (decoding, queued, running; uploads still "
                        "arriving are not counted); one more gets a 429 (default 4 x max-batch)")
    p.add_argument("--max-uploads", type=positive_int, default=256,
                   help="request bodies being received at once (each spooled to disk past 1 MiB); one more gets a "
                        "503 (default 256)")
    p.add_argument("--max-connections", type=positive_int, default=1024,
                   help="open connections; beyond, uvicorn answers 503 (default 1024)")
    p.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds a connection has to send a complete request line and headers, from its opening or "
                        "from the first byte of its next request (default 10); then it is closed")
    p.add_argument("--read-timeout", type=positive_float, default=15.0, metavar="S",
                   help="longest pause while receiving a request body (default 15): then a 408")
    p.add_argument("--upload-timeout", type=positive_float, default=300.0, metavar="S",
                   help="longest time to receive a whole request body (default 300): then a 408")
    p.add_argument("--keep-alive-timeout", type=positive_float, default=5.0, metavar="S",
                   help="an idle connection between requests is closed after S seconds (default 5)")
    p.add_argument("--request-timeout", type=non_negative_float, default=0.0, metavar="S",
                   help="a transcription still unfinished S seconds after it was admitted is stopped by the engine "
                        "(its slots freed) and answered with a 504 (default 0: no limit)")
    p.add_argument("--max-realtime-sessions", type=positive_int, default=None, metavar="N",
                   help="open live sessions on GET /v1/realtime (WebSocket); one more gets an error event and close "
                        "code 1013 (default 8 x max-batch, summed over engines: 512 with 64 slots)")
    p.add_argument("--realtime-max-session-s", type=positive_float, default=3600.0, metavar="S",
                   help="a live session is closed after S seconds (and after S seconds of audio; default 3600)")
    p.add_argument("--realtime-idle-timeout-s", type=positive_float, default=120.0, metavar="S",
                   help="a live session with no event either way for S seconds is closed (default 120)")
    p.add_argument("--realtime-max-buffer-s", type=positive_float, default=60.0, metavar="S",
                   help="audio a live session holds uncommitted; an append beyond is refused with an error event "
                        "(default 60)")
    p.add_argument("--allowed-origins", type=origin_list, default=(), metavar="ORIGINS",
                   help="comma-separated web page origins (scheme://host[:port], '*' for any, 'null') whose browser "
                        "requests and live sessions are served besides the server's own page, with CORS headers; "
                        "others get 403 / close 1008 (default: none; clients that send no Origin header, like the "
                        "openai SDK or curl, are never affected)")
    p.add_argument("--warmup", choices=("full", "request", "none"), default="full",
                   help="before /health reports ok: every kernel and graph (full, default), one short request, or "
                        "nothing")
    p.add_argument("--drain-timeout", type=non_negative_float, default=60.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default 60)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401 - the serve extra is installed (else the message below)

        from ..server.app import MIB, ServerConfig, create_app, served_names
        from ..server.http import (SWITCH_INTERVAL_S, HttpLimits, log_config, make_server, normalize_origin,
                                   uvicorn_config)
        from ..server.realtime.routes import RealtimeLimits
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install 'glmasr[serve]'): {e}", file=sys.stderr)
        return 2
    import glmasr

    api_key = args.api_key if args.api_key is not None else (os.environ.get("GLMASR_API_KEY") or None)
    data_parallel = args.data_parallel is not None or args.devices is not None
    frontends = args.frontends > 1
    try:
        origins = tuple(normalize_origin(o) for o in args.allowed_origins)  # a typo fails before the model loads
        model = pick_model(args.model)
        if frontends:
            engine = _engine_host(args, model)
        elif data_parallel:
            engine = _data_parallel_client(args, model)
        else:
            aligner = {"aligner": args.aligner} if args.aligner is not None else {}
            engine = glmasr.load(model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                                 decode_weights=args.decode_weights, **aligner)
        extra = list(args.served_model_name)
        if args.model not in (None, "tiny-random"):
            extra.append(args.model)
        limits = HttpLimits(header_timeout_s=args.header_timeout, read_timeout_s=args.read_timeout,
                            upload_timeout_s=args.upload_timeout, keep_alive_s=args.keep_alive_timeout,
                            max_connections=args.max_connections, max_uploads=args.max_uploads)
        config = ServerConfig(served_names=served_names(engine, extra), api_key=api_key,
                              max_upload_bytes=int(args.max_upload_mb * MIB), max_audio_s=args.max_audio_s or None,
                              max_queue=args.max_queue, request_timeout_s=args.request_timeout or None,
                              limits=limits, warmup=args.warmup, allowed_origins=origins,
                              realtime=RealtimeLimits(max_sessions=args.max_realtime_sessions,
                                                      max_session_s=args.realtime_max_session_s,
                                                      idle_timeout_s=args.realtime_idle_timeout_s,
                                                      max_buffer_s=args.realtime_max_buffer_s))
        if frontends:
            from ..server.frontends import Supervisor

            supervisor = Supervisor(engine, config, args.frontends, args.host, args.port, args.warmup,
                                    args.drain_timeout, log_level=args.log_level)
    except (glmasr.CheckpointError, glmasr.ConfigError, glmasr.TokenizerError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if frontends:
        return supervisor.run()
    where = (f"{len(engine.devices)} engine workers ({','.join(engine.devices)})" if data_parallel
             else str(engine.device))
    print(f"serving {engine.folder} on {where} as {', '.join(config.served_names)} at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    app = create_app(engine, config)

    def on_exit():
        app.state.begin_drain()
        if data_parallel:
            engine.stop_restarts()

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = make_server(uvicorn_config(app, args.host, args.port, limits, log_level=args.log_level,
                                        log_config=log_config(args.log_level),
                                        timeout_graceful_shutdown=args.drain_timeout, lifespan="on",
                                        ws_max_size=config.realtime.ws_max_size), on_exit=on_exit,
                         before_shutdown=app.state.close_live_sessions)
    server.run()
    return 0 if server.started or server.should_exit else 1


def _devices(args) -> list[str]:
    """The engine processes' devices from --data-parallel / --devices (checked)."""
    from ..workers import parse_devices

    if args.device is not None:
        raise ValueError("--device names the one engine's device; with --data-parallel give the workers' "
                         "devices with --devices")
    n = args.data_parallel
    if n is not None and n < 1:
        raise ValueError(f"--data-parallel must be at least 1, got {n}")
    devices = parse_devices(args.devices if args.devices is not None else [f"cuda:{i}" for i in range(n)])
    if n is not None and len(devices) != n:
        raise ValueError(f"--data-parallel {n} but --devices names {len(devices)} devices ({','.join(devices)})")
    return devices


def _engine_host(args, model):
    """--frontends K: the engine processes the supervisor runs (one on --device, or --data-parallel's)."""
    from ..models.device import resolve_device
    from ..workers.attached import EngineHost
    from ..workers.requests import _TEST_HOOKS

    if args.data_parallel is not None or args.devices is not None:
        devices = _devices(args)
    else:
        dev = resolve_device(args.device)
        devices = [f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu"]
    return EngineHost(devices, model=model, dtype=args.dtype, max_batch=args.max_batch,
                      drain_timeout_s=args.drain_timeout, worker_timeout_s=args.worker_timeout or None,
                      hooks=_TEST_HOOKS, decode_weights=args.decode_weights, aligner=args.aligner)


def _data_parallel_client(args, model):
    from ..workers.requests import DataParallelEngineClient

    devices = _devices(args)
    return DataParallelEngineClient(devices, model=model, dtype=args.dtype, max_batch=args.max_batch,
                                    drain_timeout_s=args.drain_timeout,
                                    worker_timeout_s=args.worker_timeout or None,
                                    decode_weights=args.decode_weights, aligner=args.aligner)
