"""`ForwardBatch`: everything a forward pass needs besides token ids, built once per step by the
model runner and shared by every layer.

Tokens of all scheduled sequences are packed on one axis `T` (varlen). Attention works on padded
per-sequence views: queries `[B, Qmax]` gather from `T`, keys `[B, Kmax]` gather flat KV-cache slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor      # [T] int64 position of each new token in its sequence
    slot_mapping: torch.Tensor   # [T] int64 flat KV slot (block * block_size + offset) the token writes
    q_index: torch.Tensor        # [B, Qmax] int64 index into T (padding -> 0)
    q_valid: torch.Tensor        # [B, Qmax] bool
    kv_slots: torch.Tensor       # [B, Kmax] int64 flat slots of context positions 0..ctx-1 (padding -> 0)
    causal: torch.Tensor         # [B, Qmax, Kmax] bool: key valid and key position <= query position
    max_context_len: int         # host int: max over sequences of cached + new tokens
    mla_mode: str                # "naive" (expand K/V, prefill) | "absorbed" (latent MQA, decode)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_forward_batch(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                        block_size: int, device: torch.device, mla_mode: str = "auto") -> ForwardBatch:
    """Host-side construction from per-sequence lengths (vectorized; one copy to the device).

    query_lens[i]: new tokens of sequence i this step; context_lens[i]: cached + new tokens.
    """
    B = len(query_lens)
    ql = torch.tensor(query_lens, dtype=torch.int64)                         # [B]
    cl = torch.tensor(context_lens, dtype=torch.int64)                       # [B]
    Qmax, Kmax = int(ql.max()), int(cl.max())
    max_blocks = max(len(b) for b in block_tables)
    bt = torch.zeros(B, max_blocks, dtype=torch.int64)
    for i, b in enumerate(block_tables):                                     # per sequence, not per token
        bt[i, :len(b)] = torch.tensor(b, dtype=torch.int64)
    kpos = torch.arange(Kmax)                                                # [Kmax]
    kv_valid = kpos[None, :] < cl[:, None]                                   # [B, Kmax]
    kv_slots = bt.gather(1, (kpos // block_size).clamp(max=max_blocks - 1)[None, :].expand(B, -1)) * block_size \
        + (kpos % block_size)[None, :]
    kv_slots = torch.where(kv_valid, kv_slots, 0)                            # [B, Kmax]
    qoff = torch.arange(Qmax)                                                # [Qmax]
    q_valid = qoff[None, :] < ql[:, None]                                    # [B, Qmax]
    starts = torch.cumsum(ql, 0) - ql                                        # [B]
    q_index = torch.where(q_valid, starts[:, None] + qoff[None, :], 0)       # [B, Qmax]
    qpos = (cl - ql)[:, None] + qoff[None, :]                                # [B, Qmax] absolute positions
    causal = (kpos[None, None, :] <= qpos[:, :, None]) & kv_valid[:, None, :] & q_valid[:, :, None]
    positions = qpos[q_valid]                                                # [T] (row-major = packing order)
    seq_of_tok = torch.arange(B)[:, None].expand(B, Qmax)[q_valid]
    slot_mapping = kv_slots.new_zeros(0)
    if positions.numel():
        slot_mapping = bt[seq_of_tok, positions // block_size] * block_size + positions % block_size
    if mla_mode == "auto":
        mla_mode = "absorbed" if Qmax == 1 else "naive"
    to = lambda t: t.to(device, non_blocking=True)
    return ForwardBatch(positions=to(positions), slot_mapping=to(slot_mapping), q_index=to(q_index),
                        q_valid=to(q_valid), kv_slots=to(kv_slots), causal=to(causal),
                        max_context_len=Kmax, mla_mode=mla_mode)
