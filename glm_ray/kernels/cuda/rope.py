"""Triton kernel of the `rope_inplace` op (contract and torch reference: kernels/torch_ref/rope.py): the
rotary embedding of a query's rope dims, in place, in ONE launch instead of apply_rope's strided slices,
two cats, mul and addcmul plus the cat that reassembled [q_nope | q_pe] (the MLA query) or
[q_rope | q_rest] (the DSA indexer's query).

One program per (token, BLOCK_H heads): it loads the rows' rope dims contiguously (interleaved pairs as one
[BH, dr] load split into evens / odds in registers; half-split as two contiguous halves: no stride-2 gathers),
then stores the rotated halves in apply_rope's output layout (de-interleaved: x1-part then x2-part) over the
same dims; each program owns its rows whole, so reading before writing makes the in-place update safe. Rounding
as the reference (`cache_write._rope_combine`: A * cos rounded to the dtype, then one fp32 fma for the
addcmul). Grid and constexprs come from shapes / dtypes only (no host syncs, CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.cache_write import _TL_DTYPES, _rope_combine, _round


@triton.jit(do_not_specialize=['H'])
def _rope_inplace_kernel(x_ptr, cos_ptr, sin_ptr, H, stride_t, stride_h, stride_cos, stride_sin, start,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                         INTERLEAVE: tl.constexpr, X_DTYPE: tl.constexpr):
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                    # [BH]
    j = tl.arange(0, BLOCK_HALF)                                               # [BHF] pair index
    mj = j < HALF
    m = (hs < H)[:, None] & mj[None, :]                                        # [BH, BHF]
    rows = x_ptr + t.to(tl.int64) * stride_t + hs.to(tl.int64)[:, None] * stride_h + start   # [BH, 1]
    if INTERLEAVE:
        # the pairs (x[2j], x[2j+1]): one contiguous [BH, 2 * BHF] load, split into evens / odds in registers
        k = tl.arange(0, 2 * BLOCK_HALF)
        x = tl.load(rows + k[None, :], mask=(hs < H)[:, None] & (k < 2 * HALF)[None, :], other=0.0)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))             # [BH, BHF] each
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    else:                                                                      # the two halves, contiguous
        x1 = tl.load(rows + j[None, :], mask=m, other=0.0).to(tl.float32)      # [BH, BHF]
        x2 = tl.load(rows + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    cos_t = cos_ptr + t.to(tl.int64) * stride_cos
    sin_t = sin_ptr + t.to(tl.int64) * stride_sin
    c1 = _round(tl.load(cos_t + j, mask=mj, other=0.0).to(tl.float32), X_DTYPE)          # [BHF]
    c2 = _round(tl.load(cos_t + HALF + j, mask=mj, other=0.0).to(tl.float32), X_DTYPE)
    s1 = _round(tl.load(sin_t + j, mask=mj, other=0.0).to(tl.float32), X_DTYPE)
    s2 = _round(tl.load(sin_t + HALF + j, mask=mj, other=0.0).to(tl.float32), X_DTYPE)
    y1 = _rope_combine(x1, x2, c1[None, :], s1[None, :], X_DTYPE)             # out[:HALF] = x1 c1 + x2 s1
    y2 = _rope_combine(x2, x1, c2[None, :], s2[None, :], X_DTYPE)             # out[HALF:] = x2 c2 + x1 s2
    tl.debug_barrier()                                       # every load of the rows before any store
    tl.store(rows + j[None, :], y1.to(X_DTYPE), mask=m)
    tl.store(rows + HALF + j[None, :], y2.to(X_DTYPE), mask=m)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, start: int) -> None:
    """x [T, H, D] (bf16 / fp16 / fp32, unit last stride), cos / sin [T, dr] -> x[..., start:start+dr] rotated
    in place."""
    T, H, D = x.shape
    dr = cos.shape[-1]
    assert x.stride(-1) == 1 and 0 <= start and start + dr <= D and dr % 2 == 0, (x.stride(), start, dr, D)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.shape == sin.shape == (T, dr)
    if T == 0 or H == 0 or dr == 0:
        return
    block_half = triton.next_power_of_2(dr // 2)
    block_h = max(1, min(triton.next_power_of_2(H), 2048 // block_half))
    _rope_inplace_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), int(start),
        HALF=dr // 2, BLOCK_HALF=block_half, BLOCK_H=block_h, INTERLEAVE=bool(interleave),
        X_DTYPE=_TL_DTYPES[x.dtype], num_warps=4)
