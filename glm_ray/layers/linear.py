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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class ReplicatedLinear(LinearBase):
    pass


class MergedReplicatedLinear(ReplicatedLinear):
    """Replicated, with `len(output_sizes)` logical outputs stored back to back (checkpoint modules of
    possibly different sizes, concatenated along N; `forward` returns the whole [T, sum(sizes)] output).
    A param's shard i lands after the shards before it, counted in that param's units along its output
    axis: `param.shard_units` (block-FP8 scales: 128-row blocks; set here to the rows, `output_sizes`,
    where the quant method did not)."""

    def __init__(self, in_features: int, output_sizes: list[int], **kw):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), **kw)
        for p in self.parameters(recurse=False):          # the quant method's own units, else rows
            if getattr(p, "output_dim", None) is not None and getattr(p, "shard_units", None) is None:
                p.shard_units = list(self.output_sizes)

    def weight_loader(self, param, ckpt, shard_id=None):
        if shard_id is None:
            return super().weight_loader(param, ckpt)
        dim = getattr(param, "output_dim", None)
        units = list(param.shard_units)
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1, dest_dim=dim, dest_offset=sum(units[:shard_id]),
                     dest_len=units[shard_id])


class ColumnParallelLinear(LinearBase):
    tp_dim_role = "output"

    def _per_rank(self, i, o, tp):
        if o % tp:
            raise ValueError(f"{self.prefix}: output size {o} is not divisible by tp={tp}")
        return i, o // tp


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel with `len(output_sizes)` logical outputs stored back to back per rank."""

    def __init__(self, in_features: int, output_sizes: list[int], **kw):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), **kw)

    def weight_loader(self, param, ckpt, shard_id=None):
        if shard_id is None:
            return super().weight_loader(param, ckpt)
        dim = getattr(param, "output_dim", None)
        # per-rank, per-shard length along the output axis, in this param's units (rows or blocks)
        n = len(self.output_sizes)
        per = param.shape[dim] // n  # NOTE: gate/up halves are equal, so shards are equal-sized
        load_sharded(param, ckpt, shard_dim=dim if self.tp > 1 else None, rank=tp_rank(), tp=self.tp,
                     dest_dim=dim, dest_offset=shard_id * per, dest_len=per)


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
