"""Decode steps as CUDA graphs: capture once per batch-size bucket, replay every step.

A pure-decode step (one new token per sequence) of B sequences runs the captured graph of the smallest
bucket >= B (1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32 up to `max_num_seqs`). Everything the
forward reads lives in static buffers owned here — token ids, positions, KV slots, the block table,
context lengths, state slots — and each step only copies its values in (`_stage`), then replays: one
launch for the whole model instead of thousands. Rows past B are padding: they decode position 0 of a
reserved scratch block (the KV cache has one block the scheduler never hands out) and a scratch state
row, so they never touch a real sequence; their outputs are dropped.

Graphs are captured after the KV cache exists (the graphs point at it), largest first into one shared
memory pool. Each bucket is captured per *context capacity* too (`context_buckets`: index_topk or 2k,
then x4 up to max_model_len): the key width the kernels are sized for — the attention kernel's split
over keys, the indexer's score row — is static in a graph, so a 1k-token step must not pay for a
128k-token capacity. A step takes the smallest capacity >= its longest context. For a DSA model the
first capacity is `index_topk`: steps whose contexts all fit run dense (no indexer scoring), longer
ones sparse, exactly the eager path's choice. What a graph replays is what eager runs — the same
layers and kernel ops; only the padded-view key width of a torch-reference fallback differs (the
capacity instead of the step's max).

Not captured: prefill and mixed steps (variable token counts; they run eagerly), `--enforce-eager`, and
forced MLA forms other than "auto". The logits and the sampler run eagerly after the replay. On the CPU
nothing is captured, but tests run the same static-buffer path (`run` without a graph) against eager.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from glm_ray.forward_batch import AttnGroup, ForwardBatch

logger = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: small powers/steps up to 64, then every 32, up to max_num_seqs."""
    out = [b for b in _SMALL_BUCKETS if b < max_num_seqs]
    b = 96
    while b < max_num_seqs:
        out.append(b)
        b += 32
    return out + [max_num_seqs]


def context_buckets(max_context: int, first: int) -> list[int]:
    """Captured key capacities: `first` (index_topk for DSA models), then x4, up to max_context."""
    out, c = [], first
    while c < max_context:
        out.append(c)
        c *= 4
    return out + [max_context]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor           # [Bp, D] output written by every replay
    batch: ForwardBatch            # the captured batch: its index tensors (rows, q_index, packed ...) live
                                   # outside the graph pool, and the graph reads them at every replay


class DecodeGraphs:
    """Static buffers + one captured graph per (bucket, variant); `run` stages a step and replays."""

    def __init__(self, model: torch.nn.Module, kv_caches, index_caches, state_caches, *, max_num_seqs: int,
                 max_blocks: int, block_size: int, pad_block: int, pad_state_slot: int,
                 dense_threshold: int | None, device: torch.device):
        self.model, self.kv_caches, self.index_caches, self.state_caches = model, kv_caches, index_caches, state_caches
        self.block_size, self.max_blocks = block_size, max_blocks
        # DSA models: the indexer's top-k (the MLA layer scores iff a context exceeds it)
        first = -(-(dense_threshold or 2048) // block_size) * block_size
        self.capacities = context_buckets(max_blocks * block_size, first)    # static key widths
        self.buckets = batch_buckets(max_num_seqs)
        self.device = device
        n = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        # the int64 rows live in one [4, N] buffer so a step stages them with one copy
        # (rows padded to 32 entries: each starts 256-byte aligned, as a buffer of its own would)
        self._rows = torch.zeros(4, -(-n // 32) * 32, dtype=i64, device=device)   # [4, N'] N' >= N
        self.ids, self.positions, self.slot_mapping, self.state_slots = self._rows[:, :n].unbind(0)   # [N] each
        self.block_table = torch.zeros(n, max_blocks, dtype=i32, device=device)   # [N, nb]
        self.context_lens = torch.ones(n, dtype=i32, device=device)         # [N]
        self.state_fresh = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
        self._pad = dict(block=pad_block, slot=pad_block * block_size, state=pad_state_slot)
        # host staging, pinned so the per-step copies are asynchronous; two sets, alternating, so a step
        # staged while the previous one's copies may still be queued (async scheduling) never overwrites
        # them: a set is reused only after the event recorded behind its copies
        pin = device.type == "cuda"
        self._h_rows = [torch.zeros_like(self._rows, device="cpu", pin_memory=pin) for _ in range(2)]   # ids, pos, slot, state
        self._h_ctx = [torch.ones(n, dtype=i32, pin_memory=pin) for _ in range(2)]          # context lens
        self._h_bt = [torch.zeros(n * max_blocks, dtype=i32, pin_memory=pin) for _ in range(2)]   # [B, w] used
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._set = 0
        self.graphs: dict[tuple[int, int], _Graph] = {}                    # (batch, capacity)
        self.pool = None
        self.replay_s = 0.0                                                 # host seconds inside replay()

    # ---- capture --------------------------------------------------------------------------------
    def _batch(self, B: int, cap: int) -> ForwardBatch:
        """The ForwardBatch of (bucket B, capacity cap) over views of the static buffers."""
        dev = self.device
        rows = torch.arange(B, device=dev)
        # the MLA layer runs the indexer iff max_context_len > index_topk: the capacity decides it
        group = AttnGroup(token_index=rows, q_index=rows[:, None], q_valid=torch.ones(B, 1, dtype=torch.bool, device=dev),
                          packed=rows,
                          block_table=self.block_table[:B, :cap // self.block_size], context_lens=self.context_lens[:B],
                          query_lens=torch.ones(B, dtype=torch.int32, device=dev), block_size=self.block_size,
                          max_context_len=cap, mla_mode="absorbed", state_slots=self.state_slots[:B],
                          state_fresh=self.state_fresh[:B], kv_capacity=cap, row_span=(0, B))
        return ForwardBatch(positions=self.positions[:B], slot_mapping=self.slot_mapping[:B], groups=(group,),
                            max_context_len=cap)

    def _forward(self, B: int, batch: ForwardBatch) -> torch.Tensor:
        return self.model(self.ids[:B], batch, self.kv_caches, self.index_caches, self.state_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, variant), largest first into one pool. Padding values everywhere, so
        the warm-up forward of each capture writes only the scratch block / state row."""
        t0 = time.perf_counter()
        self._fill_padding(0, self.buckets[-1])
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for B in reversed(self.buckets):
            for cap in reversed(self.capacities):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._forward(B, self._batch(B, cap))                   # warm-up: autotune, self-checks, NCCL
                torch.cuda.current_stream(self.device).wait_stream(stream)
                torch.cuda.synchronize(self.device)
                # a fresh batch: what a group derives lazily (the padded views) must be computed inside
                # the graph from the static buffers, not reused from the warm-up's padding values
                batch = self._batch(B, cap)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    hidden = self._forward(B, batch)
                self.graphs[(B, cap)] = _Graph(g, hidden, batch)
        torch.cuda.synchronize(self.device)
        used = torch.cuda.memory_allocated(self.device) - before
        logger.info("CUDA graphs: %d decode graphs (batch %s x context capacity %s) captured in %.1f s, %.0f MiB",
                    len(self.graphs), self.buckets, self.capacities, time.perf_counter() - t0, used / 2**20)

    # ---- replay ---------------------------------------------------------------------------------
    @staticmethod
    def _smallest(sizes: list[int], n: int) -> int | None:
        return next((b for b in sizes if b >= n), None)

    def fits(self, num_seqs: int, max_context_len: int) -> bool:
        return (self._smallest(self.buckets, num_seqs) is not None
                and self._smallest(self.capacities, max_context_len) is not None)

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[np.ndarray],
            state_slots: list[int], patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Stage one decode step of B = len(token_ids) sequences and replay its graph -> hidden [B, D]
        (a view of the graph's output buffer: valid until the next replay). block_tables: int32 arrays.
        patch: (rows, ids) on the device written over the staged token ids (tokens the previous step is
        still sampling, async scheduling)."""
        B = len(token_ids)
        Bp = self._smallest(self.buckets, B)
        cap = self._smallest(self.capacities, max(positions) + 1)
        self._stage(token_ids, positions, slots, block_tables, state_slots, Bp)
        if patch is not None:
            self.ids[patch[0]] = patch[1]
        g = self.graphs.get((Bp, cap))
        if g is None:                    # not captured (the CPU tests): the same static-buffer forward, eagerly
            return self._forward(Bp, self._batch(Bp, cap))[:B]
        t0 = time.perf_counter()
        g.graph.replay()                                                    # host: cudaGraphLaunch
        self.replay_s += time.perf_counter() - t0
        return g.hidden[:B]

    def _stage(self, token_ids, positions, slots, block_tables, state_slots, Bp: int) -> None:
        """Copy one step's values into the static buffers (pinned host staging, async H2D copies)."""
        B = len(token_ids)
        k = self._set = 1 - self._set                                       # the other staging set
        if self._copied[k] is not None and not self._copied[k].query():
            self._copied[k].synchronize()      # its copies (two steps ago) still running: rare, async only
        h, hc = self._h_rows[k], self._h_ctx[k]
        rows = h.numpy()                                                    # same memory
        rows[0, :B], rows[1, :B], rows[2, :B], rows[3, :B] = token_ids, positions, slots, state_slots
        ctx = hc.numpy()
        ctx[:B] = positions
        ctx[:B] += 1
        # only the columns in use: entries past a sequence's blocks are never read (kernels stop at
        # context_lens; the references mask past it)
        # staged compactly as [B, w] (contiguous: a strided pinned source would go through a pageable
        # copy, which waits for the GPU)
        w = max(len(t) for t in block_tables)
        hb = self._h_bt[k][:B * w].view(B, w)
        bt = hb.numpy()                                                     # same memory
        for i, t in enumerate(block_tables):                                # per sequence, not per token
            bt[i, :len(t)] = t
        # three copies, each from pinned memory in the destination's dtype (a converting copy would go
        # through a pageable temporary). The four int64 rows go whole: their columns past B carry an
        # older step's values, of which B..Bp are overwritten by the padding below and the rest are never
        # read by the bucket-Bp graph
        self._rows.copy_(h, non_blocking=True)
        self.context_lens[:B].copy_(hc[:B], non_blocking=True)
        self.block_table[:B, :w].copy_(hb, non_blocking=True)
        if self.device.type == "cuda":
            self._copied[k] = torch.cuda.Event()
            self._copied[k].record()
        self.state_fresh[:Bp].zero_()                                       # a decode never starts at 0
        if Bp > B:
            self._fill_padding(B, Bp)

    def _fill_padding(self, b0: int, b1: int) -> None:
        """Rows [b0, b1): decode position 0 of the scratch block into the scratch state row."""
        p = self._pad
        self.ids[b0:b1].zero_()
        self.positions[b0:b1].zero_()
        self.slot_mapping[b0:b1].fill_(p["slot"])
        self.context_lens[b0:b1].fill_(1)
        self.block_table[b0:b1].fill_(p["block"])
        self.state_slots[b0:b1].fill_(p["state"])
