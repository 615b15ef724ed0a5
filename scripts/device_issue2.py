"""Issue 1-of-4 GPU check (run on the H200 through the device tool; see scripts/device_issue2.sh).

Full-size GLM-ASR config with random bf16 weights:
1. teacher-forced logits of our model vs transformers bf16 (same weights, loaded back from disk so that RoPE
   inv_freq stays fp32 on both sides) over a 3.5 s clip + 20 forced tokens: max relative error, top-1
   agreement; both also against a transformers fp32 reference for context;
2. end-to-end wall time (waveform in memory -> text) for the 3.5 s clip with 13 forced tokens, ours vs
   transformers eager generate, medians after warm-up, in the same process.
Writes JSON to $OUT/issue2_gpu_check.json and prints a table.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmasr  # noqa: E402
from glmasr.api import teacher_forced_logits  # noqa: E402
from glmasr.random_checkpoint import build_checkpoint  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
folder = Path("/tmp/glmasr-full-random")
dev = torch.device("cuda")
report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
import transformers  # noqa: E402

report["transformers"] = transformers.__version__

t = time.perf_counter()
build_checkpoint(folder, size="full", layout="shipped", seed=0, device="cuda", dtype=torch.bfloat16)
torch.cuda.empty_cache()
report["build_checkpoint_s"] = time.perf_counter() - t

t = time.perf_counter()
asr = glmasr.load(folder, device="cuda", backend="torch")
torch.cuda.synchronize()
report["glmasr_load_s"] = time.perf_counter() - t

from transformers import AutoProcessor, GlmAsrForConditionalGeneration  # noqa: E402

t = time.perf_counter()
hf = GlmAsrForConditionalGeneration.from_pretrained(str(folder), dtype=torch.bfloat16, device_map="cuda").eval()
report["hf_load_s"] = time.perf_counter() - t
processor = AutoProcessor.from_pretrained(str(folder))

import soundfile as sf  # noqa: E402

speech, rate = sf.read(str(Path(__file__).resolve().parent.parent / "assets" / "speech_en.flac"), dtype="float32")
assert rate == 16000
clip = speech[: int(3.5 * 16000)]
rng = np.random.default_rng(0)
forced = rng.integers(0, 59246, size=20).tolist()

ours, prompt_ids = teacher_forced_logits(asr, clip, forced, sampling_rate=16000)
inputs = processor.apply_transcription_request([clip]).to("cuda")
assert inputs["input_ids"][0].tolist() == prompt_ids, "prompt ids differ from the processor's"
ids = torch.cat([inputs["input_ids"], torch.tensor([forced], device=dev)], dim=1)


def hf_logits(model, dtype):
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                    input_features=inputs["input_features"].to(dtype),
                    input_features_mask=inputs["input_features_mask"])
    return out.logits[0, len(prompt_ids) - 1:].float()


ref_bf16 = hf_logits(hf, torch.bfloat16)
hf32 = GlmAsrForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32, device_map="cuda").eval()
ref_fp32 = hf_logits(hf32, torch.float32)
del hf32
torch.cuda.empty_cache()


def compare(a, b):
    per_pos = ((a - b).abs().amax(-1) / b.abs().amax(-1))
    return {"max_rel_err": per_pos.max().item(), "mean_rel_err": per_pos.mean().item(),
            "max_abs_err": (a - b).abs().max().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "positions": a.shape[0]}


report["prompt_tokens"] = len(prompt_ids)
report["ours_bf16_vs_hf_bf16"] = compare(ours, ref_bf16)
report["ours_bf16_vs_hf_fp32"] = compare(ours, ref_fp32)
report["hf_bf16_vs_hf_fp32"] = compare(ref_bf16, ref_fp32)


def timed(fn, warmup, runs):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": runs}


def ours_e2e():
    r = glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
    assert len(r.token_ids) == 13
    return r


def hf_e2e():
    x = processor.apply_transcription_request([clip]).to("cuda")
    x["input_features"] = x["input_features"].to(torch.bfloat16)
    out = hf.generate(**x, do_sample=False, min_new_tokens=13, max_new_tokens=13)
    processor.batch_decode(out[:, x["input_ids"].shape[1]:], skip_special_tokens=True)


report["e2e_3.5s_13tok_ours_reference_path"] = timed(ours_e2e, 3, 10)
report["e2e_3.5s_13tok_transformers_eager"] = timed(hf_e2e, 2, 5)
stages = ours_e2e().timings_ms
report["ours_stage_ms"] = stages

(OUT / "issue2_gpu_check.json").write_text(json.dumps(report, indent=2))

# The Triton path on the same checkpoint (issue 3 of 4): logits vs transformers bf16 and vs our torch path.
try:
    fast = glmasr.load(folder, device="cuda", backend="triton")
    fast_logits, fast_ids = teacher_forced_logits(fast, clip, forced, sampling_rate=16000)
    assert fast_ids == prompt_ids
    report["fast_bf16_vs_hf_bf16"] = compare(fast_logits, ref_bf16)
    report["fast_bf16_vs_ours_torch_bf16"] = compare(fast_logits, ours)
    report["fast_bf16_vs_hf_fp32"] = compare(fast_logits, ref_fp32)

    def fast_e2e():
        r = glmasr.transcribe(clip, model=fast, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
        assert len(r.token_ids) == 13

    report["e2e_3.5s_13tok_ours_triton_path"] = timed(fast_e2e, 3, 10)
except Exception as e:  # report, do not lose the reference-path results above
    import traceback

    traceback.print_exc()
    report["fast_error"] = repr(e)
(OUT / "issue2_gpu_check.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
c = report["ours_bf16_vs_hf_bf16"]
print("\n| check (H200, full-size config, random bf16 weights) | value |")
print("|---|---|")
print(f"| logits max rel err, ours bf16 vs transformers bf16 ({c['positions']} positions) | {c['max_rel_err']:.4f} |")
print(f"| top-1 agreement, ours bf16 vs transformers bf16 | {c['top1_agreement']:.3f} |")
print(f"| max rel err vs fp32: ours / transformers bf16 | {report['ours_bf16_vs_hf_fp32']['max_rel_err']:.4f} / "
      f"{report['hf_bf16_vs_hf_fp32']['max_rel_err']:.4f} |")
print(f"| e2e 3.5 s + 13 tokens, ours (reference path), median | {report['e2e_3.5s_13tok_ours_reference_path']['median_ms']:.1f} ms |")
if "fast_bf16_vs_hf_bf16" in report:
    f = report["fast_bf16_vs_hf_bf16"]
    print(f"| Triton path: logits max rel err / top-1 vs transformers bf16 | {f['max_rel_err']:.4f} / {f['top1_agreement']:.3f} |")
    print(f"| e2e 3.5 s + 13 tokens, ours (Triton path), median | {report['e2e_3.5s_13tok_ours_triton_path']['median_ms']:.1f} ms |")
print(f"| e2e 3.5 s + 13 tokens, transformers eager, median | {report['e2e_3.5s_13tok_transformers_eager']['median_ms']:.1f} ms |")
