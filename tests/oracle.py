"""The independent oracle: transformers' own GlmMoeDsaForCausalLM on the same checkpoint, in fp32.

One deliberate alignment: transformers builds q_a_layernorm / kv_a_layernorm with eps=1e-6 (its
class default) while sglang, vLLM and glm-ray use config.rms_norm_eps (1e-5); we set the oracle's
eps to the config value so the comparison tests the math, not that known discrepancy
(transformers' modeling_glm_moe_dsa.py vs the checkpoint config).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def load_oracle(path: str):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for m in model.modules():
        if m.__class__.__name__.endswith("RMSNorm"):
            m.variance_epsilon = cfg.rms_norm_eps
    return model


@torch.no_grad()
def oracle_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of the next-token logits at every position (full causal forward)."""
    model = load_oracle(path)
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)
