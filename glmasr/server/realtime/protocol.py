"""The OpenAI Realtime transcription protocol as this server speaks it: client events parsed and validated, the
session configuration (OpenAI's GA and beta shapes, plus our extensions), and the server events rendered exactly as
the ``openai`` package's types (``openai.types.realtime``) define them.

Client events (JSON text frames; each may carry an ``event_id``, echoed in the ``error`` it causes):

- ``input_audio_buffer.append {audio}``: base64 audio in the session's format (strict base64: an invalid string is
  refused whole, nothing of it is used).
- ``input_audio_buffer.commit``: ends the turn now (an empty buffer: ``input_audio_buffer_commit_empty``).
- ``input_audio_buffer.clear``: drops the audio not yet committed.
- ``session.update {session}`` in the GA shape (answered by ``session.updated``)::

      {"type": "transcription",
       "audio": {"input": {
           "format": {"type": "audio/pcm", "rate": 24000} | {"type": "audio/pcmu"} | {"type": "audio/pcma"},
           "transcription": {"model", "language", "prompt", "keywords",
                             "interim_results": false, "partial_hop_ms": 1000, "context": true},  # extensions
           "turn_detection": null | {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                     "silence_duration_ms": 500, "idle_timeout_ms": null},
           "noise_reduction": null}},
       "include": []}

- ``transcription_session.update {session}`` in the beta shape (answered by ``transcription_session.updated``):
  ``input_audio_format`` ("pcm16" = 24 kHz, "g711_ulaw", "g711_alaw"), ``input_audio_params.sample_rate_hz``
  (NVIDIA Riva's field: 16000 selects 16 kHz PCM), ``input_audio_transcription {model, language, prompt, ...}``,
  ``turn_detection``, ``input_audio_noise_reduction`` (null), ``include``, ``modalities`` (["text"]).

An update changes only the fields it carries (at every level: ``{"transcription": {"language": "de"}}`` keeps the
prompt); ``turn_detection: null`` turns server VAD off (only a commit ends a turn), a ``null`` ``audio``, ``input``,
``format`` or ``transcription`` changes nothing (a transcription session always transcribes). An update with any
refused field is refused whole (an ``error`` naming the field in ``param``, e.g.
``session.audio.input.turn_detection.type``) and the session keeps its settings. Read-only fields a client may echo
back from ``session.created`` (``id``, ``object``, ``expires_at``, ``client_secret``) are ignored.

Our extensions (every OpenAI client may leave them out):

- 16 kHz PCM: ``format: {"type": "audio/pcm", "rate": 16000}`` (GA) or ``input_audio_params.sample_rate_hz: 16000``
  (beta): what vLLM- and Riva-style clients send; saves the client a resampler.
- ``transcription.keywords``: hotwords, folded into the instruction as ``POST /v1/audio/transcriptions`` does.
- ``transcription.interim_results: true``: stable partial text while a person speaks (off by default): a draft
  transcription every ``partial_hop_ms`` (250-10000, default 1000; every half of it until the turn has agreed
  text) of the turn so far; the text two consecutive drafts agree on goes out as ``delta`` events at once, and the
  turn's final decode continues from it, so nothing sent is ever retracted and the deltas still concatenate to the
  ``completed`` transcript.
- ``transcription.context`` (default true): the previous turn's transcript goes into the next turn's instruction
  (``glmasr.live.session.live_instruction``); false makes every turn's ``completed`` transcript exactly what
  ``transcribe()`` gives for that turn's samples with the session's prompt and keywords (the first turn's always is).
- ``transcription.word_timestamps: true`` (off by default; needs ``glmasr serve --aligner PATH``, else
  ``unsupported_value``): each ``completed`` event also carries ``words: [{word, start, end}]``, times in seconds
  from the session's first sample (the aligner's CTC times; ``glmasr.align``).

``transcription.model`` must be one of the served names (``GET /v1/models``; else ``model_not_found``). ``prompt``
replaces the model's instruction (as on the HTTP endpoint); ``language`` is an ISO-639-1 code (a region suffix such as
``en-US`` is accepted and dropped) and does not steer GLM-ASR. Refused with ``unsupported_value``: ``semantic_vad``
(no semantic turn model here: use ``server_vad``), ``noise_reduction`` other than null, ``include`` logprobs,
``delay`` (use ``interim_results``), several ``languages``, audio output. ``create_response`` and
``interrupt_response`` are accepted and have no effect (a transcription session creates no responses).

Server events (each with a unique ``event_id``): ``session.created`` (first, in the GA shape; in the beta shape
when the client sent the ``OpenAI-Beta: realtime=v1`` header), ``session.updated`` / ``transcription_session.updated``
(the whole effective session, in the shape of the update), ``input_audio_buffer.speech_started {item_id,
audio_start_ms}``, ``input_audio_buffer.speech_stopped {item_id, audio_end_ms}``, ``input_audio_buffer.committed
{item_id, previous_item_id}``, ``input_audio_buffer.cleared``, ``input_audio_buffer.timeout_triggered``,
``conversation.item.input_audio_transcription.delta {item_id, content_index: 0, delta}``,
``...completed {item_id, content_index: 0, transcript, usage: {"type": "duration", "seconds"}}``, ``...failed
{item_id, content_index: 0, error}`` and ``error {error: {type, code, message, param, event_id}}``.

Error codes of the client's own events (``type`` "invalid_request_error"): ``invalid_json``, ``event_too_large``,
``unknown_event_type``, ``unsupported_event`` (an OpenAI client event a transcription session has no use for, e.g.
``response.create``), ``missing_required_parameter``, ``invalid_type``, ``unknown_parameter``, ``invalid_value``,
``unsupported_value``, ``model_not_found``, ``invalid_audio`` (bad base64, a byte count that is not whole 16-bit
samples), ``input_audio_buffer_commit_empty``; the session's limits and the connection's are in ``routes``.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import re
import secrets
from dataclasses import dataclass, replace

from ..protocol import DEFAULT_MODEL_NAME, ISO_639_1, MAX_KEYWORDS, MAX_PROMPT_CHARS

PCM_RATES = (24000, 16000)  # 24 kHz is OpenAI's; 16 kHz our extension
FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
MIN_HOP_MS, MAX_HOP_MS, DEFAULT_HOP_MS = 250, 10000, 1000
MAX_EVENT_ID_CHARS = 256  # a client's event_id is echoed in errors: bounded
MAX_IDLE_TIMEOUT_MS = 3_600_000
LOGPROBS = "item.input_audio_transcription.logprobs"

# OpenAI client events a transcription session has no use for (they concern responses and conversation items)
UNSUPPORTED_EVENTS = ("response.create", "response.cancel", "conversation.item.create", "conversation.item.delete",
                      "conversation.item.retrieve", "conversation.item.truncate", "output_audio_buffer.clear")
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
FAILED = "conversation.item.input_audio_transcription.failed"
CLIENT_EVENTS = ("input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                 "session.update", "transcription_session.update")


class ProtocolError(Exception):
    """A client event refused: answered with an ``error`` event (the session stays usable)."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.event_id = event_id
        self.type = type


# ---- client events ----
@dataclass(frozen=True)
class Append:
    audio: bytes  # the decoded base64: raw bytes in the session's format
    event_id: str | None = None


@dataclass(frozen=True)
class Commit:
    event_id: str | None = None


@dataclass(frozen=True)
class Clear:
    event_id: str | None = None


@dataclass(frozen=True)
class SessionUpdate:
    session: dict  # the raw session object, validated by ``SessionConfig.updated``
    shape: str  # "ga" (session.update) or "beta" (transcription_session.update)
    event_id: str | None = None


ClientEvent = Append | Commit | Clear | SessionUpdate

_EVENT_KEYS = {"input_audio_buffer.append": {"audio"}, "input_audio_buffer.commit": set(),
               "input_audio_buffer.clear": set(), "session.update": {"session"},
               "transcription_session.update": {"session"}}


def parse_client_event(data: str | bytes, max_chars: int | None = None) -> ClientEvent:
    """One client message -> its event, or ``ProtocolError`` naming the problem (``event_id`` set when the message
    had a readable one). ``max_chars``: the longest message accepted (``event_too_large`` beyond)."""
    if max_chars is not None and len(data) > max_chars:
        raise ProtocolError(f"the event is {len(data)} bytes; this server accepts events of at most {max_chars} "
                            "bytes (send audio in smaller appends, e.g. 20-500 ms each)", "event_too_large")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"the message is not valid JSON: {str(e)[:200]}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"an event must be a JSON object, got {type(obj).__name__}", "invalid_json")
    event_id = obj.get("event_id")
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > MAX_EVENT_ID_CHARS):
        raise ProtocolError(f"event_id must be a string of at most {MAX_EVENT_ID_CHARS} characters", "invalid_value",
                            "event_id")
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("the event has no type", "missing_required_parameter", "type", event_id)
    if not isinstance(kind, str):
        raise ProtocolError(f"type must be a string, got {type(kind).__name__}", "invalid_type", "type", event_id)
    if kind in UNSUPPORTED_EVENTS:
        raise ProtocolError(f"{kind} is not supported in a transcription session (it has no responses or "
                            f"conversation items to act on); send one of {', '.join(CLIENT_EVENTS)}",
                            "unsupported_event", "type", event_id)
    if kind not in _EVENT_KEYS:
        raise ProtocolError(f"unknown event type {kind[:100]!r}; a transcription session accepts "
                            f"{', '.join(CLIENT_EVENTS)}", "unknown_event_type", "type", event_id)
    for key in obj:
        if key not in ("type", "event_id") and key not in _EVENT_KEYS[kind]:
            raise ProtocolError(f"unknown parameter {key[:100]!r} in {kind}", "unknown_parameter", key[:100],
                                event_id)
    if kind == "input_audio_buffer.append":
        audio = obj.get("audio")
        if audio is None:
            raise ProtocolError("input_audio_buffer.append needs audio (base64)", "missing_required_parameter",
                                "audio", event_id)
        if not isinstance(audio, str):
            raise ProtocolError(f"audio must be a base64 string, got {type(audio).__name__}", "invalid_type", "audio",
                                event_id)
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("audio is not valid base64 (standard alphabet, with padding); nothing of this "
                                "append was used", "invalid_audio", "audio", event_id) from None
        return Append(raw, event_id)
    if kind == "input_audio_buffer.commit":
        return Commit(event_id)
    if kind == "input_audio_buffer.clear":
        return Clear(event_id)
    session = obj.get("session")
    if session is None:
        raise ProtocolError(f"{kind} needs a session object", "missing_required_parameter", "session", event_id)
    if not isinstance(session, dict):
        raise ProtocolError(f"session must be an object, got {type(session).__name__}", "invalid_type", "session",
                            event_id)
    return SessionUpdate(session, "ga" if kind == "session.update" else "beta", event_id)


# ---- the session ----
@dataclass(frozen=True)
class TurnDetection:
    """``server_vad`` settings (``glmasr.live.turns.TurnSettings`` validates the ranges)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    idle_timeout_ms: int | None = None


@dataclass(frozen=True)
class SessionConfig:
    """The effective session. ``format``: "audio/pcm" (``rate`` 24000 or 16000), "audio/pcmu" or "audio/pcma"
    (``rate`` 8000); ``turn_detection`` None: only a commit ends a turn; ``shape``: the shape the client last used
    ("ga" or "beta"), in which the session is echoed."""

    model: str = DEFAULT_MODEL_NAME
    format: str = "audio/pcm"
    rate: int = 24000
    language: str | None = None
    prompt: str | None = None
    keywords: tuple[str, ...] = ()
    turn_detection: TurnDetection | None = TurnDetection()
    interim_results: bool = False
    partial_hop_ms: int = DEFAULT_HOP_MS
    context: bool = True
    word_timestamps: bool = False
    shape: str = "ga"

    def updated(self, update: SessionUpdate, names: dict[str, str], word_timestamps: bool = False
                ) -> "SessionConfig":
        """This session with ``update`` applied (``names``: lower-case served name -> name; ``word_timestamps``:
        whether the server can give word times, i.e. has an aligner); ``ProtocolError`` naming the first refused
        field (nothing is applied then)."""
        try:
            if update.shape == "ga":
                out = _apply_ga(self, update.session, names)
            else:
                out = _apply_beta(self, update.session, names)
        except ProtocolError as e:
            e.event_id = update.event_id
            raise
        out = replace(out, shape=update.shape)
        if out.word_timestamps and not word_timestamps:
            p = "session.audio.input.transcription" if update.shape == "ga" else "session.input_audio_transcription"
            raise ProtocolError("word_timestamps needs word times, and this server has no aligner: start it with "
                                "glmasr serve --aligner PATH (a glm-asr-ctc head folder)", "unsupported_value",
                                f"{p}.word_timestamps", update.event_id)
        try:
            out.live_settings()  # the session's own validation (turn settings' ranges), as the session will see them
        except ValueError as e:
            td = "session.audio.input.turn_detection" if update.shape == "ga" else "session.turn_detection"
            m = re.search(r"turn_detection\.(\w+)", str(e))
            raise ProtocolError(str(e), "invalid_value", f"{td}.{m.group(1)}" if m else td,
                                update.event_id) from None
        return out

    def input_format(self):
        """The ``glmasr.audio.stream.InputFormat`` of the appended audio."""
        from ...audio.stream import InputFormat

        return InputFormat.parse(kind=self.format, rate=self.rate)

    def live_settings(self):
        """The ``glmasr.live.session.LiveSettings`` of this session (ValueError: a turn setting out of range)."""
        from ...live.session import LiveSettings
        from ...live.turns import TurnSettings

        td = self.turn_detection
        turns = None if td is None else TurnSettings(
            threshold=td.threshold, prefix_padding_ms=td.prefix_padding_ms,
            silence_duration_ms=td.silence_duration_ms, idle_timeout_ms=td.idle_timeout_ms)
        return LiveSettings(prompt=self.prompt, language=self.language, keywords=self.keywords, turn_detection=turns,
                            partials=self.interim_results, partial_hop_s=self.partial_hop_ms / 1000.0,
                            context=self.context, word_timestamps=self.word_timestamps)

    # ---- echo ----
    def _transcription(self) -> dict:
        return {"model": self.model, "language": self.language, "prompt": self.prompt,
                "keywords": list(self.keywords), "interim_results": self.interim_results,
                "partial_hop_ms": self.partial_hop_ms, "context": self.context,
                "word_timestamps": self.word_timestamps}

    def _turns(self) -> dict | None:
        td = self.turn_detection
        if td is None:
            return None
        return {"type": "server_vad", "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
                "silence_duration_ms": td.silence_duration_ms, "idle_timeout_ms": td.idle_timeout_ms}

    def to_ga(self, session_id: str) -> dict:
        """The session as ``session.created`` / ``session.updated`` carry it (GA shape)."""
        fmt = {"type": self.format, "rate": self.rate} if self.format == "audio/pcm" else {"type": self.format}
        return {"type": "transcription", "object": "realtime.transcription_session", "id": session_id,
                "audio": {"input": {"format": fmt, "transcription": self._transcription(),
                                    "turn_detection": self._turns(), "noise_reduction": None}},
                "include": []}

    def to_beta(self, session_id: str) -> dict:
        """The session as ``transcription_session.updated`` carries it (beta shape)."""
        beta = {v: k for k, v in BETA_FORMATS.items()}[self.format]
        return {"id": session_id, "object": "realtime.transcription_session", "input_audio_format": beta,
                "input_audio_params": {"sample_rate_hz": self.rate, "num_channels": 1},
                "input_audio_transcription": self._transcription(), "turn_detection": self._turns(),
                "input_audio_noise_reduction": None, "include": [], "modalities": ["text"], "client_secret": None}


_READ_ONLY = ("id", "object", "expires_at", "client_secret")


def _obj(value, param: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"{param} must be an object or null, got {type(value).__name__}", "invalid_type", param)
    return value


def _keys(obj: dict, allowed, param: str) -> None:
    for key in obj:
        if key not in allowed:
            raise ProtocolError(f"unknown parameter {param}.{str(key)[:100]}; known: {', '.join(allowed)}",
                                "unknown_parameter", f"{param}.{str(key)[:100]}")


def _int(value, param: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ProtocolError(f"{param} must be an integer, got {value!r}", "invalid_type", param)
    if not lo <= value <= hi:
        raise ProtocolError(f"{param} must be in [{lo}, {hi}], got {value!r}", "invalid_value", param)
    return int(value)


def _apply_ga(cfg: SessionConfig, s: dict, names) -> SessionConfig:
    _keys(s, ("type", "audio", "include", *_READ_ONLY), "session")
    kind = s.get("type", "transcription")
    if kind == "realtime":
        raise ProtocolError("this endpoint serves transcription sessions (intent=transcription): session.type must "
                            "be 'transcription', not 'realtime' (no model responses here)", "unsupported_value",
                            "session.type")
    if kind != "transcription":
        raise ProtocolError(f"session.type must be 'transcription', got {kind!r}", "invalid_value", "session.type")
    cfg = _include(cfg, s.get("include"), "session.include")
    audio = _obj(s.get("audio"), "session.audio")
    if audio is None:
        return cfg
    _keys(audio, ("input", "output"), "session.audio")
    if audio.get("output") is not None:
        raise ProtocolError("a transcription session has no audio output; leave session.audio.output out",
                            "unsupported_value", "session.audio.output")
    inp = _obj(audio.get("input"), "session.audio.input")
    if inp is None:
        return cfg
    p = "session.audio.input"
    _keys(inp, ("format", "transcription", "turn_detection", "noise_reduction"), p)
    fmt = _obj(inp.get("format"), f"{p}.format")
    if fmt is not None:
        _keys(fmt, ("type", "rate"), f"{p}.format")
        kind = fmt.get("type", "audio/pcm")
        if kind not in FORMATS:
            raise ProtocolError(f"{p}.format.type must be one of {', '.join(FORMATS)}, got {kind!r}",
                                "invalid_value", f"{p}.format.type")
        cfg = replace(cfg, format=kind, rate=_rate(kind, fmt.get("rate"), f"{p}.format.rate"))
    if "transcription" in inp:
        cfg = _transcription(cfg, _obj(inp["transcription"], f"{p}.transcription"), f"{p}.transcription", names)
    if "turn_detection" in inp:
        cfg = _turn_detection(cfg, inp["turn_detection"], f"{p}.turn_detection")
    _noise_reduction(inp.get("noise_reduction"), f"{p}.noise_reduction")
    return cfg


def _apply_beta(cfg: SessionConfig, s: dict, names) -> SessionConfig:
    _keys(s, ("input_audio_format", "input_audio_params", "input_audio_transcription", "turn_detection",
              "input_audio_noise_reduction", "include", "modalities", *_READ_ONLY), "session")
    cfg = _include(cfg, s.get("include"), "session.include")
    modalities = s.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or any(m not in ("text", "audio") for m in modalities):
            raise ProtocolError("session.modalities must be a list of 'text' / 'audio'", "invalid_value",
                                "session.modalities")
        if "audio" in modalities:
            raise ProtocolError("a transcription session answers in text only: session.modalities must be ['text']",
                                "unsupported_value", "session.modalities")
    kind = cfg.format
    if s.get("input_audio_format") is not None:
        beta = s["input_audio_format"]
        if beta not in BETA_FORMATS:
            raise ProtocolError(f"session.input_audio_format must be one of {', '.join(BETA_FORMATS)}, got "
                                f"{beta!r}", "invalid_value", "session.input_audio_format")
        kind = BETA_FORMATS[beta]
    rate = None
    params = _obj(s.get("input_audio_params"), "session.input_audio_params")
    if params is not None:
        _keys(params, ("sample_rate_hz", "num_channels"), "session.input_audio_params")
        rate = params.get("sample_rate_hz")
        channels = params.get("num_channels")
        if channels is not None and (isinstance(channels, bool) or channels != 1):
            raise ProtocolError(f"session.input_audio_params.num_channels must be 1 (mono), got {channels!r}",
                                "unsupported_value", "session.input_audio_params.num_channels")
    if kind != cfg.format or rate is not None:
        cfg = replace(cfg, format=kind, rate=_rate(kind, rate, "session.input_audio_params.sample_rate_hz"))
    if "input_audio_transcription" in s:
        cfg = _transcription(cfg, _obj(s["input_audio_transcription"], "session.input_audio_transcription"),
                             "session.input_audio_transcription", names)
    if "turn_detection" in s:
        cfg = _turn_detection(cfg, s["turn_detection"], "session.turn_detection")
    _noise_reduction(s.get("input_audio_noise_reduction"), "session.input_audio_noise_reduction")
    return cfg


def _rate(kind: str, rate, param: str) -> int:
    if kind == "audio/pcm":
        if rate is None:
            return 24000
        if isinstance(rate, bool) or rate not in PCM_RATES:
            raise ProtocolError(f"{param} must be 24000 (or 16000, this server's extension) for audio/pcm, got "
                                f"{rate!r}", "unsupported_value", param)
        return int(rate)
    if rate is not None and (isinstance(rate, bool) or rate != 8000):
        raise ProtocolError(f"{param}: G.711 ({kind}) is 8000 Hz, got {rate!r}", "unsupported_value", param)
    return 8000


def _include(cfg: SessionConfig, include, param: str) -> SessionConfig:
    if include is None:
        return cfg
    if not isinstance(include, list):
        raise ProtocolError(f"{param} must be a list", "invalid_type", param)
    for item in include:
        if item == LOGPROBS:
            raise ProtocolError(f"{LOGPROBS} is not supported: transcription events carry no log probabilities",
                                "unsupported_value", param)
        raise ProtocolError(f"unknown {param} entry {str(item)[:100]!r}", "invalid_value", param)
    return cfg


def _noise_reduction(value, param: str) -> None:
    if value is not None:
        raise ProtocolError(f"{param}: this server has no noise reduction; send null or leave it out",
                            "unsupported_value", param)


def _transcription(cfg: SessionConfig, t: dict | None, p: str, names) -> SessionConfig:
    if t is None:  # a transcription session always transcribes: null changes nothing
        return cfg
    _keys(t, ("model", "language", "prompt", "keywords", "interim_results", "partial_hop_ms", "context", "word_timestamps", "delay",
              "languages"), p)
    out = {}
    if "model" in t:
        model = t["model"]
        if model is None:
            out["model"] = names.get(DEFAULT_MODEL_NAME, next(iter(names.values()), DEFAULT_MODEL_NAME))
        elif not isinstance(model, str):
            raise ProtocolError(f"{p}.model must be a string", "invalid_type", f"{p}.model")
        elif model.strip().lower() not in names:
            raise ProtocolError(f"the model {model[:100]!r} does not exist on this server; it serves "
                                f"{', '.join(names.values())}", "model_not_found", f"{p}.model")
        else:
            out["model"] = names[model.strip().lower()]
    if t.get("delay") is not None:
        raise ProtocolError(f"{p}.delay is not supported; for partial text set {p}.interim_results: true (and "
                            f"{p}.partial_hop_ms)", "unsupported_value", f"{p}.delay")
    language = t.get("language") if "language" in t else cfg.language
    languages = t.get("languages")
    if languages is not None:
        if not isinstance(languages, list) or len(languages) > 1:
            raise ProtocolError(f"{p}.languages: pass at most one language (GLM-ASR identifies the language "
                                "itself)", "unsupported_value", f"{p}.languages")
        if languages:
            language = languages[0]
    if "language" in t or languages:
        out["language"] = _language(language, f"{p}.language")
    if "prompt" in t:
        prompt = t["prompt"]
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ProtocolError(f"{p}.prompt must be a string", "invalid_type", f"{p}.prompt")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise ProtocolError(f"{p}.prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are "
                                    "accepted", "invalid_value", f"{p}.prompt")
            if "\x00" in prompt:
                raise ProtocolError(f"{p}.prompt must not contain NUL characters", "invalid_value", f"{p}.prompt")
            prompt = prompt if prompt.strip() else None
        out["prompt"] = prompt
    if "keywords" in t:
        out["keywords"] = _keywords(t["keywords"], f"{p}.keywords")
    prompt_len = len(out.get("prompt", cfg.prompt) or "") + sum(len(k) for k in out.get("keywords", cfg.keywords))
    if prompt_len > MAX_PROMPT_CHARS:
        raise ProtocolError(f"{p}: prompt and keywords together exceed {MAX_PROMPT_CHARS} characters",
                            "invalid_value", f"{p}.keywords")
    if t.get("interim_results") is not None:
        if not isinstance(t["interim_results"], bool):
            raise ProtocolError(f"{p}.interim_results must be true or false", "invalid_type",
                                f"{p}.interim_results")
        out["interim_results"] = t["interim_results"]
    if t.get("context") is not None:
        if not isinstance(t["context"], bool):
            raise ProtocolError(f"{p}.context must be true or false", "invalid_type", f"{p}.context")
        out["context"] = t["context"]
    if t.get("word_timestamps") is not None:
        if not isinstance(t["word_timestamps"], bool):
            raise ProtocolError(f"{p}.word_timestamps must be true or false", "invalid_type",
                                f"{p}.word_timestamps")
        out["word_timestamps"] = t["word_timestamps"]
    if t.get("partial_hop_ms") is not None:
        out["partial_hop_ms"] = _int(t["partial_hop_ms"], f"{p}.partial_hop_ms", MIN_HOP_MS, MAX_HOP_MS)
    return replace(cfg, **out)


def _language(value, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{param} must be a string", "invalid_type", param)
    code = value.strip().lower()
    if not code:
        return None  # OpenAI's own default is ""
    primary = code.replace("_", "-").split("-")[0]
    if primary not in ISO_639_1:
        raise ProtocolError(f"{param} must be an ISO-639-1 code such as 'en' or 'zh', got {value[:50]!r}",
                            "invalid_value", param)
    return primary


def _keywords(value, param: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ProtocolError(f"{param} must be a list of strings", "invalid_type", param)
    if len(value) > MAX_KEYWORDS:
        raise ProtocolError(f"{len(value)} keywords; at most {MAX_KEYWORDS} are accepted", "invalid_value", param)
    out = []
    for kw in value:
        if not isinstance(kw, str) or not kw.strip() or "\x00" in kw:
            raise ProtocolError(f"{param} entries must be non-empty strings", "invalid_value", param)
        out.append(kw.strip())
    return tuple(out)


def _turn_detection(cfg: SessionConfig, td, p: str) -> SessionConfig:
    if td is None:
        return replace(cfg, turn_detection=None)
    if not isinstance(td, dict):
        raise ProtocolError(f"{p} must be an object or null", "invalid_type", p)
    _keys(td, ("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms",
               "create_response", "interrupt_response", "eagerness"), p)
    kind = td.get("type") or "server_vad"
    if kind == "semantic_vad":
        raise ProtocolError(f"{p}.type semantic_vad is not supported (no semantic turn model here); use server_vad "
                            "(voice activity and silence_duration_ms) or null (the client commits)",
                            "unsupported_value", f"{p}.type")
    if kind != "server_vad":
        raise ProtocolError(f"{p}.type must be 'server_vad' (or turn_detection null), got {kind!r}",
                            "invalid_value", f"{p}.type")
    if td.get("eagerness") is not None:
        raise ProtocolError(f"{p}.eagerness belongs to semantic_vad, which is not supported", "unsupported_value",
                            f"{p}.eagerness")
    for key in ("create_response", "interrupt_response"):
        if td.get(key) is not None and not isinstance(td[key], bool):
            raise ProtocolError(f"{p}.{key} must be true or false", "invalid_type", f"{p}.{key}")
    base = cfg.turn_detection or TurnDetection()
    out = {}
    if td.get("threshold") is not None:
        t = td["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ProtocolError(f"{p}.threshold must be a number, got {t!r}", "invalid_type", f"{p}.threshold")
        if not 0.0 <= t <= 1.0:
            raise ProtocolError(f"{p}.threshold must be in [0, 1], got {t!r}", "invalid_value", f"{p}.threshold")
        out["threshold"] = float(t)
    if td.get("prefix_padding_ms") is not None:
        out["prefix_padding_ms"] = _int(td["prefix_padding_ms"], f"{p}.prefix_padding_ms", 0, 10000)
    if td.get("silence_duration_ms") is not None:
        out["silence_duration_ms"] = _int(td["silence_duration_ms"], f"{p}.silence_duration_ms", 0, 10000)
    if "idle_timeout_ms" in td:
        v = td["idle_timeout_ms"]
        out["idle_timeout_ms"] = None if v is None else _int(v, f"{p}.idle_timeout_ms", 1, MAX_IDLE_TIMEOUT_MS)
    return replace(cfg, turn_detection=replace(base, **out))


# ---- server events ----
_PREFIX = secrets.token_hex(4)
_COUNTER = itertools.count(1)


def new_event_id() -> str:
    """A unique server event id (this process)."""
    return f"event_{_PREFIX}{next(_COUNTER):x}"


def new_session_id() -> str:
    return f"sess_{secrets.token_hex(12)}"


def dumps(event: dict) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def session_created(cfg: SessionConfig, session_id: str) -> dict:
    session = cfg.to_beta(session_id) if cfg.shape == "beta" else cfg.to_ga(session_id)
    return {"type": "session.created", "event_id": new_event_id(), "session": session}


def session_updated(cfg: SessionConfig, session_id: str) -> dict:
    """``session.updated`` (GA) or ``transcription_session.updated`` (beta), as the client's update was shaped."""
    if cfg.shape == "beta":
        return {"type": "transcription_session.updated", "event_id": new_event_id(),
                "session": cfg.to_beta(session_id)}
    return {"type": "session.updated", "event_id": new_event_id(), "session": cfg.to_ga(session_id)}


def error(message: str, code: str | None, param: str | None = None, event_id: str | None = None,
          type: str = "invalid_request_error") -> dict:
    return {"type": "error", "event_id": new_event_id(),
            "error": {"type": type, "code": code, "message": message, "param": param, "event_id": event_id}}


def error_from(e: ProtocolError) -> dict:
    return error(e.message, e.code, e.param, e.event_id, e.type)


def speech_started(item_id: str, audio_start_ms: int) -> dict:
    return {"type": "input_audio_buffer.speech_started", "event_id": new_event_id(), "item_id": item_id,
            "audio_start_ms": int(audio_start_ms)}


def speech_stopped(item_id: str, audio_end_ms: int) -> dict:
    return {"type": "input_audio_buffer.speech_stopped", "event_id": new_event_id(), "item_id": item_id,
            "audio_end_ms": int(audio_end_ms)}


def committed(item_id: str, previous_item_id: str | None) -> dict:
    return {"type": "input_audio_buffer.committed", "event_id": new_event_id(), "item_id": item_id,
            "previous_item_id": previous_item_id}


def cleared() -> dict:
    return {"type": "input_audio_buffer.cleared", "event_id": new_event_id()}


def timeout_triggered(item_id: str, audio_start_ms: int, audio_end_ms: int) -> dict:
    return {"type": "input_audio_buffer.timeout_triggered", "event_id": new_event_id(), "item_id": item_id,
            "audio_start_ms": int(audio_start_ms), "audio_end_ms": int(audio_end_ms)}


def delta(item_id: str, text: str) -> dict:
    return {"type": DELTA, "event_id": new_event_id(),
            "item_id": item_id, "content_index": 0, "delta": text}


def completed(item_id: str, transcript: str, seconds: float, words=None) -> dict:
    """``words`` (our extension, with ``word_timestamps``): (word, start, end) of each word, seconds of the session."""
    out = {"type": COMPLETED, "event_id": new_event_id(),
           "item_id": item_id, "content_index": 0, "transcript": transcript,
           "usage": {"type": "duration", "seconds": float(seconds)}}
    if words is not None:
        out["words"] = [{"word": w.word, "start": round(float(w.start), 3), "end": round(float(w.end), 3)}
                        for w in words]
    return out


def failed(item_id: str, code: str | None, message: str, type: str = "server_error") -> dict:
    return {"type": FAILED, "event_id": new_event_id(),
            "item_id": item_id, "content_index": 0,
            "error": {"type": type, "code": code, "message": message, "param": None}}


def render(ev) -> dict:
    """A ``glmasr.live.events`` event -> its server event (by the event's class name, so the wire does not depend on
    where the class lives)."""
    name = type(ev).__name__
    if name == "SpeechStarted":
        return speech_started(ev.item_id, ev.audio_start_ms)
    if name == "SpeechStopped":
        return speech_stopped(ev.item_id, ev.audio_end_ms)
    if name == "Committed":
        return committed(ev.item_id, ev.previous_item_id)
    if name == "Cleared":
        return cleared()
    if name == "TranscriptDelta":
        return delta(ev.item_id, ev.delta)
    if name == "TranscriptCompleted":
        usage = ev.usage
        seconds = usage.get("seconds", 0.0) if isinstance(usage, dict) else float(usage)
        return completed(ev.item_id, ev.transcript, seconds, ev.words)
    if name == "TranscriptFailed":
        return failed(ev.item_id, ev.code, ev.message)
    if name in ("TimeoutTriggered", "IdleTimeout"):
        return timeout_triggered(ev.item_id, ev.audio_start_ms, ev.audio_end_ms)
    raise TypeError(f"no server event for {name}")
