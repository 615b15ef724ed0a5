"""The load generator's realtime mode (``python -m glmasr.server.loadgen --realtime``).

1. Its measurements against a scripted WebSocket server whose answers are known: turns found exactly where the
   audio's (noise-burst) speech is, ``completed`` a set delay after the end of speech, deltas at a set interval while
   a turn is open, turns never completed or never committed. The reported latencies, partial intervals and lost
   turns must be those the script made.
2. A small run against a real ``glmasr serve`` on the CPU (tiny checkpoint, espeak-ng speech) through the
   benchmark's realtime section (``scripts/bench/realtime_load.py``: the server in its own process, the load
   generator's command line): 4 sessions at real-time pace for 6 s (each to its next pause), then 2 with partials,
   lose nothing; every turn the offline detector expects is committed and completed, and the JSON has its shape.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

websockets = pytest.importorskip("websockets")

from glmasr.server import loadgen  # noqa: E402
from glmasr.server.loadgen import REALTIME_RATE, RealtimeSettings, SpeechPass  # noqa: E402

MS = REALTIME_RATE // 1000  # samples per ms
ROOT = Path(__file__).resolve().parent.parent


def burst_pass(seed: int = 0) -> SpeechPass:
    """Noise bursts (the "speech", never an exact 0 sample) in exact silence (zeros): bursts of 0.7-1.1 s with
    1.2-1.5 s pauses; turns as server_vad counts them (300 ms before the burst, 500 ms after it)."""
    rng = np.random.default_rng(seed)
    pcm, turns, pos = [np.zeros(600 * MS, np.int16)], [], 600 * MS
    for _ in range(3):
        n = int(rng.uniform(700, 1100)) * MS
        burst = rng.integers(1, 8000, n).astype(np.int16) * rng.choice(np.array([-1, 1], np.int16), n)
        turns.append((pos - 300 * MS, pos + n + 500 * MS))
        pause = int(rng.uniform(1200, 1500)) * MS
        pcm += [burst, np.zeros(pause, np.int16)]
        pos += n + pause
    pcm = np.concatenate(pcm)
    cuts = [((stop + (turns[k + 1][0] if k + 1 < len(turns) else turns[0][0] + len(pcm))) // 2) % len(pcm)
            for k, (_, stop) in enumerate(turns)]
    return SpeechPass("bursts", pcm, turns, sorted(cuts))


class ScriptedServer:
    """A realtime endpoint on 127.0.0.1 (its own thread and event loop) that finds turns in the audio exactly
    (speech = nonzero samples; a turn starts 300 ms before it, stops 500 ms of zeros after it), answers each
    committed turn ``delay`` s after its stop (a delta, then completed), sends a delta every ``partial_every`` s
    while a turn is open, and per session never completes the turns numbered in ``never_complete`` and never
    commits those in ``never_commit`` (0 = its first turn)."""

    def __init__(self, delay=0.2, partial_every=None, never_complete=(), never_commit=(), hold_updates_s=0.0):
        self.delay, self.partial_every = delay, partial_every
        self.never_complete, self.never_commit = set(never_complete), set(never_commit)
        self.hold_updates_s = hold_updates_s  # every session.updated waits until this long after the first connection
        self.first_connection = None
        self.first_audio: list[float] = []  # per session, when its first append arrived
        self.updates: list[dict] = []
        self.auth: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started):
        asyncio.set_event_loop(self.loop)

        async def main():
            self.server = await websockets.serve(self._session, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
            started.set()
            await self.server.wait_closed()

        self.loop.run_until_complete(main())

    def stop(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.thread.join(10)

    async def _session(self, ws):
        if self.first_connection is None:
            self.first_connection = time.perf_counter()
        self.auth.append(ws.request.headers.get("Authorization"))
        assert ws.request.path == "/v1/realtime?intent=transcription"

        def send(ev):
            return ws.send(json.dumps(ev))

        await send({"type": "session.created"})
        pos, last_voice, start, turn, prev, last_partial = 0, None, None, 0, None, 0.0
        tasks = []

        async def finish(item, k):
            await asyncio.sleep(self.delay)
            if k not in self.never_complete:
                await send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item, "delta": "t"})
                await send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                            "transcript": "t"})

        async for raw in ws:
            ev = json.loads(raw)
            if ev["type"] == "session.update":
                self.updates.append(ev)
                await asyncio.sleep(max(0.0, self.first_connection + self.hold_updates_s - time.perf_counter()))
                await send({"type": "session.updated", "session": ev["session"]})
                continue
            if pos == 0:
                self.first_audio.append(time.perf_counter())
            x = np.frombuffer(base64.b64decode(ev["audio"]), "<i2")
            voiced = np.flatnonzero(x)  # a chunk never holds both a turn's stop and the next onset (long pauses)
            if voiced.size:
                if start is None:
                    start = max(0, pos + int(voiced[0]) - 300 * MS, 0 if prev is None else prev)
                    last_partial = time.perf_counter()
                    await send({"type": "input_audio_buffer.speech_started", "item_id": f"i{turn}",
                                "audio_start_ms": start // MS})
                last_voice = pos + int(voiced[-1])
            pos += len(x)
            now = time.perf_counter()
            if start is not None and self.partial_every and now - last_partial >= self.partial_every:
                last_partial = now
                await send({"type": "conversation.item.input_audio_transcription.delta", "item_id": f"i{turn}",
                            "delta": "p"})
            if start is not None and pos - (last_voice + 1) >= 500 * MS:
                stop, item = last_voice + 1 + 500 * MS, f"i{turn}"
                await send({"type": "input_audio_buffer.speech_stopped", "item_id": item, "audio_end_ms": stop // MS})
                if turn not in self.never_commit:
                    await send({"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": None})
                    tasks.append(asyncio.ensure_future(finish(item, turn)))
                start, prev, turn = None, stop, turn + 1


@pytest.fixture
def scripted(request):
    server = ScriptedServer(**getattr(request, "param", {}))
    yield server
    server.stop()


def run(server, sessions=3, seconds=3.0, grace=1.0, ramp_s=0.3, procs=1, **settings):
    sp = burst_pass()
    st = RealtimeSettings(**settings)
    return loadgen.run_realtime(server.url, "sekrit", [sp], sessions, seconds, st, ramp_s=ramp_s, grace=grace,
                                procs=procs)


@pytest.mark.parametrize("scripted", [{"delay": 0.05, "hold_updates_s": 2.5}], indirect=True)
@pytest.mark.parametrize("procs", [1, 2])
def test_sessions_start_on_the_ramp_however_slowly_they_connect(scripted, procs):
    """A server that configures every session only 2.5 s after the first connected (a slow connection storm):
    the level starts once all are configured, then the sessions' first appends follow the ramp (0.2 s apart),
    none late; before the start gate they all started at once, as they were configured, and their turns came in
    bursts. With two client processes the gate spans both (a manager barrier)."""
    row = run(scripted, sessions=4, seconds=2.0, ramp_s=0.8, procs=procs, chunk_ms=40)
    assert row["sessions_failed"] == 0 and row["turns"]["lost"] == 0, row
    starts = sorted(scripted.first_audio)
    assert len(starts) == 4
    gaps = np.diff(starts)
    assert np.all(np.abs(gaps - 0.2) < 0.06), gaps  # the ramp's spacing (a 40 ms chunk of slack), not bunched
    late = row["session_start_late_ms"]
    assert late["n"] == 4 and late["max"] < 50, late


@pytest.mark.parametrize("scripted", [{"delay": 0.25}], indirect=True)
def test_latency_and_turns_are_what_the_server_did(scripted):
    row = run(scripted, chunk_ms=40)
    t = row["turns"]
    assert t["expected"] >= 3 * 2 and t["committed"] == t["completed"] == t["expected"], t
    assert t["lost"] == t["failed"] == t["missed"] == t["unfinished"] == t["extra"] == 0, t
    assert loadgen.realtime_ok([row]) and row["sessions_failed"] == 0 and row["errors"] == []
    lat = row["end_of_speech_to_completed_ms"]
    assert lat["n"] == t["completed"] and 250 <= lat["p50"] <= 400 and lat["p99"] < 600, lat
    stop = row["end_of_speech_to_speech_stopped_ms"]
    assert 0 <= stop["p50"] < 100, stop  # stopped goes out on receipt of the chunk holding the end
    assert row["turn_end_vs_offline_ms"]["max"] <= 1.0  # the script's turns are the expected ones exactly
    assert row["partial_interval_ms"]["n"] == 0 and row["partial_updates"] == 0  # partials off
    assert row["onset_to_first_update_ms"]["n"] == 0
    # every session sent its update in the GA shape, with the key as a bearer token
    assert len(scripted.updates) == 3 and set(scripted.auth) == {"Bearer sekrit"}
    s = scripted.updates[0]["session"]
    assert s["type"] == "transcription" and s["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert s["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert "interim_results" not in s["audio"]["input"]["transcription"]
    assert row["audio_s"] >= 3 * 3.0
    table = loadgen.realtime_table([row])
    assert "| 3 | off |" in table and table.splitlines()[2].count("|") == 11  # ten columns


@pytest.mark.parametrize("scripted", [{"delay": 0.05, "partial_every": 0.3}], indirect=True)
def test_partial_interval_is_the_servers_delta_rhythm(scripted):
    row = run(scripted, partials=True, partial_hop_ms=300)
    gaps = row["partial_interval_ms"]
    assert row["partial_updates"] > 0 and gaps["n"] > row["partial_updates"] // 2
    assert 280 <= gaps["p50"] <= 420, gaps  # 300 ms, in 40 ms chunk steps
    first = row["onset_to_first_update_ms"]  # one per turn, each one of the gaps
    assert first["n"] == row["turns"]["completed"] and 0 < first["p50"] <= gaps["max"], first
    tr = scripted.updates[0]["session"]["audio"]["input"]["transcription"]
    assert tr["interim_results"] is True and tr["partial_hop_ms"] == 300
    assert row["turns"]["lost"] == 0


@pytest.mark.parametrize("scripted", [{"never_complete": {1}, "never_commit": {0}}], indirect=True)
def test_turns_lost_in_the_server_are_counted(scripted):
    row = run(scripted, sessions=2, ramp_s=None)
    sp = burst_pass()
    assert row["ramp_s"] == round(sp.seconds / len(sp.cuts), 2) > 1  # the default: the mean turn period
    t = row["turns"]
    # per session: turn 0 never committed (missed), turn 1 committed but never completed (unfinished)
    assert t["missed"] == 2 and t["unfinished"] == 2 and t["lost"] == 4, t
    assert t["completed"] == t["expected"] - 4 and t["committed"] == t["expected"] - 2
    assert not loadgen.realtime_ok([row])


def test_stream_plan_covers_whole_turns():
    sp = burst_pass(1)
    n = len(sp.pcm)
    for offset in sp.cuts:
        plan = loadgen.StreamPlan.make(sp, offset, 4 * REALTIME_RATE)
        assert plan.total >= 4 * REALTIME_RATE and (offset + plan.total) % n in sp.cuts
        stream = np.concatenate([np.frombuffer(plan.chunk(sp, k, 960), "<i2")
                                 for k in range(0, plan.total, 960)])
        assert len(stream) == plan.total
        # the expected turns are exactly the bursts of the streamed audio (+300 ms before, +500 ms after)
        voiced = np.flatnonzero(stream)
        breaks = np.flatnonzero(np.diff(voiced) > 1)
        starts = np.r_[voiced[0], voiced[breaks + 1]]
        ends = np.r_[voiced[breaks] + 1, voiced[-1] + 1]
        assert plan.turns == [(a - 300 * MS, b + 500 * MS) for a, b in zip(starts, ends)]
    with pytest.raises(ValueError, match="chunk_ms"):
        RealtimeSettings(chunk_ms=10)
    assert loadgen.realtime_ws_url("https://h:1/v1/") == "wss://h:1/v1/realtime?intent=transcription"
    with pytest.raises(ValueError, match="--url"):
        loadgen.realtime_ws_url("h:1")


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (Debian: apt-get install espeak-ng)")
def test_realtime_benchmark_section_against_glmasr_serve(tiny_shipped, tmp_path):
    out = tmp_path / "realtime.json"
    p = subprocess.run([sys.executable, "-m", "scripts.bench.realtime_load", "--model", str(tiny_shipped),
                        "--device", "cpu", "--max-batch", "8", "--warmup", "request", "--sessions", "4",
                        "--partial-sessions", "2", "--partial-hop-ms", "500", "--seconds", "5", "--ramp", "1",
                        "--profile-s", "1", "--out", str(tmp_path), "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:],
                               (tmp_path / "realtime_server.log").read_text()[-2000:])
    report = json.loads(out.read_text())
    assert report["ok"] and report["server_exit_status"] == 0 and report["server_ready_s"] > 0
    assert report["audio"][0]["turns"] >= 3 and report["audio"][0]["seconds"] > 10
    assert [(r["sessions"], r["partials"]) for r in report["levels"]] == [(4, False), (2, True)]
    for row in report["levels"]:
        t = row["turns"]
        assert row["loadgen_exit_status"] == 0 and row["sessions_failed"] == 0 and row["errors"] == [], row
        assert t["lost"] == t["failed"] == t["extra"] == 0 and t["expected"] >= row["sessions"], t
        assert t["committed"] == t["completed"] == t["expected"], t
        lat = row["end_of_speech_to_completed_ms"]
        assert lat["n"] == t["completed"] and 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"], lat
        first = row["end_of_speech_to_first_delta_ms"]
        assert first["n"] == 0 or 0 < first["p50"] <= lat["max"], first
        assert row["turn_end_vs_offline_ms"]["p95"] <= 100, row["turn_end_vs_offline_ms"]
        assert row["server"]["cpu_percent"] > 0 and row["server"]["cpu_count"] >= 1
        assert row["audio_s"] >= row["sessions"] * 5 and row["client_send_lag_ms"]["n"] > 0 and row["ramp_s"] == 1
        # the server's stages of the level's finals (one engine request each), from its /metrics histograms
        stages = row["server_stages_ms"]
        assert set(stages) == {"queue", "encode", "decode", "transit"}, stages
        for st in stages.values():
            assert st["n"] == t["completed"] and st["mean"] >= 0, stages
            assert st["p95"] is None or st["p50"] <= st["p95"], stages
        # --profile-s: py-spy's summary of the server's processes, or why there is none
        prof = row["profile"]
        assert (prof.get("error", "").startswith("py-spy not found") if shutil.which("py-spy") is None
                else [q["pid"] for q in prof["processes"]][:1] == [report["server_pid"]]), prof
    # partials on: every turn has at least one interval (onset to end of speech when nothing agreed early)
    partial = report["levels"][1]
    assert partial["partial_interval_ms"]["n"] >= partial["turns"]["completed"]
    # the steady checkpoint (the default --decoder-text): drafts agree, so partial text reaches the clients
    assert report["decoder_text"] == "steady" and partial["partial_updates"] > 0, partial
    assert report["levels"][0]["partial_interval_ms"]["n"] == 0
    assert "| 4 | off |" in report["table"] and "| 2 | on |" in report["table"]
