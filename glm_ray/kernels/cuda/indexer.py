"""Triton DSA lightning-indexer kernel of the `cuda` backend: the index scores of one query per row over
its sequence's paged key cache, and their top-k positions (contract: `indexer_topk` in
kernels/torch_ref/indexer.py). Decode: a row per sequence (`indexer_decode_topk`); prefill: a row per
query token with its causal length as the context (`indexer_prefill_topk`), scored in tiles of query rows
(`_indexer_prefill_scores_kernel`: a tile's keys are read once for all its rows, where the decode kernel
would read them once per row — the prefill path measured 0.02-0.07 of the bf16 peak that way).

    I[b, t] = sum_h w[b, h] * relu(qi[b, h] . k[t] * di^-0.5),   t < context_lens[b]

* `_indexer_scores_kernel` — one program per (sequence b, `tiles` tiles of BLOCK_N positions): maps the
  positions to flat cache slots through the block table (slot = block_table[b, p // bs] * bs + p % bs),
  loads the keys [BLOCK_N, di] once, computes keys @ qi^T -> [BLOCK_N, Hi] on the tensor cores with fp32
  accumulation, then scale, ReLU, head weights and the sum over heads -> [BLOCK_N] fp32. Positions >=
  context_lens[b] get -inf; a program entirely past the context only writes -inf (no loads). Grid
  (B, cdiv(kmax, tiles * BLOCK_N)) and every constexpr come from shapes / dtypes, never from values:
  CUDA-graph capturable with a static `kmax` (e.g. nb * block_size).
* fp32 accuracy on the tensor cores: bf16 keys are exact in bf16, so an fp32 query is split into
  FP32_QUERY_PARTS bf16 parts (q1 + q2 + q3, each the bf16 rounding of what is left) and each part is
  one bf16 dot: every bf16 x bf16 product is exact in fp32 and the parts carry q to ~2^-24, so the result
  is the fp32 dot up to summation order (no TF32 anywhere). A bf16 query is one part (H200: 3.4 vs
  2.3-2.7 TB/s at B=64 x 32k: the split fp32 path is partly compute-bound). fp32 keys take one fp32 dot
  with input_precision="ieee" (CUDA-core FMAs: slower, exact).
* Top-k (`select_topk`, switch GLM_RAY_CUDA_INDEXER_TOPK read at import into TOPK_IMPL):
  "triton" (default): `topk_positions` of kernels/cuda/topk.py, an exact radix select with every row
  split over several programs (4 histogram passes + a compaction, no sort); ascending positions, ties
  to the lowest positions, -1 last. "torch": torch.topk(sorted=False) on the [B, kmax] scores, -inf
  picks -> -1; measured on the H200 (CUDA-graph replays, cold L2): 48-59 us at 8k and 51-76 us at 32k
  for B = 1..64 (k = 2048), 40-45 us per layer in glm5-flash-31b decode at 8k. (The earlier
  one-program-per-row radix kernel took 55 us at 8k and 150 us at 32k: one SM per row.) Both launch
  from shapes only (capturable). Prefill groups that attend in the naive form (the sparse MLA prefill
  kernel walks causal key tiles under a per-query bitmap) take the picks as that bitmap (`SelectionBits`)
  from `topk.topk_bits` (Kmax <= BITS_MAX_KEYS): one program per query row runs the same radix select over
  its row (re-read from L1/L2, not HBM, between passes) and packs its picks 32 to a word; neither an index
  list nor the bitmap kernel that rebuilt a bitmap from it (`mla_prefill.selection_bits`) runs
  (glm5-flash-31b on an H100: those three kernels' 49.7 ms of a 1 x 8k step -> 36.8 ms, step 362.9 -> 350.3 ms).
* Ties: exact score ties are broken by lowest position ("triton") or torch.topk's internal order
  ("torch"), not necessarily the reference's; selection sets can differ only among positions whose
  scores tie (or nearly tie, within fp32 summation-order noise) with the k-th best. Both are undefined
  by the contract.

Under `TRITON_INTERPRET=1` (CPU tests) the bf16 parts are upcast to fp32 before `tl.dot` (the
interpreter's bf16 dot is garbage); the split itself is still exercised.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm_ray import envs
from glm_ray.kernels.cuda import topk as radix_topk
from glm_ray.kernels.cuda.layout import row_tiles
from glm_ray.kernels.torch_ref.topk import SelectionBits

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NEG_INF = float("-inf")
BLOCK_N = 64            # positions per tile   } H200 tuning: see glm_ray/bench/indexer.py
TILES = None            # tiles per program   } (None: `_tiles` picks from the shapes)
NUM_WARPS = 4
FP32_QUERY_PARTS = 3    # bf16 parts of an fp32 query (3: fp32-exact products; 2: ~2^-17 relative)
TOPK_IMPL = envs.CUDA_INDEXER_TOPK.get()   # "triton": topk.topk_positions; "torch": torch.topk
TOPK_CHUNK = None       # scores per loop step of `topk_positions` (None: topk.CHUNK)
TOPK_WARPS = None       # its warps per program (None: topk.NUM_WARPS)


@triton.jit
def _bf16_parts(q):
    """fp32 q -> bf16 parts with q1 + q2 + q3 == q to ~2^-24 (each part rounds what is left; the parts a
    kernel's NSPLIT does not use are dead code)."""
    q1 = q.to(tl.bfloat16)
    r = q - q1.to(tl.float32)
    q2 = r.to(tl.bfloat16)
    return q1, q2, (r - q2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _parts_dot(keys, p1, p2, p3, NSPLIT: tl.constexpr, PARTS_LEFT: tl.constexpr, INTERP: tl.constexpr):
    """The sum over the first NSPLIT bf16 query parts of dot(part, keys) (PARTS_LEFT) or dot(keys, part):
    bf16 tensor-core dots accumulated in fp32 (fp32 numpy dots of the same parts under the interpreter,
    whose bf16 dot is garbage)."""
    if INTERP:
        keys = keys.to(tl.float32)
        p1 = p1.to(tl.float32)
        p2 = p2.to(tl.float32)
        p3 = p3.to(tl.float32)
    if PARTS_LEFT:
        acc = tl.dot(p1, keys)
        if NSPLIT >= 2:
            acc = tl.dot(p2, keys, acc)
        if NSPLIT >= 3:
            acc = tl.dot(p3, keys, acc)
    else:
        acc = tl.dot(keys, p1)
        if NSPLIT >= 2:
            acc = tl.dot(keys, p2, acc)
        if NSPLIT >= 3:
            acc = tl.dot(keys, p3, acc)
    return acc


@triton.jit(do_not_specialize=['KMAX'])   # sizes that change per step: no recompiles (cuda/__init__)
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, cl_ptr, out_ptr,
                           stride_qb, stride_qh, stride_wb, stride_k, stride_bt, stride_ob, scale,
                           KMAX, H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, DB: tl.constexpr,
                           BS: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, NSPLIT: tl.constexpr,
                           INTERP: tl.constexpr):
    b = tl.program_id(0)
    base = tl.program_id(1) * (TILES * BLOCK_N)                                # first position of the program
    ctx = tl.load(cl_ptr + b)
    o_row = out_ptr + b.to(tl.int64) * stride_ob
    if base < ctx:
        offs_d = tl.arange(0, DB)
        offs_h = tl.arange(0, HB)
        d_ok = offs_d < D
        h_ok = offs_h < H
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + offs_h[None, :] * stride_qh + offs_d[:, None],
                    mask=d_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)   # [DB, HB] = qi[b]^T
        wv = tl.load(w_ptr + b.to(tl.int64) * stride_wb + offs_h, mask=h_ok, other=0.0).to(tl.float32)   # [HB]
        q1, q2, q3 = _bf16_parts(q)                                            # [DB, HB] each
        for i in tl.static_range(TILES):                                       # unrolled: loads issue together
            offs_n = base + i * BLOCK_N + tl.arange(0, BLOCK_N)                # [BN] positions
            valid = offs_n < ctx
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + offs_n // BS, mask=valid, other=0)
            slot = blk.to(tl.int64) * BS + offs_n % BS                         # [BN] flat cache slots
            kt = tl.load(k_ptr + slot[:, None] * stride_k + offs_d[None, :],
                         mask=valid[:, None] & d_ok[None, :], other=0.0)       # [BN, DB]
            if NSPLIT == 0:                                                    # fp32 keys: exact fp32 dot
                acc = tl.dot(kt.to(tl.float32), q, input_precision="ieee")     # [BN, HB]
            else:
                acc = _parts_dot(kt, q1, q2, q3, NSPLIT, False, INTERP)       # [BN, HB]
            s = tl.maximum(acc * scale, 0.0)                                   # [BN, HB]
            score = tl.sum(s * wv[None, :], axis=1)                            # [BN]
            tl.store(o_row + offs_n, tl.where(valid, score, float("-inf")), mask=offs_n < KMAX)
    else:                                                                      # program past the context
        for i in tl.static_range(TILES):
            offs_n = base + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(o_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < KMAX)


@triton.jit(do_not_specialize=['KMAX', 'NT'])   # sizes that change per step: no recompiles (cuda/__init__)
def _indexer_prefill_scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, row0_ptr, nrows_ptr, pos0_ptr, tseq_ptr, toff_ptr,
                                   out_ptr, stride_qr, stride_qh, stride_wr, stride_k, stride_bt, stride_or, scale,
                                   KMAX, NT, H: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, BS: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                                   INTERP: tl.constexpr):
    """One program per (tile of BLOCK_M consecutive query rows of one sequence, BLOCK_N key positions):
    the keys [BLOCK_N, di] are loaded once and scored against every row of the tile, head by head, as
    [BLOCK_M, di] x [di, BLOCK_N] dots on the tensor cores (an fp32 query as NSPLIT bf16 parts, as the
    decode kernel): scale, ReLU, times the row's head weight, summed over heads in fp32."""
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    b = tl.load(tseq_ptr + t)
    if b >= 0:
        off = tl.load(toff_ptr + t)                                            # first row of the tile in its seq
        nr = tl.load(nrows_ptr + b)
        r0 = tl.load(row0_ptr + b)
        p0 = tl.load(pos0_ptr + b)
        offs_m = off + tl.arange(0, BLOCK_M)                                   # [BM] rows of the sequence
        m_ok = offs_m < nr
        rows = (r0 + offs_m).to(tl.int64)                                      # [BM] rows of q / out
        lens = p0 + offs_m + 1                                                 # [BM] causal context lengths
        offs_n = n0 + tl.arange(0, BLOCK_N)                                    # [BN] key positions
        o_ptrs = out_ptr + rows[:, None] * stride_or + offs_n[None, :]
        o_mask = m_ok[:, None] & (offs_n < KMAX)[None, :]
        last = p0 + tl.minimum(off + BLOCK_M, nr)                              # the tile's longest context
        if n0 < last:
            offs_d = tl.arange(0, DB)
            d_ok = offs_d < D
            valid_n = offs_n < last
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + offs_n // BS, mask=valid_n, other=0)
            slot = blk.to(tl.int64) * BS + offs_n % BS                         # [BN] flat cache slots
            kt = tl.load(k_ptr + slot[None, :] * stride_k + offs_d[:, None],
                         mask=d_ok[:, None] & valid_n[None, :], other=0.0)     # [DB, BN] = keys^T
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for h in range(H):
                q = tl.load(q_ptr + rows[:, None] * stride_qr + h * stride_qh + offs_d[None, :],
                            mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)   # [BM, DB]
                wh = tl.load(w_ptr + rows * stride_wr + h, mask=m_ok, other=0.0).to(tl.float32)   # [BM]
                if NSPLIT == 0:                                                # fp32 keys: exact fp32 dot
                    s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")   # [BM, BN]
                else:
                    q1, q2, q3 = _bf16_parts(q)                                # [BM, DB] each
                    s = _parts_dot(kt, q1, q2, q3, NSPLIT, True, INTERP)       # [BM, BN]
                acc += tl.maximum(s * scale, 0.0) * wh[:, None]
            causal = offs_n[None, :] < lens[:, None]
            tl.store(o_ptrs, tl.where(causal, acc, float("-inf")), mask=o_mask)
        else:                                                                  # every key past the tile's rows
            tl.store(o_ptrs, tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32), mask=o_mask)


def _tiles(B: int, kmax: int) -> int:
    """Tiles per program from the shapes: 4 once there are >= 2048 tiles (~16 per SM on an H200: fewer,
    longer programs stream better: B=64 x 32k 2.3 -> 2.8 TB/s), else 1 (small grids need every program)."""
    if TILES is not None:
        return TILES
    return 4 if B * triton.cdiv(kmax, BLOCK_N) >= 2048 else 1


def _nsplit(qi: torch.Tensor, key_cache: torch.Tensor) -> int:
    """bf16 parts per query (0: fp32 ieee dot)."""
    if key_cache.dtype != torch.bfloat16:
        return 0
    return 1 if qi.dtype == torch.bfloat16 else FP32_QUERY_PARTS


def indexer_decode_scores(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                          context_lens: torch.Tensor, block_size: int, kmax: int) -> torch.Tensor:
    """qi [B, Hi, di] fp32 or bf16 (one query per sequence: decode), w [B, Hi] fp32, key_cache [S, di]
    bf16/fp32 (rows may be strided, elements contiguous), block_table [B, nb] int32, context_lens [B]
    int32 (>= 1), kmax: host int >= max(context_lens) (static: e.g. nb * block_size under CUDA graphs).
    Returns scores [B, kmax] fp32: I[b, t] for t < context_lens[b], -inf past it."""
    B, H, D = qi.shape
    assert key_cache.shape[-1] == D and key_cache.stride(-1) == 1, "key_cache [S, di] with contiguous rows"
    qi, w = qi.contiguous(), w.contiguous()
    block_table, context_lens = block_table.contiguous(), context_lens.contiguous()
    out = torch.empty(B, kmax, dtype=torch.float32, device=qi.device)          # [B, kmax]
    if B == 0 or kmax == 0:
        return out
    HB = max(16, triton.next_power_of_2(H))                                    # tl.dot wants dims >= 16
    DB = max(16, triton.next_power_of_2(D))
    tiles = _tiles(B, kmax)
    grid = (B, triton.cdiv(kmax, BLOCK_N * tiles))
    _indexer_scores_kernel[grid](
        qi, w, key_cache, block_table, context_lens, out,
        qi.stride(0), qi.stride(1), w.stride(0), key_cache.stride(0), block_table.stride(0), out.stride(0),
        D ** -0.5, kmax, H=H, D=D, HB=HB, DB=DB, BS=block_size, BLOCK_N=BLOCK_N, TILES=tiles,
        NSPLIT=_nsplit(qi, key_cache), INTERP=INTERPRET, num_warps=NUM_WARPS)
    return out


def indexer_decode_topk(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, topk: int, kmax: int) -> torch.Tensor:
    """indices [B, min(topk, kmax)] int32: the positions of the best-scored keys of each sequence
    (`select_topk` of `indexer_decode_scores`; order: see there), -1 where fewer than topk
    positions exist (the -inf picks)."""
    scores = indexer_decode_scores(qi, w, key_cache, block_table, context_lens, block_size, kmax)   # [B, kmax]
    return select_topk(scores, context_lens, min(topk, kmax))


PREFILL_BLOCK_M = 64    # query rows per tile of the prefill scores kernel (not tuned on a GPU yet)
PREFILL_BLOCK_N = 64


def indexer_prefill_scores(q: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                           row0: torch.Tensor, nrows: torch.Tensor, pos0: torch.Tensor, kmax: int,
                           block_size: int, tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Scores of R query rows grouped by sequence: sequence b's rows are q[row0[b] : row0[b] + nrows[b]]
    (consecutive positions from pos0[b]; nrows may be 0), its keys at block_table[b]. q [R, Hi, di] fp32 /
    bf16, w [R, Hi] fp32, row0 / nrows / pos0 [B] int32 on the device. Returns [R, kmax] fp32: I[r, t]
    for t <= the row's position, -inf after. Tiles of PREFILL_BLOCK_M rows x PREFILL_BLOCK_N keys (the
    table of tiles built on the device: no host sync; `tiles` = `row_tiles(nrows, PREFILL_BLOCK_M, R)`
    when the caller made it already)."""
    R, H, D = q.shape
    out = torch.empty(R, kmax, dtype=torch.float32, device=q.device)           # [R, kmax]
    if R == 0 or kmax == 0:
        return out
    bm, bn = PREFILL_BLOCK_M, PREFILL_BLOCK_N
    tile_seq, tile_off = tiles if tiles is not None else row_tiles(nrows, bm, R)   # [NT] each
    nt = tile_seq.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w.contiguous()
    _indexer_prefill_scores_kernel[(nt, triton.cdiv(kmax, bn))](
        q, w, key_cache, block_table, row0, nrows, pos0, tile_seq, tile_off, out,
        q.stride(0), q.stride(1), w.stride(0), key_cache.stride(0), block_table.stride(0), out.stride(0),
        D ** -0.5, kmax, nt, H=H, D=D, DB=max(16, triton.next_power_of_2(D)), BS=block_size, BLOCK_M=bm,
        BLOCK_N=bn, NSPLIT=_nsplit(q, key_cache), INTERP=INTERPRET, num_warps=4)
    return out


@dataclass(frozen=True)
class ScoreChunk:
    """Rows [r0, r1) of a prefill group's packed query rows, scored in one `indexer_prefill_scores` call."""
    r0: int
    r1: int
    row0: torch.Tensor            # [B] int32 first row of each sequence within the chunk
    nrows: torch.Tensor           # [B] int32 rows of each sequence within the chunk (may be 0)
    pos0: torch.Tensor            # [B] int32 position of each sequence's first row in the chunk
    lens: torch.Tensor            # [r1 - r0] int32 causal context of each row (position + 1)
    tiles: tuple[torch.Tensor, torch.Tensor]   # `row_tiles(nrows, PREFILL_BLOCK_M, r1 - r0)`


@dataclass(frozen=True)
class IndexerPrefillPlan:
    """What `indexer_prefill_topk` derives from a group's metadata alone — the same for every layer of the
    step, so it is built once per group (device ops, no host sync) instead of once per layer."""
    kmax: int
    k: int
    dense: bool                   # no padded query slots: the packed rows are the [B*Qmax] rows in order
    chunks: tuple[ScoreChunk, ...]


def indexer_prefill_plan(group, topk: int, rows: int) -> IndexerPrefillPlan:
    """The plan of `group` for top-`topk` picks scored in chunks of at most `rows` query rows."""
    B, Qmax = group.q_index.shape
    kmax = group.max_context_len
    tg = group.packed.shape[0]
    ql = group.query_lens.long()
    first = (group.context_lens - group.query_lens).long()                      # [B] first new position
    start = torch.cumsum(ql, 0) - ql                                            # [B] first packed row
    seq = group.packed // Qmax                                                  # [Tg] sequence of each row
    lens = (first[seq] + group.packed % Qmax + 1).to(torch.int32)               # [Tg] causal context
    chunks = []
    for r0 in range(0, tg, rows):                                               # chunks of rows (usually one)
        r1 = min(tg, r0 + rows)
        lo, hi = start.clamp(min=r0, max=r1), (start + ql).clamp(min=r0, max=r1)   # [B] the chunk's rows
        nrows = (hi - lo).to(torch.int32)
        chunks.append(ScoreChunk(r0, r1, (lo - r0).to(torch.int32), nrows, (first + lo - start).to(torch.int32),
                                 lens[r0:r1], row_tiles(nrows, PREFILL_BLOCK_M, r1 - r0)))
    return IndexerPrefillPlan(kmax=kmax, k=min(topk, kmax), dense=tg == B * Qmax, chunks=tuple(chunks))


def indexer_prefill_topk(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, group, topk: int, *,
                         max_bytes: int, bits: bool = False) -> torch.Tensor | SelectionBits:
    """The `indexer_topk` op on a prefill group (several queries per sequence): the query rows of a
    sequence are scored as tiles against its keys (`indexer_prefill_scores`: keys loaded once per tile
    of queries, not once per query), each row over its causal length (position + 1), then the same top-k
    as decode, with no [B, Qmax, Hi, Kmax] per-head scores and no padded views. qi [T, Hi, di], w [T, Hi]:
    rows of the whole step. Returns indices [B, Qmax, k] int32 (k = min(topk, max_context_len); -1 where a
    query has fewer than k causal keys and in padded query slots). Rows go in chunks whose [rows, Kmax]
    fp32 scores fit `max_bytes` (one chunk unless the step's queries x context are large). The group's
    row bookkeeping (`indexer_prefill_plan`) is built by its first layer and shared by the others.
    bits: return the picks as `SelectionBits` instead ([Tg, ceil(Kmax / 32)] int32, packed rows: what the
    sparse MLA prefill kernel reads), written by `topk.topk_bits` straight from the scores (one launch a chunk,
    no index list, no bitmap kernel after it); Kmax <= topk.BITS_MAX_KEYS."""
    B, Qmax = group.q_index.shape
    rows = max(1, max_bytes // (group.max_context_len * 4))
    plan = group.plan(("indexer_prefill", topk, rows), lambda: indexer_prefill_plan(group, topk, rows))
    k = plan.k
    if bits:
        words = triton.cdiv(plan.kmax, 32)
        # [Tg, W]: every word of every row is written by its chunk's topk_bits (the chunks cover all Tg rows)
        picked_bits = torch.empty(group.packed.shape[0], words, dtype=torch.int32, device=qi.device)
    if not plan.chunks:
        return SelectionBits(picked_bits) if bits else torch.full((B, Qmax, k), -1, dtype=torch.int32, device=qi.device)
    if group.row_span is not None:                                              # the group's rows in order
        q, ww = qi[group.row_span[0]:group.row_span[1]], w[group.row_span[0]:group.row_span[1]]
    else:
        q, ww = qi[group.token_index], w[group.token_index]                     # [Tg, Hi, di], [Tg, Hi]
    table = group.block_table.contiguous()
    picks = []
    for ch in plan.chunks:
        scores = indexer_prefill_scores(q[ch.r0:ch.r1], ww[ch.r0:ch.r1], key_cache, table, ch.row0, ch.nrows,
                                        ch.pos0, plan.kmax, group.block_size, tiles=ch.tiles)   # [rows, kmax]
        if bits:
            radix_topk.topk_bits(scores, ch.lens, k, words, out=picked_bits[ch.r0:ch.r1])   # [rows, W]
            continue
        picks.append(select_topk(scores, ch.lens, k))                           # [rows, k]
    if bits:
        return SelectionBits(picked_bits)
    picked = picks[0] if len(picks) == 1 else torch.cat(picks)                  # [Tg, k]
    if plan.dense:                                                              # packed == arange(B * Qmax)
        return picked.view(B, Qmax, k)
    out = torch.full((B * Qmax, k), -1, dtype=torch.int32, device=qi.device)    # [B*Qmax, k]
    out[group.packed] = picked
    return out.view(B, Qmax, k)


def select_topk(scores: torch.Tensor, context_lens: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, kmax] fp32 (-inf past each context) -> [B, k] int32 positions of the k best of each row
    (TOPK_IMPL "triton": ascending positions, -1s last; "torch": torch.topk order), -1 for -inf picks."""
    B, kmax = scores.shape
    assert 0 < k <= kmax
    if TOPK_IMPL == "torch":
        vals, idx = scores.topk(k, dim=-1, sorted=False)                       # [B, k]
        return idx.to(torch.int32).masked_fill_(vals == NEG_INF, -1)
    return radix_topk.topk_positions(scores, context_lens, k, chunk=TOPK_CHUNK, num_warps=TOPK_WARPS)   # [B, k]


def indexer_decode_reference(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                             context_lens: torch.Tensor, block_size: int, topk: int, *,
                             kmax: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (TEST-ONLY: loops over the B sequences and reads context_lens on the host).
    Returns (indices [B, min(topk, kmax)] int32 sorted by descending score, -1 for the -inf picks;
    scores [B, kmax] fp32, -inf past each context); kmax defaults to max(context_lens). The dots are
    accumulated in fp64 and rounded to fp32 once, so the reference is the exact score to fp32 rounding
    whatever the process's TF32 settings."""
    B, H, D = qi.shape
    lens = [int(n) for n in context_lens.tolist()]
    kmax = max(lens) if kmax is None else kmax
    dev = qi.device
    scores = torch.full((B, kmax), NEG_INF, dtype=torch.float32, device=dev)   # [B, kmax]
    for b, n in enumerate(lens):                                               # per sequence (test-only)
        pos = torch.arange(n, device=dev)                                      # [n]
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        keys = key_cache[slots].double()                                       # [n, di]
        s = (qi[b].double() @ keys.T).mul_(D ** -0.5).relu_()                  # [Hi, n]
        scores[b, :n] = (w[b].double() @ s).float()                            # [n]
    vals, idx = scores.topk(min(topk, kmax), dim=-1)                           # [B, k] sorted
    return idx.to(torch.int32).masked_fill_(vals == NEG_INF, -1), scores
