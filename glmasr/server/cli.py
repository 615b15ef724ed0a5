"""``glmasr serve`` (also ``python -m glmasr.server``): load a checkpoint, warm it up, serve it with uvicorn.

SIGTERM or SIGINT: the listening socket closes, the requests in flight finish (up to ``--drain-timeout`` s; streams
included), the engine stops, and the process exits with status 0.

``--data-parallel N [--devices cuda:0,cuda:1,...]``: this process is the front end (HTTP, decoding, limits,
streaming, metrics) and N engine worker processes each own one loaded model (``data_parallel.py``); devices
default to cuda:0..N-1 (``cpu`` entries work too; an entry may repeat). SIGTERM then drains the workers too.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glmasr serve",
                                description="OpenAI-compatible transcription server (POST /v1/audio/transcriptions)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder, hub id, or 'tiny-random'; default as for `glmasr`: local "
                        "weights/GLM-ASR-Nano-2512 if present, else zai-org/GLM-ASR-Nano-2512")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may send as `model` (repeatable); always served: glm-asr-nano-2512 "
                        "and the checkpoint folder's name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $GLMASR_API_KEY, else none)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--data-parallel", type=int, default=None, metavar="N",
                   help="N engine worker processes, one model each (one per GPU), behind this front end")
    p.add_argument("--worker-timeout", type=float, default=120.0, metavar="S",
                   help="with --data-parallel: a worker whose engine makes no step for S seconds while it holds "
                        "requests is killed (its requests get a 503) and restarted (default 120; 0 = never)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="the workers' devices with --data-parallel, comma-separated (default cuda:0..N-1; cpu "
                        "allowed, repeats allowed: cuda:0,cuda:0 runs two engines on one GPU)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-batch", type=int, default=None, help="engine sequence slots (default 64 on CUDA, 8 on CPU)")
    p.add_argument("--max-upload-mb", type=float, default=25.0, help="largest upload in MiB (default 25)")
    p.add_argument("--max-audio-s", type=float, default=3600.0,
                   help="longest decoded audio per request in seconds (default 3600; 0 = no limit)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests inside the server at once (reading, decoding, queued, running); one more gets a "
                        "429 (default 4 x max-batch)")
    p.add_argument("--warmup", choices=("full", "request", "none"), default="full",
                   help="before /health reports ok: every kernel and graph (full, default), one short request, or "
                        "nothing")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default 60)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from .app import MIB, ServerConfig, create_app, served_names
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install 'glmasr[serve]'): {e}", file=sys.stderr)
        return 2
    import glmasr
    from glmasr.cli import _pick_model

    from glmasr.options import api_key as env_api_key

    api_key = args.api_key if args.api_key is not None else env_api_key()
    data_parallel = args.data_parallel is not None or args.devices is not None
    try:
        model = _pick_model(args.model)
        if data_parallel:
            engine = _data_parallel_client(args, model)
        else:
            engine = glmasr.load(model, device=args.device, dtype=args.dtype, max_batch=args.max_batch)
        extra = list(args.served_model_name)
        if args.model not in (None, "tiny-random"):
            extra.append(args.model)
        config = ServerConfig(served_names=served_names(engine, extra), api_key=api_key,
                              max_upload_bytes=int(args.max_upload_mb * MIB), max_audio_s=args.max_audio_s or None,
                              max_queue=args.max_queue, warmup=args.warmup)
    except (glmasr.CheckpointError, glmasr.ConfigError, glmasr.TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = (f"{len(engine.devices)} engine workers ({','.join(engine.devices)})" if data_parallel
             else str(engine.device))
    print(f"serving {engine.folder} on {where} as {', '.join(config.served_names)} at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    app = create_app(engine, config)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.drain_timeout, lifespan="on"),
                     on_exit=engine.stop_restarts if data_parallel else None)
    server.run()
    return 0 if server.started or server.should_exit else 1


def _data_parallel_client(args, model):
    from ..parallel import parse_devices
    from .data_parallel import DataParallelEngineClient

    if args.device is not None:
        raise ValueError("--device names the one engine's device; with --data-parallel give the workers' "
                         "devices with --devices")
    n = args.data_parallel
    if n is not None and n < 1:
        raise ValueError(f"--data-parallel must be at least 1, got {n}")
    devices = parse_devices(args.devices if args.devices is not None else [f"cuda:{i}" for i in range(n)])
    if n is not None and len(devices) != n:
        raise ValueError(f"--data-parallel {n} but --devices names {len(devices)} devices ({','.join(devices)})")
    return DataParallelEngineClient(devices, model=model, dtype=args.dtype, max_batch=args.max_batch,
                                    drain_timeout_s=args.drain_timeout,
                                    worker_timeout_s=args.worker_timeout or None)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM/SIGINT that led to a graceful shutdown is not re-raised at the
        end (uvicorn re-raises it, so the process would die of the signal): the drained server exits with 0.
        ``on_exit``: called at the signal (the engine workers stop being restarted)."""

        on_exit = None

        def handle_exit(self, sig, frame):
            if self.on_exit is not None:
                self.on_exit()
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server


def _Server(config, on_exit=None):
    server = _server_class()(config)
    server.on_exit = on_exit
    return server
