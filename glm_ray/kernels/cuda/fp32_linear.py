"""Triton `fp32_linear` of the `cuda` backend at decode sizes (contract and oracle: kernels/torch_ref/linear.py;
this module imports triton): y = x.float() @ w.T in fp32 for the MoE router logits and the DSA indexer's
head weights, ONE launch where torch runs a cast of x and cuBLAS's fp32 GEMV with its split-K reduction
(or a SIMT sgemm at a few dozen rows): 2-3 launches each, twice a layer when the indexer scores.

Programs tile (tokens x outputs) (`layout.fp32_linear_config`: ~one program per SM, a [BT, BN, BK] product
tile of <= 4096 fp32) and walk D accumulating the exact fp32 products per lane, with one cross-lane sum at
the end (a sum per K step cost 24 us a call at T = 64 on the H200). The sum order differs from cuBLAS:
equal within fp32 rounding, not bitwise. Grid from shapes only (CUDA-graph capturable).

At prefill sizes (`fp32_linear_split`, from `layout.FP32_LINEAR_SPLIT_MIN_ROWS` rows of bf16 / fp16 x) the GEMM
runs on the tensor cores: the fp32 weight is split once into three bf16 parts, w = w0 + w1 + w2 exactly (`split3`:
each part the rounding of what the ones before left; 3 x 8 mantissa bits hold fp32's 24), and y = x.w0 + x.w1 +
x.w2 with fp32 accumulation. x is bf16 already, so every product is exact in fp32, as in the fp32 GEMM: the result
is the same fp32 dot product, its sums in another order (the bf16x3 scheme of fp32-emulating GEMMs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from glm_ray.kernels.cuda.layout import fp32_linear_config, fp32_linear_split_config
from glm_ray.kernels.cuda.triton_kernels import INTERPRET


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
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk])
    w_desc = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [bn, bk])
    _fp32_linear_split_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
        x_desc, w_desc, out, T, N, out.stride(0), D=D, BM=bm, BN=bn, BK=bk, INTERP=INTERPRET, num_warps=warps,
        num_stages=stages)
    return out


__all__ = ["fp32_linear", "fp32_linear_split", "split3"]
