"""OpenAI-compatible transcription server over a loaded ``GlmAsr`` (``glmasr serve``; needs the ``serve`` extra).

- ``protocol``: request fields, validation, response bodies and the OpenAI error envelope;
- ``http``: connection timeouts, request framing, uvicorn's settings; ``uploads``: bodies under time and size limits;
- ``serving``: upload decoding with limits, admission, the async transcription over an engine client;
- ``app``: ``create_app(asr, ServerConfig(...))``, the FastAPI routes, auth, metrics, warm-up and health;
- ``cli``: ``glmasr serve`` / ``python -m glmasr.server`` (uvicorn, graceful SIGTERM).
"""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
