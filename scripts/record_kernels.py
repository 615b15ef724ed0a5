"""Record the Triton specializations the product compiles on this GPU into a kernel manifest, or check that a
fresh process finds all of them in Triton's disk cache. Run on a CUDA device, from the checkout root:

    python3 -m scripts.record_kernels --out kernels/manifests/sm90.json [--fresh]
    python3 -m scripts.record_kernels --check            # after `glmasr compile` into the same TRITON_CACHE_DIR

Workload (every stage in one process, recorded with ``glmasr_kernels.aot.record`` from before the first launch),
on the full-size random checkpoint (``ensure_full_size_checkpoint``, /tmp/glmasr-full-random, as
scripts/benchmark.py) with a full-size random CTC aligner head (``glmasr.align.random_head``):
  1. ``glmasr.load(..., warmup=True)`` (the full warm-up: every batch bucket, the warm-up KV lengths and prefills);
  2. the KV cache grown to the model's maximum and the decode graphs of every batch bucket x every KV bucket up to
     it, and the prefill graphs of every prefill bucket;
  3. the mixed workload (``scripts/bench/workloads.mixed_clips``, 1-30 s clips, batched);
  4. long-form audio (4 min) with VAD segmentation (the Silero LSTM kernel) and with fixed windows;
  5. word times (the aligner: its encoder pass and the CTC Viterbi kernel), and speakers where the diarizer's
     weights are installed (the diarizer runs on PyTorch ops today; recorded in case that changes);
  6. the same model loaded with ``decode_weights="int8"`` and its full warm-up, and the mixed workload;
  7. ``batch_invariant=True`` (the row-count-independent decode kernels) with its warm-up and a few clips.
The manifest is merged with the file's entries unless ``--fresh``. ``--check`` runs the same stages and counts
the Triton compiles that missed the disk cache (``triton.knobs.compilation.listener``) and whether the log-mel
cubin for this SM was there before the load: exit 1 when anything had to be compiled.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def stages(folder: Path, head: Path, quick: bool):
    """(name, callable) pairs of the workload, in order."""
    import glmasr
    from glmasr.engine.model_runner import BATCH_BUCKETS, MIN_KV_BUCKET, PREFILL_BUCKETS

    from .bench.workloads import mixed_clips, noise_clip

    state: dict = {}
    n_mixed = 16 if quick else 64

    def load():
        state["asr"] = glmasr.load(folder, device="cuda", warmup=True, aligner=str(head))

    def all_buckets(asr):
        def grow_and_warm(eng):
            runner = eng.runner
            runner.ensure_capacity(runner.max_positions)
            kvs, kv = [], MIN_KV_BUCKET
            while kv <= runner.capacity:
                kvs.append(kv)
                kv *= 2
            return eng.warmup(batch_sizes=runner.buckets, kv_lens=tuple(kvs),
                              prefill_lengths=tuple(b for b in PREFILL_BUCKETS if b <= runner.capacity))
        return asr.loop.call(grow_and_warm).result()

    def mixed(asr, n=n_mixed):
        glmasr.transcribe(mixed_clips(n), model=asr, sampling_rate=16000)
        for b in BATCH_BUCKETS[:3]:  # small batches one after the other too
            glmasr.transcribe(mixed_clips(b), model=asr, sampling_rate=16000)

    def longform(asr):
        audio = noise_clip(60.0 if quick else 240.0, seed=7)
        for seg in ("vad", "windows"):
            glmasr.transcribe(audio, model=asr, sampling_rate=16000, segmentation=seg)

    def words_speakers(asr):
        from glmasr.diarize import weights as diarize_weights

        clip = noise_clip(20.0, seed=11)
        glmasr.transcribe(clip, model=asr, sampling_rate=16000, word_timestamps=True, segmentation="vad")
        glmasr.transcribe([clip, noise_clip(9.0, seed=12)], model=asr, sampling_rate=16000, word_timestamps=True)
        if diarize_weights.available():
            glmasr.transcribe(noise_clip(40.0, seed=13), model=asr, sampling_rate=16000, diarize=True,
                              word_timestamps=True)

    def close():
        state.pop("asr").close()
        torch.cuda.empty_cache()

    def int8():
        asr = glmasr.load(folder, device="cuda", warmup=True, decode_weights="int8")
        try:
            mixed(asr, 16)
        finally:
            asr.close()
            torch.cuda.empty_cache()

    def invariant():
        asr = glmasr.load(folder, device="cuda", warmup=True, batch_invariant=True)
        try:
            mixed(asr, 8)
        finally:
            asr.close()
            torch.cuda.empty_cache()

    return [("load(warmup=True)", load), ("every batch x KV bucket", lambda: all_buckets(state["asr"])),
            ("mixed workload", lambda: mixed(state["asr"])),
            ("long-form (vad, windows)", lambda: longform(state["asr"])),
            ("words and speakers", lambda: words_speakers(state["asr"])), ("close", close),
            ("decode_weights=int8", int8), ("batch_invariant", invariant)]


def run_stages(folder: Path, head: Path, quick: bool) -> list[str]:
    errors = []
    for name, fn in stages(folder, head, quick):
        t = time.perf_counter()
        try:
            fn()
            print(f"[record_kernels] {name}: {time.perf_counter() - t:.1f} s", flush=True)
        except Exception:
            errors.append(name)
            print(f"[record_kernels] {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="kernels/manifests/sm90.json", help="the manifest to write (merged)")
    ap.add_argument("--fresh", action="store_true", help="replace the manifest instead of merging into it")
    ap.add_argument("--check", action="store_true",
                    help="record nothing: count the kernels the workload had to compile (exit 1 if any)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the full-size random one)")
    ap.add_argument("--quick", action="store_true", help="shorter audio (a smoke run of this script)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: record_kernels needs a CUDA device", file=sys.stderr)
        return 2
    from glmasr.align.random_head import build_head_for_checkpoint
    from glmasr.checkpoint.random_weights import ensure_full_size_checkpoint
    from glmasr_kernels import aot

    folder = Path(args.model) if args.model else ensure_full_size_checkpoint()
    head = build_head_for_checkpoint(Path(tempfile.gettempdir()) / f"glmasr-ctc-random-{folder.name}", folder,
                                     size="full")
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    t0 = time.perf_counter()
    if args.check:
        from triton import knobs

        from glmasr_kernels.logmel import whisper_config
        from glmasr_kernels.logmel._build import cache_dir, cache_key

        cubin = cache_dir() / f"logmel_{cache_key(whisper_config(128, sm=arch * 10))}.cubin"
        cubin_there = cubin.exists()
        misses, hits = [], [0]

        def listener(*, src, metadata, cache_hit, **_):
            if cache_hit:
                hits[0] += 1
            else:
                consts = {str(k): str(v) for k, v in getattr(src, "constants", {}).items()}
                misses.append(f"{getattr(src, 'fn', src)} {consts}")

        knobs.compilation.listener = listener
        errors = run_stages(folder, head, args.quick)
        knobs.compilation.listener = None
        print(f"[record_kernels --check] {hits[0]} Triton kernels from the disk cache, {len(misses)} compiled; "
              f"log-mel cubin {'found' if cubin_there else 'MISSING'} ({cubin}); "
              f"{time.perf_counter() - t0:.1f} s")
        for m in misses:
            print(f"  compiled: {m}")
        return 1 if errors or misses or not cubin_there else 0
    with aot.record() as rec:
        errors = run_stages(folder, head, args.quick)
    out = Path(args.out)
    if args.fresh and out.exists():
        out.unlink()
    m = aot.write_manifest(rec, out)
    kernels = sorted({f"{e['module']}.{e['qualname']}" for e in rec.entries})
    print(f"[record_kernels] {len(rec.entries)} specializations of {len(kernels)} kernels recorded on sm_{arch}; "
          f"{out} now holds {len(m['entries'])}; {time.perf_counter() - t0:.1f} s")
    for name, why in rec.skipped:
        print(f"  not recordable: {name}: {why}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
