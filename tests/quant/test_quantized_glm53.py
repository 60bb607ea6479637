"""GLM-5.3-Flash (glm5_next) with the MI355X port's Quark recipe: MXFP4 (1x32) routed + shared
experts, everything else bf16 — the KDA projections, MLA, indexer, dense MLPs — written by
`glm-ray quantize --scheme quark-mxfp4-moe` from a `make-tiny --config glm53-flash-tiny-text.json`
checkpoint (nested glm5_next config, `model.language_model.*` names).

Exactness as for GLM-5 (tests/quant/test_quantized_model.py): the quantized checkpoint run with a
weight-only torch backend equals the unquantized engine on a checkpoint holding exactly the
dequantized weights (<= 1e-4): scale mapping, gate/up halves and the exclude list under the
language_model prefix are right. Plus: the methods chosen per layer.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from glm_ray import LLM
from tests.quant.conftest import dequantize_checkpoint
from tests.quant.helpers import prompt_logprobs


@pytest.fixture(scope="module")
def flash_quark(tmp_path_factory) -> Path:
    from glm_ray.model.quantize import quantize_checkpoint
    from glm_ray.model.tiny import bundled_config, write_tiny
    root = tmp_path_factory.mktemp("glm53q")
    cfg = bundled_config("glm53-flash-tiny-text.json")
    cfg.update(index_topk=8, index_n_heads=16)
    base = write_tiny(root / "bf16", cfg)
    return quantize_checkpoint(base, root / "mx", "quark-mxfp4-moe")


def test_config_and_methods_per_layer(flash_quark):
    from glm_ray.quant.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
    from glm_ray.quant.unquantized import UnquantizedLinearMethod
    qc = json.loads((flash_quark / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quark" and "text_config" in json.loads((flash_quark / "config.json").read_text())
    llm = LLM(str(flash_quark), dtype="float32", kv_cache_memory_bytes=16 << 20)
    layers = llm.engine.executor.worker.model.model.language_model.layers
    kda, mla = layers[0].self_attn, layers[3].self_attn                 # layer 3: first MLA layer (and MoE)
    assert isinstance(layers[3].mlp.experts.quant_method, Mxfp4MoEMethod)
    assert isinstance(layers[3].mlp.shared_experts.gate_up_proj.quant_method, Mxfp4LinearMethod)
    assert isinstance(layers[0].mlp.gate_up_proj.quant_method, UnquantizedLinearMethod)       # dense MLP
    for lin in (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_b_proj, kda.b_proj, kda.g_b_proj, kda.o_proj,
                mla.q_b_proj, mla.kv_b_proj, mla.o_proj, mla.indexer.wk):
        assert isinstance(lin.quant_method, UnquantizedLinearMethod), lin.prefix


def test_quantized_engine_equals_dequantized_checkpoint(flash_quark, weight_only_backend, tmp_path):
    ref = prompt_logprobs(dequantize_checkpoint(flash_quark, tmp_path / "deq"))
    got = prompt_logprobs(flash_quark, kernel_backend=weight_only_backend)
    d = np.abs(got - ref).max()
    print(f"glm53 mx: weight-only engine vs dequantized checkpoint max |dlogprob| {d:.2e}")
    assert np.isfinite(got).all() and d <= 1e-4
