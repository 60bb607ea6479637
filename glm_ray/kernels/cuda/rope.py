"""Triton kernel of the `rope_inplace` op (contract and torch reference: kernels/torch_ref/rope.py): the
rotary embedding of a query's rope dims, in place, in ONE launch instead of apply_rope's strided slices,
two cats, mul and addcmul plus the cat that reassembled [q_nope | q_pe] (the MLA query) or
[q_rope | q_rest] (the DSA indexer's query).

One program per (token, BLOCK_H heads): it loads the rows' rope dims at the de-interleave / swap positions
(`cache_write._rope_offsets`), then stores the rotated values in apply_rope's output layout over the same
dims; each program owns its rows whole, so reading before writing makes the in-place update safe. Rounding
as the reference (`cache_write._rope_combine`: A * cos rounded to the dtype, then one fp32 fma for the
addcmul). Grid and constexprs come from shapes / dtypes only (no host syncs, CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.cache_write import _TL_DTYPES, _rope_combine, _rope_offsets, _round


@triton.jit(do_not_specialize=['H'])
def _rope_inplace_kernel(x_ptr, cos_ptr, sin_ptr, H, stride_t, stride_h, stride_cos, stride_sin, start,
                         DR: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr,
                         INTERLEAVE: tl.constexpr, X_DTYPE: tl.constexpr):
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                    # [BH]
    i = tl.arange(0, BLOCK_DR)                                                 # [BD]
    mi = i < DR
    m = (hs < H)[:, None] & mi[None, :]                                        # [BH, BD]
    ia, ib = _rope_offsets(i, DR // 2, INTERLEAVE)
    rows = x_ptr + t.to(tl.int64) * stride_t + hs.to(tl.int64)[:, None] * stride_h + start   # [BH, 1]
    a = tl.load(rows + ia[None, :], mask=m, other=0.0).to(tl.float32)         # [BH, BD]
    b = tl.load(rows + ib[None, :], mask=m, other=0.0).to(tl.float32)
    cs = _round(tl.load(cos_ptr + t.to(tl.int64) * stride_cos + i, mask=mi, other=0.0).to(tl.float32), X_DTYPE)
    sn = _round(tl.load(sin_ptr + t.to(tl.int64) * stride_sin + i, mask=mi, other=0.0).to(tl.float32), X_DTYPE)
    y = _rope_combine(a, b, cs[None, :], sn[None, :], X_DTYPE)                 # [BH, BD]
    tl.debug_barrier()                                       # every load of the rows before any store
    tl.store(rows + i[None, :], y.to(X_DTYPE), mask=m)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, start: int) -> None:
    """x [T, H, D] (bf16 / fp16 / fp32, unit last stride), cos / sin [T, dr] -> x[..., start:start+dr] rotated
    in place."""
    T, H, D = x.shape
    dr = cos.shape[-1]
    assert x.stride(-1) == 1 and 0 <= start and start + dr <= D and dr % 2 == 0, (x.stride(), start, dr, D)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.shape == sin.shape == (T, dr)
    if T == 0 or H == 0 or dr == 0:
        return
    block_dr = triton.next_power_of_2(dr)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_dr))
    _rope_inplace_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), int(start),
        DR=dr, BLOCK_DR=block_dr, BLOCK_H=block_h, INTERLEAVE=bool(interleave), X_DTYPE=_TL_DTYPES[x.dtype],
        num_warps=4)
