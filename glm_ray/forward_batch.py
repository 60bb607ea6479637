"""`ForwardBatch`: everything a forward pass needs besides token ids, built once per step by the
model runner and shared by every layer.

Tokens of all scheduled sequences are packed on one axis `T` (varlen), in scheduler order. Attention
runs per `AttnGroup`: the sequences of a step split into a *decode* group (one new token each) and a
*prefill* groups (chunks of prompts, bucketed so padding stays within 2x), each on its own padded
per-sequence view — queries `[B, Qmax]`
gather from `T`, keys `[B, Kmax]` gather flat KV-cache slots. Splitting keeps a 1-token decode from
being padded to a 1024-token prefill chunk (`[B, Qmax, Kmax]` of the whole step) and lets each group
take its own MLA form: absorbed (latent MQA) for decode, naive (expanded MHA) for prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnGroup:
    """One homogeneous set of sequences of a step (all decode, or all prefill)."""
    token_index: torch.Tensor    # [Tg] int64 rows of T owned by the group, in the order q_valid packs them
    q_index: torch.Tensor        # [B, Qmax] int64 index into T (padding -> 0)
    q_valid: torch.Tensor        # [B, Qmax] bool
    kv_slots: torch.Tensor       # [B, Kmax] int64 flat slots of context positions 0..ctx-1 (padding -> 0)
    causal: torch.Tensor         # [B, Qmax, Kmax] bool: key valid and key position <= query position
    max_context_len: int         # host int: max over the group's sequences of cached + new tokens
    mla_mode: str                # "naive" (expand K/V) | "absorbed" (latent MQA)
    # recurrent-state models (GLM-5.3-Flash KDA layers); None for pure-attention models
    state_slots: torch.Tensor | None = None   # [B] int64 row of each sequence in the state caches
    state_fresh: torch.Tensor | None = None   # [B] bool: the sequence starts at position 0 this step
                                              # (initial state zero, whatever the slot holds)


@dataclass
class ForwardBatch:
    positions: torch.Tensor      # [T] int64 position of each new token in its sequence
    slot_mapping: torch.Tensor   # [T] int64 flat KV slot (block * block_size + offset) the token writes
    groups: tuple[AttnGroup, ...]  # decode groups first, then prefill groups; every row of T once
    max_context_len: int         # host int: max over all sequences of cached + new tokens

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_forward_batch(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                        block_size: int, device: torch.device, mla_mode: str = "auto",
                        state_slots: list[int] | None = None) -> ForwardBatch:
    """Host-side construction from per-sequence lengths (vectorized per group; one copy each to the device).

    query_lens[i]: new tokens of sequence i this step; context_lens[i]: cached + new tokens.
    mla_mode: "auto" -> absorbed for the decode group, naive for the prefill group; "naive" /
    "absorbed" force one form for both (tests, A/B).
    state_slots[i]: recurrent-state cache row of sequence i (hybrid models; default 0..B-1).
    """
    B = len(query_lens)
    ql = torch.tensor(query_lens, dtype=torch.int64)                         # [B]
    cl = torch.tensor(context_lens, dtype=torch.int64)                       # [B]
    max_blocks = max(len(b) for b in block_tables)
    bt = torch.zeros(B, max_blocks, dtype=torch.int64)
    for i, b in enumerate(block_tables):                                     # per sequence, not per token
        bt[i, :len(b)] = torch.tensor(b, dtype=torch.int64)
    starts = torch.cumsum(ql, 0) - ql                                        # [B] first row in T
    # every token: its position and KV slot, in packing order
    tok_seq = torch.repeat_interleave(torch.arange(B), ql)                   # [T]
    positions = (cl - ql)[tok_seq] + (torch.arange(len(tok_seq)) - starts[tok_seq])   # [T]
    slot_mapping = bt[tok_seq, positions // block_size] * block_size + positions % block_size
    slots = torch.tensor(state_slots if state_slots is not None else range(B), dtype=torch.int64)   # [B]
    groups = []
    for idx, mode in _partition(query_lens, context_lens):
        idx = torch.tensor(idx, dtype=torch.int64)
        groups.append(_group(ql[idx], cl[idx], starts[idx], bt[idx], block_size,
                             mode if mla_mode == "auto" else mla_mode) + (slots[idx], cl[idx] == ql[idx]))
    def to(t):
        return t.to(device, non_blocking=True)
    groups = tuple(AttnGroup(*(to(t) for t in g[:5]), max_context_len=g[5], mla_mode=g[6],
                             state_slots=to(g[7]), state_fresh=to(g[8]))
                   for g in groups)
    return ForwardBatch(positions=to(positions), slot_mapping=to(slot_mapping), groups=groups,
                        max_context_len=int(cl.max()))


def contiguous_block_tables(query_lens: list[int], block_size: int) -> list[list[int]]:
    """Block tables for fresh sequences of these lengths laid out back to back from block 0 (profile
    and benchmark steps that own a scratch cache)."""
    tables, nxt = [], 0
    for q in query_lens:
        n = -(-q // block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return tables


def _partition(query_lens: list[int], context_lens: list[int]) -> list[tuple[list[int], str]]:
    """Sequence indices per attention group: decodes first, then prefill chunks, each split into
    buckets whose padded views stay within 2x their real rows (B * Qmax <= 2 * sum(q) and
    B * Kmax <= 2 * sum(k)): one 8000-token chunk next to sixty 3-token chunks is not padded into
    [61, 8000, ...], nor 63 short chats' decodes to one 100k-token context. Host-side, per sequence
    (not per token); homogeneous steps stay one group each."""
    dec = sorted((i for i, q in enumerate(query_lens) if q == 1), key=lambda i: -context_lens[i])
    pre = sorted((i for i, q in enumerate(query_lens) if q > 1), key=lambda i: -query_lens[i])
    return ([(b, "absorbed") for b in _buckets(dec, query_lens, context_lens)]
            + [(b, "naive") for b in _buckets(pre, query_lens, context_lens)])


def _buckets(order: list[int], query_lens: list[int], context_lens: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    sq = sk = qmax = kmax = 0
    for i in order:
        q, k = query_lens[i], context_lens[i]
        n = len(cur) + 1
        if cur and (n * max(qmax, q) > 2 * (sq + q) or n * max(kmax, k) > 2 * (sk + k)):
            out.append(cur)
            cur, sq, sk, qmax, kmax = [], 0, 0, 0, 0
        cur.append(i)
        sq, sk, qmax, kmax = sq + q, sk + k, max(qmax, q), max(kmax, k)
    if cur:
        out.append(cur)
    return out


def _group(ql, cl, starts, bt, block_size: int, mode: str):
    """Padded per-sequence view of one group (host tensors)."""
    B, max_blocks = bt.shape
    Qmax, Kmax = int(ql.max()), int(cl.max())
    kpos = torch.arange(Kmax)                                                # [Kmax]
    kv_valid = kpos[None, :] < cl[:, None]                                   # [B, Kmax]
    kv_slots = bt.gather(1, (kpos // block_size).clamp(max=max_blocks - 1)[None, :].expand(B, -1)) * block_size \
        + (kpos % block_size)[None, :]
    kv_slots = torch.where(kv_valid, kv_slots, 0)                            # [B, Kmax]
    qoff = torch.arange(Qmax)                                                # [Qmax]
    q_valid = qoff[None, :] < ql[:, None]                                    # [B, Qmax]
    q_index = torch.where(q_valid, starts[:, None] + qoff[None, :], 0)       # [B, Qmax]
    qpos = (cl - ql)[:, None] + qoff[None, :]                                # [B, Qmax] absolute positions
    causal = (kpos[None, None, :] <= qpos[:, :, None]) & kv_valid[:, None, :] & q_valid[:, :, None]
    token_index = q_index[q_valid]                                           # [Tg]
    return token_index, q_index, q_valid, kv_slots, causal, Kmax, mode
