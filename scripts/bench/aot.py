"""Ahead-of-time compiles for sm_90 on a machine without a GPU (Triton's bundled ptxas and cuobjdump), shared by
the kernel benchmarks' ``--aot-check`` modes: the compiled kernel, its resource usage and its SASS."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_for(fn, signature: dict, constexprs: dict, divisible: list[str], arch: int = 90, **options):
    """Compile Triton ``fn`` for sm_<arch>: ``signature`` name -> type (constexprs' names map to "constexpr"),
    ``constexprs`` name -> value, ``divisible`` the pointer / integer arguments known to be multiples of 16.
    Returns (compiled kernel, ``cuobjdump -res-usage`` text, SASS text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in fn.params]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(a),): v for a, v in constexprs.items()},
                    attrs={(names.index(d),): [["tt.divisibility", 16]] for d in divisible if d not in constexprs})
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(f.name)
    return ck, res, sass


def usage(res: str) -> dict:
    """Registers and stack bytes (spills) from ``cuobjdump -res-usage`` text."""
    return dict(regs=int(re.search(r"REG:(\d+)", res).group(1)), stack=int(re.search(r"STACK:(\d+)", res).group(1)))
