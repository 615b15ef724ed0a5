"""Voice-activity detection for long recordings: the Silero VAD v5/v6 16 kHz network in plain PyTorch, batched.

Weights come from the ``silero-vad`` wheel (MIT; the optional extra ``pip install glmasr[vad]``), found through
the distribution's file list: by default the tensors of its TorchScript model ``silero_vad/data/silero_vad.jit``,
which are those of its ``silero_vad.onnx`` (the wheel's ``silero_vad_16k.safetensors`` holds older weights that do
not reproduce the ONNX model; see ``load_weights``). The ``silero_vad`` package itself is never imported (its
import calls ``torch.set_num_threads(1)`` for the whole process).

The network (read off the tensor names/shapes and the shipped TorchScript, checked against the shipped ONNX model
run by onnxruntime in ``tests/test_vad.py``), per 512-sample window (32 ms) with the 64 samples before it as
context, i.e. an input row of 576 samples:

    reflect-pad 64 on the right -> 640 samples
    STFT as a conv: basis (258, 1, 256), stride 128 -> (258, 4); magnitude sqrt(re^2 + im^2) of the 129 bins
    conv1 129->128 k3 s1 p1, ReLU -> (128, 4)     conv2 128->64 k3 s2 p1, ReLU -> (64, 2)
    conv3 64->64   k3 s2 p1, ReLU -> (64, 1)      conv4 64->128 k3 s1 p1, ReLU -> (128, 1)
    LSTM cell 128 -> 128 with state (h, c)   (the only recurrent part)
    ReLU -> 1x1 conv 128->1 -> sigmoid -> speech probability

The state is (2, N, 128) (h and c stacked), as the ONNX model has it; N independent streams run as one batch.
Everything before the LSTM cell depends on the window alone, so it is computed for all windows of a recording in
large batches; the sequential part is the LSTM cell (its input projection is also precomputed for all windows),
and the decoder runs once over all hidden states at the end. On CUDA the recurrence is one Triton launch
(``glmasr_kernels.lstm_cell``; the torch loop in ``_recurrence`` stays as the reference and the CPU path).

Long recordings can be split into ``streams`` contiguous pieces that run as one batch, window by window, with
the state handed from each piece to the next over a few passes (see ``speech_probabilities``).
``speech_regions`` turns probabilities into speech regions (hysteresis, minimum speech and silence durations,
padding), ``merge_regions`` regions into pieces for the engine: packed into pieces of at most 30 s (the fewest
prompts), or speech-shaped (``follow_pauses``: at most ``max_segment_s``, cut at the longest pauses, edges close
to the speech; subtitles), ``segment`` does both; ``segment_options`` maps ``DecodeOptions.max_segment_s`` to
``segment``'s arguments.

``cancel`` (a ``threading.Event``, optional in ``speech_probabilities``, ``speech_regions`` and ``segment``): once
set, the computation stops at its next check (every front-end chunk, pass, and ``_CANCEL_EVERY`` recurrence steps
on the CPU) with ``VadCancelled``, so a program that runs VAD on worker threads (``glmasr transcribe``) can stop
them within a fraction of a second instead of waiting for a long recording's recurrence to end.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from ..errors import VadCancelled, VadUnavailableError

SAMPLE_RATE = 16000
WINDOW = 512  # samples per window (32 ms)
CONTEXT = 64  # samples of the previous window the network sees
WINDOW_S = WINDOW / SAMPLE_RATE
STATE_SIZE = 128
JIT_FILE = "silero_vad.jit"  # v6 weights: the ones silero_vad.onnx has
SAFETENSORS_FILE = "silero_vad_16k.safetensors"  # older weights (see load_weights)
DISTRIBUTION = "silero-vad"

# Streams shorter than this are not worth a stream of their own (the warm-up would dominate).
_MIN_STREAM_S = 30.0
_MAX_STREAMS = 256
# Audio before a stream's start that it runs in the first pass (from a zero state, outputs dropped) so that its
# state there is a better first guess than zeros (see speech_probabilities).
DEFAULT_WARMUP_S = 2.0
# Batched streams iterate until no probability changes by more than this from one pass to the next.
DEFAULT_TOL = 1e-3
# Front end (STFT + encoder convs) batch, in windows: bounds its intermediate memory (~8 KiB per window).
_FRONT_END_CHUNK = 8192
# Steps of the CPU recurrence between two looks at ``cancel`` (~0.1 s of work on a small CPU).
_CANCEL_EVERY = 64


def _check(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise VadCancelled("voice-activity detection cancelled")


def _missing(detail: str) -> VadUnavailableError:
    return VadUnavailableError(
        f"voice-activity detection needs the Silero VAD weights from the '{DISTRIBUTION}' wheel ({detail}); "
        f"install them with: pip install glmasr[vad]  (or: pip install 'silero-vad==6.2.*')")


def data_file(name: str = JIT_FILE) -> Path:
    """Path of ``silero_vad/data/<name>`` inside the installed ``silero-vad`` distribution (found through the
    distribution's file list; the package is not imported)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(DISTRIBUTION)
    except md.PackageNotFoundError:
        raise _missing("the distribution is not installed") from None
    for f in dist.files or ():
        if f.name == name and f.parent.name == "data":
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
            raise _missing(f"{path} is listed by the distribution but missing on disk")
    raise _missing(f"no data/{name} in silero-vad {dist.version}")


# Our names (those of the wheel's safetensors file) -> the TorchScript model's (its 16 kHz submodule `_model`).
_JIT_NAMES = {
    "stft_conv.weight": "stft.forward_basis_buffer",
    **{f"conv{i + 1}.{p}": f"encoder.{i}.reparam_conv.{p}" for i in range(4) for p in ("weight", "bias")},
    **{f"lstm_cell.{p}": f"decoder.rnn.{p}" for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
    "final_conv.weight": "decoder.decoder.2.weight", "final_conv.bias": "decoder.decoder.2.bias",
}


def load_weights(source: str = "jit") -> dict[str, torch.Tensor]:
    """The network's tensors, by our names, from the ``silero-vad`` wheel, on the CPU.

    ``source="jit"`` (default): the tensors of the shipped TorchScript model's 16 kHz part (``silero_vad.jit``),
    read with ``torch.jit.load`` (a TorchScript archive holds its own code; nothing of the ``silero_vad`` package
    runs). These are the weights of the shipped ``silero_vad.onnx`` (checked in tests/test_vad.py to ~1e-7).
    ``source="safetensors"``: ``silero_vad_16k.safetensors``, read with ``safetensors``. In silero-vad 6.2.3 that
    file has the same names and shapes but different values (only the STFT basis agrees): it is an older release's
    weights (the wheel keeps it for its tinygrad example) and does not reproduce ``silero_vad.onnx``.
    """
    if source == "jit":
        path = data_file(JIT_FILE)
        with warnings.catch_warnings():
            # torch marks torch.jit.load deprecated in favour of torch.export: a DeprecationWarning in 2.11-2.13,
            # a FutureWarning (which Python shows by default) in 2.14 and 2.15; silenced by its text, any category
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.load` is", category=Warning)
            state = torch.jit.load(str(path), map_location="cpu")._model.state_dict()
        missing = sorted(v for v in _JIT_NAMES.values() if v not in state)
        if missing:
            raise ValueError(f"{path}: the TorchScript model lacks {missing} (an unknown silero-vad layout)")
        return {ours: state[theirs].detach().clone() for ours, theirs in _JIT_NAMES.items()}
    if source == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(data_file(SAFETENSORS_FILE)))
    raise ValueError(f"unknown weights source {source!r}: use 'jit' or 'safetensors'")


_EXPECTED_SHAPES = {
    "stft_conv.weight": (258, 1, 256),
    "conv1.weight": (128, 129, 3), "conv1.bias": (128,),
    "conv2.weight": (64, 128, 3), "conv2.bias": (64,),
    "conv3.weight": (64, 64, 3), "conv3.bias": (64,),
    "conv4.weight": (128, 64, 3), "conv4.bias": (128,),
    "lstm_cell.weight_ih": (512, 128), "lstm_cell.weight_hh": (512, 128),
    "lstm_cell.bias_ih": (512,), "lstm_cell.bias_hh": (512,),
    "final_conv.weight": (1, 128, 1), "final_conv.bias": (1,),
}


class SileroVad(torch.nn.Module):
    """The Silero VAD 16 kHz network (fp32) from tensors named as the wheel's safetensors file names them.

    ``forward(x, state)``: x (N, 576) = 64 context samples + one 512-sample window per stream, state (2, N, 128)
    (h, c) -> (probability (N, 1), next state (2, N, 128)); the ONNX model's interface.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        missing = sorted(set(_EXPECTED_SHAPES) - set(tensors))
        if missing:
            raise ValueError(f"Silero VAD weights lack {missing}")
        for name, shape in _EXPECTED_SHAPES.items():
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"Silero VAD weight {name} has shape {tuple(t.shape)}, expected {shape}")
            self.register_buffer(name.replace(".", "_"), t.to(torch.float32).contiguous())

    @classmethod
    def from_wheel(cls, device=None, source: str = "jit") -> "SileroVad":
        return cls(load_weights(source)).to(_device(device)).eval()

    # -- pieces ---------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, as_matmul: bool | None = None) -> torch.Tensor:
        """(W, 576) input rows -> (W, 128) encoder features (no state involved).

        ``as_matmul`` (default: on CUDA): the STFT and the four convolutions as matmuls over unfolded windows
        (channels last) instead of ``conv1d``. On CUDA, cuDNN convolutions run in TF32 by default
        (``torch.backends.cudnn.allow_tf32``) while fp32 matmuls do not (``torch.backends.cuda.matmul.allow_tf32``
        is off unless a caller turns it on), and the network must stay fp32 without touching process-wide flags.
        On the CPU ``conv1d`` (oneDNN, fp32) is ~3x faster here. Both forms are held to onnxruntime in the tests."""
        if as_matmul is None:
            as_matmul = x.device.type == "cuda"
        x = F.pad(x.unsqueeze(1), (0, CONTEXT), mode="reflect")  # (W, 1, 640)
        if not as_matmul:
            spec = F.conv1d(x, self.stft_conv_weight, stride=128)  # (W, 258, 4)
            re, im = spec[:, :129], spec[:, 129:]
            h = torch.sqrt(re * re + im * im)
            h = F.relu(F.conv1d(h, self.conv1_weight, self.conv1_bias, stride=1, padding=1))
            h = F.relu(F.conv1d(h, self.conv2_weight, self.conv2_bias, stride=2, padding=1))
            h = F.relu(F.conv1d(h, self.conv3_weight, self.conv3_bias, stride=2, padding=1))
            h = F.relu(F.conv1d(h, self.conv4_weight, self.conv4_bias, stride=1, padding=1))
            return h.squeeze(-1)  # (W, 128)
        w = x.shape[0]
        frames = x.squeeze(1).unfold(1, 256, 128).reshape(-1, 256)  # (W * 4, 256): 2-D matmul, ~3x a 3-D one
        spec = (frames @ self.stft_conv_weight.reshape(258, 256).t()).reshape(w, 4, 258)
        re, im = spec[..., :129], spec[..., 129:]
        h = torch.sqrt(re * re + im * im)  # (W, 4, 129)
        h = _conv3(h, self.conv1_weight, self.conv1_bias, 1)  # (W, 4, 128)
        h = _conv3(h, self.conv2_weight, self.conv2_bias, 2)  # (W, 2, 64)
        h = _conv3(h, self.conv3_weight, self.conv3_bias, 2)  # (W, 1, 64)
        h = _conv3(h, self.conv4_weight, self.conv4_bias, 1)  # (W, 1, 128)
        return h.squeeze(1)

    def input_gates(self, feats: torch.Tensor) -> torch.Tensor:
        """The LSTM cell's input projection, W_ih x + b_ih + b_hh, for any number of rows: (..., 128) -> (..., 512)."""
        return torch.addmm(self.lstm_cell_bias_ih + self.lstm_cell_bias_hh, feats.reshape(-1, STATE_SIZE),
                           self.lstm_cell_weight_ih.t()).reshape(*feats.shape[:-1], 4 * STATE_SIZE)

    def cell(self, gates_x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One LSTM step (PyTorch gate order i, f, g, o) from precomputed input gates (N, 512)."""
        gates = torch.addmm(gates_x, h, self.lstm_cell_weight_hh.t())
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c

    def weight_hh_columns(self) -> torch.Tensor:
        """W_hh (512, 128) stored column-major (``W_hh.t()`` contiguous), the layout the LSTM kernel reads fastest;
        made once per device."""
        w = self.lstm_cell_weight_hh
        key = (w.data_ptr(), w.device)  # redone after .to() (inference tensors have no version counter)
        cached = getattr(self, "_w_hh_columns", None)
        if cached is None or cached[0] != key:
            cached = (key, w.t().contiguous().t())
            self._w_hh_columns = cached
        return cached[1]

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., 128) -> speech probabilities (...)."""
        w = self.final_conv_weight.reshape(1, STATE_SIZE)
        return torch.sigmoid(F.relu(h) @ w.t() + self.final_conv_bias).squeeze(-1)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != 2 or x.shape[1] != CONTEXT + WINDOW:
            raise ValueError(f"input must be (N, {CONTEXT + WINDOW}), got {tuple(x.shape)}")
        h, c = self.cell(self.input_gates(self.encode(x)), state[0], state[1])
        return self.decode(h).unsqueeze(1), torch.stack([h, c])


def _conv3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int) -> torch.Tensor:
    """ReLU(conv1d(kernel 3, padding 1, ``stride``)) on channels-last (W, L, C_in) -> (W, L_out, C_out), as a
    matmul (see ``SileroVad.encode``)."""
    w, length, c_in = x.shape
    cols = F.pad(x, (0, 0, 1, 1)).unfold(1, 3, stride)  # (W, L_out, C_in, 3): index c * 3 + k as the weight's
    out = torch.addmm(bias, cols.reshape(-1, c_in * 3), weight.reshape(weight.shape[0], c_in * 3).t())
    return F.relu(out).reshape(w, cols.shape[1], weight.shape[0])


def _device(device) -> torch.device:
    from glmasr.models.device import resolve_device

    return resolve_device(device)


@functools.lru_cache(maxsize=4)
def _cached_model(device: str) -> SileroVad:
    return SileroVad.from_wheel(device)


def load_vad(device=None) -> SileroVad:
    """The network on ``device`` (default: CUDA if available, else CPU), loaded once per device."""
    return _cached_model(str(_device(device)))


def _as_samples(samples) -> np.ndarray:
    x = np.asarray(samples)
    if x.ndim != 1:
        raise ValueError(f"expected mono 16 kHz samples (1-D), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"expected float samples in [-1, 1], got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _auto_streams(n_windows: int) -> int:
    per = int(round(_MIN_STREAM_S / WINDOW_S))
    return max(1, min(_MAX_STREAMS, n_windows // per))


@torch.inference_mode()
def speech_probabilities(samples_16k, device=None, streams: int | None = None,
                         warmup_s: float = DEFAULT_WARMUP_S, passes: int | None = None,
                         tol: float = DEFAULT_TOL, cancel=None) -> np.ndarray:
    """Speech probability of every 512-sample window (32 ms) of a 16 kHz recording, as float32 (ceil(n / 512),).

    Window i covers samples [512 i, 512 (i + 1)) (the last one zero-padded) and sees the 64 samples before it
    (zeros before the recording), as Silero's own ``get_speech_timestamps`` feeds it.

    Everything before the LSTM cell is computed for all windows at once (it does not depend on the state); the
    LSTM cell is the sequential part. ``streams=1`` runs it over the whole recording as one stream: exactly the
    network run window by window (what ``tests/test_vad.py`` holds to onnxruntime).

    ``streams`` (default: 1 on the CPU, where one stream is fastest and exact; on CUDA, where each step costs its
    kernel launches whatever the batch, one per 30 s of audio, at most 256) > 1 cuts the recording into that many
    contiguous streams of equal length that run as one batch, window by window, and stitches their probabilities. The
    network's state has a long memory (some cell-state units integrate over tens of seconds; a stream started from
    a zero state still differs from the single-stream probabilities by up to ~0.5 at places 30 s later, measured),
    so a short warm-up alone is not enough. So:
    pass 1: stream k starts ``warmup_s`` before its first window from a zero state (outputs there dropped);
    pass p > 1: stream k starts at its first window from the state stream k - 1 ended pass p - 1 with (a parareal
    iteration: after p passes streams 0 .. p - 1 are exact, so with ``streams`` passes the result is the
    single-stream one). With ``passes=None`` (default) the passes stop as soon as no probability changed by more
    than ``tol`` (default 1e-3) from the pass before; an int runs exactly that many passes. ``cancel``: see the
    module docstring (``VadCancelled``). Measured on 6 minutes
    of synthesized speech with 30 s streams: 8-9 passes, probabilities within ~1e-4 of the single stream's and the
    same regions; 3 passes give region boundaries within 0.032 s. The cost is passes x (recording / streams)
    sequential steps instead of the recording's length.
    """
    x = _as_samples(samples_16k)
    model = load_vad(device)
    dev = model.stft_conv_weight.device
    n = x.shape[0]
    n_win = max(1, math.ceil(n / WINDOW))
    padded = np.zeros(CONTEXT + n_win * WINDOW, dtype=np.float32)
    padded[CONTEXT:CONTEXT + n] = x
    audio = torch.from_numpy(padded).to(dev, non_blocking=False)
    rows = audio.unfold(0, CONTEXT + WINDOW, WINDOW)  # (n_win, 576), a view

    # Front end and the LSTM input projection for every window, in chunks.
    gates_x = torch.empty(n_win, 4 * STATE_SIZE, device=dev, dtype=torch.float32)
    for a in range(0, n_win, _FRONT_END_CHUNK):
        _check(cancel)
        b = min(n_win, a + _FRONT_END_CHUNK)
        gates_x[a:b] = model.input_gates(model.encode(rows[a:b]))

    if streams is None:
        s = _auto_streams(n_win) if dev.type == "cuda" else 1
    else:
        s = int(streams)
    if s < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    if passes is not None and passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    s = min(s, n_win)
    length = math.ceil(n_win / s)  # windows each stream owns
    s = math.ceil(n_win / length)  # drop empty streams
    if s == 1:
        hs, _ = _recurrence(model, gates_x.unsqueeze(1), None, None, cancel)
        return model.decode(hs[:, 0]).float().cpu().numpy()
    warm = min(int(round(warmup_s / WINDOW_S)), length)
    owned = torch.arange(s, device=dev) * length
    # Pass 1: stream k runs from window k L - warm, from a zero state (stream 0's state is held at zero before the
    # recording starts, so it is the single-stream run).
    g, keep = _gather(gates_x, owned - warm, warm + length)
    hs, (h, c) = _recurrence(model, g, keep, None, cancel)
    probs = model.decode(hs[warm:])
    del g, hs
    # Later passes: stream k starts at its first window with the state stream k - 1 ended the previous pass with
    # (a parareal iteration: after p passes streams 0 .. p - 1 are exact, so s passes are the single-stream run).
    limit = s if passes is None else min(passes, s)
    if limit > 1:
        g, _ = _gather(gates_x, owned, length)
    for _ in range(limit - 1):
        h0 = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
        c0 = torch.cat([torch.zeros_like(c[:1]), c[:-1]])
        hs, (h, c) = _recurrence(model, g, None, (h0, c0), cancel)
        new = model.decode(hs)
        change = float((new - probs).abs().max())
        probs = new
        if passes is None and change <= tol:
            break
    probs = probs.transpose(0, 1).reshape(-1)[:n_win]  # stream-major = time order
    return probs.float().cpu().numpy()


def _gather(gates_x: torch.Tensor, starts: torch.Tensor, steps: int):
    """Input gates of ``len(starts)`` streams, stream k over windows starts[k] + t for t < steps: (steps, s, 512).
    Windows past the recording's end repeat its last one (their outputs are dropped by the caller); windows before
    its start give a mask (leading steps, s, 1) that holds those streams' state at zero (None if there are none)."""
    n_win = gates_x.shape[0]
    idx = starts[None, :] + torch.arange(steps, device=gates_x.device)[:, None]  # (steps, s)
    g = gates_x[idx.clamp(0, n_win - 1)]
    before = max(0, -int(starts.min()))
    keep = (idx[:before] >= 0).to(torch.float32).unsqueeze(-1) if before else None
    return g, keep


def _recurrence(model: SileroVad, g: torch.Tensor, keep: torch.Tensor | None,
                state: tuple[torch.Tensor, torch.Tensor] | None, cancel=None):
    """The LSTM cell over ``g`` (steps, streams, 512) of input gates, all streams as one batch, from ``state``
    (default zeros); ``keep`` (from ``_gather``) zeroes the state of streams not yet in the recording. Returns the
    hidden states (steps, streams, 128) and the final (h, c). ``cancel``: looked at before the launch, and every
    ``_CANCEL_EVERY`` steps of the torch loop."""
    _check(cancel)
    steps, s, _ = g.shape
    if state is None:
        h = g.new_zeros(s, STATE_SIZE)
        c = g.new_zeros(s, STATE_SIZE)
    else:
        h, c = state
    lstm_sequence = _lstm_kernel(g.device)
    if lstm_sequence is not None:  # all steps in one launch (the loop below is the reference)
        hs, h, c = lstm_sequence(g, h, c, model.weight_hh_columns(), keep=keep)
        return hs, (h, c)
    before = 0 if keep is None else keep.shape[0]
    hs = g.new_empty(steps, s, STATE_SIZE)
    for t in range(steps):
        if t % _CANCEL_EVERY == 0:
            _check(cancel)
        h, c = model.cell(g[t], h, c)
        if t < before:
            h = h * keep[t]
            c = c * keep[t]
        hs[t] = h
    return hs, (h, c)


# On CUDA the recurrence runs as one Triton kernel (glmasr_kernels.lstm_cell) when Triton is importable; False
# forces the torch loop of _recurrence (the reference; the tests compare the two).
TRITON_LSTM = True


@functools.lru_cache(maxsize=1)
def _import_lstm_sequence():
    try:
        from glmasr_kernels.lstm_cell import lstm_sequence, triton
    except ImportError:
        return None
    return lstm_sequence if triton is not None else None


def _lstm_kernel(device: torch.device):
    """``lstm_sequence`` where it should run (CUDA, Triton importable, TRITON_LSTM on), else None."""
    if not TRITON_LSTM or device.type != "cuda":
        return None
    return _import_lstm_sequence()


# The network's probability lags the audio at the end of speech: it stays above the threshold for about two
# windows after the speech stops (measured on espeak-ng speech in low noise: region ends 0-110 ms, on average
# ~60 ms, after the speech when taken at the first window below the threshold). A region therefore ends at the
# start of its last window above the threshold, one window earlier (ends then 40 ms early to 80 ms late, ~30 ms
# late on average; starts are within ~16 ms and are not shifted).
_END_LAG = WINDOW


def _region_end(start: int, below_from: int) -> int:
    return below_from - _END_LAG if below_from - _END_LAG > start else below_from


def regions_from_probabilities(probs: np.ndarray, n_samples: int | None = None, threshold: float = 0.5,
                               neg_threshold: float | None = None, min_speech_ms: float = 250,
                               min_silence_ms: float = 500, speech_pad_ms: float = 200,
                               end_pad_ms: float | None = None) -> list[tuple[float, float]]:
    """Speech regions ``[(start_s, end_s), ...]`` from per-window probabilities (see ``speech_regions``).
    ``end_pad_ms`` (default: ``speech_pad_ms``): the padding after each region, ``speech_pad_ms`` the one before."""
    p = np.asarray(probs, dtype=np.float32).reshape(-1)
    total = p.shape[0] * WINDOW if n_samples is None else int(n_samples)
    neg = max(threshold - 0.15, 0.01) if neg_threshold is None else neg_threshold
    min_speech = min_speech_ms * SAMPLE_RATE / 1000
    min_silence = min_silence_ms * SAMPLE_RATE / 1000
    for name, ms in (("speech_pad_ms", speech_pad_ms), ("end_pad_ms", end_pad_ms)):
        if ms is not None and not ms >= 0:
            raise ValueError(f"{name} must be >= 0, got {ms}")
    lead = int(speech_pad_ms * SAMPLE_RATE / 1000)
    tail = lead if end_pad_ms is None else int(end_pad_ms * SAMPLE_RATE / 1000)

    regions: list[list[int]] = []  # in samples
    start = None
    silence_from = None  # first window of the current run below neg_threshold (a candidate silence)
    below_from = None  # first window of the current run below threshold: where the region ends if it is one
    for i, v in enumerate(p.tolist()):
        pos = i * WINDOW
        if start is None:
            if v >= threshold:
                start, silence_from, below_from = pos, None, None
            continue
        if v >= threshold:
            silence_from = below_from = None
            continue
        if below_from is None:
            below_from = pos
        if v < neg:
            if silence_from is None:
                silence_from = pos
            if pos + WINDOW - silence_from >= min_silence:
                regions.append([start, _region_end(start, below_from)])
                start = silence_from = below_from = None
        else:
            silence_from = None  # back between the thresholds: the silence run is broken
    if start is not None:
        end = p.shape[0] * WINDOW if below_from is None else _region_end(start, below_from)
        regions.append([start, min(total, end)])
    regions = [r for r in regions if r[1] - r[0] >= min_speech]

    # Pad each region; where two padded regions would overlap, the gap between them is shared in proportion to the
    # two pads (in half when they are equal).
    orig = [tuple(r) for r in regions]

    def shares(gap: int) -> tuple[int, int]:  # (after the region before the gap, before the one after it)
        if gap >= lead + tail:
            return tail, lead
        after = gap * tail // (lead + tail)
        return after, gap - after

    padded = []
    for k, (a, b) in enumerate(orig):
        a -= lead if k == 0 else shares(a - orig[k - 1][1])[1]
        b += tail if k == len(orig) - 1 else shares(orig[k + 1][0] - b)[0]
        padded.append((a, b))
    return [(max(0, a) / SAMPLE_RATE, min(total, b) / SAMPLE_RATE) for a, b in padded]


def speech_regions(samples_16k, threshold: float = 0.5, min_speech_ms: float = 250, min_silence_ms: float = 500,
                   speech_pad_ms: float = 200, device=None, streams: int | None = None,
                   neg_threshold: float | None = None, cancel=None,
                   end_pad_ms: float | None = None) -> list[tuple[float, float]]:
    """Speech regions ``[(start_s, end_s), ...]`` of a 16 kHz mono float recording, in order, not overlapping.

    A region starts at the first window whose probability is >= ``threshold``; it ends at a run of windows below
    ``neg_threshold`` (default threshold - 0.15) lasting ``min_silence_ms`` (windows between the two thresholds
    break the run), at the start of the last window >= ``threshold`` before that run (see ``_END_LAG``); regions
    shorter than ``min_speech_ms`` are dropped; each is widened by ``speech_pad_ms`` before and ``end_pad_ms``
    (default: the same) after (where two would meet, the gap is shared in proportion to the two pads), clipped to
    the recording. Times are multiples of the 32 ms window (plus the padding).

    Defaults: threshold 0.5 as Silero and faster-whisper; min_silence 500 ms, longer than pauses between words
    (~100-300 ms) so words stay together, shorter than faster-whisper's 2000 ms because ``merge_regions`` joins
    regions into 30 s pieces anyway and every silence found is a place a piece can end; speech_pad 200 ms (Silero
    30, faster-whisper 400) so the onsets and offsets that 32 ms windows and the hysteresis clip stay in.
    """
    x = _as_samples(samples_16k)
    probs = speech_probabilities(x, device=device, streams=streams, cancel=cancel)
    return regions_from_probabilities(probs, x.shape[0], threshold=threshold, neg_threshold=neg_threshold,
                                      min_speech_ms=min_speech_ms, min_silence_ms=min_silence_ms,
                                      speech_pad_ms=speech_pad_ms, end_pad_ms=end_pad_ms)


# Speech-shaped pieces (``segment_options`` with a max_segment_s; the subtitle use): edges close to the speech
# and cuts at pauses. Measured on espeak-ng speech (64 phrases, 4 voices, 140-190 wpm) in low noise, unpadded
# regions start 17 ms early to 111 ms late (weak onsets such as /h/, /f/, /th/ sit below the threshold) and end
# 56 ms early to 73 ms late; 100 ms before and 60 ms after keep every onset and offset in and every edge within
# ~135 ms of the speech.
SPEECH_LEAD_PAD_MS = 100.0
SPEECH_TAIL_PAD_MS = 60.0
# A pause at least this long always ends a speech-shaped piece (a cue does not stay up across it); shorter ones
# (the VAD ends regions at pauses of min_silence_ms, 500 ms) are merged over while the piece fits max_segment_s.
SPEECH_MAX_PAUSE_S = 1.0
# The cost of a cut at a gap of g seconds is 1 / (g + _CUT_SOFTEN_S): among the partitions with the fewest pieces
# the one with the least total cost cuts at the longest pauses (convex in g: two medium pauses are preferred to a
# long one and a very short one, which a sum of the gaps would not do).
_CUT_SOFTEN_S = 0.05


def segment_options(max_segment_s: float | None = None) -> dict:
    """Keyword arguments of ``segment`` for ``DecodeOptions.max_segment_s`` (the one mapping every caller uses).

    None: ``{"max_s": 30.0}``: regions packed greedily into pieces of up to 30 s (the fewest prompts), padded by
    200 ms. A number S (0 < S <= 30): speech-shaped pieces: ``max_s=S``, ``follow_pauses=True`` (see
    ``merge_regions``), regions padded by 100 ms before and 60 ms after the speech, and never merged across a
    pause of ``SPEECH_MAX_PAUSE_S`` (1 s) or more (``max_gap_s`` is that pause less the two pads: the gap between
    padded regions). Callers may override any of them (e.g. a server's ``speech_pad_ms``)."""
    if max_segment_s is None:
        return {"max_s": 30.0}
    if isinstance(max_segment_s, bool) or not isinstance(max_segment_s, (int, float)) \
            or not 0 < max_segment_s <= 30.0:
        raise ValueError(f"max_segment_s must be a number of seconds in (0, 30], got {max_segment_s!r}")
    return {"max_s": float(max_segment_s), "follow_pauses": True,
            "max_gap_s": SPEECH_MAX_PAUSE_S - (SPEECH_LEAD_PAD_MS + SPEECH_TAIL_PAD_MS) / 1000,
            "speech_pad_ms": SPEECH_LEAD_PAD_MS, "end_pad_ms": SPEECH_TAIL_PAD_MS}


def merge_regions(regions, max_s: float = 30.0, probs: np.ndarray | None = None,
                  max_gap_s: float | None = None, min_split_s: float | None = None,
                  follow_pauses: bool = False) -> list[tuple[float, float]]:
    """Speech regions -> pieces of at most ``max_s`` seconds for the engine: ``[(start_s, end_s), ...]``.

    ``follow_pauses=False`` (default; 30 s pieces for the engine): neighbouring regions are merged (the piece runs
    from the first one's start to the last one's end, silences included) while the piece stays within ``max_s``;
    ``max_gap_s`` (default: none) also starts a new piece at a silence longer than that. A region longer than
    ``max_s`` is split: with ``probs`` (per 32 ms window, from ``speech_probabilities``) at the lowest-probability
    window boundary between ``min_split_s`` (default max_s / 2) and ``max_s`` from the piece's start, else hard at
    ``max_s``.

    ``follow_pauses=True`` (speech-shaped pieces, e.g. for subtitles):
    1. a region longer than ``max_s`` is cut into the fewest pieces, k = ceil(length / max_s): each cut, in turn,
       at the lowest-probability window boundary (``probs``; without them the latest allowed point) among those
       that leave the rest room for its k - 1 pieces, no piece shorter than length / (2 k);
    2. a gap longer than ``max_gap_s`` (default: none) always ends a piece;
    3. between those, the units (the regions and the parts of cut ones) are grouped into the fewest pieces that
       keep each within ``max_s``, and among such groupings the one whose cuts lie at the longest gaps (the least
       total 1 / (gap + 0.05 s) over its cuts: long pauses before short ones, and a few medium pauses before one
       long and one very short). ``min_split_s`` is not used.

    Either way no piece is longer than ``max_s``, every region lies inside the pieces, the pieces are in order
    and do not overlap, and a piece starts at a region's start (or a cut) and ends at a region's end (or a cut).
    """
    if not max_s > 0:
        raise ValueError(f"max_s must be > 0, got {max_s}")
    if follow_pauses:
        return _follow_pauses(regions, float(max_s), probs, max_gap_s)
    lo_split = max_s / 2 if min_split_s is None else min_split_s
    eps = 1e-9
    p = None if probs is None else np.asarray(probs, dtype=np.float32).reshape(-1)

    def split(a: float, b: float) -> list[tuple[float, float]]:
        out = []
        while b - a > max_s + eps:
            cut = a + max_s
            if p is not None:
                # candidate cuts: window starts i * WINDOW_S in [a + lo_split, a + max_s]; the cut goes at the start
                # of the quietest window, so the window's silence begins the next piece.
                i0 = math.ceil((a + lo_split) / WINDOW_S - eps)
                i1 = math.floor((a + max_s) / WINDOW_S + eps)
                i1 = min(i1, p.shape[0] - 1)
                if i1 >= i0:
                    i = i0 + int(np.argmin(p[i0:i1 + 1]))
                    cut = i * WINDOW_S
            out.append((a, cut))
            a = cut
        out.append((a, b))
        return out

    pieces: list[tuple[float, float]] = []
    cur = None
    for a, b in sorted((float(a), float(b)) for a, b in regions):
        if b <= a:
            continue
        if cur is not None and a < cur[1]:  # overlapping input: merge
            a = cur[1]
            if b <= a:
                continue
        if cur is not None and b - cur[0] <= max_s + eps and (max_gap_s is None or a - cur[1] <= max_gap_s):
            cur = (cur[0], b)
            continue
        if cur is not None:
            pieces.append(cur)
        parts = split(a, b)
        pieces.extend(parts[:-1])
        cur = parts[-1]
    if cur is not None:
        pieces.append(cur)
    return pieces


def _normalised(regions) -> list[tuple[float, float]]:
    """Regions sorted, empty ones dropped, overlapping ones joined (touching ones are kept apart: where padded
    regions meet there is a pause)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in regions):
        if b <= a:
            continue
        if out and a < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _cut_fewest(a: float, b: float, max_s: float, p: np.ndarray | None) -> list[tuple[float, float]]:
    """[a, b) in ceil((b - a) / max_s) pieces of at most max_s, each cut at the quietest allowed window boundary
    (see ``merge_regions``, follow_pauses step 1)."""
    eps = 1e-9
    k = max(1, math.ceil((b - a) / max_s - eps))
    shortest = (b - a) / (2 * k)  # <= max_s / 2, as k >= (b - a) / max_s
    out = []
    while k > 1:
        lo = max(a + shortest, b - (k - 1) * max_s)  # the rest fits k - 1 pieces
        hi = min(a + max_s, b - (k - 1) * shortest)  # this piece fits, the rest's pieces are not too short
        cut = hi
        if p is not None:
            i0 = math.ceil(lo / WINDOW_S - eps)
            i1 = min(math.floor(hi / WINDOW_S + eps), p.shape[0] - 1)
            if i1 >= i0:
                cut = min(max(lo, (i0 + int(np.argmin(p[i0:i1 + 1]))) * WINDOW_S), hi)
        out.append((a, cut))
        a, k = cut, k - 1
    out.append((a, b))
    return out


def _follow_pauses(regions, max_s: float, probs, max_gap_s: float | None) -> list[tuple[float, float]]:
    eps = 1e-9
    p = None if probs is None else np.asarray(probs, dtype=np.float32).reshape(-1)
    units = [u for a, b in _normalised(regions) for u in _cut_fewest(a, b, max_s, p)]
    runs: list[list[tuple[float, float]]] = []
    for u in units:
        if runs and (max_gap_s is None or u[0] - runs[-1][-1][1] <= max_gap_s + eps):
            runs[-1].append(u)
        else:
            runs.append([u])
    pieces = []
    for run in runs:
        # best[j]: (pieces, cut cost) of the best partition of run[:j]; back[j]: where its last piece starts
        n = len(run)
        best: list[tuple[int, float] | None] = [(0, 0.0)] + [None] * n
        back = [0] * (n + 1)
        for j in range(1, n + 1):
            end = run[j - 1][1]
            for i in range(j - 1, -1, -1):
                if end - run[i][0] > max_s + eps:
                    break
                count, cost = best[i]
                if i > 0:
                    cost += 1.0 / (run[i][0] - run[i - 1][1] + _CUT_SOFTEN_S)
                if best[j] is None or (count + 1, cost) < best[j]:
                    best[j], back[j] = (count + 1, cost), i
        out, j = [], n
        while j > 0:
            i = back[j]
            out.append((run[i][0], run[j - 1][1]))
            j = i
        pieces.extend(reversed(out))
    return pieces


def segment(samples_16k, max_s: float = 30.0, device=None, streams: int | None = None,
            max_gap_s: float | None = None, cancel=None, follow_pauses: bool = False,
            **region_options) -> list[tuple[float, float]]:
    """``speech_regions`` + ``merge_regions`` with one probability pass: pieces of at most ``max_s`` seconds.
    ``follow_pauses``: speech-shaped pieces (see ``merge_regions``; ``segment_options`` gives the keyword arguments
    for a ``DecodeOptions.max_segment_s``). ``cancel``: see the module docstring."""
    x = _as_samples(samples_16k)
    probs = speech_probabilities(x, device=device, streams=streams, cancel=cancel)
    regions = regions_from_probabilities(probs, x.shape[0], **region_options)
    return merge_regions(regions, max_s=max_s, probs=probs, max_gap_s=max_gap_s, follow_pauses=follow_pauses)
