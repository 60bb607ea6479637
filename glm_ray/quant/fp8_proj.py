"""Opt-in, prefill-only FP8 GEMM for the MLA `q_b_proj` / `o_proj` (origin PR B).

Those projections stay bf16 in GLM-5.2 checkpoints; at prefill (many tokens) they are dense-GEMM
bound, so a block-FP8 GEMM is faster, while at decode (few tokens) untuned small-M FP8 GEMMs lose to
bf16. So, when the flag is on, the layer keeps its bf16 `weight` (decode uses it, bit for bit) and
gains a private FP8 e4m3 copy with 128x128 UE8M0 (power-of-two) scales, laid out by the backend's
`block_fp8_linear_prepare` (aiter preshuffle on gfx950). `apply` picks by the number of tokens in
the forward batch: M > `min_tokens` (512) -> FP8, else bf16.

Gate: only unquantized q_b_proj / o_proj, and only where the backend has a fast block-FP8 dense GEMM
(aiter on gfx950, cuda on sm90+); elsewhere the flag is a no-op, logged once.
"""
from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F

from glm_ray import kernels
from glm_ray.kernels.torch_ref.fp8 import quant_weight_ue8m0
from glm_ray.quant.base import LinearMethod, QuantConfig
from glm_ray.quant.unquantized import UnquantizedLinearMethod, linear_into

logger = logging.getLogger(__name__)

PROJ_SUFFIXES = (".self_attn.q_b_proj", ".self_attn.o_proj")
_LAYER = re.compile(r"\.layers\.(\d+)\.self_attn\.")
BLOCK = (128, 128)


def fp8_proj_unsupported_reason(ops: kernels.KernelOps | None = None) -> str | None:
    """None when this backend/device runs a block-FP8 dense GEMM faster than bf16, else why not."""
    ops = ops or kernels.ops()
    if ops.name == "aiter":
        arch = torch.cuda.get_device_properties(0).gcnArchName if torch.cuda.is_available() else ""
        return None if "gfx95" in arch else f"aiter on {arch or 'no GPU'} (the FP8 projection GEMM is gfx950-only)"
    if ops.name == "cuda":
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        return None if cap >= (9, 0) else f"CUDA sm{cap[0]}{cap[1]} has no block-FP8 GEMM (needs sm90+)"
    return f"kernel backend {ops.name!r} has no fast FP8 dense GEMM"


class Fp8ProjGemmMethod(LinearMethod):
    """bf16 weights + a private FP8 copy; FP8 GEMM only when the batch has more than `min_tokens` tokens."""

    def __init__(self, base: UnquantizedLinearMethod, min_tokens: int = 512):
        self.base = base
        self.min_tokens = min_tokens

    def create_weights(self, layer, in_features, out_features, params_dtype):
        self.base.create_weights(layer, in_features, out_features, params_dtype)

    def process_weights_after_loading(self, layer) -> None:
        self.base.process_weights_after_loading(layer)
        q, s = quant_weight_ue8m0(layer.weight.data, BLOCK)                 # e4m3 [N, K], fp32 pow2 [N/128, K/128]
        q, s, meta = kernels.ops().block_fp8_linear_prepare(q, s, BLOCK)    # e.g. aiter (16,16) preshuffle
        # NOTE: buffers, not parameters: the checkpoint knows nothing about them.
        layer.register_buffer("_fp8_proj_weight", q, persistent=False)
        layer.register_buffer("_fp8_proj_scale", s, persistent=False)
        layer._fp8_proj_meta = dict(meta)

    def uses_fp8(self, num_tokens: int) -> bool:
        return num_tokens > self.min_tokens

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_fp8(x.shape[0]):                                   # decode / small batches: bf16
            return F.linear(x, layer.weight)
        return kernels.ops().block_fp8_linear(x, layer._fp8_proj_weight, layer._fp8_proj_scale, BLOCK,
                                              out_dtype=x.dtype, act_ue8m0=False, **layer._fp8_proj_meta)

    def apply_into(self, layer, x, out):
        if not self.uses_fp8(x.shape[0]):
            return linear_into(x, layer.weight, out)
        return kernels.ops().block_fp8_linear(x, layer._fp8_proj_weight, layer._fp8_proj_scale, BLOCK,
                                              out_dtype=x.dtype, act_ue8m0=False, out=out, **layer._fp8_proj_meta)


class Fp8ProjOverlay(QuantConfig):
    """Wraps the checkpoint's QuantConfig: q_b_proj / o_proj that it leaves unquantized get the
    FP8-projection method. `force` runs it on any backend (tests of the FP8 path on CPU)."""

    def __init__(self, base: QuantConfig, min_tokens: int = 512, force: bool = False,
                 mla_layers: set[int] | None = None):
        self.base = base
        # hybrid models (GLM-5.3-Flash): only the MLA layers' projections, not a KDA layer's o_proj
        self.mla_layers = mla_layers
        self.name = base.name
        self.min_tokens = min_tokens
        reason = None if force else fp8_proj_unsupported_reason()
        self.active = reason is None
        if reason:
            logger.warning("fp8_proj_gemm requested but not applied: %s (bf16 projections unchanged)", reason)
        else:
            logger.info("fp8_proj_gemm: MLA q_b_proj/o_proj use a block-FP8 GEMM when a batch has > %d tokens",
                        min_tokens)

    def can_fuse(self, prefixes):
        return self.base.can_fuse(prefixes)

    def get_method(self, layer, prefix):
        m = self.base.get_method(layer, prefix)
        if self.active and prefix.endswith(PROJ_SUFFIXES) and type(m) is UnquantizedLinearMethod:
            layer = _LAYER.search(prefix)
            if self.mla_layers is None or (layer is not None and int(layer.group(1)) in self.mla_layers):
                return Fp8ProjGemmMethod(m, self.min_tokens)
        return m
