"""One cold-start measurement in a fresh process (run by the coldstart section of scripts/benchmark.py, once per
case, with the caches it chose in GLMASR_CACHE_DIR / TRITON_CACHE_DIR):

    python -m scripts.bench.coldstart_child CHECKPOINT RESULT.json [--device cuda] [--dtype bfloat16]
        [--backend triton] [--warmup] [--seconds 3.5] [--new-tokens 13] [--mixed N --max-batch B]

Stages, in order, each a wall clock that ends with the GPU synchronised (queued GPU work is charged to the stage
that queued it): ``import torch``; ``import glmasr``; ``glmasr.load`` (and the handle's ``load_timings``, ms per
load stage, as given; with --warmup-background ``load(warmup="background")``, whose captures go on while the
requests run: when they are all done, from the end of load, is reported after the second request); with --warmup ``asr.warmup()`` (and the ms per stage it returns); the first
``glmasr.transcribe`` of a SECONDS clip with NEW_TOKENS forced tokens (and its ``timings_ms``); a second one (the
steady state, for comparison). With --mixed N each request is instead one ``transcribe`` of issue 13's mixed
workload (N clips of 1-30 s, scripts/bench/workloads.py) on an engine of B slots, and RESULT has the audio
seconds, the RTFx and the Triton kernel variants each request built (scripts/bench/triton_hooks.py). RESULT.json is rewritten after every stage, so a crash or a timeout keeps what was
measured; ``t_start`` / ``t_end`` are time.monotonic() (CLOCK_MONOTONIC, comparable with the parent's clock).
"""

import time

T_START = time.monotonic()

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

RESULT: dict = {"t_start": T_START, "stages_ms": {}}


def dump(path: Path) -> None:
    RESULT["t_end"] = time.monotonic()
    path.write_text(json.dumps(RESULT, indent=1))


def as_ms_dict(value, name: str) -> dict:
    """A stage dict as returned by the handle (name -> ms), in its order, numbers only. When its keys carry an
    ``_ms`` suffix, the numbers without one (``weights_bytes``) are no stages: they go to RESULT[name + "_values"]."""
    if not isinstance(value, dict):
        return {}
    nums = {str(k): float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if any(k.endswith("_ms") for k in nums):
        other = {k: v for k, v in nums.items() if not k.endswith("_ms")}
        if other:
            RESULT[f"{name}_values"] = other
        nums = {k: v for k, v in nums.items() if k.endswith("_ms")}
    return nums


def main() -> int:
    args = sys.argv[1:]
    folder, result_path = args[0], Path(args[1])

    def opt(name, default):
        return args[args.index(name) + 1] if name in args else default

    device, dtype, backend = opt("--device", "cuda"), opt("--dtype", "bfloat16"), opt("--backend", "triton")
    seconds, new_tokens, warmup = float(opt("--seconds", "3.5")), int(opt("--new-tokens", "13")), "--warmup" in args
    background = "--warmup-background" in args
    mixed, max_batch = int(opt("--mixed", "0")), opt("--max-batch", None)
    RESULT.update(device=device, dtype=dtype, backend=backend, warmup="background" if background else warmup,
                  clip_s=seconds, new_tokens=new_tokens,
                  mixed_clips=mixed, max_batch=max_batch)
    stages = RESULT["stages_ms"]

    t = time.monotonic()
    import torch

    stages["import_torch"] = 1e3 * (time.monotonic() - t)
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    dump(result_path)
    try:
        t = time.monotonic()
        import glmasr

        stages["import_glmasr"] = 1e3 * (time.monotonic() - t)
        dump(result_path)

        from scripts.bench.triton_hooks import triton_compiles

        t = time.monotonic()
        engine_options = {"max_batch": int(max_batch)} if max_batch else {}
        with triton_compiles() as compiles:
            asr = glmasr.load(folder, device=device, dtype=dtype, backend=backend,
                              **({"warmup": "background"} if background else {}), **engine_options)
            sync()
        stages["load"] = 1e3 * (time.monotonic() - t)
        RESULT["load_triton_compiles"] = compiles.summary()
        t_loaded = time.monotonic()
        RESULT["load_stages_ms"] = as_ms_dict(getattr(asr, "load_timings", {}), "load")
        RESULT["model"] = repr(asr)
        dump(result_path)

        if warmup:
            fn = getattr(asr, "warmup", None)
            if fn is None:
                RESULT["warmup_error"] = "the handle has no warmup()"
            else:
                t = time.monotonic()
                try:
                    got = fn()
                except Exception as e:  # measure the first request anyway (it then compiles lazily)
                    got = {}
                    RESULT["warmup_error"] = repr(e)[:500]
                    traceback.print_exc()
                sync()
                stages["warmup"] = 1e3 * (time.monotonic() - t)
                RESULT["warmup_stages_ms"] = as_ms_dict(got, "warmup")
            dump(result_path)

        from scripts.bench.workloads import mixed_clips, noise_clip

        audio = mixed_clips(mixed) if mixed else noise_clip(seconds, seed=0)
        if mixed:
            RESULT["audio_s"] = sum(len(a) for a in audio) / 16000
        profile = "--profile-first" in args
        for name in ("first_request", "second_request"):
            runner = getattr(getattr(asr, "engine", None), "runner", None)
            before = dict(runner.stats) if runner is not None else {}
            prof = None
            if profile and name == "first_request" and cuda:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            with triton_compiles() as compiles:
                t = time.monotonic()
                r = glmasr.transcribe(audio, model=asr, sampling_rate=16000, max_new_tokens=new_tokens,
                                      ignore_eos=True)
                sync()
                stages[name] = 1e3 * (time.monotonic() - t)
            if prof is not None:
                prof.__exit__(None, None, None)
                RESULT["first_request_profile"] = prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
            RESULT[f"{name}_triton_compiles"] = compiles.summary()
            if runner is not None:  # graph captures, eager rounds, prefills by kind, in this request
                RESULT[f"{name}_runner_stats"] = {k: round(v - before.get(k, 0), 1) for k, v in runner.stats.items()
                                                  if v != before.get(k, 0)}
            if mixed:
                RESULT[f"{name}_RTFx"] = RESULT["audio_s"] / (stages[name] / 1e3)
                RESULT[f"{name}_tokens"] = sum(len(x.token_ids) for x in r)
            else:
                RESULT[f"{name}_timings_ms"] = as_ms_dict(getattr(r, "timings_ms", {}), name)
                RESULT[f"{name}_tokens"] = len(r.token_ids)
            dump(result_path)
        pending = getattr(asr, "background_warmup", None)
        if pending is not None:  # what the background warm-up did, and when it was done (from the end of load)
            got = pending.result(timeout=600)
            RESULT["background_warmup_done_ms"] = 1e3 * (time.monotonic() - t_loaded)
            RESULT["background_warmup_stages_ms"] = as_ms_dict(got, "background_warmup")
            if got.get("errors"):
                RESULT["background_warmup_errors"] = got["errors"]
        if cuda:
            RESULT["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
        close = getattr(asr, "close", None)
        if close is not None:  # stop the engine thread before the interpreter exits
            close()
    except Exception as e:
        RESULT["error"] = repr(e)[:1000]
        traceback.print_exc()
        dump(result_path)
        return 1
    dump(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
