"""Triton MLA prefill (naive form: expanded per-head K/V, MHA) of the `cuda` backend, dense causal and
DSA-sparse, over packed varlen queries and the paged latent cache (this module imports triton).
Contract and math: `mla_prefill` in kernels/torch_ref/attention.py; the backend's `mla_prefill` op
adapts a group through `mla_prefill_group`, the tensor-level entry is `mla_prefill_varlen`.

Per call (one `AttnGroup`: B sequences, Tg = sum(query_lens) new tokens, packed back to back):

* Key expansion, in torch: the context rows [c (r) | k_pe (dr)] of every sequence (cached prefix +
  this chunk, positions 0..ctx-1) are gathered through the block table into one packed buffer
  (sequence b's rows start at cu_k[b]), and `kv_b` expands c once into per-head [k_nope (dn) | v (dv)]
  (the layer's kv_b_proj, whatever its quantisation). The kernel reads k_nope and v straight from
  kv_b's output and the rope part k_pe (shared by all heads) from the gathered rows: no per-head
  concat, no padded [B, Qmax, Kmax] view, no bool mask. The buffer is sized B * max_context_len rows
  (the group's host int; its true length sum(context_lens) lives on the device): rows past the last
  sequence are zero, and the bucketing of `build_forward_batch` keeps that padding within 2x.
* `_prefill_kernel` — grid (query tiles, h). A program owns BLOCK_M consecutive queries of one
  sequence and one head (a tile table built on the device maps program -> (sequence, first query);
  the grid is sized from host ints, cdiv(Tg, BLOCK_M) + B, and surplus programs store nothing). It
  walks its keys in BLOCK_N tiles under an online softmax in fp32, base 2 (log2(e) folded into the
  scale), q . k as up to three dots (the largest power-of-two part of dn, the rest of dn, dr: 128 + 64
  and 64 at GLM-5's 192 + 64, no padding to 256).
  Dense: causal with the offset ctx - query_len (query i of a chunk sits at position ctx - ql + i), so
  a tile reads keys 0..its last position; tiles wholly below the diagonal skip the mask.
  Sparse (DSA): a query attends to its top-k positions (int32 [B, Qmax, k], -1 = none; the decode
  kernel's index contract) AND causal. The indices become a per-query bitmap ([Tg, ceil(Kmax/32)]
  int32, one atomic-or per index: `_selection_bits_kernel`) — or come as that bitmap already (the cuda
  indexer's `SelectionBits`, written by its top-k); the kernel walks the same causal key
  range and masks each [BLOCK_M, BLOCK_N] tile by its bits (a row's BLOCK_N / 32 words loaded once and
  spread over the tile in registers). The MMA work is therefore that of dense causal attention (the
  naive form gives each head its own K, so queries with different selections cannot share a gathered
  tile). `SparseTiles.skip_empty` branches around tiles no query of the tile picked; off by default,
  as the branch keeps the tile's loads out of the software pipeline and a random top-2048 of a few
  thousand keys leaves no tile empty.
* Launch order: the tile table lists each head's heaviest tiles first (a sequence's last queries walk the
  most keys), and the grid (tiles, h) is dispatched tiles-fastest, so head by head: the heaviest tiles of the
  last head started with ~1/h of the work left, a tail of up to one heavy tile (1 x 8k: 64 key tiles against
  ~16 of work left an SM). The programs take their (tile, head) in an order that interleaves the tiles of
  HEAD_GROUP heads (`default_head_group`: 4 where it divides h): every group's heaviest tiles start first and
  the last group's light ones end the launch, while the programs running at once still read the keys of only
  a few heads (L2: 4 heads' expanded keys at 8k, 29 MB). Not measured yet (`bench.attention --mode prefill
  --head-groups 1 4`).
* Long contexts: when the expanded keys of the group (B * max_context_len rows of h * (dn + dv)
  values plus the gathered latents) would exceed `max_bytes`, the key positions are cut into chunks
  of whole BLOCK_N tiles and each chunk is gathered, expanded and attended in turn; the kernel keeps
  the online-softmax state (running max, sum, unnormalised output: fp32 [Tg, h] / [Tg, h, dv]) in
  global memory between chunks and the last chunk writes the output. A loop over key chunks (host
  ints only), not over sequences or tokens.

The device metadata (tile table, cu offsets, gather slots) depends on the group only, so
`mla_prefill_group` builds it once per group and reuses it for every layer of the step (a group's
tensors are never rewritten in place: prefill runs eagerly, CUDA graphs capture absorbed decode groups
only). No host sync: every size comes from shapes or the group's host ints (max_context_len); lengths
are read on the device.

A query row with no selected causal key gets output 0 (the reference's SDPA would spread it over
every key; the indexer never returns such a row). Under `TRITON_INTERPRET=1` (CPU tests) dot operands
are upcast to fp32 (the interpreter's bf16 dot is garbage, numpy has no bf16).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from glm_ray.forward_batch import AttnGroup
from glm_ray.kernels.cuda.layout import row_tiles
from glm_ray.kernels.torch_ref.topk import SelectionBits

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
MIN_DOT = 16                  # tl.dot's smallest K / N extent: dims below it are padded (masked) to it
BITS_BLOCK = 1024             # indices per step of the bitmap kernel


@dataclass(frozen=True)
class SparseTiles:
    """How the sparse kernel walks its causal key tiles (`bench.attention --sparse-tiles` times both):
    skip_empty — branch around a tile no query of the tile picked (saves its MMAs, but the branch keeps the
    tile's loads out of the software pipeline: H200, random top-2048 of 8k, 154 vs 350 TFLOPS without it).
    (Loading the bitmap as BM x BN gathers of repeated words instead of a row's BN / 32 words spread in
    registers ran at 125-131 TFLOPS there and is gone.)"""
    skip_empty: bool = False


# --------------------------------------------------------------------------------------------
# launch configs and the per-group plan
# --------------------------------------------------------------------------------------------

def _config(d_qk: int, d_v: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per head dims (GLM-5 and glm5-flash-31b: q/k 192 + 64,
    v 256; GLM-5.3-Flash: 256 / 256, NoPE). Swept on the H200 at h = 32 (`python -m glm_ray.bench.attention
    --mode prefill --heads 32 --prefill-shapes 1x2048 8x1024 1x8192 --config BM BN WARPS STAGES`,
    docs/measurements/2026-12-02/s21-mla-prefill-configs): 128 x 64, 8 warps, 2 stages runs the attention
    at 247 / 245 / 378 TFLOPS (1x2k / 8x1k / 1x8k dense; 1x8k sparse 115) against 145 / 141 / 181 (83)
    for the earlier 64 x 64; with 4 or 16 warps 85-240; 3 stages, BN 128 or BM 256 did not launch."""
    return 128, 64, 8, 2


HEAD_GROUP = 4                # heads whose query tiles are dispatched interleaved (`default_head_group`)


def default_head_group(h: int) -> int:
    """Heads a program's launch order interleaves: HEAD_GROUP where it divides h, else 1 (head by head)."""
    return HEAD_GROUP if h % HEAD_GROUP == 0 else 1


def _dn_split(dn: int) -> tuple[int, int, int]:
    """(DN1, DN2, BLOCK_DN2): dn = DN1 (a power of two) + DN2 (the rest, padded to BLOCK_DN2)."""
    dn1 = 1 << (dn.bit_length() - 1)
    dn2 = dn - dn1
    return dn1, dn2, (max(MIN_DOT, triton.next_power_of_2(dn2)) if dn2 else 0)


def chunk_keys(num_seqs: int, h: int, dn: int, dv: int, row_dim: int, elem_bytes: int, max_bytes: int,
               block_n: int, max_context_len: int) -> int:
    """Key positions per chunk: the gathered rows (row_dim), kv_b's output (h * (dn + dv)) and the
    int64 slot of every one of the B sequences' positions within `max_bytes`; whole BLOCK_N tiles, at
    least one. >= max_context_len means one chunk."""
    per_pos = num_seqs * ((row_dim + h * (dn + dv)) * elem_bytes + 8)
    kc = max(block_n, (max_bytes // per_pos) // block_n * block_n)
    return max_context_len if kc >= max_context_len else kc


@dataclass(frozen=True)
class KeyChunk:
    """Key positions [k0, k1) of every sequence, packed: sequence b's rows start at cu_k[b]."""
    k0: int
    k1: int
    rows: int                     # host: buffer rows, B * (k1 - k0) (>= the device total)
    cu_k: torch.Tensor            # [B] int32 first row of each sequence
    slots: torch.Tensor           # [rows] int64 cache slot of each row (0 past the packed total)
    pad: torch.Tensor | None      # [rows] bool rows past the packed total (None: the buffer is exact)


@dataclass(frozen=True)
class PrefillPlan:
    """Device metadata of one group for one (BLOCK_M, BLOCK_N, chunk) — layer-independent."""
    num_tokens: int               # host: Tg
    num_tiles: int                # host: grid size along queries (>= the device tile count)
    max_context_len: int          # host
    block_m: int
    block_n: int
    token_index: torch.Tensor     # [Tg] int64 row of T of each packed query
    cu_q: torch.Tensor            # [B] int32 first packed query of each sequence
    query_lens: torch.Tensor      # [B] int32
    context_lens: torch.Tensor    # [B] int32
    tile_seq: torch.Tensor        # [num_tiles] int32 sequence of each program's tile (-1: none)
    tile_start: torch.Tensor      # [num_tiles] int32 first query (offset in its sequence) of the tile
    chunks: tuple[KeyChunk, ...]


def prefill_plan(block_table: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
                 token_index: torch.Tensor, block_size: int, max_context_len: int, *, block_m: int, block_n: int,
                 chunk: int) -> PrefillPlan:
    """The plan of a group from its device metadata (torch ops on its device; no host sync).

    block_table [B, nb], context_lens [B] (cached + new), query_lens [B] (new, >= 1), token_index [Tg]
    (the new tokens' rows of T, sequences back to back in order); chunk: key positions per chunk
    (`chunk_keys`), a multiple of block_n unless it covers max_context_len."""
    B = query_lens.shape[0]
    Tg = token_index.shape[0]
    dev = query_lens.device
    ql, cl = query_lens.long(), context_lens.long()
    cu_q = torch.cumsum(ql, 0) - ql                                         # [B] exclusive
    tile_seq, tile_start = row_tiles(query_lens, block_m, Tg)               # [NT] each, NT from host ints
    num_tiles = tile_seq.shape[0]
    # heaviest tiles (last queries of a sequence: most keys) first; surplus programs (-1) exit at once
    tile_seq, tile_start = tile_seq.flip(0), tile_start.flip(0)
    bt = block_table.long()
    nb = bt.shape[1]
    chunks = []
    for k0 in range(0, max_context_len, chunk):                             # key chunks (host ints)
        k1 = min(k0 + chunk, max_context_len)
        n = (cl.clamp(max=k1) - k0).clamp(min=0)                            # [B] positions in the chunk
        end = torch.cumsum(n, 0)
        rows = B * (k1 - k0)
        i = torch.arange(rows, device=dev)
        kb = torch.searchsorted(end, i, right=True)                         # sequence of each row
        valid = kb < B
        kbc = kb.clamp(max=B - 1)
        pos = torch.where(valid, k0 + i - (end - n)[kbc], 0)
        slots = bt[kbc, (pos // block_size).clamp(max=nb - 1)] * block_size + pos % block_size
        exact = B == 1                                                      # one sequence: rows == ctx
        chunks.append(KeyChunk(k0=k0, k1=k1, rows=rows, cu_k=(end - n).to(torch.int32),
                               slots=torch.where(valid, slots, 0), pad=None if exact else ~valid))
    return PrefillPlan(num_tokens=Tg, num_tiles=num_tiles, max_context_len=max_context_len, block_m=block_m,
                       block_n=block_n, token_index=token_index, cu_q=cu_q.to(torch.int32),
                       query_lens=query_lens.to(torch.int32), context_lens=context_lens.to(torch.int32),
                       tile_seq=tile_seq, tile_start=tile_start, chunks=tuple(chunks))


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=['QMAX', 'WORDS'])   # sizes that change per step: no recompiles (cuda/__init__)
def _selection_bits_kernel(idx_ptr, bits_ptr, cu_q_ptr, ql_ptr, QMAX, K, WORDS, stride_ib, stride_iq,
                           BLOCK_K: tl.constexpr):
    """One program per (sequence, query slot): OR the bits of its selected positions into its packed
    row of the bitmap (padded query slots and -1 / out-of-range positions set nothing)."""
    pid = tl.program_id(0)
    b = pid // QMAX
    i = pid % QMAX
    ql = tl.load(ql_ptr + b)
    if i < ql:
        row = (tl.load(cu_q_ptr + b) + i).to(tl.int64)
        src = idx_ptr + b.to(tl.int64) * stride_ib + i.to(tl.int64) * stride_iq
        for j0 in range(0, K, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            pos = tl.load(src + j, mask=j < K, other=-1)
            ok = (pos >= 0) & (pos < WORDS * 32)
            pos = tl.where(ok, pos, 0)
            tl.atomic_or(bits_ptr + row * WORDS + pos // 32, (1 << (pos % 32)).to(tl.int32), mask=ok,
                         sem="relaxed")


@triton.jit
def _attend_tile(acc, m_i, l_i, q1, q2, qpe, kv_rows, pe_rows, kmask, smask, qk_scale,
                 DN1: tl.constexpr, DN2: tl.constexpr, BLOCK_DN2: tl.constexpr, DR: tl.constexpr,
                 BLOCK_DR: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                 INTERP: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] step of the online softmax over key rows loaded through pointer tiles."""
    d1 = tl.arange(0, DN1)
    k1 = tl.load(kv_rows + d1[None, :], mask=kmask[:, None], other=0.0)       # [BN, DN1]
    k2 = k1
    kp = k1
    if DN2 > 0:
        d2 = tl.arange(0, BLOCK_DN2)
        k2 = tl.load(kv_rows + DN1 + d2[None, :], mask=kmask[:, None] & (d2 < DN2)[None, :], other=0.0)
    if DR > 0:
        dp = tl.arange(0, BLOCK_DR)
        kp = tl.load(pe_rows + dp[None, :], mask=kmask[:, None] & (dp < DR)[None, :], other=0.0)
    dv = tl.arange(0, BLOCK_DV)
    v = tl.load(kv_rows + DN1 + DN2 + dv[None, :], mask=kmask[:, None] & (dv < DV)[None, :], other=0.0)
    return _softmax_step(acc, m_i, l_i, q1, q2, qpe, k1, k2, kp, v, smask, qk_scale, DN2, DR, MASKED, INTERP)


@triton.jit
def _attend_tile_tma(acc, m_i, l_i, q1, q2, qpe, k1_desc, k2_desc, v_desc, pe_desc, krow, col, pe_col, smask,
                     qk_scale, DN1: tl.constexpr, DN2: tl.constexpr, DR: tl.constexpr, MASKED: tl.constexpr,
                     INTERP: tl.constexpr):
    """The same step over key rows loaded as TMA boxes (`key_descriptors`): rows krow.. of the expanded keys at column col
    (this head's k_nope | v), the rope part at pe_col of the gathered rows. Rows past the context (a later
    sequence's, or zeros past the buffer) are masked out of s by smask (their p is 0); box columns past DN2 / DR
    meet zero query columns."""
    k1 = k1_desc.load([krow, col])                                            # [BN, DN1]
    k2 = k1
    kp = k1
    if DN2 > 0:
        k2 = k2_desc.load([krow, col + DN1])                                  # [BN, BLOCK_DN2]
    if DR > 0:
        kp = pe_desc.load([krow, pe_col])                                     # [BN, BLOCK_DR]
    v = v_desc.load([krow, col + DN1 + DN2])                                  # [BN, BLOCK_DV]
    return _softmax_step(acc, m_i, l_i, q1, q2, qpe, k1, k2, kp, v, smask, qk_scale, DN2, DR, MASKED, INTERP)


@triton.jit
def _attend_keys(acc, m_i, l_i, q1, q2, qpe, kv_head, pe_ptr, krow, stride_kvn, stride_pe, descs, krow0, col, kmask,
                 smask, qk_scale, DN1: tl.constexpr, DN2: tl.constexpr,
                 BLOCK_DN2: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr, DV: tl.constexpr,
                 BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr):
    """One key tile [krow0, krow0 + BLOCK_N) of this head: TMA boxes (`descs` = (k1, k2, v, pe) descriptors) or
    pointer tiles."""
    if TMA:
        k1_desc, k2_desc, v_desc, pe_desc = descs
        return _attend_tile_tma(acc, m_i, l_i, q1, q2, qpe, k1_desc, k2_desc, v_desc, pe_desc, krow0, col, 0, smask,
                                qk_scale, DN1, DN2, DR, MASKED, INTERP)
    return _attend_tile(acc, m_i, l_i, q1, q2, qpe, kv_head + krow[:, None] * stride_kvn,
                        pe_ptr + krow[:, None] * stride_pe, kmask, smask, qk_scale,
                        DN1, DN2, BLOCK_DN2, DR, BLOCK_DR, DV, BLOCK_DV, MASKED, INTERP)


@triton.jit
def _softmax_step(acc, m_i, l_i, q1, q2, qpe, k1, k2, kp, v, smask, qk_scale, DN2: tl.constexpr, DR: tl.constexpr,
                  MASKED: tl.constexpr, INTERP: tl.constexpr):
    """s = q . k (nope parts + rope part), the online-softmax update, acc += p . v."""
    if INTERP:
        k1 = k1.to(tl.float32)
        k2 = k2.to(tl.float32)
        kp = kp.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q1, tl.trans(k1))                                              # [BM, BN]
    if DN2 > 0:
        s = tl.dot(q2, tl.trans(k2), s)
    if DR > 0:
        s = tl.dot(qpe, tl.trans(kp), s)
    s = s * qk_scale                                                          # base-2 logits
    if MASKED:
        s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)                     # [BM, BDV]
    return acc, m_new, l_i


@triton.jit(do_not_specialize=['K0', 'K1', 'WORDS'])   # sizes that change per step: no recompiles (cuda/__init__)
def _prefill_kernel(q_ptr, tok_ptr, kv_ptr, pe_ptr, bits_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
                    cu_q_ptr, ql_ptr, cl_ptr, cu_k_ptr, tile_seq_ptr, tile_start_ptr,
                    k1_desc, k2_desc, v_desc, pe_desc,
                    H, K0, K1, WORDS, qk_scale,
                    stride_qt, stride_qh, stride_kvn, stride_kvh, stride_pe, stride_ot, stride_oh,
                    DN1: tl.constexpr, DN2: tl.constexpr, BLOCK_DN2: tl.constexpr, DR: tl.constexpr,
                    BLOCK_DR: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr,
                    SKIP_EMPTY: tl.constexpr, BNW: tl.constexpr, TMA: tl.constexpr,
                    FIRST: tl.constexpr, LAST: tl.constexpr, HEAD_GROUP: tl.constexpr, INTERP: tl.constexpr):
    if HEAD_GROUP == 1:
        t = tl.program_id(0)
        hd = tl.program_id(1)
    else:                           # launch order (module docstring): HEAD_GROUP heads' tiles interleaved, heaviest first
        nt = tl.num_programs(0)
        lin = tl.program_id(1) * nt + tl.program_id(0)                        # the order blocks are dispatched in
        w = lin % (HEAD_GROUP * nt)
        t = w // HEAD_GROUP
        hd = (lin // (HEAD_GROUP * nt)) * HEAD_GROUP + w % HEAD_GROUP
    b = tl.load(tile_seq_ptr + t)
    m0 = tl.load(tile_start_ptr + t)
    live = b >= 0
    b = tl.maximum(b, 0)
    ql = tl.where(live, tl.load(ql_ptr + b), 0)                               # surplus program: no rows
    ctx = tl.load(cl_ptr + b)
    qs = tl.load(cu_q_ptr + b)
    ks = tl.load(cu_k_ptr + b)

    rows = m0 + tl.arange(0, BLOCK_M)                                         # [BM] query offsets
    rmask = rows < ql
    qpos = ctx - ql + rows                                                    # [BM] positions
    first = ctx - ql + m0
    last = ctx - ql + tl.minimum(m0 + BLOCK_M, ql) - 1
    hi = tl.where(live, tl.minimum(last + 1, K1), K0)                         # keys of this chunk: [K0, hi)
    prow = (qs + rows).to(tl.int64)                                           # [BM] packed rows
    tok = tl.load(tok_ptr + prow, mask=rmask, other=0)
    q_rows = q_ptr + tok[:, None] * stride_qt + hd * stride_qh                # [BM, 1]
    d1 = tl.arange(0, DN1)
    q1 = tl.load(q_rows + d1[None, :], mask=rmask[:, None], other=0.0)        # [BM, DN1]
    q2 = q1
    qpe = q1
    if DN2 > 0:
        d2 = tl.arange(0, BLOCK_DN2)
        q2 = tl.load(q_rows + DN1 + d2[None, :], mask=rmask[:, None] & (d2 < DN2)[None, :], other=0.0)
    if DR > 0:
        dp = tl.arange(0, BLOCK_DR)
        qpe = tl.load(q_rows + DN1 + DN2 + dp[None, :], mask=rmask[:, None] & (dp < DR)[None, :], other=0.0)
    if INTERP:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        qpe = qpe.to(tl.float32)

    dv = tl.arange(0, BLOCK_DV)
    st = prow * H + hd                                                        # [BM] state rows
    if FIRST:
        # finite initial max: a row with no key yet adds exp2(-inf) = 0, never exp2(-inf - -inf) = NaN
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    else:
        m_i = tl.load(m_ptr + st, mask=rmask, other=-1.0e30)
        l_i = tl.load(l_ptr + st, mask=rmask, other=0.0)
        acc = tl.load(acc_ptr + st[:, None] * DV + dv[None, :], mask=rmask[:, None] & (dv < DV)[None, :], other=0.0)

    kv_head = kv_ptr + hd * stride_kvh
    col = hd * (DN1 + DN2 + DV)                                               # this head's k_nope | v (TMA)
    descs = (k1_desc, k2_desc, v_desc, pe_desc)
    if SPARSE:
        for n0 in range(K0, hi, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)                                 # [BN] positions
            kmask = kpos < hi
            # the tile's BN bits of a row are BNW whole words (BN >= 32) or part of one (BN < 32):
            # BM x BNW loads, spread over the tile in registers (not BM x BN gathers of repeated words)
            wi = n0 // 32 + tl.arange(0, BNW)                                  # [BNW] word of the row
            words = tl.load(bits_ptr + prow[:, None] * WORDS + wi[None, :],
                            mask=rmask[:, None] & (wi < WORDS)[None, :], other=0)     # [BM, BNW]
            if BNW == 1:
                words = tl.broadcast_to(words, (BLOCK_M, BLOCK_N))
            else:
                words = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_M, BNW, 32)), (BLOCK_M, BLOCK_N))
            picked = ((words >> (kpos % 32)[None, :]) & 1) != 0
            smask = picked & (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            krow = (ks + kpos - K0).to(tl.int64)
            if SKIP_EMPTY:
                if tl.max(tl.max(smask.to(tl.int32), 1), 0) > 0:              # a tile nobody picked: skip
                    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q1, q2, qpe, kv_head, pe_ptr, krow, stride_kvn, stride_pe,
                                                 descs, ks + n0 - K0, col, kmask, smask, qk_scale, DN1, DN2, BLOCK_DN2, DR,
                                                 BLOCK_DR, DV, BLOCK_DV, True, TMA, INTERP)
            else:                                                             # branch-free: the loads pipeline
                acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q1, q2, qpe, kv_head, pe_ptr, krow, stride_kvn, stride_pe,
                                             descs, ks + n0 - K0, col, kmask, smask, qk_scale, DN1, DN2, BLOCK_DN2, DR,
                                             BLOCK_DR, DV, BLOCK_DV, True, TMA, INTERP)
    else:
        # tiles whose keys are all <= the tile's first position: every row sees all of them, no mask
        full = tl.maximum(tl.minimum((first + 1) // BLOCK_N * BLOCK_N, hi), K0)
        for n0 in range(K0, full, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < hi
            krow = (ks + kpos - K0).to(tl.int64)
            acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q1, q2, qpe, kv_head, pe_ptr, krow, stride_kvn, stride_pe,
                                         descs, ks + n0 - K0, col, kmask, kmask[None, :], qk_scale, DN1, DN2, BLOCK_DN2, DR,
                                         BLOCK_DR, DV, BLOCK_DV, False, TMA, INTERP)
        for n0 in range(full, hi, BLOCK_N):                                   # the diagonal tiles
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < hi
            smask = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            krow = (ks + kpos - K0).to(tl.int64)
            acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q1, q2, qpe, kv_head, pe_ptr, krow, stride_kvn, stride_pe,
                                         descs, ks + n0 - K0, col, kmask, smask, qk_scale, DN1, DN2, BLOCK_DN2, DR,
                                         BLOCK_DR, DV, BLOCK_DV, True, TMA, INTERP)

    omask = rmask[:, None] & (dv < DV)[None, :]
    if LAST:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]                      # no key at all -> 0
        tl.store(o_ptr + prow[:, None] * stride_ot + hd * stride_oh + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(m_ptr + st, m_i, mask=rmask)
        tl.store(l_ptr + st, l_i, mask=rmask)
        tl.store(acc_ptr + st[:, None] * DV + dv[None, :], acc, mask=omask)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def selection_bits(indices: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """DSA indices [B, Qmax, k] int32 (-1 = none) -> the bitmap [Tg, ceil(max_context_len / 32)] int32
    of each packed query's selected positions (padded query slots, -1 and positions >= the width are
    dropped; duplicates are harmless)."""
    B, qmax, k = indices.shape
    words = triton.cdiv(plan.max_context_len, 32)
    bits = torch.zeros(plan.num_tokens, words, dtype=torch.int32, device=indices.device)
    if k == 0 or plan.num_tokens == 0:
        return bits
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    _selection_bits_kernel[(B * qmax,)](indices, bits, plan.cu_q, plan.query_lens, qmax, k, words,
                                        indices.stride(0), indices.stride(1),
                                        BLOCK_K=min(BITS_BLOCK, triton.next_power_of_2(k)), num_warps=4)
    return bits


def mla_prefill_varlen(q: torch.Tensor, kv_cache: torch.Tensor, kv_b: Callable[[torch.Tensor], torch.Tensor],
                       plan: PrefillPlan, *, kv_lora_rank: int, v_head_dim: int, scale: float,
                       indices: torch.Tensor | None = None, bits: torch.Tensor | None = None,
                       config: tuple[int, int, int, int] | None = None,
                       tiles: SparseTiles = SparseTiles(), out: torch.Tensor | None = None,
                       key_descriptors: Callable | None = None, head_group: int | None = None) -> torch.Tensor:
    """Naive MLA prefill of the group `plan` describes.

    q [T, h, dn+dr] rows of the whole step (bf16/fp16; unit last stride); kv_cache [S, r+dr] same
    dtype, unit last stride; kv_b: latents [N, r] (row-strided view) -> [N, h*(dn+dv)] (rows grouped
    per head: dn key dims then dv value dims). indices None: dense causal; else [B, Qmax, k] int32
    positions (-1 = none), attended AND causal; or bits: the same selection as the bitmap [Tg, ceil(max_context_len
    / 32)] int32 the kernel reads (`SelectionBits.bits`, packed rows; no index list to convert). config: (BLOCK_M, BLOCK_N, num_warps, num_stages),
    BLOCK_M / BLOCK_N equal to the plan's; tiles: the sparse walk (`SparseTiles`). Returns o [Tg, h, dv]
    in q.dtype, in the packed order: `out` when given (any row / head strides, unit last stride), which the kernel
    writes directly. key_descriptors: the key tiles (k_nope, v, k_pe) load as TMA boxes through the host-side tensor
    descriptors this makes (`tma.mla_key_descriptors`, NVIDIA only) instead of pointer tiles, where the buffers'
    strides allow (`key_tma_ok`). head_group: heads whose tiles are dispatched interleaved (`head_group`'s default).
    """
    T, h, dq = q.shape
    r, dv = kv_lora_rank, v_head_dim
    dr = kv_cache.shape[1] - r
    dn = dq - dr
    block_m, block_n, num_warps, num_stages = config or _config(dq, dv)
    assert (block_m, block_n) == (plan.block_m, plan.block_n), (config, plan.block_m, plan.block_n)
    hg = default_head_group(h) if head_group is None else head_group
    assert hg >= 1 and h % hg == 0, (h, hg)
    assert kv_cache.dim() == 2 and kv_cache.dtype == q.dtype and kv_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert dn >= MIN_DOT and dr >= 0 and dv >= 1, (dn, dr, dv)
    Tg = plan.num_tokens
    if out is None:
        out = torch.empty(Tg, h, dv, dtype=q.dtype, device=q.device)         # [Tg, h, dv]
    assert out.shape == (Tg, h, dv) and out.dtype == q.dtype and out.stride(-1) == 1, (out.shape, out.dtype)
    if Tg == 0 or h == 0:
        return out
    dn1, dn2, block_dn2 = _dn_split(dn)
    sparse = indices is not None or bits is not None
    if indices is not None:
        assert bits is None, "indices or bits, not both"
        bits = selection_bits(indices, plan)                                   # [Tg, W]
    elif bits is not None:
        assert bits.shape == (Tg, triton.cdiv(plan.max_context_len, 32)) and bits.stride(-1) == 1, bits.shape
    words = bits.shape[1] if sparse else 0
    bits = bits if sparse else out                                            # (unused pointer when dense)
    n_chunks = len(plan.chunks)
    if n_chunks > 1:                                                          # online-softmax state across chunks
        m_st = torch.empty(Tg, h, dtype=torch.float32, device=q.device)
        l_st = torch.empty(Tg, h, dtype=torch.float32, device=q.device)
        acc_st = torch.empty(Tg, h, dv, dtype=torch.float32, device=q.device)
    else:
        m_st = l_st = acc_st = out                                            # unused pointers
    consts = dict(DN1=dn1, DN2=dn2, BLOCK_DN2=block_dn2, DR=dr,
                  BLOCK_DR=max(MIN_DOT, triton.next_power_of_2(dr)) if dr else 0, DV=dv,
                  BLOCK_DV=max(MIN_DOT, triton.next_power_of_2(dv)), BLOCK_M=block_m, BLOCK_N=block_n,
                  SPARSE=sparse, SKIP_EMPTY=tiles.skip_empty, BNW=max(1, block_n // 32), HEAD_GROUP=hg,
                  INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    for ci, ch in enumerate(plan.chunks):                                     # key chunks (usually one)
        rows = kv_cache[ch.slots]                                             # [N, r+dr] gathered latents
        if ch.pad is not None:
            rows.masked_fill_(ch.pad[:, None], 0)                             # rows past the packed total
        kv = kv_b(rows[:, :r])
        kv = (kv if kv.dtype == q.dtype else kv.to(q.dtype)).reshape(ch.rows, h, dn + dv)   # [N, h, dn+dv]
        if kv.stride(-1) != 1:
            kv = kv.contiguous()
        pe = rows[:, r:] if dr else rows                                      # [N, dr] shared by heads
        descs = None
        if key_descriptors is not None and key_tma_ok(kv, pe):
            descs = key_descriptors(kv, pe, block_n, dn1, consts["BLOCK_DN2"], consts["BLOCK_DR"], consts["BLOCK_DV"])
        _prefill_kernel[(plan.num_tiles, h)](
            q, plan.token_index, kv, pe, bits, out, m_st, l_st, acc_st,
            plan.cu_q, plan.query_lens, plan.context_lens, ch.cu_k, plan.tile_seq, plan.tile_start,
            *(descs or (None,) * 4),
            h, ch.k0, ch.k1, words, float(scale) * LOG2E,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), rows.stride(0), out.stride(0), out.stride(1),
            TMA=descs is not None, FIRST=ci == 0, LAST=ci == n_chunks - 1, **consts)
    return out


def key_tma_ok(kv: torch.Tensor, pe: torch.Tensor) -> bool:
    """Host-side tensor descriptors need 16-byte aligned bases and row strides (and unit last strides)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in (kv, pe))



def mla_prefill_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttnGroup,
                      selection: torch.Tensor | SelectionBits | None,
                      kv_b: Callable[[torch.Tensor], torch.Tensor], *, kv_lora_rank: int, v_head_dim: int,
                      scale: float, max_bytes: int, config: tuple[int, int, int, int] | None = None,
                      tiles: SparseTiles = SparseTiles(), out: torch.Tensor | None = None,
                      key_descriptors: Callable | None = None, head_group: int | None = None) -> torch.Tensor:
    """The `mla_prefill` op on one group (the torch reference's arguments; selection None, int32 indices
    [B, Qmax, k] or the indexer's `SelectionBits`; `out` the [Tg, h, dv] destination). The group's plan is built
    on first use and shared by every layer."""
    h, dq = q.shape[1], q.shape[2]
    r, dv = kv_lora_rank, v_head_dim
    dr = kv_cache.shape[1] - r
    cfg = config or _config(dq, dv)
    chunk = chunk_keys(group.num_seqs, h, dq - dr, dv, r + dr, kv_cache.element_size(), max_bytes, cfg[1],
                       group.max_context_len)
    plan = group.plan(("mla_prefill", cfg[0], cfg[1], chunk), lambda: prefill_plan(
        group.block_table, group.context_lens, group.query_lens, group.token_index, group.block_size,
        group.max_context_len, block_m=cfg[0], block_n=cfg[1], chunk=chunk))
    bits = selection.bits if isinstance(selection, SelectionBits) else None
    return mla_prefill_varlen(q, kv_cache, kv_b, plan, kv_lora_rank=r, v_head_dim=dv, scale=scale,
                              indices=selection if bits is None else None, bits=bits, config=cfg, tiles=tiles,
                              out=out, key_descriptors=key_descriptors, head_group=head_group)


__all__ = ["KeyChunk", "PrefillPlan", "SparseTiles", "chunk_keys", "default_head_group", "mla_prefill_group",
           "mla_prefill_varlen", "prefill_plan", "selection_bits"]
