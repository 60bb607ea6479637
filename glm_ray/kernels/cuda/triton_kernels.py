"""Triton kernels of the `cuda` backend and their launchers (this module imports triton).

Kernels (all written for this project; the grouped-dispatch scheme is the usual one: pairs sorted by
expert, BM-row blocks of one expert, see `layout.moe_align`):

* `_act_quant_fp8_kernel` — dynamic 1x128 FP8 activation quant (the torch reference's exact op order:
  amax, `max(amax, eps) / fmax` with IEEE division, optional UE8M0 ceil, `clamp(x * (1/s))`, RNE cast)
  into caller-chosen strides, so one kernel writes both the row-major scales of the MoE path and the
  padded column-major [Mp, Kp/128] scales `_scaled_mm` wants (pad rows/groups are written as zeros).
* `_moe_up_kernel` — stage 1: for a block of BM sorted pairs of one expert and BN intermediate columns
  it streams the gate rows AND the matching up rows of w13 (separated halves: rows n and I' + n), keeps
  two fp32 accumulators and applies the (clamped) SiLU-GLU in the epilogue, so the [P, 2I] pre-activation
  never exists. The epilogue then writes the stage-2 input: bf16, or FP8 re-quantized per 1x128 (the
  tile's row IS the 128-group, BN = 128), or MXFP4 quantize-dequantized per 1x32 (W4A4 numerics).
  Weights: bf16, block-FP8 (scales per half: gate block rows then up block rows), or MXFP4
  (packed e2m1 nibbles + e8m0 scales, dequantized in registers to bf16 = W4A16).
* `_moe_down_kernel` — stage 2: the [P, I] intermediate (rows by pair id) times w2[e]^T, multiplied by
  the routing weight, written per pair in the output dtype; `fused_moe_*` then sums the K slots in
  fp32 (deterministic: no atomics). With IDENTITY dispatch (row = pair, expert 0) the same kernel is a
  dense GEMM: block-FP8 W8A8 and MXFP4 W4A16 dense linears use it.

The K loops run a constexpr trip count KB = cdiv(K, BK): the interpreter cannot iterate `range` over a
runtime scalar with numpy >= 2.4. Compiled kernels are therefore specialized per K (one compile per
layer shape; a model has a handful).
Under `TRITON_INTERPRET=1` (CPU tests) operands are upcast to fp32 before `tl.dot`: the interpreter's
bf16 dot returns garbage (numpy has no bf16). `hidden_pad` / `intermediate_pad` are honoured by running
the K / N loops over the real sizes only (pad rows/columns are zeros by contract and are never read).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import TileConfig, cdiv, dense_config, moe_configs
from glm_ray.kernels.cuda.moe_align import moe_align_auto

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FP8_MAX = 448.0
ACT_EPS = 1e-10
MX_MODES = {"even": 0, "round_up": 1, "round_down": 2, "ceil": 3}
W_BF16, W_FP8, W_MX = 0, 1, 2
OUT_PLAIN, OUT_FP8, OUT_MX = 0, 1, 2


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _ceil_pow2(s):
    """Bit-exact ceil of a positive fp32 to a power of two, biased exponent clamped to [1, 254]."""
    b = s.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(q):
    """RNE of fp32 q (|q| <= 448) onto the e4m3fn grid, in fp32 arithmetic (magic-number add: fp32
    addition rounds to nearest even). Used under the interpreter only, whose fp32->fp8 cast rounds
    half-up and drops the carry into the exponent (triton 3.6 `_convert_float`)."""
    a = tl.abs(q)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)                                              # e4m3fn subnormal step 2**-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    c = step * 12582912.0                                              # 1.5 * 2**23 * step
    r = (a + c) - c
    sign = q.to(tl.int32, bitcast=True) & -2147483648                  # copy q's sign bit (keeps -0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_group_quant(x, eps, fmax, UE8M0: tl.constexpr, INTERP: tl.constexpr):
    """x [R, 128] fp32 (one group per row) -> (q [R, 128] e4m3, s [R] fp32)."""
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, eps), tl.zeros_like(amax) + fmax)
    if UE8M0:
        s = _ceil_pow2(s)
    inv = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    q = tl.minimum(tl.maximum(x * inv[:, None], -fmax), fmax)
    if INTERP:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), s


@triton.jit
def _exp_field(x):
    return (x.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _ceil_exp_field(x):
    u = x.to(tl.int32, bitcast=True)
    e = (u >> 23) & 0xFF
    return tl.where(((u & 0x7FFFFF) != 0) & (e < 255), e + 1, e)


@triton.jit
def _e8m0_to_f32(b):
    """e8m0 byte (int32) -> 2**(b-127); b == 0 -> 2**-127 (denormal bits 0x00400000)."""
    return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_qdq(y, R: tl.constexpr, C: tl.constexpr, MODE: tl.constexpr):
    """MXFP4 quantize-dequantize of y [R, C] fp32 in 1x32 groups along C (RNE onto the e2m1 grid,
    saturating at 6; scale exponent by MODE: 0 even, 1 round_up, 2 round_down, 3 ceil) -> [R, C] fp32."""
    g = tl.reshape(y, (R, C // 32, 32))
    amax = tl.max(tl.abs(g), axis=2)                                   # [R, C/32]
    if MODE == 0:
        bits = amax.to(tl.int32, bitcast=True)
        r = ((bits + 0x200000) & -8388608).to(tl.float32, bitcast=True)
        e = _exp_field(r * 0.25)
    elif MODE == 1:
        e = _ceil_exp_field(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0))
    elif MODE == 2:
        e = _exp_field(amax * 0.25)
    else:
        e = _ceil_exp_field(amax * 0.25)
    e = tl.minimum(tl.maximum(e, 0), 254)
    inv = tl.where(e == 254, 0x00400000, (254 - e) << 23).to(tl.float32, bitcast=True)   # 2**(127-e)
    scale = _e8m0_to_f32(e)
    z = g * inv[:, :, None]
    a = tl.abs(z)
    v = (0.5 * (a > 0.25).to(tl.float32) + 0.5 * (a >= 0.75).to(tl.float32) + 0.5 * (a > 1.25).to(tl.float32)
         + 0.5 * (a >= 1.75).to(tl.float32) + 1.0 * (a > 2.5).to(tl.float32) + 1.0 * (a >= 3.5).to(tl.float32)
         + 2.0 * (a > 5.0).to(tl.float32))
    v = tl.where(z < 0, -v, v) * scale[:, :, None]
    return tl.reshape(v, (R, C))


@triton.jit
def _mx_weight_tile(w_ptr, s_ptr, rows, k0, row_ok, K, stride_wn, stride_sn, BK: tl.constexpr, BN: tl.constexpr):
    """Dequantized MXFP4 weight tile [BK, BN] (bf16) for output rows `rows` [BN] and K in [k0, k0 + BK):
    the packed bytes are loaded K-contiguous as [BN, BK/2] (vectorizable, so the loop pipelines), split
    into low/high nibbles (element 2j = low), decoded to e2m1 values and scaled per 32-group."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    m = row_ok[:, None] & (kb < K // 2)[None, :]
    byte = tl.load(w_ptr + rows[:, None] * stride_wn + kb[None, :], mask=m, other=0).to(tl.int32)   # [BN, BK/2]
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BN, BK))                  # [BN, BK], K order kept
    mag = code & 7
    ex = mag >> 1
    man = mag & 1
    fb = tl.where(mag >= 2, ((ex + 126) << 23) | (man << 22), tl.where(mag == 1, 126 << 23, 0))
    v = fb.to(tl.float32, bitcast=True)
    v = tl.where(code >= 8, -v, v)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    sb = tl.load(s_ptr + rows[:, None] * stride_sn + ks[None, :], mask=row_ok[:, None] & (ks < K // 32)[None, :],
                 other=127).to(tl.int32)                                        # [BN, BK/32]
    v = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * _e8m0_to_f32(sb)[:, :, None], (BN, BK))
    return tl.trans(v.to(tl.bfloat16))


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    return pid_m, pid_n


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _store_pair_rows(o_ptr, acc, pair64, valid, offs_n, n_ok, stride_om, tw_ptr, MUL_W: tl.constexpr):
    """The grouped down GEMMs' epilogue: out[pair, n] = acc[r, n] (x the pair's routing weight tw[pair] if
    MUL_W) for the tile's valid pair rows (pad pairs are skipped) and columns n < N."""
    if MUL_W:
        acc = acc * tl.load(tw_ptr + pair64, mask=valid, other=0.0)[:, None]
    tl.store(o_ptr + pair64[:, None] * stride_om + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=['M', 'M_OUT'])   # sizes that change per step: no recompiles (cuda/__init__)
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, M, K, M_OUT, stride_xm, stride_qm, stride_sm, stride_sg, eps, fmax,
                          UE8M0: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    cols = g * 128 + tl.arange(0, 128)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :],
                mask=(rows < M)[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
    q, s = _fp8_group_quant(x, eps, fmax, UE8M0, INTERP)
    out_ok = rows < M_OUT
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=out_ok[:, None])
    tl.store(s_ptr + rows64 * stride_sm + g * stride_sg, s, mask=out_ok)


@triton.jit(do_not_specialize=['P', 'EM'])   # sizes that change per step: no recompiles (cuda/__init__)
def _moe_up_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, os_ptr, sorted_ptr, eid_ptr, npost_ptr,
                   P, EM, top_k, K, N, HALF, SHALF,
                   stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
                   limit, eps, fmax,
                   W_MODE: tl.constexpr, OUT_MODE: tl.constexpr, MX_MODE: tl.constexpr, UE8M0: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, GROUP_M: tl.constexpr):
    """act[pair, n] = silu_glu(x[tok] . w13[e, n], x[tok] . w13[e, HALF + n]) for n < N (= real I).
    K = real hidden size; HALF = I' (row offset of the up half); SHALF = scale block rows of one half."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(EM, BM), tl.cdiv(N, BN), GROUP_M)
    if pid_m * BM >= tl.load(npost_ptr):
        return
    offs = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs)
    valid = pair < P
    tok = (pair // top_k).to(tl.int64)
    e = tl.load(eid_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_rows = a_ptr + tok[:, None] * stride_am
    w_e = w_ptr + e * stride_we
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):                     # KB = cdiv(K, BK), constexpr: see module docstring
        k0 = kb * BK
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_MODE == 2:
            ws_e = ws_ptr + e * stride_wse
            bg = _mx_weight_tile(w_e, ws_e, offs_n, k0, n_ok, K, stride_wn, stride_wsn, BK, BN)
            bu = _mx_weight_tile(w_e, ws_e, offs_n + HALF, k0, n_ok, K, stride_wn, stride_wsn, BK, BN)
            if not INTERP:
                a = a.to(tl.bfloat16)
        else:
            bm = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(w_e + offs_n[None, :] * stride_wn + kk[:, None], mask=bm, other=0.0)
            bu = tl.load(w_e + (offs_n + HALF)[None, :] * stride_wn + kk[:, None], mask=bm, other=0.0)
        if INTERP:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        if W_MODE == 1:
            a_s = tl.load(as_ptr + tok * stride_asm + kb, mask=valid, other=0.0)
            ws_e = ws_ptr + e * stride_wse + kb
            sg = tl.load(ws_e + (offs_n // 128) * stride_wsn, mask=n_ok, other=0.0)
            su = tl.load(ws_e + (SHALF + offs_n // 128) * stride_wsn, mask=n_ok, other=0.0)
            acc_g += tl.dot(a, bg) * a_s[:, None] * sg[None, :]
            acc_u += tl.dot(a, bu) * a_s[:, None] * su[None, :]
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h = tl.where(n_ok[None, :], h, 0.0)
    pair64 = pair.to(tl.int64)
    o_mask = valid[:, None] & n_ok[None, :]
    o_ptrs = o_ptr + pair64[:, None] * stride_om + offs_n[None, :]
    if OUT_MODE == 1:
        q, s = _fp8_group_quant(h, eps, fmax, UE8M0, INTERP)
        tl.store(o_ptrs, q, mask=o_mask)
        tl.store(os_ptr + pair64 * stride_osm + pid_n, s, mask=valid)
    elif OUT_MODE == 2:
        h = _mx_qdq(h, BM, BN, MX_MODE)
        tl.store(o_ptrs, h.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, h.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=['P', 'EM'])   # sizes that change per step: no recompiles (cuda/__init__)
def _moe_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
                     P, EM, N, K,
                     stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                     W_MODE: tl.constexpr, MUL_W: tl.constexpr, IDENTITY: tl.constexpr, INTERP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair, n] = tw[pair] * sum_k a[pair, k] w2[e, n, k] for n < N, k < K (real sizes).
    IDENTITY: rows are pairs 0..P-1 in order and the expert is 0 (a dense GEMM)."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(EM, BM), tl.cdiv(N, BN), GROUP_M)
    offs = pid_m * BM + tl.arange(0, BM)
    if IDENTITY:
        pair = offs
        e = 0
    else:
        if pid_m * BM >= tl.load(npost_ptr):
            return
        pair = tl.load(sorted_ptr + offs)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
    valid = pair < P
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_rows = a_ptr + pair64[:, None] * stride_am
    w_e = w_ptr + e * stride_we
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):                     # KB = cdiv(K, BK), constexpr: see module docstring
        k0 = kb * BK
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_MODE == 2:
            b = _mx_weight_tile(w_e, ws_ptr + e * stride_wse, offs_n, k0, n_ok, K, stride_wn, stride_wsn, BK, BN)
            if not INTERP:
                a = a.to(tl.bfloat16)
        else:
            b = tl.load(w_e + offs_n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
        if INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if W_MODE == 1:
            a_s = tl.load(as_ptr + pair64 * stride_asm + kb, mask=valid, other=0.0)
            b_s = tl.load(ws_ptr + e * stride_wse + (offs_n // 128) * stride_wsn + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
    _store_pair_rows(o_ptr, acc, pair64, valid, offs_n, n_ok, stride_om, tw_ptr, MUL_W)


@triton.jit(do_not_specialize=['M'])   # sizes that change per step: no recompiles (cuda/__init__)
def _mx_qdq_rows_kernel(x_ptr, o_ptr, M, K, stride_xm, stride_om, MODE: tl.constexpr, ROWS: tl.constexpr,
                        COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = _mx_qdq(x, ROWS, COLS, MODE)
    tl.store(o_ptr + rows64[:, None] * stride_om + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def act_quant_fp8(x: torch.Tensor, *, m_out: int | None = None, k_out: int | None = None, ue8m0: bool = False,
                  col_major_scale: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                  eps: float = ACT_EPS, fmax: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M_out, K_out] fp8, s [M_out, K_out/128] fp32); rows >= M and columns >= K are
    written as zeros (M_out >= M, K_out >= K, K_out % 128 == 0 unless K_out == K). With
    `col_major_scale` s has strides (1, M_out) (the `_scaled_mm` 1x128 layout), else row-major."""
    m, k = x.shape
    m_out = m if m_out is None else m_out
    k_out = k if k_out is None else k_out
    g = cdiv(k_out, 128)
    q = torch.empty(m_out, k_out, dtype=fp8_dtype, device=x.device)
    if col_major_scale:
        st = torch.empty(g, m_out, dtype=torch.float32, device=x.device)
        s, stride_sm, stride_sg = st.t(), 1, m_out
    else:
        s = torch.empty(m_out, g, dtype=torch.float32, device=x.device)
        stride_sm, stride_sg = g, 1
    if k_out % 128:
        # the kernel stores whole 128-column groups: write into a padded buffer and return a view
        qp = torch.empty(m_out, g * 128, dtype=fp8_dtype, device=x.device)
        _launch_act_quant(x, qp, s, m, k, m_out, qp.stride(0), stride_sm, stride_sg, eps, fmax, ue8m0)
        q.copy_(qp[:, :k_out])
        return q, s
    _launch_act_quant(x, q, s, m, k, m_out, q.stride(0), stride_sm, stride_sg, eps, fmax, ue8m0)
    return q, s


def _launch_act_quant(x, q, s, m, k, m_out, stride_qm, stride_sm, stride_sg, eps, fmax, ue8m0):
    rows = 16 if m_out <= 4096 else 32
    grid = (cdiv(m_out, rows), cdiv(q.shape[1], 128))
    if grid[0] == 0 or grid[1] == 0:
        return
    _act_quant_fp8_kernel[grid](x, q, s, m, k, m_out, x.stride(0), stride_qm, stride_sm, stride_sg, eps, fmax,
                                UE8M0=ue8m0, INTERP=INTERPRET, ROWS=rows, num_warps=4)


def mx_qdq_rows(x: torch.Tensor, mode: str, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 quantize-dequantize of x [M, K] (K % 32 == 0) along K -> [M, K] out_dtype (exact in bf16)."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    rows, cols = 16, 128
    grid = (cdiv(m, rows), cdiv(k, cols))
    _mx_qdq_rows_kernel[grid](x, out, m, k, x.stride(0), out.stride(0), MODE=MX_MODES[mode], ROWS=rows, COLS=cols,
                              num_warps=4)
    return out


def _up(a, a_s, w, ws, out, out_s, al, num_pairs, top_k, k_real, n_real, half, shalf, cfg: TileConfig, *,
        w_mode, out_mode, mx_mode=0, ue8m0=False, limit=None):
    if w_mode == W_FP8 or out_mode == OUT_FP8:
        assert cfg.block_k == 128 and cfg.block_n == 128, "FP8 stage 1 needs 128x128 tiles (scale/requant groups)"
    if w_mode == W_MX or out_mode == OUT_MX:
        assert cfg.block_k % 32 == 0 and cfg.block_n % 32 == 0
    em = al.max_blocks * al.block_m
    grid = (cdiv(em, cfg.block_m) * cdiv(n_real, cfg.block_n),)
    dummy = out
    _moe_up_kernel[grid](
        a, a_s if a_s is not None else dummy, w, ws if ws is not None else dummy, out,
        out_s if out_s is not None else dummy, al.sorted_ids, al.expert_ids, al.num_post_pad,
        num_pairs, em, top_k, k_real, n_real, half, shalf,
        a.stride(0), a_s.stride(0) if a_s is not None else 0, w.stride(0), w.stride(1),
        ws.stride(0) if ws is not None else 0, ws.stride(1) if ws is not None else 0,
        out.stride(0), out_s.stride(0) if out_s is not None else 0,
        float(limit) if limit is not None else 0.0, ACT_EPS, FP8_MAX,
        W_MODE=w_mode, OUT_MODE=out_mode, MX_MODE=mx_mode, UE8M0=ue8m0, HAS_LIMIT=limit is not None,
        INTERP=INTERPRET, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, KB=cdiv(k_real, cfg.block_k),
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _down(a, a_s, w, ws, out, tw, al, num_pairs, n_real, k_real, cfg: TileConfig, *, w_mode, mul_w=True,
          identity=False):
    if identity:
        em = num_pairs
        sorted_ids = expert_ids = npost = out
    else:
        em = al.max_blocks * al.block_m
        sorted_ids, expert_ids, npost = al.sorted_ids, al.expert_ids, al.num_post_pad
    grid = (cdiv(em, cfg.block_m) * cdiv(n_real, cfg.block_n),)
    if grid[0] == 0:
        return
    _moe_down_kernel[grid](
        a, a_s if a_s is not None else out, w, ws if ws is not None else out, out, tw if tw is not None else out,
        sorted_ids, expert_ids, npost, num_pairs, em, n_real, k_real,
        a.stride(0), a_s.stride(0) if a_s is not None else 0,
        w.stride(0) if w.dim() == 3 else 0, w.stride(-2),
        (ws.stride(0) if ws.dim() == 3 else 0) if ws is not None else 0, ws.stride(-2) if ws is not None else 0,
        out.stride(0),
        W_MODE=w_mode, MUL_W=mul_w, IDENTITY=identity, INTERP=INTERPRET,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, KB=cdiv(k_real, cfg.block_k), GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _combine(out_pairs: torch.Tensor, t: int, k: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return out_pairs.view(t, k, d).sum(1, dtype=torch.float32).to(dtype)


MAX_PAIRS_PER_CHUNK = 65536      # bounds the [P, I] / [P, D] temporaries (P = tokens x top_k)


def pair_chunk_tokens(top_k: int) -> int:
    """Tokens in one MoE call's chunk: at most MAX_PAIRS_PER_CHUNK (token, expert) pairs."""
    return max(1, MAX_PAIRS_PER_CHUNK // top_k)


def in_token_chunks(moe_fn, x, w13, w2, topk_weights, topk_ids, **kw) -> torch.Tensor:
    """`moe_fn` over consecutive chunks of `pair_chunk_tokens` tokens, concatenated (a few launches per 64k pairs:
    whole long prefills only)."""
    n = pair_chunk_tokens(topk_ids.shape[1])
    return torch.cat([moe_fn(x[i:i + n], w13, w2, topk_weights[i:i + n], topk_ids[i:i + n], **kw)
                      for i in range(0, x.shape[0], n)])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, w_mode: str, w13_scale=None, w2_scale=None, hidden_pad: int = 0,
                     intermediate_pad: int = 0, swiglu_limit: float | None = None, act_ue8m0: bool = False,
                     mx_act_mode: str | None = None) -> torch.Tensor:
    """Routed experts through the two grouped kernels. x [T, D] (bf16/fp16); w13 [E, 2I', D'(/2)];
    w2 [E, D', I'(/2)]; topk_* [T, K] -> [T, D] x.dtype. w_mode "bf16" | "fp8" | "mxfp4"."""
    t, d = x.shape
    k = topk_ids.shape[1]
    if t == 0:
        return x.new_zeros(t, d)
    if t > pair_chunk_tokens(k):
        return in_token_chunks(fused_moe_triton, x, w13, w2, topk_weights, topk_ids, w_mode=w_mode,
                               w13_scale=w13_scale, w2_scale=w2_scale, hidden_pad=hidden_pad,
                               intermediate_pad=intermediate_pad, swiglu_limit=swiglu_limit, act_ue8m0=act_ue8m0,
                               mx_act_mode=mx_act_mode)
    e = w13.shape[0]
    half = w13.shape[1] // 2                       # I' (rows of one half, padding included)
    i_real = half - intermediate_pad
    p = t * k
    cfg1, cfg2 = moe_configs(w_mode, p, e)
    al = moe_align_auto(topk_ids, e, cfg1.block_m)                   # one launch at decode sizes, three above (moe_align.py)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    x = x.contiguous()
    if w_mode == "fp8":
        wm = W_FP8
        a, a_s = act_quant_fp8(x, ue8m0=act_ue8m0)                 # [T, D] e4m3, [T, D/128] fp32
        shalf = w13_scale.shape[1] // 2
        inter = torch.empty(p, i_real, dtype=torch.float8_e4m3fn, device=x.device)
        inter_s = torch.empty(p, cdiv(i_real, 128), dtype=torch.float32, device=x.device)
        _up(a, a_s, w13, w13_scale, inter, inter_s, al, p, k, d, i_real, half, shalf, cfg1, w_mode=wm,
            out_mode=OUT_FP8, ue8m0=act_ue8m0, limit=swiglu_limit)
    else:
        wm = W_MX if w_mode == "mxfp4" else W_BF16
        kdt = torch.bfloat16 if w_mode == "mxfp4" else x.dtype
        if INTERPRET:
            kdt = torch.float32                    # the interpreter's fp32->bf16 store rounding is inexact
        a, a_s = x, None
        if w_mode == "mxfp4" and mx_act_mode is not None:
            a = mx_qdq_rows(x, mx_act_mode, torch.bfloat16)
        elif w_mode == "mxfp4":
            a = x.to(torch.bfloat16)
        inter, inter_s = torch.empty(p, i_real, dtype=kdt, device=x.device), None
        out_mode = OUT_MX if (w_mode == "mxfp4" and mx_act_mode is not None) else OUT_PLAIN
        _up(a, None, w13, w13_scale, inter, None, al, p, k, d, i_real, half, 0, cfg1, w_mode=wm, out_mode=out_mode,
            mx_mode=MX_MODES.get(mx_act_mode or "even", 0), limit=swiglu_limit)
    out_pairs = torch.empty(p, d, dtype=torch.float32 if INTERPRET else x.dtype, device=x.device)
    _down(inter, inter_s, w2, w2_scale, out_pairs, tw, al, p, d, i_real, cfg2, w_mode=wm)
    return _combine(out_pairs, t, k, d, x.dtype)


def dense_gemm_triton(a: torch.Tensor, w: torch.Tensor, *, w_mode: str, a_scale=None, w_scale=None,
                      out_dtype: torch.dtype = torch.bfloat16, n: int | None = None,
                      k: int | None = None) -> torch.Tensor:
    """y [M, N] = a [M, K] @ W[N, K]^T with the down kernel in identity dispatch.
    fp8: a e4m3 + a_scale [M, K/128] row-major, w e4m3 [N, K] + w_scale [N/128, K/128];
    mxfp4: a bf16, w packed uint8 [N, K/2] + e8m0 [N, K/32]."""
    m = a.shape[0]
    n = w.shape[0] if n is None else n
    k = a.shape[1] if k is None else k
    cfg = dense_config(w_mode, m)
    out = torch.empty(m, n, dtype=torch.float32 if INTERPRET else out_dtype, device=a.device)
    wm = {"fp8": W_FP8, "mxfp4": W_MX, "bf16": W_BF16}[w_mode]
    _down(a, a_scale, w, w_scale, out, None, None, m, n, k, cfg, w_mode=wm, mul_w=False, identity=True)
    return out.to(out_dtype)
