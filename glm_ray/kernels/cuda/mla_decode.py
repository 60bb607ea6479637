"""Triton paged MLA decode (absorbed form) of the `cuda` backend, dense and DSA-sparse (this module
imports triton). Contract and math: `mla_decode` in kernels/torch_ref/attention.py; the public entry
is `mla_decode_paged` (the backend's `mla_decode` op adapts a group to it).

Absorbed MLA decode is MQA with one shared latent KV head: per sequence, h query heads of dim
D = r + dr attend to the cache rows [c (r) | k_pe (dr)] of its context (key = the whole row, value =
c), so every cache row is read ONCE for all heads of the token:

* `_mla_split_kernel` — grid (ceil(h / BLOCK_H), num_splits, B). One program owns BLOCK_H heads of one
  sequence (a [BLOCK_H, D] query tile; padded heads are masked) and one split of its key range
  (flash-decoding split-K, so B=1 still fills the GPU). It walks its keys in BLOCK_N tiles: the tile's
  cache slots come from the block table (dense: positions start..end-1; sparse: the tile's DSA indices,
  -1 masked), the [BLOCK_N, r] latent and [BLOCK_N, dr] rope parts are loaded once and serve as K
  (two dots: nope + rope) and V (the latent part again, no second load), under an online softmax in
  fp32 (base-2: log2(e) is folded into the scale). The split writes its normalised fp32 partial
  output [BLOCK_H, r] and its log-sum-exp; a split with no key (beyond the sequence's length, or all
  -1) writes lse = -inf only. With one split the program writes the final output directly.
* `_mla_merge_kernel` — grid (B * h, r / MERGE_R): the log-sum-exp weighted sum of the splits
  (splits with lse = -inf weigh 0 and are not read).

CUDA graphs: the grid, num_splits and every constexpr derive from SHAPES only (B, h, D, nb *
block_size or K); context lengths, block tables and indices are read on the device, so a captured
launch stays right when their values change. A dense split covers ceil(ctx / num_splits) keys of its
own sequence rounded up to BLOCK_N (short sequences do not leave most splits idle); sparse splits
cover fixed K / num_splits index ranges. num_splits is a runtime argument, not a constexpr: outside graphs
(the decode rows of a mixed step) it changes with B and the block-table width, and as a constexpr every
new value compiled both kernels again inside a step.

Under `TRITON_INTERPRET=1` (CPU tests) dot operands are upcast to fp32 (the interpreter's bf16 dot is
garbage, numpy has no bf16); the test-only oracle `mla_decode_reference` is plain torch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import DEFAULT_SMS

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NUM_SMS = DEFAULT_SMS         # H200 / H100 SXM; the split heuristic assumes it (shapes only, no device query)
LOG2E = 1.4426950408889634
MERGE_R = 128                 # latent dims per merge program
MAX_SPLITS = 64
WIDE_MAX_SPLITS = 2           # more head tiles than SMs: at most this many splits (each one's partials go through
WIDE_MIN_KEYS = 256           # the merge: B * h * r * 4 bytes a split), each of at least this many keys


# --------------------------------------------------------------------------------------------
# launch configs
# --------------------------------------------------------------------------------------------

def _config(h: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) per head count (D = 576 for every GLM-5 model).

    A key costs D*2 = 1152 bytes and 2*h*(D + r) FLOPs (139 kFLOP at h = 64: 121 FLOP/byte, not far
    below the H200's ~190 bf16 FLOP/byte balance point), so a tile keeps all heads of a token together
    (each cache row read once per head tile) and its fp32 [BLOCK_H, r] accumulator must not spill
    (BLOCK_H * 512 * 4 bytes over num_warps * 32 threads: 128 registers a thread at 64 heads / 8 warps).
    Head counts below 16 (TP > 4) pad to 16, tl.dot's minimum M.

    Picked from a sweep of 66 configs on the H200 (2026-12-01; BLOCK_H 16/32/64, BLOCK_N 16/32/64,
    4/8 warps, 1-3 stages; B = 64 x 8k dense and B = 64 x K=2048 sparse weighted most), at B = 64 x 8k
    dense: h = 64 (64, 32, 8, 2) 1.05 TB/s (16-head tiles re-reading rows from L2: 0.88); h = 32
    (32, 64, 8, 2) 1.6 TB/s; h = 16 (16, 64, 4, 3) 2.2 TB/s. `python -m glm_ray.bench.attention`
    prints the full table (compute limits h = 64: ~125 TFLOP/s of mma there).
    """
    if h <= 16:
        return 16, 64, 4, 3
    if h <= 32:
        return 32, 64, 8, 2
    return 64, 32, 8, 2


def default_num_splits(batch: int, h: int, D: int, key_range: int, block_h: int | None = None) -> int:
    """Splits of the key range per (sequence, head tile): as many as ONE wave of the SMs holds (the split
    kernel runs one program per SM: a partial second wave costs a whole program's time), each split still
    worth >= `min_keys` keys of the largest possible range (`key_range` = nb * block_size dense, K sparse),
    and at most MAX_SPLITS. Shapes only (CUDA-graph static).

    Measured on the H200 (`bench.attention --heads 32 --splits ...`, docs/measurements/2026-12-04): the
    fastest split count was floor(132 / (B x head tiles)) at every B in {1, 8, 32, 64}, dense 1k / 8k and
    sparse 8k (B = 64: 2 splits 61 / 313 / 109 us vs 82 / 379 / 160 us for the earlier ~2-wave rule's 5;
    3 splits = 1.5 waves was the slowest). min_keys grows with h: a split writes an fp32 [h, r] partial and
    the merge reads it back (h * r * 8 bytes: 128 KiB at h = 32), so many short splits at large h would
    move more partials than cache rows; at h = 32, 64-key splits still won (B = 1 and 8 at 1k).

    More head tiles than SMs (an eager decode group holding a prefix-cache hit's absorbed tail: 16 decodes + a
    128-token tail = 144 rows at h = 32): one split a tile leaves a partial last wave that costs a whole program's
    time (144 programs = 2 waves for 1.09 waves of work). There the split count s <= WIDE_MAX_SPLITS, each split
    >= WIDE_MIN_KEYS keys, minimizes waves(s) / s = ceil(tiles * s / NUM_SMS) / s, the smaller s on a tie (144
    and 192 tiles: 2 splits, 1.5 vs 2; a whole number of waves: 1). Measured on an H100 (session 43, `bench.attention
    --heads 32 64 --batch 144 192 --contexts 2048 --splits 0 1 2 4`, docs/measurements/2026-12-07): 144 rows at h = 32
    247 / 287 / 262 us with 2 / 1 / 4 splits (h = 64: 380 / 450 / 416), 192 rows 265 / 299 / 327 (h = 64: 398 / 451 /
    522) — 2 splits fastest at both, so the waves model holds only up to 2 splits (4 splits' shorter key ranges and
    merged partials cost more than the quarter-wave saves): WIDE_MAX_SPLITS = 2."""
    block_h = block_h or _config(h, D)[0]
    tiles = batch * triton.cdiv(h, block_h)
    min_keys = 64 if h <= 32 else 4 * h
    if tiles <= NUM_SMS:
        return int(max(1, min(NUM_SMS // tiles, key_range // min_keys, MAX_SPLITS)))
    cap = max(1, min(WIDE_MAX_SPLITS, key_range // max(min_keys, WIDE_MIN_KEYS)))
    return min(range(1, cap + 1), key=lambda s: (triton.cdiv(tiles * s, NUM_SMS) / s, s))


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _mla_tile(n0, end, ctx, q_nope, q_pe, m_i, l_i, acc, kv_ptr, bt_row, idx_row, qk_scale, stride_kv,
              dn, dp, dn_ok, dp_ok, R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              SPARSE: tl.constexpr, INTERP: tl.constexpr):
    """One BLOCK_N tile of keys [n0, n0 + BLOCK_N) under the online softmax: returns (m_i, l_i, acc)."""
    offs = n0 + tl.arange(0, BLOCK_N)                                         # [BN]
    if SPARSE:
        pos = tl.load(idx_row + offs, mask=offs < end, other=-1)
        pos = pos.to(tl.int32)
        valid = (pos >= 0) & (pos < ctx)
    else:
        pos = offs
        valid = offs < end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE                   # [BN]
    rows = kv_ptr + slot[:, None] * stride_kv                                 # [BN, 1]
    c = tl.load(rows + dn[None, :], mask=valid[:, None] & dn_ok[None, :], other=0.0)          # [BN, BR]
    k_pe = tl.load(rows + R + dp[None, :], mask=valid[:, None] & dp_ok[None, :], other=0.0)   # [BN, BDR]
    if INTERP:
        c = c.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    s = tl.dot(q_nope, tl.trans(c))
    s = tl.dot(q_pe, tl.trans(k_pe), s)                                       # [BH, BN]
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))                 # base-2 logits
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                           # [BH, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)                     # [BH, BR]
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["NUM_SPLITS"])   # a runtime value: eager decode groups vary it (cuda/__init__)
def _mla_split_kernel(q_ptr, kv_ptr, bt_ptr, cl_ptr, idx_ptr, o_ptr, lse_ptr,
                      H, K_IDX, qk_scale,
                      stride_qb, stride_qh, stride_kv, stride_btb, stride_idxb,
                      stride_ob, stride_oh, stride_os,
                      R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, NUM_SPLITS, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr,
                      INTERP: tl.constexpr, WARP_SPEC: tl.constexpr = False):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)                              # [BH]
    hmask = heads < H
    dn = tl.arange(0, BLOCK_R)                                                # [BR]
    dp = tl.arange(0, BLOCK_DR)                                               # [BDR]
    dn_ok = dn < R
    dp_ok = dp < DR

    ctx = tl.load(cl_ptr + b)
    if SPARSE:
        per = tl.cdiv(tl.cdiv(K_IDX, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per
        end = tl.minimum(start + per, K_IDX)
    else:
        per = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per
        end = tl.minimum(start + per, ctx)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh          # [BH, 1]
    q_nope = tl.load(q_rows + dn[None, :], mask=hmask[:, None] & dn_ok[None, :], other=0.0)   # [BH, BR]
    q_pe = tl.load(q_rows + R + dp[None, :], mask=hmask[:, None] & dp_ok[None, :], other=0.0)  # [BH, BDR]
    if INTERP:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    # finite initial max: a tile with no valid key (sparse -1 run) leaves m at -1e30 and adds
    # exp2(-inf) = 0, never exp2(-inf - -inf) = NaN
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    idx_row = idx_ptr + b.to(tl.int64) * stride_idxb
    if WARP_SPEC:                                  # Triton's warp-specialized loop (loads vs MMA warps)
        for n0 in tl.range(start, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _mla_tile(n0, end, ctx, q_nope, q_pe, m_i, l_i, acc, kv_ptr, bt_row, idx_row, qk_scale,
                                      stride_kv, dn, dp, dn_ok, dp_ok, R, BLOCK_SIZE, BLOCK_N, SPARSE, INTERP)
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _mla_tile(n0, end, ctx, q_nope, q_pe, m_i, l_i, acc, kv_ptr, bt_row, idx_row, qk_scale,
                                      stride_kv, dn, dp, dn_ok, dp_ok, R, BLOCK_SIZE, BLOCK_N, SPARSE, INTERP)

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]                           # [BH, BR]
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dn[None, :]
    if DIRECT:
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & dn_ok[None, :])
    else:
        tl.store(o_ptrs + split * stride_os, o, mask=(hmask & nonempty)[:, None] & dn_ok[None, :])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * H + heads) * NUM_SPLITS + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["NUM_SPLITS"])   # SPLITS_P2 (a power of two <= MAX_SPLITS) stays constexpr
def _mla_merge_kernel(part_ptr, lse_ptr, out_ptr, H, stride_ob, stride_oh,
                      R: tl.constexpr, NUM_SPLITS, SPLITS_P2: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)                                                    # b * H + head
    rt = tl.program_id(1)
    b = row // H
    head = row % H
    s_all = tl.arange(0, SPLITS_P2)
    lse_row = lse_ptr + row.to(tl.int64) * NUM_SPLITS
    lse = tl.load(lse_row + s_all, mask=s_all < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)                                  # no split with a key
    total = tl.sum(tl.exp2(lse - m), 0)
    d = rt * BLOCK_R + tl.arange(0, BLOCK_R)                                  # [BR]
    d_ok = d < R
    acc = tl.zeros([BLOCK_R], tl.float32)
    part_row = part_ptr + row.to(tl.int64) * NUM_SPLITS * R
    for s0 in range(0, NUM_SPLITS, CHUNK):
        s = s0 + tl.arange(0, CHUNK)                                          # [CHUNK]
        ls = tl.load(lse_row + s, mask=s < NUM_SPLITS, other=float("-inf"))
        w = tl.exp2(ls - m)                                                   # 0 for empty splits
        part = tl.load(part_row + s[:, None] * R + d[None, :],
                       mask=(ls > float("-inf"))[:, None] & d_ok[None, :], other=0.0)   # [CHUNK, BR]
        acc += tl.sum(part * w[:, None], 0)
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def mla_decode_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, *, kv_lora_rank: int, scale: float, indices: torch.Tensor | None = None,
                     num_splits: int | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache, one query token per sequence.

    q [B, h, D] (D = r + dr; bf16/fp16; any row strides, unit last stride), kv_cache [S, D] same dtype
    (unit last stride), block_table [B, nb] int32, context_lens [B] int32 (>= 1), indices [B, K] int32
    or None.
    indices None: dense — attend to positions 0..context_lens[b]-1.
    indices given: sparse (DSA) — attend only to positions indices[b, j] >= 0 (-1 = padding; positions
    are < context_lens[b]; any order; no duplicates except -1).
    Returns o_lat [B, h, r] in q.dtype: softmax(scale * q . k) @ v with k = row[:D], v = row[:r].
    num_splits: split-K count (None: `default_num_splits`, from shapes only). config: (BLOCK_H, BLOCK_N,
    num_warps, num_stages[, warp_specialize]) instead of the per-shape table (tests, tuning; the fifth
    element runs the key loop as Triton's warp-specialized `tl.range`).
    """
    B, h, D = q.shape
    r = kv_lora_rank
    dr = D - r
    assert kv_cache.dim() == 2 and kv_cache.shape[1] == D and kv_cache.dtype == q.dtype, (q.shape, kv_cache.shape)
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and 0 < r and 0 < dr
    assert block_size > 0 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert block_table.dim() == 2 and block_table.shape[0] == B and context_lens.shape == (B,)
    out = torch.empty(B, h, r, dtype=q.dtype, device=q.device)                # [B, h, r]
    if B == 0 or h == 0:
        return out
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    context_lens = context_lens.contiguous()
    sparse = indices is not None
    if sparse:
        assert indices.dim() == 2 and indices.shape[0] == B, indices.shape
        indices = indices if indices.stride(-1) == 1 else indices.contiguous()
        key_range = indices.shape[1]
        idx_arg, stride_idx = indices, indices.stride(0)
    else:
        key_range = block_table.shape[1] * block_size
        idx_arg, stride_idx = context_lens, 0                                 # unused pointer
    if key_range == 0:                                                        # sparse K = 0: nothing selected
        return out.zero_()
    block_h, block_n, num_warps, num_stages, *rest = config or _config(h, D)
    warp_spec = bool(rest and rest[0])
    splits = default_num_splits(B, h, D, key_range, block_h) if num_splits is None else int(num_splits)
    assert splits >= 1
    qk_scale = float(scale) * LOG2E
    consts = dict(R=r, DR=dr, BLOCK_R=triton.next_power_of_2(r), BLOCK_DR=triton.next_power_of_2(dr),
                  BLOCK_SIZE=block_size, NUM_SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, SPARSE=sparse,
                  INTERP=INTERPRET, WARP_SPEC=warp_spec, num_warps=num_warps, num_stages=num_stages)
    grid = (triton.cdiv(h, block_h), splits, B)
    if splits == 1:
        _mla_split_kernel[grid](q, kv_cache, block_table, context_lens, idx_arg, out, out,
                                h, key_range, qk_scale, q.stride(0), q.stride(1), kv_cache.stride(0),
                                block_table.stride(0), stride_idx, out.stride(0), out.stride(1), 0,
                                DIRECT=True, **consts)
        return out
    part = torch.empty(B, h, splits, r, dtype=torch.float32, device=q.device)   # [B, h, splits, r]
    lse = torch.empty(B, h, splits, dtype=torch.float32, device=q.device)       # [B, h, splits] (base 2)
    _mla_split_kernel[grid](q, kv_cache, block_table, context_lens, idx_arg, part, lse,
                            h, key_range, qk_scale, q.stride(0), q.stride(1), kv_cache.stride(0),
                            block_table.stride(0), stride_idx, part.stride(0), part.stride(1), part.stride(2),
                            DIRECT=False, **consts)
    merge_r = min(MERGE_R, triton.next_power_of_2(r))
    splits_p2 = triton.next_power_of_2(splits)
    _mla_merge_kernel[(B * h, triton.cdiv(r, merge_r))](part, lse, out, h, out.stride(0), out.stride(1),
                                                        R=r, NUM_SPLITS=splits, SPLITS_P2=splits_p2,
                                                        CHUNK=min(splits_p2, 16), BLOCK_R=merge_r, num_warps=4)
    return out


def mla_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, *, kv_lora_rank: int, scale: float,
                         indices: torch.Tensor | None = None) -> torch.Tensor:
    """TEST-ONLY oracle of `mla_decode_paged` (same arguments, no num_splits): per sequence, gather the
    attended cache rows and run softmax(scale * q k^T) v in fp32. A Python loop over B with host syncs
    (`.item()`-style reads of lengths and indices): never on a hot path. Returns [B, h, r] in q.dtype."""
    B, h, D = q.shape
    r = kv_lora_rank
    out = torch.empty(B, h, r, dtype=torch.float32, device=q.device)
    for b in range(B):                                                        # test-only: per sequence
        n = int(context_lens[b])
        if indices is None:
            pos = torch.arange(n, device=q.device)
        else:
            sel = indices[b].long()
            pos = sel[(sel >= 0) & (sel < n)]
        slots = block_table[b].long()[pos // block_size] * block_size + pos % block_size
        kv = kv_cache[slots].float()                                          # [n, D]
        s = (q[b].float() @ kv.T) * scale                                     # [h, n]
        out[b] = torch.softmax(s, dim=-1) @ kv[:, :r]                         # [h, r]
    return out.to(q.dtype)


__all__ = ["default_num_splits", "mla_decode_paged", "mla_decode_reference"]
