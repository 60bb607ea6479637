"""Decode-size routed experts for the `cuda` backend: two Triton launches, no token sorting (this module
imports triton).

`fused_moe_decode` computes exactly the math of `fused_moe_triton` (triton_kernels.py) and of the torch
references (`torch_ref.fused_moe` for bf16/fp16, `torch_ref.quant_ops.fused_moe_block_fp8` for block-FP8
W8A8) without `moe_align`'s ~10 small sorting ops, whose launches cost more than the math when T*K is
a few dozen (T = 1..16 decode tokens, K = 4 or 8), and without BM = 16-row tiles that hold one real row:

* `_decode_up_kernel` (stage 1), grid (T*K pairs, cdiv(I, BN1)): the program reads its pair's expert
  e = topk_ids[t, k] on the device, streams the gate rows AND the up rows of w13[e] for BN1 intermediate
  columns against x[t], and applies the (clamped) SiLU-GLU in fp32. fp8: x[t] is quantized per 1x128 in
  registers with `_fp8_group_quant` (bit-exact with `act_quant_fp8` and the reference quantizer), the
  weights are scaled by their 128x128 block scales (per half: gate block rows then up block rows), and
  the intermediate is written re-quantized per 1x128 (e4m3 + fp32 scale; BN1 = 128 makes the tile's
  row one group), exactly the grouped path's OUT_FP8 epilogue. When the pairs are too few for 128-wide
  tiles to fill the SMs (T = 1..2 at K = 4: 48-96 programs on 132 SMs), BN1 shrinks to 64 / 32 and the
  intermediate is written in fp32 instead; stage 2 then quantizes it per 1x128 in registers with the same
  quantizer (same fp32 values in, same e4m3 bits and scales out: bit-equal under the interpreter; compiled,
  the in-tile reduction order may differ with BN1 in the last fp32 bit). bf16: the intermediate is
  stored in x.dtype (fp32 under the interpreter, as the grouped path does).
* `_decode_down_kernel` (stage 2), grid (T, cdiv(D, BN2)): for each of the token's K slots in order,
  inter[t, k] . w2[e] for BN2 output columns, times the routing weight, summed in fp32 (the combine is
  fused; no atomics, so the result is deterministic), stored in x.dtype. The K slots and the I blocks
  run as ONE flat loop (K * KB iterations) so the weight stream is software-pipelined across slots;
  the K expert ids and weights are loaded once as a vector and selected per iteration in registers
  (no dependent scalar load in front of each weight tile).

GEMV, not `tl.dot`: a pair is one row, so a 16-row MMA tile would be 15/16 zeros and would need the x
row staged as a padded operand. The kernels instead multiply the [BN, BK] weight tile by the x row
elementwise and `tl.sum` over BK on the CUDA cores, in fp32: at 2 FLOP per weight element the H200's
~60 fp32 TFLOP/s are far above what 4.2 TB/s of weights can feed (fp8: 8.4 TFLOP/s, bf16: 4.2), and
the sums are plain fp32 (no fp8-MMA accumulator precision question). Since no load feeds a dot, the
loops use `tl.range(..., num_stages=S)`: Triton then pipelines the weight loads (cp.async into shared
memory, S - 1 tiles in flight per program) even without a dot. fp8 tiles span BK = G * 128 columns
(G scale groups per step), reduced per group and scaled by a [G] vector of scales.

Intended for T*K <= ~64 pairs: every pair streams its expert's w13 slice and every token streams its K
experts' w2 slices, so an expert chosen by several tokens is read once per pair (the L2 catches some of
it when those programs run in the same wave: the grid's fastest axis is the pair / token). The grouped
path reads each touched expert once per BM-row block; at GLM-5 routing (E = 256, K = 8) the expected
re-read factor T*K / E[distinct experts] is ~1.1 at T = 8 but ~2.3 at T = 64, so past a few dozen pairs
the alignment launches are cheaper than the extra weight bytes. Nothing here asserts on T: the lead's
dispatch threshold decides (glm_ray.bench.moe_decode measures the crossover).

Everything is CUDA-graph capturable: grids and constexprs come from tensor shapes (and the device's SM
count), the expert ids are read only inside the kernels, no host syncs. Under `TRITON_INTERPRET=1` the
kernels run on CPU (constexpr trip counts; fp32 stage outputs, cast by torch, as in triton_kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import DEFAULT_SMS, cdiv, num_sms
from glm_ray.kernels.cuda.triton_kernels import ACT_EPS, FP8_MAX, INTERPRET, _fp8_group_quant

FP8_GROUP = 128                  # 1x128 activation groups, 128x128 weight blocks


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _decode_up_kernel(x_ptr, w_ptr, ws_ptr, ids_ptr, o_ptr, os_ptr,
                      D, N, HALF, SHALF, DG,
                      stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
                      limit, eps, fmax,
                      FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr,
                      TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
                      STAGES: tl.constexpr, REQUANT: tl.constexpr):
    """inter[p, n] = silu_glu(x[t] . w13[e, n], x[t] . w13[e, HALF + n]) for the pair p = t * TOPK + k,
    e = ids[p], n < N (= real I). D = real hidden size, DG = cdiv(D, 128); HALF = I' (row offset of the
    up half); SHALF = scale block rows of one half. fp8: G = BK / 128 groups per K step; REQUANT (BN = 128)
    writes inter re-quantized per 1x128, else (BN < 128: a tile holds part of a group) in fp32, and
    stage 2 quantizes it with the same quantizer."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = p // TOPK
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    x_row = x_ptr + t.to(tl.int64) * stride_xm
    g_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn                  # [BN, 1] gate rows of w13[e]
    u_rows = g_rows + HALF * stride_wn                                             # [BN, 1] up rows
    acc_g = tl.zeros((BN,), dtype=tl.float32)
    acc_u = tl.zeros((BN,), dtype=tl.float32)
    for kb in tl.range(0, KB, num_stages=STAGES):     # KB = cdiv(D, BK), constexpr (see triton_kernels.py)
        kk = kb * BK + offs_k
        k_ok = kk < D
        wm = n_ok[:, None] & k_ok[None, :]
        xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)             # [BK]
        wg = tl.load(g_rows + kk[None, :], mask=wm, other=0.0).to(tl.float32)      # [BN, BK]
        wu = tl.load(u_rows + kk[None, :], mask=wm, other=0.0).to(tl.float32)      # [BN, BK]
        if FP8:
            q, s = _fp8_group_quant(tl.reshape(xv, (G, 128)), eps, fmax, UE8M0, INTERP)   # [G, 128] e4m3, [G]
            qf = q.to(tl.float32)[None, :, :]                                      # [1, G, 128]
            gi = kb * G + tl.arange(0, G)
            g_ok = gi < DG
            ws_e = ws_ptr + e * stride_wse + gi
            srow = (pid_n * BN) // 128                                             # BN | 128: one block row
            sg = tl.load(ws_e + srow * stride_wsn, mask=g_ok, other=0.0)           # [G]
            su = tl.load(ws_e + (SHALF + srow) * stride_wsn, mask=g_ok, other=0.0)
            pg = tl.sum(tl.reshape(wg, (BN, G, 128)) * qf, axis=2)                 # [BN, G]
            pu = tl.sum(tl.reshape(wu, (BN, G, 128)) * qf, axis=2)
            acc_g += tl.sum(pg * (s * sg)[None, :], axis=1)
            acc_u += tl.sum(pu * (s * su)[None, :], axis=1)
        else:
            acc_g += tl.sum(wg * xv[None, :], axis=1)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = acc_g * tl.sigmoid(acc_g) * acc_u                                          # [BN] fp32
    h = tl.where(n_ok, h, 0.0)
    o_row = o_ptr + p.to(tl.int64) * stride_om
    if REQUANT:
        hq, hs = _fp8_group_quant(h[None, :], eps, fmax, UE8M0, INTERP)            # [1, 128] e4m3, [1]
        tl.store(o_row + offs_n[None, :], hq, mask=n_ok[None, :])
        tl.store(os_ptr + p.to(tl.int64) * stride_osm + pid_n + tl.arange(0, 1), hs)
    else:
        tl.store(o_row + offs_n, h.to(o_ptr.dtype.element_ty), mask=n_ok)    # bf16/fp16, or fp32 (fp8, BN < 128)


@triton.jit
def _decode_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, ids_ptr, tw_ptr, o_ptr,
                        D, I, IG,
                        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, eps, fmax,
                        FP8: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
                        STAGES: tl.constexpr, QUANT_A: tl.constexpr, UE8M0: tl.constexpr, INTERP: tl.constexpr):
    """out[t, n] = sum_k tw[t, k] * sum_i inter[t*TOPK + k, i] w2[ids[t, k], n, i] for n < D, i < I (real
    sizes), accumulated in fp32 in slot order. IG = cdiv(I, 128); KP = next power of 2 of TOPK.
    QUANT_A (fp8): inter is fp32 and is quantized per 1x128 here, in registers."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    kr = tl.arange(0, KP)
    k_ok = kr < TOPK
    e_all = tl.load(ids_ptr + t * TOPK + kr, mask=k_ok, other=0).to(tl.int64)      # [KP] the token's experts
    tw_all = tl.load(tw_ptr + t * TOPK + kr, mask=k_ok, other=0.0)                 # [KP] fp32 routing weights
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BK)
    w_rows = w_ptr + offs_n[:, None] * stride_wn                                   # [BN, 1]
    acc = tl.zeros((BN,), dtype=tl.float32)
    for it in tl.range(0, TOPK * KB, num_stages=STAGES):   # slot k = it // KB, I block kb = it % KB
        k = it // KB
        kb = it - k * KB
        sel = kr == k
        e = tl.sum(tl.where(sel, e_all, 0), axis=0)
        wt = tl.sum(tl.where(sel, tw_all, 0.0), axis=0)
        p = (t * TOPK + k).to(tl.int64)
        kk = kb * BK + offs_k
        i_ok = kk < I
        a = tl.load(a_ptr + p * stride_am + kk, mask=i_ok, other=0.0).to(tl.float32)           # [BK]
        w = tl.load(w_rows + e * stride_we + kk[None, :], mask=n_ok[:, None] & i_ok[None, :],
                    other=0.0).to(tl.float32)                                                  # [BN, BK]
        if FP8:
            gi = kb * G + tl.arange(0, G)
            g_ok = gi < IG
            if QUANT_A:
                aq, a_s = _fp8_group_quant(tl.reshape(a, (G, 128)), eps, fmax, UE8M0, INTERP)   # [G, 128], [G]
                a = tl.reshape(aq.to(tl.float32), (BK,))
            else:
                a_s = tl.load(as_ptr + p * stride_asm + gi, mask=g_ok, other=0.0)              # [G]
            b_s = tl.load(ws_ptr + e * stride_wse + ((pid_n * BN) // 128) * stride_wsn + gi, mask=g_ok,
                          other=0.0)                                                           # [G] (BN | 128)
            part = tl.sum(tl.reshape(w, (BN, G, 128)) * tl.reshape(a, (G, 128))[None, :, :], axis=2)   # [BN, G]
            acc += tl.sum(part * (a_s * b_s)[None, :], axis=1) * wt
        else:
            acc += tl.sum(w * a[None, :], axis=1) * wt
    tl.store(o_ptr + t.to(tl.int64) * stride_om + offs_n, acc.to(o_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------------------------
# configs and launcher
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeConfig:
    bn1: int            # stage 1: intermediate columns per program (fp8: divides 128; 128 = the tile
                        # re-quantizes its group, less = fp32 intermediate quantized by stage 2)
    bk1: int            # stage 1: hidden columns per step (fp8: a multiple of 128)
    warps1: int
    stages1: int
    bn2: int            # stage 2: output columns per program (fp8: divides 128, one w2 scale row)
    bk2: int            # stage 2: intermediate columns per step (fp8: a multiple of 128)
    warps2: int
    stages2: int


def _block_k(target: int, k: int, cap: int) -> int:
    """Power of two in [128, cap], near `target` elements, not (much) past the K extent."""
    bk = 128
    while bk * 2 <= min(target, cap) and bk < k:
        bk *= 2
    return bk


def _block_n(programs_per_col: int, n: int, sms: int) -> int:
    """Largest tile in (128, 64, 32) whose grid still fills the SMs once; else 16."""
    for bn in (128, 64, 32):
        if programs_per_col * cdiv(n, bn) >= sms:
            return bn
    return 16


def _warps(bn: int, bk: int) -> int:
    return max(4, min(8, bn * bk // 2048))


def decode_config(w_mode: str, t: int, top_k: int, d: int, i: int, sms: int = DEFAULT_SMS) -> DecodeConfig:
    """Tiles from shapes only. A program streams ~16 KB of weights per step (per half in stage 1), and the
    tiles shrink until the grid covers the SMs (at T = 1 there are only T*K pairs / one token); with
    S stages, S - 1 steps are in flight per program (H200 needs ~4-6 MB in flight GPU-wide to stream at
    full rate). Compiled for sm_90a with Triton 3.9 (ptxas -v): no spills; stage 1 fp8 uses 183
    registers x 8 warps (one program per SM), the rest <= 170."""
    wb = 1 if w_mode == "fp8" else 2
    if w_mode == "fp8":      # 128 (re-quant in stage 1) when it fills the SMs, else 32 (H200, T = 1: 33 us vs
        bn1 = 128 if t * top_k * cdiv(i, 128) >= sms else 32     # 49 / 40 at 64 / 128; 16: 30 us, not GPU-tested)
    else:
        bn1 = _block_n(t * top_k, i, sms)
    bk1 = _block_k(16384 // (bn1 * wb), d, 512)
    bn2 = _block_n(t, d, sms)
    bk2 = _block_k(16384 // (bn2 * wb), i, 1024)
    stages1 = 4 if 2 * bn1 * bk1 * wb <= 32768 else 3             # <= ~100 KB of shared memory
    return DecodeConfig(bn1, bk1, _warps(bn1, bk1), stages1, bn2, bk2, _warps(bn2, bk2), 4)


def fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, w_mode: str, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, hidden_pad: int = 0, intermediate_pad: int = 0,
                     swiglu_limit: float | None = None, act_ue8m0: bool = False,
                     config: DecodeConfig | None = None) -> torch.Tensor:
    """Routed experts for small T*K (see the module docstring), same arguments as `fused_moe_triton`:
    x [T, D] bf16/fp16; w13 [E, 2I', D'] (gate rows then up rows), w2 [E, D', I']; fp8: e4m3 weights with
    per-half block scales w13_scale [E, 2*ceil(I'/128), ceil(D'/128)], w2_scale [E, ceil(D'/128),
    ceil(I'/128)]; topk_weights [T, K] fp32, topk_ids [T, K] int (distinct within a row) -> [T, D] x.dtype.
    D' = D + hidden_pad, I' = I + intermediate_pad (pad rows/columns are zeros and are never read).
    w_mode "bf16" (any float weights in x's precision) | "fp8". `config` overrides the tile heuristic."""
    if w_mode not in ("bf16", "fp8"):
        raise ValueError(f"fused_moe_decode: w_mode must be 'bf16' or 'fp8', got {w_mode!r}")
    fp8 = w_mode == "fp8"
    t, d = x.shape
    top_k = topk_ids.shape[1]
    if t == 0:
        return x.new_zeros(t, d)
    half = w13.shape[1] // 2                         # I' (rows of one half, padding included)
    i_real = half - intermediate_pad
    p = t * top_k
    cfg = config or decode_config(w_mode, t, top_k, d, i_real, num_sms(x.device))
    if fp8:
        assert FP8_GROUP % cfg.bn1 == 0 and cfg.bk1 % FP8_GROUP == 0 and cfg.bk2 % FP8_GROUP == 0, cfg
        assert FP8_GROUP % cfg.bn2 == 0, cfg
        assert w13_scale is not None and w2_scale is not None, "fp8 needs w13_scale and w2_scale"
    x = x.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    dev = x.device
    requant = fp8 and cfg.bn1 == FP8_GROUP
    if requant:
        inter = torch.empty(p, i_real, dtype=torch.float8_e4m3fn, device=dev)     # [P, I] e4m3
        inter_s = torch.empty(p, cdiv(i_real, FP8_GROUP), dtype=torch.float32, device=dev)   # [P, I/128]
    elif fp8:
        inter = torch.empty(p, i_real, dtype=torch.float32, device=dev)           # [P, I] fp32, quantized in stage 2
        inter_s = inter
    if fp8:
        ws1, ws2, shalf = w13_scale, w2_scale, w13_scale.shape[1] // 2
    else:
        kdt = torch.float32 if INTERPRET else x.dtype   # the interpreter's fp32->bf16 store rounding is inexact
        inter = torch.empty(p, i_real, dtype=kdt, device=dev)                      # [P, I]
        inter_s = ws1 = ws2 = None
        shalf = 0
    dummy = inter
    _decode_up_kernel[(p, cdiv(i_real, cfg.bn1))](
        x, w13, ws1 if fp8 else dummy, ids, inter, inter_s if fp8 else dummy,
        d, i_real, half, shalf, cdiv(d, FP8_GROUP),
        x.stride(0), w13.stride(0), w13.stride(1), ws1.stride(0) if fp8 else 0, ws1.stride(1) if fp8 else 0,
        inter.stride(0), inter_s.stride(0) if fp8 else 0,
        float(swiglu_limit) if swiglu_limit is not None else 0.0, ACT_EPS, FP8_MAX,
        FP8=fp8, UE8M0=act_ue8m0, HAS_LIMIT=swiglu_limit is not None, INTERP=INTERPRET,
        TOPK=top_k, BN=cfg.bn1, BK=cfg.bk1, G=max(1, cfg.bk1 // FP8_GROUP), KB=cdiv(d, cfg.bk1),
        STAGES=cfg.stages1, REQUANT=requant, num_warps=cfg.warps1)
    out = torch.empty(t, d, dtype=torch.float32 if INTERPRET else x.dtype, device=dev)   # [T, D]
    _decode_down_kernel[(t, cdiv(d, cfg.bn2))](
        inter, inter_s if fp8 else dummy, w2, ws2 if fp8 else dummy, ids, tw, out,
        d, i_real, cdiv(i_real, FP8_GROUP),
        inter.stride(0), inter_s.stride(0) if fp8 else 0, w2.stride(0), w2.stride(1),
        ws2.stride(0) if fp8 else 0, ws2.stride(1) if fp8 else 0, out.stride(0), ACT_EPS, FP8_MAX,
        FP8=fp8, TOPK=top_k, KP=triton.next_power_of_2(top_k),
        BN=cfg.bn2, BK=cfg.bk2, G=max(1, cfg.bk2 // FP8_GROUP), KB=cdiv(i_real, cfg.bk2),
        STAGES=cfg.stages2, QUANT_A=fp8 and not requant, UE8M0=act_ue8m0, INTERP=INTERPRET, num_warps=cfg.warps2)
    return out if out.dtype == x.dtype else out.to(x.dtype)
