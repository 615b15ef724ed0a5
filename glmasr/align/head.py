"""The CTC aligner head in the public ``glm-asr-ctc`` layout: the module, its config and its loader.

The head (JazerJu's ``glm-asr-ctc``, Apache-2.0; module and key layout read from the public training repository
``JazerJu/glm-asr-ctc-train``, ``train_ddp.py:CTCDecoder``; not copied) maps the frozen GLM-ASR audio encoder's
final-normed states, *before* the projector's 4-frame merge (1280 wide, 50 per second: one per 20 ms), to CTC
logits over the model's own tokenizer plus one blank:

    x = gelu(linear1(states)); x = gelu(linear2(x))            encoder_dim -> proj_hidden -> ctc_hidden
    x = block(x) for each of blocks.0 .. blocks.{num_blocks-1}  (skipped when ``use_blocks`` is false)
    logits = ctc_lo(layer_norm(x))                              ctc_hidden -> vocab_size

Each block is post-norm self-attention over all frames (no mask, no positions) then a small GELU MLP:
``x = norm1(x + linear_o(attn(linear_q x, linear_k x, linear_v x)))``, ``x = norm2(x + ffn_w2(gelu(ffn_w1 x)))``.
The published head: encoder_dim 1280, proj_hidden 2048, ctc_hidden 512, 5 blocks of 8 heads, ffn_hidden 128,
vocab_size 59264 with blank 59263 (= the tokenizer's length, blank appended after the last token): ~40.0 M
parameters, fp32.

A head folder holds ``config.json`` (the fields above; the exporter also writes ``model_type: "ctc-head"``,
``encoder_family``, ``frame_shift_sec``, ``sample_rate``...) and the weights in ``ctc_head.safetensors`` (the
exporter's name) or ``model.safetensors``. Fields missing from config.json are taken from the tensor shapes
(``num_heads``, which no shape shows, defaults to 8, the training default); a field that contradicts a shape, a
missing or unexpected tensor, or a head made for another encoder (family, frame rate, sample rate) is a
``CheckpointError`` naming the file, the key and both values. Keys under ``optimizer.`` (left in some exports)
are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.weights import read_header
from ..errors import CheckpointError

WEIGHT_FILES = ("ctc_head.safetensors", "model.safetensors")
FRAME_SHIFT_S = 0.02  # the GLM-ASR encoder: mel hop 160 samples at 16 kHz, halved by the stride-2 convolution
SAMPLE_RATE = 16000
# The authors' measured median bias of this head's word times against Montreal Forced Aligner on LibriSpeech
# (1500 utterances, 29,621 words): starts +105 ms late, ends 100 ms early (a peaky CTC property). Theirs, not ours.
AUTHORS_START_BIAS_S = 0.105
AUTHORS_END_BIAS_S = -0.100
_IGNORED_PREFIXES = ("optimizer.",)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class CtcHeadConfig:
    """The head's dimensions and conventions (config.json). ``start_bias_s`` / ``end_bias_s``: how late the
    head's word starts / ends come out on average (seconds; negative: early), subtracted from the times when the
    aligner corrects them; default the authors' figures."""

    encoder_dim: int = 1280
    proj_hidden: int = 2048
    ctc_hidden: int = 512
    num_blocks: int = 5
    num_heads: int = 8
    ffn_hidden: int = 128
    vocab_size: int = 59264
    blank_id: int = 59263
    use_blocks: bool = True
    frame_shift_s: float = FRAME_SHIFT_S
    start_bias_s: float = AUTHORS_START_BIAS_S
    end_bias_s: float = AUTHORS_END_BIAS_S

    def validate(self, where: str = "config") -> None:
        for f in ("encoder_dim", "proj_hidden", "ctc_hidden", "num_blocks", "num_heads", "ffn_hidden", "vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f == "num_blocks" else 1):
                raise CheckpointError(f"{where}: {f} must be a positive integer, got {v!r}")
        if self.ctc_hidden % self.num_heads:
            raise CheckpointError(f"{where}: num_heads ({self.num_heads}) must divide ctc_hidden ({self.ctc_hidden})")
        if not 0 <= self.blank_id < self.vocab_size:
            raise CheckpointError(f"{where}: blank_id {self.blank_id} is outside the head's {self.vocab_size} "
                                  f"classes")
        for f in ("start_bias_s", "end_bias_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= 1.0):
                raise CheckpointError(f"{where}: {f} must be a number of seconds within [-1, 1], got {v!r}")

    def to_json(self) -> dict:
        """The published config.json fields (plus ours: use_blocks and the biases)."""
        return {"model_type": "ctc-head", "encoder_family": "glm-asr", "base_encoder": "zai-org/GLM-ASR-Nano-2512",
                "encoder_dim": self.encoder_dim, "proj_hidden": self.proj_hidden, "ctc_hidden": self.ctc_hidden,
                "num_blocks": self.num_blocks, "num_heads": self.num_heads, "ffn_hidden": self.ffn_hidden,
                "vocab_size": self.vocab_size, "blank_id": self.blank_id, "use_blocks": self.use_blocks,
                "frame_rate_hz": round(1 / self.frame_shift_s), "frame_shift_sec": self.frame_shift_s,
                "sample_rate": SAMPLE_RATE, "start_bias_s": self.start_bias_s, "end_bias_s": self.end_bias_s,
                "torch_dtype": "float32"}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a head with this config: its published key and shape."""
        e, p, h, f, v = self.encoder_dim, self.proj_hidden, self.ctc_hidden, self.ffn_hidden, self.vocab_size
        shapes = {"linear1.weight": (p, e), "linear1.bias": (p,), "linear2.weight": (h, p), "linear2.bias": (h,)}
        for i in range(self.num_blocks):
            b = f"blocks.{i}."
            for name in ("linear_q", "linear_k", "linear_v", "linear_o"):
                shapes[f"{b}{name}.weight"], shapes[f"{b}{name}.bias"] = (h, h), (h,)
            for name in ("norm1", "norm2"):
                shapes[f"{b}{name}.weight"], shapes[f"{b}{name}.bias"] = (h,), (h,)
            shapes[f"{b}ffn_w1.weight"], shapes[f"{b}ffn_w1.bias"] = (f, h), (f,)
            shapes[f"{b}ffn_w2.weight"], shapes[f"{b}ffn_w2.bias"] = (h, f), (h,)
        shapes.update({"layer_norm.weight": (h,), "layer_norm.bias": (h,), "ctc_lo.weight": (v, h),
                       "ctc_lo.bias": (v,)})
        return shapes


class HeadBlock(nn.Module):
    """One post-norm transformer block of the head (parameter names as published)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.linear_q = nn.Linear(hidden, hidden)
        self.linear_k = nn.Linear(hidden, hidden)
        self.linear_v = nn.Linear(hidden, hidden)
        self.linear_o = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn_w1 = nn.Linear(hidden, ffn_hidden)
        self.ffn_w2 = nn.Linear(ffn_hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads = [lin(x).view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)
                 for lin in (self.linear_q, self.linear_k, self.linear_v)]
        a = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b, t, c)
        x = self.norm1(x + self.linear_o(a))
        return self.norm2(x + self.ffn_w2(F.gelu(self.ffn_w1(x))))


class CtcHead(nn.Module):
    """The head (see the module docstring). ``forward(states)``: (B, T, encoder_dim) -> logits (B, T, vocab);
    ``token_log_probs``: log-posteriors of chosen classes only, without materialising all of them at once."""

    def __init__(self, config: CtcHeadConfig):
        super().__init__()
        self.config = config
        c = config
        self.linear1 = nn.Linear(c.encoder_dim, c.proj_hidden)
        self.linear2 = nn.Linear(c.proj_hidden, c.ctc_hidden)
        self.blocks = nn.ModuleList(HeadBlock(c.ctc_hidden, c.ffn_hidden, c.num_heads) for _ in range(c.num_blocks))
        self.layer_norm = nn.LayerNorm(c.ctc_hidden)
        self.ctc_lo = nn.Linear(c.ctc_hidden, c.vocab_size)

    def trunk(self, states: torch.Tensor) -> torch.Tensor:
        """(B, T, encoder_dim) -> the normed features the classifier reads (B, T, ctc_hidden)."""
        x = F.gelu(self.linear2(F.gelu(self.linear1(states.to(self.linear1.weight.dtype)))))
        if self.config.use_blocks:
            for block in self.blocks:
                x = block(x)
        return self.layer_norm(x)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.ctc_lo(self.trunk(states))

    def token_log_probs(self, states: torch.Tensor, classes: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """Log-softmax over all classes of one utterance's states (T, encoder_dim), kept only for ``classes``
        (K,) int64: (T, K) fp32. The full (T, vocab) logits exist ``chunk`` frames at a time (the published
        vocabulary is 59264 classes: 356 MB for a 30 s window in fp32)."""
        x = self.trunk(states[None])[0]
        w, b = self.ctc_lo.weight, self.ctc_lo.bias
        out = []
        for i in range(0, x.shape[0], chunk):
            logits = F.linear(x[i:i + chunk], w, b).float()
            out.append(logits.index_select(1, classes) - torch.logsumexp(logits, dim=1, keepdim=True))
        return torch.cat(out) if out else x.new_zeros((0, classes.numel()), dtype=torch.float32)


def weights_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise CheckpointError(f"no aligner weights in {folder}: expected {' or '.join(WEIGHT_FILES)} (found: {found})")


_CONFIG_FIELDS = {"encoder_dim": "encoder_dim", "proj_hidden": "proj_hidden", "ctc_hidden": "ctc_hidden",
                  "num_blocks": "num_blocks", "num_heads": "num_heads", "ffn_hidden": "ffn_hidden",
                  "vocab_size": "vocab_size", "blank_id": "blank_id", "use_blocks": "use_blocks",
                  "start_bias_s": "start_bias_s", "end_bias_s": "end_bias_s"}


def _shape_facts(shapes: dict[str, tuple[int, ...]], path: Path) -> dict:
    """The dimensions the tensors themselves show (those present)."""
    facts = {}

    def dim(key, axis):
        s = shapes.get(key)
        return s[axis] if s is not None and len(s) > axis else None

    for field_, key, axis in (("proj_hidden", "linear1.weight", 0), ("encoder_dim", "linear1.weight", 1),
                              ("ctc_hidden", "linear2.weight", 0), ("vocab_size", "ctc_lo.weight", 0),
                              ("ffn_hidden", "blocks.0.ffn_w1.weight", 0)):
        if (v := dim(key, axis)) is not None:
            facts[field_] = (v, key)
    blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))}
    facts["num_blocks"] = (max(blocks) + 1 if blocks else 0, "blocks.N.*")
    return facts


def read_head_config(folder: Path, shapes: dict[str, tuple[int, ...]] | None = None) -> CtcHeadConfig:
    """The head's config from ``folder/config.json``, completed and checked against the tensor ``shapes``
    (from the weights file's header when not given)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in the aligner folder {folder} (a glm-asr-ctc head folder holds "
                              f"config.json and ctc_head.safetensors)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    if data.get("model_type", "ctc-head") != "ctc-head":
        raise CheckpointError(f"{path}: model_type is {data['model_type']!r}, not a CTC aligner head ('ctc-head'); "
                              f"pass the folder of a glm-asr-ctc head as aligner=")
    family = data.get("encoder_family", "glm-asr")
    if family != "glm-asr":
        raise CheckpointError(f"{path}: this head was trained on the {family!r} encoder (encoder_family), not on "
                              f"GLM-ASR's ('glm-asr')")
    shift = data.get("frame_shift_sec", FRAME_SHIFT_S)
    rate = data.get("frame_rate_hz")
    if not isinstance(shift, (int, float)) or abs(shift - FRAME_SHIFT_S) > 1e-6 or (rate is not None and rate != 50):
        raise CheckpointError(f"{path}: frame_shift_sec {shift!r} / frame_rate_hz {rate!r}: the GLM-ASR encoder gives "
                              f"one state per {FRAME_SHIFT_S * 1000:g} ms (50 per second)")
    if data.get("sample_rate", SAMPLE_RATE) != SAMPLE_RATE:
        raise CheckpointError(f"{path}: sample_rate {data['sample_rate']!r}; GLM-ASR's encoder takes 16000 Hz")
    if shapes is None:
        shapes = {k: e.shape for k, e in read_header(weights_file(folder)).items()}
    values = {}
    for key, field_ in _CONFIG_FIELDS.items():
        if key in data:
            values[field_] = data[key]
    for field_, (v, key) in _shape_facts(shapes, path).items():
        if field_ in values and values[field_] != v:
            raise CheckpointError(f"{path}: {field_} is {values[field_]!r} but the weights say {v} ({key}); the "
                                  f"config and the weights do not belong together")
        values.setdefault(field_, v)
    if "blank_id" not in values and "vocab_size" in values:
        values["blank_id"] = values["vocab_size"] - 1  # the training convention: blank after the last token
    for f in ("start_bias_s", "end_bias_s"):
        if f in values and isinstance(values[f], int) and not isinstance(values[f], bool):
            values[f] = float(values[f])
    if not isinstance(values.get("use_blocks", True), bool):
        raise CheckpointError(f"{path}: use_blocks must be true or false, got {values['use_blocks']!r}")
    try:
        cfg = CtcHeadConfig(**values)
    except TypeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    cfg.validate(str(path))
    return cfg


def check_tensors(path: Path, shapes: dict[str, tuple[int, ...]], cfg: CtcHeadConfig) -> None:
    """Missing, unexpected and mis-shaped tensors of a head file, named (CheckpointError)."""
    expected = cfg.expected_shapes()
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
        raise CheckpointError(f"{path} is not a glm-asr-ctc head of this config: {'; '.join(parts)}")
    for k, shape in expected.items():
        if tuple(shapes[k]) != shape:
            raise CheckpointError(f"{path}: tensor {k!r} has shape {list(shapes[k])}, expected {list(shape)} "
                                  f"(from config.json and the other tensors)")


def load_head(folder: str | Path, device: torch.device | str = "cpu") -> CtcHead:
    """The head in ``folder`` (config.json + ctc_head.safetensors or model.safetensors), checked, on ``device``
    in fp32, in eval mode without gradients."""
    from safetensors.torch import load_file

    folder = Path(folder)
    path = weights_file(folder)
    header = read_header(path)
    for key, entry in header.items():
        if not key.startswith(_IGNORED_PREFIXES) and entry.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {entry.dtype}, expected a float type")
    shapes = {k: e.shape for k, e in header.items() if not k.startswith(_IGNORED_PREFIXES)}
    cfg = read_head_config(folder, shapes)
    check_tensors(path, shapes, cfg)
    try:
        state = {k: v for k, v in load_file(str(path)).items() if not k.startswith(_IGNORED_PREFIXES)}
    except Exception as e:  # the header was fine, the data is not: report the file
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    with torch.device("meta"):
        head = CtcHead(cfg)
    head.load_state_dict({k: v.to(device=device, dtype=torch.float32) for k, v in state.items()}, strict=True,
                         assign=True)
    return head.eval().requires_grad_(False)


def head_config_for(encoder_dim: int, tokenizer_size: int, **fields) -> CtcHeadConfig:
    """A head config for a model whose encoder is ``encoder_dim`` wide and whose tokenizer has
    ``tokenizer_size`` tokens (blank = tokenizer_size, the training convention); ``fields`` override."""
    cfg = dataclasses.replace(CtcHeadConfig(), encoder_dim=encoder_dim, vocab_size=tokenizer_size + 1,
                              blank_id=tokenizer_size)
    return dataclasses.replace(cfg, **fields)
