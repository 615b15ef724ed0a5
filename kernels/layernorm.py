"""LayerNorm with weight and bias (Whisper-style encoder, eps 1e-5), optionally fused with the residual add.

Computes, for every row of the last dim (size N):

    s    = x + residual                     (only when ``residual`` is given; rounded to the I/O dtype)
    mean = mean(s_f32);  var = mean((s_f32 - mean)**2)      (biased variance, two passes over registers)
    out  = ((s_f32 - mean) * rsqrt(var + eps) * w_f32 + b_f32).to(dtype)

which is ``torch.nn.functional.layer_norm`` (fp32 math, one rounding at the end).

Shape contract: ``x`` (..., N), last dim contiguous (copied otherwise); ``weight``/``bias`` (N,); ``residual``
same shape/dtype as ``x``. bf16, fp16 or fp32 I/O; output in x's dtype; N up to 32768, odd N masked.

    layer_norm(x, weight, bias, eps)            -> out
    layer_norm(x, weight, bias, eps, residual)  -> (out, new_residual)   new_residual = x + residual
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import (as_rows, cdiv, check_device, load_add_residual, residual_rows, row_block, row_tile,
                            warps_for)

__all__ = ["layer_norm", "layer_norm_ref"]


def layer_norm_ref(x, weight, bias, eps: float = 1e-5, residual=None):
    """Plain-PyTorch reference (the encoder's ``x = x + h`` followed by ``nn.LayerNorm``)."""
    new_res = None
    if residual is not None:
        x = residual + x
        new_res = x
    out = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return out if residual is None else (out, new_res)


# Counts that vary per call (rows: a packed prefill's tokens, W x 1500 encoder rows, the decode batch) are not
# specialised on, so a new count never compiles another variant in the middle of a request.
@triton.jit(do_not_specialize=["M"])
def _layernorm_kernel(X, R, W, B, Y, RO, M, N, sx, sr, sy, sro, eps,
                      HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows64, cols, cmask, mask = row_block(M, N, BLOCK_M, BLOCK_N)
    x = load_add_residual(X, R, RO, rows64[:, None] * sx + cols[None, :], rows64[:, None] * sr + cols[None, :],
                          rows64[:, None] * sro + cols[None, :], mask, HAS_RES)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / N
    d = tl.where(mask, xf - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / N
    rstd = tl.math.rsqrt(var + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    out = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows64[:, None] * sy + cols[None, :], out.to(Y.dtype.element_ty), mask=mask)


def layer_norm(x, weight, bias, eps: float = 1e-5, residual=None):
    """Triton LayerNorm; see the module docstring. Returns ``out`` or ``(out, new_residual)``."""
    check_device(x, weight, bias, residual)
    shape = x.shape
    n = shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError("weight and bias must be (N,)")
    if n > 32768:
        raise ValueError("layer_norm: N > 32768 not supported (row held in registers)")
    x2 = as_rows(x)
    m = x2.shape[0]
    w = weight.contiguous()
    b = bias.contiguous()
    out = torch.empty(shape, device=x.device, dtype=x.dtype)
    out2 = out.view(-1, n)
    r2, ro2, new_res = residual_rows(x2, residual, shape)
    if m > 0:
        bm, bn = row_tile(n)
        _layernorm_kernel[(cdiv(m, bm),)](
            x2, r2, w, b, out2, ro2, m, n, x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), float(eps),
            HAS_RES=residual is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps_for(bm * bn))
    return out if residual is None else (out, new_res)
