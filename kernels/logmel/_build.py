"""NVRTC build of logmel.cu: one cubin per configuration, cached on disk by content hash.

Headers come from the installed wheels only (nvidia-mathdx, nvidia-cuda-cccl, nvidia-cuda-runtime),
never from a system toolkit. The cache key covers the kernel source, every compile option (so the
macros and the SM target), the NVRTC version and the mathdx/cccl versions.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KERNEL_SRC = Path(__file__).with_name("logmel.cu")


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time configuration of logmel.cu (every field becomes a -D macro)."""

    n_fft: int
    pairs: int  # complex FFTs (frame pairs) per block
    iters: int  # frame pairs per FFT slot per block
    split: int  # lanes per mel dot product
    power_mode: int  # 0: |X|^2, 1: |X|, 2: general exponent
    whisper: bool
    in_i16: bool
    out_bf16: bool
    sm: int  # cuFFTDx SM<> value, e.g. 900
    ept: int = 0  # 0: cuFFTDx default
    direct: bool = False  # mel results stored straight from registers (no shared output tile)
    minb: int = 0  # __launch_bounds__ min blocks per SM (0: none)
    out_f16: bool = False  # float16 output (exclusive with out_bf16)

    def __post_init__(self):
        if self.out_bf16 and self.out_f16:
            raise ValueError("out_bf16 and out_f16 are exclusive")

    @property
    def frames_per_block(self) -> int:
        return 2 * self.pairs * self.iters

    def macros(self) -> dict[str, str]:
        return {
            "LM_N": str(self.n_fft),
            "LM_P": str(self.pairs),
            "LM_R": str(self.iters),
            "LM_SPLIT": str(self.split),
            "LM_POWER": str(self.power_mode),
            "LM_WHISPER": str(int(self.whisper)),
            "LM_IN_I16": str(int(self.in_i16)),
            "LM_OUT_BF16": str(int(self.out_bf16)),
            "LM_SM": str(self.sm),
            "LM_EPT": str(self.ept),
            "LM_DIRECT": str(int(self.direct)),
            "LM_MINB": str(self.minb),
            "LM_OUT_F16": str(int(self.out_f16)),
        }


def cache_dir() -> Path:
    """$GLMASR_CACHE_DIR/cubins, else $XDG_CACHE_HOME/glmasr/cubins, else ~/.cache/glmasr/cubins: the cubins folder
    of the cache root glmasr uses for its other files (``glmasr.checkpoint.resources.cache_dir``; the kernels read the
    variable themselves, since they import nothing from glmasr)."""
    env = os.environ.get("GLMASR_CACHE_DIR")
    base = Path(env).expanduser() if env else Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "glmasr"
    return base / "cubins"


@functools.lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """Header folders from the installed wheels: mathdx, the CUDA runtime headers, and CCCL."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'nvidia' wheels (nvidia-mathdx, nvidia-cuda-runtime, nvidia-cuda-cccl) are not installed")
    roots = [Path(p) for p in spec.submodule_search_locations]

    def find(rel: str, probe: str) -> Path:
        for r in roots:
            if (r / rel / probe).exists():
                return r / rel
        raise RuntimeError(f"header {rel}/{probe} not found under {roots}: install the matching nvidia-* wheel")

    return (
        str(find("mathdx/include", "cufftdx.hpp")),
        str(find("cu13/include", "cuda_fp16.h")),
        str(find("cu13/include/cccl", "cuda/std/type_traits")),
    )


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    from importlib import metadata

    parts = []
    for name in ("nvidia-mathdx", "nvidia-cuda-cccl", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime"):
        try:
            parts.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name}=?")
    return ";".join(parts)


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return KERNEL_SRC.read_text()


def cache_key(cfg: KernelConfig) -> str:
    """Content hash: kernel source + options (without include paths, which vary by install) + versions."""
    opts = compile_options_raw(cfg)
    h = hashlib.sha256()
    for part in (_source(), *opts, _versions()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def compile_options_raw(cfg: KernelConfig) -> list[str]:
    return [
        "--std=c++17",
        f"--gpu-architecture=sm_{cfg.sm // 10}",
        "--device-as-default-execution-space",
        "-DCUFFTDX_DISABLE_CUTLASS_DEPENDENCY",
        *(f"-D{k}={v}" for k, v in sorted(cfg.macros().items())),
    ]


def _check(ret, what: str):
    from cuda.bindings import nvrtc

    err, *rest = ret
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def compile_program(source: str, name: str, options: list[str], what: str) -> tuple[bytes, str]:
    """NVRTC: ``source`` (file ``name``) with ``options`` to a cubin. Returns (cubin, log); RuntimeError with the
    log, naming ``what``, on failure. No GPU needed (the target is in the options). Shared by the NVRTC families."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "create")
    try:
        res = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        # NVRTC writes into these buffers: they must be fresh mutable ones. ``b" " * n`` is not: for n == 1 (an
        # empty log is its terminating NUL alone) it is the interpreter's cached one-byte b" ", and the NUL
        # written into it corrupted every later b" " of the process (torch.load then misread files).
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        log_s = log.decode(errors="replace").rstrip("\x00 \n")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC compilation of {name} failed for {what}:\n{log_s}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin), log_s


def nvrtc_compile(cfg: KernelConfig, verbose_ptxas: bool = False) -> tuple[bytes, str]:
    """Compile now (no cache). Returns (cubin, log). Raises RuntimeError with the log on failure."""
    opts = compile_options_raw(cfg) + [f"--include-path={d}" for d in include_dirs()]
    if verbose_ptxas:
        opts.append("--ptxas-options=-v")
    return compile_program(_source(), "logmel.cu", opts, str(cfg))



def get_cubin(cfg: KernelConfig) -> bytes:
    """The cubin for cfg: from the disk cache, else compiled (saying so once on stderr) and stored."""
    path = cache_dir() / f"logmel_{cache_key(cfg)}.cubin"
    return cached_cubin(path, lambda: nvrtc_compile(cfg)[0], "glmasr.logmel: compiling CUDA kernels with NVRTC "
                        "(first use, a few seconds each)")


_announced: set[str] = set()  # the families that said on stderr that they compile


def cached_cubin(path: Path, build, cold_message: str) -> bytes:
    """The cubin at ``path`` (the disk cache), else ``build()``'s, stored there atomically (an unwritable cache only
    costs a recompile next time); ``cold_message`` (with the cache folder) goes to stderr the first time it
    compiles in this process. Shared by the NVRTC families."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    if cold_message not in _announced:
        print(f"{cold_message}; cache: {path.parent}", file=sys.stderr)
        _announced.add(cold_message)
    cubin = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)  # atomic: concurrent processes never see a partial cubin
    except OSError:
        pass
    return cubin
