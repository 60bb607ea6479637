"""Triton kernel for the mHC mixing coefficients (contract and torch reference:
kernels/torch_ref/mhc.py): sigmoid pre/post weights and the softmax + Sinkhorn-Knopp recombination
matrix of every token in one launch, instead of ~6·iters small torch launches per mHC site.
One program handles BLOCK_T tokens; each token's n×n matrix stays in registers for all iterations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _mhc_coefficients_kernel(m_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_m, eps,
                             ITERS: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                 # [BT]
    ok = rows < T
    cn = tl.arange(0, N)                                                      # [N]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    row_m = m_ptr + rows[:, None] * stride_m                                  # [BT, 1]
    pre = tl.sigmoid(tl.load(row_m + cn[None, :], mask=ok[:, None], other=0.0) * s0
                     + tl.load(base_ptr + cn)[None, :]) + eps                 # [BT, N]
    post = 2.0 * tl.sigmoid(tl.load(row_m + N + cn[None, :], mask=ok[:, None], other=0.0) * s1
                            + tl.load(base_ptr + N + cn)[None, :])            # [BT, N]
    tl.store(pre_ptr + rows[:, None] * N + cn[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + rows[:, None] * N + cn[None, :], post, mask=ok[:, None])
    ij = cn[:, None] * N + cn[None, :]                                        # [N, N] row-major (in, out)
    x = tl.load(m_ptr + rows[:, None, None] * stride_m + 2 * N + ij[None, :, :], mask=ok[:, None, None],
                other=0.0) * s2 + tl.load(base_ptr + 2 * N + ij)[None, :, :]  # [BT, N, N]
    x = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    c = x / tl.sum(x, axis=2)[:, :, None] + eps                               # softmax over out, + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)                             # column-normalise
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)                         # rows
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)                         # columns
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + ij[None, :, :], c, mask=ok[:, None, None])


def mhc_coefficients(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, eps: float,
                     iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m [T, (2+n)n] fp32, base [(2+n)n], scale [3] -> pre [T, n], post [T, n], comb [T, n, n] (fp32)."""
    assert n & (n - 1) == 0, "n must be a power of 2 (tl.arange); CudaKernels routes others to the reference"
    T = m.shape[0]
    m = m.float()
    if m.stride(-1) != 1:
        m = m.contiguous()
    pre = m.new_empty(T, n)
    post = m.new_empty(T, n)
    comb = m.new_empty(T, n, n)
    block = 32
    _mhc_coefficients_kernel[(triton.cdiv(T, block),)](
        m, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, T, m.stride(0), eps,
        ITERS=iters, N=n, BLOCK_T=block)
    return pre, post, comb
