"""Triton `fp32_linear` of the `cuda` backend at decode sizes (contract and oracle: kernels/torch_ref/linear.py;
this module imports triton): y = x.float() @ w.T in fp32 for the MoE router logits and the DSA indexer's
head weights, ONE launch where torch runs a cast of x and cuBLAS's fp32 GEMV with its split-K reduction
(or a SIMT sgemm at a few dozen rows): 2-3 launches each, twice a layer when the indexer scores.

Programs tile (tokens x outputs) (`layout.fp32_linear_config`: ~one program per SM, a [BT, BN, BK] product
tile of <= 4096 fp32) and walk D accumulating the exact fp32 products per lane, with one cross-lane sum at
the end (a sum per K step cost 24 us a call at T = 64 on the H200). The sum order differs from cuBLAS:
equal within fp32 rounding, not bitwise. Grid from shapes only (CUDA-graph capturable).

At prefill sizes the op runs fp32_split.py's tensor-core GEMM instead (NVIDIA only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import fp32_linear_config


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _fp32_linear_kernel(x_ptr, w_ptr, o_ptr, T, stride_xt, stride_wn, stride_ot,
                        N: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BT + tl.arange(0, BT)                           # [BT] tokens
    cols = pid_n * BN + tl.arange(0, BN)                                      # [BN] outputs
    row_ok = rows < T
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt                   # [BT, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn                   # [BN, 1]
    acc = tl.zeros([BT, BN, BK], dtype=tl.float32)                            # per-lane partial sums
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)                                             # [BK]
        k_ok = k < D
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)                 # [BN, BK]
        acc += x[:, None, :] * w[None, :, :]                                  # [BT, BN, BK]: no reduction per step
    y = tl.sum(acc, axis=2)                                                   # [BT, BN]: one cross-lane sum
    tl.store(o_ptr + rows[:, None] * stride_ot + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] (bf16 / fp16 / fp32, unit last stride), weight [N, D] fp32 -> y [T, N] fp32."""
    T, D = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, D) and weight.dtype == torch.float32, (weight.shape, weight.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)            # [T, N]
    if T == 0:
        return out
    bt, bn, bk = fp32_linear_config(T, N, D)
    _fp32_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bt))](
        x, weight, out, T, x.stride(0), weight.stride(0), out.stride(0), N=N, D=D, BT=bt, BN=bn, BK=bk, num_warps=4)
    return out


__all__ = ["fp32_linear"]
