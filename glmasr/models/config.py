"""Typed configuration of a GLM-ASR checkpoint, parsed from its ``config.json``.

Three dataclasses mirror the checkpoint's three sections: the top level (``GlmAsrConfig``), the Whisper-style
audio encoder (``audio_config`` -> ``AudioEncoderConfig``) and the Llama decoder (``text_config`` ->
``TextDecoderConfig``). A missing field takes the GLM-ASR-Nano-2512 default (``shared/spec/glmasr-model.md``,
section 1); a field whose value we cannot run (another activation, another RoPE type) is an error, never
silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from ..errors import ConfigError


def _rope_fields(section: dict, where: str) -> tuple[float, float | None]:
    """(rope_theta, partial_rotary_factor) from either the v4 flat keys or the v5 ``rope_parameters`` dict."""
    params = section.get("rope_parameters") or section.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}.rope_parameters must be an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", section.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", section.get("partial_rotary_factor"))
    return float(theta), (None if partial is None else float(partial))


def _check_positive(obj: Any, where: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and f.name != "pad_token_id" and value <= 0:
            raise ConfigError(f"{where}.{f.name} must be positive, got {value}")


@dataclass(frozen=True)
class AudioEncoderConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 20
    num_key_value_heads: int = 20
    head_dim: int = 64
    num_mel_bins: int = 128
    max_position_embeddings: int = 1500
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict) -> "AudioEncoderConfig":
        where = "audio_config"
        theta, partial = _rope_fields(d, where)
        heads = int(d.get("num_attention_heads", cls.num_attention_heads))
        hidden = int(d.get("hidden_size", cls.hidden_size))
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", cls.intermediate_size)),
            num_hidden_layers=int(d.get("num_hidden_layers", cls.num_hidden_layers)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            num_mel_bins=int(d.get("num_mel_bins", cls.num_mel_bins)),
            max_position_embeddings=int(d.get("max_position_embeddings", cls.max_position_embeddings)),
            rope_theta=theta,
            partial_rotary_factor=cls.partial_rotary_factor if partial is None else partial,
            layer_norm_eps=float(d.get("layer_norm_eps", cls.layer_norm_eps)),
            hidden_act=str(d.get("hidden_act", cls.hidden_act)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        where = "audio_config"
        _check_positive(self, where)
        if self.hidden_act not in ("gelu",):
            raise ConfigError(f"{where}.hidden_act {self.hidden_act!r} is not supported (only exact 'gelu')")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"{where}: the encoder is plain multi-head attention; num_key_value_heads "
                              f"({self.num_key_value_heads}) must equal num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(f"{where}: num_attention_heads * head_dim ({self.num_attention_heads} * {self.head_dim}) "
                              f"!= hidden_size ({self.hidden_size})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"{where}: rotary dim head_dim * partial_rotary_factor = {self.rotary_dim} must be even "
                              f"and in (0, head_dim]")


@dataclass(frozen=True)
class TextDecoderConfig:
    vocab_size: int = 59264
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = (59246, 59253, 59255)
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "TextDecoderConfig":
        where = "text_config"
        theta, partial = _rope_fields(d, where)
        if partial not in (None, 1.0):
            raise ConfigError(f"{where}: partial_rotary_factor {partial} is not supported for the decoder (only 1.0)")
        heads = int(d.get("num_attention_heads", cls.num_attention_heads))
        hidden = int(d.get("hidden_size", cls.hidden_size))
        eos = d.get("eos_token_id", list(cls.eos_token_ids))
        if eos is None:
            raise ConfigError(f"{where}.eos_token_id is null: the decoder needs at least one stop token id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        cfg = cls(
            vocab_size=int(d.get("vocab_size", cls.vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", cls.intermediate_size)),
            num_hidden_layers=int(d.get("num_hidden_layers", cls.num_hidden_layers)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", cls.max_position_embeddings)),
            rms_norm_eps=float(d.get("rms_norm_eps", cls.rms_norm_eps)),
            rope_theta=theta,
            hidden_act=str(d.get("hidden_act", cls.hidden_act)),
            attention_bias=bool(d.get("attention_bias", cls.attention_bias)),
            mlp_bias=bool(d.get("mlp_bias", cls.mlp_bias)),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        where = "text_config"
        _check_positive(self, where)
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}.hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias or self.mlp_bias:
            raise ConfigError(f"{where}: attention_bias/mlp_bias are not supported (GLM-ASR has none)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{where}.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.eos_token_ids:
            raise ConfigError(f"{where}.eos_token_id is empty")


@dataclass(frozen=True)
class GlmAsrConfig:
    audio: AudioEncoderConfig = field(default_factory=AudioEncoderConfig)
    text: TextDecoderConfig = field(default_factory=TextDecoderConfig)
    audio_token_id: int = 59260
    projector_hidden_act: str = "gelu"
    tie_word_embeddings: bool = True
    # Frame merge of the projector; hard-coded to 4 in the reference model and processor.
    merge_factor: int = 4

    @property
    def merged_width(self) -> int:
        return self.audio.hidden_size * self.merge_factor

    @property
    def projector_hidden(self) -> int:
        return self.text.hidden_size * 2

    @classmethod
    def from_dict(cls, d: dict) -> "GlmAsrConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "glmasr")
        if model_type != "glmasr":
            raise ConfigError(f"config model_type is {model_type!r}; expected 'glmasr' (GLM-ASR checkpoints)")
        audio = AudioEncoderConfig.from_dict(d.get("audio_config") or {})
        text = TextDecoderConfig.from_dict(d.get("text_config") or {})
        cfg = cls(
            audio=audio,
            text=text,
            audio_token_id=int(d.get("audio_token_id", cls.audio_token_id)),
            projector_hidden_act=str(d.get("projector_hidden_act", cls.projector_hidden_act)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", cls.tie_word_embeddings)),
        )
        if cfg.projector_hidden_act != "gelu":
            raise ConfigError(f"projector_hidden_act {cfg.projector_hidden_act!r} is not supported (only 'gelu')")
        if audio.intermediate_size != cfg.merged_width:
            raise ConfigError(f"audio_config.intermediate_size ({audio.intermediate_size}) must equal 4 x hidden_size "
                              f"({cfg.merged_width}): the projector reuses it as the merged frame width")
        if not 0 <= cfg.audio_token_id < text.vocab_size:
            raise ConfigError(f"audio_token_id {cfg.audio_token_id} is outside the vocabulary (size {text.vocab_size})")
        return cfg

    @classmethod
    def from_json_file(cls, path: str | Path) -> "GlmAsrConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
