"""Rotary position embedding for MLA and the indexer: default and yarn frequencies, applied to
interleaved pairs (x0,x1),(x2,x3),... (GLM/DeepSeek MLA) or NeoX halves.

NOTE: the interleaved form writes its result *de-interleaved* (evens then odds), exactly like the
transformers reference. q and k get the same permutation so scores are unchanged; only the cached
k_pe layout depends on it, and it is consistent across prefill and decode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from glm_ray.config import RopeConfig
from glm_ray.kernels.torch_ref.rope import rope as rope_math


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)   # [dim/2]
    if rope.rope_type != "yarn":
        return 1.0 / pos_freqs
    extra = 1.0 / pos_freqs
    inter = 1.0 / (rope.factor * pos_freqs)

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor


@dataclass
class RopeCache:
    """cos/sin of one step's positions, in the model dtype, laid out for `apply_rope` (built once per
    step, shared by every layer: the casts and the sign/duplication are not redone per call)."""
    cos: torch.Tensor            # [T, dim]  (c, c)
    sin: torch.Tensor            # [T, dim]  (-s, s)


class RotaryEmbedding(nn.Module):
    """cos/sin per position (fp32 math, then the model dtype), computed on the fly from positions [T]."""

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.dim = dim
        self.scale = rope.cos_sin_scale
        self.register_buffer("inv_freq", rope_inv_freq(rope, dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeCache:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]                 # [T, dim/2]
        c, s = (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        return RopeCache(cos=torch.cat([c, c], -1), sin=torch.cat([-s, s], -1))  # [T, dim] each


def apply_rope(x: torch.Tensor, rope: RopeCache, interleave: bool) -> torch.Tensor:
    """x [T, ..., dim] -> rotated x (same dtype): `kernels/torch_ref/rope.py` on the step's cos/sin."""
    return rope_math(x, rope.cos, rope.sin, interleave)
