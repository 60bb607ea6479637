"""Checkpoint tensors as the loader hands them to layers, and the shard arithmetic for TP.

A `CheckpointTensor` is lazy: `read(index)` pulls only this rank's slice from the safetensors file
(or from an in-memory tensor). Parameters carry `output_dim` / `input_dim` attributes saying which
tensor dim is the layer's output / input axis; layers use them to cut their TP shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# safetensors dtype strings -> torch dtypes
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})


class WeightError(ValueError):
    """A checkpoint tensor does not fit the model (shape, dtype, name)."""


@dataclass
class CheckpointTensor:
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str                                   # safetensors dtype string
    _slice: Any = None                           # safetensors PySafeSlice or a torch.Tensor

    @classmethod
    def from_tensor(cls, name: str, t: torch.Tensor, file: str = "<memory>") -> "CheckpointTensor":
        return cls(name, file, tuple(t.shape), TORCH_TO_ST[t.dtype], t)

    def read(self, index: tuple | None = None) -> torch.Tensor:
        src = self._slice
        if index is None:
            return src[...] if isinstance(src, torch.Tensor) else src[:]
        return src[index]


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for k, v in attrs.items():
        setattr(param, k, v)
    return param


def check_dtype(param: nn.Parameter, ckpt: CheckpointTensor) -> None:
    allowed = getattr(param, "ckpt_dtypes", FLOAT_DTYPES)
    if ckpt.dtype not in allowed:
        raise WeightError(f"tensor {ckpt.name!r} in {ckpt.file}: dtype {ckpt.dtype}, expected one of "
                          f"{sorted(allowed)} (is the checkpoint quantized without a matching quantization_config?)")


def shape_error(ckpt: CheckpointTensor, expected: tuple[int, ...]) -> WeightError:
    return WeightError(f"tensor {ckpt.name!r} in {ckpt.file}: shape {list(ckpt.shape)}, expected {list(expected)}")


def load_sharded(param: nn.Parameter, ckpt: CheckpointTensor, *, shard_dim: int | None, rank: int, tp: int,
                 dest_dim: int | None = None, dest_offset: int = 0, dest_len: int | None = None) -> None:
    """Copy this rank's slice of `ckpt` into `param` (or into a slice of it along `dest_dim`).

    `shard_dim`: checkpoint dim split across TP ranks (None = replicated).
    `dest_*`: where it lands inside `param` (merged params such as gate_up hold several shards).
    """
    check_dtype(param, ckpt)
    target = param.data
    if dest_dim is not None:
        target = target.narrow(dest_dim, dest_offset, dest_len)
    expected = list(target.shape)
    if shard_dim is not None:
        expected[shard_dim] *= tp
    if tuple(expected) != tuple(ckpt.shape):
        raise shape_error(ckpt, tuple(expected))
    index = None
    if shard_dim is not None and tp > 1:
        per = target.shape[shard_dim]
        index = tuple(slice(rank * per, (rank + 1) * per) if d == shard_dim else slice(None)
                      for d in range(len(ckpt.shape)))
    target.copy_(ckpt.read(index).to(target.dtype))
