"""Vocab-parallel embedding and LM head (rows of the vocabulary split across TP ranks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray.distributed.parallel_state import all_gather, all_reduce, tp_rank
from glm_ray.layers.linear import ColumnParallelLinear
from glm_ray.weights import load_sharded, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, params_dtype: torch.dtype, tp: int = 1):
        super().__init__()
        if vocab % tp:
            raise ValueError(f"vocab_size {vocab} is not divisible by tp={tp}")
        self.tp, self.per = tp, vocab // tp
        self.start = tp_rank() * self.per
        self.weight = set_weight_attrs(nn.Parameter(torch.empty(self.per, dim, dtype=params_dtype), requires_grad=False),
                                       output_dim=0, weight_loader=self.weight_loader)

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=0 if self.tp > 1 else None, rank=tp_rank(), tp=self.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per)
        out = F.embedding(local.clamp(0, self.per - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """Column-parallel over the vocabulary; logits are gathered to the full vocab on every rank."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return all_gather(self.quant_method.apply(self, h), dim=-1)              # [N, V]
