"""quantization_config parsing and the per-layer scheme decision (quant_contracts.md §2.1, §3.6; PR A)."""
import copy
import dataclasses

import pytest
import torch

from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, quant_weight_block
from glm_ray.quant.config import (
    UNQUANTIZED,
    Fp8BlockSpec,
    NoQuantSpec,
    QuantConfigError,
    QuantScheme,
    QuarkSpec,
    UnsupportedQuantSchemeError,
    concat_block_fp8_shards,
    parse_quant_config,
)

# ---------------------------------------------------------------- fp8 (zai-org/GLM-5.3-Flash style)
FP8_QC = {
    "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
    "ignored_layers": ["lm_head", "mlp.gate", "model.language_model.layers.45.eh_proj",
                       "re:.*indexer\\.weights_proj$"],
    "modules_to_not_convert": ["model.layers.1.self_attn.kv_b_proj"],
}

FP8_BLOCK = QuantScheme(kind="fp8_block", block=(128, 128), ue8m0=False, act="fp8_1x128", act_group_size=128,
                        checkpoint_scale_name="weight_scale_inv", runtime_scale_name="weight_scale_inv")


def test_fp8_config_schemes():
    spec = parse_quant_config({"model_type": "glm5_next_text", "quantization_config": FP8_QC})
    assert isinstance(spec, Fp8BlockSpec) and spec.weight_block_size == (128, 128)
    assert spec.scheme_for("model.layers.0.self_attn.q_b_proj") == FP8_BLOCK
    assert spec.scheme_for("model.language_model.layers.3.mlp.experts", "moe") == FP8_BLOCK
    assert spec.scheme_for("model.layers.3.mlp.shared_experts.gate_proj") == FP8_BLOCK
    assert spec.scheme_for("model.layers.3.mlp.gate_proj") == FP8_BLOCK              # "mlp.gate" is not a prefix of it
    for ign in ("lm_head", "model.layers.3.mlp.gate", "model.layers.45.eh_proj",       # name variants
                "model.language_model.layers.45.eh_proj", "model.layers.7.self_attn.indexer.weights_proj",
                "model.layers.1.self_attn.kv_b_proj"):
        s = spec.scheme_for(ign)
        assert s == UNQUANTIZED and not s.is_quantized and s.source == "fp8.ignored_layers", ign
    assert spec.scheme_for("model.layers.7.self_attn.indexer.wq_b") == FP8_BLOCK


def test_fp8_config_ue8m0_and_frozen():
    spec = parse_quant_config({**FP8_QC, "scale_fmt": "ue8m0"})
    s = spec.scheme_for("model.layers.0.self_attn.o_proj")
    assert s.kind == "fp8_block" and s.ue8m0 and s.act_ue8m0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.weight_block_size = (64, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kind = "mxfp4"
    hash(spec), hash(s)


def test_fp8_unsupported_schemes_name_the_layer():
    static = parse_quant_config({**FP8_QC, "activation_scheme": "static"})
    with pytest.raises(UnsupportedQuantSchemeError, match=r"model\.layers\.2\.self_attn\.q_a_proj.*activation_scheme"):
        static.scheme_for("model.layers.2.self_attn.q_a_proj")
    assert static.scheme_for("lm_head") == UNQUANTIZED                                   # ignored layers still fine
    per_tensor = parse_quant_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(UnsupportedQuantSchemeError, match=r"'model\.layers\.4\.mlp\.experts'.*per-tensor"):
        per_tensor.scheme_for("model.layers.4.mlp.experts", "moe")


def test_fp8_fused_shards_and_experts():
    spec = parse_quant_config(FP8_QC)
    fused = spec.scheme_for("model.layers.0.self_attn.fused_qkv_a_proj",
                            shard_prefixes=["model.layers.0.self_attn.q_a_proj",
                                            "model.layers.0.self_attn.kv_a_proj_with_mqa"])
    assert fused == FP8_BLOCK
    mixed = parse_quant_config({**FP8_QC, "ignored_layers": ["model.layers.0.self_attn.q_a_proj"]})
    with pytest.raises(UnsupportedQuantSchemeError, match="fused_qkv_a_proj"):
        mixed.scheme_for("model.layers.0.self_attn.fused_qkv_a_proj",
                         shard_prefixes=["model.layers.0.self_attn.q_a_proj",
                                         "model.layers.0.self_attn.kv_a_proj_with_mqa"])
    all_exp = parse_quant_config({**FP8_QC, "ignored_layers": ["model.layers.5.mlp.experts"]})
    assert all_exp.scheme_for("model.layers.5.mlp.experts", "moe") == UNQUANTIZED
    one_exp = parse_quant_config({**FP8_QC, "ignored_layers": ["model.layers.5.mlp.experts.3"]})
    with pytest.raises(UnsupportedQuantSchemeError, match="partially ignored"):
        one_exp.scheme_for("model.layers.5.mlp.experts", "moe", num_experts=8)
    with pytest.raises(UnsupportedQuantSchemeError, match="partially ignored"):
        one_exp.scheme_for("model.layers.5.mlp.experts", "moe")            # index 3 found in the config


def test_parse_entry_points():
    assert isinstance(parse_quant_config(None), NoQuantSpec)
    assert isinstance(parse_quant_config({"model_type": "glm_moe_dsa", "hidden_size": 64}), NoQuantSpec)
    assert parse_quant_config(None).scheme_for("x.y").kind == "unquantized"

    class Cfg:
        quantization_config = FP8_QC
    assert isinstance(parse_quant_config(Cfg()), Fp8BlockSpec)
    with pytest.raises(QuantConfigError, match="awq"):
        parse_quant_config({"quant_method": "awq"})
    with pytest.raises(QuantConfigError):
        parse_quant_config({"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError):
        parse_quant_config(FP8_QC).scheme_for("model.layers.0.self_attn.o_proj", "attention")


# ---------------------------------------------------------------- Quark (amd/GLM-5.3-Flash-Quark-MXFP4 style)
MXFP4_W = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "is_dynamic": False,
           "scale_format": "e8m0", "scale_type": "float", "scale_calculation_mode": "even",
           "round_method": "half_even", "observer_cls": "PerBlockMXObserver", "symmetric": None,
           "block_size": None, "mx_element_dtype": None, "is_scale_quant": False}
MXFP4_A = {**MXFP4_W, "is_dynamic": True}
FP8_W = {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": [128, 128], "is_dynamic": False,
         "observer_cls": "PerBlock2DMinMaxObserver", "scale_type": "float32", "ch_axis": None,
         "group_size": None, "symmetric": True, "round_method": "half_even", "scale_format": None}
FP8_A = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 128, "is_dynamic": True, "ch_axis": -1,
         "observer_cls": "PerGroupMinMaxObserver", "scale_type": "float32", "symmetric": True}
MXFP4_LAYER = {"weight": MXFP4_W, "input_tensors": MXFP4_A, "output_tensors": None, "bias": None,
               "target_device": None}
FP8_LAYER = {"weight": FP8_W, "input_tensors": FP8_A, "output_tensors": None, "bias": None, "target_device": None}

QUARK_QC = {
    "quant_method": "quark",
    "global_quant_config": MXFP4_LAYER,
    "layer_type_quant_config": {},
    "layer_quant_config": {"model.language_model.layers.45.*": FP8_LAYER},
    "kv_cache_quant_config": {},
    "exclude": [
        "lm_head",
        "model.language_model.layers.45.eh_proj",
        "re:model\\.language_model\\.layers\\.[0-2]\\.mlp\\..*",                              # dense MLPs
        "re:model\\.language_model\\.layers\\.([0-9]|[1-3][0-9]|4[0-4])\\.self_attn\\..*",  # attention 0-44
        "re:.*\\.mlp\\.gate$",                                                              # routers
        "re:model\\.visual\\..*",
    ],
    "algo_config": None, "softmax_quant_spec": None, "quant_mode": "eager_mode", "version": "0.11",
    "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
               "weight_format": "real_quantized", "weight_merge_groups": None},
}


def test_quark_glm53_flash_mxfp4_layout():
    spec = parse_quant_config({"model_type": "glm5_next", "quantization_config": QUARK_QC})
    assert isinstance(spec, QuarkSpec)
    for n in (3, 20, 44):
        s = spec.scheme_for(f"model.layers.{n}.mlp.experts", "moe", num_experts=288)
        assert (s.kind, s.block, s.act, s.act_group_size) == ("mxfp4", (1, 32), "mxfp4_1x32", 32)
        assert (s.scale_calculation_mode, s.act_scale_calculation_mode, s.round_method) == ("even", "even", "half_even")
        assert s.checkpoint_scale_name == s.runtime_scale_name == "weight_scale"
        assert s.source == "quark.global_quant_config"
        assert spec.scheme_for(f"model.language_model.layers.{n}.mlp.shared_experts.down_proj").kind == "mxfp4"
        assert spec.scheme_for(f"model.layers.{n}.self_attn.q_b_proj") == UNQUANTIZED
        assert spec.scheme_for(f"model.layers.{n}.mlp.gate") == UNQUANTIZED
    mtp = spec.scheme_for("model.layers.45.mlp.experts", "moe", num_experts=288)
    assert (mtp.kind, mtp.block, mtp.act, mtp.act_group_size, mtp.ue8m0) == ("fp8_block", (128, 128), "fp8_1x128", 128, False)
    assert (mtp.checkpoint_scale_name, mtp.runtime_scale_name) == ("weight_scale", "weight_scale_inv")
    assert "layers.45.*" in mtp.source
    assert spec.scheme_for("model.layers.45.self_attn.q_b_proj").kind == "fp8_block"
    assert spec.scheme_for("model.layers.45.mlp.shared_experts.gate_proj").kind == "fp8_block"
    assert spec.scheme_for("model.layers.45.eh_proj") == UNQUANTIZED                      # exclude beats pattern
    assert spec.scheme_for("model.layers.45.mlp.gate") == UNQUANTIZED
    assert spec.scheme_for("model.layers.0.self_attn.q_b_proj") == UNQUANTIZED
    assert spec.scheme_for("model.layers.1.mlp.gate_proj") == UNQUANTIZED
    assert spec.scheme_for("lm_head").source == "quark.exclude"


def test_quark_runtime_tensor_names():
    spec = parse_quant_config(QUARK_QC)
    f = spec.runtime_tensor_name
    assert f("model.language_model.layers.45.mlp.experts.17.gate_proj.weight_scale") == \
        "model.language_model.layers.45.mlp.experts.17.gate_proj.weight_scale_inv"
    assert f("model.layers.45.mlp.shared_experts.down_proj.weight_scale") == \
        "model.layers.45.mlp.shared_experts.down_proj.weight_scale_inv"
    assert f("model.layers.45.self_attn.q_b_proj.weight_scale") == "model.layers.45.self_attn.q_b_proj.weight_scale_inv"
    for keep in ("model.layers.45.self_attn.q_b_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight_scale",
                 "model.layers.45.mlp.experts.1.down_proj.weight_scale_inv", "model.layers.45.eh_proj.weight"):
        assert f(keep) == keep
    # fp8 checkpoints already use the runtime name
    assert parse_quant_config(FP8_QC).runtime_tensor_name("model.layers.0.self_attn.o_proj.weight_scale_inv") == \
        "model.layers.0.self_attn.o_proj.weight_scale_inv"


def test_fused_q_a_kv_a_scales():
    # q_a first along N; q_a's N must be a multiple of 128, kv_a (576 in GLM-5) may be ragged
    torch.manual_seed(0)
    wa, wb = torch.randn(256, 256), torch.randn(72, 256)
    (qa, sa), (qb, sb) = quant_weight_block(wa), quant_weight_block(wb)
    w, s = concat_block_fp8_shards([qa, qb], [sa, sb])
    assert w.shape == (328, 256) and s.shape == (3, 2)
    assert torch.equal(s[:2], sa) and torch.equal(s[2:], sb)
    torch.testing.assert_close(dequant_block_fp8(w, s), torch.cat([dequant_block_fp8(qa, sa), dequant_block_fp8(qb, sb)]))
    with pytest.raises(ValueError, match="multiple of 128"):
        concat_block_fp8_shards([qb, qa], [sb, sa])
    with pytest.raises(ValueError):
        concat_block_fp8_shards([qa, qb], [sa, sa])
    spec = parse_quant_config(QUARK_QC)
    shards = ["model.layers.45.self_attn.q_a_proj", "model.layers.45.self_attn.kv_a_proj_with_mqa"]
    assert spec.scheme_for("model.layers.45.self_attn.fused_qkv_a_proj", shard_prefixes=shards).kind == "fp8_block"
    qc = copy.deepcopy(QUARK_QC)
    qc["exclude"].append("model.language_model.layers.45.self_attn.kv_a_proj_with_mqa")
    with pytest.raises(UnsupportedQuantSchemeError, match="fused_qkv_a_proj.*different schemes"):
        parse_quant_config(qc).scheme_for("model.layers.45.self_attn.fused_qkv_a_proj", shard_prefixes=shards)


def _per_expert_qc(n_experts, layer_cfg=FP8_LAYER, odd=None):
    qc = copy.deepcopy(QUARK_QC)
    qc["layer_quant_config"] = {}
    for e in range(n_experts):
        for p in ("gate_proj", "up_proj", "down_proj"):
            cfg = MXFP4_LAYER if (odd is not None and (e, p) == odd) else layer_cfg
            qc["layer_quant_config"][f"model.language_model.layers.45.mlp.experts.{e}.{p}"] = cfg
    return qc


def test_quark_per_expert_entries():
    spec = parse_quant_config(_per_expert_qc(4))
    assert spec.scheme_for("model.layers.45.mlp.experts", "moe", num_experts=4).kind == "fp8_block"
    assert spec.scheme_for("model.layers.45.mlp.experts", "moe").kind == "fp8_block"      # indices from the config
    with pytest.raises(UnsupportedQuantSchemeError, match=r"layers\.45\.mlp\.experts.*differs between experts"):
        spec.scheme_for("model.layers.45.mlp.experts", "moe", num_experts=5)               # expert 4 not covered
    mixed = parse_quant_config(_per_expert_qc(4, odd=(2, "down_proj")))
    with pytest.raises(UnsupportedQuantSchemeError, match="differs between experts"):
        mixed.scheme_for("model.layers.45.mlp.experts", "moe", num_experts=4)
    assert spec.scheme_for("model.layers.3.mlp.experts", "moe", num_experts=4).kind == "mxfp4"


def test_quark_exclude_experts():
    qc = copy.deepcopy(QUARK_QC)
    qc["exclude"] += [f"model.language_model.layers.44.mlp.experts.{e}.{p}"
                      for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    qc["exclude"].append("re:model\\.language_model\\.layers\\.43\\.mlp\\.experts")
    spec = parse_quant_config(qc)
    assert spec.scheme_for("model.layers.44.mlp.experts", "moe", num_experts=4) == UNQUANTIZED
    assert spec.scheme_for("model.layers.44.mlp.experts", "moe") == UNQUANTIZED
    assert spec.scheme_for("model.layers.43.mlp.experts", "moe", num_experts=288) == UNQUANTIZED
    with pytest.raises(UnsupportedQuantSchemeError, match="partially excluded"):
        spec.scheme_for("model.layers.44.mlp.experts", "moe", num_experts=8)


def test_quark_layer_type_config_and_old_mx_dtype():
    qc = copy.deepcopy(QUARK_QC)
    qc["layer_type_quant_config"] = {"Linear": FP8_LAYER}
    spec = parse_quant_config(qc)
    assert spec.scheme_for("model.layers.10.mlp.experts", "moe").kind == "fp8_block"
    assert spec.scheme_for("model.layers.10.mlp.experts", "moe").source == "quark.layer_type_quant_config['Linear']"
    old = copy.deepcopy(QUARK_QC)
    for t in ("weight", "input_tensors"):
        old["global_quant_config"][t].update(dtype="mx", mx_element_dtype="fp4", scale_format=None)
    assert parse_quant_config(old).scheme_for("model.layers.3.mlp.experts", "moe").kind == "mxfp4"
    none_global = {**QUARK_QC, "global_quant_config": None}
    assert parse_quant_config(none_global).scheme_for("model.layers.3.mlp.experts", "moe") == UNQUANTIZED


@pytest.mark.parametrize("mutate,reason", [
    (lambda c: c["global_quant_config"].update(input_tensors=None), "W4A16"),
    (lambda c: c["global_quant_config"]["weight"].update(dtype="int8", qscheme="per_channel"), "int8"),
    (lambda c: c["global_quant_config"]["weight"].update(group_size=16), "g32"),
    (lambda c: c["global_quant_config"]["input_tensors"].update(scale_calculation_mode="stochastic"), "stochastic"),
    (lambda c: c["global_quant_config"].update(output_tensors=FP8_A), "output"),
    (lambda c: c["global_quant_config"].update(input_tensors={**FP8_A, "is_dynamic": False}), "MXFP4"),
])
def test_quark_unsupported_scheme_error(mutate, reason):
    qc = copy.deepcopy(QUARK_QC)
    mutate(qc)
    spec = parse_quant_config(qc)
    with pytest.raises(UnsupportedQuantSchemeError) as ei:
        spec.scheme_for("model.layers.7.mlp.experts", "moe", num_experts=288)
    msg = str(ei.value)
    assert "'model.layers.7.mlp.experts'" in msg and "unsupported quantization scheme quark(" in msg
    assert reason in msg
    assert ei.value.prefix == "model.layers.7.mlp.experts"
    assert spec.scheme_for("lm_head") == UNQUANTIZED


def test_quark_unsupported_fp8_variants():
    qc = copy.deepcopy(QUARK_QC)
    qc["layer_quant_config"]["model.language_model.layers.45.*"]["input_tensors"] = None
    with pytest.raises(UnsupportedQuantSchemeError, match=r"layers\.45\.self_attn\.o_proj.*fp8_e4m3/per_block/b128x128"):
        parse_quant_config(qc).scheme_for("model.layers.45.self_attn.o_proj")
    qc2 = copy.deepcopy(QUARK_QC)
    qc2["layer_quant_config"]["model.language_model.layers.45.*"]["weight"]["scale_type"] = "float8_e8m0fnu"
    assert parse_quant_config(qc2).scheme_for("model.layers.45.self_attn.o_proj").ue8m0
