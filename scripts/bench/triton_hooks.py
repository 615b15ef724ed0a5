"""Which Triton kernel variants a stretch of code builds, from Triton's JIT hooks (``triton.knobs.runtime``):
used by scripts/benchmark.py (per timed call) and scripts/bench/coldstart_child.py (per request)."""

from __future__ import annotations

import contextlib
import time


class TritonCompiles:
    """Kernel variants built (compiled, or loaded from Triton's disk cache) while active: host ms per kernel and
    the signature of the slowest."""

    def __init__(self):
        self.started, self.done = {}, []
        self.hits, self.misses = [], []  # compilation listener: (kernel, ms) loaded from the disk cache / compiled

    def listener(self, *, src, metadata, times=None, cache_hit=False, **_):
        name = str(getattr(src, "name", None) or metadata.get("name", "?"))
        (self.hits if cache_hit else self.misses).append(name)

    def before(self, *, key, repr, fn, **_):
        self.started[(fn.name, str(key))] = time.perf_counter()
        return False  # a true value would skip the compile

    def after(self, *, key, repr, fn, **_):
        t0 = self.started.pop((fn.name, str(key)), None)
        self.done.append((fn.name, 1e3 * (time.perf_counter() - t0) if t0 else float("nan"), repr))
        return False

    def summary(self) -> dict:
        by_kernel = {}
        for name, ms, _ in self.done:
            n, total = by_kernel.get(name, (0, 0.0))
            by_kernel[name] = (n + 1, total + ms)
        slowest = sorted(self.done, key=lambda d: -d[1])[:12]
        return {"count": len(self.done), "ms": round(sum(d[1] for d in self.done), 1),
                "disk_cache_hits": len(self.hits), "compiled": len(self.misses), "compiled_kernels": self.misses[:40],
                "by_kernel": {k: {"count": n, "ms": round(ms, 1)} for k, (n, ms) in by_kernel.items()},
                "slowest": [{"kernel": k, "ms": round(ms, 1), "signature": r[:400]} for k, ms, r in slowest]}


@contextlib.contextmanager
def triton_compiles():
    """Record the Triton kernel variants built inside the block (``TritonCompiles``); nothing where Triton has
    no such hooks."""
    rec = TritonCompiles()
    try:
        from triton import knobs
    except ImportError:
        yield rec
        return
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, knobs.compilation.listener
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = rec.before, rec.after
    knobs.compilation.listener = rec.listener
    try:
        yield rec
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, knobs.compilation.listener = saved
