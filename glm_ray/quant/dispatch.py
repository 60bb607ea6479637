"""`QuantSpec` (parsed quantization_config, quant/config.py) -> one method per layer.

`SpecQuantConfig.get_method(layer, prefix)` is the single per-layer decision:

1. the layer kind (`layer.kind`, layer_contracts.py): routed experts -> "moe" (checkpoint modules `prefix.{e}.{gate,up,down}_proj`), any
   other linear -> "linear"; a fused runtime linear is resolved from the checkpoint modules it holds
   (`gate_up_proj` = `gate_proj` + `up_proj`, which must agree);
2. `spec.scheme_for(prefix, kind)` applies the config's own rules (fp8 `ignored_layers` /
   `modules_to_not_convert`; Quark `exclude` -> `layer_quant_config` -> `layer_type_quant_config` ->
   `global_quant_config`);
3. the scheme kind picks the method; a scheme without a method for this layer kind raises
   `UnsupportedQuantSchemeError` naming the layer and the scheme — at model construction.

Release-dependent FP8-ness (e.g. GLM releases that ship `kv_b_proj` in bf16) follows the config
only: a module is unquantized iff the config says so. If a checkpoint's tensor dtype disagrees
with the config (bf16 tensor where the config implies FP8, or the reverse), loading fails on that
tensor with a message naming the module and the config list to fix — we never guess from the
tensors, because a guess per tensor could silently mix formats inside a fused layer.

Modules the model always keeps unquantized regardless of the config (bf16 in every GLM release):
embeddings, lm_head, the router (`mlp.gate`), norms and `indexer.weights_proj` (their layers do not
ask the config).
"""
from __future__ import annotations

from torch import nn

from glm_ray.layer_contracts import LayerKind, layer_kind
from glm_ray.quant.base import LinearMethod, MoEMethod, QuantConfig
from glm_ray.quant.config import QuantScheme, QuantSpec, UnsupportedQuantSchemeError
from glm_ray.quant.fp8 import Fp8BlockLinearMethod, Fp8BlockMoEMethod
from glm_ray.quant.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
from glm_ray.quant.runtime import describe
from glm_ray.quant.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod

# runtime fused linears -> the checkpoint modules they are built from (suffix replacement), in order
FUSED_LINEARS = {".gate_up_proj": (".gate_proj", ".up_proj"),
                 ".fused_qkv_a_proj": (".q_a_proj", ".kv_a_proj_with_mqa")}


def checkpoint_shards(prefix: str) -> list[str] | None:
    for fused, parts in FUSED_LINEARS.items():
        if prefix.endswith(fused):
            base = prefix[: -len(fused)]
            return [base + p for p in parts]
    return None


def _linear_method(scheme: QuantScheme) -> LinearMethod | None:
    if scheme.kind == "unquantized":
        return UnquantizedLinearMethod()
    if scheme.kind == "fp8_block":
        return Fp8BlockLinearMethod(scheme)
    if scheme.kind == "mxfp4":
        return Mxfp4LinearMethod(scheme)
    return None


def _moe_method(scheme: QuantScheme) -> MoEMethod | None:
    if scheme.kind == "unquantized":
        return UnquantizedMoEMethod()
    if scheme.kind == "fp8_block":
        return Fp8BlockMoEMethod(scheme)
    if scheme.kind == "mxfp4":
        return Mxfp4MoEMethod(scheme)
    return None


class SpecQuantConfig(QuantConfig):
    """A quantized checkpoint's config: per-layer methods from `spec.scheme_for`."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        self.name = spec.method
        self.decisions: dict[str, QuantScheme] = {}          # prefix -> scheme (for logs / tests)

    def scheme_for_layer(self, layer: nn.Module, prefix: str) -> tuple[str, QuantScheme]:
        if layer_kind(layer) == LayerKind.MOE:
            return "moe", self.spec.scheme_for(prefix, "moe", num_experts=layer.num_experts)
        return "linear", self.spec.scheme_for(prefix, "linear", shard_prefixes=checkpoint_shards(prefix))

    def can_fuse(self, prefixes: list[str]) -> bool:
        try:
            self.spec.scheme_for(prefixes[0], "linear", shard_prefixes=prefixes)
        except UnsupportedQuantSchemeError:          # shards that disagree (or a scheme the layers reject)
            return False
        return True

    def get_method(self, layer: nn.Module, prefix: str) -> LinearMethod | MoEMethod:
        kind, scheme = self.scheme_for_layer(layer, prefix)
        method = _moe_method(scheme) if kind == "moe" else _linear_method(scheme)
        if method is None:
            raise UnsupportedQuantSchemeError(prefix, f"{scheme.kind} {describe(scheme)}",
                                              f"no {kind} method implements it (supported: "
                                              f"unquantized, fp8_block, mxfp4)")
        self.decisions[prefix] = scheme
        return method

    def __repr__(self) -> str:
        return f"SpecQuantConfig({self.spec!r})"
