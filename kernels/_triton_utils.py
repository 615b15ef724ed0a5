"""Shared helpers for the Triton kernels in this package (no heavy work at import beyond ``import triton``).

* ``interpreting()``: True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``); the
  launchers then accept CPU tensors and pick small tiles so the interpreter stays fast.
  Under it, importing this module also stops the interpreter from patching ``triton.language`` again at every
  ``@triton.jit`` helper call (``_skip_interpreter_repatching``: the same work each time).
* ``next_pow2``/``cdiv``: integer helpers for tile sizes.
* ``num_sms(device)``: multiprocessor count (cached), used by launch heuristics; a fixed 132 (H200) when
  interpreting or on CPU so heuristics stay deterministic.
* ``as_rows(x)``: view a (..., N) tensor as (M, N) with unit stride in the last dim, copying only if needed.
* ``residual_rows``: the residual / new-residual buffers of the norm launchers fused with a residual add.
* ``pdl_enabled(device)`` / ``set_pdl``: whether the kernels of the decode-step chain launch with programmatic
  dependent launch (PDL, sm_90+), and the in-kernel ``pdl_begin`` / ``pdl_wait`` helpers (see below).

PDL (Hopper's griddepcontrol): a kernel launched with ``launch_pdl=True`` may start while the kernel before
it in the stream is still running, as soon as every program of that kernel has executed ``pdl_begin``. The
contract every PDL kernel here keeps: it calls ``pdl_begin`` first, then reads only data no kernel of the
chain writes (weights, norm gains; and data settled before the chain began: what earlier steps or an ordinary,
non-PDL launch ahead of the chain wrote, such as the decode step's positions, lengths and the KV cache's earlier
positions) until ``pdl_wait``, which blocks until the previous kernel has
finished and its writes are visible; it writes nothing before ``pdl_wait`` and every program executes
``pdl_wait`` (so the wait is transitive: finishing implies everything earlier finished). The gain is the
launch latency and ramp of each small decode kernel, overlapped with the tail of the one before, and for the
GEMVs the first weight tile already in flight. Off under the interpreter, below sm_90, or with ``set_pdl(False)``
(a switch for tests and benchmarks that compare PDL with plain launches).

* ``compile_ahead()``: a context in which this thread's Triton launches only compile, all on a thread pool at
  once, and launch nothing; on exit every compile has finished and is in the kernels' caches. For a dry pass
  over the code paths a warm-up will take, so cold caches cost the longest compile instead of their sum.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _skip_interpreter_repatching() -> None:
    """Under the interpreter (CPU development and CI): Triton's interpreter patches ``triton.language`` for a
    kernel's launch and restores it after (``_patch_lang``), and patches it again, never restored, at every call
    of a ``@triton.jit`` helper inside the kernel, although nothing changes then: the same functions replace the
    same builtins (its cost: notes/measurements.md, nineteenth session). Skipped when every language
    module the helper sees is patched already (its ``load`` is no longer the builtin); any other call, and any
    Triton without these internals, keeps Triton's own path."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, scope = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope is None or getattr(patch_lang, "skips_repatching", False):
        return

    def _patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and all(hasattr(lang, "load") and not tl.core.is_builtin(lang.load) for lang in langs):
            return scope()  # patched by the launch running this helper, which restores it
        return patch_lang(fn)

    _patch_lang.skips_repatching = True
    interpreter._patch_lang = _patch_lang


if interpreting():
    _skip_interpreter_repatching()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None = None) -> int:
    device = torch.device(device) if device is not None else None
    if interpreting() or device is None or device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(…, N) -> (M, N) with stride(-1) == 1; a view whenever the leading dims collapse."""
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:
        return x.reshape(-1, n)


def residual_rows(x2: torch.Tensor, residual: torch.Tensor | None, shape: torch.Size):
    """For the norm launchers fused with a residual add: (residual rows, new-residual rows, new residual).
    Without a residual, x's rows stand in for both pointers (never read or written: HAS_RES is off)."""
    if residual is None:
        return x2, x2, None
    if residual.shape != shape or residual.dtype != x2.dtype:
        raise ValueError("residual must have x's shape and dtype")
    new_res = torch.empty(shape, device=x2.device, dtype=x2.dtype)
    return as_rows(residual), new_res.view(-1, shape[-1]), new_res


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors only under the interpreter."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(f"Triton kernel needs CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 for CPU")


def row_tile(n: int, target_elems: int = 4096, max_rows: int = 64) -> tuple[int, int]:
    """Tile (BLOCK_M, BLOCK_N) for row-wise kernels: whole row in BLOCK_N, several rows per program when short."""
    block_n = next_pow2(n)
    block_m = max(1, min(max_rows, target_elems // block_n))
    return block_m, block_n


def warps_for(elems: int) -> int:
    """Warps for a tile of ``elems`` elements: ~8-16 elements per thread."""
    if elems >= 16384:
        return 16
    if elems >= 4096:
        return 8
    if elems >= 1024:
        return 4
    return 2 if elems >= 256 else 1


_PDL_OVERRIDE: bool | None = None


def set_pdl(enabled: bool | None) -> None:
    """Force PDL on/off for launches from now on (None: back to the default, on); for tests and benchmarks that
    compare PDL with plain launches. Kernels already captured in a CUDA graph keep the mode they were captured
    with."""
    global _PDL_OVERRIDE
    _PDL_OVERRIDE = enabled


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device | None) -> bool:
    if interpreting() or device is None or device.type != "cuda":
        return False
    on = _PDL_OVERRIDE if _PDL_OVERRIDE is not None else True
    return on and _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def prepare_runtime(device: torch.device) -> None:
    """Triton's once-per-process set-up, which its first kernel launch would otherwise pay: the hash of its own
    sources and library (``triton_key``, ~0.3-0.6 s), the ptxas version and the default options' hash (the
    backend part of every cache key). ``glmasr.load`` runs this in a background thread while the weights load, so
    the first kernels only read their cubins from the cache."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import triton_key

        triton_key()
        major, minor = torch.cuda.get_device_capability(device)
        backend = make_backend(GPUTarget("cuda", 10 * major + minor, 32))
        backend.hash()
        backend.parse_options({}).hash()
    except Exception:  # only a head start: the first launch does all of this itself
        pass


def pdl_launch(device: torch.device | None) -> dict:
    """Launch kwargs and the kernel's PDL constexpr: ``kernel[grid](..., **pdl_launch(x.device))``."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Let the next kernel of the stream launch once every program of this one got here (hint, no ordering)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def load_add_residual(X, R, RO, offs_x, offs_r, offs_ro, mask, HAS_RES: tl.constexpr):
    """The norms' residual prologue: x = X[offs_x]; with HAS_RES, x = round(x + R[offs_r]) (added in fp32,
    rounded once to X's dtype, like torch's ``residual + x``), stored to RO[offs_ro] as the new residual."""
    x = tl.load(X + offs_x, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + offs_r, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RO + offs_ro, x, mask=mask)
    return x


@triton.jit
def row_block(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [pid * BLOCK_M, +BLOCK_M) of an (M, N) row-major problem with the whole row in one tile: returns the
    int64 row indices, the column indices, the column mask and the 2-D mask."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    return rows.to(tl.int64), cols, cmask, mask


_dry = threading.local()


def _install_dry_launch() -> None:
    """Wrap ``JITFunction.run`` once so that launches from a thread inside ``compile_ahead`` become warm-ups
    (compile, no launch); other threads are untouched."""
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction.run, "_glmasr_dry", False):
        return
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return original(self, *args, grid=grid, warmup=warmup or getattr(_dry, "on", False), **kwargs)

    run._glmasr_dry = True
    JITFunction.run = run


@contextlib.contextmanager
def compile_ahead(workers: int | None = None):
    """Context (yields True, or False where it does nothing: the interpreter): Triton launches from this thread
    compile on ``workers`` threads (default: the CPUs, at most 16) and do not run, so whatever they would have
    written is left unwritten; leaving the context waits for every compile. Only for dry passes whose outputs
    are thrown away (torch ops inside still run, on unwritten data)."""
    if interpreting():
        yield False
        return
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    _install_dry_launch()
    with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1), thread_name_prefix="triton-compile") as pool:
        _dry.on = True
        try:
            with AsyncCompileMode(pool):
                yield True
        finally:
            _dry.on = False
