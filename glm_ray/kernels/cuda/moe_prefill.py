"""Prefill-size block-FP8 routed experts for the `cuda` backend: the grouped MoE with a contiguous, pre-quantized
activation operand and gate + up in ONE accumulator (this module imports triton).

`fused_moe_prefill` computes the math of `fused_moe_triton(w_mode="fp8")` (triton_kernels.py) and of the torch
reference `torch_ref.quant_ops.fused_moe_block_fp8` (W8A8: 1x128 activations, 128x128 weight blocks with per-half
w13 scales) in five launches:

1. `moe_align_auto` (moe_align.py): pairs sorted by expert, each expert's run padded to BM rows.
2. `_sorted_quant_kernel`: x's rows gathered into that sorted order AND quantized per 1x128 in one pass ->
   A [EM, DG*128] e4m3 (row r = pair sorted_ids[r]; pad rows and pad columns zero) and its scales [DG, EM] fp32
   (K-block-major: the GEMM's per-step [BM] scale load is contiguous). The GEMMs then read A as plain 2-D tiles
   (TMA-able), DeepGEMM's "contiguous" grouped layout, instead of gathering token rows per K step.
3. `_up_kernel`: per (BM rows of one expert, 128 intermediate columns) ONE [BM, 256] fp32 accumulator whose
   columns are the 128 gate rows then the 128 matching up rows of w13[e] (the separated checkpoint halves: the
   B tile's columns are two 128-row runs, each one scale block, so no re-layout or second copy of the experts
   is needed; the TMA form loads them as one [2, 128, BK] box of w13 viewed [E*2, I', D']). One dot of N = 256
   per K step, promoted into the fp32 accumulator with the folded scale (a_s[BM] x (gate | up scale)[256])
   (DeepGEMM's per-K-block promotion); the epilogue splits the accumulator into gate and up, applies the
   (clamped) SiLU-GLU and re-quantizes per 1x128 (the tile row is one group) into inter [EM, IG*128] e4m3 +
   [IG, EM] scales, still in sorted order.
4. `_down_kernel`: inter (contiguous rows) x w2[e]^T, promoted the same way, times the routing weight, stored
   per pair (a row scatter) in x.dtype.
5. `_combine_kernel`: out[t] = sum_k out_pairs[t*K + k] in fp32 (deterministic: no atomics), in x.dtype.

The scale product is formed before it meets the dot result: a thread's accumulator elements share one row pair
and one 128-column half, so ptxas keeps two products a thread and each element costs one FFMA, where the old
kernels' `dot * a_s * w_s` costs an FMUL and an FFMA (sm_90a SASS, Triton 3.6). Numerically a_s * w_s is
rounded once in fp32 first (an ulp-level difference from the old kernels' order). Triton still waits for each
step's wgmma before promoting it (one `wgmma.wait_group 0` a K step, down from two in the old up kernel).

The old grouped kernels stay for decode-to-mid sizes and as the fallback (ops.py chooses by pairs per expert,
GLM_RAY_CUDA_MOE_PREFILL_ROWS). Tiles
come from `layout.moe_prefill_configs` (or the caller: bench/moe_prefill.py sweeps them). A config's `tma` makes
a stage load its operands through host-side tensor descriptors (`triton.tools.tensor_descriptor`) instead of
pointer tiles; the interpreter runs both forms. A config's `persistent` (programs an SM) launches that many programs
(Triton's persistent matmul): each strides over the used tiles — their count read on the device — in one flattened
loop, so the loads of its next tile are in flight under this tile's epilogue (the SwiGLU, the re-quantization and the
stores, during which the tensor cores of a one-CTA-an-SM kernel idle) and no program is launched for the rows past
`num_post_pad`. sm_90a compile (Triton 3.6): 246 registers, 184 KiB of shared memory at 3 stages (the epilogue's
layout exchange no longer shares the pipeline's buffers), so one CTA an SM.

CUDA graphs: every grid and constexpr comes from shapes (EM = the alignment's static row bound), the used row
count `num_post_pad` is read on the device and programs past it exit; no host syncs. Under `TRITON_INTERPRET=1`
(CPU tests) dot operands are upcast to fp32 and the per-pair output is fp32, as in triton_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from glm_ray.kernels.cuda.layout import TileConfig, cdiv, moe_prefill_configs, num_sms
from glm_ray.kernels.cuda.moe_align import moe_align_auto
from glm_ray.kernels.cuda.triton_kernels import (
    ACT_EPS,
    FP8_MAX,
    INTERPRET,
    _fp8_group_quant,
    _store_pair_rows,
    _swizzle,
    in_token_chunks,
    pair_chunk_tokens,
)

GROUP = 128                      # 1x128 activation groups, 128x128 weight blocks
FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=['P', 'EM'])   # sizes that change per step: no recompiles (cuda/__init__)
def _sorted_quant_kernel(x_ptr, q_ptr, s_ptr, sorted_ptr, npost_ptr, P, EM, D, stride_xm, stride_qm, eps, fmax,
                         TOPK: tl.constexpr, UE8M0: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr):
    """q[r, g*128:(g+1)*128], s[g, r] = quant(x[sorted[r] // TOPK, group g]) for sorted rows r < npost; pad rows
    (sorted[r] == P) and columns >= D are written as zeros."""
    r0 = tl.program_id(0) * ROWS
    g = tl.program_id(1)
    npost = tl.load(npost_ptr)
    if r0 >= npost:
        return
    rows = r0 + tl.arange(0, ROWS)                                               # [ROWS] sorted rows
    live = rows < npost
    pair = tl.load(sorted_ptr + rows, mask=live, other=P)
    valid = pair < P
    tok = (pair // TOPK).to(tl.int64)
    cols = g * 128 + tl.arange(0, 128)                                           # [128]
    x = tl.load(x_ptr + tok[:, None] * stride_xm + cols[None, :], mask=valid[:, None] & (cols < D)[None, :],
                other=0.0).to(tl.float32)                                        # [ROWS, 128]
    q, s = _fp8_group_quant(x, eps, fmax, UE8M0, INTERP)
    s = tl.where(valid, s, 0.0)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], q, mask=live[:, None])
    tl.store(s_ptr + g * EM + rows, s, mask=live)


@triton.jit(do_not_specialize=['EM'])   # sizes that change per step: no recompiles (cuda/__init__)
def _up_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, os_ptr, eid_ptr, npost_ptr,
               EM, K, N, HALF, SHALF,
               stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
               limit, eps, fmax,
               UE8M0: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PERSISTENT: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, GROUP_M: tl.constexpr):
    """inter[r, n] = requant(silu_glu(A[r] . w13[e, n], A[r] . w13[e, HALF + n])) for sorted rows r of one expert
    e and n in a 128-column block (< N = real I). K = w13's row length (D'); HALF = I'; SHALF = scale block rows
    of one half. TMA: a_ptr is a descriptor of A [EM, DG*128] (block [BM, BK]) and w_ptr one of w13 viewed
    [E*2, I', D'] (block [2, 128, BK]). PERSISTENT: the programs stride over the used tiles (module docstring)."""
    num_n = tl.cdiv(N, 128)
    if PERSISTENT:
        num_m = tl.cdiv(tl.load(npost_ptr), BM)                                  # used row tiles only
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _swizzle(tile, num_m, num_n, GROUP_M)
            _up_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, os_ptr, eid_ptr, EM, K, N, HALF, SHALF,
                     stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, limit, eps, fmax,
                     UE8M0, HAS_LIMIT, INTERP, TMA, EVEN_K, EVEN_N, BM, BK, KB)
    else:
        pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(EM, BM), num_n, GROUP_M)
        if pid_m * BM < tl.load(npost_ptr):
            _up_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, os_ptr, eid_ptr, EM, K, N, HALF, SHALF,
                     stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, limit, eps, fmax,
                     UE8M0, HAS_LIMIT, INTERP, TMA, EVEN_K, EVEN_N, BM, BK, KB)


@triton.jit
def _up_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, os_ptr, eid_ptr, EM, K, N, HALF, SHALF,
             stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, limit, eps, fmax,
             UE8M0: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr,
             EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr):
    """One (BM sorted rows, 128 intermediate columns) tile of `_up_kernel`."""
    BNH: tl.constexpr = 128                                                      # one half: a scale block, a group
    BN: tl.constexpr = 2 * BNH                                                   # gate columns, then up columns
    r0 = pid_m * BM
    e32 = tl.load(eid_ptr + pid_m)
    e = e32.to(tl.int64)
    rows = r0 + tl.arange(0, BM)                                                 # [BM] sorted rows
    offs_k = tl.arange(0, BK)
    c = tl.arange(0, BN)
    is_up = c >= BNH                                                             # [BN]
    j = pid_n * BNH + (c % BNH)                                                  # [BN] intermediate column
    n_ok = j < N
    ws_g = ws_ptr + e * stride_wse + pid_n * stride_wsn                          # gate scale row of this block
    ws_u = ws_g + SHALF * stride_wsn                                             # up scale row
    if not TMA:
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]              # [BM, BK]
        b_cols = w_ptr + e * stride_we + (j + tl.where(is_up, HALF, 0))[None, :] * stride_wn   # [1, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):                     # KB = cdiv(D, BK), constexpr (see triton_kernels.py)
        k0 = kb * BK
        if TMA:
            a = a_ptr.load([r0, k0])                                             # [BM, BK]
            b = tl.trans(tl.reshape(w_ptr.load([2 * e32, pid_n * BNH, k0]), (BN, BK)))          # [BK, BN]
        else:
            a = tl.load(a_rows + k0)                                             # A is zero-padded to KB * BK
            kk = k0 + offs_k
            if EVEN_K and EVEN_N:
                b = tl.load(b_cols + kk[:, None])                                # [BK, BN]
            else:
                b = tl.load(b_cols + kk[:, None], mask=(kk < K)[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + kb * EM + rows)                                   # [BM]
        w_s = tl.where(is_up, tl.load(ws_u + kb), tl.load(ws_g + kb))            # [BN]
        if INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])         # one FFMA an element (module docstring)
    g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BNH)), (0, 2, 1)))        # [BM, BNH] each
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u                                                    # [BM, BNH] fp32
    jn = pid_n * BNH + tl.arange(0, BNH)
    if not EVEN_N:
        h = tl.where((jn < N)[None, :], h, 0.0)
    q, s = _fp8_group_quant(h, eps, fmax, UE8M0, INTERP)                         # [BM, 128] e4m3, [BM]
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_om + jn[None, :], q)    # inter has IG * 128 columns
    tl.store(os_ptr + pid_n * EM + rows, s)


@triton.jit(do_not_specialize=['P', 'EM'])   # sizes that change per step: no recompiles (cuda/__init__)
def _down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
                 P, EM, N, K,
                 stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                 INTERP: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 PERSISTENT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair(r), n] = tw[pair(r)] * sum_k inter[r, k] w2[e, n, k] for the sorted rows r of one expert e, n < N
    (real D), k < KB * BK (inter is zero past the real I). K = w2's row length (I'). TMA: a_ptr is a descriptor
    of inter [EM, IG*128] (block [BM, BK]) and w_ptr one of w2 [E, D', I'] (block [1, BN, BK]). PERSISTENT: the
    programs stride over the used tiles."""
    num_n = tl.cdiv(N, BN)
    if PERSISTENT:
        num_m = tl.cdiv(tl.load(npost_ptr), BM)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _swizzle(tile, num_m, num_n, GROUP_M)
            _down_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, tw_ptr, sorted_ptr, eid_ptr, P, EM, N, K,
                       stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                       INTERP, TMA, EVEN_K, EVEN_N, BM, BN, BK, KB)
    else:
        pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(EM, BM), num_n, GROUP_M)
        if pid_m * BM < tl.load(npost_ptr):
            _down_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, tw_ptr, sorted_ptr, eid_ptr, P, EM, N, K,
                       stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                       INTERP, TMA, EVEN_K, EVEN_N, BM, BN, BK, KB)


@triton.jit
def _down_tile(pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, tw_ptr, sorted_ptr, eid_ptr, P, EM, N, K,
               stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
               INTERP: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr):
    """One (BM sorted rows, BN output columns) tile of `_down_kernel`."""
    r0 = pid_m * BM
    e32 = tl.load(eid_ptr + pid_m)
    e = e32.to(tl.int64)
    rows = r0 + tl.arange(0, BM)                                                 # [BM] sorted rows
    offs_k = tl.arange(0, BK)
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)                                               # [BN]
    n_ok = offs_n < N
    ws_lo = ws_ptr + e * stride_wse + (n0 // 128) * stride_wsn                   # scale row of columns n0..
    if not TMA:
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]               # [BM, BK]
        b_cols = w_ptr + e * stride_we + offs_n[None, :] * stride_wn                            # [1, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):                     # KB = cdiv(I, BK), constexpr (see triton_kernels.py)
        k0 = kb * BK
        if TMA:
            a = a_ptr.load([r0, k0])                                             # [BM, BK]
            b = tl.trans(tl.reshape(w_ptr.load([e32, n0, k0]), (BN, BK)))        # [BK, BN]
        else:
            a = tl.load(a_rows + k0)
            kk = k0 + offs_k
            if EVEN_K and EVEN_N:
                b = tl.load(b_cols + kk[:, None])
            else:
                b = tl.load(b_cols + kk[:, None], mask=(kk < K)[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + kb * EM + rows)                                   # [BM]
        if BN > 128:                                                             # two 128-row scale blocks
            s_hi = tl.load(ws_lo + stride_wsn + kb, mask=n0 + 128 < N, other=0.0)
            b_s = tl.where(tl.arange(0, BN) >= 128, s_hi, tl.load(ws_lo + kb))   # [BN]
        else:
            b_s = tl.load(ws_lo + kb)                                            # BN | 128: one scale
        if INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if BN > 128:
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
    pair = tl.load(sorted_ptr + rows)
    _store_pair_rows(o_ptr, acc, pair.to(tl.int64), pair < P, offs_n, n_ok, stride_om, tw_ptr, True)


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _combine_kernel(y_ptr, o_ptr, T, D, stride_ym, stride_om, TOPK: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    """o[t, :] = sum_k y[t * TOPK + k, :] in fp32, slot order."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    m = (rows < T)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (rows64 * TOPK + k)[:, None] * stride_ym + cols[None, :], mask=m,
                       other=0.0).to(tl.float32)
    tl.store(o_ptr + rows64[:, None] * stride_om + cols[None, :], acc.to(o_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def sorted_act_quant(x: torch.Tensor, sorted_ids: torch.Tensor, num_post_pad: torch.Tensor, top_k: int, em: int,
                     *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (q [EM, DG*128] e4m3, s [DG, EM] fp32): row r is x[sorted_ids[r] // top_k] quantized per
    1x128 for r < num_post_pad (device count); pad pairs (id == T*top_k) and columns >= D are zeros; rows at or
    past num_post_pad are not written."""
    t, d = x.shape
    dg = cdiv(d, GROUP)
    q = torch.empty(em, dg * GROUP, dtype=FP8, device=x.device)                 # [EM, DG*128]
    s = torch.empty(dg, em, dtype=torch.float32, device=x.device)               # [DG, EM]
    rows = 32
    if em:
        _sorted_quant_kernel[(cdiv(em, rows), dg)](x, q, s, sorted_ids, num_post_pad, t * top_k, em, d, x.stride(0),
                                                   q.stride(0), ACT_EPS, FP8_MAX, TOPK=top_k, UE8M0=ue8m0,
                                                   INTERP=INTERPRET, ROWS=rows, num_warps=4)
    return q, s


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Host-side tensor descriptors need 16-byte aligned bases and leading strides."""
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)


def _up(aq, a_s, w13, ws13, inter, inter_s, al, k_real, n_real, cfg: TileConfig, *, ue8m0, limit):
    em = al.max_blocks * al.block_m
    half = w13.shape[1] // 2                                                     # I'
    kb = cdiv(k_real, cfg.block_k)
    e, _, dp = w13.shape
    tma = cfg.tma and _tma_ok(aq, w13)
    a_arg, w_arg = aq, w13
    if tma:
        a_arg = TensorDescriptor(aq, list(aq.shape), list(aq.stride()), [cfg.block_m, cfg.block_k])
        w3 = w13.view(e * 2, half, dp)                                           # [E*2, I', D']: gate, up halves
        w_arg = TensorDescriptor(w3, list(w3.shape), list(w3.stride()), [2, GROUP, cfg.block_k])
    grid = _grid(cdiv(em, cfg.block_m) * cdiv(n_real, GROUP), cfg, aq.device)
    _up_kernel[grid](
        a_arg, a_s, w_arg, ws13, inter, inter_s, al.expert_ids, al.num_post_pad,
        em, dp, n_real, half, ws13.shape[1] // 2,
        aq.stride(0), w13.stride(0), w13.stride(1), ws13.stride(0), ws13.stride(1), inter.stride(0),
        float(limit) if limit is not None else 0.0, ACT_EPS, FP8_MAX,
        UE8M0=ue8m0, HAS_LIMIT=limit is not None, INTERP=INTERPRET, TMA=tma,
        EVEN_K=kb * cfg.block_k <= dp, EVEN_N=n_real % GROUP == 0, PERSISTENT=cfg.persistent > 0,
        BM=cfg.block_m, BK=cfg.block_k, KB=kb, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_launch_options(cfg))


def _grid(tiles: int, cfg: TileConfig, device: torch.device) -> tuple[int]:
    """One program a tile (the static bound; programs past the device's row count exit), or a persistent config's
    programs an SM (never more than the tiles)."""
    if cfg.persistent <= 0:
        return (tiles,)
    return (max(1, min(tiles, cfg.persistent * num_sms(device))),)


def _launch_options(cfg: TileConfig) -> dict:
    """Compile options a config sets beyond warps and stages (Triton keys its cache on them)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def _down(inter, inter_s, w2, ws2, out, tw, al, num_pairs, n_real, k_real, cfg: TileConfig):
    em = al.max_blocks * al.block_m
    kb = cdiv(k_real, cfg.block_k)
    _, dp, ip = w2.shape
    tma = cfg.tma and _tma_ok(inter, w2)
    a_arg, w_arg = inter, w2
    if tma:
        a_arg = TensorDescriptor(inter, list(inter.shape), list(inter.stride()), [cfg.block_m, cfg.block_k])
        w_arg = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [1, cfg.block_n, cfg.block_k])
    grid = _grid(cdiv(em, cfg.block_m) * cdiv(n_real, cfg.block_n), cfg, inter.device)
    _down_kernel[grid](
        a_arg, inter_s, w_arg, ws2, out, tw, al.sorted_ids, al.expert_ids, al.num_post_pad,
        num_pairs, em, n_real, ip,
        inter.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), ws2.stride(1), out.stride(0),
        INTERP=INTERPRET, TMA=tma, EVEN_K=kb * cfg.block_k <= ip, EVEN_N=n_real % cfg.block_n == 0,
        PERSISTENT=cfg.persistent > 0, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, KB=kb, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_launch_options(cfg))


def combine_pairs(out_pairs: torch.Tensor, t: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """out_pairs [T*K, D] -> [T, D] dtype: the K slots of each token summed in fp32 (slot order)."""
    d = out_pairs.shape[1]
    odt = torch.float32 if INTERPRET else dtype      # the interpreter's fp32->bf16 store rounding is inexact
    out = torch.empty(t, d, dtype=odt, device=out_pairs.device)                 # [T, D]
    rows, cols = 16, 256
    _combine_kernel[(cdiv(t, rows), cdiv(d, cols))](out_pairs, out, t, d, out_pairs.stride(0), out.stride(0),
                                                    TOPK=top_k, ROWS=rows, COLS=cols, num_warps=4)
    return out if odt == dtype else out.to(dtype)


def check_configs(cfg1: TileConfig, cfg2: TileConfig) -> None:
    """The constraints of the two prefill kernels (raises ValueError)."""
    if cfg1.block_m != cfg2.block_m:
        raise ValueError(f"stage 1 and 2 share one alignment: BM {cfg1.block_m} != {cfg2.block_m}")
    if cfg1.block_n != 2 * GROUP or cfg1.block_k != GROUP or cfg2.block_k != GROUP:
        raise ValueError(f"FP8 prefill: stage 1 BN must be 256 (128 gate + 128 up rows) and BK 128, got "
                         f"{cfg1.block_n}/{cfg1.block_k}; stage 2 BK 128, got {cfg2.block_k}")
    if cfg2.block_n not in (64, 128, 256):
        raise ValueError(f"FP8 prefill: stage 2 BN must be 64, 128 or 256, got {cfg2.block_n}")


def fused_moe_prefill(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor, hidden_pad: int = 0,
                      intermediate_pad: int = 0, swiglu_limit: float | None = None, act_ue8m0: bool = False,
                      configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """Block-FP8 routed experts (module docstring), the arguments of `fused_moe_triton(w_mode="fp8")`:
    x [T, D] bf16/fp16; w13 [E, 2I', D'] e4m3 (gate rows then up rows, K-contiguous), w13_scale
    [E, 2*ceil(I'/128), ceil(D'/128)] fp32 (gate block rows then up); w2 [E, D', I'] e4m3, w2_scale
    [E, ceil(D'/128), ceil(I'/128)]; topk_weights [T, K], topk_ids [T, K] int -> [T, D] x.dtype.
    D' = D + hidden_pad, I' = I + intermediate_pad (pad rows / columns are zeros). `configs` overrides
    `layout.moe_prefill_configs`."""
    t, d = x.shape
    k = topk_ids.shape[1]
    if t == 0:
        return x.new_zeros(t, d)
    if t > pair_chunk_tokens(k):
        return in_token_chunks(fused_moe_prefill, x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                               w2_scale=w2_scale, hidden_pad=hidden_pad, intermediate_pad=intermediate_pad,
                               swiglu_limit=swiglu_limit, act_ue8m0=act_ue8m0, configs=configs)
    e = w13.shape[0]
    i_real = w13.shape[1] // 2 - intermediate_pad
    p = t * k
    cfg1, cfg2 = configs or moe_prefill_configs(p, e)
    check_configs(cfg1, cfg2)
    al = moe_align_auto(topk_ids, e, cfg1.block_m)
    em = al.max_blocks * al.block_m
    x = x.contiguous()
    aq, a_s = sorted_act_quant(x, al.sorted_ids, al.num_post_pad, k, em, ue8m0=act_ue8m0)   # [EM, DG*128], [DG, EM]
    ig = cdiv(i_real, GROUP)
    inter = torch.empty(em, ig * GROUP, dtype=FP8, device=x.device)             # [EM, IG*128] sorted rows
    inter_s = torch.empty(ig, em, dtype=torch.float32, device=x.device)         # [IG, EM]
    _up(aq, a_s, w13, w13_scale, inter, inter_s, al, d, i_real, cfg1, ue8m0=act_ue8m0, limit=swiglu_limit)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()                # [P]
    out_pairs = torch.empty(p, d, dtype=torch.float32 if INTERPRET else x.dtype, device=x.device)   # [P, D]
    _down(inter, inter_s, w2, w2_scale, out_pairs, tw, al, p, d, i_real, cfg2)
    return combine_pairs(out_pairs, t, k, x.dtype)
