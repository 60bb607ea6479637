"""Triton kernel of the RMSNorm op with the optional fused residual add (contract and torch reference:
kernels/torch_ref/norm.py): one launch per norm instead of x.float() / F.rms_norm / .to() / weight * (and
the separate `x = x + h` of the decoder layer).

One program handles BLOCK_T rows of a [BLOCK_T, BLOCK_D] tile (BLOCK_D = D padded to a power of two, at
most MAX_D; BLOCK_T rows so a tile holds ~4K elements for small D). Rounding follows the reference step by
step: the residual sum is rounded to x's dtype (and stored: the new stream), the statistics are fp32, the
mean is an IEEE division by D and the reciprocal square root is `div_rn(1, sqrt_rn(.))` (torch's CPU
rsqrt, correctly rounded; not the approximate `rsqrt.approx`), the normalized row is rounded to x's dtype,
then multiplied by the weight in fp32 (exact for two bf16/fp16 factors) and rounded once more. The only
difference from the reference is the order of the D-term fp32 sum of squares.

Rows may be strided views (a row stride; the last dim must be unit-stride, the wrapper copies otherwise);
outputs are contiguous. Grid and constexprs depend on shapes only (CUDA-graph capturable, no host syncs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_D = 8192
TILE = 4096                     # elements of x per program (rows * BLOCK_D), for small D


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 v -> dtype, round to nearest even. For bf16 the rounding is done on the bits (torch's
    c10::BFloat16 rule, NaN kept), then the cast is exact: the same result as the GPU's cvt.rn, and also
    under TRITON_INTERPRET=1, whose fp32 -> bf16 cast truncates."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16) << 16
        v = tl.where(v != v, v, b.to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, T, stride_x, stride_r, stride_s, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_RES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                 # [BT]
    cols = tl.arange(0, BLOCK_D)                                              # [BD]
    col_ok = cols < D
    m = (rows < T)[:, None] & col_ok[None, :]                                 # [BT, BD]
    r64 = rows.to(tl.int64)
    out_off = r64[:, None] * D + cols[None, :]                                # [BT, BD] contiguous outputs
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0)   # [BT, BD] x.dtype
    if HAS_RES:
        res = tl.load(r_ptr + r64[:, None] * stride_r + cols[None, :], mask=m, other=0.0)
        x = _round(x.to(tl.float32) + res.to(tl.float32), x_ptr.dtype.element_ty)   # like torch's add
        tl.store(s_ptr + r64[:, None] * stride_s + cols[None, :], x, mask=m)     # (s may be r itself: in place)
    xf = x.to(tl.float32)                                                     # [BT, BD]
    ssq = tl.sum(xf * xf, axis=1)                                             # [BT]
    var = tl.math.div_rn(ssq, tl.full([BLOCK_T], D, tl.float32)) + eps        # [BT] mean + eps
    rstd = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), tl.math.sqrt_rn(var))   # [BT]
    yn = _round(xf * rstd[:, None], x_ptr.dtype.element_ty)                   # [BT, BD] cast back first
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)          # [BD]
    y = _round(w[None, :] * yn.to(tl.float32), y_ptr.dtype.element_ty)       # [BT, BD]
    tl.store(y_ptr + out_off, y, mask=m)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """[..., D] -> [T, D] with a unit last stride (a strided 2-D row view stays a view)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             in_place: bool = False):
    """x [..., D], weight [D] (x's dtype), residual [..., D] | None -> y [..., D], or (y, x + residual); with
    `in_place` the sum is stored into `residual` (each element read and written by the same thread)."""
    d = x.shape[-1]
    assert d <= MAX_D and weight.shape == (d,) and weight.dtype == x.dtype, (d, weight.shape, weight.dtype)
    lead = x.shape[:-1]
    x2 = _rows(x, d)                                                          # [T, D]
    t = x2.shape[0]
    r2 = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        r2 = _rows(residual, d)                                               # [T, D]
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)                     # [T, D]
    s = None
    if residual is not None:
        s = r2 if in_place and r2.data_ptr() == residual.data_ptr() else torch.empty(t, d, dtype=x.dtype,
                                                                                     device=x.device)
    if t > 0:
        block_d = triton.next_power_of_2(d)
        block_t = max(1, min(TILE // block_d, 16, triton.next_power_of_2(t)))
        warps = max(1, min(16, block_t * block_d // 512))
        _rms_norm_kernel[(triton.cdiv(t, block_t),)](
            x2, r2 if r2 is not None else x2, weight.contiguous(), y, s if s is not None else y, t, x2.stride(0),
            r2.stride(0) if r2 is not None else 0, s.stride(0) if s is not None else 0, float(eps),
            D=d, BLOCK_D=block_d, BLOCK_T=block_t, HAS_RES=residual is not None, num_warps=warps)
    y = y.view(*lead, d)
    if s is None:
        return y
    if in_place and s is not r2:                      # residual had no unit last stride: the kernel wrote a copy
        return y, residual.copy_(s.view(*lead, d))
    return y, (residual if in_place else s.view(*lead, d))
