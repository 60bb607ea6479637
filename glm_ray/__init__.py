"""glm-ray: serve GLM-5-family MoE models on Ray Serve with an own PyTorch engine."""
from glm_ray.engine.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # NOTE: lazy, so `import glm_ray` stays cheap for the CLI and the ingress.
    if name == "LLM":
        from glm_ray.llm import LLM  # noqa: PLC0415 - LLM pulls in ray (the executor); `import glm_ray` stays light
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
