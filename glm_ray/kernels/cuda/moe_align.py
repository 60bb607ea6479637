"""Token -> expert alignment of the grouped MoE kernels in one Triton launch (decode-size calls).

`layout.moe_align` (the reference, and the path for large pair counts) builds the same `MoEAlign` from
~17 torch device ops — scatter_add counts, two cumsums, a stable radix argsort, gathers, index_put,
searchsorted. Inside a decode CUDA graph each of those is a launch of a few microseconds, and the radix
sort alone measured 6.5 us (batch 1) to 27 us (batch 64) per layer on the H200: more than the expert
GEMMs' own time at batch 1. Here one program does it all for P <= `MAX_PAIRS` pairs:

1. counts[E] = histogram of the expert ids (one-hot [CHUNK, E] tiles summed over rows);
2. padded = round_up(counts, BM); pstart = exclusive cumsum; cum_blocks = inclusive cumsum / BM;
3. sorted_ids[:] = P (padding), expert_ids[b] = #experts whose cum_blocks <= b (searchsorted right,
   clamped to E - 1), num_post_pad = sum(padded);
4. (after a block barrier, so the padding fill is ordered before the scatter) every pair's slot =
   pstart[e] + (pairs of expert e before it): the running per-expert count plus the inclusive cumsum of
   the one-hot tile — stable, so the result equals `layout.moe_align` element for element.

Chunks run serially in one CTA: O(P * E / CHUNK) work, microseconds for decode (P = T * K <= a few
hundred); larger calls keep the torch path. No host sync, shapes-only grid: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import MoEAlign, moe_align, moe_max_blocks

MAX_PAIRS = 4096            # above: layout.moe_align (the serial chunk loop would grow with P)
MAX_EXPERTS = 1024
_TILE = 8192                # one-hot tile elements (CHUNK * E_P2): registers of one CTA


@triton.jit(do_not_specialize=['P', 'max_rows', 'max_blocks'])   # sizes that change per step: no recompiles (cuda/__init__)
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, npost_ptr, P, E, max_rows, max_blocks,
                      BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    e_off = tl.arange(0, E_P2)                                               # [E_P2]
    rows = tl.arange(0, CHUNK)                                               # [CHUNK]
    # 1. per-expert counts
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + rows
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)               # [CHUNK]
        counts += tl.sum((ids[:, None] == e_off[None, :]).to(tl.int32), axis=0)
    # 2. padded runs and their starts
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M                   # [E_P2] (0 past E)
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    cum_blocks = pend // BLOCK_M                                             # [E_P2]
    # 3. padding fill, block -> expert, used rows
    pad = tl.zeros([CHUNK], dtype=tl.int32) + P
    for r0 in range(0, max_rows, CHUNK):
        offs = r0 + rows
        tl.store(sorted_ptr + offs, pad, mask=offs < max_rows)
    for b0 in range(0, max_blocks, CHUNK):
        blk = b0 + rows                                                      # [CHUNK]
        le = (cum_blocks[None, :] <= blk[:, None]) & (e_off[None, :] < E)    # [CHUNK, E_P2]
        eid = tl.minimum(tl.sum(le.to(tl.int32), axis=1), E - 1)
        tl.store(expert_ids_ptr + blk, eid, mask=blk < max_blocks)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    tl.debug_barrier()                                                       # fill before scatter
    # 4. stable rank within the expert -> destination slot
    seen = tl.zeros([E_P2], dtype=tl.int32)                                  # pairs placed per expert
    for c0 in range(0, P, CHUNK):
        offs = c0 + rows
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        onehot = (ids[:, None] == e_off[None, :]).to(tl.int32)               # [CHUNK, E_P2]
        incl = tl.cumsum(onehot, axis=0)                                     # inclusive rank in the chunk
        dest = tl.sum(onehot * (incl - 1 + seen[None, :] + pstart[None, :]), axis=1)   # [CHUNK]
        tl.store(sorted_ptr + dest, offs, mask=offs < P)
        seen += tl.sum(onehot, axis=0)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlign:
    """`layout.moe_align` in one launch: topk_ids [T, K] int (values in [0, E)), T*K <= MAX_PAIRS,
    E <= MAX_EXPERTS -> the identical MoEAlign (sorted_ids, expert_ids, num_post_pad, max_blocks)."""
    flat = topk_ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 and flat.is_contiguous() else flat.to(torch.int32).contiguous()
    p = flat.numel()
    assert p <= MAX_PAIRS and num_experts <= MAX_EXPERTS, (p, num_experts)
    max_blocks = moe_max_blocks(p, num_experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)   # [max_blocks * BM]
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)             # [max_blocks]
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, _TILE // e_p2))
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post_pad, p, num_experts, max_blocks * block_m,
                            max_blocks, BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    return MoEAlign(sorted_ids, expert_ids, num_post_pad, max_blocks, block_m)


def moe_align_auto(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlign:
    """The one-launch kernel where it applies (P <= MAX_PAIRS, E <= MAX_EXPERTS), else the torch ops."""
    if 0 < topk_ids.numel() <= MAX_PAIRS and num_experts <= MAX_EXPERTS:
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align(topk_ids, num_experts, block_m)
