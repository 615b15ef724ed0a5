"""The Realtime wire format (glmasr.server.realtime.protocol) against the ``openai`` package's own types: every client
event the SDK can build is parsed (or refused with a named reason), and every server event we render validates
against the SDK's server event models, with no field the models do not declare (outside the session object, which
carries our documented extensions)."""

from __future__ import annotations

import base64
import json
import typing

import numpy as np
import pytest

openai = pytest.importorskip("openai")
from openai.types import realtime as rt  # noqa: E402
from openai.types.beta import realtime as beta  # noqa: E402

from glmasr.server.realtime import protocol as rp  # noqa: E402
from glmasr.server.realtime.protocol import ProtocolError, SessionConfig  # noqa: E402

NAMES = {"glm-asr-nano-2512": "glm-asr-nano-2512", "tiny": "tiny"}


class _Events:
    """Validation of a server event against the member of an SDK event union its ``type`` names."""

    def __init__(self, union):
        members = typing.get_args(typing.get_args(union)[0])
        self.by_type = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}

    def validate_python(self, obj: dict):
        assert obj["type"] in self.by_type, f"the SDK has no server event {obj['type']!r}"
        return self.by_type[obj["type"]].model_validate(obj)


SERVER_EVENTS = _Events(rt.RealtimeServerEvent)
BETA_SERVER_EVENTS = _Events(beta.realtime_server_event.RealtimeServerEvent)


def parse(obj, **kw):
    return rp.parse_client_event(json.dumps(obj), **kw)


def refused(obj, code, param=None, cfg=None):
    """The error a client event (or a session update applied to ``cfg``) gets: its code and param."""
    with pytest.raises(ProtocolError) as e:
        ev = parse(obj)
        (cfg or SessionConfig()).updated(ev, NAMES)
    assert e.value.code == code, e.value.message
    if param is not None:
        assert e.value.param == param, e.value.message
    assert e.value.message
    return e.value


def update(session: dict, cfg: SessionConfig | None = None, kind="session.update") -> SessionConfig:
    return (cfg or SessionConfig()).updated(parse({"type": kind, "session": session}), NAMES)


# ---- client events built by the SDK ----
def _sdk_client_events():
    """One instance of every member of the SDK's ``RealtimeClientEvent`` union (and the beta transcription update),
    built and validated by the SDK's pydantic models."""
    rng = np.random.default_rng(7)
    audio = base64.b64encode(rng.integers(-2000, 2000, 480).astype("<i2").tobytes()).decode()
    transcription = rt.RealtimeTranscriptionSessionCreateRequest.model_validate({
        "type": "transcription",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "glm-asr-nano-2512", "language": "en", "prompt": "Say it.",
                                              "keywords": ["GLM"]},
                            "turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200,
                                               "silence_duration_ms": 400, "idle_timeout_ms": 9000},
                            "noise_reduction": None}}})
    return {
        "conversation.item.create": rt.ConversationItemCreateEvent.model_validate(
            {"type": "conversation.item.create",
             "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}),
        "conversation.item.delete": rt.ConversationItemDeleteEvent(type="conversation.item.delete", item_id="i1"),
        "conversation.item.retrieve": rt.ConversationItemRetrieveEvent(type="conversation.item.retrieve",
                                                                       item_id="i1"),
        "conversation.item.truncate": rt.ConversationItemTruncateEvent(type="conversation.item.truncate",
                                                                       item_id="i1", content_index=0,
                                                                       audio_end_ms=10),
        "input_audio_buffer.append": rt.InputAudioBufferAppendEvent(type="input_audio_buffer.append", audio=audio,
                                                                    event_id="ev_append"),
        "input_audio_buffer.clear": rt.InputAudioBufferClearEvent(type="input_audio_buffer.clear"),
        "output_audio_buffer.clear": rt.OutputAudioBufferClearEvent(type="output_audio_buffer.clear"),
        "input_audio_buffer.commit": rt.InputAudioBufferCommitEvent(type="input_audio_buffer.commit"),
        "response.cancel": rt.ResponseCancelEvent(type="response.cancel"),
        "response.create": rt.ResponseCreateEvent(type="response.create"),
        "session.update": rt.SessionUpdateEvent(type="session.update", session=transcription),
        "transcription_session.update": beta.TranscriptionSessionUpdate.model_validate(
            {"type": "transcription_session.update",
             "session": {"input_audio_format": "g711_ulaw",
                         "input_audio_transcription": {"model": "gpt-4o-transcribe", "language": "de"},
                         "turn_detection": {"type": "server_vad", "threshold": 0.4}, "modalities": ["text"]}}),
    }


def test_sdk_event_list_is_complete():
    """The test above covers every client event type the SDK defines (a new SDK event type fails here)."""
    members = typing.get_args(typing.get_args(rt.RealtimeClientEvent)[0])
    types = {typing.get_args(m.model_fields["type"].annotation)[0] for m in members}
    assert types | {"transcription_session.update"} == set(_sdk_client_events())


@pytest.mark.parametrize("exclude_unset", [True, False])
def test_every_sdk_client_event(exclude_unset):
    """Each SDK event, as the SDK sends it (exclude_unset) and fully dumped (every optional field as null): the
    ones a transcription session uses parse to their meaning; the others are refused naming the event type."""
    names = {**NAMES, "gpt-4o-transcribe": "glm-asr-nano-2512"}  # a server that serves that name too
    for kind, model in _sdk_client_events().items():
        obj = model.model_dump(mode="json", exclude_unset=exclude_unset)
        if kind in rp.UNSUPPORTED_EVENTS:
            with pytest.raises(ProtocolError) as e:
                parse(obj)
            assert (e.value.code, e.value.param) == ("unsupported_event", "type")
            assert kind in e.value.message
            continue
        ev = parse(obj)
        if kind == "input_audio_buffer.append":
            assert isinstance(ev, rp.Append) and ev.event_id == "ev_append"
            assert ev.audio == base64.b64decode(obj["audio"])
        elif kind == "input_audio_buffer.commit":
            assert isinstance(ev, rp.Commit)
        elif kind == "input_audio_buffer.clear":
            assert isinstance(ev, rp.Clear)
        elif kind == "session.update":
            cfg = SessionConfig().updated(ev, names)
            assert (cfg.format, cfg.rate, cfg.language, cfg.prompt, cfg.keywords) == \
                   ("audio/pcm", 24000, "en", "Say it.", ("GLM",))
            assert cfg.turn_detection == rp.TurnDetection(0.6, 200, 400, 9000)
            assert cfg.shape == "ga"
        else:
            cfg = SessionConfig().updated(ev, names)
            assert (cfg.format, cfg.rate, cfg.language, cfg.shape) == ("audio/pcmu", 8000, "de", "beta")
            assert cfg.turn_detection.threshold == 0.4


def test_realtime_session_type_refused():
    """A conversation session (type realtime, what the SDK builds by default) is refused naming session.type."""
    model = rt.SessionUpdateEvent(type="session.update",
                                  session=rt.RealtimeSessionCreateRequest(type="realtime", instructions="hi"))
    refused(model.model_dump(mode="json", exclude_unset=True), "unknown_parameter", "session.instructions")
    refused({"type": "session.update", "session": {"type": "realtime"}}, "unsupported_value", "session.type")
    refused({"type": "session.update", "session": {"type": "translation"}}, "invalid_value", "session.type")


# ---- the session configuration ----
@pytest.mark.parametrize("fmt,expect", [
    ({"type": "audio/pcm", "rate": 24000}, ("audio/pcm", 24000)),
    ({"type": "audio/pcm"}, ("audio/pcm", 24000)),
    ({"type": "audio/pcm", "rate": 16000}, ("audio/pcm", 16000)),
    ({"type": "audio/pcmu"}, ("audio/pcmu", 8000)),
    ({"type": "audio/pcma", "rate": 8000}, ("audio/pcma", 8000)),
])
def test_formats(fmt, expect):
    cfg = update({"type": "transcription", "audio": {"input": {"format": fmt}}})
    assert (cfg.format, cfg.rate) == expect
    assert (cfg.input_format().kind, cfg.input_format().rate) == expect
    echo = rp.session_updated(cfg, "sess_1")
    assert echo["session"]["audio"]["input"]["format"] == \
           ({"type": "audio/pcm", "rate": expect[1]} if expect[0] == "audio/pcm" else {"type": expect[0]})
    if expect[1] == 16000:  # the SDK types pin rate to 24000: our extension is echoed as it is, else valid
        echo = json.loads(json.dumps(echo))
        echo["session"]["audio"]["input"]["format"]["rate"] = 24000
    SERVER_EVENTS.validate_python(echo)


@pytest.mark.parametrize("beta_fmt,params,expect", [
    ("pcm16", None, ("audio/pcm", 24000)),
    ("pcm16", {"sample_rate_hz": 16000, "num_channels": 1}, ("audio/pcm", 16000)),
    ("g711_ulaw", None, ("audio/pcmu", 8000)),
    ("g711_alaw", None, ("audio/pcma", 8000)),
])
def test_beta_formats(beta_fmt, params, expect):
    session = {"input_audio_format": beta_fmt}
    if params:
        session["input_audio_params"] = params
    cfg = update(session, kind="transcription_session.update")
    assert (cfg.format, cfg.rate, cfg.shape) == (*expect, "beta")
    echo = rp.session_updated(cfg, "sess_1")
    assert echo["type"] == "transcription_session.updated"
    assert echo["session"]["input_audio_format"] == beta_fmt
    assert echo["session"]["input_audio_params"]["sample_rate_hz"] == expect[1]
    _validate_beta(echo)


def _validate_beta(event: dict) -> None:
    """The beta models restrict ``model`` to OpenAI's names and mark ``client_secret`` required though it is absent
    from WebSocket updates; everything else must validate as is."""
    e = json.loads(json.dumps(event))
    e["session"]["client_secret"] = {"expires_at": 0, "value": "x"}
    e["session"]["input_audio_transcription"]["model"] = "whisper-1"
    parsed = BETA_SERVER_EVENTS.validate_python(e)
    assert parsed.type == event["type"]


def test_update_changes_only_what_it_carries():
    cfg = update({"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcmu"},
        "transcription": {"model": "tiny", "language": "zh", "prompt": "p", "keywords": ["a", " b "],
                          "interim_results": True, "partial_hop_ms": 700},
        "turn_detection": {"type": "server_vad", "threshold": 0.3, "silence_duration_ms": 800}}}})
    assert (cfg.model, cfg.language, cfg.prompt, cfg.keywords, cfg.interim_results, cfg.partial_hop_ms) == \
           ("tiny", "zh", "p", ("a", "b"), True, 700)
    assert cfg.turn_detection == rp.TurnDetection(0.3, 300, 800, None)
    cfg2 = update({"type": "transcription", "audio": {"input": {"transcription": {"language": "en-US"},
                                                                  "turn_detection": {"prefix_padding_ms": 100}}}},
                  cfg)
    assert (cfg2.model, cfg2.language, cfg2.prompt, cfg2.keywords, cfg2.format) == \
           ("tiny", "en", "p", ("a", "b"), "audio/pcmu")
    assert cfg2.turn_detection == rp.TurnDetection(0.3, 100, 800, None)
    cfg3 = update({"type": "transcription", "audio": {"input": {"turn_detection": None,
                                                                  "transcription": {"context": False}}}}, cfg2)
    assert cfg3.turn_detection is None and cfg3.language == "en" and cfg3.context is False
    assert cfg3.live_settings().context is False and cfg2.live_settings().context is True
    # null objects change nothing; read-only fields echoed back from session.created are ignored
    assert update({"type": "transcription", "id": "sess_x", "object": "realtime.transcription_session",
                   "audio": {"input": {"format": None, "transcription": None}}}, cfg3) == cfg3
    # the live settings the session gets
    s = cfg.live_settings()
    assert (s.prompt, s.language, s.keywords, s.partials, s.partial_hop_s) == ("p", "zh", ("a", "b"), True, 0.7)
    assert (s.turn_detection.threshold, s.turn_detection.silence_duration_ms) == (0.3, 800)
    assert cfg3.live_settings().turn_detection is None


@pytest.mark.parametrize("session,code,param", [
    ({"type": "transcription", "bogus": 1}, "unknown_parameter", "session.bogus"),
    ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}},
     "unsupported_value", "session.audio.input.format.rate"),
    ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}},
     "unsupported_value", "session.audio.input.format.rate"),
    ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/flac"}}}},
     "invalid_value", "session.audio.input.format.type"),
    ({"type": "transcription", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
     "unsupported_value", "session.audio.input.turn_detection.type"),
    ({"type": "transcription", "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
     "invalid_value", "session.audio.input.turn_detection.threshold"),
    ({"type": "transcription", "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": "x"}}}},
     "invalid_type", "session.audio.input.turn_detection.threshold"),
    ({"type": "transcription", "audio": {"input": {"turn_detection": {"silence_duration_ms": 1.5}}}},
     "invalid_type", "session.audio.input.turn_detection.silence_duration_ms"),
    ({"type": "transcription", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
     "unsupported_value", "session.audio.input.noise_reduction"),
    ({"type": "transcription", "include": ["item.input_audio_transcription.logprobs"]},
     "unsupported_value", "session.include"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"model": "whisper-1"}}}},
     "model_not_found", "session.audio.input.transcription.model"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"delay": "low"}}}},
     "unsupported_value", "session.audio.input.transcription.delay"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"languages": ["en", "de"]}}}},
     "unsupported_value", "session.audio.input.transcription.languages"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"language": "english"}}}},
     "invalid_value", "session.audio.input.transcription.language"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"prompt": "x" * 5000}}}},
     "invalid_value", "session.audio.input.transcription.prompt"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"keywords": ["a", " "]}}}},
     "invalid_value", "session.audio.input.transcription.keywords"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"interim_results": "yes"}}}},
     "invalid_type", "session.audio.input.transcription.interim_results"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"context": 1}}}},
     "invalid_type", "session.audio.input.transcription.context"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"partial_hop_ms": 50}}}},
     "invalid_value", "session.audio.input.transcription.partial_hop_ms"),
    ({"type": "transcription", "audio": {"output": {"voice": "alloy"}}}, "unsupported_value",
     "session.audio.output"),
    ({"type": "transcription", "audio": "pcm"}, "invalid_type", "session.audio"),
])
def test_refused_settings(session, code, param):
    refused({"type": "session.update", "event_id": "ev_7", "session": session}, code, param)
    e = refused({"type": "session.update", "event_id": "ev_7", "session": session}, code, param)
    assert e.event_id == "ev_7"


@pytest.mark.parametrize("session,code,param", [
    ({"input_audio_format": "pcm24"}, "invalid_value", "session.input_audio_format"),
    ({"input_audio_params": {"sample_rate_hz": 48000}}, "unsupported_value",
     "session.input_audio_params.sample_rate_hz"),
    ({"input_audio_params": {"num_channels": 2}}, "unsupported_value", "session.input_audio_params.num_channels"),
    ({"modalities": ["text", "audio"]}, "unsupported_value", "session.modalities"),
    ({"turn_detection": {"type": "semantic_vad"}}, "unsupported_value", "session.turn_detection.type"),
    ({"input_audio_noise_reduction": {"type": "far_field"}}, "unsupported_value",
     "session.input_audio_noise_reduction"),
    ({"audio": {}}, "unknown_parameter", "session.audio"),
])
def test_refused_beta_settings(session, code, param):
    refused({"type": "transcription_session.update", "session": session}, code, param)


# ---- event parsing errors ----
def test_append_roundtrip_random_bytes():
    rng = np.random.default_rng(11)
    for n in (0, 1, 2, 3, 1000, 4801):
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ev = parse({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw).decode()})
        assert ev.audio == raw


@pytest.mark.parametrize("message,code,param", [
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_json", None),
    ('"input_audio_buffer.commit"', "invalid_json", None),
    ("{}", "missing_required_parameter", "type"),
    ('{"type": 5}', "invalid_type", "type"),
    ('{"type": "input_audio_buffer.flush"}', "unknown_event_type", "type"),
    ('{"type": "input_audio_buffer.commit", "extra": 1}', "unknown_parameter", "extra"),
    ('{"type": "input_audio_buffer.append"}', "missing_required_parameter", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": 12}', "invalid_type", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": "abc*"}', "invalid_audio", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": "abc"}', "invalid_audio", "audio"),
    ('{"type": "session.update"}', "missing_required_parameter", "session"),
    ('{"type": "session.update", "session": []}', "invalid_type", "session"),
    ('{"type": "input_audio_buffer.commit", "event_id": 3}', "invalid_value", "event_id"),
])
def test_bad_events(message, code, param):
    with pytest.raises(ProtocolError) as e:
        rp.parse_client_event(message)
    assert (e.value.code, e.value.param) == (code, param), e.value.message


def test_event_id_is_echoed_and_size_limited():
    with pytest.raises(ProtocolError) as e:
        rp.parse_client_event('{"type": "input_audio_buffer.flush", "event_id": "mine"}')
    assert e.value.event_id == "mine"
    err = rp.error_from(e.value)
    assert err["error"]["event_id"] == "mine"
    big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 2000})
    with pytest.raises(ProtocolError) as e:
        rp.parse_client_event(big, max_chars=1024)
    assert e.value.code == "event_too_large" and "1024" in e.value.message
    rp.parse_client_event(big, max_chars=len(big))


# ---- server events ----
def _declared(model_cls, obj: dict) -> None:
    extra = set(obj) - set(model_cls.model_fields)
    assert not extra, f"{obj['type']}: fields the SDK does not declare: {extra}"


def test_server_events_validate_against_the_sdk():
    from openai._models import construct_type_unchecked

    cfg = update({"type": "transcription", "audio": {"input": {"transcription": {"language": "en",
                                                                                 "keywords": ["x"]}}}})
    events = [
        rp.session_created(SessionConfig(), "sess_1"),
        rp.session_created(cfg, "sess_1"),
        rp.session_updated(cfg, "sess_1"),
        rp.session_updated(update({"type": "transcription", "audio": {"input": {"turn_detection": None}}}),
                           "sess_1"),
        rp.speech_started("item_1", 320),
        rp.speech_stopped("item_1", 2400),
        rp.committed("item_1", None),
        rp.committed("item_2", "item_1"),
        rp.cleared(),
        rp.timeout_triggered("item_3", 0, 5000),
        rp.delta("item_1", "Hello"),
        rp.completed("item_1", "Hello world", 2.08),
        rp.failed("item_2", "engine_error", "transcription failed"),
        rp.error("bad", "invalid_value", "session.audio", "ev_1"),
        rp.error("gone", "shutting_down", type="server_error"),
    ]
    ids = set()
    for obj in events:
        wire = json.loads(rp.dumps(obj))
        parsed = SERVER_EVENTS.validate_python(wire)
        assert parsed.type == wire["type"]
        if not wire["type"].startswith("session."):
            _declared(type(parsed), wire)
        # and as the SDK's connection parses what it receives
        sdk = construct_type_unchecked(value=wire, type_=typing.cast(typing.Any, rt.RealtimeServerEvent))
        assert type(sdk) is type(parsed)
        ids.add(wire["event_id"])
    assert len(ids) == len(events)  # every event has its own id
    completed = SERVER_EVENTS.validate_python(events[11])
    assert completed.usage.type == "duration" and completed.usage.seconds == 2.08
    assert completed.content_index == 0
    session = SERVER_EVENTS.validate_python(events[1]).session
    assert session.type == "transcription" and session.audio.input.transcription.keywords == ["x"]
    assert session.audio.input.turn_detection.type == "server_vad"


def test_beta_session_created_shape():
    cfg = SessionConfig(shape="beta", format="audio/pcmu", rate=8000)
    e = rp.session_created(cfg, "sess_b")
    assert e["session"]["input_audio_format"] == "g711_ulaw"
    parsed = BETA_SERVER_EVENTS.validate_python(json.loads(rp.dumps(e)))
    assert parsed.type == "session.created"


def test_render_session_events():
    """The live session's events map onto their wire events field by field."""
    from glmasr.live import events as ev

    cases = [
        (ev.SpeechStarted("item_a", 300), {"type": "input_audio_buffer.speech_started", "item_id": "item_a",
                                           "audio_start_ms": 300}),
        (ev.SpeechStopped("item_a", 2300), {"type": "input_audio_buffer.speech_stopped", "item_id": "item_a",
                                            "audio_end_ms": 2300}),
        (ev.TimeoutTriggered("item_b", 100, 5100), {"type": "input_audio_buffer.timeout_triggered",
                                                    "item_id": "item_b", "audio_start_ms": 100,
                                                    "audio_end_ms": 5100}),
        (ev.Committed("item_b", "item_a"), {"type": "input_audio_buffer.committed", "item_id": "item_b",
                                            "previous_item_id": "item_a"}),
        (ev.Cleared(), {"type": "input_audio_buffer.cleared"}),
        (ev.TranscriptDelta("item_a", " wor"), {"type": "conversation.item.input_audio_transcription.delta",
                                                "item_id": "item_a", "content_index": 0, "delta": " wor"}),
        (ev.TranscriptCompleted("item_a", "Hi wor", {"type": "duration", "seconds": 1.5}),
         {"type": "conversation.item.input_audio_transcription.completed", "item_id": "item_a",
          "content_index": 0, "transcript": "Hi wor", "usage": {"type": "duration", "seconds": 1.5}}),
        (ev.TranscriptFailed("item_a", "worker_died", "the worker died"),
         {"type": "conversation.item.input_audio_transcription.failed", "item_id": "item_a", "content_index": 0,
          "error": {"type": "server_error", "code": "worker_died", "message": "the worker died", "param": None}}),
    ]
    for event, expect in cases:
        out = rp.render(event)
        assert out.pop("event_id").startswith("event_")
        assert out == expect
        SERVER_EVENTS.validate_python({**out, "event_id": "e"})
