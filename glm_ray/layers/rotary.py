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
    """x [T, ..., dim] -> rotated x (same dtype): out = (x1, x2) * (c, c) + (x2, x1) * (-s, s),
    i.e. (x1 c - x2 s, x2 c + x1 s) with x1/x2 the even/odd (interleaved) or first/second halves."""
    shape = (rope.cos.shape[0],) + (1,) * (x.dim() - 2) + (rope.cos.shape[1],)
    c, s = rope.cos.view(shape).to(x.dtype), rope.sin.view(shape).to(x.dtype)   # no-op casts in practice
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        xs = torch.cat([x1, x2], -1)                                            # de-interleaved copy
    else:
        x1, x2 = x.chunk(2, dim=-1)
        xs = x
    return torch.addcmul(xs * c, torch.cat([x2, x1], -1), s)
