"""Quantization: per-layer strategy objects (see base.py) and the config that picks them."""
from glm_ray.quant.base import LinearMethod, MoEMethod, QuantConfig
from glm_ray.quant.config import NoQuantSpec, parse_quant_config
from glm_ray.quant.dispatch import SpecQuantConfig
from glm_ray.quant.unquantized import Unquantized, UnquantizedLinearMethod, UnquantizedMoEMethod


def get_quant_config(model_config) -> QuantConfig:
    """The one place a checkpoint's `quantization_config` becomes a QuantConfig.

    No config -> `Unquantized`; `quant_method` "fp8" (block FP8) / "quark" (MXFP4 MoE + per-layer block
    FP8) -> `SpecQuantConfig`, which picks one method per layer (quant/dispatch.py). Anything else is a
    `QuantConfigError` here; a well-formed but unsupported per-layer scheme fails while the model is
    built, naming the layer (`UnsupportedQuantSchemeError`)."""
    qc = model_config.quantization_config
    if not qc:
        return Unquantized()
    spec = parse_quant_config(qc)
    if isinstance(spec, NoQuantSpec):
        return Unquantized()
    return SpecQuantConfig(spec)


__all__ = ["LinearMethod", "MoEMethod", "QuantConfig", "Unquantized", "UnquantizedLinearMethod",
           "UnquantizedMoEMethod", "get_quant_config"]
