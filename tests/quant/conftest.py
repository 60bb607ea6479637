"""Quantized tiny checkpoints (written once per session) and a weight-only torch backend."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_ray import kernels
from glm_ray.kernels.torch_ref import fused_moe, quant_ops
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear, dequant_block_fp8
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4


def write_base(path: Path, seed: int = 0, **overrides) -> Path:
    """Tiny GLM-5 via write_tiny with 16 indexer heads (as tests/conftest.py's oracle_dir: no top-k ties)."""
    from glm_ray.model.tiny import bundled_config, write_tiny
    cfg = bundled_config()
    cfg.update(index_n_heads=16, **overrides)
    return write_tiny(path, cfg, seed=seed)


def dequantize_checkpoint(src: Path, dst: Path) -> Path:
    """Our quantized checkpoint -> an unquantized fp32 one with exactly the dequantized weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        d = load_file(f)
        out = {}
        for name, t in d.items():
            if name.endswith((".weight_scale", ".weight_scale_inv")):
                continue
            mod = name[: -len(".weight")] if name.endswith(".weight") else None
            s = d.get(f"{mod}.weight_scale_inv", d.get(f"{mod}.weight_scale")) if mod else None
            if s is not None and t.dtype == torch.float8_e4m3fn:
                t = dequant_block_fp8(t, s)
            elif s is not None and t.dtype == torch.uint8:
                t = dequant_mxfp4(t, s)
            out[name] = t.float() if t.dtype.is_floating_point and name.endswith(".weight") else t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    with open(dst / "model.safetensors.index.json", "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _quantized_set(root: Path, **overrides) -> dict[str, str]:
    from glm_ray.model.quantize import quantize_checkpoint
    base = write_base(root / "bf16", **overrides)
    return {"bf16": str(base), "fp8": str(quantize_checkpoint(base, root / "fp8", "fp8-block")),
            "mx": str(quantize_checkpoint(base, root / "mx", "quark-mxfp4-moe"))}


@pytest.fixture(scope="session")
def quant_ckpts(tmp_path_factory) -> dict[str, str]:
    """The default tiny (sparse DSA: index_topk 8) in bf16 and both quantized formats."""
    return _quantized_set(tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="session")
def dense_ckpts(tmp_path_factory) -> dict[str, str]:
    """Like quant_ckpts but with index_topk 64 (> every test prompt: DSA selection = causal), plus an
    unrelated model of the same shape ("other", another seed) as the yardstick for the bf16 comparison."""
    root = tmp_path_factory.mktemp("quant_dense")
    out = _quantized_set(root, index_topk=64)
    out["other"] = str(write_base(root / "other", seed=7, index_topk=64))
    return out


# ---- a torch backend without activation quantization (isolates weight loading from act-quant noise)

def _w8a16_linear(x, w, s, block=(128, 128), out_dtype=None, **_):
    return block_fp8_linear(x, w, s, block, out_dtype, mode="w8a16")


def _moe_fp8_weight_only(x, w13, s13, w2, s2, tw, ids, *, block=(128, 128), swiglu_limit=None,
                         intermediate_pad=0, **_):
    return fused_moe(x, quant_ops.dequant_w13_block_fp8(w13, s13, block).to(x.dtype),
                     dequant_block_fp8(w2, s2, block, dtype=x.dtype), tw, ids, swiglu_limit=swiglu_limit,
                     intermediate_pad=intermediate_pad)


def _moe_mx_weight_only(x, w13, s13, w2, s2, tw, ids, *, swiglu_limit=None, intermediate_pad=0, **_):
    return fused_moe(x, dequant_mxfp4(w13, s13, x.dtype), dequant_mxfp4(w2, s2, x.dtype), tw, ids,
                     swiglu_limit=swiglu_limit, intermediate_pad=intermediate_pad)


def _mx_linear_weight_only(x, w, s, *, act_mode=None, **kw):
    return quant_ops.mxfp4_linear(x, w, s, act_mode=None, **kw)


@pytest.fixture(scope="session")
def weight_only_backend() -> str:
    name = "torch-weight-only"
    kernels.register(name)(lambda: dataclasses.replace(
        kernels._torch_ops(), name=name, block_fp8_linear=_w8a16_linear, mxfp4_linear=_mx_linear_weight_only,
        fused_moe_block_fp8=_moe_fp8_weight_only, fused_moe_mxfp4=_moe_mx_weight_only))
    return name


@pytest.fixture(scope="session")
def dense_reference(dense_ckpts):
    """(bf16 prompt logprobs, mean |dlogprob| of the unrelated model vs bf16) on dense_ckpts."""
    import numpy as np

    from tests.quant.helpers import prompt_logprobs
    base = prompt_logprobs(dense_ckpts["bf16"])
    return base, float(np.abs(prompt_logprobs(dense_ckpts["other"]) - base).mean())
