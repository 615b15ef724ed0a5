"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide).

| metric | kind | meaning |
|---|---|---|
| glmasr_requests_total{outcome} | counter | finished transcription requests by outcome (below) |
| glmasr_audio_seconds_total | counter | decoded audio duration of the requests that were transcribed |
| glmasr_prompt_tokens_total | counter | prompt positions (audio + text) prefilled |
| glmasr_generated_tokens_total | counter | tokens generated |
| glmasr_queue_depth | gauge | requests inside the server (reading, decoding, queued or decoding in the engine) |
| glmasr_engine_pending_requests | gauge | requests the engine holds (queued or running) |
| glmasr_time_to_first_token_seconds | histogram | request received -> first tokens back from the engine |
| glmasr_request_latency_seconds{stream} | histogram | request received -> last byte of the answer produced |
| glmasr_request_stage_seconds{kind,stage} | histogram | where a transcribed request's time went (below) |

Stages (``STAGES``, from the result's ``timings_ms``; kind "transcription" for the HTTP API, "realtime" for the
final of a live turn): ``queue`` its arrival in the engine -> the engine's first encoder work for it; ``encode``
-> its first prefill launched (the encoder, and the wait for a slot and a round); ``decode`` -> its end read back
by the engine (prefill and decode steps, shared with the batch); ``transit`` the rest of the request's time after
its audio was decoded: between the caller and the engine (the engine process's pipes, the event loops, the
detokenizer). The four add up to the request's time from decoded audio to its transcript (word alignment and the
wait for diarization, when asked for, apart).

Outcomes: ok, bad_request, unauthorized, not_found, too_large, rejected (queue full), unavailable (warming up,
shutting down, too many uploads, or the engine worker holding it died), timed_out (an upload too slow: 408; a
transcription past --request-timeout: 504), aborted (the client went away), error.

With engine worker processes (``--data-parallel``), per worker, labels ``worker`` (its slot: 0..N-1) and
``device`` (as given in ``--devices``), read from the engine client at each scrape:

| metric | kind | meaning |
|---|---|---|
| glmasr_worker_up{worker,device} | gauge | 1 while the worker is loaded, warmed up and taking requests |
| glmasr_worker_in_flight_requests{worker,device} | gauge | requests routed to it that it still holds |
| glmasr_worker_in_flight_audio_seconds{worker,device} | gauge | their audio seconds (what routing balances) |
| glmasr_worker_requests_total{worker,device} | counter | requests routed to it |
| glmasr_worker_failures_total{worker,device} | counter | requests that failed there (an engine error, or its death) |
| glmasr_worker_restarts_total{worker,device} | counter | times its process died and was restarted |

The aggregate series above stay (``glmasr_engine_pending_requests`` is the sum of the workers' in-flight).

With several front-end processes (``glmasr serve --frontends K``, ``frontends.py``) a scrape reaches one
front-end, and sees every front-end's series summed (prometheus_client's multiprocess mode: each front-end writes
its values to files in the supervisor's private folder, the scraped one adds them up; the gauges
``glmasr_queue_depth`` and ``glmasr_realtime_active_sessions`` sum the live front-ends, the counters and
histograms keep what a front-end that died had counted). ``glmasr_engine_pending_requests`` is the engine
processes' own count (every front-end's requests). The ``glmasr_worker_*`` series are the scraped front-end's view
of the engine processes: up, and the requests it routed and saw fail (in_flight: its own; restarts: the times its
connection to that engine was re-established). One more series says how the load is spread:

| metric | kind | meaning |
|---|---|---|
| glmasr_frontend_requests_total{frontend,kind} | counter | transcription requests (kind "transcription") and realtime sessions ("realtime") that reached front-end ``frontend`` (0..K-1) |

Live transcription (``GET /v1/realtime``, ``glmasr.server.realtime``); a turn is one committed piece of audio (one
final engine request); "end of turn" is when its last sample arrived (turn detection) or the client's commit:

| metric | kind | meaning |
|---|---|---|
| glmasr_realtime_active_sessions | gauge | open realtime sessions |
| glmasr_realtime_sessions_total | counter | sessions accepted (past auth and --max-realtime-sessions) |
| glmasr_realtime_audio_seconds_total | counter | audio the sessions received (16 kHz seconds, after decoding) |
| glmasr_realtime_turns_total | counter | turns committed (turn detection, idle timeout or the client) |
| glmasr_realtime_turns_failed_total{code} | counter | turns answered with ``...transcription.failed``, by code |
| glmasr_realtime_drafts_total{outcome} | counter | partial drafts: sent, skipped (engine full), aborted, failed |
| glmasr_realtime_forcing_total{changed} | counter | audited finals: "true" when forcing the partial text changed it |
| glmasr_realtime_delta_mismatches_total | counter | finals not continuing the text already sent (not expected) |
| glmasr_realtime_first_delta_seconds | histogram | end of turn -> the final's first text sent |
| glmasr_realtime_completed_seconds | histogram | end of turn -> ``...transcription.completed`` sent |
| glmasr_realtime_errors_total{code} | counter | ``error`` events sent, by code (bad client events, limits, refusals) |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "bad_request", "unauthorized", "not_found", "too_large", "rejected", "unavailable", "timed_out",
            "aborted", "error")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# live latencies are judged around 100-300 ms: finer there
_LIVE_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
# a request's stages run from well under a millisecond (an idle engine's queue) to seconds
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                  1.5, 2.5, 5.0, 10.0, 30.0)
DRAFT_OUTCOMES = ("sent", "skipped", "aborted", "failed")
STAGES = ("queue", "encode", "decode", "transit")
STAGE_KINDS = ("transcription", "realtime")


def stage_seconds(timings_ms: dict) -> dict[str, float] | None:
    """A result's ``timings_ms`` -> seconds per stage (``STAGES``), or None when the engine's marks are missing (a
    request that ended before its prefill, an engine without them)."""
    t = timings_ms or {}
    if not all(k in t for k in ("queue_ms", "admit_ms", "engine_ms", "total_ms")):
        return None
    queue, admit, engine = t["queue_ms"], t["admit_ms"], t["engine_ms"]
    # alignment and diarization add their own time to total_ms after the engine is done: not a stage here
    transit = t["total_ms"] - t.get("audio_ms", 0.0) - t.get("align_ms", 0.0) - t.get("diarize_wait_ms", 0.0) - engine
    return {"queue": queue / 1e3, "encode": max(0.0, admit - queue) / 1e3, "decode": max(0.0, engine - admit) / 1e3,
            "transit": max(0.0, transit) / 1e3}


def outcome_for(status: int) -> str:
    return {400: "bad_request", 401: "unauthorized", 404: "not_found", 408: "timed_out", 413: "too_large",
            429: "rejected", 503: "unavailable", 504: "timed_out"}.get(status, "error" if status >= 500 else
                                                                         "bad_request")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_pending=lambda: 0, workers=None, multiprocess_dir: str | None = None,
                 frontend: int | None = None):
        """``multiprocess_dir`` (with ``frontend``, this front-end's index): render every front-end's series summed
        (the process must have been started with ``PROMETHEUS_MULTIPROC_DIR`` set to that folder)."""
        self.registry = r = CollectorRegistry()
        self._multiprocess_dir = multiprocess_dir
        # series computed at each scrape (not summed over the front-ends): apart in multiprocess mode
        local = CollectorRegistry() if multiprocess_dir is not None else r
        self._local = local
        self.requests = Counter("glmasr_requests", "Finished transcription requests by outcome", ["outcome"],
                                registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.audio_seconds = Counter("glmasr_audio_seconds", "Seconds of audio transcribed", registry=r)
        self.prompt_tokens = Counter("glmasr_prompt_tokens", "Prompt positions (audio + text) prefilled",
                                     registry=r)
        self.generated_tokens = Counter("glmasr_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("glmasr_queue_depth", "Requests inside the server", registry=r,
                                 multiprocess_mode="livesum")
        if multiprocess_dir is None:
            self.engine_pending = Gauge("glmasr_engine_pending_requests", "Requests queued or running in the engine",
                                        registry=r)
            self.engine_pending.set_function(engine_pending)
        else:  # a Gauge would also write a per-process file (summed): this one is computed at each scrape only
            local.register(_FunctionGauge("glmasr_engine_pending_requests", "Requests queued or running in the "
                                          "engine", engine_pending))
        self.ttft = Histogram("glmasr_time_to_first_token_seconds", "Request received -> first tokens",
                              buckets=_BUCKETS, registry=r)
        self.latency = Histogram("glmasr_request_latency_seconds", "Request received -> answer complete",
                                 ["stream"], buckets=_BUCKETS, registry=r)
        for v in ("true", "false"):
            self.latency.labels(v)
        self.stages = Histogram("glmasr_request_stage_seconds", "Where a transcribed request's time went, by stage",
                                ["kind", "stage"], buckets=_STAGE_BUCKETS, registry=r)
        for kind in STAGE_KINDS:
            for stage in STAGES:
                self.stages.labels(kind, stage)
        if workers is not None:
            local.register(_WorkerCollector(workers))
        self.frontend = None
        if frontend is not None:
            self.frontend = Counter("glmasr_frontend_requests", "Transcription requests and realtime sessions "
                                    "that reached this front-end", ["frontend", "kind"], registry=r)
            for kind in ("transcription", "realtime"):
                self.frontend.labels(str(frontend), kind)
            self._frontend_index = str(frontend)
        self.live_sessions = Gauge("glmasr_realtime_active_sessions", "Open realtime sessions", registry=r,
                                   multiprocess_mode="livesum")
        self.live_sessions_total = Counter("glmasr_realtime_sessions", "Realtime sessions accepted", registry=r)
        self.live_audio_seconds = Counter("glmasr_realtime_audio_seconds", "Seconds of audio received by realtime "
                                          "sessions", registry=r)
        self.live_turns = Counter("glmasr_realtime_turns", "Realtime turns committed", registry=r)
        self.live_turns_failed = Counter("glmasr_realtime_turns_failed", "Realtime turns whose transcription "
                                         "failed, by error code", ["code"], registry=r)
        self.live_drafts = Counter("glmasr_realtime_drafts", "Partial-transcript drafts by outcome", ["outcome"],
                                   registry=r)
        for o in DRAFT_OUTCOMES:
            self.live_drafts.labels(o)
        self.live_forcing = Counter("glmasr_realtime_forcing", "Finals audited against an unforced decode, by "
                                    "whether forcing the agreed text changed it", ["changed"], registry=r)
        for v in ("true", "false"):
            self.live_forcing.labels(v)
        self.live_mismatches = Counter("glmasr_realtime_delta_mismatches", "Finals whose text did not continue "
                                       "the text already sent", registry=r)
        self.live_first_delta = Histogram("glmasr_realtime_first_delta_seconds", "End of a turn -> first text of "
                                          "its final", buckets=_LIVE_BUCKETS, registry=r)
        self.live_completed = Histogram("glmasr_realtime_completed_seconds", "End of a turn -> its completed "
                                        "event", buckets=_LIVE_BUCKETS, registry=r)
        self.live_errors = Counter("glmasr_realtime_errors", "Realtime error events sent, by code", ["code"],
                                   registry=r)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self._multiprocess_dir)
        return generate_latest(summed) + generate_latest(self._local)

    def observe_stages(self, kind: str, timings_ms: dict) -> None:
        """Record a transcribed request's stages (``stage_seconds``) under ``kind`` ("transcription" or
        "realtime")."""
        stages = stage_seconds(timings_ms)
        if stages is not None:
            for stage, seconds in stages.items():
                self.stages.labels(kind, stage).observe(seconds)

    def reached(self, kind: str) -> None:
        """A transcription request ("transcription") or a realtime session ("realtime") reached this front-end
        (counted with ``--frontends`` only)."""
        if self.frontend is not None:
            self.frontend.labels(self._frontend_index, kind).inc()

    def live(self) -> "LiveMetrics":
        """The hook a ``glmasr.live.session.LiveSession`` calls (``glmasr.live.events.LiveMetrics``)."""
        return LiveMetrics(self)


class LiveMetrics:
    """``glmasr.live.events.LiveMetrics`` over a server's ``Metrics`` (one object serves every session)."""

    def __init__(self, m: Metrics):
        self._m = m

    def on_audio(self, seconds: float) -> None:
        self._m.live_audio_seconds.inc(seconds)

    def on_turn(self) -> None:
        self._m.live_turns.inc()

    def on_draft(self, outcome: str) -> None:
        self._m.live_drafts.labels(outcome if outcome in DRAFT_OUTCOMES else "failed").inc()

    def on_first_delta(self, seconds: float) -> None:
        self._m.live_first_delta.observe(seconds)

    def on_completed(self, seconds: float) -> None:
        self._m.live_completed.observe(seconds)

    def on_timings(self, timings_ms: dict) -> None:
        self._m.observe_stages("realtime", timings_ms)

    def on_failed(self, code: str) -> None:
        self._m.live_turns_failed.labels(code or "error").inc()

    def on_forcing(self, changed: bool) -> None:
        self._m.live_forcing.labels("true" if changed else "false").inc()

    def on_mismatch(self) -> None:
        self._m.live_mismatches.inc()


class _WorkerCollector:
    """The per-worker series, from ``workers()`` (``EngineClient.workers``) at each scrape."""

    def __init__(self, workers):
        self._workers = workers

    def collect(self):
        labels = ["worker", "device"]
        up = GaugeMetricFamily("glmasr_worker_up", "1 while the engine worker takes requests", labels=labels)
        held = GaugeMetricFamily("glmasr_worker_in_flight_requests", "Requests the engine worker holds",
                                 labels=labels)
        audio = GaugeMetricFamily("glmasr_worker_in_flight_audio_seconds",
                                  "Audio seconds of the requests the engine worker holds", labels=labels)
        routed = CounterMetricFamily("glmasr_worker_requests", "Requests routed to the engine worker", labels=labels)
        failed = CounterMetricFamily("glmasr_worker_failures", "Requests that failed on the engine worker",
                                     labels=labels)
        restarts = CounterMetricFamily("glmasr_worker_restarts", "Restarts of the engine worker's process",
                                       labels=labels)
        for w in self._workers():
            key = [str(w["worker"]), w["device"]]
            up.add_metric(key, 1.0 if w["state"] == "ready" else 0.0)
            held.add_metric(key, w["in_flight"])
            audio.add_metric(key, w["in_flight_audio_s"])
            routed.add_metric(key, w["requests"])
            failed.add_metric(key, w["failures"])
            restarts.add_metric(key, w["restarts"])
        yield from (up, held, audio, routed, failed, restarts)


class _FunctionGauge:
    """One unlabelled gauge whose value ``fn()`` gives at each scrape."""

    def __init__(self, name: str, documentation: str, fn):
        self._name, self._doc, self._fn = name, documentation, fn

    def collect(self):
        g = GaugeMetricFamily(self._name, self._doc)
        g.add_metric([], float(self._fn()))
        yield g
