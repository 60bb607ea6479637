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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionBits:
    """A prefill group's DSA selection as a bitmap — the form the cuda backend's indexer hands its sparse MLA
    prefill kernel (no [B, Qmax, k] index list, no bitmap built from it): bits [Tg, ceil(Kmax / 32)] int32,
    rows in the group's packed (q_valid) order, bit t % 32 of word t // 32 set iff that query attends to
    position t (its top-k of its causal positions). `indexer.selection_mask` turns it into the bool mask."""
    bits: torch.Tensor

    @classmethod
    def from_indices(cls, indices: torch.Tensor, group) -> SelectionBits:
        """The index form [B, Qmax, k] int32 (-1 = none) of `group`'s selection as its bitmap (torch; tests and
        references — the cuda indexer writes the bitmap itself)."""
        B, Qmax, k = indices.shape
        return cls(pack_positions(indices.reshape(B * Qmax, k)[group.packed], -(-group.max_context_len // 32)))


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


def pack_positions(positions: torch.Tensor, words: int) -> torch.Tensor:
    """positions [B, k] int (-1 = none; positions >= words * 32 dropped) -> the bitmap [B, words] int32:
    bit p % 32 of word p // 32 set for each listed position p (the sparse MLA prefill's selection form)."""
    B = positions.shape[0]
    ok = (positions >= 0) & (positions < words * 32)                                  # [B, k]
    mask = torch.zeros(B, words * 32 + 1, dtype=torch.bool, device=positions.device)  # [B, n+1]; last = dropped
    mask.scatter_(1, torch.where(ok, positions.long(), words * 32), True)
    return pack_mask(mask[:, :words * 32])


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, n] -> [B, ceil(n / 32)] int32 (bit j % 32 of word j // 32 = mask[:, j])."""
    B, n = mask.shape
    words = -(-n // 32)
    m = torch.zeros(B, words * 32, dtype=torch.int64, device=mask.device)
    m[:, :n] = mask.long()
    w = (m.view(B, words, 32) << torch.arange(32, device=mask.device)).sum(-1)       # [B, words] < 2**32
    return (w - (w >= 2**31).long() * 2**32).to(torch.int32)                         # two's complement


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """[B, words] int32 -> bool [B, n] (the first n bits of each row)."""
    B, words = bits.shape
    m = (bits.long()[:, :, None] >> torch.arange(32, device=bits.device)) & 1         # [B, words, 32]
    return m.view(B, words * 32)[:, :n].bool()


def topk_bits(scores: torch.Tensor, lengths: torch.Tensor, k: int, words: int | None = None) -> torch.Tensor:
    """The selection of `topk_positions` as a bitmap: scores [B, n] fp32, lengths [B], k ->
    [B, words (default ceil(n / 32))] int32, bit t set iff t is one of the row's picks."""
    n = scores.shape[1]
    return pack_positions(topk_positions(scores, lengths, k), words if words is not None else -(-n // 32))
