"""Live transcription sessions under load (issue 24's realtime benchmark), in one run.

    bash benchmark.sh --only realtime [--realtime-sessions 64,256,512] [--realtime-partial-sessions 32,128]
                      [--realtime-seconds 60]        # as a benchmark.sh section (full-size checkpoint, H200)
    python -m scripts.bench.realtime_load [--model FOLDER] [--device cuda] [--sessions 64,256,512]
        [--partial-sessions 32,128] [--seconds 60] [--chunk-ms 40] [--procs P] [--audio FILE...] [--profile-s S]
        [--json FILE]

Starts ``glmasr serve`` in its own process on a free 127.0.0.1 port (``--max-realtime-sessions`` above the largest N),
then for each N in ``--sessions`` runs the load generator's realtime mode (``python -m glmasr.server.loadgen
--realtime``: N sessions streaming espeak-ng speech with pauses at real-time pace, server_vad turns, finals only),
then each N in ``--partial-sessions`` with partials on (``interim_results``, a draft every ``--partial-hop-ms``), and
stops the server (SIGTERM: it drains). The server decodes ``--tokens-per-s`` (default 3) tokens per second of each
prompt's audio (``scripts.bench.forced_serve``): random weights never stop on their own, and the default budget (32 +
6 per second) is several times what speech gives. By default the server loads the steady copy of the checkpoint
(``--decoder-text steady``, ``scripts/bench/steady_checkpoint.py``: the same tensors and work, but it writes `` a a a
...`` whatever the audio), so that consecutive drafts agree as they mostly do on speech and partials go out; on random
text no draft ever agrees and the partial interval is just the turn's length. Per N: p50/p95/p99 from end of speech to
``completed``, the partial update interval, the drafts the server sent, skipped and aborted (from its /metrics),
lost/failed turns (must be 0), the server's CPU (its process tree) and GPU use (nvidia-smi), where the finals' time
went on the server (``server_stages_ms``: the mean and approximate p50 / p95 of each stage of
``glmasr_request_stage_seconds{kind="realtime"}`` in the level: queue, encode, decode, transit; from /metrics'
histogram buckets, interpolated) and, with ``--profile-s S``, a py-spy summary of every server process sampled for S
seconds from a third of the way into the level (``scripts/bench/profile_tree.py``; raw stacks under
``--out``/profile_N); the issue's targets on the H200: >= 500 sessions, finals only, p95 <= 300 ms; >= 128 sessions
with partials at a 1 s hop, p95 interval <= 1.5 s; 0 lost turns. The clients run in ``--procs`` processes (default:
one per 128 sessions, at most 8), so that the client's own interpreter does not become the bottleneck; each row's
``client_send_lag_ms`` says whether it kept real-time pace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path


def client_procs(sessions: int) -> int:
    return max(1, min(8, -(-sessions // 128)))


DECODER_TEXTS = ("steady", "random")


def run(folder, device: str = "cuda", sessions=(64, 256, 512), partial_sessions=(32, 128), seconds: float = 60.0,
        chunk_ms: int = 40, partial_hop_ms: int = 1000, procs: int | None = None, max_batch: int | None = None,
        warmup: str = "full", out_dir: Path | None = None, health_timeout_s: float = 600.0,
        grace: float = 60.0, ramp_s: float | None = None, audio: tuple[str, ...] = (),
        tokens_per_s: float | None = 3.0, server_flags=(), profile_s: float = 0.0,
        profile_idle: bool = False, decoder_text: str = "steady") -> dict:
    """The section: every level's loadgen row, the table, the server's settings and exit status."""
    from glmasr.server import loadgen
    from scripts.bench.serve_load import start_server, stop_server

    if decoder_text not in DECODER_TEXTS:
        raise ValueError(f"decoder_text must be one of {DECODER_TEXTS}, got {decoder_text!r}")
    if decoder_text == "steady":
        from scripts.bench.steady_checkpoint import steady_copy

        folder = steady_copy(folder)
    out_dir = Path(out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    top = max([*sessions, *partial_sessions, 1])
    extra = ["--max-realtime-sessions", str(top + 8), "--max-connections", str(max(1024, top + 64)),
             "--warmup", warmup, *server_flags]
    data_parallel = any(f.startswith(("--data-parallel", "--devices")) for f in server_flags)
    proc, port, log = start_server(folder, None if data_parallel else device, max_batch, None,
                                   out_dir / "realtime_server.log", extra,
                                   tokens_per_s=tokens_per_s)
    report = {"seconds_per_level": seconds, "chunk_ms": chunk_ms, "partial_hop_ms": partial_hop_ms,
              "audio_files": [str(a) for a in audio], "tokens_per_s": tokens_per_s,
              "server_flags": list(server_flags), "decoder_text": decoder_text,
              "max_batch": max_batch, "levels": []}
    try:
        report["server_ready_s"] = round(loadgen.wait_healthy(port, health_timeout_s, lambda: proc.poll() is None), 1)
        report["server_pid"] = proc.pid
        for partials, levels in ((False, sessions), (True, partial_sessions)):
            for n in levels:
                path = out_dir / f"realtime_{n}{'_partials' if partials else ''}.json"
                argv = ["--realtime", "--url", f"http://127.0.0.1:{port}/v1", "--sessions", str(n), "--seconds",
                        str(seconds), "--chunk-ms", str(chunk_ms), "--server-pid", str(proc.pid), "--procs",
                        str(procs or client_procs(n)), "--grace", str(grace), "--json", str(path)]
                if partials:
                    argv += ["--partials", "--partial-hop-ms", str(partial_hop_ms)]
                if ramp_s is not None:
                    argv += ["--ramp", str(ramp_s)]
                if audio:
                    argv += ["--audio", *map(str, audio)]
                metrics_before = scrape_metrics(port)
                profile: dict = {}
                timer = None
                if profile_s > 0:
                    from scripts.bench.profile_tree import profile_tree

                    tag = f"{n}{'_partials' if partials else ''}"
                    timer = threading.Timer(max(5.0, seconds / 3), lambda: profile.update(profile_tree(
                        proc.pid, profile_s, out_dir=out_dir / f"profile_{tag}", idle=profile_idle)))
                    timer.start()
                rc = loadgen.main(argv)
                if timer is not None:
                    timer.join(profile_s + 60)
                result = json.loads(path.read_text())
                report.setdefault("audio", result["audio"])
                row = result["levels"][0]
                row["loadgen_exit_status"] = rc
                # what the server did with drafts in this level (a client sees a partial only once two drafts
                # agree, which random weights never do: the cadence of drafts is the server's side of it)
                metrics_after = scrape_metrics(port)
                before, after = draft_counts(metrics_before), draft_counts(metrics_after)
                row["server_drafts"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                row["server_stages_ms"] = stage_summary(stage_histograms(metrics_before),
                                                        stage_histograms(metrics_after))
                if profile:
                    row["profile"] = profile
                report["levels"].append(row)
                print(f"[realtime] {json.dumps(row)}", flush=True)
    finally:
        report["server_exit_status"] = stop_server(proc)
        log.close()
    report["table"] = loadgen.realtime_table(report["levels"])
    report["ok"] = loadgen.realtime_ok(report["levels"])
    print(report["table"], flush=True)
    return report


def scrape_metrics(port: int) -> str:
    """The server's /metrics text ("" when it cannot be read)."""
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return ""


def draft_counts(text: str) -> dict[str, float]:
    """``glmasr_realtime_drafts_total`` by outcome from a /metrics text."""
    import re

    return {m[1]: float(m[2]) for m in re.finditer(r'^glmasr_realtime_drafts_total\{outcome="(\w+)"\} (\S+)$', text,
                                                     re.M)}


def stage_histograms(text: str, kind: str = "realtime") -> dict[str, dict]:
    """``glmasr_request_stage_seconds{kind=...}`` per stage from a /metrics text: {stage: {"le": {bound: count},
    "sum", "count"}}."""
    import re

    out: dict[str, dict] = {}
    pat = re.compile(r'^glmasr_request_stage_seconds_(bucket|sum|count)\{kind="(\w+)",(?:le="([^"]+)",)?'
                     r'stage="(\w+)"(?:,le="([^"]+)")?\} (\S+)$', re.M)
    for part, k, le1, stage, le2, value in pat.findall(text):
        if k != kind:
            continue
        h = out.setdefault(stage, {"le": {}, "sum": 0.0, "count": 0.0})
        if part == "bucket":
            h["le"][float(le1 or le2)] = float(value)
        else:
            h[part] = float(value)
    return out


def stage_summary(before: dict, after: dict) -> dict[str, dict]:
    """Per stage, what the level added: n, mean ms and p50 / p95 ms interpolated within the histogram's buckets."""
    out = {}
    for stage, h in after.items():
        b = before.get(stage, {"le": {}, "sum": 0.0, "count": 0.0})
        n = h["count"] - b["count"]
        if n <= 0:
            continue
        bounds = sorted(h["le"])
        cum = [h["le"][x] - b["le"].get(x, 0.0) for x in bounds]

        def quantile(q: float) -> float | None:
            target, lo, prev = q * n, 0.0, 0.0
            for bound, c in zip(bounds, cum):
                if c >= target:
                    if bound == float("inf"):
                        return None  # beyond the last finite bucket
                    return 1e3 * (lo + (bound - lo) * (target - prev) / max(c - prev, 1e-9))
                lo, prev = bound, c
            return None

        out[stage] = {"n": int(n), "mean": round(1e3 * (h["sum"] - b["sum"]) / n, 1),
                      "p50": _round(quantile(0.5)), "p95": _round(quantile(0.95))}
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sessions", default="64,256,512", help="N for finals-only levels (comma-separated)")
    p.add_argument("--partial-sessions", default="32,128", help="N for levels with partials on ('' for none)")
    p.add_argument("--seconds", type=float, default=60.0, help="streaming time per level (each session then "
                                                               "goes on to its next pause)")
    p.add_argument("--chunk-ms", type=int, default=40)
    p.add_argument("--partial-hop-ms", type=int, default=1000)
    p.add_argument("--procs", type=int, default=None, help="client processes (default: one per 128 sessions)")
    p.add_argument("--max-batch", type=int, default=None, help="the server's slots (default: its own)")
    p.add_argument("--warmup", default="full", choices=("full", "request", "none"))
    p.add_argument("--ramp", type=float, default=None,
                   help="seconds over which a level's sessions start (default: the audio's mean turn period)")
    p.add_argument("--audio", nargs="+", default=(), metavar="FILE",
                   help="speech the sessions stream (default: espeak-ng speech made by the load generator)")
    p.add_argument("--tokens-per-s", type=float, default=3.0,
                   help="every prompt decodes this many tokens per second of audio (random weights never stop on "
                        "their own; default 3, about what speech gives; 0 = the server's own budgets)")
    p.add_argument("--decoder-text", default="steady", choices=DECODER_TEXTS,
                   help="steady: the checkpoint's copy that writes ' a a a' whatever the audio, so that drafts "
                        "agree and partials go out (scripts/bench/steady_checkpoint.py; same work per token; "
                        "written once next to the checkpoint as FOLDER-steady); "
                        "random: the checkpoint as it is (drafts never agree)")
    p.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                   help="a flag for glmasr serve (repeatable; e.g. --server-flag=--max-batch=128)")
    p.add_argument("--profile-s", type=float, default=0.0,
                   help="py-spy every server process for this many seconds in each level (0: off)")
    p.add_argument("--profile-idle", action="store_true",
                   help="the profile samples blocked threads too (where each waits: the GIL, a lock, a sync)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the logs and rows")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

    folder = args.model or ensure_full_size_checkpoint()
    report = run(folder, args.device, _sizes(args.sessions), _sizes(args.partial_sessions), args.seconds,
                 args.chunk_ms, args.partial_hop_ms, args.procs, args.max_batch, args.warmup, Path(args.out),
                 ramp_s=args.ramp, audio=tuple(args.audio), tokens_per_s=args.tokens_per_s or None,
                 server_flags=tuple(args.server_flag), profile_s=args.profile_s,
                 profile_idle=args.profile_idle, decoder_text=args.decoder_text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
