"""Strict, streaming weight loading from an HF directory (config.json + safetensors shards + index).

Every checkpoint tensor must map to exactly one expected (param, shard) slot and every slot must be
filled: a missing, unexpected, wrongly shaped or wrongly typed tensor, or an unreadable/truncated
shard, is a `WeightError` naming the tensor and the file. Tensors are read lazily, one TP slice at a
time. `load_format="dummy"` fills the same params with random values (full-size benchmarks).
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from glm_ray.weights import CheckpointTensor, WeightError

logger = logging.getLogger(__name__)

# Tensors real GLM/DeepSeek checkpoints may carry that we deliberately do not use.
IGNORED = [
    re.compile(r".*rotary_emb\.inv_freq$"),
    re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$"),  # MTP copies of shared weights
]


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightError(f"{index} lists shard(s) that do not exist: {missing}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: no *.safetensors files and no model.safetensors.index.json "
                          f"(for random weights of this config use --load-format dummy)")
    return files


def iter_checkpoint(path: str | os.PathLike, progress: bool = True):
    """Yield CheckpointTensor for every tensor of every shard (lazily; nothing read yet)."""
    path = Path(path)
    files = _shard_files(path)
    index_map = None
    if (path / "model.safetensors.index.json").is_file():
        with open(path / "model.safetensors.index.json") as f:
            index_map = json.load(f)["weight_map"]
    bar = tqdm(files, desc="loading shards", unit="shard", disable=not progress or len(files) < 2)
    seen: set[str] = set()
    for file in bar:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise WeightError(f"cannot read safetensors shard {file}: {e} (truncated or corrupt?)") from e
        with handle as f:
            for name in f.keys():
                sl = f.get_slice(name)
                seen.add(name)
                yield CheckpointTensor(name=name, file=str(file), shape=tuple(sl.get_shape()),
                                       dtype=sl.get_dtype(), _slice=sl)
    if index_map is not None:
        absent = sorted(set(index_map) - seen)
        if absent:
            raise WeightError(f"model.safetensors.index.json lists {len(absent)} tensor(s) not found in the shards, "
                              f"e.g. {absent[0]!r} (expected in {index_map[absent[0]]})")


def load_weights(model, path: str | os.PathLike, progress: bool = True) -> None:
    expected = model.checkpoint_params()
    model_ignores = getattr(model, "ignores_checkpoint_tensor", lambda name: False)
    loaded: set[str] = set()
    for ckpt in iter_checkpoint(path, progress):
        if ckpt.name not in expected:
            if any(p.match(ckpt.name) for p in IGNORED) or model_ignores(ckpt.name):
                continue
            raise WeightError(f"unexpected tensor {ckpt.name!r} in {ckpt.file}: the model has no such parameter")
        if ckpt.name in loaded:
            raise WeightError(f"tensor {ckpt.name!r} appears twice (again in {ckpt.file})")
        param, loader, kwargs = expected[ckpt.name]
        try:
            loader(param, ckpt, **kwargs)
        except WeightError:
            raise
        except Exception as e:
            raise WeightError(f"tensor {ckpt.name!r} in {ckpt.file}: cannot load ({type(e).__name__}: {e}; "
                              f"file truncated or corrupt?)") from e
        loaded.add(ckpt.name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightError(f"checkpoint {path} is missing tensor {missing[0]!r}{more}")
    model.process_weights_after_loading()


@torch.no_grad()
def init_dummy_weights(model, seed: int = 0) -> None:
    """Random weights of the right shapes/dtypes, on the model's device (no checkpoint)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        init = getattr(p, "dummy_init", None)
        if init is not None:                  # quant methods fill their payloads (and scales) themselves
            init(p, gen)
        elif getattr(p, "is_norm", False) or name.endswith("k_norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            p.zero_()
        elif p.dtype.is_floating_point and p.element_size() >= 2:
            fan_in = p.shape[-1]
            p.normal_(0.0, fan_in ** -0.5, generator=gen)
        else:
            raise WeightError(f"no dummy initializer for {name} ({p.dtype})")
    model.process_weights_after_loading()
