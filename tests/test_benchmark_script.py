"""benchmark.sh's script runs end to end at toy sizes (``--smoke``), so a GPU run does not fail on plumbing."""

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
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--smoke", "--no-peers",
                        "--only", "latency,decode,breakdown", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["latency"][0]["ours_ms"] > 0
    assert report["decode"][0]["ms_per_token"] > 0
    assert "error" not in report["latency"] and "error" not in report["decode"]
    assert "error" not in report["breakdown"], report["breakdown"]
    assert report["breakdown"]["decode_step_graph_ms"]["default"] > 0


def test_benchmark_rejects_unknown_sections(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--only", "speed",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown sections" in p.stderr
