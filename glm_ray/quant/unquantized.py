"""The unquantized methods: weights in the model dtype, plain GEMMs and the grouped MoE kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray import kernels
from glm_ray.layer_contracts import LayerKind, layer_kind
from glm_ray.quant.base import LinearMethod, MoEMethod, QuantConfig
from glm_ray.weights import set_weight_attrs


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, in_features, out_features, params_dtype):
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1,
                                                            weight_loader=layer.weight_loader))

    def apply(self, layer, x):
        return F.linear(x, layer.weight)                                   # [T, in] -> [T, out]

    def apply_into(self, layer, x, out):
        return linear_into(x, layer.weight, out)


def linear_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) [T, N] written into `out` (contiguous): the same GEMM, no copy after."""
    torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out=out.view(-1, out.shape[-1]))
    return out


class UnquantizedMoEMethod(MoEMethod):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype),
                           requires_grad=False)                            # [E, 2I, D] gate rows ; up rows
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype),
                          requires_grad=False)                             # [E, D, I]
        layer.register_parameter("w13_weight", set_weight_attrs(w13, output_dim=1, input_dim=2,
                                                                weight_loader=layer.weight_loader))
        layer.register_parameter("w2_weight", set_weight_attrs(w2, output_dim=1, input_dim=2,
                                                               weight_loader=layer.weight_loader))

    def apply(self, layer, x, topk_weights, topk_ids):
        c = layer.contract
        return kernels.ops().fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                       swiglu_limit=c.swiglu_limit, intermediate_pad=c.intermediate_pad)


class Unquantized(QuantConfig):
    name = "none"

    def get_method(self, layer, prefix):
        return UnquantizedMoEMethod() if layer_kind(layer) == LayerKind.MOE else UnquantizedLinearMethod()
