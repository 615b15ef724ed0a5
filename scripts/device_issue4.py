"""Issue 3-of-4 end-to-end GPU check (run on the H200 via scripts/device_issue4.sh).

Full-size GLM-ASR config, random bf16 weights, one process:
1. teacher-forced logits (3.5 s clip + 20 forced tokens): Triton path vs plain-torch path (same weights, bf16),
   both vs the plain-torch path in fp32;
2. one decode step (whole decoder + lm head + argmax) captured in a CUDA graph, batch 1/8/64 at contexts
   64/512/4096, vs the bare cuBLAS GEMM graph over the same weights, and vs the weight-streaming floor;
3. encoder (+ projector) ms per 30 s window at batch 1/8/32, Triton path vs plain-torch path.
Writes $OUT/issue4_e2e.json and prints tables.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmasr  # noqa: E402
from glmasr.api import teacher_forced_logits  # noqa: E402
from glmasr.models.kv_cache import KVCache  # noqa: E402
from glmasr.random_checkpoint import ensure_full_size_checkpoint  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

# copy peak (read + write bytes) measured here, for the floors
buf = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=dev)
dst = torch.empty_like(buf)
for _ in range(3):
    dst.copy_(buf)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10):
    dst.copy_(buf)
e.record()
torch.cuda.synchronize()
copy_peak = 2 * buf.numel() * 10 / (s.elapsed_time(e) * 1e-3)
report["copy_peak_GBps"] = copy_peak / 1e9
del buf, dst

folder = ensure_full_size_checkpoint()
fast = glmasr.load(folder, device="cuda", backend="triton")
ref = glmasr.GlmAsr(fast.config, fast.model.reference, fast.prompts, fast.folder)  # same weights, torch path

# ---- 1. logits
g = torch.Generator().manual_seed(0)
clip = (torch.randn(int(3.5 * 16000), generator=g) * 0.1).numpy()
forced = torch.randint(0, 59246, (20,), generator=g).tolist()
lf, ids_f = teacher_forced_logits(fast, clip, forced, sampling_rate=16000)
lr, ids_r = teacher_forced_logits(ref, clip, forced, sampling_rate=16000)
assert ids_f == ids_r
ref32 = glmasr.load(folder, device="cuda", dtype="float32", backend="torch")
l32, _ = teacher_forced_logits(ref32, clip, forced, sampling_rate=16000)
del ref32
torch.cuda.empty_cache()


def compare(a, b):
    per_pos = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return {"max_rel_err": per_pos.max().item(), "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


report["logits_triton_bf16_vs_torch_bf16"] = compare(lf, lr)
report["logits_triton_bf16_vs_torch_fp32"] = compare(lf, l32)
report["logits_torch_bf16_vs_torch_fp32"] = compare(lr, l32)


# ---- 2. decode step in a CUDA graph
def graph_time_ms(fn, replays=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / replays)
    return statistics.median(times)


model = fast.model
cfg = fast.config.text
weight_bytes = sum(t.numel() * t.element_size() for lw in model.dec_layers
                   for t in (lw.w_qkv, lw.w_o, lw.w_gate_up, lw.w_down)) + model.lm_head.numel() * 2
report["decoder_weight_bytes"] = weight_bytes
floor_ms = weight_bytes / copy_peak * 1e3  # reading weights at copy-peak speed (conservative: reads only)
report["weight_streaming_floor_ms"] = floor_ms

decode_rows = []
for batch in (1, 8, 64):
    for ctx in (64, 512, 4096):
        cache = KVCache(cfg, batch, ctx + 1, dev, torch.bfloat16)
        cache.k.normal_(0, 0.5)
        cache.v.normal_(0, 0.5)
        tok = torch.randint(0, cfg.vocab_size, (batch,), device=dev)
        pos = torch.full((batch, 1), ctx, device=dev, dtype=torch.long)

        def step():
            h = model.decode(model.embed_tokens(tok)[:, None], pos, cache, kv_len=ctx + 1)
            tok.copy_(model.logits(h[:, 0]).argmax(-1))

        ms = graph_time_ms(step)
        decode_rows.append({"batch": batch, "context": ctx, "step_ms": ms, "pct_of_floor": 100 * floor_ms / ms})
        del cache
    x = torch.randn(batch, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(batch, cfg.intermediate_size, device=dev, dtype=torch.bfloat16)

    def bare():
        for lw in model.dec_layers:
            F.linear(x, lw.w_qkv)
            F.linear(x, lw.w_o)
            F.linear(x, lw.w_gate_up)
            F.linear(xi, lw.w_down)
        F.linear(x, model.lm_head)

    bare_ms = graph_time_ms(bare)
    for r in decode_rows:
        if r["batch"] == batch:
            r["bare_gemm_ms"] = bare_ms
            r["vs_bare_gemm"] = r["step_ms"] / bare_ms
report["decode_step_graph"] = decode_rows


# ---- 3. encoder per window
def events_ms(fn, runs=5):
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


enc_rows = []
with torch.inference_mode():
    for w in (1, 8, 32):
        feats = torch.randn(w, 128, 3000, device=dev)
        tf = events_ms(lambda: model.encode_audio(feats))
        tr = events_ms(lambda: ref.model.encode_audio(feats))
        enc_rows.append({"windows": w, "triton_ms_per_window": tf / w, "torch_ms_per_window": tr / w})
report["encoder"] = enc_rows

(OUT / "issue4_e2e.json").write_text(json.dumps(report, indent=2))
print(json.dumps({k: v for k, v in report.items() if k not in ("decode_step_graph", "encoder")}, indent=2))
print(f"\ncopy peak {report['copy_peak_GBps']:.0f} GB/s; decoder weights {weight_bytes / 1e9:.2f} GB; "
      f"floor {floor_ms:.3f} ms/step")
print("| batch | context | decode step (graph) ms | bare cuBLAS GEMM graph ms | step / bare | % of floor |")
print("|---|---|---|---|---|---|")
for r in decode_rows:
    print(f"| {r['batch']} | {r['context']} | {r['step_ms']:.3f} | {r['bare_gemm_ms']:.3f} | {r['vs_bare_gemm']:.3f} | "
          f"{r['pct_of_floor']:.0f}% |")
print("| windows | encoder+projector Triton path ms/window | plain-torch path ms/window |")
print("|---|---|---|")
for r in enc_rows:
    print(f"| {r['windows']} | {r['triton_ms_per_window']:.2f} | {r['torch_ms_per_window']:.2f} |")
