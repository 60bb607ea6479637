"""Triton absorbed MLA over RUNS of one-query rows of one sequence (this module imports triton): a prefix-cache
hit's or a later prompt chunk's tail absorbed into the decode group (forward_batch._attention_units) is a run of
consecutive rows whose contexts grow by one, over the same block table. `mla_decode_paged` gives each row its own
program, so a 128-token tail reads its ~2k cached keys 128 times (and at h = 32 its [32, 576] query tiles leave
half of a Hopper MMA tile empty). Here one program owns ROWS rows of a run x all heads — a [ROWS * BLOCK_H, 576]
query tile, M = 64 at h = 32 — and every key tile it loads serves all of them. Contract and math: `mla_decode`
in kernels/torch_ref/attention.py (each row attends to its own causal context, or its own DSA picks).

* `_mla_rows_kernel` — grid (B, num_splits). Program b owns the tile that STARTS at row b (b - run_first[b] a
  multiple of ROWS; other programs exit at once): rows b .. b + nrows - 1 (nrows <= ROWS, the rest of the run).
  Key walks, under the online softmax of `mla_decode` (fp32, base 2), split-K over `num_splits`:
  - dense (no DSA indices): positions 0 .. the tile's longest context, each row masked to its own context;
  - DSA, a multi-row tile whose longest context is <= WALK * K: the same dense walk, each row masked by its
    picks' bitmap (bits [B, words] int32, bit p % 32 of word p // 32; built from the indices by
    `_index_bits_kernel`). A tail over a prefix of about K keys picks nearly all of them, so the dense walk
    costs ~ what the picks do and is read once for ROWS rows;
  - DSA otherwise (a single row, or a long context): each row's index list in turn, the tile's other rows
    masked (their softmax state passes through unchanged) — the `mla_decode_paged` walk, at up to 2x its MMAs.
  Splits write normalised fp32 partials and base-2 log-sum-exps that `mla_decode._mla_merge_kernel` combines;
  with one split the program writes the output.
* `_index_bits_kernel` — grid (B,): OR each row's selected positions into its zeroed bitmap row.

Not CUDA-graph captured: runs only come with mixed (eager) steps; CUDA-graph decode batches have no runs and keep
`mla_decode_paged`. No host sync: the grid, splits and bitmap width come from host ints of the group. Under
`TRITON_INTERPRET=1` (CPU tests) dot operands are upcast to fp32 as in mla_decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.mla_decode import (
    INTERPRET,
    LOG2E,
    MAX_SPLITS,
    MERGE_R,
    NUM_SMS,
    _config,
    _latent_step,
    _mla_merge_kernel,
)

WALK = 2                  # a multi-row DSA tile walks its context densely while it is <= WALK * K keys
BITS_BLOCK = 1024         # indices per step of the bitmap kernel


def rows_per_tile(h: int, D: int) -> int:
    """ROWS: the run rows one program holds — enough to fill a 64-row query tile (1 at h >= 64: the decode
    kernel's own 64-head tile is full already; 2 at h = 32, 4 at h = 16)."""
    block_h = _config(h, D)[0]
    return max(1, 64 // block_h)


def num_tiles(run_lens: tuple[int, ...], rows: int) -> int:
    """Programs with work: each run of L rows in ceil(L / rows) tiles (host ints)."""
    return sum(-(-n // rows) for n in run_lens)


@triton.jit
def _index_bits_kernel(idx_ptr, bits_ptr, K, WORDS, stride_ib, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    src = idx_ptr + b.to(tl.int64) * stride_ib
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        pos = tl.load(src + j, mask=j < K, other=-1)
        ok = (pos >= 0) & (pos < WORDS * 32)
        pos = tl.where(ok, pos, 0)
        tl.atomic_or(bits_ptr + b.to(tl.int64) * WORDS + pos // 32, (1 << (pos % 32)).to(tl.int32), mask=ok,
                     sem="relaxed")


@triton.jit(do_not_specialize=["NUM_SPLITS", "B", "WORDS"])
def _mla_rows_kernel(q_ptr, kv_ptr, bt_ptr, cl_ptr, rf_ptr, idx_ptr, bits_ptr, o_ptr, lse_ptr,
                     B, H, K_IDX, WORDS, qk_scale,
                     stride_qb, stride_qh, stride_kv, stride_btb, stride_idxb,
                     stride_ob, stride_oh, stride_os,
                     R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, NUM_SPLITS, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr,
                     WALK: tl.constexpr):
    b0 = tl.program_id(0)
    split = tl.program_id(1)
    first = tl.load(rf_ptr + b0)
    if (b0 - first) % ROWS == 0:                                              # a tile starts here
        m = tl.arange(0, ROWS * BLOCK_H)                                      # [M] query rows of the tile
        j = m // BLOCK_H                                                      # [M] its row in the tile
        heads = m % BLOCK_H                                                   # [M]
        row = b0 + j                                                          # [M] its row in the group
        in_run = (j < ROWS) & (row < B)
        in_run = in_run & (tl.load(rf_ptr + row, mask=in_run, other=-1) == first)
        live = in_run & (heads < H)                                           # [M]
        ctx = tl.load(cl_ptr + row, mask=in_run, other=0)                     # [M] each row's context
        ctx_max = tl.max(ctx, 0)
        nrows = tl.max(tl.where(in_run, j + 1, 0), 0)
        dn = tl.arange(0, BLOCK_R)
        dp = tl.arange(0, BLOCK_DR)
        dn_ok = dn < R
        dp_ok = dp < DR
        q_rows = q_ptr + row.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh    # [M, 1]
        q_nope = tl.load(q_rows + dn[None, :], mask=live[:, None] & dn_ok[None, :], other=0.0)  # [M, BR]
        q_pe = tl.load(q_rows + R + dp[None, :], mask=live[:, None] & dp_ok[None, :], other=0.0)  # [M, BDR]
        if INTERP:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
        m_i = tl.full([ROWS * BLOCK_H], -1.0e30, tl.float32)                 # finite: an all-masked tile adds 0
        l_i = tl.zeros([ROWS * BLOCK_H], tl.float32)
        acc = tl.zeros([ROWS * BLOCK_H, BLOCK_R], tl.float32)
        bt_row = bt_ptr + b0.to(tl.int64) * stride_btb                        # a run shares its block table
        offs0 = tl.arange(0, BLOCK_N)
        dense_walk = True
        if SPARSE:
            dense_walk = (nrows > 1) & (ctx_max <= WALK * K_IDX)
        if dense_walk:
            per = tl.cdiv(tl.cdiv(ctx_max, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = split * per
            end = tl.minimum(start + per, ctx_max)
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + offs0                                              # [BN]
                kvalid = pos < end
                rmask = live[:, None] & (pos[None, :] < ctx[:, None])         # [M, BN] causal per row
                if SPARSE:
                    word = tl.load(bits_ptr + row.to(tl.int64)[:, None] * WORDS + (pos // 32)[None, :],
                                   mask=rmask, other=0)                        # [M, BN]
                    rmask = rmask & (((word >> (pos % 32)[None, :]) & 1) != 0)
                m_i, l_i, acc = _latent_step(pos, kvalid, rmask, q_nope, q_pe, m_i, l_i, acc, kv_ptr, bt_row,
                                           qk_scale, stride_kv, dn, dp, dn_ok, dp_ok, R, BLOCK_SIZE, INTERP)
        else:                                                                 # each row's picks in turn
            per = tl.cdiv(tl.cdiv(K_IDX, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = split * per
            end = tl.minimum(start + per, K_IDX)
            for jj in range(0, nrows):
                idx_row = idx_ptr + (b0 + jj).to(tl.int64) * stride_idxb
                ctx_j = tl.load(cl_ptr + b0 + jj)
                for n0 in range(start, end, BLOCK_N):
                    offs = n0 + offs0
                    pos = tl.load(idx_row + offs, mask=offs < end, other=-1).to(tl.int32)   # [BN]
                    kvalid = (pos >= 0) & (pos < ctx_j)
                    rmask = (live & (j == jj))[:, None] & kvalid[None, :]     # [M, BN] row jj only
                    m_i, l_i, acc = _latent_step(pos, kvalid, rmask, q_nope, q_pe, m_i, l_i, acc, kv_ptr, bt_row,
                                               qk_scale, stride_kv, dn, dp, dn_ok, dp_ok, R, BLOCK_SIZE, INTERP)
        nonempty = l_i > 0.0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]                       # [M, BR]
        o_ptrs = o_ptr + row.to(tl.int64)[:, None] * stride_ob + heads[:, None] * stride_oh + dn[None, :]
        if DIRECT:
            tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=live[:, None] & dn_ok[None, :])
        else:
            tl.store(o_ptrs + split * stride_os, o, mask=(live & nonempty)[:, None] & dn_ok[None, :])
            lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + (row * H + heads) * NUM_SPLITS + split, lse, mask=live)


def index_bits(indices: torch.Tensor, words: int) -> torch.Tensor:
    """DSA indices [B, K] int32 (-1 = none) -> bitmap [B, words] int32 of each row's picks (positions >= words *
    32 dropped)."""
    B, K = indices.shape
    bits = torch.zeros(B, words, dtype=torch.int32, device=indices.device)    # [B, W]
    if B and K:
        _index_bits_kernel[(B,)](indices, bits, K, words, indices.stride(0), BLOCK_K=min(BITS_BLOCK,
                                                                                       triton.next_power_of_2(K)))
    return bits


def mla_decode_runs(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                    block_size: int, run_first: torch.Tensor, run_lens: tuple[int, ...], max_context_len: int, *,
                    kv_lora_rank: int, scale: float, indices: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """`mla_decode_paged`'s contract (q [B, h, D], kv_cache [S, D], block_table [B, nb], context_lens [B],
    indices [B, K] or None -> o_lat [B, h, r]) for a group whose rows come in runs: run_first [B] int32, the first
    row of each row's run (rows of a run are consecutive, share their block table and grow by one context
    position each; a row alone is its own run), run_lens the runs' lengths in row order (host), max_context_len
    the group's longest context (host: the bitmap's width)."""
    B, h, D = q.shape
    r = kv_lora_rank
    dr = D - r
    assert kv_cache.dim() == 2 and kv_cache.shape[1] == D and kv_cache.dtype == q.dtype, (q.shape, kv_cache.shape)
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and 0 < r and 0 < dr
    assert run_first.shape == (B,) and sum(run_lens) == B, (run_first.shape, sum(run_lens), B)
    out = torch.empty(B, h, r, dtype=q.dtype, device=q.device)                # [B, h, r]
    if B == 0 or h == 0:
        return out
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens = context_lens.contiguous()
    run_first = run_first.to(torch.int32).contiguous()
    block_h = _config(h, D)[0]
    rows = rows_per_tile(h, D)
    # the decode kernel's tile for ROWS * BLOCK_H heads: its [M, r] fp32 accumulator fits the same registers
    _, block_n, num_warps, num_stages = _config(rows * block_h, D)[:4]
    sparse = indices is not None
    if sparse:
        indices = indices if indices.stride(-1) == 1 else indices.contiguous()
        K = indices.shape[1]
        if K == 0:
            return out.zero_()
        words = triton.cdiv(max_context_len, 32)
        bits = index_bits(indices, words)                                     # [B, W]
        idx_arg, stride_idx, key_range = indices, indices.stride(0), min(max_context_len, WALK * K)
    else:
        K, words, bits = 0, 1, context_lens                                   # unused pointer
        idx_arg, stride_idx, key_range = context_lens, 0, max_context_len
    tiles = num_tiles(run_lens, rows)
    if num_splits is None:
        min_keys = 64 if h <= 32 else 4 * h
        num_splits = max(1, min(NUM_SMS // max(tiles, 1), key_range // min_keys, MAX_SPLITS))
    splits = int(num_splits)
    consts = dict(R=r, DR=dr, BLOCK_R=triton.next_power_of_2(r), BLOCK_DR=triton.next_power_of_2(dr),
                  BLOCK_SIZE=block_size, NUM_SPLITS=splits, ROWS=rows, BLOCK_H=block_h, BLOCK_N=block_n,
                  SPARSE=sparse, WALK=WALK, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    args = (h, K, words, float(scale) * LOG2E, q.stride(0), q.stride(1), kv_cache.stride(0), block_table.stride(0),
            stride_idx)
    if splits == 1:
        _mla_rows_kernel[(B, 1)](q, kv_cache, block_table, context_lens, run_first, idx_arg, bits, out, out, B,
                                 *args, out.stride(0), out.stride(1), 0, DIRECT=True, **consts)
        return out
    part = torch.empty(B, h, splits, r, dtype=torch.float32, device=q.device)   # [B, h, splits, r]
    lse = torch.empty(B, h, splits, dtype=torch.float32, device=q.device)       # [B, h, splits] (base 2)
    _mla_rows_kernel[(B, splits)](q, kv_cache, block_table, context_lens, run_first, idx_arg, bits, part, lse, B,
                                  *args, part.stride(0), part.stride(1), part.stride(2), DIRECT=False, **consts)
    merge_r = min(MERGE_R, triton.next_power_of_2(r))
    splits_p2 = triton.next_power_of_2(splits)
    _mla_merge_kernel[(B * h, triton.cdiv(r, merge_r))](part, lse, out, h, out.stride(0), out.stride(1),
                                                        R=r, NUM_SPLITS=splits, SPLITS_P2=splits_p2,
                                                        CHUNK=min(splits_p2, 16), BLOCK_R=merge_r, num_warps=4)
    return out


__all__ = ["index_bits", "mla_decode_runs", "num_tiles", "rows_per_tile"]
