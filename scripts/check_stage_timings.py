"""On a GPU: transcribe a clip with a tiny random checkpoint on the Triton path and check that the reported stage
timings (CUDA-event encoder span) add up to the total. Prints them."""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmasr  # noqa: E402
from glmasr.random_checkpoint import build_checkpoint  # noqa: E402

folder = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", size="tiny", layout="shipped")
asr = glmasr.load(folder, device="cuda", dtype=torch.bfloat16, backend="triton")
x = (torch.randn(56000) * 0.1).numpy()
for _ in range(3):
    r = glmasr.transcribe(x, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True, max_batch=1)
t = r.timings_ms
print(asr.frontend, t)
assert abs(t["audio_ms"] + t["encoder_ms"] + t["decoder_ms"] - t["total_ms"]) < 1e-6 * t["total_ms"], t
assert 0 < t["features_ms"] <= t["encoder_ms"] and t["decoder_ms"] > 0, t
print("stage timings OK")
