"""End-to-end latency of the engine's CUDA path with each frontend (fused cuFFTDx vs torch.stft recipe) on the
full-size random bf16 checkpoint: 3.5 s clip, 13 forced tokens, medians after warm-up. Writes $OUT/integration.json."""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmasr  # noqa: E402
from glmasr.random_checkpoint import build_checkpoint  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
folder = Path("/tmp/glmasr-full-random")
if not (folder / "model.safetensors").exists():
    build_checkpoint(folder, size="full", layout="shipped", seed=0, device="cuda", dtype=torch.bfloat16)
asr = glmasr.load(folder, device="cuda")
clip = (torch.randn(56000, generator=torch.Generator().manual_seed(0)) * 0.1).numpy()
report = {"device": torch.cuda.get_device_name(0), "model": repr(asr)}
for frontend in ("cuda", "torch"):
    asr.frontend = frontend
    runs = []
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
        torch.cuda.synchronize()
        if i >= 3:
            runs.append((1e3 * (time.perf_counter() - t0), r.timings_ms))
    report[frontend] = {"median_total_ms": statistics.median(t for t, _ in runs),
                        "median_features_ms": statistics.median(s["features_ms"] for _, s in runs),
                        "median_encoder_ms": statistics.median(s["encoder_ms"] for _, s in runs),
                        "median_decoder_ms": statistics.median(s["decoder_ms"] for _, s in runs)}
(OUT / "integration.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
