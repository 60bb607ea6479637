"""Torch reference of the RMSNorm op, with the residual add of the decoder layer fused in front of it
(vLLM's fused_add_rms_norm idea):

    s = x + residual                      (residual form only; in x's dtype, as `x = x + h` did)
    y = weight * F.rms_norm(s.float(), (D,), eps=eps).to(s.dtype)
    returns y, or (y, s) in the residual form (s is the new residual stream; with `in_place`, s is stored into
    `residual` itself, vLLM's in-place fused_add_rms_norm: a piecewise graph's static residual carry, no copy)

fp32 statistics and normalization, cast back to the input dtype, then the weight multiply in the input
dtype (GLM checkpoints were trained that way). This is exactly what `RMSNorm.forward` computed before it
moved to the `rms_norm` op, so the torch backend is bit-identical to the old layer. The cuda backend runs
it as one Triton launch (kernels/cuda/norm.py) instead of ~4 (+1 for the add).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             in_place: bool = False):
    """x [..., D], weight [D], residual [..., D] | None -> y [..., D], or (y, x + residual) when given (written
    into `residual`, which is returned, with `in_place`)."""
    if residual is not None:
        x = residual.add_(x) if in_place else x + residual                   # [..., D] the new stream
    y = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)   # [..., D]
    return y if residual is None else (y, x)
