"""int8 decode weights (``glmasr.load(..., decode_weights="int8")``) against bf16, on the same checkpoint: what can
be measured without labelled speech, and the speed.

    python -m scripts.bench.int8_agreement [--device cuda|cpu] [--steps N] [--rows R] [--model FOLDER] [--json OUT]

Two handles are loaded from one checkpoint through ``glmasr.load(backend="triton")``, one per ``decode_weights``;
both prefill with the same bf16 weights (so their KV caches and first logits agree exactly) and differ in the
decode step's four GEMVs per layer. Reported, with logits in fp32 and the bf16 handle's as the reference:

* ``random``: ``--rows`` sequences (prompts of random embeddings at the scale of the embedding table), then
  ``--steps`` decode steps on fresh random embeddings (the same for both handles), each on its own KV cache;
* ``teacher_forced``: ``--rows`` sequences; the bf16 handle decodes them greedily for ``--steps`` steps and the
  int8 handle is fed the same tokens (on its own KV cache), so each step compares the two on one token history;

per case: the logits' max and mean absolute difference divided by the std of that row's bf16 logits, and top-1
agreement (the share of steps x rows whose argmax is the same token). On cuda also the decode step's ms/token at
batch 1, contexts 64 and 512, for both (``scripts/benchmark.py``'s CUDA-graph timing of the engine's decode
round: ``decode_runner`` / ``fill_decode_state`` / ``decode_round`` / ``sync_time``), the bytes each step
streams (``KernelDecoder.weight_bytes``) and the memory the int8 copies add.

Model: ``--device cuda`` (default with a GPU): the full-size GLM-ASR checkpoint with random bf16 weights
(``ensure_full_size_checkpoint``, as ``scripts/benchmark.py``); ``--device cpu``: the tiny random checkpoint in
fp32 under the Triton interpreter (the plumbing, in seconds). Random weights: the numbers say how far int8 moves
the logits of a network of this shape, not what it does to a trained model's words: WER has to be checked on
real weights and real data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CONTEXTS = (64, 512)
PROMPT_LEN = {"cuda": 32, "cpu": 5}


def logit_stats(ref, got) -> dict:
    """One step's comparison of logits (rows, vocab), as sums that ``summary`` pools over steps."""
    sd = ref.std(dim=-1, keepdim=True).clamp_min(1e-30)
    rel = (got - ref).abs() / sd
    return {"max_rel": float(rel.max()), "sum_rel": float(rel.sum()), "n": rel.numel(),
            "agree": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": ref.shape[0]}


def summary(steps: list[dict]) -> dict:
    return {"max_abs_err_over_std": max(s["max_rel"] for s in steps),
            "mean_abs_err_over_std": sum(s["sum_rel"] for s in steps) / sum(s["n"] for s in steps),
            "top1_agreement": sum(s["agree"] for s in steps) / sum(s["rows"] for s in steps),
            "decisions": sum(s["rows"] for s in steps)}


def _random_embeds(model, n: int, gen):
    """(n, hidden) random embeddings at the embedding table's scale, in the model's dtype on its device."""
    import torch

    scale = float(model.embedding.float().std())
    return (torch.randn(n, model.cfg.text.hidden_size, generator=gen) * scale).to(model.device, model.dtype)


def _prefilled(models, prompts, capacity: int):
    """Per model: a KV cache holding ``prompts`` (row i = prompt i) and the logits after them."""
    from glmasr.models.kv_cache import KVCache

    out = []
    for m in models:
        cache = KVCache(m.cfg.text, len(prompts), capacity, m.device, m.dtype)
        out.append((cache, m.logits(m.prefill(prompts, cache, list(range(len(prompts)))))))
    return out


def _step(model, cache, embeds, position: int):
    """One decode step of every cache row at ``position`` (embeds (rows, hidden)); fp32 logits (rows, vocab). A
    batch-invariant step: the int8 handle then uses its int8 copies at any row count (a plain step of more than
    ``fast_decoder.INT8_MAX_ROWS`` rows takes the bf16 matrices)."""
    import torch

    pos = torch.full((embeds.shape[0], 1), position, device=embeds.device, dtype=torch.long)
    before, model.batch_invariant = model.batch_invariant, True
    try:
        return model.logits(model.decode(embeds[:, None], pos, cache, kv_len=cache.capacity)[:, 0])
    finally:
        model.batch_invariant = before


def random_case(bf16, int8, rows: int, steps: int, plen: int, seed: int = 0) -> dict:
    """``random`` (module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [_random_embeds(bf16, plen, gen) for _ in range(rows)]
    (cb, first_b), (ci, first_i) = _prefilled((bf16, int8), prompts, plen + steps)
    stats = []
    for i in range(steps):
        x = _random_embeds(bf16, rows, gen)
        stats.append(logit_stats(_step(bf16, cb, x, plen + i), _step(int8, ci, x, plen + i)))
    # both prefill on the model's own weights: their first logits should be identical
    return dict(summary(stats), prefill_logits_identical=bool(torch.equal(first_b, first_i)))


def teacher_forced_case(bf16, int8, rows: int, steps: int, plen: int, seed: int = 1) -> dict:
    """``teacher_forced`` (module docstring): the bf16 handle's greedy tokens fed to both."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [_random_embeds(bf16, plen, gen) for _ in range(rows)]
    (cb, first), (ci, _) = _prefilled((bf16, int8), prompts, plen + steps)
    tokens = first.argmax(-1)
    stats, seen = [], set(tokens.tolist())
    for i in range(steps):
        x = bf16.embed_tokens(tokens)
        ref = _step(bf16, cb, x, plen + i)
        stats.append(logit_stats(ref, _step(int8, ci, x, plen + i)))
        tokens = ref.argmax(-1)
        seen.update(tokens.tolist())
    return dict(summary(stats), distinct_tokens=len(seen))


def decode_ms(asr, contexts=CONTEXTS, steps: int = 8) -> dict:
    """ms per token of the engine's graph-replayed decode round at batch 1 (``scripts/benchmark.py``'s
    ``section_decode`` timing) for each context."""
    from scripts.benchmark import decode_round, decode_runner, fill_decode_state, sync_time

    cfg = asr.config.text
    runner = decode_runner(asr.model, max(contexts) + steps)
    out = {}
    for ctx in contexts:
        fill_decode_state(runner, cfg, ctx)
        out[str(ctx)] = sync_time(decode_round(runner, 1, ctx, steps), 2, 10) / steps
    del runner
    return out


def main(argv=None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per case (default 64 on cuda, 3 on cpu)")
    ap.add_argument("--rows", type=int, default=None,
                    help="sequences of the random case (default 16 on cuda, 2 on cpu)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the random one for the device)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs the Triton path in its interpreter: set TRITON_INTERPRET=1")
    steps = args.steps or (64 if cuda else 3)
    rows = args.rows or (16 if cuda else 2)
    if steps < 1 or rows < 1:
        sys.exit("--steps and --rows must be at least 1")
    import glmasr
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint, ensure_tiny_checkpoint

    folder = args.model or (ensure_full_size_checkpoint() if cuda else ensure_tiny_checkpoint())
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    bf16 = glmasr.load(folder, device=args.device, dtype=dtype, backend="triton", decode_weights="bf16")
    int8 = glmasr.load(folder, device=args.device, dtype=dtype, backend="triton", decode_weights="int8")
    dec_b, dec_i = bf16.model.decoder, int8.model.decoder
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)", "model": str(folder),
              "dtype": str(dtype).replace("torch.", ""), "steps": steps, "rows": rows,
              "load_s": time.perf_counter() - t0,
              "decode_weight_bytes": {"bf16": dec_b.weight_bytes(), "int8": dec_i.weight_bytes()},
              "int8_extra_bytes": sum(m.nbytes() for lw in dec_i.layers for m in lw.int8.matrices())}
    plen = PROMPT_LEN[args.device]
    with torch.inference_mode():
        report["random"] = random_case(bf16.model, int8.model, rows, steps, plen)
        report["teacher_forced"] = teacher_forced_case(bf16.model, int8.model, rows, steps, plen)
    if cuda:
        report["decode_ms_per_token_batch1"] = {"bf16": decode_ms(bf16), "int8": decode_ms(int8)}
    bf16.close()
    int8.close()
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def _print(r: dict) -> None:
    mb = 1e6
    print(f"\n{r['device']}, {r['model']} ({r['dtype']}); int8 copies: +{r['int8_extra_bytes'] / mb:.2f} MB; a decode "
          f"step streams {r['decode_weight_bytes']['bf16'] / mb:.2f} MB (bf16) / "
          f"{r['decode_weight_bytes']['int8'] / mb:.2f} MB (int8)")
    print(f"{'case':<16} {'decisions':>9} {'max|d|/std':>11} {'mean|d|/std':>12} {'top-1 agree':>12}")
    for case in ("random", "teacher_forced"):
        s = r[case]
        print(f"{case:<16} {s['decisions']:>9} {s['max_abs_err_over_std']:>11.4f} {s['mean_abs_err_over_std']:>12.5f} "
              f"{s['top1_agreement']:>12.4f}")
    if "decode_ms_per_token_batch1" in r:
        t = r["decode_ms_per_token_batch1"]
        print(f"{'decode ms/token, batch 1':<26}" + "".join(f"{'ctx ' + c:>10}" for c in t["bf16"]))
        for k in ("bf16", "int8"):
            print(f"{k:<26}" + "".join(f"{v:>10.3f}" for v in t[k].values()))


if __name__ == "__main__":
    main()
