"""`glm-ray quantize`: quantize -> save -> load -> dequantize round trips, the written formats and configs."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, expand_block_scale
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4, e8m0_to_f32
from glm_ray.model.quantize import add_parser, quantize_checkpoint
from glm_ray.quant.config import parse_quant_config


def _tensors(path) -> dict[str, tuple[str, torch.Tensor]]:
    out = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = (h.get_slice(k).get_dtype(), h.get_tensor(k))
    return out


@pytest.fixture(scope="module")
def src(quant_ckpts):
    return _tensors(quant_ckpts["bf16"])


def _fp8_err_ok(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """e4m3: relative rounding <= 2^-4 for normal values; subnormal step 2^-9 of the block scale."""
    wf = w.float()
    se = expand_block_scale(s, *w.shape)
    err = (dequant_block_fp8(q, s) - wf).abs()
    assert bool((err <= torch.maximum(wf.abs() * 2.0 ** -4, se * 2.0 ** -10) * (1 + 1e-6)).all())


def test_fp8_block_round_trip(quant_ckpts, src):
    out = _tensors(quant_ckpts["fp8"])
    quantized = {k[: -len(".weight_scale_inv")] for k in out if k.endswith(".weight_scale_inv")}
    assert "model.layers.0.self_attn.kv_b_proj" in quantized and "model.layers.2.mlp.experts.7.down_proj" in quantized
    assert "model.layers.4.self_attn.indexer.wk" in quantized and "model.layers.1.mlp.shared_experts.gate_proj" in quantized
    for m in quantized:
        (wdt, q), (sdt, s) = out[m + ".weight"], out[m + ".weight_scale_inv"]
        n, k = q.shape
        assert wdt == "F8_E4M3" and sdt == "F32" and tuple(s.shape) == (-(-n // 128), -(-k // 128)), m
        _fp8_err_ok(src[m + ".weight"][1], q, s)
    kept = [k for k in out if not any(k.startswith(m + ".") for m in quantized)]
    for k in kept:                                               # everything else: bit-identical copies
        assert out[k][0] == src[k][0] and torch.equal(out[k][1], src[k][1]), k
    for k in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.4.eh_proj.weight", "model.layers.3.self_attn.indexer.weights_proj.weight",
              "model.layers.3.self_attn.indexer.k_norm.bias", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.2.input_layernorm.weight", "model.layers.4.enorm.weight"):
        assert k in kept, k
    cfg = json.loads((Path(quant_ckpts["fp8"]) / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "lm_head" in qc["ignored_layers"] and "model.layers.4.eh_proj" in qc["ignored_layers"]
    assert "model.layers.2.mlp.gate" in qc["ignored_layers"]
    idx = json.loads((Path(quant_ckpts["fp8"]) / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(idx) == set(out)
    assert (Path(quant_ckpts["fp8"]) / "tokenizer.json").is_file()


def test_fp8_ue8m0_scales_are_powers_of_two(quant_ckpts, src, tmp_path):
    path = quantize_checkpoint(quant_ckpts["bf16"], tmp_path / "ue8m0", "fp8-block", ue8m0=True)
    out = _tensors(path)
    s = out["model.layers.1.self_attn.q_b_proj.weight_scale_inv"][1]
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    _fp8_err_ok(src["model.layers.1.self_attn.q_b_proj.weight"][1], out["model.layers.1.self_attn.q_b_proj.weight"][1], s)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"


def test_quark_mxfp4_moe_round_trip(quant_ckpts, src):
    out = _tensors(quant_ckpts["mx"])
    hf = json.loads((Path(quant_ckpts["mx"]) / "config.json").read_text())
    L = hf["num_hidden_layers"]
    mods = [f"model.layers.{layer}.mlp.{ex}.{proj}" for layer in range(1, L)     # routed + shared experts
            for ex in [f"experts.{e}" for e in range(hf["n_routed_experts"])] + ["shared_experts"]
            for proj in ("gate_proj", "up_proj", "down_proj")]
    for m in mods:
        (wdt, p), (sdt, s) = out[m + ".weight"], out[m + ".weight_scale"]
        w = src[m + ".weight"][1].float()
        assert wdt == sdt == "U8" and p.shape[-1] * 2 == w.shape[-1] and s.shape[-1] * 32 == w.shape[-1]
        err = (dequant_mxfp4(p, s) - w).abs()
        step = e8m0_to_f32(s).repeat_interleave(32, -1)         # E2M1 grid step <= 2 x 2^e; saturation < 2^e
        assert bool((err <= step).all()), m
        assert (err.norm() / w.norm()).item() < 0.12
    # MTP layer: block FP8 with Quark's scale name
    m = f"model.layers.{L}.mlp.experts.0.gate_proj"
    assert out[m + ".weight"][0] == "F8_E4M3" and out[m + ".weight_scale"][0] == "F32"
    assert m + ".weight_scale_inv" not in out
    assert out[f"model.layers.{L}.self_attn.q_b_proj.weight"][0] == "F8_E4M3"
    # unquantized elsewhere
    assert out[f"model.layers.{L}.mlp.shared_experts.up_proj.weight"][0] == "F8_E4M3"
    for k in ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.0.mlp.gate_proj.weight", f"model.layers.{L}.eh_proj.weight", "lm_head.weight"):
        assert out[k][0] == src[k][0] == "BF16" and torch.equal(out[k][1], src[k][1]), k


def test_quark_config_is_realistic_and_resolves(quant_ckpts):
    qc = json.loads((Path(quant_ckpts["mx"]) / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quark" and qc["export"]["weight_format"] == "real_quantized"
    w, a = qc["global_quant_config"]["weight"], qc["global_quant_config"]["input_tensors"]
    assert (w["dtype"], w["qscheme"], w["group_size"], w["scale_format"], w["scale_calculation_mode"],
            w["is_dynamic"]) == ("fp4", "per_group", 32, "e8m0", "even", False)
    assert a["is_dynamic"] is True and a["dtype"] == "fp4"
    assert list(qc["layer_quant_config"]) == ["model.layers.4.*"]
    assert any(e.startswith("re:") for e in qc["exclude"]) and "lm_head" in qc["exclude"]
    spec = parse_quant_config(qc)
    mx = spec.scheme_for("model.layers.2.mlp.experts", "moe", num_experts=8)
    assert mx.kind == "mxfp4" and mx.act_scale_calculation_mode == "even"
    mtp = spec.scheme_for("model.layers.4.mlp.experts", "moe", num_experts=8)
    assert mtp.kind == "fp8_block" and mtp.checkpoint_scale_name == "weight_scale"
    assert spec.scheme_for("model.layers.4.self_attn.kv_b_proj").kind == "fp8_block"
    assert spec.scheme_for("model.layers.2.mlp.shared_experts.up_proj").kind == "mxfp4"
    for m in ("model.layers.1.self_attn.q_b_proj", "model.layers.4.eh_proj", "model.layers.0.mlp.gate_proj", "lm_head"):
        assert spec.scheme_for(m).kind == "unquantized", m
    assert spec.runtime_tensor_name("model.layers.4.mlp.experts.3.up_proj.weight_scale", num_experts=8) == \
        "model.layers.4.mlp.experts.3.up_proj.weight_scale_inv"
    assert spec.runtime_tensor_name("model.layers.2.mlp.experts.3.up_proj.weight_scale", num_experts=8) == \
        "model.layers.2.mlp.experts.3.up_proj.weight_scale"


def test_cli_parser_and_errors(quant_ckpts, tmp_path):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    add_parser(sub)
    a = parser.parse_args(["quantize", quant_ckpts["bf16"], str(tmp_path / "o"), "--scheme", "fp8-block",
                           "--keep-bf16", "kv_b_proj", "--ue8m0"])
    assert a.func(a) == 0
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["scale_fmt"] == "ue8m0" and "model.layers.1.self_attn.kv_b_proj" in qc["ignored_layers"]
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "o", tmp_path / "o2", "fp8-block")
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_checkpoint(quant_ckpts["bf16"], tmp_path / "o3", "int4")
    with pytest.raises(SystemExit):
        parser.parse_args(["quantize", "a", "b", "--scheme", "nvfp4"])


def test_make_tiny_quantized(tmp_path):
    from glm_ray.model.quantize import make_tiny_quantized
    out = make_tiny_quantized(tmp_path / "tiny-fp8", "fp8")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-fp8"]          # scratch bf16 copy removed
    with pytest.raises(ValueError, match="--quant"):
        make_tiny_quantized(tmp_path / "x", "int4")
