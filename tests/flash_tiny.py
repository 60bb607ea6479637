"""A tiny GLM-5.3-Flash (glm5_next) checkpoint written by transformers itself: `save_pretrained` of a
randomly initialised `Glm5NextForConditionalGeneration` (text config from
glm_ray/configs/glm53-flash-tiny-text.json, a one-block vision tower glm-ray does not load).

That is the on-disk format of a real checkpoint (`model.language_model.*`, separate q/k/v conv1d,
per-expert MoE tensors, flat `hc_*` tensors) produced by code we did not write. The parameters
transformers initialises to constants (mHC base/scale, k-pool ape/gate, A_log, norms) are randomised
first so that every path carries signal; index_topk 8 with k-pools of 4 keeps every prompt beyond 8
tokens sparse.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import torch

CONFIG = Path(__file__).parents[1] / "glm_ray" / "configs" / "glm53-flash-tiny-text.json"


def available() -> bool:
    """transformers has glm5_next. In CI it must have it: the GLM-5.3-Flash oracle tests fail there
    instead of skipping (a CI that silently skips them proves nothing)."""
    try:
        import transformers.models.glm5_next  # noqa: F401
        return True
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        return False


def import_oracle(module: str):
    """`pytest.importorskip` outside CI; a hard import (an ImportError fails the test module) in CI."""
    import pytest
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def write_flash_tiny(path: str | Path, seed: int = 0) -> str:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    text = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k not in ("architectures", "model_type")}
    # NOTE: 16 indexer heads, not 4: with 4, ReLU makes many pool scores exactly 0 and top-k ties are
    # broken differently by each implementation (the same reason as tests/conftest.py oracle_dir)
    text.update(index_topk=8, index_n_heads=16, eos_token_id=1, dtype="float32")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("attn_hc.base", "ffn_hc.base", "index_kpool_compress_ape", "e_score_correction_bias")):
                p.copy_(0.5 * r)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale")):
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(0.2 * r)
            elif name.endswith("A_log"):
                p.copy_(0.5 * r)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * r)
        model.lm_head.weight.mul_(4.0)   # sharper next-token distributions: greedy parity not decided by 1e-6 gaps
    model.save_pretrained(path)
    return str(path)


def load_flash_oracle(path: str):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    return Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def flash_oracle_logprobs(oracle, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of the next-token logits at every position (full causal forward)."""
    return torch.log_softmax(oracle(input_ids=torch.tensor([ids])).logits[0].float(), -1)
