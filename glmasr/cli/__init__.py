"""The ``glmasr`` command: ``main`` dispatches to ``glmasr [AUDIO ...]`` (``main.py``), ``glmasr transcribe``
(``transcribe.py``: files and folders to transcripts and subtitles) and ``glmasr serve`` (``serve.py``: the
OpenAI-compatible server); ``common.py`` has what they share."""

from .main import main

__all__ = ["main"]
