"""Torch reference of the row-wise top-k positions used by the DSA indexer's decode path (the oracle of
the Triton radix select in kernels/cuda/topk.py, and its CPU path).

    out[b] = the positions t < lengths[b] of the k largest scores[b, t], ties broken by lowest position,
             listed in ascending position order, then -1 up to k

Valid keys are the positions below the row's length whose score is not -inf (-inf scores are never
picked: a row with fewer than k of them is -1 padded). Scores of valid keys are expected finite; NaN is
outside the contract. -0.0 and +0.0 are the same value (a tie). The selection is deterministic: it is
the first k of the row sorted by (score descending, position ascending).
"""
from __future__ import annotations

import torch


def topk_positions(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, n] fp32, lengths [B] int (positions >= lengths[b] are invalid), k >= 1 (may exceed n)
    -> [B, k] int32: ascending positions of the k best valid scores of each row, then -1s. No host sync."""
    B, n = scores.shape
    assert k >= 1
    pos = torch.arange(n, device=scores.device)                                      # [n]
    valid = pos[None, :] < lengths.to(device=scores.device).long()[:, None]           # [B, n]
    s = scores.float().masked_fill(~valid, float("-inf"))                            # [B, n]
    # a stable descending sort keeps equal scores in position order: ties -> lowest position first
    vals, order = torch.sort(s, dim=-1, descending=True, stable=True)               # [B, n]
    kk = min(k, n)
    picked = order[:, :kk].masked_fill(vals[:, :kk] == float("-inf"), n)            # [B, kk]; n = no pick
    picked = picked.sort(dim=-1).values                                             # ascending, no-picks last
    out = torch.full((B, k), -1, dtype=torch.int32, device=scores.device)            # [B, k]
    out[:, :kk] = picked.masked_fill(picked == n, -1).to(torch.int32)
    return out
