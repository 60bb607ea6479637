"""MLA's q_a_proj + kv_a_proj_with_mqa as one runtime linear (`fused_qkv_a_proj`, layers/mla.py: one GEMM and
one activation quant for the two projections that read the same x, as vLLM / sglang fuse them): built when
the checkpoint quantizes both alike, loaded from the two checkpoint tensors and their block scales (each
shard's rows / 128-row scale blocks after the previous shard's), equal to the two linears it replaces; two
linears when the config treats them differently. Checkpoints: tiny GLM-5 written by glm-ray's writer,
quantized by `glm-ray quantize` (q_lora_rank 64: the shards' scale blocks straddle, two GEMMs inside the
layer; 128: block-aligned, one GEMM)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glm_ray.config import ModelConfig
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear
from glm_ray.model import MODEL_CLASSES
from glm_ray.model.base import _checkpoint_names
from glm_ray.model.loader import load_weights
from glm_ray.model.quantize import quantize_checkpoint
from glm_ray.quant import get_quant_config
from glm_ray.quant.config import parse_quant_config
from glm_ray.quant.dispatch import SpecQuantConfig
from tests.quant.conftest import write_base


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _load(path):
    cfg = ModelConfig.from_pretrained(path, "float32")
    model = MODEL_CLASSES[cfg.architecture](cfg, get_quant_config(cfg), cfg.dtype).eval()
    load_weights(model, path, progress=False)
    return cfg, model


@pytest.fixture(scope="module", params=[64, 128], ids=["rq64-straddling", "rq128-aligned"])
def ckpts(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fused-qkv-a-{request.param}")
    base = write_base(root / "bf16", q_lora_rank=request.param)
    return {"bf16": str(base), "fp8": str(quantize_checkpoint(base, root / "fp8", "fp8-block")), "rq": request.param}


def test_checkpoint_names_of_the_fused_param():
    names = list(_checkpoint_names("model.layers.3.self_attn.fused_qkv_a_proj.weight_scale_inv", None))
    assert names == [("model.layers.3.self_attn.q_a_proj.weight_scale_inv", {"shard_id": 0}),
                     ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv", {"shard_id": 1})]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_loaded_shards_land_in_order_and_the_layer_equals_the_two_linears(ckpts, fmt):
    cfg, model = _load(ckpts[fmt])
    disk = _tensors(ckpts[fmt])
    rq, kv = cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in range(cfg.num_hidden_layers):
        attn = model.model.layers[i].self_attn
        assert attn.fused_qkv_a and not hasattr(attn, "q_a_proj") and not hasattr(attn, "kv_a_proj_with_mqa")
        lin, pre = attn.fused_qkv_a_proj, f"model.layers.{i}.self_attn"
        qa_w, kv_w = disk[f"{pre}.q_a_proj.weight"], disk[f"{pre}.kv_a_proj_with_mqa.weight"]
        assert torch.equal(lin.weight.data[:rq].view(torch.uint8) if fmt == "fp8" else lin.weight.data[:rq],
                           qa_w.view(torch.uint8) if fmt == "fp8" else qa_w.float())
        assert torch.equal(lin.weight.data[rq:].view(torch.uint8) if fmt == "fp8" else lin.weight.data[rq:],
                           kv_w.view(torch.uint8) if fmt == "fp8" else kv_w.float())
        if fmt == "fp8":
            qa_s, kv_s = disk[f"{pre}.q_a_proj.weight_scale_inv"], disk[f"{pre}.kv_a_proj_with_mqa.weight_scale_inv"]
            nq = qa_s.shape[0]                                   # q_a's scale blocks, then kv_a's
            assert torch.equal(lin.weight_scale_inv.data[:nq], qa_s) and torch.equal(lin.weight_scale_inv.data[nq:], kv_s)
            assert (lin.fp8_shards is None) == (rq % 128 == 0)   # aligned: one GEMM over both shards
            want = torch.cat([block_fp8_linear(x, qa_w, qa_s), block_fp8_linear(x, kv_w, kv_s)], -1)
        else:
            want = torch.cat([x @ qa_w.float().T, x @ kv_w.float().T], -1)
        got = lin(x)                                                             # [7, rq + r + dr]
        assert got.shape == (7, rq + kv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_config_that_treats_the_shards_differently_keeps_two_linears(ckpts):
    cfg = ModelConfig.from_pretrained(ckpts["fp8"], "float32")
    qc = dict(cfg.quantization_config)
    qc["ignored_layers"] = list(qc.get("ignored_layers") or []) + ["model.layers.0.self_attn.kv_a_proj_with_mqa"]
    quant = SpecQuantConfig(parse_quant_config(qc))
    assert not quant.can_fuse(["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"])
    model = MODEL_CLASSES[cfg.architecture](cfg, quant, cfg.dtype)
    first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert not first.fused_qkv_a and hasattr(first, "q_a_proj") and hasattr(first, "kv_a_proj_with_mqa")
    assert type(first.kv_a_proj_with_mqa.quant_method).__name__ == "UnquantizedLinearMethod"
    assert type(first.q_a_proj.quant_method).__name__ == "Fp8BlockLinearMethod"
    assert second.fused_qkv_a
