"""GPU checks of our model against transformers on the full-size GLM-ASR config with random bf16 weights (the
full-size checkpoint of ``glmasr.checkpoint.random_weights``, built on the GPU once per machine), in one process.

Parts (default: all, in this order; each is kept when a later one fails):
  logits   teacher-forced logits over a 3.5 s clip + 20 forced tokens (21 predicted positions): ours (plain-torch
           bf16, Triton bf16, plain-torch fp32) and transformers GlmAsrForConditionalGeneration (bf16, fp32), all on
           the same checkpoint; per pair the max over positions of max|a-b| / max|b| and the top-1 agreement
  e2e      waveform in memory -> text, 3.5 s clip, 13 forced tokens: ours on the plain-torch path and the Triton
           path, transformers eager generate(); medians after warm-up
  decode   one decode step (embedding, decoder, lm head, argmax) captured in a CUDA graph at batch 1/8/64 and
           context 64/512/4096, against the bare cuBLAS GEMM graph over the same weights and the weight-streaming
           floor (decoder weight bytes / device-to-device copy peak measured in this run)
  encoder  encoder + projector ms per 30 s window at 1/8/32 windows, Triton path vs plain-torch path

    python -m scripts.bench.gpu_check [logits] [e2e] [decode] [encoder] [--clip speech|noise] [--out DIR]

``--clip speech`` (default) is assets/speech_en.flac (needs soundfile), ``noise`` Gaussian noise (x 0.1, seed 0).
Writes DIR/gpu_check.json (DIR: --out, else $OUT, else ./out) after every part and prints a table per part.
(These were two one-off programs, scripts/device_issue2.py and scripts/device_issue4.py.)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import pkgutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import glmasr
from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint

ROOT = Path(__file__).resolve().parents[2]  # the checkout root (the speech sample)

PARTS = ("logits", "e2e", "decode", "encoder")
# the models each part uses (dropped once no later part needs them)
NEEDS = {"logits": {"ours_torch", "ours_triton", "ours_torch_fp32", "hf_bf16", "hf_fp32"},
         "e2e": {"ours_torch", "ours_triton", "hf_bf16"}, "decode": {"ours_triton"},
         "encoder": {"ours_triton", "ours_torch"}}
DEV = torch.device("cuda")
FORCED_TOKENS = 20
FORCED_VOCAB = 59246  # forced ids below the special tokens


def find_attr(name: str, modules: tuple[str, ...]):
    """``name`` from the first of ``modules`` that has it, else from any glmasr submodule (the package is being
    reorganised: look it up rather than pin one module path)."""
    for mod in modules:
        try:
            obj = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            obj = None
        if obj is not None:
            return obj
    for info in pkgutil.walk_packages(glmasr.__path__, "glmasr."):
        try:
            obj = getattr(importlib.import_module(info.name), name, None)
        except Exception:  # a module that does not import here (optional dependency)
            continue
        if obj is not None:
            return obj
    raise ImportError(f"{name} not found in glmasr")


def teacher_forced_logits(*args, **kwargs):
    return find_attr("teacher_forced_logits", ("glmasr", "glmasr.pipeline", "glmasr.api"))(*args, **kwargs)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a vs reference b, (positions, vocab) float logits."""
    per_pos = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return {"max_rel_err": per_pos.max().item(), "mean_rel_err": per_pos.mean().item(),
            "max_abs_err": (a - b).abs().max().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "positions": a.shape[0]}


def timed(fn, warmup: int, runs: int) -> dict:
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


def graph_time_ms(fn, replays: int = 50) -> float:
    """ms per call of ``fn`` captured in a CUDA graph (scripts/bench/graph_timing.py): median over ``replays``
    timed replays after an eager warm-up."""
    from scripts.bench.graph_timing import graph_call_us

    return graph_call_us([fn], repeats=1, replays=replays, warmup_passes=3) / 1e3


def events_ms(fn, runs: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def copy_peak_bytes_per_s() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    buf = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(buf)
    for _ in range(3):
        dst.copy_(buf)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        dst.copy_(buf)
    e.record()
    torch.cuda.synchronize()
    peak = 2 * buf.numel() * 10 / (s.elapsed_time(e) * 1e-3)
    del buf, dst
    torch.cuda.empty_cache()
    return peak


class Models:
    """The models of the checks, loaded on first use, dropped when no later part needs them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._loaded: dict = {}
        self.load_s: dict = {}
        self.processor = None

    def get(self, name: str):
        if name not in self._loaded:
            t = time.perf_counter()
            if name == "ours_triton":
                m = glmasr.load(self.folder, device="cuda", backend="triton")
            elif name == "ours_torch":
                m = glmasr.load(self.folder, device="cuda", backend="torch")
            elif name == "ours_torch_fp32":
                m = glmasr.load(self.folder, device="cuda", dtype="float32", backend="torch")
            elif name in ("hf_bf16", "hf_fp32"):
                from transformers import GlmAsrForConditionalGeneration

                dtype = torch.bfloat16 if name == "hf_bf16" else torch.float32
                m = GlmAsrForConditionalGeneration.from_pretrained(str(self.folder), dtype=dtype,
                                                                   device_map="cuda").eval()
            else:
                raise KeyError(name)
            torch.cuda.synchronize()
            self.load_s[name] = time.perf_counter() - t
            self._loaded[name] = m
        return self._loaded[name]

    def hf_processor(self):
        if self.processor is None:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(str(self.folder))
        return self.processor

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def drop(self, *names: str):
        for n in names:
            self._loaded.pop(n, None)
        gc.collect()
        torch.cuda.empty_cache()


def load_clip(kind: str) -> np.ndarray:
    n = int(3.5 * 16000)
    if kind == "speech":
        import soundfile as sf

        speech, rate = sf.read(str(ROOT / "assets" / "speech_en.flac"), dtype="float32")
        assert rate == 16000, rate
        return speech[:n]
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=g) * 0.1).numpy()


# ---------------------------------------------------------------- parts

LOGIT_PAIRS = (("ours_torch_bf16", "hf_bf16"), ("ours_torch_bf16", "hf_fp32"), ("hf_bf16", "hf_fp32"),
               ("ours_triton_bf16", "hf_bf16"), ("ours_triton_bf16", "ours_torch_bf16"),
               ("ours_triton_bf16", "hf_fp32"), ("ours_triton_bf16", "ours_torch_fp32"),
               ("ours_torch_bf16", "ours_torch_fp32"), ("ours_torch_fp32", "hf_fp32"))


def part_logits(models: Models, clip: np.ndarray, report: dict) -> list[str]:
    vocab = min(FORCED_VOCAB, models.get("ours_torch").config.text.vocab_size)
    forced = np.random.default_rng(0).integers(0, vocab, size=FORCED_TOKENS).tolist()
    logits, prompt_ids = {}, None
    for name, model in (("ours_torch_bf16", "ours_torch"), ("ours_triton_bf16", "ours_triton"),
                        ("ours_torch_fp32", "ours_torch_fp32")):
        lg, ids = teacher_forced_logits(models.get(model), clip, forced, sampling_rate=16000)
        assert prompt_ids is None or ids == prompt_ids, f"{name}: prompt ids differ between our paths"
        prompt_ids = ids
        logits[name] = lg.float()
    models.drop("ours_torch_fp32")
    processor = models.hf_processor()
    inputs = processor.apply_transcription_request([clip]).to("cuda")
    assert inputs["input_ids"][0].tolist() == prompt_ids, "prompt ids differ from the transformers processor's"
    ids = torch.cat([inputs["input_ids"], torch.tensor([forced], device=DEV)], dim=1)
    for name in ("hf_bf16", "hf_fp32"):
        dtype = torch.bfloat16 if name == "hf_bf16" else torch.float32
        with torch.inference_mode():
            out = models.get(name)(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   input_features=inputs["input_features"].to(dtype),
                                   input_features_mask=inputs["input_features_mask"])
        logits[name] = out.logits[0, len(prompt_ids) - 1:].float()
    models.drop("hf_fp32")
    report["prompt_tokens"] = len(prompt_ids)
    report["logits"] = {f"{a}_vs_{b}": compare(logits[a], logits[b]) for a, b in LOGIT_PAIRS}
    lines = [f"logits, {logits['hf_bf16'].shape[0]} positions (max over positions of max|a-b| / max|b|; top-1 = "
             "argmax agreement)", "| pair | max rel err | mean rel err | top-1 |", "|---|---|---|---|"]
    for a, b in LOGIT_PAIRS:
        c = report["logits"][f"{a}_vs_{b}"]
        lines.append(f"| {a} vs {b} | {c['max_rel_err']:.4f} | {c['mean_rel_err']:.4f} | "
                     f"{round(c['top1_agreement'] * c['positions'])}/{c['positions']} |")
    return lines


def part_e2e(models: Models, clip: np.ndarray, report: dict) -> list[str]:
    def ours(name):
        asr = models.get(name)

        def run():
            r = glmasr.transcribe(clip, model=asr, sampling_rate=16000, max_new_tokens=13, ignore_eos=True)
            assert len(r.token_ids) == 13, len(r.token_ids)
            return r
        return run

    processor = models.hf_processor()
    hf = models.get("hf_bf16")

    def hf_eager():
        x = processor.apply_transcription_request([clip]).to("cuda")
        x["input_features"] = x["input_features"].to(torch.bfloat16)
        with torch.inference_mode():
            out = hf.generate(**x, do_sample=False, min_new_tokens=13, max_new_tokens=13)
        processor.batch_decode(out[:, x["input_ids"].shape[1]:], skip_special_tokens=True)

    rows = report["e2e_3.5s_13tok"] = {}
    rows["ours_torch_path"] = timed(ours("ours_torch"), 3, 10)
    rows["ours_triton_path"] = timed(ours("ours_triton"), 3, 10)
    rows["ours_triton_path"]["stages_ms"] = ours("ours_triton")().timings_ms
    rows["transformers_eager"] = timed(hf_eager, 2, 5)
    lines = ["waveform in memory -> text, 3.5 s clip, 13 forced tokens (median ms)", "| engine | median ms | min ms |",
             "|---|---|---|"]
    lines += [f"| {k} | {v['median_ms']:.1f} | {v['min_ms']:.1f} |" for k, v in rows.items()]
    return lines


def part_decode(models: Models, report: dict) -> list[str]:
    KVCache = find_attr("KVCache", ("glmasr.models.kv_cache", "glmasr.engine.kv_cache"))
    copy_peak = report.setdefault("copy_peak_GBps", copy_peak_bytes_per_s() / 1e9) * 1e9
    fast = models.get("ours_triton")
    model, cfg = fast.model, fast.config.text
    weight_bytes = model.decoder.weight_bytes()
    floor_ms = weight_bytes / copy_peak * 1e3  # reading the weights at copy-peak speed (copy peak counts r + w)
    report["decoder_weight_bytes"] = weight_bytes
    report["weight_streaming_floor_ms"] = floor_ms
    rows = []
    for batch in (1, 8, 64):
        for ctx in (64, 512, 4096):
            cache = KVCache(cfg, batch, ctx + 1, DEV, torch.bfloat16)
            cache.k.normal_(0, 0.5)
            cache.v.normal_(0, 0.5)
            tok = torch.randint(0, cfg.vocab_size, (batch,), device=DEV)
            pos = torch.full((batch, 1), ctx, device=DEV, dtype=torch.long)

            def step():
                h = model.decode(model.embed_tokens(tok)[:, None], pos, cache, kv_len=ctx + 1)
                tok.copy_(model.logits(h[:, 0]).argmax(-1))

            ms = graph_time_ms(step)
            rows.append({"batch": batch, "context": ctx, "step_ms": ms, "pct_of_floor": 100 * floor_ms / ms})
            del cache
        x = torch.randn(batch, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
        xi = torch.randn(batch, cfg.intermediate_size, device=DEV, dtype=torch.bfloat16)

        def bare():
            for lw in model.decoder.layers:
                F.linear(x, lw.w_qkv)
                F.linear(x, lw.w_o)
                F.linear(x, lw.w_gate_up)
                F.linear(xi, lw.w_down)
            F.linear(x, model.decoder.lm_head)

        bare_ms = graph_time_ms(bare)
        for r in rows:
            if r["batch"] == batch:
                r["bare_gemm_ms"] = bare_ms
                r["vs_bare_gemm"] = r["step_ms"] / bare_ms
    report["decode_step_graph"] = rows
    lines = [f"copy peak {copy_peak / 1e9:.0f} GB/s; decoder weights {weight_bytes / 1e9:.2f} GB; floor "
             f"{floor_ms:.3f} ms/step",
             "| batch | context | decode step (graph) ms | bare cuBLAS GEMM graph ms | step / bare | % of floor |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['step_ms']:.3f} | {r['bare_gemm_ms']:.3f} | "
              f"{r['vs_bare_gemm']:.3f} | {r['pct_of_floor']:.0f}% |" for r in rows]
    return lines


def part_encoder(models: Models, report: dict) -> list[str]:
    fast, ref = models.get("ours_triton"), models.get("ours_torch")
    rows = []
    with torch.inference_mode():
        for w in (1, 8, 32):
            feats = torch.randn(w, fast.config.audio.num_mel_bins, 3000, device=DEV)
            tf = events_ms(lambda: fast.model.encode_audio(feats))
            tr = events_ms(lambda: ref.model.encode_audio(feats))
            rows.append({"windows": w, "triton_ms_per_window": tf / w, "torch_ms_per_window": tr / w})
    report["encoder"] = rows
    lines = ["| windows | encoder+projector Triton path ms/window | plain-torch path ms/window |", "|---|---|---|"]
    lines += [f"| {r['windows']} | {r['triton_ms_per_window']:.2f} | {r['torch_ms_per_window']:.2f} |" for r in rows]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", help=f"any of {PARTS} (default: all)")
    ap.add_argument("--clip", choices=("speech", "noise"), default="speech")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {PARTS}")
    parts = [p for p in PARTS if p in (args.parts or PARTS)]
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "clip": args.clip,
              "parts": parts, "errors": {}}
    t = time.perf_counter()
    folder = ensure_full_size_checkpoint()
    report["checkpoint_s"] = time.perf_counter() - t
    models = Models(folder)
    report["load_s"] = models.load_s
    clip = load_clip(args.clip)
    tables = []
    for part in parts:
        t = time.perf_counter()
        try:
            if part == "logits":
                lines = part_logits(models, clip, report)
            elif part == "e2e":
                lines = part_e2e(models, clip, report)
            elif part == "decode":
                lines = part_decode(models, report)
            else:
                lines = part_encoder(models, report)
            tables.append("\n".join(lines))
            print(tables[-1], flush=True)
        except Exception as e:  # keep the other parts' numbers
            traceback.print_exc()
            report["errors"][part] = repr(e)[:1000]
            print(f"[{part}] failed: {e!r}", flush=True)
        report.setdefault("part_s", {})[part] = time.perf_counter() - t
        print(f"[{part}: {report['part_s'][part]:.0f} s]", flush=True)
        later = set().union(*(NEEDS[p] for p in parts[parts.index(part) + 1:]))
        models.drop(*(set(models.loaded) - later))
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print("\n" + "\n\n".join(tables))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
