"""Triton SwiGLU activation of the `cuda` backend (contract and oracle: `swiglu` in kernels/torch_ref/moe.py;
this module imports triton): out = silu(gate) * up, or the clamped form silu(min(gate, L)) * clamp(up, -L, L),
in ONE launch where torch runs silu and the product as two (the dense MLP and every shared expert: two
launches a layer at decode). The rounding follows torch's bf16 / fp16 ops step by step — silu in fp32
with an IEEE division by 1 + expf(-g) (libdevice's expf, as ATen's kernel), rounded to the input dtype,
then the product in fp32 rounded again — so the result equals the two torch ops' bit for bit.
Grid (T, cdiv(I, BLOCK)) from shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, T, I, stride_g, stride_u, stride_o, limit,
                   HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                     # [BLOCK]
    ok = cols < I
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if INTERP:                                                                # numpy's exp (no libdevice there)
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)                                                 # expf, as ATen's silu
    s = tl.math.div_rn(g, 1.0 + e)                                            # silu in fp32, IEEE division
    s = s.to(o_ptr.dtype.element_ty).to(tl.float32)                           # torch rounds silu's output
    tl.store(o_ptr + row * stride_o + cols, (s * u).to(o_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate, up [T, I] (bf16 / fp16, unit last strides, any row strides) -> out [T, I] contiguous."""
    assert gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype, (gate.shape, up.shape)
    assert gate.stride(-1) == 1 and up.stride(-1) == 1
    T, I = gate.shape
    out = torch.empty(T, I, dtype=gate.dtype, device=gate.device)            # [T, I]
    if T == 0 or I == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(I))
    _swiglu_kernel[(T, triton.cdiv(I, block))](gate, up, out, T, I, gate.stride(0), up.stride(0), out.stride(0),
                                               float(limit) if limit is not None else 0.0,
                                               HAS_LIMIT=limit is not None, BLOCK=block, INTERP=INTERPRET,
                                               num_warps=4)
    return out


__all__ = ["swiglu"]
