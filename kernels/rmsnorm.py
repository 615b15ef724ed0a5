"""RMSNorm (Llama decoder), optionally fused with the residual add.

Computes, for every row of the last dim (size N):

    s   = x + residual            (only when ``residual`` is given; rounded to the I/O dtype, like ``residual + x``)
    y   = (s_f32 * rsqrt(mean(s_f32**2) + eps)).to(s.dtype)      # HF casts to the input dtype first ...
    out = weight * y                                               # ... then multiplies by the weight

exactly the HF ``LlamaRMSNorm`` order (fp32 statistics, one rounding before and one after the weight product).

Shape contract: ``x`` (..., N) any leading shape, last dim contiguous (copied otherwise); ``weight`` (N,);
``residual`` same shape/dtype as ``x``. dtypes: bf16, fp16 or fp32 I/O, fp32 accumulation. Output dtype is
``promote_types(x.dtype, weight.dtype)`` (what ``weight * y`` gives in torch). N up to 32768 (whole row in
registers), any N (odd sizes masked).

    rms_norm(x, weight, eps)            -> out
    rms_norm(x, weight, eps, residual)  -> (out, new_residual)   new_residual = x + residual

Launched with PDL on sm_90+ (``_triton_utils.pdl_launch``): the gain is loaded before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import (as_rows, cdiv, check_device, load_add_residual, pdl_begin, pdl_launch, pdl_wait,
                            residual_rows, row_block, row_tile, warps_for)

__all__ = ["rms_norm", "rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Plain-PyTorch reference (HF LlamaRMSNorm + the decoder's residual add)."""
    new_res = None
    if residual is not None:
        x = residual + x
        new_res = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * y.to(x.dtype)
    return out if residual is None else (out, new_res)


# Counts that vary per call (rows: a packed prefill's tokens, W x 1500 encoder rows, the decode batch) are not
# specialised on, so a new count never compiles another variant in the middle of a request.
@triton.jit(do_not_specialize=["M"])
def _rmsnorm_kernel(X, R, W, Y, RO, M, N, sx, sr, sy, sro, eps,
                    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    rows64, cols, cmask, mask = row_block(M, N, BLOCK_M, BLOCK_N)
    w = tl.load(W + cols, mask=cmask, other=0.0)  # the gain is never written by the step: safe before the wait
    pdl_wait(PDL)
    x = load_add_residual(X, R, RO, rows64[:, None] * sx + cols[None, :], rows64[:, None] * sr + cols[None, :],
                          rows64[:, None] * sro + cols[None, :], mask, HAS_RES)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / N
    rstd = tl.math.rsqrt(ms + eps)
    y = (xf * rstd[:, None]).to(X.dtype.element_ty)
    out = y.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * sy + cols[None, :], out.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, residual: torch.Tensor | None = None):
    """Triton RMSNorm; see the module docstring. Returns ``out`` or ``(out, new_residual)``."""
    check_device(x, weight, residual)
    shape = x.shape
    n = shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({n},)")
    if n > 32768:
        raise ValueError("rms_norm: N > 32768 not supported (row held in registers)")
    x2 = as_rows(x)
    m = x2.shape[0]
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    out = torch.empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    out2 = out.view(-1, n)
    r2, ro2, new_res = residual_rows(x2, residual, shape)
    if m > 0:
        bm, bn = row_tile(n)
        _rmsnorm_kernel[(cdiv(m, bm),)](
            x2, r2, w, out2, ro2, m, n, x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), float(eps),
            HAS_RES=residual is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps_for(bm * bn),
            **pdl_launch(x.device))
    return out if residual is None else (out, new_res)
