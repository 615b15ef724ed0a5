"""Engine latency on the H200 (full-size config, random bf16 weights), waveform in memory -> text:
3.5 s clip with 13 and 100 forced tokens (medians after warm-up); decode ms/token from the difference.
Writes $OUT/engine_latency.json."""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmasr  # noqa: E402
from glmasr.random_checkpoint import ensure_full_size_checkpoint  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
folder = ensure_full_size_checkpoint()
asr = glmasr.load(folder, device="cuda")
clip = (torch.randn(56000, generator=torch.Generator().manual_seed(0)) * 0.1).numpy()
report = {"device": torch.cuda.get_device_name(0), "model": repr(asr)}
for n in (13, 100):
    runs = []
    for i in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=n, ignore_eos=True, max_batch=1)
        torch.cuda.synchronize()
        assert len(r.token_ids) == n
        if i >= 3:
            runs.append((1e3 * (time.perf_counter() - t0), r.timings_ms))
    report[f"tokens_{n}"] = {"median_total_ms": statistics.median(t for t, _ in runs),
                             **{k: statistics.median(s[k] for _, s in runs)
                                for k in ("audio_ms", "features_ms", "encoder_ms", "decoder_ms")}}
report["decode_ms_per_token"] = (report["tokens_100"]["median_total_ms"] - report["tokens_13"]["median_total_ms"]) / 87
(OUT / "engine_latency.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
