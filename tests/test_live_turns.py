"""Live VAD and turns (glmasr/live/vad_stream.py, glmasr/live/turns.py): synthesized speech with known pauses
(espeak-ng phrases joined with sox silences, at 24 kHz, in low noise) streamed in random chunks through
``StreamDecoder`` + ``VadStreams`` + ``TurnDetector``: turns start and stop within 100 ms of the speech; the
probabilities equal the batch VAD's; a 40 s stream of continuous speech is cut before 30 s inside a pause; 64
concurrent streams each get exactly what they get alone; the ticker; closing a stream while its batch runs; the
turn logic on random probabilities (hysteresis, the max-turn cut, idle timeout); settings validation.

Needs the ``vad`` extra (silero-vad) and the ``espeak-ng`` and ``sox`` programs for the speech tests
(Debian: ``apt-get install -y espeak-ng sox``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import numpy as np
import pytest

try:
    import importlib.metadata as _md

    _md.distribution("silero-vad")
except Exception:  # pragma: no cover - the test extra installs it
    pytest.skip("the silero-vad wheel is not installed (pip install glmasr[vad])", allow_module_level=True)

from glmasr.audio import vad  # noqa: E402
from glmasr.audio.stream import InputFormat, StreamDecoder  # noqa: E402
from glmasr.live.turns import TurnDetector, TurnEvent, TurnSettings  # noqa: E402
from glmasr.live.vad_stream import PROB_ATOL, VadStreams  # noqa: E402

RATE = 24000  # the client's rate (OpenAI's audio/pcm)
SR = 16000
W = vad.WINDOW
TOL = int(0.1 * SR)  # turn edges vs the speech: 100 ms
NOISE = 0.003 * 32768  # low background noise (~ -50 dBFS), in int16 units

PHRASES = [  # start and end on voiced sounds, so that "where the speech is" is well defined
    "My mother made a warm meal for the whole family last night.",
    "Many people now listen to long recordings of meetings.",
    "All around the world, new machines learn to understand human language.",
    "We will meet again in the morning, and then we will travel home.",
    "Our engine reads the audio and writes the words down in order.",
]
LONG_TEXT = " ".join(PHRASES + [
    "I would like a room near the main hall, if one is free.",
    "The weather was mild, so we walked along the river for an hour.",
    "Nobody knew where the old map had gone, but we found the way.",
    "Later we read a book about the sea and the ships that crossed it long ago.",
    "In the evening the children sang while their grandmother made bread.",
    "Then everyone went to bed, and the house was quiet until morning.",
])


# -- synthesized speech ------------------------------------------------------------------------------------------
def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _read16(path: str) -> np.ndarray:
    import soundfile as sf

    x, sr = sf.read(path, dtype="int16")
    assert sr == RATE and x.ndim == 1
    return x


def _extent(x: np.ndarray) -> tuple[int, int]:
    """First and last 10 ms frame within 40 dB of the loudest frame: where the speech is in a synthesized clip
    (espeak-ng pads its output with silence), in samples of ``x``."""
    f = RATE // 100
    n = len(x) // f
    rms = np.sqrt((x[: n * f].reshape(n, f).astype(np.float64) ** 2).mean(1) + 1e-20)
    active = np.nonzero(20 * np.log10(rms / rms.max()) > -40)[0]
    return int(active[0] * f), int((active[-1] + 1) * f)


class Speech:
    """24 kHz int16 speech with noise, its clean version, and the true turn intervals in 16 kHz samples."""

    def __init__(self, clean: np.ndarray, turns: list[tuple[int, int]], seed: int):
        rng = np.random.default_rng(seed)
        self.clean = clean
        self.noisy = np.clip(np.round(clean + rng.standard_normal(len(clean)) * NOISE), -32768, 32767).astype(np.int16)
        self.turns = turns
        self.data = self.noisy.astype("<i2").tobytes()


def _join(tmp: str, parts: list, name: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """sox-joins ``parts`` (a phrase: ("say", text); a pause: seconds of sox silence); returns the joined clip and
    each phrase's speech extent in it (24 kHz samples)."""
    files, extents, at = [], [], 0
    for k, part in enumerate(parts):
        path = os.path.join(tmp, f"{name}{k}.wav")
        if isinstance(part, tuple):
            raw = path + ".espeak.wav"
            _run("espeak-ng", "-v", "en-us", "-s", "165", "-w", raw, part[1])
            _run("sox", raw, "-r", str(RATE), "-c", "1", "-b", "16", path)
            x = _read16(path)
            a, b = _extent(x)
            extents.append((at + a, at + b))
        else:
            _run("sox", "-n", "-r", str(RATE), "-c", "1", "-b", "16", path, "trim", "0", f"{part}")
            x = _read16(path)
            assert abs(len(x) - part * RATE) <= 1
        files.append(path)
        at += len(x)
    out = os.path.join(tmp, f"{name}.wav")
    _run("sox", *files, out)
    joined = _read16(out)
    assert len(joined) == at
    return joined, extents


def _to16(n24: int) -> int:
    return n24 * SR // RATE


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    for prog in ("espeak-ng", "sox"):
        if shutil.which(prog) is None:
            pytest.skip(f"{prog} is not installed (Debian: apt-get install -y espeak-ng sox); the speech tests need it")
    return str(tmp_path_factory.mktemp("live_turns"))


@pytest.fixture(scope="module")
def turns_speech(tmp):
    """Four turns: pauses of 0.7-1.3 s (sox) plus espeak's own ~0.35 s trailing silence between them; inside the
    second turn two phrases joined by 0.05 s of sox silence (a ~0.4 s pause: shorter than silence_duration)."""
    parts = [0.9, ("say", PHRASES[0]), 0.7, ("say", PHRASES[1]), 0.05, ("say", PHRASES[2]), 1.3,
             ("say", PHRASES[3]), 1.0, ("say", PHRASES[4]), 1.2]
    clean, ext = _join(tmp, parts, "turns")
    merged = [ext[0], (ext[1][0], ext[2][1]), ext[3], ext[4]]
    return Speech(clean.astype(np.float64), [(_to16(a), _to16(b)) for a, b in merged], seed=1)


@pytest.fixture(scope="module")
def long_speech(tmp):
    """About 40 s of continuous speech (espeak's sentence pauses are ~0.2-0.3 s), 0.6 s of silence before and
    1.5 s after."""
    clean, ext = _join(tmp, [0.6, ("say", LONG_TEXT), 1.5], "long")
    assert ext[0][1] - ext[0][0] >= 38 * RATE, "the long text must give about 40 s of speech"
    return Speech(clean.astype(np.float64), [(_to16(a), _to16(b)) for a, b in ext], seed=2)


# -- streaming helpers -------------------------------------------------------------------------------------------
def _chunks(data: bytes, rng, lo_ms: float = 20, hi_ms: float = 100) -> list[bytes]:
    """Random chunks of 20-100 ms, of any byte count (so chunks split samples)."""
    out, at = [], 0
    while at < len(data):
        n = int(rng.integers(int(lo_ms * RATE * 2 / 1000), int(hi_ms * RATE * 2 / 1000)))
        out.append(data[at:at + n])
        at += n
    return out


class Client:
    """One live stream: decoder -> VAD stream -> turn detector, recording what it got."""

    def __init__(self, vads: VadStreams, settings: TurnSettings | None = None):
        self.decoder = StreamDecoder(InputFormat.parse("audio/pcm", RATE))
        self.detector = TurnDetector(settings or TurnSettings())
        self.stream = vads.open(self.on_probs)
        self.firsts: list[int] = []
        self.probs: list[np.ndarray] = []
        self.x16: list[np.ndarray] = []
        self.events: list[TurnEvent] = []

    def on_probs(self, first: int, probs: np.ndarray) -> None:
        self.firsts.append(first)  # checked in all_probs (VadStreams logs a callback's exceptions)
        self.probs.append(probs.copy())
        self.events.extend(self.detector.feed(first, probs))

    def push(self, chunk: bytes) -> None:
        x = self.decoder.push(chunk)
        self.x16.append(x)
        self.stream.push(x)

    def finish(self) -> None:
        x = self.decoder.flush()
        self.x16.append(x)
        self.stream.push(x)

    @property
    def all_probs(self) -> np.ndarray:
        assert self.firsts == [sum(len(p) for p in self.probs[:k]) for k in range(len(self.probs))]
        return np.concatenate(self.probs) if self.probs else np.zeros(0, np.float32)

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.x16)


async def _drain(vads: VadStreams) -> None:
    while await vads.run_pending():
        pass


async def _stream_one(vads: VadStreams, speech: Speech, seed: int, settings: TurnSettings | None = None,
                      every: int = 1) -> Client:
    rng = np.random.default_rng(seed)
    client = Client(vads, settings)
    for k, chunk in enumerate(_chunks(speech.data, rng)):
        client.push(chunk)
        if k % every == 0:
            await vads.run_pending()
    client.finish()
    await _drain(vads)
    client.stream.close()
    return client


@pytest.fixture(scope="module")
def vads():
    return VadStreams(device="cpu")


# -- turns on speech with known pauses ------------------------------------------------------------------------------
def test_turns_land_on_the_pauses(vads, turns_speech):
    settings = TurnSettings()  # threshold 0.5, prefix 300 ms, silence 500 ms
    client = asyncio.run(_stream_one(vads, turns_speech, seed=5))
    prefix, silence = 300 * SR // 1000, 500 * SR // 1000
    kinds = [e.kind for e in client.events]
    assert kinds == ["started", "stopped"] * len(turns_speech.turns), client.events
    assert not any(e.forced for e in client.events)
    previous_stop = 0
    for (start, stop), (a, b) in zip(zip(client.events[::2], client.events[1::2]), turns_speech.turns):
        assert start.sample >= previous_stop and stop.sample > start.sample
        assert abs(start.sample + prefix - a) <= TOL, (start, a / SR)
        assert abs(stop.sample - silence - b) <= TOL, (stop, b / SR)
        previous_stop = stop.sample
    assert client.detector.position <= len(client.samples)
    assert client.detector.settings == settings


def test_probabilities_equal_the_batch_vad(vads, turns_speech):
    client = asyncio.run(_stream_one(vads, turns_speech, seed=6, every=3))
    x16 = client.samples
    assert len(x16) == round(len(turns_speech.noisy) * SR / RATE)
    got = client.all_probs
    assert len(got) == len(x16) // W  # every complete window, and only those
    want = vad.speech_probabilities(x16, device="cpu")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want[:len(got)], rtol=0, atol=PROB_ATOL)
    assert (want[:len(got)] >= 0.5).mean() > 0.3  # speech was there (not a run of zeros)


def test_long_turn_is_cut_in_a_pause(vads, long_speech):
    client = asyncio.run(_stream_one(vads, long_speech, seed=7, every=4))
    ev = client.events
    kinds = [(e.kind, e.forced) for e in ev]
    assert kinds == [("started", False), ("stopped", True), ("started", True), ("stopped", False)], ev
    start, cut = ev[0].sample, ev[1].sample
    assert ev[2].sample == cut
    a, b = long_speech.turns[0]
    assert abs(start + 300 * SR // 1000 - a) <= TOL
    assert abs(ev[3].sample - 500 * SR // 1000 - b) <= TOL
    # before 30 s, in the last third, at the quietest window there
    assert 20 * SR <= cut - start <= 30 * SR and cut % W == 0
    probs = client.all_probs
    lo = -(-(start + 20 * SR) // W)
    hi = (start + 30 * SR) // W  # the window in which the turn reached 30 s
    assert probs[cut // W] == probs[lo:hi + 1].min() < 0.5
    # inside a pause of the speech itself: no 10 ms frame within 30 ms of the cut has speech energy
    c24 = cut * RATE // SR
    f = RATE // 100
    clean = long_speech.clean
    peak = np.sqrt((clean[: len(clean) // f * f].reshape(-1, f) ** 2).mean(1)).max()
    around = clean[c24 - 3 * f: c24 + 3 * f].reshape(-1, f)
    assert (20 * np.log10(np.sqrt((around ** 2).mean(1)) / peak + 1e-12) < -40).all()


# -- many streams -----------------------------------------------------------------------------------------------
def test_64_streams_each_get_what_they_get_alone(vads, turns_speech):
    rng = np.random.default_rng(8)
    n24 = len(turns_speech.noisy)
    clips = []
    for k in range(64):  # a random piece of the speech (random length and offset), its own noise
        length = int(rng.uniform(1.5, 4.0) * RATE)
        at = int(rng.integers(0, n24 - length))
        x = turns_speech.clean[at:at + length] * rng.uniform(0.3, 1.0) + rng.standard_normal(length) * NOISE
        clips.append(np.clip(np.round(x), -32768, 32767).astype("<i2").tobytes())

    async def together():
        clients = [Client(vads) for _ in clips]
        queues = [_chunks(c, rng) for c in clips]
        while any(queues):
            for client, q in zip(clients, queues):
                if q and rng.random() < 0.7:  # streams run at different paces
                    client.push(q.pop(0))
            await vads.run_pending()
        for client in clients:
            client.finish()
        await _drain(vads)
        for client in clients:
            client.stream.close()
        return [c.all_probs for c in clients]

    async def alone(data: bytes):
        client = Client(vads)
        for chunk in _chunks(data, rng):
            client.push(chunk)
            await vads.run_pending()
        client.finish()
        await _drain(vads)
        client.stream.close()
        return client.all_probs

    batched = asyncio.run(together())
    assert vads.num_streams == 0
    for k in rng.choice(64, 12, replace=False):  # the same samples alone, in another chunking
        single = asyncio.run(alone(clips[k]))
        assert len(single) == len(batched[k]) > 40
        np.testing.assert_array_equal(batched[k], single)


def test_ticker_delivers_the_same_probabilities(vads, turns_speech):
    async def main():
        await vads.start()
        try:
            rng = np.random.default_rng(9)
            data = turns_speech.data[: 4 * RATE * 2]
            clients = [Client(vads), Client(vads)]
            for chunk in _chunks(data, rng):
                for c in clients:
                    c.push(chunk)
                await asyncio.sleep(0.002)  # faster than real time: the ticker catches up in larger batches
            for c in clients:
                c.finish()
            want = len(clients[0].samples) // W
            for _ in range(500):
                if all(len(c.all_probs) == want for c in clients):
                    break
                await asyncio.sleep(0.01)
        finally:
            await vads.stop()
        for c in clients:
            c.stream.close()
        return clients

    clients = asyncio.run(main())
    ref = vad.speech_probabilities(clients[0].samples, device="cpu")
    for c in clients:
        got = c.all_probs
        assert len(got) == len(c.samples) // W
        np.testing.assert_allclose(got, ref[:len(got)], rtol=0, atol=PROB_ATOL)
    np.testing.assert_array_equal(clients[0].all_probs, clients[1].all_probs)


def test_closed_stream_gets_no_callback_and_its_slot_is_reused_clean(vads):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(40 * W) * 0.1).astype(np.float32)

    async def main():
        got = {"a": [], "b": [], "c": []}
        a = vads.open(lambda i, p: got["a"].append(p))
        b = vads.open(lambda i, p: got["b"].append(p))
        a.push(x)
        b.push(x)
        task = asyncio.ensure_future(vads.run_pending())
        while vads._inflight is None:  # the batch with both streams' windows is running on the worker
            await asyncio.sleep(0)
        a.close()
        a.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            a.push(x)
        await task
        assert got["a"] == [] and len(got["b"]) == 1
        await vads.run_pending()  # nothing pending: frees the closed stream's slot
        c = vads.open(lambda i, p: got["c"].append(p))
        assert c._slot == a._slot
        c.push(x)
        await _drain(vads)
        b.close()
        c.close()
        return got

    got = asyncio.run(main())
    np.testing.assert_array_equal(got["c"][0], got["b"][0])  # its state started from zeros again
    assert got["a"] == []


def test_network_failure_closes_the_streams_of_the_batch(monkeypatch):
    vads = VadStreams(device="cpu")

    def broken(batch):
        raise RuntimeError("no memory")

    monkeypatch.setattr(vads, "_compute", broken)
    errors, probs = [], []

    async def main():
        s = vads.open(lambda i, p: probs.append(p), on_error=errors.append)
        s.push(np.random.default_rng(11).standard_normal(3 * W).astype(np.float32))
        await vads.run_pending()
        return s

    s = asyncio.run(main())
    assert s.closed and probs == [] and len(errors) == 1 and "no memory" in str(errors[0])


def test_missing_weights_raise_at_creation(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    vad._cached_model.cache_clear()
    try:
        with pytest.raises(vad.VadUnavailableError, match=r"pip install glmasr\[vad\]"):
            VadStreams(device="cpu")
    finally:
        monkeypatch.undo()
        vad._cached_model.cache_clear()


def test_stream_input_is_checked(vads):
    s = vads.open(lambda i, p: None)
    try:
        with pytest.raises(ValueError, match="1-D float"):
            s.push(np.zeros((2, 512), np.float32))
        with pytest.raises(ValueError, match="1-D float"):
            s.push(np.zeros(512, np.int16))
    finally:
        s.close()
    with pytest.raises(ValueError, match="tick_s"):
        VadStreams(device="cpu", tick_s=0)
    with pytest.raises(ValueError, match="max_windows_per_tick"):
        VadStreams(device="cpu", max_windows_per_tick=0)


# -- the turn logic on random probabilities ------------------------------------------------------------------------
def _low(rng, n):  # below the release threshold 0.35
    return rng.uniform(0.0, 0.3, n)


def _high(rng, n):  # speech
    return rng.uniform(0.6, 1.0, n)


def test_hysteresis_between_the_thresholds_keeps_the_turn():
    rng = np.random.default_rng(12)
    det = TurnDetector(TurnSettings(prefix_padding_ms=0, silence_duration_ms=320))  # 10 windows
    p = np.concatenate([_low(rng, 20), _high(rng, 30), rng.uniform(0.36, 0.49, 40), _high(rng, 5), _low(rng, 9),
                        rng.uniform(0.36, 0.49, 1), _low(rng, 10), _low(rng, 5)])
    ev = det.feed(0, p[:60]) + det.feed(60, p[60:])
    # starts at window 20; windows between the thresholds and a 9-window low run never stop it; the 10-window run
    # after them does: its end is the start of the last window >= threshold (window 94), plus the silence
    assert ev == [TurnEvent("started", 20 * W), TurnEvent("stopped", 94 * W + 320 * SR // 1000)]
    with pytest.raises(ValueError, match="first_window_index must be 120"):
        det.feed(0, p[:3])
    with pytest.raises(ValueError, match="finite"):
        det.feed(120, [0.1, float("nan")])


def test_prefix_padding_is_clipped_at_the_previous_stop():
    rng = np.random.default_rng(13)
    det = TurnDetector(TurnSettings(prefix_padding_ms=300, silence_duration_ms=160))  # 5 windows
    p = np.concatenate([_low(rng, 3), _high(rng, 10), _low(rng, 6), _high(rng, 4), _low(rng, 30)])
    ev = det.feed(0, p)
    first_stop = (13 - 1) * W + 160 * SR // 1000
    assert ev == [TurnEvent("started", 0), TurnEvent("stopped", first_stop),
                  TurnEvent("started", first_stop),  # 19 * W - 300 ms would be before it
                  TurnEvent("stopped", (23 - 1) * W + 160 * SR // 1000)]


def test_max_turn_cut_at_the_quietest_window_of_the_last_third():
    rng = np.random.default_rng(14)
    settings = TurnSettings(prefix_padding_ms=0, max_turn_s=6.0)  # from window 0: 6 s reached in window 187
    p = _high(rng, 600)
    p[40] = 0.05  # a dip outside the last third: ignored
    dip = 160  # inside [4 s, 6 s) of the turn
    p[dip] = 0.2
    p[dip + 3] = 0.25
    det = TurnDetector(settings)
    ev = []
    for a in range(0, 600, 37):  # in uneven pieces
        ev += det.feed(a, p[a:a + 37])
    assert ev[:3] == [TurnEvent("started", 0), TurnEvent("stopped", dip * W, True),
                      TurnEvent("started", dip * W, True)]
    starts = [e.sample for e in ev if e.kind == "started"]
    stops = [e.sample for e in ev if e.kind == "stopped"]
    assert all(e.forced for e in ev[1:]) and len(starts) == len(stops) + 1
    for s, e in zip(starts, stops):
        assert 4 * SR <= e - s <= 6 * SR  # every piece within max_turn_s, cut in its last third
        assert p[e // W] == p[-(-(s + 4 * SR) // W):(s + 6 * SR) // W + 1].min()
    assert det.speaking and det.turn_start == starts[-1]


def test_idle_timeout_once_per_idle_stretch():
    rng = np.random.default_rng(15)
    det = TurnDetector(TurnSettings(idle_timeout_ms=2000, silence_duration_ms=320, prefix_padding_ms=0))
    idle = 2 * SR
    assert det.feed(0, _low(rng, 40)) == []
    assert det.idle(idle - 1) == []
    assert det.idle(idle + 123) == [TurnEvent("timeout", idle)]
    assert det.idle(idle + 5 * SR) == []  # once per stretch
    ev = det.feed(40, _high(rng, 100))
    assert ev == [TurnEvent("started", 40 * W)]
    assert det.idle(100 * SR) == []  # never while a turn is open
    ev = det.feed(140, _low(rng, 12))
    stop = 139 * W + 320 * SR // 1000
    assert ev == [TurnEvent("stopped", stop)]
    assert det.idle(stop + idle - 1) == []
    assert det.idle(stop + idle) == [TurnEvent("timeout", stop + idle)]
    assert det.idle(stop + 3 * idle) == []
    det.reset(10 * SR)  # a manual commit: the idle stretch restarts there
    assert det.idle(12 * SR) == [TurnEvent("timeout", 12 * SR)]
    assert TurnDetector(TurnSettings()).idle(10 ** 9) == []  # no idle_timeout_ms: never


def test_reset_drops_the_open_turn():
    rng = np.random.default_rng(16)
    det = TurnDetector(TurnSettings(prefix_padding_ms=300))
    assert det.feed(0, np.concatenate([_low(rng, 30), _high(rng, 10)])) == [TurnEvent("started", 30 * W - 4800)]
    det.reset(40 * W)
    assert not det.speaking
    assert det.feed(40, _high(rng, 1)) == [TurnEvent("started", 40 * W)]  # not before the reset point


@pytest.mark.parametrize("field, value", [
    ("threshold", -0.1), ("threshold", 1.5), ("threshold", "0.5"), ("threshold", float("nan")), ("threshold", True),
    ("prefix_padding_ms", -1), ("prefix_padding_ms", 10_001), ("silence_duration_ms", -5),
    ("silence_duration_ms", 20_000), ("silence_duration_ms", None), ("idle_timeout_ms", 0),
    ("idle_timeout_ms", "1000"), ("max_turn_s", 0.5), ("max_turn_s", 31), ("max_turn_s", float("inf")),
])
def test_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=rf"turn_detection\.{field} must be"):
        TurnSettings(**{field: value})


def test_settings_defaults_and_prefix_limit():
    s = TurnSettings()
    assert (s.threshold, s.prefix_padding_ms, s.silence_duration_ms, s.idle_timeout_ms, s.max_turn_s) == \
        (0.5, 300, 500, None, 30.0)
    assert s.release_threshold == pytest.approx(0.35)
    assert TurnSettings(threshold=0.1).release_threshold == 0.01
    with pytest.raises(ValueError, match="prefix_padding_ms .* half of max_turn_s"):
        TurnSettings(prefix_padding_ms=600, max_turn_s=1.0)
    assert TurnEvent("started", 16_015).ms == 1000
