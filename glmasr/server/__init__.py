"""OpenAI-compatible transcription server over a loaded ``GlmAsr`` (``glmasr serve``; needs the ``serve`` extra).

- ``app``: ``create_app(asr, ServerConfig(...))``: the app's set-up (state, lifespan with the warm-up, error handlers,
  the framing guard); ``routes``: the handlers (transcriptions, models, health, metrics);
- ``protocol``: request fields, validation, the OpenAI error envelope, stream events (bodies: ``glmasr.writers``);
- ``http``: connection timeouts, request framing, uvicorn's settings; ``uploads``: bodies under time and size limits;
- ``serving``: upload decoding with limits, admission, the errors' answers, the async transcription over an engine
  client (``glmasr.workers.engine_client``: the in-process engine or ``--data-parallel`` workers);
- ``metrics``: Prometheus; ``loadgen``: the load generator (uploads, and realtime sessions at real-time pace);
- ``realtime``: OpenAI's Realtime transcription sessions over WebSocket (``/v1/realtime``) on ``glmasr.live``;
  ``static``: the microphone page served at ``/`` and ``/demo``.
The command is ``glmasr serve`` (``glmasr.cli.serve``).
"""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
