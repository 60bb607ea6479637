"""RMSNorm (fp32 statistics, cast back before the weight, as GLM checkpoints were trained; optionally with
the residual add of the decoder layer fused in front, through the `rms_norm` kernel op) and the indexer's
LayerNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray import kernels
from glm_ray.weights import load_sharded, set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_attrs(nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False),
                                       is_norm=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, in_place: bool = False):
        """x [..., D] -> weight * rms_norm(x.float()).to(x.dtype) [..., D]; with `residual` [..., D]:
        (norm of s, s = x + residual) — the add of the residual stream fused into the same launch; `in_place`
        stores s into `residual` (the caller gives up the old stream)."""
        return kernels.ops().rms_norm(x, self.weight, self.eps, residual, in_place=in_place)

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the indexer's k_norm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_attrs(nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False), is_norm=True)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)
