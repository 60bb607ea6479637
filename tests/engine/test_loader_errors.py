"""Strict loading: every way a checkpoint can be wrong is a clear error naming the tensor and file."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_ray import LLM
from glm_ray.weights import WeightError


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def _shard_with(ckpt, name):
    wm = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return ckpt / wm[name]


def _load(path):
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_loads_clean(ckpt):
    _load(ckpt)


def test_truncated_shard(ckpt):
    f = _shard_with(ckpt, "lm_head.weight")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match=f"{f.name}.*(truncated|corrupt)"):
        _load(ckpt)


def _rewrite(ckpt, name, fn):
    f = _shard_with(ckpt, name)
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return f


def test_missing_tensor(ckpt):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    _rewrite(ckpt, name, lambda t: t.pop(name))
    idx = ckpt / "model.safetensors.index.json"
    j = json.loads(idx.read_text()); j["weight_map"].pop(name); idx.write_text(json.dumps(j))
    with pytest.raises(WeightError, match="missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"):
        _load(ckpt)


def test_index_lists_absent_tensor(ckpt):
    name = "model.layers.1.self_attn.q_b_proj.weight"
    _rewrite(ckpt, name, lambda t: t.pop(name))
    with pytest.raises(WeightError, match="q_b_proj.weight"):
        _load(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    f = _rewrite(ckpt, name, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(WeightError, match=rf"'{name}' in .*{f.name}: shape \[.*\], expected \[.*\]"):
        _load(ckpt)


def test_wrong_dtype(ckpt):
    name = "model.layers.0.mlp.down_proj.weight"
    f = _rewrite(ckpt, name, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(WeightError, match=rf"'{name}' in .*{f.name}: dtype F8_E4M3"):
        _load(ckpt)


def test_unexpected_tensor(ckpt):
    name = "model.layers.0.mlp.gate_proj.weight"
    _rewrite(ckpt, name, lambda t: t.__setitem__("model.layers.0.mlp.bogus.weight", torch.zeros(2)))
    with pytest.raises(WeightError, match="unexpected tensor 'model.layers.0.mlp.bogus.weight'"):
        _load(ckpt)


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
        _load(ckpt)
