"""Mixture of experts: the sigmoid/grouped top-k router, the routed experts and the dense MLP.

The MoE *contract* (gate/up layout, clamped SwiGLU limit, padding) is recorded on the experts layer
in a `MoEContract` and forwarded to whichever kernel runs it — never inferred from a global setting.
Routed experts are sharded over the intermediate dim across TP ranks; the routed and shared partial
sums are added and all-reduced once.
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray import envs, kernels
from glm_ray.config import ModelConfig
from glm_ray.distributed.parallel_state import all_reduce, tp_rank
from glm_ray.kernels.streams import forked, join, side_stream_for
from glm_ray.layer_contracts import LayerKind, MoEContract
from glm_ray.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from glm_ray.weights import load_sharded, set_weight_attrs


class TopKRouter(nn.Module):
    """sigmoid scores; `e_score_correction_bias` only for selection; grouped top-k; renormalize; scale."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = set_weight_attrs(nn.Parameter(torch.empty(E, D, dtype=torch.float32), requires_grad=False),
                                       weight_loader=self.weight_loader)
        self.e_score_correction_bias = set_weight_attrs(
            nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False),
            weight_loader=self.weight_loader, ckpt_dtypes=frozenset({"F32", "BF16", "F16"}))

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K] fp32, ids [T, K] int32): the `fp32_linear` GEMM, then `moe_routing`."""
        logits = kernels.ops().fp32_linear(x, self.weight)                       # [T, E] fp32
        return kernels.ops().moe_routing(logits, self.e_score_correction_bias, top_k=self.top_k,
                                         n_group=self.n_group, topk_group=self.topk_group,
                                         renormalize=self.norm_topk_prob, scale=self.scale)


class FusedMoE(nn.Module):
    """Routed experts of one layer; weights owned by the quant method (w13 [E, 2I/tp, D], w2 [E, D, I/tp])."""
    kind = LayerKind.MOE

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, quant_config,
                 prefix: str, params_dtype: torch.dtype, contract: MoEContract, tp: int = 1):
        super().__init__()
        if intermediate_size % tp:
            raise ValueError(f"{prefix}: moe_intermediate_size {intermediate_size} not divisible by tp={tp}")
        self.prefix, self.tp, self.contract = prefix, tp, contract
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // tp
        self.quant_method = quant_config.get_method(self, prefix)
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_size, params_dtype)

    def weight_loader(self, param: nn.Parameter, ckpt, shard_id: str, expert_id: int) -> None:
        """One expert's gate ("w1"), up ("w3") or down ("w2") tensor from the checkpoint."""
        dest = param.data[expert_id]                                             # [2I, D] or [D, I] (or scales)
        view = set_weight_attrs(nn.Parameter(dest, requires_grad=False),
                                ckpt_dtypes=getattr(param, "ckpt_dtypes", None) or frozenset({"F32", "BF16", "F16"}))
        if shard_id == "w2":
            dim = param.input_dim - 1
            load_sharded(view, ckpt, shard_dim=dim if self.tp > 1 else None, rank=tp_rank(), tp=self.tp)
            return
        dim = param.output_dim - 1
        half = dest.shape[dim] // 2
        load_sharded(view, ckpt, shard_dim=dim if self.tp > 1 else None, rank=tp_rank(), tp=self.tp,
                     dest_dim=dim, dest_offset=0 if shard_id == "w1" else half, dest_len=half)

    def forward(self, x, topk_weights, topk_ids):
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


class MLP(nn.Module):
    """Dense SwiGLU MLP (first dense layers and the shared experts); gate/up merged, column/row TP."""

    def __init__(self, hidden: int, inter: int, *, quant_config, prefix: str, params_dtype, tp: int,
                 swiglu_limit: float | None = None, reduce_results: bool = True):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj", params_dtype=params_dtype, tp=tp)
        self.down_proj = RowParallelLinear(inter, hidden, quant_config=quant_config, prefix=f"{prefix}.down_proj",
                                           params_dtype=params_dtype, tp=tp, reduce_results=reduce_results)

    def forward(self, x):
        gu = self.gate_up_proj(x)                                                # [T, 2I/tp]
        g, u = gu.chunk(2, dim=-1)
        return self.down_proj(kernels.ops().swiglu(g, u, self.swiglu_limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, *, quant_config, prefix: str, params_dtype, tp: int):
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                quant_config=quant_config, prefix=f"{prefix}.experts", params_dtype=params_dtype,
                                contract=MoEContract(swiglu_limit=cfg.swiglu_limit), tp=tp)
        self.shared_experts = None
        self.side_stream_tokens = envs.SIDE_STREAM_TOKENS.get()         # decode sizes fork the shared experts
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      quant_config=quant_config, prefix=f"{prefix}.shared_experts",
                                      params_dtype=params_dtype, tp=tp, swiglu_limit=cfg.swiglu_limit,
                                      reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = None
        if self.shared_experts is not None:
            side = side_stream_for(x, self.side_stream_tokens)
        if side is not None:                                                     # decode: fork the shared experts
            with forked(side):
                shared = self.shared_experts(x)                                  # [T, D]
        topk_weights, topk_ids = self.gate(x)                                    # [T, K] each
        y = self.experts(x, topk_weights, topk_ids)                              # [T, D] partial over TP
        if side is not None:
            join(side)                                                           # before the sum
            y = y + shared
        elif self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return all_reduce(y)
