"""Torch reference of the mHC mixing coefficients (GLM-5.3-Flash hyper-connections): from the
per-token projection `m = rms(flat(streams)) @ fnᵀ` to the collapse / expand / recombination weights.

    pre  = sigmoid(m[:n]·s0 + b[:n]) + eps                        [T, n]
    post = 2·sigmoid(m[n:2n]·s1 + b[n:2n])                        [T, n]
    comb = softmax(m[2n:]·s2 + b[2n:], -1) + eps                  [T, n(in), n(out)]
    comb: column-normalise, then (iters-1) × (row, column)         (Sinkhorn-Knopp, fp32)

About 6·iters elementwise launches in torch (the Sinkhorn loop is ~3/4 of a GLM-5.3-Flash decode
step's launches); the cuda backend runs all of it as one Triton kernel (kernels/cuda/mhc.py).
"""
from __future__ import annotations

import torch


def mhc_coefficients(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, eps: float,
                     iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m [T, (2+n)n] fp32, base [(2+n)n] fp32, scale [3] fp32 -> pre [T, n], post [T, n], comb [T, n, n]."""
    T = m.shape[0]
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps                 # [T, n]
    post = 2 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])        # [T, n]
    comb = torch.softmax(m[:, 2 * n:].view(T, n, n) * scale[2] + base[2 * n:].view(n, n), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)                          # [T, n, n]
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb
