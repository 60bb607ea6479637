"""Quantization as strategy objects on layers.

A layer knows its shapes and its tensor-parallel split; its quant *method* owns the weights:
`create_weights` registers parameters (with their on-disk names and a `weight_loader` that places a
checkpoint tensor into this rank's shard), `process_weights_after_loading` turns checkpoint layout
into runtime layout (dequant for the reference, preshuffle for aiter, ...), `apply` runs the math.
"Unquantized" is a method too, so layer code never branches on `None`.

`QuantConfig.get_method(layer, prefix)` is the one place that decides which method a layer gets.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """Strategy for a (possibly TP-sharded) linear layer `y = x @ W.T`.

    The layer passes its *per-rank* shape: `out_features` rows, `in_features` columns.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...   # [T, in] -> [T, out]

    def apply_into(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`apply` written into `out` [T, out] (contiguous, the output dtype), which is returned: a destination the
        caller keeps (a piecewise graph's static carry). This default copies; a method whose kernel takes an
        output buffer writes it directly."""
        return out.copy_(self.apply(layer, x))


class MoEMethod(ABC):
    """Strategy for the routed experts of one MoE layer (per-rank intermediate shard)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor: ...   # x [T, D], topk_* [T, K] -> [T, D]


class QuantConfig(ABC):
    """Parsed `quantization_config` (or its absence); decides the method per layer."""

    name: str = "none"

    @abstractmethod
    def get_method(self, layer: nn.Module, prefix: str) -> LinearMethod | MoEMethod: ...

    def can_fuse(self, prefixes: list[str]) -> bool:
        """Whether the checkpoint linears at `prefixes` resolve to one method, so that one runtime linear
        (their weights concatenated along N) can hold them."""
        return True
