"""Quantized routed-expert MoE references (block-FP8 W8A8 and MXFP4 W4A4).

Semantics of quant_contracts.md §4.8: weights are dequantized, the stage-1 input `x` is
quantize-dequantized per token (1 x 128 FP8 or 1 x 32 MXFP4), and — as in aiter's 2-stage kernels —
the stage-2 input `swiglu(gate, up)` is re-quantized the same way before the down projection.
w13 `[E, 2I, D]` holds gate rows then up rows (SEPARATED halves), w2 `[E, D, I]`; activation is the
GLM clamped SiLU-GLU (`swiglu_limit`). `intermediate_pad` trailing zero rows/cols of each half do
not change the result.

These are oracles (one matmul pair per active expert), not a CPU hot path.
"""
from __future__ import annotations

from typing import Callable

import torch

from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, dequant_per_token_group, per_token_group_quant_fp8
from glm_ray.kernels.torch_ref.moe import fused_moe, swiglu
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4, qdq_mxfp4


def qdq_fp8_1x128(x: torch.Tensor, group_size: int = 128, ue8m0: bool = False) -> torch.Tensor:
    """Per-token-group FP8 quantize-dequantize: `[..., K]` -> `[..., K]` fp32."""
    q, s = per_token_group_quant_fp8(x, group_size, ue8m0=ue8m0)
    return dequant_per_token_group(q, s, group_size)


def fused_moe_act_qdq(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, act_qdq: Callable[[torch.Tensor], torch.Tensor] | None,
                      requant_intermediate: bool = True, swiglu_limit: float | None = None,
                      intermediate_pad: int = 0) -> torch.Tensor:
    """MoE on dequantized float weights with emulated activation quantization.

    x `[T, D]`; w13 `[E, 2I, D]` float; w2 `[E, D, I]` float; topk_* `[T, K]` -> `[T, D]` x.dtype.
    act_qdq: row-wise quantize-dequantize of activations (None = no activation quant).
    requant_intermediate=False applies act_qdq to the stage-1 input only and defers to the grouped
    `fused_moe` reference.
    """
    xq = x.to(torch.float32) if act_qdq is None else act_qdq(x.to(torch.float32))      # [T, D]
    if not requant_intermediate or act_qdq is None:
        return fused_moe(xq, w13.to(torch.float32), w2.to(torch.float32), topk_weights, topk_ids,
                         swiglu_limit=swiglu_limit, intermediate_pad=intermediate_pad).to(x.dtype)
    T, D = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        t, k = (topk_ids == e).nonzero(as_tuple=True)                                  # [n], [n]
        h = xq[t] @ w13[e].to(torch.float32).T                                         # [n, 2I]
        a = act_qdq(swiglu(h[:, :inter], h[:, inter:], swiglu_limit))                  # [n, I]
        y = a @ w2[e].to(torch.float32).T                                              # [n, D]
        out.index_add_(0, t, topk_weights[t, k, None].to(torch.float32) * y)
    return out.to(x.dtype)


def fused_moe_w8a8_block_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor,
                             w2: torch.Tensor, w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, *, block: tuple[int, int] = (128, 128),
                             act_ue8m0: bool = False, requant_intermediate: bool = True,
                             swiglu_limit: float | None = None, intermediate_pad: int = 0) -> torch.Tensor:
    """Block-FP8 MoE reference (aiter `QuantType.per_128x128`).

    w13 `[E, 2I, D]` e4m3 + w13_scale_inv `[E, ceil(2I/bn), ceil(D/bk)]`;
    w2 `[E, D, I]` e4m3 + w2_scale_inv `[E, ceil(D/bn), ceil(I/bk)]`; activations qdq per 1 x bk.
    """
    return fused_moe_act_qdq(
        x, dequant_block_fp8(w13, w13_scale_inv, block), dequant_block_fp8(w2, w2_scale_inv, block),
        topk_weights, topk_ids, act_qdq=lambda a: qdq_fp8_1x128(a, block[1], act_ue8m0),
        requant_intermediate=requant_intermediate, swiglu_limit=swiglu_limit, intermediate_pad=intermediate_pad)


def fused_moe_w4a4_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                         w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, *, act_mode: str | None = "even",
                         requant_intermediate: bool = True, swiglu_limit: float | None = None,
                         intermediate_pad: int = 0) -> torch.Tensor:
    """MXFP4 W4A4 MoE reference (aiter `QuantType.per_1x32`, unshuffled layouts).

    w13_packed `[E, 2I, D/2]` uint8 + w13_scale `[E, 2I, D/32]` uint8 (E8M0);
    w2_packed `[E, D, I/2]` uint8 + w2_scale `[E, D, I/32]` uint8.
    act_mode: MX scale mode of the dynamic activation quant ("even" = Quark calibration,
    "round_up" = current aiter HIP kernels); None gives W4A16.
    """
    qdq = None if act_mode is None else (lambda a: qdq_mxfp4(a, act_mode))
    return fused_moe_act_qdq(
        x, dequant_mxfp4(w13_packed, w13_scale), dequant_mxfp4(w2_packed, w2_scale), topk_weights, topk_ids,
        act_qdq=qdq, requant_intermediate=requant_intermediate, swiglu_limit=swiglu_limit,
        intermediate_pad=intermediate_pad)
