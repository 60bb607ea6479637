"""Quantization: per-layer strategy objects (see base.py) and the config that picks them."""
from glm_ray.quant.base import LinearMethod, MoEMethod, QuantConfig
from glm_ray.quant.unquantized import Unquantized, UnquantizedLinearMethod, UnquantizedMoEMethod


def get_quant_config(model_config) -> QuantConfig:
    """The one place a checkpoint's `quantization_config` becomes a QuantConfig."""
    qc = model_config.quantization_config
    if not qc:
        return Unquantized()
    method = qc.get("quant_method")
    raise ValueError(f"quantization method {method!r} is not supported yet by this build "
                     "(block FP8 and Quark MXFP4 arrive with the quantization issue)")


__all__ = ["LinearMethod", "MoEMethod", "QuantConfig", "Unquantized", "UnquantizedLinearMethod",
           "UnquantizedMoEMethod", "get_quant_config"]
