"""Torch reference of the MoE router after its GEMM (GLM-5 / DeepSeek-V3 "noaux_tc" routing): from the
router logits to the top-k expert ids and their combine weights.

    scores  = sigmoid(logits)                                         [T, E] fp32
    choice  = scores + bias                  (bias only for SELECTION) [T, E]
    n_group > 1: group score = sum of the top-2 choices of each of the n_group groups; the choices of
                 all but the topk_group best groups are set to -inf
    ids     = topk(choice, top_k)            (descending choice order) [T, K]
    weights = scores[ids]                    (un-biased)               [T, K]
              / (sum + 1e-20) if renormalize, then * scale

This is exactly `TopKRouter.forward` (layers/moe.py) minus the GEMM, with ids as int32. About ten small
launches per layer in torch; the cuda backend runs all of it as one Triton kernel (kernels/cuda/routing.py).
The GEMM before it is `fp32_linear` (torch_ref/linear.py): fp32 logits of the (bf16) hidden states against
the fp32 router weight, as transformers' GLM-5 router computes them.
"""
from __future__ import annotations

import torch


def moe_routing(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int,
                renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] (None = zeros) -> (weights [T, K] fp32, ids [T, K] int32)."""
    T, E = logits.shape
    scores = logits.float().sigmoid()                                         # [T, E] fp32
    choice = scores if bias is None else scores + bias                        # [T, E]
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group)                             # [T, G, E/G]
        group_scores = g.topk(2, dim=-1).values.sum(-1)                       # [T, G]
        keep = group_scores.topk(topk_group, dim=-1).indices                  # [T, topk_group]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = g.masked_fill(~mask[..., None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices                                  # [T, K] int64
    w = scores.gather(1, ids)                                                 # [T, K] un-biased
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids.to(torch.int32)
