"""Token -> expert alignment of the grouped MoE kernels in Triton: one launch at decode sizes, three at
prefill sizes; both give a `MoEAlign` identical element for element to `layout.moe_align`.

`layout.moe_align` (the reference, and the path for E > `MAX_EXPERTS`) builds the same `MoEAlign` from
~17 torch device ops — scatter_add counts, two cumsums, a stable radix argsort, gathers, index_put,
searchsorted. Inside a decode CUDA graph each of those is a launch of a few microseconds, and the radix
sort alone measured 6.5 us (batch 1) to 27 us (batch 64) per layer on the H200 (~47 us at 2048 tokens x
4 experts/token): more than the expert GEMMs' own time at batch 1.

`moe_align_triton` — one program for P = T * K <= `MAX_PAIRS` pairs (`moe_align_auto` uses it up to
`ONE_LAUNCH_PAIRS`):

1. counts[E] = histogram of the expert ids (one-hot [SUB, E] tiles summed over rows);
2. padded = round_up(counts, BM); pstart = exclusive cumsum; cum_blocks = inclusive cumsum / BM;
3. sorted_ids[:] = P (padding), expert_ids[b] = #experts whose cum_blocks <= b (searchsorted right,
   clamped to E - 1), num_post_pad = sum(padded);
4. (after a block barrier, so the padding fill is ordered before the scatter) every pair's slot =
   pstart[e] + (pairs of expert e before it): the running per-expert count plus the inclusive cumsum of
   the one-hot tile — stable, so the result equals `layout.moe_align` element for element.

Its chunks run serially in one CTA (O(P * E) work): microseconds at decode sizes only.

`moe_align_chunked` — a stable counting sort over chunks of CHUNK pairs, for any P (prefill):

(1) `_chunk_hist_kernel`, one program per chunk: rank[i] = pairs of the same expert before i in the chunk
    and, at each expert's first pair, its count in the chunk (a [SUB, CHUNK] equality tile: O(CHUNK^2),
    not O(E)) -> row c of the [n_chunks, E] count table; and a slice of the padding fill sorted_ids = P;
(2) `_chunk_scan_kernel`, one program per `_SCAN_E` experts: each table column becomes its exclusive
    cumsum over chunks (pairs of e in earlier chunks); totals[e] = the column sum;
(3) `_chunk_scatter_kernel`, one program per chunk: steps 2-3 above from totals (each program its slice
    of expert_ids; program 0 num_post_pad), table row c += pstart, then slot = table[c, e] + rank[i].

The launch order puts the fill before the scatter. No host sync; grids from shapes; constexprs from E,
BM and the chunk size only (per-step sizes are `do_not_specialize` runtime arguments): CUDA-graph
capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import MoEAlign, cdiv, moe_align, moe_max_blocks

MAX_PAIRS = 4096            # moe_align_triton's limit (the one-CTA chunk loop grows with P)
# moe_align_auto: one launch up to here, three above. Estimated from two H200 points, not swept: the one-CTA
# kernel took 83 us a layer at 4096 pairs (glm5-flash-31b 1 x 1024 step), the chunked path 10.5 us at 8192
# pairs (three launches of a few us each); the crossover is near a few hundred pairs.
ONE_LAUNCH_PAIRS = 512
MAX_EXPERTS = 1024
_TILE = 8192                # elements of a register tile (one-hot SUB x E_P2, equality SUB x CHUNK, scan)
CHUNK = 64                  # pairs per program of moe_align_chunked (H200: 64 <= 128 < 256)
_FILL = 1024                # padding-fill store width
_SCAN_E = 8                 # experts per program of the chunk scan (H200: 4-8 < 16 < 32 at P = 64k)


def _sub_rows(e_p2: int) -> int:
    return max(16, min(256, _TILE // e_p2))


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


@triton.jit(do_not_specialize=['P', 'max_rows', 'fill_per'])
def _chunk_hist_kernel(ids_ptr, table_ptr, rank_ptr, sorted_ptr, P, E, max_rows, fill_per,
                       E_P2: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, FILL: tl.constexpr):
    c = tl.program_id(0)
    e_off = tl.arange(0, E_P2)                                               # [E_P2]
    cols = tl.arange(0, CHUNK)                                               # [CHUNK]
    rows = tl.arange(0, SUB)                                                 # [SUB]
    tl.store(table_ptr + c * E + e_off, tl.zeros([E_P2], dtype=tl.int32), mask=e_off < E)
    tl.debug_barrier()                                                       # zero row before the counts
    ids_all = tl.load(ids_ptr + c * CHUNK + cols, mask=c * CHUNK + cols < P, other=-1)   # [CHUNK]
    for r0 in tl.static_range(0, CHUNK, SUB):
        offs = c * CHUNK + r0 + rows                                         # [SUB]
        ok = offs < P
        ids = tl.load(ids_ptr + offs, mask=ok, other=-2)
        eq = ids[:, None] == ids_all[None, :]                                # [SUB, CHUNK]
        before = cols[None, :] < (r0 + rows)[:, None]
        rank = tl.sum((eq & before).to(tl.int32), axis=1)                    # [SUB] same expert, earlier
        cnt = tl.sum(eq.to(tl.int32), axis=1)                                # [SUB] same expert, in chunk
        tl.store(rank_ptr + offs, rank, mask=ok)
        tl.store(table_ptr + c * E + ids, cnt, mask=ok & (rank == 0))        # first of its expert: the count
    f = tl.arange(0, FILL)                                                   # [FILL]
    pad = tl.zeros([FILL], dtype=tl.int32) + P
    for f0 in range(0, fill_per, FILL):
        rows_f = c * fill_per + f0 + f                                       # [FILL] sorted_ids rows
        tl.store(sorted_ptr + rows_f, pad, mask=(f0 + f < fill_per) & (rows_f < max_rows))


@triton.jit(do_not_specialize=['n_chunks'])
def _chunk_scan_kernel(table_ptr, totals_ptr, n_chunks, E, E_T: tl.constexpr, C_T: tl.constexpr):
    e_off = tl.program_id(0) * E_T + tl.arange(0, E_T)                      # [E_T] this program's experts
    c_off = tl.arange(0, C_T)                                                # [C_T]
    carry = tl.zeros([E_T], dtype=tl.int32)                                  # pairs of e in chunks < c0
    for c0 in range(0, n_chunks, C_T):
        cs = c0 + c_off
        m = (cs[:, None] < n_chunks) & (e_off[None, :] < E)
        ptrs = table_ptr + cs[:, None] * E + e_off[None, :]
        cnt = tl.load(ptrs, mask=m, other=0)                                 # [C_T, E_T]
        tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + carry[None, :], mask=m)
        carry += tl.sum(cnt, axis=0)
    tl.store(totals_ptr + e_off, carry, mask=e_off < E)                      # [E] counts


@triton.jit(do_not_specialize=['P', 'max_blocks', 'blk_per'])
def _chunk_scatter_kernel(ids_ptr, rank_ptr, table_ptr, totals_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
                          P, E, max_blocks, blk_per, BLOCK_M: tl.constexpr, E_P2: tl.constexpr,
                          CHUNK: tl.constexpr, SUB: tl.constexpr, BSUB: tl.constexpr):
    c = tl.program_id(0)
    e_off = tl.arange(0, E_P2)                                               # [E_P2]
    rows = tl.arange(0, SUB)                                                 # [SUB]
    brows = tl.arange(0, BSUB)                                               # [BSUB]
    e_ok = e_off < E
    counts = tl.load(totals_ptr + e_off, mask=e_ok, other=0)                 # [E_P2]
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, axis=0)
    cum_blocks = tl.where(e_ok, pend // BLOCK_M, 2147483647)                 # [E_P2] (never <= b past E)
    tl.store(npost_ptr, tl.sum(padded, axis=0), mask=c == 0)
    # block -> expert for blocks [c * blk_per, (c + 1) * blk_per)
    for b0 in range(0, blk_per, BSUB):
        blk = c * blk_per + b0 + brows                                       # [BSUB]
        le = (cum_blocks[None, :] <= blk[:, None]).to(tl.int32)              # [BSUB, E_P2]
        eid = tl.minimum(tl.sum(le, axis=1), E - 1)
        tl.store(expert_ids_ptr + blk, eid, mask=(b0 + brows < blk_per) & (blk < max_blocks))
    # table row c += pstart: the first slot of expert e's pairs of this chunk
    row = table_ptr + c * E + e_off
    tl.store(row, tl.load(row, mask=e_ok, other=0) + pend - padded, mask=e_ok)
    tl.debug_barrier()                                                       # row before its gathers
    for r0 in tl.static_range(0, CHUNK, SUB):
        offs = c * CHUNK + r0 + rows                                         # [SUB]
        ok = offs < P
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        dest = tl.load(table_ptr + c * E + ids, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
        tl.store(sorted_ptr + dest, offs, mask=ok)


def _flat_i32(topk_ids: torch.Tensor) -> torch.Tensor:
    flat = topk_ids.reshape(-1)                                              # [P]
    return flat if flat.dtype == torch.int32 and flat.is_contiguous() else flat.to(torch.int32).contiguous()


def _outputs(p: int, num_experts: int, block_m: int, dev):
    max_blocks = moe_max_blocks(p, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)   # [max_blocks * BM]
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)             # [max_blocks]
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)                    # [1]
    return max_blocks, sorted_ids, expert_ids, num_post_pad


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlign:
    """`layout.moe_align` in one launch: topk_ids [T, K] int (values in [0, E)), T*K <= MAX_PAIRS,
    E <= MAX_EXPERTS -> the identical MoEAlign (sorted_ids, expert_ids, num_post_pad, max_blocks)."""
    flat = _flat_i32(topk_ids)
    p = flat.numel()
    assert p <= MAX_PAIRS and num_experts <= MAX_EXPERTS, (p, num_experts)
    max_blocks, sorted_ids, expert_ids, num_post_pad = _outputs(p, num_experts, block_m, flat.device)
    e_p2 = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post_pad, p, num_experts, max_blocks * block_m,
                            max_blocks, BLOCK_M=block_m, E_P2=e_p2, CHUNK=_sub_rows(e_p2), num_warps=4)
    return MoEAlign(sorted_ids, expert_ids, num_post_pad, max_blocks, block_m)


def moe_align_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = CHUNK) -> MoEAlign:
    """`layout.moe_align` in three launches (histogram / scan / scatter over chunks of `chunk` pairs, a
    power of two): topk_ids [T, K] int (values in [0, E)), P = T*K >= 1, E <= MAX_EXPERTS -> the identical
    MoEAlign."""
    flat = _flat_i32(topk_ids)
    p = flat.numel()
    assert 0 < p and num_experts <= MAX_EXPERTS and chunk >= 16 and chunk & (chunk - 1) == 0, (p, num_experts, chunk)
    max_blocks, sorted_ids, expert_ids, num_post_pad = _outputs(p, num_experts, block_m, flat.device)
    assert max_blocks * block_m < 2 ** 31, (p, num_experts, block_m)
    dev, e, e_p2 = flat.device, num_experts, triton.next_power_of_2(num_experts)
    n_chunks, max_rows, sub = cdiv(p, chunk), max_blocks * block_m, max(1, min(chunk, _TILE // chunk))
    table = torch.empty(n_chunks, e, dtype=torch.int32, device=dev)         # [n_chunks, E] counts -> offsets
    rank = torch.empty(p, dtype=torch.int32, device=dev)                    # [P] rank within chunk and expert
    totals = torch.empty(e, dtype=torch.int32, device=dev)                  # [E] pairs per expert
    _chunk_hist_kernel[(n_chunks,)](flat, table, rank, sorted_ids, p, e, max_rows, cdiv(max_rows, n_chunks),
                                    E_P2=e_p2, CHUNK=chunk, SUB=sub, FILL=_FILL, num_warps=4)
    _chunk_scan_kernel[(cdiv(e, _SCAN_E),)](table, totals, n_chunks, e, E_T=_SCAN_E, C_T=_TILE // _SCAN_E,
                                            num_warps=4)
    _chunk_scatter_kernel[(n_chunks,)](flat, rank, table, totals, sorted_ids, expert_ids, num_post_pad, p, e,
                                       max_blocks, cdiv(max_blocks, n_chunks), BLOCK_M=block_m, E_P2=e_p2,
                                       CHUNK=chunk, SUB=sub, BSUB=_sub_rows(e_p2), num_warps=4)
    return MoEAlign(sorted_ids, expert_ids, num_post_pad, max_blocks, block_m)


def moe_align_auto(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlign:
    """One launch up to ONE_LAUNCH_PAIRS pairs, three above; the torch ops for E > MAX_EXPERTS or no pairs."""
    p = topk_ids.numel()
    if p == 0 or num_experts > MAX_EXPERTS:
        return moe_align(topk_ids, num_experts, block_m)
    if p <= ONE_LAUNCH_PAIRS:
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_chunked(topk_ids, num_experts, block_m)
