"""`ForwardBatch`: everything a forward pass needs besides token ids, built once per step by the
model runner and shared by every layer.

Tokens of all scheduled sequences are packed on one axis `T` (varlen), in scheduler order. Attention
runs per `AttnGroup`: the sequences of a step split into a *decode* group (one new token each) and
*prefill* groups (chunks of prompts, bucketed so padding stays within 2x). A group carries the paged
metadata kernels read — block table, context and query lengths, on the device — and, derived from it
on first use, the padded per-sequence views the torch references use: queries `[B, Qmax]` gather
from `T`, keys `[B, Kmax]` gather flat KV-cache slots. Splitting keeps a 1-token decode from being
padded to a 1024-token prefill chunk (`[B, Qmax, Kmax]` of the whole step) and lets each group take
its own MLA form: absorbed (latent MQA) for decode, naive (expanded MHA) for prefill.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from glm_ray.staging import stage


@dataclass(eq=False)
class AttnGroup:
    """One homogeneous set of sequences of a step (all decode, or all prefill).

    Device metadata a paged kernel reads (`block_table`, `context_lens`, `query_lens`) plus the padded
    per-sequence views the torch references use (`kv_slots`, `causal`), derived from them on the device
    on first use (a decode kernel that walks the block table never builds them).
    """
    token_index: torch.Tensor    # [Tg] int64 rows of T owned by the group, in the order q_valid packs them
    q_index: torch.Tensor        # [B, Qmax] int64 index into T (padding -> 0)
    q_valid: torch.Tensor        # [B, Qmax] bool
    packed: torch.Tensor         # [Tg] int64 valid entries of the flattened [B*Qmax] view, in q_valid order
                                 # (`x.flatten(0, 1)[packed]` == `x[q_valid]` without a host sync)
    block_table: torch.Tensor    # [B, nb] int32 cache blocks of each sequence (padding -> 0)
    context_lens: torch.Tensor   # [B] int32 cached + new tokens of each sequence
    query_lens: torch.Tensor     # [B] int32 new tokens of each sequence this step
    block_size: int
    max_context_len: int         # host int: max over the group's sequences of cached + new tokens
    mla_mode: str                # "naive" (expand K/V) | "absorbed" (latent MQA)
    # recurrent-state models (GLM-5.3-Flash KDA layers); None for pure-attention models
    state_slots: torch.Tensor | None = None   # [B] int64 row of each sequence in the state caches
    state_fresh: torch.Tensor | None = None   # [B] bool: the sequence starts at position 0 this step
                                              # (initial state zero, whatever the slot holds)
    # host int: key width Kmax of the padded views (None -> max_context_len). A CUDA-graph decode batch
    # sets it to its static capacity (nb * block_size) so every view keeps its captured shape.
    kv_capacity: int | None = None
    # host hint: the group's rows are exactly T[start:stop] in order (a CUDA-graph decode batch, a
    # prefill step's group whose sequences sit back to back), so per-row gathers (`x[q_index[:, 0]]`)
    # and scatters back can be slices (None: use the indices)
    row_span: tuple[int, int] | None = None
    _views: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _plans: dict = field(default_factory=dict, init=False, repr=False)   # kernel plans derived from the metadata (`plan`)

    @property
    def num_seqs(self) -> int:
        return self.q_index.shape[0]

    @property
    def kv_slots(self) -> torch.Tensor:
        """[B, Kmax] int64 flat slot of every context position 0..ctx-1 (padding -> 0)."""
        return self._padded_views()[0]

    @property
    def causal(self) -> torch.Tensor:
        """[B, Qmax, Kmax] bool: key valid and key position <= query position."""
        return self._padded_views()[1]

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the group's one-query rows [B, ...] (decode groups): a slice where `row_span`
        says so, else a gather by q_index[:, 0]."""
        if self.row_span is not None:
            return x[self.row_span[0]:self.row_span[1]]
        return x[self.q_index[:, 0]]

    def plan(self, key, build):
        """A kernel's layer-independent plan of this group (device metadata derived from the group's),
        built by `build()` on the first layer that asks for `key` and shared by the step's other layers."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def _padded_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._views is None:
            self._views = padded_views(self.block_table, self.context_lens, self.query_lens, self.q_valid,
                                       self.block_size, self.kv_capacity or self.max_context_len)
        return self._views


def padded_views(block_table: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
                 q_valid: torch.Tensor, block_size: int, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_slots [B, kmax] int64, causal [B, Qmax, kmax] bool) of a group, on its device."""
    B, nb = block_table.shape
    dev = block_table.device
    cl, ql = context_lens.long(), query_lens.long()                         # [B]
    kpos = torch.arange(kmax, device=dev)                                   # [Kmax]
    kv_valid = kpos[None, :] < cl[:, None]                                  # [B, Kmax]
    blk = (kpos // block_size).clamp(max=nb - 1)[None, :].expand(B, -1)     # [B, Kmax]
    kv_slots = block_table.long().gather(1, blk) * block_size + (kpos % block_size)[None, :]
    kv_slots = torch.where(kv_valid, kv_slots, 0)
    qpos = (cl - ql)[:, None] + torch.arange(q_valid.shape[1], device=dev)[None, :]   # [B, Qmax] positions
    causal = (kpos[None, None, :] <= qpos[:, :, None]) & kv_valid[:, None, :] & q_valid[:, :, None]
    return kv_slots, causal


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
                        block_size: int, device: torch.device | str, mla_mode: str = "auto",
                        state_slots: list[int] | None = None, absorb_tokens: int = 0) -> ForwardBatch:
    """Host-side construction from per-sequence lengths: vectorized numpy per step (no per-token Python,
    no torch dispatch per small op), then every array of the step in one host -> device copy (`stage`).

    query_lens[i]: new tokens of sequence i this step; context_lens[i]: cached + new tokens.
    mla_mode: "auto" -> absorbed for the decode group, naive for the prefill group; "naive" /
    "absorbed" force one form for both (tests, A/B).
    state_slots[i]: recurrent-state cache row of sequence i (hybrid models; default 0..B-1).
    absorb_tokens (mla_mode "auto"; 0 = off; pure-attention models only: a recurrent state is per sequence): a
    prefill chunk of at most this many tokens over a cached context at least as long (a prefix-cache hit's tail,
    a chunked prompt's later chunk) joins the decode group as one-query rows — row i attends to the sequence's
    first `context - query + i + 1` positions through the sequence's block table — instead of expanding its
    whole context with kv_b_proj in a prefill group of its own (`_attention_units`), while the decode group's
    [rows, max context] fp32 index scores stay within ABSORB_SCORE_BYTES.
    """
    B = len(query_lens)
    ql = np.asarray(query_lens, dtype=np.int64)                              # [B]
    cl = np.asarray(context_lens, dtype=np.int64)                            # [B]
    nblk = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=B)   # [B]
    bt = np.zeros((B, int(nblk.max())), dtype=np.int64)                      # [B, nb] (padding -> 0)
    bt[np.arange(bt.shape[1])[None, :] < nblk[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(nblk.sum()))
    starts = np.cumsum(ql) - ql                                              # [B] first row in T
    # every token: its position and KV slot, in packing order
    tok_seq = np.repeat(np.arange(B), ql)                                    # [T]
    positions = (cl - ql - starts)[tok_seq] + np.arange(tok_seq.shape[0])   # [T]
    slot_mapping = bt[tok_seq, positions // block_size] * block_size + positions % block_size   # [T]
    slots = np.asarray(state_slots if state_slots is not None else range(B), dtype=np.int64)   # [B]
    seq, uq, ucl, ustart = _attention_units(ql, cl, starts, absorb_tokens if mla_mode == "auto" else 0)
    parts = _partition(uq.tolist(), ucl.tolist())
    per_group = []                              # each group's 7 AttnGroup arrays + state slots + state fresh
    for idx, _ in parts:
        idx = np.asarray(idx, dtype=np.int64)
        u = seq[idx]                                                         # the units' sequences
        per_group.append([*_group(uq[idx], ucl[idx], ustart[idx], bt[u]), slots[u], ucl[idx] == uq[idx]])
    dev = iter(stage([positions, slot_mapping, *itertools.chain.from_iterable(per_group)], torch.device(device)))
    positions_d, slot_mapping_d = next(dev), next(dev)
    groups = []
    for h, (_, mode) in zip(per_group, parts):
        d = [next(dev) for _ in h]
        groups.append(AttnGroup(*d[:7], block_size=block_size, max_context_len=int(h[5].max()),
                                mla_mode=mode if mla_mode == "auto" else mla_mode, state_slots=d[7],
                                state_fresh=d[8], row_span=_span(h[0])))
    return ForwardBatch(positions=positions_d, slot_mapping=slot_mapping_d, groups=tuple(groups),
                        max_context_len=int(cl.max()))


# the absorbed rows' index scores, [rows, max context] fp32, stay within the prefill indexer's per-call bound
ABSORB_SCORE_BYTES = 256 * 2**20


def _attention_units(ql: np.ndarray, cl: np.ndarray, starts: np.ndarray, absorb_tokens: int):
    """The step's attention units (numpy, [U] each): (sequence, query len, context len, first row in T). A unit is
    a whole sequence, except that a prefill chunk of 2..absorb_tokens tokens over at least as many cached ones
    becomes one unit per token: query len 1 and the causal context of that token — the absorbed (latent MQA) form
    then costs ~h * (2r + dr) FLOPs per query and key, against the naive form's expansion of the whole context
    through kv_b_proj (r * h * (dn + dv) per key) plus h * (dn + dr + dv) per query and key: at every GLM-5 head
    count the absorbed form is cheaper below ~400 queries per chunk."""
    B = ql.shape[0]
    seq = np.arange(B)
    absorb = (ql > 1) & (ql <= absorb_tokens) & (cl - ql >= ql)                # [B] candidate chunks
    # bound the decode group's [rows, max context] fp32 index scores (the decode indexer scores a row's whole
    # context in one pass) by what one prefill indexer call may hold: later candidates stay naive prefill chunks
    dec = ql == 1
    rows, kmax = int(dec.sum()), int(cl[dec].max()) if dec.any() else 0
    for i in np.flatnonzero(absorb):
        r, k = rows + int(ql[i]), max(kmax, int(cl[i]))
        if r * k * 4 > ABSORB_SCORE_BYTES:
            absorb[i] = False
        else:
            rows, kmax = r, k
    if not absorb.any():
        return seq, ql, cl, starts
    reps = np.where(absorb, ql, 1)                                           # [B] units of each sequence
    seq = np.repeat(seq, reps)                                               # [U]
    k = np.arange(seq.shape[0]) - (np.cumsum(reps) - reps)[seq]              # [U] the unit's token in its chunk
    row = absorb[seq]                                                        # [U] a one-token unit of a chunk
    uq = np.where(row, 1, ql[seq])
    ucl = np.where(row, cl[seq] - ql[seq] + k + 1, cl[seq])
    return seq, uq, ucl, starts[seq] + k


def _span(token_index: np.ndarray) -> tuple[int, int] | None:
    """(start, stop) when the group's rows are exactly T[start:stop] in order (host array), else None."""
    n = token_index.shape[0]
    if n == 0:
        return None
    a, b = int(token_index[0]), int(token_index[-1])
    if b - a + 1 != n or (n > 1 and not bool((token_index[1:] > token_index[:-1]).all())):
        return None
    return a, b + 1


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
    # a bucket's members in step order: a group whose rows are consecutive in T gets a `row_span` (slices, not
    # gathers, for its rows; e.g. decodes beside a cached tail's one-query rows)
    return ([(sorted(b), "absorbed") for b in _buckets(dec, query_lens, context_lens)]
            + [(sorted(b), "naive") for b in _buckets(pre, query_lens, context_lens)])


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


def _group(ql, cl, starts, bt):
    """Host metadata of one group (numpy): (token_index, q_index, q_valid, packed, block_table, context_lens,
    query_lens)."""
    qoff = np.arange(int(ql.max()))                                          # [Qmax]
    q_valid = qoff[None, :] < ql[:, None]                                    # [B, Qmax]
    q_index = np.where(q_valid, starts[:, None] + qoff[None, :], 0)          # [B, Qmax]
    token_index = q_index[q_valid]                                           # [Tg]
    packed = np.flatnonzero(q_valid)                                         # [Tg]
    return (token_index, q_index, q_valid, packed, bt.astype(np.int32), cl.astype(np.int32),
            ql.astype(np.int32))
