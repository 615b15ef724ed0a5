"""Word times for transcripts: the aligner interface and the one aligner built, the glm-asr-ctc CTC head.

- ``base.py``: ``Aligner`` (the interface ``GlmAsr`` calls; other backends implement it) and ``AlignSegment``.
- ``head.py``: the head module in the published layout, its config and its checked loader.
- ``ctc.py``: CTC Viterbi forced alignment (token spans and posteriors).
- ``words.py``: text -> words and alignment tokens (space-delimited scripts per word, CJK per character,
  punctuation and case for alignment only), and back.
- ``ctc_aligner.py``: ``CtcAligner``: encoder states of each segment -> head -> Viterbi -> ``Word``s.
- ``random_head.py``: random heads with the real key layout (tests).

``load_aligner(spec, model_folder, device)`` is what ``glmasr.load(..., aligner=spec)`` calls: an ``Aligner``
instance passes through; a folder or hub id becomes a ``CtcAligner``.
"""

from __future__ import annotations

import os

from .base import Aligner, AlignSegment
from .ctc import CtcAlignment, ctc_viterbi, ctc_viterbi_batch, ctc_viterbi_batch_torch
from .ctc_aligner import DEFAULT_ALIGNER_ID, CtcAligner, resolve_head_folder
from .head import CtcHead, CtcHeadConfig, load_head

__all__ = [
    "DEFAULT_ALIGNER_ID",
    "AlignSegment",
    "Aligner",
    "CtcAligner",
    "CtcAlignment",
    "CtcHead",
    "CtcHeadConfig",
    "ctc_viterbi",
    "ctc_viterbi_batch",
    "ctc_viterbi_batch_torch",
    "load_aligner",
    "load_head",
    "resolve_head_folder",
]


def load_aligner(spec, model_folder: str | os.PathLike, device="cpu", model_config=None) -> Aligner:
    """``spec``: an ``Aligner`` (returned as it is), or a glm-asr-ctc head folder or hub id (a ``CtcAligner``
    on ``device`` with the tokenizer of ``model_folder``, checked against ``model_config`` (``GlmAsrConfig``)
    when given). Not yet bound to a model."""
    if isinstance(spec, Aligner):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"aligner must be a folder, a hub id or an Aligner instance, got {type(spec).__name__}")
    return CtcAligner.from_folder(spec, model_folder, device, model_config=model_config)
