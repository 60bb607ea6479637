"""Quantized tiny GLM-5 end to end through `glm_ray.LLM` (CPU, fp32 compute).

Prompts: 3 random prompts of 5/30/57 tokens = 89 scored positions. Two kinds of checks:

* Exactness (<= 1e-4, the tolerance of tests/model/test_parity.py): the quantized checkpoint run with a
  weight-only torch backend (no activation quantization) equals the unquantized engine on a checkpoint
  holding exactly the dequantized weights (observed 0). This catches loading bugs (scale mapping,
  gate/up halves, per-half scales, nibble order); the bf16 comparison below cannot, because a random
  tiny model is chaotic: MoE routing (top-2 of 8, one group of 4) flips under any perturbation, so e.g.
  swapped gate/up halves of the routed experts move logprobs only ~1.2x as much as FP8 noise does.
* Against the bf16 model (loose), on `dense_ckpts` (index_topk 64 > prompt lengths, so DSA top-k flips
  do not add to the chaos). Yardstick: an unrelated model of the same shape (another seed), mean
  |dlogprob| 4.6 / max 12.7 nats vs the bf16 model. Calibration on the same model: FP8 weight rounding
  alone (rms relative error 2.6%) gives mean 1.18; i.i.d. Gaussian noise of 2.6% on the same weights
  gives 0.96 — i.e. this model amplifies any few-% weight noise to ~1 nat. Observed for the full engine:
  FP8 W8A8 mean 1.23 / max 6.8 (ratio 0.27 to the unrelated model); MXFP4 W4A4 (routed + shared
  experts, rms weight error 8.7%) mean 1.51 / max 5.5 (ratio 0.33).
  Bound: mean <= 0.5 x the unrelated model's mean (1.5-1.9x margin) and max <= 10 nats.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from glm_ray import LLM
from glm_ray.quant.config import QuantConfigError, UnsupportedQuantSchemeError
from glm_ray.weights import WeightError
from tests.quant.conftest import dequantize_checkpoint
from tests.quant.helpers import prompt_logprobs as _prompt_logprobs

MEAN_RATIO, MAX_NATS = 0.5, 10.0


@pytest.mark.parametrize("kind", ["fp8", "mx"])
def test_quantized_logprobs_within_bound_of_bf16(dense_ckpts, dense_reference, kind):
    base, unrelated = dense_reference
    lp = _prompt_logprobs(dense_ckpts[kind])
    d = np.abs(lp - base)
    print(f"{kind}: |dlogprob| mean {d.mean():.3f} max {d.max():.3f} over {d.size} positions; "
          f"unrelated model mean {unrelated:.3f} (ratio {d.mean() / unrelated:.2f})")
    assert np.isfinite(lp).all()
    assert d.mean() <= MEAN_RATIO * unrelated and d.max() <= MAX_NATS, (d.mean(), d.max(), unrelated)


@pytest.mark.parametrize("kind", ["fp8", "mx"])
def test_quantized_engine_equals_dequantized_checkpoint(quant_ckpts, weight_only_backend, tmp_path, kind):
    deq = dequantize_checkpoint(Path(quant_ckpts[kind]), tmp_path / "deq")
    ref = _prompt_logprobs(deq)
    got = _prompt_logprobs(quant_ckpts[kind], kernel_backend=weight_only_backend)
    d = np.abs(got - ref).max()
    print(f"{kind}: weight-only engine vs dequantized checkpoint max |dlogprob| {d:.2e}")
    assert d <= 1e-4


def test_methods_chosen_per_layer(quant_ckpts):
    from glm_ray.quant.fp8 import Fp8BlockLinearMethod, Fp8BlockMoEMethod
    from glm_ray.quant.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
    from glm_ray.quant.unquantized import UnquantizedLinearMethod
    llm = LLM(quant_ckpts["mx"], dtype="float32", kv_cache_memory_bytes=16 << 20)
    model = llm.engine.executor.worker.model                  # LocalExecutor (TP=1)
    layers = model.model.layers
    assert isinstance(layers[1].mlp.experts.quant_method, Mxfp4MoEMethod)
    assert isinstance(layers[1].mlp.shared_experts.gate_up_proj.quant_method, Mxfp4LinearMethod)
    assert isinstance(layers[0].mlp.gate_up_proj.quant_method, UnquantizedLinearMethod)
    assert isinstance(layers[1].self_attn.q_b_proj.quant_method, UnquantizedLinearMethod)
    mtp = layers[4]                                      # MTP layer: Quark block FP8 (weight_scale on disk)
    assert isinstance(mtp.mlp.experts.quant_method, Fp8BlockMoEMethod)
    assert isinstance(mtp.self_attn.q_b_proj.quant_method, Fp8BlockLinearMethod)
    assert isinstance(mtp.eh_proj.quant_method, UnquantizedLinearMethod)


def _copy_with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_scheme_checkpoint_fails_at_load_with_clear_error(quant_ckpts, tmp_path):
    def int4(qc):
        qc["global_quant_config"]["weight"].update(dtype="int4", qscheme="per_group", group_size=128)
    bad = _copy_with_config(quant_ckpts["mx"], tmp_path / "int4", int4)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"layer 'model\.layers\.1\.mlp\.experts'.*int4"):
        LLM(str(bad), dtype="float32", kv_cache_memory_bytes=16 << 20)

    def per_tensor(qc):
        qc.pop("weight_block_size")
    bad = _copy_with_config(quant_ckpts["fp8"], tmp_path / "pt", per_tensor)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"layer 'model\.layers\.0\..*per-tensor"):
        LLM(str(bad), dtype="float32", kv_cache_memory_bytes=16 << 20)

    def awq(qc):
        qc["quant_method"] = "awq"
    bad = _copy_with_config(quant_ckpts["fp8"], tmp_path / "awq", awq)
    with pytest.raises(QuantConfigError, match="unsupported quant_method 'awq'"):
        LLM(str(bad), dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_release_dependent_kv_b_proj(quant_ckpts, tmp_path):
    """Some GLM releases ship kv_b_proj in bf16: the config's ignored list decides, and a disagreement
    between config and tensors is a load error that says which list to fix."""
    from glm_ray.model.quantize import quantize_checkpoint
    path = quantize_checkpoint(quant_ckpts["bf16"], tmp_path / "kvb", "fp8-block", keep_bf16=["kv_b_proj"])
    ign = json.loads((path / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert "model.layers.0.self_attn.kv_b_proj" in ign and "model.layers.4.self_attn.kv_b_proj" in ign
    lp = _prompt_logprobs(path)
    assert np.isfinite(lp).all()

    def forget(qc):
        qc["ignored_layers"] = [n for n in qc["ignored_layers"] if not n.endswith("kv_b_proj")]
    bad = _copy_with_config(path, tmp_path / "kvb_bad", forget)
    with pytest.raises(WeightError, match=r"kv_b_proj.*BF16.*ignored_layers"):
        LLM(str(bad), dtype="float32", kv_cache_memory_bytes=16 << 20)


@pytest.mark.parametrize("kind", ["fp8", "mx"])
def test_dummy_weights_for_quantized_configs(quant_ckpts, kind):
    lp = _prompt_logprobs(quant_ckpts[kind], load_format="dummy")
    assert np.isfinite(lp).all()
