"""Ahead-of-time builds of the kernels' compile caches, so a fresh machine finds every kernel compiled at first use.

Triton compiles a kernel variant (a *specialization*: argument types, 16-byte divisibility of pointers and
integers, constexpr values, launch options) the first time a launch needs it and keeps it in its disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``) under a key made of the Triton build, the kernel's source (and
the sources of the helpers it calls), the specialization, the options, the target (``cuda`` + arch + ptxas version)
and the cache-invalidating environment variables. Which variants a product uses can only be seen by running it on
the GPU; building them needs no GPU at all. So:

* ``record()`` (on the GPU): a context that collects every specialization that reaches Triton's compile step
  (``JITFunction._do_compile``, through ``triton.knobs.runtime.jit_cache_hook``; an existing hook is chained and
  compiles still happen) while the product runs. Start it before the process's first launch: a variant already in
  a kernel's in-memory cache is not compiled again, so it is not seen.
* ``write_manifest(entries, path)``: the manifest, JSON, one entry per specialization, merged with the file's
  entries when it exists (deduplicated, sorted, so a re-recording gives a readable diff), plus the Triton version
  and the target it was recorded on.
* ``build(manifest, arch=90)`` (anywhere, GPU or not): compiles each entry with ``triton.compile`` for
  ``GPUTarget("cuda", arch, 32)``, which writes exactly the cache entry the JIT looks up for that launch on a GPU of
  that arch (same key: same Triton install, kernel sources and cache-invalidating variables), then builds the NVRTC
  cubins of the families in ``NVRTC_FAMILIES`` for that SM. Returns a ``BuildReport``: built, already cached, stale
  (the kernel is gone, or its parameters no longer match the entry: re-record), failed (with the error).

Manifest format (``FORMAT``)::

    {"format": "glmasr-kernel-manifest/1", "triton": "3.6.0", "target": {"backend": "cuda", "arch": 90,
     "warp_size": 32},
     "entries": [{"module": "glmasr_kernels.rmsnorm", "qualname": "_rmsnorm_kernel",
                  "signature": {"X": "*bf16", ..., "HAS_RES": "constexpr", ...},
                  "constexprs": {"HAS_RES": false, "BLOCK_M": 8, ...},
                  "attrs": {"X": [["tt.divisibility", 16]], ...},
                  "options": {"num_warps": 2, "launch_pdl": true}}, ...]}

``signature``: every parameter's Triton type as the JIT saw it ("constexpr" for compile-time values, also for
integer arguments the JIT folded, e.g. a 1). ``constexprs`` and ``attrs`` are keyed by parameter name (``NAME[i]``
for an element of a tuple argument); a constexpr that is a Triton dtype is written ``{"dtype": "bf16"}``, a
``tl.constexpr`` object ``{"constexpr": value}``. ``options``: the compile options that differ from the backend's
defaults (so the build re-derives the defaults, as the JIT of the serving process does, from its own environment).

Parallelism: the Triton compiles run in ``workers`` child processes (``python -m glmasr_kernels.aot --worker``):
the front end (Python AST to IR) holds the GIL, so threads do not scale, and a child can run with
``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` gives ``InterpretedFunction`` objects, whose cache
keys are not the compiled kernel's). The children inherit every other variable, so the cache-invalidating ones
(``get_cache_invalidating_env_vars()``, listed in the report) must be those the serving process will have. The
NVRTC families run on threads of this process (NVRTC releases the GIL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

FORMAT = "glmasr-kernel-manifest/1"
MANIFEST_DIR = Path(__file__).with_name("manifests")


def default_manifest(arch: int = 90) -> Path:
    """The manifest shipped in the package for ``arch`` (``manifests/sm<arch>.json``)."""
    return MANIFEST_DIR / f"sm{arch}.json"


class ManifestError(ValueError):
    """The manifest file is missing, is not JSON, or does not have the format (the message names the file and
    the field)."""


class ToolchainMissing(RuntimeError):
    """A compiler this build needs is not installed (Triton, or the NVRTC / header wheels of the ``cuda`` extra)."""


# ------------------------------------------------------------------------------------------------ NVRTC families


@dataclasses.dataclass(frozen=True)
class NvrtcJob:
    """One NVRTC binary a family needs on a target: ``build()`` compiles it into the family's cache at ``path``
    (and returns anything); the builder skips it when ``path`` exists. ``build`` runs on a thread of the
    building process."""

    label: str
    path: str
    build: Callable[[], Any]


def logmel_jobs(arch: int) -> list[NvrtcJob]:
    """The log-mel frontend's cubin that ``glmasr.load`` prebuilds on a GPU of SM ``arch``: the Whisper
    configuration for 128 mel bins, float32 input and output (``glmasr_kernels.logmel.prebuild``)."""
    try:
        import functools

        from .logmel import _deps_importable, whisper_config
        from .logmel._build import cache_dir, cache_key, get_cubin
    except ImportError as e:
        raise ToolchainMissing(f"the log-mel frontend cannot be built: {e}") from e
    if not _deps_importable():
        raise ToolchainMissing("the log-mel frontend needs cuda-bindings (NVRTC) and the nvidia-mathdx / "
                               "nvidia-cuda-cccl / nvidia-cuda-runtime header wheels: pip install 'glmasr[cuda]'")
    cfg = whisper_config(128, sm=arch * 10)
    return [NvrtcJob(f"logmel whisper n_mels=128 sm_{arch}", str(cache_dir() / f"logmel_{cache_key(cfg)}.cubin"),
                     functools.partial(get_cubin, cfg))]


def cuda_gemv_jobs(arch: int) -> list[NvrtcJob]:
    """The CUDA decode GEMVs' cubins (``glmasr_kernels.cuda_gemv``): every config the product launches (its tables,
    bf16 and int8, and their fused batch-1 forms: ``cuda_gemv.default_configs``)."""
    try:
        import functools

        from . import cuda_gemv
    except ImportError as e:
        raise ToolchainMissing(f"the CUDA GEMVs cannot be built: {e}") from e
    if not cuda_gemv._deps_importable():
        raise ToolchainMissing("the CUDA GEMVs need cuda-bindings (NVRTC): pip install 'glmasr[cuda]'")
    configs = cuda_gemv.default_configs()
    return [NvrtcJob(f"cuda_gemv {c.short()} sm_{arch}", str(cuda_gemv.cubin_path(c, arch)),
                     functools.partial(cuda_gemv.get_cubin, c, arch)) for c in configs]


# The NVRTC-compiled families and their prebuilds: each callable takes the Triton-style arch (90 for sm_90) and
# returns its jobs for that target, or raises ToolchainMissing.
NVRTC_FAMILIES: list[Callable[[int], list[NvrtcJob]]] = [logmel_jobs, cuda_gemv_jobs]


# ------------------------------------------------------------------------------------------------ recording


def _path_key(names: list[str], path: tuple) -> str:
    key = names[path[0]]
    return key + "".join(f"[{i}]" for i in path[1:])


_PATH_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


def _parse_path(names: list[str], key: str) -> tuple:
    m = _PATH_RE.match(key)
    if not m or m.group(1) not in names:
        raise KeyError(key)
    return (names.index(m.group(1)), *(int(i) for i in re.findall(r"\d+", m.group(2))))


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _encode_constexpr(v):
    import triton.language as tl

    if isinstance(v, tl.dtype):
        return {"dtype": str(v)}
    if isinstance(v, tl.constexpr):
        return {"constexpr": _encode_constexpr(v.value)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"constexpr value of type {type(v).__name__} cannot be written to a manifest")


def _decode_constexpr(v):
    import triton.language as tl

    if isinstance(v, dict):
        if set(v) == {"dtype"}:
            return tl.dtype(v["dtype"])
        if set(v) == {"constexpr"}:
            return tl.constexpr(_decode_constexpr(v["constexpr"]))
        raise ValueError(f"unknown constexpr encoding {v!r}")
    return v


def _default_options(backend) -> dict:
    return _jsonable(dict(backend.parse_options({}).__dict__))


def entry_from_launch(jit_function, signature: dict, constants: dict, attrs: dict, options: dict, backend) -> dict:
    """A manifest entry for one specialization as ``JITFunction._do_compile`` sees it (``options``: the compile
    options' fields, e.g. from the hook's serialized specialization data)."""
    names = list(jit_function.arg_names)
    defaults = _default_options(backend)
    opts = {k: v for k, v in _jsonable(dict(options)).items() if defaults.get(k, object()) != v}
    return {"module": jit_function.fn.__module__, "qualname": jit_function.fn.__qualname__,
            "signature": _jsonable(dict(signature)),
            "constexprs": {_path_key(names, k): _encode_constexpr(v) for k, v in constants.items()},
            "attrs": {_path_key(names, k): _jsonable(v) for k, v in attrs.items()},
            "options": opts}


def _canonical(entry: dict) -> str:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"))


@dataclasses.dataclass
class Recording:
    """What ``record()`` saw: ``entries`` (one per specialization, deduplicated, in first-seen order), the
    ``target`` ({"backend", "arch", "warp_size"}) they compiled for, and ``skipped`` (kernel, reason) for launches
    that cannot be written to a manifest."""

    entries: list[dict] = dataclasses.field(default_factory=list)
    target: dict | None = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    _seen: set = dataclasses.field(default_factory=set, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, entry: dict, target: dict) -> None:
        with self._lock:
            if self.target is None:
                self.target = target
            elif target != self.target:
                self.skipped.append((f"{entry['module']}.{entry['qualname']}",
                                     f"compiled for {target}, not the recording's {self.target}"))
                return
            key = _canonical(entry)
            if key not in self._seen:
                self._seen.add(key)
                self.entries.append(entry)


@contextlib.contextmanager
def record():
    """Context that yields a ``Recording`` of every Triton specialization compiled inside it (any thread). The
    hook it installs calls the hook that was there first and returns that hook's answer (never True of its
    own), so every compile still happens; the previous hook is restored on exit."""
    from triton import knobs

    rec = Recording()
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **more):
        answer = None
        if previous is not None:
            answer = previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                              already_compiled=already_compiled, **more)
        jf = fn.jit_function
        name = f"{fn.module}.{fn.name}"
        try:
            _, _, target, backend, _ = jf.device_caches[compile["device"]]
            from triton.runtime.jit import JITFunction

            if type(jf) is not JITFunction or "<locals>" in fn.name:
                raise TypeError("not a module-level @triton.jit kernel (cannot be imported by name)")
            options = json.loads(compile["specialization_data"])["options"]
            entry = entry_from_launch(jf, compile["signature"], compile["constants"], compile["configs"][0],
                                      options, backend)
            rec.add(entry, {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size})
        except Exception as e:  # a launch we cannot describe must not break the product
            with rec._lock:
                rec.skipped.append((name, f"{type(e).__name__}: {e}"))
        return answer

    knobs.runtime.jit_cache_hook = hook
    try:
        yield rec
    finally:
        knobs.runtime.jit_cache_hook = previous


# ------------------------------------------------------------------------------------------------ manifest files


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _sorted_entries(entries: Iterable[dict]) -> list[dict]:
    seen, out = set(), []
    for e in entries:
        k = _canonical(e)
        if k not in seen:
            seen.add(k)
            out.append(e)
    return sorted(out, key=lambda e: (e["module"], e["qualname"], _canonical(e)))


def manifest_dict(entries: Iterable[dict], target: dict | None = None, triton_version: str | None = None) -> dict:
    """A manifest (``FORMAT``) holding ``entries`` (deduplicated, sorted)."""
    target = target or {"backend": "cuda", "arch": 90, "warp_size": 32}
    m = {"format": FORMAT, "triton": triton_version or _triton_version(), "target": dict(target),
         "entries": _sorted_entries(entries)}
    validate_manifest(m, "<manifest>")
    return m


def write_manifest(entries, path, *, target: dict | None = None, triton_version: str | None = None) -> dict:
    """Write ``entries`` (a ``Recording`` or a list of entries) to ``path``, merged with the entries already there
    when the file exists (same target required); returns the manifest written. The target and Triton version
    default to the recording's (a ``Recording``), else to the existing file's, else cuda sm_90 and this Triton."""
    if isinstance(entries, Recording):
        target = target or entries.target
        entries = entries.entries
    path = Path(path)
    old: list[dict] = []
    if path.exists():
        existing = read_manifest(path)
        if target is not None and existing["target"] != target:
            raise ManifestError(f"{path}: recorded for {existing['target']}, not {target}; write to another file")
        target = target or existing["target"]
        triton_version = triton_version or (existing["triton"] if target == existing["target"] else None)
        old = existing["entries"]
    m = manifest_dict([*old, *entries], target, triton_version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(dumps_manifest(m))
    os.replace(tmp, path)
    return m


def dumps_manifest(m: dict) -> str:
    """The manifest's text: the header fields, then one entry per line (a re-recording reads as a line diff)."""
    head = {k: v for k, v in m.items() if k != "entries"}
    lines = [json.dumps(e, separators=(", ", ": ")) for e in m["entries"]]
    body = ",\n  ".join(lines)
    text = json.dumps(head, indent=1)[:-2] + ',\n "entries": [' + ("\n  " + body + "\n " if lines else "") + "]\n}\n"
    return text


def validate_manifest(m, where: str) -> dict:
    """Raise ``ManifestError`` naming ``where`` and the field unless ``m`` has the manifest format."""
    def bad(msg):
        raise ManifestError(f"{where}: {msg}")

    if not isinstance(m, dict):
        bad("not a JSON object")
    if m.get("format") != FORMAT:
        bad(f"field 'format' must be {FORMAT!r}, got {m.get('format')!r}")
    t = m.get("target")
    if (not isinstance(t, dict) or set(t) != {"backend", "arch", "warp_size"} or not isinstance(t["backend"], str)
            or not isinstance(t["arch"], int) or not isinstance(t["warp_size"], int)):
        bad(f"field 'target' must be {{'backend': str, 'arch': int, 'warp_size': int}}, got {t!r}")
    if m.get("triton") is not None and not isinstance(m["triton"], str):
        bad(f"field 'triton' must be a version string, got {m['triton']!r}")
    entries = m.get("entries")
    if not isinstance(entries, list):
        bad("field 'entries' must be a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            bad(f"entries[{i}] is not an object")
        for field, kind in (("module", str), ("qualname", str), ("signature", dict), ("constexprs", dict),
                            ("attrs", dict), ("options", dict)):
            if not isinstance(e.get(field), kind):
                bad(f"entries[{i}].{field} must be a {kind.__name__}, got {e.get(field)!r}")
        extra = set(e) - {"module", "qualname", "signature", "constexprs", "attrs", "options"}
        if extra:
            bad(f"entries[{i}] has unknown fields {sorted(extra)}")
    return m


def read_manifest(path) -> dict:
    """The manifest at ``path``, validated (``ManifestError`` naming the file and the problem otherwise)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest file") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest: {e}") from None
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON: {e}") from None
    return validate_manifest(m, str(path))


# ------------------------------------------------------------------------------------------------ building


@dataclasses.dataclass
class BuildReport:
    """``build``'s outcome. ``built`` / ``cached``: labels of Triton entries compiled now / found in the cache;
    ``stale``: (label, why) for entries the current code cannot have launched (re-record the manifest);
    ``failed``: (label, error); ``nvrtc_built`` / ``nvrtc_cached`` / ``nvrtc_failed`` the same for the NVRTC
    families; ``warnings``: e.g. a Triton version other than the recording's; ``triton_cache_dir`` and
    ``nvrtc_dirs``: where the binaries are; ``env_vars``: the cache-invalidating variables the keys include;
    ``seconds``: wall time."""

    arch: int
    built: list[str] = dataclasses.field(default_factory=list)
    cached: list[str] = dataclasses.field(default_factory=list)
    stale: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    nvrtc_built: list[str] = dataclasses.field(default_factory=list)
    nvrtc_cached: list[str] = dataclasses.field(default_factory=list)
    nvrtc_failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    triton_cache_dir: str | None = None
    nvrtc_dirs: list[str] = dataclasses.field(default_factory=list)
    env_vars: dict = dataclasses.field(default_factory=dict)
    workers: int = 1
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.nvrtc_failed


def entry_label(e: dict) -> str:
    c = ",".join(f"{k}={v}" for k, v in e.get("constexprs", {}).items())
    return f"{e['module']}.{e['qualname']}[{c}]"


def _resolve_kernel(module: str, qualname: str):
    """The JITFunction, or raises LookupError (stale: the kernel is gone)."""
    from triton.runtime.jit import JITFunction

    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise LookupError(f"module {module} no longer exists") from None
        raise
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{module} has no {qualname}")
        obj = getattr(obj, part)
    if not isinstance(obj, JITFunction):
        raise LookupError(f"{module}.{qualname} is not a Triton kernel (a {type(obj).__name__})")
    return obj


def _source_for(fn, e: dict):
    """(ASTSource, options dict) for entry ``e`` of kernel ``fn``; LookupError when they no longer match."""
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    sig = list(e["signature"])
    if sig != names:
        raise LookupError(f"parameters are now {names}, the entry has {sig}")
    for p in fn.params:
        if p.is_constexpr and e["signature"][p.name] != "constexpr":
            raise LookupError(f"parameter {p.name} is now a constexpr")
    try:
        constexprs = {_parse_path(names, k): _decode_constexpr(v) for k, v in e["constexprs"].items()}
        attrs = {_parse_path(names, k): v for k, v in e["attrs"].items()}
    except KeyError as k:
        raise LookupError(f"the entry names a parameter the kernel no longer has: {k}") from None
    for path in constexprs:
        if len(path) == 1 and e["signature"][names[path[0]]] != "constexpr":
            raise LookupError(f"entry gives a constexpr value for {names[path[0]]}, typed "
                              f"{e['signature'][names[path[0]]]}")
    for p in fn.params:
        if e["signature"][p.name] == "constexpr" and (p.num,) not in constexprs:
            raise LookupError(f"entry has no value for the constexpr {p.name}")

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    signature = {k: tup(v) for k, v in e["signature"].items()}
    return ASTSource(fn, signature, constexprs, attrs), {k: tup(v) for k, v in e["options"].items()}


def _build_entry(e: dict, arch: int) -> dict:
    """In a worker: compile entry ``e`` for sm_<arch> unless its cache entry exists. Returns {"status": "built" |
    "cached" | "stale" | "failed", "detail", "seconds"}."""
    import hashlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import get_cache_invalidating_env_vars, make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    t0 = time.perf_counter()
    try:
        fn = _resolve_kernel(e["module"], e["qualname"])
        src, opts = _source_for(fn, e)
    except LookupError as err:
        return {"status": "stale", "detail": str(err), "seconds": 0.0}
    try:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        known = set(type(backend.parse_options({})).__dataclass_fields__)
        unknown = sorted(set(opts) - known)
        if unknown:
            return {"status": "stale", "detail": f"options {unknown} unknown to Triton {triton.__version__}",
                    "seconds": 0.0}
        options = backend.parse_options(dict(opts))
        key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        if get_cache_manager(digest).get_group(f"{src.name[:150]}.json"):
            return {"status": "cached", "detail": digest, "seconds": time.perf_counter() - t0}
        kernel = triton.compile(src, target=target, options=options.__dict__)
        if kernel.hash != digest:  # the key this module computes must be the one compile() uses
            return {"status": "failed", "detail": f"cache key mismatch: {kernel.hash} != {digest}",
                    "seconds": time.perf_counter() - t0}
        return {"status": "built", "detail": digest, "seconds": time.perf_counter() - t0}
    except Exception as err:
        root = err
        while root.__cause__ is not None:  # Triton's CompilationError wraps the error that says what is wrong
            root = root.__cause__
        msg = str(err).strip().splitlines()
        why = f"{type(root).__name__}: {root}; " if root is not err else ""
        return {"status": "failed", "detail": f"{why}{type(err).__name__}: {' | '.join(msg[-6:])}"[:2000],
                "seconds": time.perf_counter() - t0}


def _worker_main() -> int:
    """``python -m glmasr_kernels.aot --worker``: JSON lines in ({"entry", "arch"}), JSON lines out. The first
    line out describes the worker (cache dir, env vars); stdout of compilers goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import triton
        from triton import knobs
        from triton.compiler.compiler import get_cache_invalidating_env_vars
    except ImportError as e:
        proto.write(json.dumps({"error": f"Triton is not importable: {e}"}) + "\n")
        return 0
    proto.write(json.dumps({"cache_dir": knobs.cache.dir, "env_vars": dict(get_cache_invalidating_env_vars()),
                            "triton": triton.__version__, "interpret": bool(knobs.runtime.interpret)}) + "\n")
    for line in sys.stdin:
        task = json.loads(line)
        proto.write(json.dumps(_build_entry(task["entry"], task["arch"])) + "\n")
    return 0


def worker_env(cache_dir=None) -> dict:
    """The environment of the compile workers: this one without TRITON_INTERPRET, with TRITON_CACHE_DIR set to
    ``cache_dir`` when given."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(Path(cache_dir).expanduser().resolve())
    return env


class _Worker:
    def __init__(self, env: dict):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "glmasr_kernels.aot", "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     bufsize=1)
        self.info = self._read()
        if "error" in self.info:
            self.close()
            raise ToolchainMissing(self.info["error"])

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.err.seek(0)
            tail = self.err.read().decode(errors="replace").strip().splitlines()[-8:]
            raise RuntimeError(f"compile worker exited with status {self.proc.returncode}: " + " | ".join(tail))
        return json.loads(line)

    def ask(self, entry: dict, arch: int) -> dict:
        self.proc.stdin.write(json.dumps({"entry": entry, "arch": arch}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def check_triton() -> str:
    """Triton's version, or ``ToolchainMissing`` naming the extra to install."""
    version = _triton_version()
    if version is None:
        raise ToolchainMissing("Triton is not installed: pip install 'glmasr[cuda]'")
    return version


def _run_triton(entries: list[dict], arch: int, workers: int, env: dict, report: BuildReport) -> None:
    tasks: queue.Queue = queue.Queue()
    for e in entries:
        tasks.put(e)
    lock = threading.Lock()
    first_info: dict = {}
    fatal: list[BaseException] = []

    def run():
        w = None
        try:
            while True:
                try:
                    e = tasks.get_nowait()
                except queue.Empty:
                    return
                if w is None:
                    w = _Worker(env)
                    with lock:
                        first_info.setdefault("info", w.info)
                try:
                    r = w.ask(e, arch)
                except RuntimeError as err:  # the worker died on this entry (e.g. a compiler crash)
                    r = {"status": "failed", "detail": str(err)}
                    w.close()
                    w = None
                label = entry_label(e)
                with lock:
                    if r["status"] == "built":
                        report.built.append(label)
                    elif r["status"] == "cached":
                        report.cached.append(label)
                    elif r["status"] == "stale":
                        report.stale.append((label, r["detail"]))
                    else:
                        report.failed.append((label, r["detail"]))
        except BaseException as err:
            fatal.append(err)
        finally:
            if w is not None:
                w.close()

    threads = [threading.Thread(target=run, name=f"aot-worker-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if fatal:
        raise fatal[0]
    info = first_info.get("info", {})
    report.triton_cache_dir = info.get("cache_dir")
    report.env_vars = info.get("env_vars", {})


def _run_nvrtc(arch: int, workers: int, report: BuildReport, families) -> None:
    from concurrent.futures import ThreadPoolExecutor

    jobs: list[NvrtcJob] = []
    for family in families:
        name = getattr(family, "__name__", repr(family))
        try:
            jobs += family(arch)
        except ToolchainMissing:
            raise
        except Exception as e:
            report.nvrtc_failed.append((name, f"{type(e).__name__}: {e}"))
    todo = []
    for job in jobs:
        d = str(Path(job.path).parent)
        if d not in report.nvrtc_dirs:
            report.nvrtc_dirs.append(d)
        if Path(job.path).exists():
            report.nvrtc_cached.append(job.label)
        else:
            todo.append(job)

    def one(job: NvrtcJob):
        try:
            job.build()
        except Exception as e:
            return job, f"{type(e).__name__}: {e}"
        if not Path(job.path).exists():
            return job, f"built, but {job.path} was not written (is its folder writable?)"
        return job, None

    if todo:
        with ThreadPoolExecutor(max(1, min(workers, len(todo))), thread_name_prefix="aot-nvrtc") as pool:
            for job, err in pool.map(one, todo):
                if err is None:
                    report.nvrtc_built.append(job.label)
                else:
                    report.nvrtc_failed.append((job.label, err))


def build(manifest, arch: int = 90, cache_dir=None, workers: int | None = None, *, nvrtc: bool = True,
          families=None) -> BuildReport:
    """Compile every entry of ``manifest`` (a path or a manifest dict) for ``GPUTarget("cuda", arch, 32)`` into
    Triton's cache (``cache_dir``, else ``TRITON_CACHE_DIR``, else Triton's default), on ``workers`` processes
    (default: the CPUs, at most 16), then (``nvrtc``) the NVRTC ``families`` (default ``NVRTC_FAMILIES``) for
    that SM. Raises ``ManifestError`` for a bad manifest or one recorded for another target, ``ToolchainMissing``
    when Triton (or, with ``nvrtc``, the NVRTC wheels) is missing; everything per entry goes into the report."""
    t0 = time.perf_counter()
    if isinstance(manifest, (str, os.PathLike)):
        m = read_manifest(manifest)
    else:
        m = validate_manifest(manifest, "<manifest>")
    want = {"backend": "cuda", "arch": int(arch), "warp_size": 32}
    if m["target"] != want:
        raise ManifestError(f"manifest recorded for {m['target']}, not {want}: record one on such a GPU "
                            f"(python3 -m scripts.record_kernels)")
    version = check_triton()
    workers = max(1, int(workers or min(16, os.cpu_count() or 1)))
    report = BuildReport(arch=int(arch), workers=workers)
    if m["triton"] and m["triton"] != version:
        report.warnings.append(f"manifest recorded with Triton {m['triton']}, building with {version}: the "
                               f"variants it picks may differ; re-record on the GPU")
    entries = m["entries"]
    if not entries:
        report.warnings.append("the manifest holds no Triton entries (not recorded yet?): record it on the GPU with "
                               "python3 -m scripts.record_kernels")
    env = worker_env(cache_dir)
    nv_thread = None
    nv_error: list[BaseException] = []
    if nvrtc:
        def nv():
            try:
                _run_nvrtc(int(arch), workers, report, NVRTC_FAMILIES if families is None else families)
            except BaseException as e:
                nv_error.append(e)

        nv_thread = threading.Thread(target=nv, name="aot-nvrtc", daemon=True)
        nv_thread.start()
    if entries:
        _run_triton(entries, int(arch), min(workers, len(entries)), env, report)
    else:
        from triton import knobs

        report.triton_cache_dir = env.get("TRITON_CACHE_DIR") or knobs.cache.dir
    if nv_thread is not None:
        nv_thread.join()
        if nv_error:
            raise nv_error[0]
    report.seconds = time.perf_counter() - t0
    return report


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    print("usage: python -m glmasr_kernels.aot --worker (internal; use `glmasr compile`)", file=sys.stderr)
    sys.exit(2)
