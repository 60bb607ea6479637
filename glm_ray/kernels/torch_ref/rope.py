"""The rotary embedding's math on tensors (cos / sin in the `RopeCache` layout of layers/rotary.py),
shared by the layers and the cache-write references so both run the same ops with the same roundings."""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, ..., dim], cos / sin [T, dim] ((c, c) and (-s, s)) -> rotated x (same dtype):
    out = (x1, x2) * (c, c) + (x2, x1) * (-s, s), i.e. (x1 c - x2 s, x2 c + x1 s) with x1/x2 the even/odd
    (interleaved; the result is de-interleaved: evens then odds) or first/second halves."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)       # no-op casts in practice
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        xs = torch.cat([x1, x2], -1)                                        # de-interleaved copy
    else:
        x1, x2 = x.chunk(2, dim=-1)
        xs = x
    return torch.addcmul(xs * c, torch.cat([x2, x1], -1), s)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, start: int) -> None:
    """The `rope_inplace` op's reference: x [T, H, D] (last dim unit-stride), cos / sin [T, dr] ->
    x[..., start:start + dr] = rope(x[..., start:start + dr]) in place (MLA's query: start = qk_nope_head_dim;
    the DSA indexer's query: start = 0)."""
    dr = cos.shape[-1]
    part = x[..., start:start + dr]
    part.copy_(rope(part, cos, sin, interleave))
