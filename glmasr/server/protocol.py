"""The wire format of the OpenAI transcription API as this server speaks it: the error envelope, the parsed and
validated request, and the stream events (the response bodies are rendered by ``glmasr.writers.render_openai``).

Request fields (multipart/form-data, as the ``openai`` client sends them: list fields as ``name[]``, booleans as
"true"/"false", fields left out are not sent):

- ``file`` (required): the audio bytes; the format is detected from the bytes (wav, flac, ogg/vorbis/opus, mp3:
  whatever libsndfile reads; mp4/m4a/mov, webm/mkv and ADTS aac through PyAV, the ``containers`` extra), never from
  the file name or content type, so a nameless ``upload`` with ``application/octet-stream`` works.
- ``model`` (required): one of the served names (``GET /v1/models``); anything else is a 404.
- ``prompt``: the model's instruction text. GLM-ASR is prompted with an instruction ("Please transcribe this audio
  into text" by default); ``prompt`` *replaces* it, exactly like ``glmasr --prompt`` and ``DecodeOptions.prompt``.
- ``keywords[]``: hotwords, folded into the instruction (``build_instruction``): the instruction (``prompt`` or the
  default) followed by a new line and ``Hotwords: kw1, kw2, ...``. Each keyword is stripped; empty ones are refused.
- ``language``: an ISO-639-1 code, validated (anything else is a 400) and echoed in ``verbose_json``. It does *not*
  steer the model: GLM-ASR-Nano-2512 has no language token and recognises the language itself; to steer it, say so
  in ``prompt``. Without it ``verbose_json`` reports ``"unknown"`` (the engine does no language identification).
- ``temperature``: absent or 0 = greedy decoding, the only decoding the engine implements; any other value is a 400.
- ``response_format``: ``json`` (default), ``text``, ``srt``, ``vtt``, ``verbose_json``.
- ``timestamp_granularities[]``: ``segment`` is accepted with every format (as OpenAI does; only
  ``verbose_json`` carries segments); ``word`` needs ``verbose_json`` (a 400 otherwise, as OpenAI answers) and a
  server started with an aligner (``glmasr serve --aligner PATH``; else a 400 naming both): the answer then has
  ``words`` (word, start, end: every segment's words in order, times from the aligner), and ``segments`` only when
  ``segment`` is asked for too, as OpenAI answers.
- ``stream``: "true" sends server-sent events (``transcript.text.delta`` ..., ``transcript.text.done``,
  ``[DONE]``); with ``response_format`` json or text only.
- ``chunking_strategy``: ``auto`` or ``{"type": "server_vad", ...}`` = voice activity detection
  (``glmasr.audio.vad``, Silero VAD, run on the CPU in the request's worker thread): speech regions merged into
  pieces, one prompt and one segment (with its true times) each; a recording with no speech gives an empty text.
  The pieces are speech-shaped, at most ``SUBTITLE_MAX_SEGMENT_S`` (6 s) and cut at pauses
  (``vad.segment_options``), for ``srt``, ``vtt`` and ``verbose_json``; packed into pieces of up to 30 s for
  ``json`` and ``text``. ``server_vad``'s ``threshold`` (0-1, default 0.5), ``silence_duration_ms`` (the silence
  that ends a region, default 500) and ``prefix_padding_ms`` (the padding before each region, default 200, or 100
  for speech-shaped pieces; after it too with 30 s pieces) are passed on; ``auto``
  uses the defaults. Needs the ``vad`` extra (else a 400 saying so). Left out: ``srt``, ``vtt`` and
  ``verbose_json`` get the same speech-shaped segments (as ``auto``; if the VAD's weights are missing, 30 s windows
  instead), ``json`` and ``text`` the reference segmentation (non-overlapping 30 s windows packed into prompts of
  up to 21 windows: token-exact with transformers).
- ``include[]`` (logprobs), ``languages[]``, ``known_speaker_*``: not implemented, a 400; any other field: a 400.

Segments: ``verbose_json``'s segments are the result's own ``Transcription.segments``: one per prompt, spanning
exactly the audio of that prompt (a speech piece; with 30 s windows a window group, whose times are the bounds
of the audio, not of the speech in it), with that prompt's text and tokens. The SRT/VTT cues are cut from them by
``glmasr.writers`` (default ``CueOptions``: lines of 42 characters; at word times into cues of at most 2 lines
and 7 s where the segment has words). Of the fields the OpenAI
segment type requires, ``avg_logprob`` is the engine's (``Segment.avg_logprob``: the mean natural-log probability
of the segment's tokens, each under its greedy step's softmax; the stop token is not counted; 0.0 for a segment
with no token); ``no_speech_prob`` is not computed (0.0); ``compression_ratio`` is the engine's (text bytes over
zlib-compressed bytes, as Whisper computes it); ``temperature`` is 0.0 (greedy); ``seek`` is the start in 10 ms
frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..checkpoint.tokenizer import build_instruction
from ..writers import SUBTITLE_MAX_SEGMENT_S

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# formats whose segments are seen (cues, segment times): speech-shaped segments by default
SPEECH_SHAPED_FORMATS = ("srt", "vtt", "verbose_json")
DEFAULT_MODEL_NAME = "glm-asr-nano-2512"
MAX_PROMPT_CHARS = 4000
MAX_KEYWORDS = 100
MAX_CHUNKING_CHARS = 1024  # a chunking_strategy object has four short fields

# ISO 639-1 (the two-letter codes)
ISO_639_1 = frozenset("""
aa ab ae af ak am an ar as av ay az ba be bg bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de dv dz ee el en eo
es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv ka
kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng
nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su
sv sw ta te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu
""".split())

_KNOWN_FIELDS = {"file", "model", "prompt", "keywords[]", "keywords", "language", "temperature", "response_format",
                 "timestamp_granularities[]", "timestamp_granularities", "stream", "chunking_strategy",
                 "chunking_strategy[type]"}
_UNSUPPORTED_FIELDS = {
    "include[]": "include[] (logprobs) is not implemented: per-token log probabilities are not returned (each "
                 "verbose_json segment has its avg_logprob)",
    "languages[]": "languages[] is not supported; pass one ISO-639-1 code as language",
    "known_speaker_names[]": "speaker diarization (known_speaker_names[]) is not implemented",
    "known_speaker_references[]": "speaker diarization (known_speaker_references[]) is not implemented",
}


class APIError(Exception):
    """An error answered in the OpenAI envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class TranscriptionRequest:
    """A validated request (the file still undecoded: ``file`` is the spooled upload, a binary file object of
    ``size`` bytes, which the caller closes)."""

    file: object
    size: int
    filename: str
    model: str
    prompt: str | None = None
    keywords: list[str] = field(default_factory=list)
    language: str | None = None
    response_format: str = "json"
    stream: bool = False
    granularities: list[str] = field(default_factory=list)
    vad: dict | None = None  # chunking_strategy: keyword arguments of glmasr.audio.vad.speech_regions; None = not sent

    @property
    def instruction(self) -> str | None:
        return build_instruction(self.prompt, self.keywords)

    @property
    def words(self) -> bool:
        """Word times asked for (``timestamp_granularities[]=word``)."""
        return "word" in self.granularities

    @property
    def speech_shaped(self) -> bool:
        """Segments follow the speech (VAD pieces of at most ``max_segment_s``) without chunking_strategy."""
        return self.response_format in SPEECH_SHAPED_FORMATS

    @property
    def max_segment_s(self) -> float | None:
        """``DecodeOptions.max_segment_s`` of VAD pieces: the subtitle default for the formats whose segments are
        seen, else None (pieces of up to 30 s)."""
        return SUBTITLE_MAX_SEGMENT_S if self.speech_shaped else None


def _text_field(form, name: str) -> str | None:
    values = form.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"{name} was sent {len(values)} times; send it once", name)
    value = values[0]
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a text field, not a file upload", name, "invalid_type")
    return value


def _list_field(form, name: str) -> list[str]:
    values = form.getlist(name) + form.getlist(name.removesuffix("[]"))
    for v in values:
        if not isinstance(v, str):
            raise bad_request(f"{name} must be text fields, not file uploads", name, "invalid_type")
    return values


def _bool_field(form, name: str) -> bool:
    raw = _text_field(form, name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0", ""):
        return False
    raise bad_request(f"{name} must be true or false, got {raw!r}", name, "invalid_type")


def parse_form(form, file, size: int, filename: str) -> TranscriptionRequest:
    """Validate every field but the file's content (``file``: the upload's binary file object, ``size`` bytes)."""
    for key in form.keys():
        if key in _UNSUPPORTED_FIELDS:
            raise bad_request(_UNSUPPORTED_FIELDS[key], key, "unsupported_parameter")
        if key not in _KNOWN_FIELDS and not key.startswith("chunking_strategy["):
            raise bad_request(f"unknown parameter {key!r}", key, "unknown_parameter")
    model = _text_field(form, "model")
    if model is None or not model.strip():
        raise bad_request("you must provide a model parameter", "model", "missing_required_parameter")
    prompt = _text_field(form, "prompt")
    if prompt is not None:
        if len(prompt) > MAX_PROMPT_CHARS:
            raise bad_request(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are accepted",
                              "prompt")
        if "\x00" in prompt:
            raise bad_request("prompt must not contain NUL characters", "prompt")
        prompt = prompt if prompt.strip() else None
    keywords = []
    for kw in _list_field(form, "keywords[]"):
        kw = kw.strip()
        if not kw or "\x00" in kw:
            raise bad_request("keywords[] entries must be non-empty text", "keywords")
        keywords.append(kw)
    if len(keywords) > MAX_KEYWORDS:
        raise bad_request(f"{len(keywords)} keywords; at most {MAX_KEYWORDS} are accepted", "keywords")
    if sum(len(k) for k in keywords) + len(prompt or "") > MAX_PROMPT_CHARS:
        raise bad_request(f"prompt and keywords together exceed {MAX_PROMPT_CHARS} characters", "keywords")
    language = _text_field(form, "language")
    if language is not None:
        language = language.strip().lower()
        if language not in ISO_639_1:
            raise bad_request(f"language must be an ISO-639-1 code such as 'en' or 'zh', got {language!r}",
                              "language", "invalid_language")
    temperature = _text_field(form, "temperature")
    if temperature is not None:
        try:
            t = float(temperature)
        except ValueError:
            raise bad_request(f"temperature must be a number, got {temperature!r}", "temperature",
                              "invalid_type") from None
        if t != 0.0:
            raise bad_request(f"temperature={temperature} is not supported: this server decodes greedily; send 0 "
                              "or leave temperature out", "temperature", "unsupported_value")
    response_format = _text_field(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise bad_request(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}",
                          "response_format")
    granularities = _list_field(form, "timestamp_granularities[]")
    for g in granularities:
        if g not in ("segment", "word"):
            raise bad_request(f"timestamp_granularities[] entries must be 'segment' or 'word', got {g!r}",
                              "timestamp_granularities")
    if "word" in granularities and response_format != "verbose_json":
        raise bad_request("timestamp_granularities[]=word needs response_format=verbose_json",
                          "timestamp_granularities")
    stream = _bool_field(form, "stream")
    if stream and response_format not in ("json", "text"):
        raise bad_request(f"stream=true sends transcript.text events; response_format={response_format} cannot be "
                          "streamed (use json or text, or stream=false)", "stream", "unsupported_value")
    vad = _chunking(form)
    return TranscriptionRequest(file=file, size=size, filename=filename, model=model.strip(), prompt=prompt,
                                keywords=keywords, language=language, response_format=response_format,
                                stream=stream, granularities=granularities, vad=vad)


_VAD_PARAMS = {"threshold": ("threshold", 0.0, 1.0), "silence_duration_ms": ("min_silence_ms", 1.0, 60000.0),
               "prefix_padding_ms": ("speech_pad_ms", 0.0, 10000.0)}


def _chunking(form) -> dict | None:
    """``chunking_strategy`` (a string "auto", a JSON object, or the client's ``chunking_strategy[key]`` fields)
    -> keyword arguments for ``glmasr.audio.vad.speech_regions``, or None (30 s windows)."""
    raw = _text_field(form, "chunking_strategy")
    fields = {k[len("chunking_strategy["):-1]: _text_field(form, k) for k in form.keys()
              if k.startswith("chunking_strategy[") and k.endswith("]")}
    if raw is not None:
        if fields:
            raise bad_request("send chunking_strategy either as one field or as chunking_strategy[...] fields",
                              "chunking_strategy")
        if len(raw) > MAX_CHUNKING_CHARS:
            raise bad_request(f"chunking_strategy is {len(raw)} characters; at most {MAX_CHUNKING_CHARS} are "
                              "accepted", "chunking_strategy")
        try:
            decoded = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON (a bare "auto"), or nested deeper than the parser goes
            decoded = raw
        if decoded == "auto":
            return {}
        if not isinstance(decoded, dict):
            raise bad_request(f"chunking_strategy must be 'auto' or an object with type 'server_vad', got {raw!r}",
                              "chunking_strategy")
        fields = decoded
    elif not fields:
        return None
    if fields.get("type") != "server_vad":
        raise bad_request(f"chunking_strategy type must be 'server_vad', got {fields.get('type')!r}",
                          "chunking_strategy")
    out = {}
    for key, value in fields.items():
        if key == "type":
            continue
        if key not in _VAD_PARAMS:
            raise bad_request(f"unknown chunking_strategy parameter {key!r}; known: type, "
                              f"{', '.join(_VAD_PARAMS)}", "chunking_strategy", "unknown_parameter")
        name, lo, hi = _VAD_PARAMS[key]
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad_request(f"chunking_strategy {key} must be a number, got {value!r}", "chunking_strategy",
                              "invalid_type") from None
        if not lo <= number <= hi:
            raise bad_request(f"chunking_strategy {key} must be in [{lo:g}, {hi:g}], got {value!r}",
                              "chunking_strategy")
        out[name] = number
    return out


# ---- responses ----
def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


def delta_event(text: str) -> bytes:
    return sse({"type": "transcript.text.delta", "delta": text})


def done_event(text: str, input_tokens: int, output_tokens: int) -> bytes:
    return sse({"type": "transcript.text.done", "text": text,
                "usage": {"type": "tokens", "input_tokens": input_tokens, "output_tokens": output_tokens,
                          "total_tokens": input_tokens + output_tokens}})


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    return sse({"type": "error", **error_body(message, type, None, code)})
