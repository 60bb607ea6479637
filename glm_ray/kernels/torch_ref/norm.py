"""RMSNorm references (the oracle of the fused kernels): fp32 statistics and normalization, cast back
to the input dtype, then the weight in that dtype — the order GLM checkpoints were trained with
(transformers' `GlmMoeDsaRMSNorm`). `add_rms_norm` first adds the residual in the input dtype, as the
decoder layer's `residual + hidden` does, and returns that sum as the new residual stream."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any leading strides), weight [D] -> [..., D]."""
    # F.rms_norm without a weight: one fused kernel where torch has one
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [T, D]."""
    s = x + residual
    return rms_norm(s, weight, eps), s
