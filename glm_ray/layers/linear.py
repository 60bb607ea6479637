"""Linear layers that know their tensor-parallel split; the weights belong to the quant method.

- `ReplicatedLinear`: every rank holds the whole weight (the indexer's projections).
- `MergedReplicatedLinear`: several replicated outputs stored as one param (MLA's q_a + kv_a: one GEMM).
- `ColumnParallelLinear`: output rows split across ranks (q_b, kv_b by heads; lm_head).
- `MergedColumnParallelLinear`: several column-parallel outputs stored as one param (gate_up).
- `RowParallelLinear`: input columns split; the partial sums are all-reduced (o_proj, down).

Quant methods register params with `output_dim` / `input_dim` attributes and, for block-quantized
tensors, use the same attributes on their scale params (in units of blocks); the loaders below are
therefore method-agnostic.
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.distributed.parallel_state import all_reduce, tp_rank
from glm_ray.weights import CheckpointTensor, load_sharded


class LinearBase(nn.Module):
    tp_dim_role: str | None = None           # "output" | "input" | None: which axis is sharded

    def __init__(self, in_features: int, out_features: int, *, quant_config, prefix: str,
                 params_dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.prefix = prefix
        self.in_features_full, self.out_features_full = in_features, out_features
        self.tp = tp
        in_pr, out_pr = self._per_rank(in_features, out_features, tp)
        self.in_features, self.out_features = in_pr, out_pr
        self.params_dtype = params_dtype
        self.quant_method = quant_config.get_method(self, prefix)
        self.quant_method.create_weights(self, in_pr, out_pr, params_dtype)

    def _per_rank(self, i: int, o: int, tp: int) -> tuple[int, int]:
        return i, o

    def _shard_dim(self, param: nn.Parameter) -> int | None:
        if self.tp_dim_role is None or self.tp == 1:
            return None
        return getattr(param, f"{self.tp_dim_role}_dim", None)

    def weight_loader(self, param: nn.Parameter, ckpt: CheckpointTensor, shard_id=None) -> None:
        load_sharded(param, ckpt, shard_dim=self._shard_dim(param), rank=tp_rank(), tp=self.tp)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out]; written into `out` [T, out] when given (`LinearMethod.apply_into`)."""
        return self.quant_method.apply(self, x) if out is None else self.quant_method.apply_into(self, x, out)


class ReplicatedLinear(LinearBase):
    pass


class _MergedShards:
    """Several checkpoint modules stored back to back along N in one param (gate_up; q_a + kv_a). Shard i of
    a param lands after the shards before it, counted in that param's units along its output axis per rank:
    `param.shard_units`, set by the quant method where it stores in other units (block-FP8 scales: 128-row
    blocks), else here to the rows (`output_sizes` / tp)."""

    output_sizes: list[int]

    def _set_shard_units(self) -> None:
        for p in self.parameters(recurse=False):
            if getattr(p, "output_dim", None) is not None and getattr(p, "shard_units", None) is None:
                p.shard_units = [s // self.tp for s in self.output_sizes]

    def weight_loader(self, param, ckpt, shard_id=None):
        if shard_id is None:
            return super().weight_loader(param, ckpt)
        dim, units = param.output_dim, param.shard_units
        load_sharded(param, ckpt, shard_dim=self._shard_dim(param), rank=tp_rank(), tp=self.tp, dest_dim=dim,
                     dest_offset=sum(units[:shard_id]), dest_len=units[shard_id])


class MergedReplicatedLinear(_MergedShards, ReplicatedLinear):
    """Replicated, `len(output_sizes)` logical outputs of possibly different sizes back to back; `forward`
    returns the whole [T, sum(sizes)] output."""

    def __init__(self, in_features: int, output_sizes: list[int], **kw):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), **kw)
        self._set_shard_units()


class ColumnParallelLinear(LinearBase):
    tp_dim_role = "output"

    def _per_rank(self, i, o, tp):
        if o % tp:
            raise ValueError(f"{self.prefix}: output size {o} is not divisible by tp={tp}")
        return i, o // tp


class MergedColumnParallelLinear(_MergedShards, ColumnParallelLinear):
    """Column-parallel with `len(output_sizes)` logical outputs stored back to back per rank."""

    def __init__(self, in_features: int, output_sizes: list[int], **kw):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), **kw)
        self._set_shard_units()


class RowParallelLinear(LinearBase):
    tp_dim_role = "input"

    def __init__(self, *args, reduce_results: bool = True, **kw):
        self.reduce_results = reduce_results
        super().__init__(*args, **kw)

    def _per_rank(self, i, o, tp):
        if i % tp:
            raise ValueError(f"{self.prefix}: input size {i} is not divisible by tp={tp}")
        return i // tp, o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return all_reduce(y) if self.reduce_results else y
