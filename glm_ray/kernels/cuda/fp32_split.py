"""`fp32_linear` at prefill sizes on the tensor cores, for the `cuda` backend on NVIDIA Hopper (TMA tiles; contract
and oracle: kernels/torch_ref/linear.py; the decode-size kernel is fp32_linear.py, which ROCm's Triton runs too).

From `layout.FP32_LINEAR_SPLIT_MIN_ROWS` rows of bf16 x the fp32 weight is split once into three bf16 parts,
w = w0 + w1 + w2 exactly (`split3`: each part the rounding of what the ones before left; 3 x 8 mantissa bits hold
fp32's 24), and y = x.w0 + x.w1 + x.w2 with fp32 accumulation. x is bf16 already, so every product is exact in fp32,
as in the fp32 GEMM: the result is the same fp32 dot product, its sums in another order (the bf16x3 scheme of
fp32-emulating GEMMs). The MoE router's fp32 GEMM ran as cuBLAS's SIMT sgemm (`sm80_xmma_gemm_f32f32`), 2.7 ms of a
glm5-flash-31b 8 x 1k prefill step on the H200 (session 34). Grid from shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import fp32_linear_split_config
from glm_ray.kernels.cuda.tma import descriptor
from glm_ray.kernels.cuda.triton_kernels import INTERPRET


def split3(weight: torch.Tensor) -> torch.Tensor:
    """fp32 w [N, D] -> [3, N, D] bf16 with w0.float() + w1.float() + w2.float() == w exactly (each rounding error
    of fp32 -> bf16 is itself an fp32 number; what is left after two parts has at most 8 significant bits)."""
    w = weight.float()
    parts = []
    for _ in range(3):
        p = w.to(torch.bfloat16)
        parts.append(p)
        w = w - p.float()                                                     # exact: the rounding error
    return torch.stack(parts)                                                 # [3, N, D]


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _fp32_linear_split_kernel(x_desc, w_desc, o_ptr, T, N, stride_ot, D: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    """o[t, n] = sum_p x[t] . w[p, n] in fp32: tensor-core dots of bf16 tiles into one fp32 accumulator. x_desc: a
    descriptor of x [T, D] (block [BM, BK]), w_desc one of the parts viewed [3N, D] (block [BN, BK]; part p's rows
    start at p * N). Tiles past T / D read zeros; a tile's rows past a part's N read the next part's (only the
    columns >= N see them, and those are not stored). (Pointer tiles ran into 255 registers and ~1 KB of spills
    a thread at 64 x 64 on sm_90a with Triton 3.6; descriptors: 58 registers, TMA loads.)"""
    m0 = tl.program_id(0) * BM
    n0 = tl.program_id(1) * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        x = x_desc.load([m0, k0])                                             # [BM, BK] bf16
        if INTERP:
            x = x.to(tl.float32)
        for p in tl.static_range(3):                                          # the weight's three bf16 parts
            w = w_desc.load([p * N + n0, k0])                                 # [BN, BK] bf16
            if INTERP:
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc,
             mask=(rows < T)[:, None] & (cols < N)[None, :])


def fp32_linear_split(x: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """x [T, D] bf16, w3 [3, N, D] bf16 = `split3(weight)` -> y [T, N] fp32 = x.float() @ weight.T (up to the order
    of the fp32 sums)."""
    T, D = x.shape
    N = w3.shape[1]
    assert x.dtype == torch.bfloat16 and w3.dtype == torch.bfloat16 and w3.shape == (3, N, D), (x.dtype, w3.shape)
    if x.stride(-1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16:   # TMA: 16-byte aligned base and rows
        x = x.contiguous()
    w2 = w3.contiguous().view(3 * N, D)                                       # [3N, D]
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)            # [T, N]
    if T == 0:
        return out
    bm, bn, bk, warps, stages = fp32_linear_split_config(T, N)
    x_desc = descriptor(x, [bm, bk])
    w_desc = descriptor(w2, [bn, bk])
    _fp32_linear_split_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
        x_desc, w_desc, out, T, N, out.stride(0), D=D, BM=bm, BN=bn, BK=bk, INTERP=INTERPRET, num_warps=warps,
        num_stages=stages)
    return out


__all__ = ["fp32_linear_split", "split3"]
