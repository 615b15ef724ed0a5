"""``glmasr compile`` (also ``python -m glmasr.cli compile``): build the kernels' compile caches ahead, on any machine
(a GPU is not needed), so the first request on a fresh GPU machine does not wait for Triton and NVRTC compiles.

Builds every Triton specialization of the manifest (default: the one shipped for the arch,
``glmasr_kernels/manifests/sm<arch>.json``, recorded on such a GPU by ``scripts/record_kernels.py``) into Triton's
cache (``--cache-dir``, else ``TRITON_CACHE_DIR``, else ``~/.triton/cache``), and the NVRTC cubins (the log-mel
frontend's, the CUDA decode GEMVs') into glmasr's cache (``GLMASR_CACHE_DIR``/cubins, else ~/.cache/glmasr/cubins),
for sm_<arch>
(``glmasr_kernels.aot.build``). Run it with the same Triton and glmasr install, and the same ``TRITON_*`` compile
variables, as the process that will serve: they are part of the cache keys.

Exit status: 0 when nothing failed (stale manifest entries, which today's code cannot launch, are listed but do not
fail the run), 1 when an entry failed to compile, 2 for a missing or invalid manifest or a missing toolchain (the
``cuda`` extra: ``pip install 'glmasr[cuda]'``).
"""

from __future__ import annotations

import argparse
import sys

from .common import positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="glmasr compile",
        description="Compile the Triton kernels (and the NVRTC cubins) of the recorded manifest for a GPU arch into "
                    "the local caches, so a fresh machine does not compile at first use. Needs no GPU.")
    p.add_argument("--arch", type=positive_int, default=90, metavar="N",
                   help="the target's compute capability as major*10+minor (default 90: H100/H200, sm_90)")
    p.add_argument("--manifest", default=None, metavar="PATH",
                   help="the kernel manifest (default: the one shipped for --arch, glmasr_kernels/manifests/"
                        "sm<arch>.json)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="compile processes (default: the CPUs, at most 16)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="Triton's cache folder to fill (default: $TRITON_CACHE_DIR, else ~/.triton/cache); the "
                        "serving process must use the same one")
    p.add_argument("--no-nvrtc", action="store_true", help="only the Triton kernels, not the NVRTC cubins")
    p.add_argument("-v", "--verbose", action="store_true", help="list every entry and its outcome")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from glmasr_kernels import aot
    except ImportError as e:  # a broken install: the kernels package ships with glmasr
        print(f"error: glmasr_kernels is not importable ({e})", file=sys.stderr)
        return 2
    manifest = args.manifest or aot.default_manifest(args.arch)
    try:
        report = aot.build(manifest, arch=args.arch, cache_dir=args.cache_dir, workers=args.workers,
                           nvrtc=not args.no_nvrtc)
    except aot.ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except aot.ToolchainMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = report
    total = len(r.built) + len(r.cached) + len(r.stale) + len(r.failed)
    print(f"glmasr compile: sm_{r.arch}, manifest {manifest} ({total} Triton entries), {r.workers} worker(s)")
    print(f"  triton: {len(r.built)} built, {len(r.cached)} already cached, {len(r.stale)} stale, "
          f"{len(r.failed)} failed -> {r.triton_cache_dir}")
    if not args.no_nvrtc:
        where = ", ".join(r.nvrtc_dirs) or "-"
        print(f"  nvrtc:  {len(r.nvrtc_built)} built, {len(r.nvrtc_cached)} already cached, "
              f"{len(r.nvrtc_failed)} failed -> {where}")
    if r.env_vars:
        print(f"  cache keys include {r.env_vars}: the serving process must set the same")
    for w in r.warnings:
        print(f"  warning: {w}")
    if args.verbose:
        for label in r.built:
            print(f"  built   {label}")
        for label in r.cached:
            print(f"  cached  {label}")
        for label in r.nvrtc_built:
            print(f"  built   {label}")
        for label in r.nvrtc_cached:
            print(f"  cached  {label}")
    for label, why in r.stale:
        print(f"  stale   {label}: {why}")
    for label, err in [*r.failed, *r.nvrtc_failed]:
        print(f"  FAILED  {label}: {err}", file=sys.stderr)
    print(f"  {r.seconds:.1f} s")
    return 0 if r.ok else 1
