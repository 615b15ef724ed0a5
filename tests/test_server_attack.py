"""The attack run (tests/attack.py) at its smoke size against a real ``glmasr serve`` on 127.0.0.1: decompression
bombs within the stated memory bound, fuzzed fields and file headers without a 5xx and in the envelope, stalled
clients locking nobody out, ambiguous framing refused, vanished clients as one log line each, 64 concurrent clients
with nothing lost."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import attack  # noqa: E402


def test_attack_run_smoke(tmp_path):
    out = tmp_path / "attack.json"
    assert attack.main(["--smoke", "--out", str(out)]) == 0, out.read_text() if out.exists() else "no report"
    report = json.loads(out.read_text())
    assert report["server_alive"]
    assert all(r["within_bound"] for r in report["bombs"]["rows"]), report["bombs"]
    assert report["fuzz"]["5xx"] == 0 and report["fuzz"]["not_in_envelope"] == 0
    assert report["load64"]["lost"] == 0 and report["load64"]["ok"] == report["load64"]["requests"]
    assert report["disconnects"]["tracebacks"] == 0
