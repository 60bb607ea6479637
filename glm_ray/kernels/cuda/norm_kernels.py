"""Triton RMSNorm of the `cuda` backend (this module imports triton): one launch per norm, and one for
the decoder layer's residual add + norm, where the torch reference (`torch_ref/norm.py`) takes four
(cast, rms_norm, cast, weight) and five.

`_rms_norm_kernel` — one program per row, the whole row in registers (D ≤ 16384): optional residual add
rounded to the input dtype (what `residual + hidden` gives in that dtype; the sum is stored as the new
residual), fp32 sum of squares, `x * rsqrt(mean + eps)` rounded to the input dtype, then the weight
multiplied in fp32 and rounded again (= torch's `weight * y` in bf16/fp16). The sum is bitwise the
reference's; the normalized row differs from it only by the fp32 reduction order (≤ 1 ulp of the
output dtype on an element).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_D = 16384
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _cast(x, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even. The interpreter truncates fp32 -> bf16, so there the
    bits are rounded first (then truncation is exact); compiled kernels round RNE themselves."""
    if RNE_BY_HAND:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, stride_y, stride_s, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = _cast(x.to(tl.float32) + r.to(tl.float32), dt, RNE_BY_HAND)    # residual + hidden, in dt
        tl.store(s_ptr + row * stride_s + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    yn = _cast(xf * rstd, dt, RNE_BY_HAND)                                     # normalized, cast back
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, _cast(yn.to(tl.float32) * w.to(tl.float32), dt, RNE_BY_HAND), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (unit column stride, any row stride), weight [D] in x's dtype -> y [T, D]; with
    `residual` [T, D] -> (rms_norm(x + residual), x + residual)."""
    T, D = x.shape
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    s = torch.empty((T, D), dtype=x.dtype, device=x.device) if residual is not None else y
    if T:
        block = triton.next_power_of_2(D)
        r = residual if residual is not None else x
        _rms_norm_kernel[(T,)](x, r, weight, y, s, D, x.stride(0), r.stride(0), y.stride(0), s.stride(0), eps,
                               HAS_RES=residual is not None, BLOCK=block,
                               RNE_BY_HAND=INTERPRET and x.dtype == torch.bfloat16,
                               num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return (y, s) if residual is not None else y
