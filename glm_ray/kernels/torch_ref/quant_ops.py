"""Torch-reference implementations of the quantized `KernelOps` fields (the default backend).

They define the runtime contracts every backend implements (shapes in `glm_ray/kernels/__init__.py`):

* `block_fp8_linear_prepare(w, scale_inv, block)` -> `(w, scale_inv, meta)`: runtime layout of a
  block-FP8 linear. The reference keeps the checkpoint layout (`meta = {}`).
* `moe_quant_layout(kind, num_experts, hidden, inter, block)` -> `MoEQuantLayout`: the padding a
  backend's quantized MoE runner needs (reference: none) and, when it cannot run a shape at all, the
  reason. Asked once, at model construction, so an unsupported layer fails early and by name.
* `moe_quant_prepare(kind, w13, w13_scale, w2, w2_scale)` -> the runtime tensors + `meta` (the
  reference: unchanged, `{}`); `meta` is forwarded to the runner call by the method that owns it.
* `fused_moe_block_fp8(...)` / `fused_moe_mxfp4(...)`: the routed experts with the MoE contract passed
  explicitly: `gate_mode` ("separated" only: w13 = [gate rows ; up rows]), `swiglu_limit` (None = no
  clamp), `hidden_pad` / `intermediate_pad` (trailing zero columns of D / rows of each half of I).

Block-FP8 MoE scales are *per half*: `w13_scale_inv` is `[E, 2 * ceil(I'/bn), ceil(D'/bk)]` = the gate
half's block rows then the up half's. When I' % bn == 0 (every real GLM shape, and what aiter needs)
this is exactly the `[E, ceil(2I'/bn), ...]` layout of SGLang/aiter; otherwise (tiny test models) a
block never straddles the two halves, which is what the per-expert checkpoint scales describe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8
from glm_ray.kernels.torch_ref.moe_quant import fused_moe_act_qdq, qdq_fp8_1x128
from glm_ray.kernels.torch_ref.mxfp4 import MX_BLOCK, dequant_mxfp4, qdq_mxfp4
from glm_ray.kernels.torch_ref.mxfp4 import mxfp4_linear as _mxfp4_linear

SEPARATED = "separated"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MoEQuantLayout:
    hidden_pad: int = 0              # zero columns appended to D (w13's K, w2's N)
    intermediate_pad: int = 0        # zero rows appended to each half of w13 and columns of w2
    unsupported: str | None = None   # why this runner cannot run the layer (None = it can)


# --------------------------------------------------------------------------------------------
# layout / prepare
# --------------------------------------------------------------------------------------------

def block_fp8_linear_prepare(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """Reference: the checkpoint layout is the runtime layout."""
    return w, scale_inv, {}


def moe_quant_layout(kind: str, num_experts: int, hidden: int, inter: int,
                     block: tuple[int, int] | None = None) -> MoEQuantLayout:
    if kind == "mxfp4" and (hidden % MX_BLOCK or inter % MX_BLOCK):
        return MoEQuantLayout(unsupported=f"MXFP4 needs hidden ({hidden}) and per-rank intermediate ({inter}) "
                                          f"to be multiples of {MX_BLOCK}")
    if kind not in ("fp8_block", "mxfp4"):
        return MoEQuantLayout(unsupported=f"no quantized MoE runner for {kind!r}")
    return MoEQuantLayout()


def moe_quant_prepare(kind: str, w13, w13_scale, w2, w2_scale):
    return w13, w13_scale, w2, w2_scale, {}


# --------------------------------------------------------------------------------------------
# runners
# --------------------------------------------------------------------------------------------

def _check_contract(gate_mode: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, hidden_pad: int,
                    packed: int = 1) -> None:
    if gate_mode != SEPARATED:
        raise ValueError(f"torch MoE reference runs gate_mode 'separated' only, got {gate_mode!r} "
                         "(the quant method converts interleaved sources at load)")
    d_pad = w2.shape[1]
    if x.shape[-1] + hidden_pad != d_pad or w13.shape[2] * packed != d_pad:
        raise ValueError(f"MoE shapes: x {tuple(x.shape)} + hidden_pad {hidden_pad} vs w13 {tuple(w13.shape)} / "
                         f"w2 {tuple(w2.shape)}")


def dequant_w13_block_fp8(w13: torch.Tensor, w13_scale_inv: torch.Tensor,
                          block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Per-half dequant of w13 `[E, 2I, D]` e4m3 with scales `[E, 2*ceil(I/bn), ceil(D/bk)]` -> fp32."""
    inter = w13.shape[1] // 2
    g = _cdiv(inter, block[0])
    if w13_scale_inv.shape[1] != 2 * g:
        raise ValueError(f"w13_scale_inv {tuple(w13_scale_inv.shape)}: expected {2 * g} block rows for 2 x {inter} "
                         f"rows (gate blocks then up blocks)")
    return torch.cat([dequant_block_fp8(w13[:, :inter], w13_scale_inv[:, :g], block),
                      dequant_block_fp8(w13[:, inter:], w13_scale_inv[:, g:], block)], 1)


def fused_moe_block_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                        w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        block: tuple[int, int] = (128, 128), act_ue8m0: bool = False,
                        swiglu_limit: float | None = None, gate_mode: str = SEPARATED, hidden_pad: int = 0,
                        intermediate_pad: int = 0) -> torch.Tensor:
    """Block-FP8 W8A8 routed experts (aiter `QuantType.per_128x128` semantics): dequantized weights,
    activations quantize-dequantized per 1 x bk before both GEMMs. x `[T, D]` -> `[T, D]` x.dtype."""
    _check_contract(gate_mode, x, w13, w2, hidden_pad)
    d = x.shape[-1]
    xp = F.pad(x, (0, hidden_pad)) if hidden_pad else x
    out = fused_moe_act_qdq(xp, dequant_w13_block_fp8(w13, w13_scale_inv, block),
                            dequant_block_fp8(w2, w2_scale_inv, block), topk_weights, topk_ids,
                            act_qdq=lambda a: qdq_fp8_1x128(a, block[1], act_ue8m0), swiglu_limit=swiglu_limit,
                            intermediate_pad=intermediate_pad)
    return out[:, :d] if hidden_pad else out


def fused_moe_mxfp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    act_mode: str | None = "even", swiglu_limit: float | None = None, gate_mode: str = SEPARATED,
                    hidden_pad: int = 0, intermediate_pad: int = 0) -> torch.Tensor:
    """MXFP4 W4A4 routed experts (aiter `QuantType.per_1x32` semantics; unshuffled uint8 layouts):
    activations MXFP4 quantize-dequantized with scale mode `act_mode` before both GEMMs
    (None = W4A16). x `[T, D]` -> `[T, D]` x.dtype."""
    _check_contract(gate_mode, x, w13, w2, hidden_pad, packed=2)
    d = x.shape[-1]
    xp = F.pad(x, (0, hidden_pad)) if hidden_pad else x
    qdq = None if act_mode is None else (lambda a: qdq_mxfp4(a, act_mode))
    out = fused_moe_act_qdq(xp, dequant_mxfp4(w13, w13_scale), dequant_mxfp4(w2, w2_scale), topk_weights, topk_ids,
                            act_qdq=qdq, swiglu_limit=swiglu_limit, intermediate_pad=intermediate_pad)
    return out[:, :d] if hidden_pad else out


def mxfp4_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, act_mode: str | None = "even",
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense MXFP4 W4A4 linear (Quark `QuarkW4A4MXFP4`): x `[..., K]`, w uint8 `[N, K/2]`, w_scale uint8
    `[N, K/32]` -> `[..., N]` (activations MXFP4-qdq'd with `act_mode`; None = W4A16)."""
    lead = x.shape[:-1]
    y = _mxfp4_linear(x.reshape(-1, x.shape[-1]), w, w_scale, act_mode=act_mode, out_dtype=out_dtype)
    return y.reshape(*lead, w.shape[0])
