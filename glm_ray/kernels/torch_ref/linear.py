"""Torch reference of `fp32_linear`: an fp32 GEMM of (bf16) activations against an fp32 weight, as
transformers computes GLM-5's MoE router logits (`F.linear(x.float(), gate.weight.float())`) and the DSA
indexer's per-head weights (`weights_proj(x.float())`). Decode-sized, these are GEMVs: the cuda backend
runs them as one Triton launch (kernels/cuda/fp32_linear.py) where torch runs a cast and a cuBLAS fp32
GEMV with its split-K reduction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] (any float dtype), weight [N, D] fp32 -> y [T, N] fp32 = x.float() @ weight.T."""
    return F.linear(x.float(), weight)
