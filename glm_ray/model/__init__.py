"""The model registry: a checkpoint's `architectures[0]` -> the class that runs it."""
from glm_ray.model.glm5_next import Glm5NextForCausalLM
from glm_ray.model.glm_moe_dsa import GlmMoeDsaForCausalLM

MODEL_CLASSES = {"GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM, "Glm4MoeLiteForCausalLM": GlmMoeDsaForCausalLM,
                 "Glm5NextForConditionalGeneration": Glm5NextForCausalLM}

__all__ = ["MODEL_CLASSES", "GlmMoeDsaForCausalLM", "Glm5NextForCausalLM"]
