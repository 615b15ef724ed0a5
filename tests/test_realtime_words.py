"""Word times in live finals (issue 25's realtime output): ``transcription.word_timestamps: true`` on a server
started with ``--aligner`` gives each ``completed`` event ``words`` in seconds of the session, equal to what the
aligner gives ``transcribe()`` of the turn's samples shifted by the turn's start; the same with the engines in
processes of their own (``--frontends 2``, ``--data-parallel 2``: every engine process loads the aligner), whose
uploads' ``verbose_json`` words are the handle's too; without an aligner the setting is an ``error`` event naming
the field, and the session keeps working."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("websockets")

import glmasr  # noqa: E402
from glmasr.align.random_head import build_head_for_checkpoint  # noqa: E402

from conftest import noise  # noqa: E402
from live_server import MODEL as MODEL_NAME  # noqa: E402
from live_server import ServerProcess  # noqa: E402
from test_realtime import COMPLETED, MANUAL, Session, as_float, pcm16, run, server  # noqa: E402,F401

WORDS = {"type": "transcription", "audio": {"input": {"turn_detection": None, "transcription": {
    "word_timestamps": True, "context": False}}}}


@pytest.fixture(scope="module")
def head(tiny_shipped, tmp_path_factory):
    return build_head_for_checkpoint(tmp_path_factory.mktemp("head") / "ctc", tiny_shipped, seed=3)


LAYOUTS = {"one engine": (), "two front-ends": ("--frontends", "2"),
           "two engine workers": ("--data-parallel", "2", "--devices", "cpu,cpu")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def aligned_server(request, tiny_shipped, head, tmp_path_factory):
    s = ServerProcess(tiny_shipped, tmp_path_factory.mktemp("rt_words"),
                      extra=("--aligner", str(head), *LAYOUTS[request.param]))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def aligned_asr(tiny_shipped, head):
    asr = glmasr.load(tiny_shipped, device="cpu", aligner=str(head))
    yield asr
    asr.close()


def test_completed_carries_word_times_in_session_seconds(aligned_server, aligned_asr):
    a, b = pcm16(noise(3.0, 91, rate=24000)), pcm16(noise(6.0, 91, rate=24000))  # noise the random head finds words in

    async def main():
        s = await Session.open(aligned_server)
        await s.recv()
        u = await s.update(WORDS)
        assert u["session"]["audio"]["input"]["transcription"]["word_timestamps"] is True
        first = await s.turn(a, seed=1)
        second = await s.turn(b, seed=2)
        await s.close()
        done = {e["item_id"]: e for e in s.events if e["type"] == COMPLETED}
        return done[first["item_id"]], done[second["item_id"]]

    first, second = run(main())
    for event, raw, offset in ((first, a, 0.0), (second, b, 3.0)):
        r = aligned_asr.submit(as_float(raw), glmasr.DecodeOptions(word_timestamps=True),
                               sampling_rate=24000).result()
        assert event["transcript"] == r.text
        want = [(w.word, round(offset + w.start, 3), round(offset + w.end, 3))
                for seg in r.segments for w in seg.words]
        got = [(w["word"], w["start"], w["end"]) for w in event["words"]]
        assert got == want and got  # the same words, shifted to the session's clock
        assert all(offset - 1e-3 <= s <= e <= offset + len(raw) / 2 / 24000 + 1e-3 for _, s, e in got)


def test_uploads_get_the_handles_word_times(aligned_server, aligned_asr):
    """``verbose_json`` with word granularity (speech-shaped segments), through the real openai client: the words
    and times of the handle loaded in this process, whichever process the server's engine runs in."""
    from test_subtitles import decoded, flac, speech_audio

    from glmasr.audio import vad
    from glmasr.writers import SUBTITLE_MAX_SEGMENT_S

    data = flac(speech_audio(reps=2))
    audio = decoded(data)
    pieces = vad.segment(audio.samples, device="cpu", **vad.segment_options(SUBTITLE_MAX_SEGMENT_S))
    ref = aligned_asr.submit_loaded(audio, glmasr.DecodeOptions(segmentation="vad", word_timestamps=True,
                                                                max_segment_s=SUBTITLE_MAX_SEGMENT_S),
                                    pieces=pieces).result()
    want = [(w.word, round(w.start, 3), round(w.end, 3)) for seg in ref.segments for w in seg.words]
    v = aligned_server.client().audio.transcriptions.create(
        file=("a.flac", data), model=MODEL_NAME, response_format="verbose_json",
        timestamp_granularities=["word", "segment"])
    assert want and [(w.word, w.start, w.end) for w in v.words] == want
    assert [seg.text for seg in v.segments] == [seg.text for seg in ref.segments]


def test_word_timestamps_without_an_aligner_is_an_error_naming_the_field(server):
    async def main():
        s = await Session.open(server)
        await s.recv()
        await s.send({"type": "session.update", "session": WORDS, "event_id": "ev_words"})
        err = await s.error()
        await s.update(MANUAL)  # still usable: the refused update changed nothing
        turn = await s.turn(pcm16(noise(1.0, 93, rate=24000)), seed=4)
        await s.close()
        return err, turn

    err, turn = run(main())
    assert err["code"] == "unsupported_value" and err["event_id"] == "ev_words"
    assert err["param"] == "session.audio.input.transcription.word_timestamps"
    assert "--aligner" in err["message"]
    assert isinstance(turn["transcript"], str)
    assert np.isfinite(turn["usage"]["seconds"])
