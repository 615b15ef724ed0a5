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
- ``response_format``: ``json`` (default), ``text``, ``srt``, ``vtt``, ``verbose_json``, ``diarized_json``.
- ``diarized_json`` (speaker diarization, ``glmasr.diarize``; needs the ``diarize`` extra, else a 400
  ``diarization_unavailable``): ``{task, duration, text, segments, usage}`` as the openai client types it
  (``TranscriptionDiarized``); each segment ``{type: "transcript.text.segment", id, start, end, text, speaker}``.
  Segments are speech-shaped (as ``verbose_json``'s) and split where the speaker changes inside one: with word
  times (a server with an aligner asks for them) a segment is a run of consecutive words of one speaker, else one
  per transcript segment with the speaker it overlaps most. Speakers are "A", "B", ... by first appearance, or
  the names of known speakers. With ``stream=true`` the events are the deltas, then one
  ``transcript.text.segment`` event per segment (once the diarization is done), then ``transcript.text.done``.
- ``known_speaker_names[]`` / ``known_speaker_references[]`` (``diarized_json`` only): up to
  ``MAX_KNOWN_SPEAKERS`` (4) names, each with the reference at the same index: a data URL
  (``data:audio/wav;base64,...``; any format ``file`` takes, detected from the bytes) of at most
  ``MAX_REFERENCE_BYTES`` (4 MiB as sent) holding 2-10 s of the speaker's speech. Clusters that sound like a
  reference take its name; a name given twice pools its references. Lists of unequal length, a fifth name, an
  empty or over-long name, a reference that is not a data URL, not audio, outside 2-10 s or without speech: a 400
  naming the field and index (``param`` "known_speaker_references[1]", code ``invalid_speaker_reference``).
- ``min_speakers`` / ``max_speakers`` (extensions, ``diarized_json`` only): integers 1-26 bounding the number of
  speakers found; anything else (or min > max) is a 400.
- ``timestamp_granularities[]``: ``segment`` is accepted with every format (as OpenAI does; only
  ``verbose_json`` carries segments); ``word`` needs ``verbose_json`` (a 400 otherwise, as OpenAI answers) and a
  server started with an aligner (``glmasr serve --aligner PATH``; else a 400 naming both): the answer then has
  ``words`` (word, start, end: every segment's words in order, times from the aligner), and ``segments`` only when
  ``segment`` is asked for too, as OpenAI answers.
- ``stream``: "true" sends server-sent events (``transcript.text.delta`` ..., ``transcript.text.done``,
  ``[DONE]``); with ``response_format`` json, text or diarized_json (which adds ``transcript.text.segment``
  events before the done event).
- ``chunking_strategy``: ``auto`` or ``{"type": "server_vad", ...}`` = voice activity detection
  (``glmasr.audio.vad``, Silero VAD, run on the CPU in the request's worker thread): speech regions merged into
  pieces, one prompt and one segment (with its true times) each; a recording with no speech gives an empty text.
  The pieces are speech-shaped, at most ``SUBTITLE_MAX_SEGMENT_S`` (6 s) and cut at pauses
  (``vad.segment_options``), for ``srt``, ``vtt``, ``verbose_json`` and ``diarized_json``; packed into pieces of up to 30 s for
  ``json`` and ``text``. ``server_vad``'s ``threshold`` (0-1, default 0.5), ``silence_duration_ms`` (the silence
  that ends a region, default 500) and ``prefix_padding_ms`` (the padding before each region, default 200, or 100
  for speech-shaped pieces; after it too with 30 s pieces) are passed on; ``auto``
  uses the defaults. Needs the ``vad`` extra (else a 400 saying so). Left out: ``srt``, ``vtt`` and
  ``verbose_json`` get the same speech-shaped segments (as ``auto``; if the VAD's weights are missing, 30 s windows
  instead), ``json`` and ``text`` the reference segmentation (non-overlapping 30 s windows packed into prompts of
  up to 21 windows: token-exact with transformers).
- ``include[]`` (logprobs), ``languages[]``: not implemented, a 400; any other field: a 400.

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

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
# formats whose segments are seen (cues, segment times): speech-shaped segments by default
SPEECH_SHAPED_FORMATS = ("srt", "vtt", "verbose_json", "diarized_json")
STREAM_FORMATS = ("json", "text", "diarized_json")
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
                 "chunking_strategy[type]", "known_speaker_names[]", "known_speaker_names",
                 "known_speaker_references[]", "known_speaker_references", "min_speakers", "max_speakers"}
_UNSUPPORTED_FIELDS = {
    "include[]": "include[] (logprobs) is not implemented: per-token log probabilities are not returned (each "
                 "verbose_json segment has its avg_logprob)",
    "languages[]": "languages[] is not supported; pass one ISO-639-1 code as language",
}
MAX_KNOWN_SPEAKERS = 4  # OpenAI's "up to 4 speakers" (glmasr.diarize.MAX_KNOWN_SPEAKERS)
MAX_SPEAKER_NAME_CHARS = 100
# one known_speaker_references[] entry as sent (the data URL): 10 s of 48 kHz stereo 24-bit wav is ~3.8 MiB in base64
MAX_REFERENCE_BYTES = 4 * 1024 * 1024
_SPEAKER_FIELDS = ("known_speaker_names[]", "known_speaker_references[]", "min_speakers", "max_speakers")


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
    min_speakers: int | None = None
    max_speakers: int | None = None
    # known_speaker_names[i] goes with known_speaker_references[i] (a data URL, decoded by serving.known_speakers)
    speaker_names: list[str] = field(default_factory=list)
    speaker_references: list[str] = field(default_factory=list)

    @property
    def diarize(self) -> bool:
        """Speakers asked for (``response_format=diarized_json``)."""
        return self.response_format == "diarized_json"

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
    if stream and response_format not in STREAM_FORMATS:
        raise bad_request(f"stream=true sends transcript.text events; response_format={response_format} cannot be "
                          "streamed (use json, text or diarized_json, or stream=false)", "stream",
                          "unsupported_value")
    vad = _chunking(form)
    if response_format != "diarized_json":
        for name in _SPEAKER_FIELDS:
            if form.getlist(name) or form.getlist(name.removesuffix("[]")):
                raise bad_request(f"{name} is for speaker diarization: it needs response_format=diarized_json",
                                  name.removesuffix("[]"), "unsupported_parameter")
    min_speakers, max_speakers = _speaker_count(form, "min_speakers"), _speaker_count(form, "max_speakers")
    if min_speakers is not None and max_speakers is not None and min_speakers > max_speakers:
        raise bad_request(f"min_speakers ({min_speakers}) must not exceed max_speakers ({max_speakers})",
                          "min_speakers")
    names, references = _known_speakers(form)
    return TranscriptionRequest(file=file, size=size, filename=filename, model=model.strip(), prompt=prompt,
                                keywords=keywords, language=language, response_format=response_format,
                                stream=stream, granularities=granularities, vad=vad, min_speakers=min_speakers,
                                max_speakers=max_speakers, speaker_names=names, speaker_references=references)


def _speaker_count(form, name: str) -> int | None:
    raw = _text_field(form, name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise bad_request(f"{name} must be an integer from 1 to 26, got {raw[:40]!r}", name, "invalid_type") from None
    if not 1 <= value <= 26:
        raise bad_request(f"{name} must be an integer from 1 to 26, got {value}", name)
    return value


def speaker_reference_error(message: str, index: int | None) -> APIError:
    """A 400 about ``known_speaker_references[index]`` (the whole list when ``index`` is None)."""
    param = "known_speaker_references" if index is None else f"known_speaker_references[{index}]"
    return bad_request(message, param, "invalid_speaker_reference")


def _known_speakers(form) -> tuple[list[str], list[str]]:
    """known_speaker_names[] and known_speaker_references[]: equal lengths, at most 4, names non-empty and short,
    references data URLs (their contents are decoded later, off the event loop)."""
    names = _list_field(form, "known_speaker_names[]")
    references = _list_field(form, "known_speaker_references[]")
    if len(names) != len(references):
        raise bad_request(f"known_speaker_names[] has {len(names)} entries and known_speaker_references[] "
                          f"{len(references)}; give one reference per name, in the same order",
                          "known_speaker_references", "invalid_speaker_reference")
    if len(names) > MAX_KNOWN_SPEAKERS:
        raise bad_request(f"{len(names)} known speakers; at most {MAX_KNOWN_SPEAKERS} are supported",
                          "known_speaker_names", "invalid_speaker_reference")
    out = []
    for i, name in enumerate(names):
        stripped = name.strip()
        if not stripped or "\x00" in stripped or len(stripped) > MAX_SPEAKER_NAME_CHARS:
            raise bad_request(f"known_speaker_names[{i}] must be a non-empty name of at most "
                              f"{MAX_SPEAKER_NAME_CHARS} characters, got {name[:40]!r}", f"known_speaker_names[{i}]",
                              "invalid_speaker_reference")
        out.append(stripped)
    for i, ref in enumerate(references):
        if len(ref) > MAX_REFERENCE_BYTES:
            raise speaker_reference_error(f"known_speaker_references[{i}] is {len(ref) / 2**20:.1f} MiB; at most "
                                          f"{MAX_REFERENCE_BYTES // 2**20} MiB per reference", i)
        if not ref[:5].lower() == "data:" or "," not in ref[:256]:
            raise speaker_reference_error(f"known_speaker_references[{i}] must be a data URL such as "
                                          f"'data:audio/wav;base64,...', got {ref[:30]!r}", i)
    return out, references


def data_url_bytes(url: str, index: int) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (percent-encoded when not base64); the media type is
    ignored (the audio's format comes from the bytes)."""
    import base64
    import binascii
    from urllib.parse import unquote_to_bytes

    head, _, data = url.partition(",")
    if head[-7:].lower() == ";base64":
        try:
            raw = base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError):
            raise speaker_reference_error(f"known_speaker_references[{index}]: the data URL's base64 data is not "
                                          "valid base64", index) from None
    else:
        raw = unquote_to_bytes(data)
    if not raw:
        raise speaker_reference_error(f"known_speaker_references[{index}]: the data URL holds no data", index)
    return raw


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


def diarized_segments(result) -> list[dict]:
    """``diarized_json``'s segments of a ``Transcription`` whose segments (and words) carry speakers: a segment
    with words becomes one entry per run of consecutive words of one speaker (its text cut from the segment's text
    at the first word of each run, so spacing and punctuation stay; times from the words, within the segment),
    else one entry with the segment's speaker. Segments without text are left out. A speaker the diarization could
    not give (no speech turns found at all) is "A", the one speaker it would have named."""
    out: list[dict] = []
    for seg in result.segments:
        for start, end, text, speaker in _speaker_runs(seg):
            text = text.strip()
            if text:
                out.append({"type": "transcript.text.segment", "id": f"seg_{len(out)}", "start": round(start, 3),
                            "end": round(max(start, end), 3), "text": text, "speaker": speaker or "A"})
    return out


def _speaker_runs(seg) -> list[tuple[float, float, str, str | None]]:
    words = [w for w in (seg.words or ()) if w.word.strip()]
    whole = [(seg.start, seg.end, seg.text, seg.speaker)]
    if not words or len({w.speaker for w in words}) == 1 and words[0].speaker == seg.speaker:
        return whole
    cuts, pos = [], 0  # (text offset where a run starts, index of its first word)
    for k, w in enumerate(words):
        at = seg.text.find(w.word.strip(), pos)
        if at < 0:  # the words do not spell the text: the segment as a whole
            return whole
        if k == 0 or w.speaker != words[k - 1].speaker:
            cuts.append((0 if k == 0 else at, k))
        pos = at + len(w.word.strip())
    runs = []
    for j, (at, k) in enumerate(cuts):
        stop, last = (cuts[j + 1] if j + 1 < len(cuts) else (len(seg.text), len(words)))
        lo = max(seg.start, min(seg.end, words[k].start)) if j else seg.start
        hi = max(seg.start, min(seg.end, words[last - 1].end)) if j + 1 < len(cuts) else seg.end
        runs.append((lo, hi, seg.text[at:stop], words[k].speaker))
    return runs


def diarized_body(result, seconds: float) -> dict:
    """The ``diarized_json`` body (``TranscriptionDiarized``)."""
    from ..writers import duration_usage

    return {"task": "transcribe", "duration": round(seconds, 3), "text": result.text,
            "segments": diarized_segments(result), "usage": duration_usage(seconds)}


def segment_event(segment: dict) -> bytes:
    """A ``transcript.text.segment`` stream event (``TranscriptionTextSegmentEvent``): a diarized segment."""
    return sse(segment)
