"""Small-M block-FP8 W8A8 linear in one Triton launch: the dynamic 1x128 activation quant is fused into
the GEMM (this module imports triton).

`block_fp8_linear_small_m(x [M, K], w e4m3 [N, K], w_scale_inv fp32 [ceil(N/128), ceil(K/128)])` computes
what `torch_ref.fp8.block_fp8_linear(..., mode="w8a8")` computes, for M <= 64 (decode steps). The backend's
general path is two launches (`act_quant_fp8`, then `torch._scaled_mm` or the Triton GEMM) and, at M of a
few rows, the GEMM is a GEMV whose time is reading the weight once. Here:

* one program owns BN output columns (BN divides 128, so the tile has ONE weight-scale row) and ALL M rows
  (BM = max(16, next_pow2(M)) rows, padded rows masked to zero), and walks its K range in 128-wide groups:
  load x [BM, 128] (bf16/fp16 -> fp32) and quantize it in registers with the project's quantizer
  `triton_kernels._fp8_group_quant` (imported, so bit-identical to `act_quant_fp8` and to the torch
  reference's op order), load the weight tile [128, BN] e4m3 and accumulate
  `acc += dot(q, w) * (s[:, None] * w_scale)` in fp32: the per-128-group promotion of the FP8 MMA
  result to an fp32 accumulator that every block-FP8 kernel does.
  Quantizing x in every N-program is redundant work, but x is tiny (M x K, L2-resident) and the quant of a
  [BM, 128] tile is a few ALU ops per element against BN x 128 weight bytes; the bytes that matter, the
  weight's, are read exactly once. Rows >= M load as zeros, quantize to 0 and add exactly 0.
* tl.dot for every M, including M = 1 (no separate GEMV form): the 15 padding rows of a BM = 16 MMA cost
  only tensor-core issue slots, which sit mostly idle at the bandwidth bound (M = 16 needs ~32 FLOP per
  weight byte, ~150 TFLOP/s at 4.8 TB/s, far below the FP8 MMA rate), and one code path keeps the
  numerics identical for every M. A CUDA-core GEMV would also have to widen every weight byte to fp32.
* split-K: when cdiv(N, BN) programs cannot fill the GPU (N = 2048 at M = 1 is 32 programs for 132 SMs)
  the K groups are split into `split` contiguous ranges (grid axis 1); each split stores its fp32 partial
  [split, M, N], and the partials are added in split order and cast: deterministic (bit-identical run
  to run; the fp32 sum is p[0] + p[1] + ... whichever program finishes last). `split` is normalized so
  that no split is empty (`groups_per_split = cdiv(G, split)`, `split = cdiv(G, groups_per_split)`); the
  partial traffic (2 x split x M x N x 4 bytes, mostly L2) is capped at half the weight bytes.
  Who adds them (`reduce=`, else the config's): "last" = in the same launch, by the last program of each column
  tile to finish: every program stores its partial, then (CTA barrier, one acq_rel gpu-scope atomic)
  increments the tile's arrival counter; the program that reads split - 1 loads the partials (L1
  bypassed: `.cg`), adds them in split order, stores the output and resets the counter to 0 for the
  next launch. The counters are a per-device int32 workspace allocated zeroed on the first eager call
  (never inside a CUDA-graph capture: a capture without it falls back to "kernel"), shared by every
  launch on the device: launches must not run concurrently on two streams (the engine runs one
  forward stream). "kernel" = the second tiny launch `_split_k_sum_kernel` (same sum, same bits: the
  reference the GPU test holds "last" to). The interpreter runs programs one after another, so the
  counter logic runs there too (the last arrival is always pid_k = split - 1); the memory ordering is
  what only the GPU test checks (repeated runs, bit-equal to "kernel").
* the grid and every constexpr come from shapes (M, N, K, the SM count of the device): CUDA-graph
  capturable, no host syncs. K not a multiple of 128 and N not a multiple of BN are masked. The K loop
  is a constexpr trip count (`groups_per_split`): the interpreter cannot `range` over a runtime scalar
  (numpy >= 2.4), and compiled kernels are specialized per (K, split) anyway.

Interpreter (`TRITON_INTERPRET=1`, CPU tests): dot operands are upcast to fp32 (its bf16/fp8 dot is not
exact) and outputs are computed in fp32 and cast by torch (its fp32 -> bf16 store rounding is inexact),
as in triton_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm_ray.kernels.cuda.layout import DEFAULT_SMS, cdiv, num_sms
from glm_ray.kernels.cuda.triton_kernels import ACT_EPS, FP8_MAX, INTERPRET, _fp8_group_quant
from glm_ray.kernels.streams import LANES, lane

MAX_M = 64                      # the design point: BM <= 64 rows in one tile
GROUP = 128                     # activation quant group = weight block (both 128 along K)
PROGRAMS_PER_SM = {16: 4, 32: 2, 64: 2}   # split-K target per BM: about this many programs per SM
PARTIAL_BYTES_FRACTION = 0.5    # cap: split-K partial traffic <= this fraction of the weight bytes
SUM_BLOCK = 256                 # elements per program of the split-K reduction ("kernel")
COUNTERS = 4096                 # arrival counters per device ("last"): column tiles of one launch
REDUCE_MODES = ("last", "kernel")


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int                 # BM: rows of the tile (>= M, power of two, >= 16 for tl.dot)
    block_n: int                 # BN: output columns per program (divides 128)
    split: int                   # K splits (grid axis 1); 1 = no partials, one launch
    groups_per_split: int        # 128-wide K groups per split (constexpr trip count)
    num_warps: int
    num_stages: int
    reduce: str = "last"         # who adds split-K partials: REDUCE_MODES (no effect at split 1)


# Measured on one H200 (132 SMs), `scripts/bench_kernels.py --small-m-sweep` (docs/measurements/2026-12-04,
# second sweep): (N, K, BM) -> (BN, split, num_warps, reduce), the fastest candidate per glm5-flash-31b decode
# linear (BM 16: the sum over M = 1 and 16; BM 32: M = 32; BM 64: M = 64), each timed as back-to-back calls
# on distinct weights in one CUDA graph. Shapes not listed (and other SM counts) take the heuristic. What the
# table says in general: BM 16 wants ~one 128-wide K group per program except the 8192-deep o_proj; BM >= 32
# wants 8 warps and more splits than one wave, the partials added by a second launch.
TUNED_SMS = 132
TUNED: dict[tuple[int, int, int], tuple[int, int, int, str]] = {
    # o_proj
    (2048, 8192, 16): (64, 8, 4, "kernel"), (2048, 8192, 32): (128, 16, 4, "kernel"),
    (2048, 8192, 64): (128, 16, 4, "kernel"),
    # q_b_proj
    (8192, 768, 16): (64, 6, 4, "kernel"), (8192, 768, 32): (64, 1, 8, "last"), (8192, 768, 64): (64, 1, 8, "last"),
    # shared expert gate_up
    (3072, 2048, 16): (64, 8, 4, "kernel"), (3072, 2048, 32): (128, 16, 4, "kernel"),
    (3072, 2048, 64): (128, 8, 4, "kernel"),
    # indexer wq_b
    (4096, 768, 16): (32, 6, 4, "last"), (4096, 768, 32): (64, 2, 8, "last"), (4096, 768, 64): (128, 3, 8, "kernel"),
    # shared expert down
    (2048, 1536, 16): (32, 12, 4, "kernel"), (2048, 1536, 32): (64, 12, 8, "kernel"),
    (2048, 1536, 64): (64, 4, 8, "kernel"),
    # q_a + kv_a, fused into one GEMM
    (1344, 2048, 16): (32, 16, 4, "kernel"), (1344, 2048, 32): (64, 16, 8, "kernel"),
    (1344, 2048, 64): (128, 8, 8, "kernel"),
    # indexer wk
    (128, 2048, 16): (32, 16, 4, "kernel"), (128, 2048, 32): (64, 16, 8, "kernel"), (128, 2048, 64): (64, 8, 8, "kernel"),
}


def small_m_config(m: int, n: int, k: int, *, split_k: int | None = None, num_sms: int = DEFAULT_SMS,
                   block_n: int | None = None, tuned: bool = True) -> SmallMConfig:
    """Tile config from shapes only. The measured `TUNED` entry when (N, K, BM) has one on a TUNED_SMS-SM
    device and neither `split_k` nor `block_n` is given (and `tuned`); else the heuristic: `split_k` None =
    no split when the column tiles alone cover every SM, else the split that brings the grid to about
    PROGRAMS_PER_SM[BM] x num_sms programs (capped by the partial-traffic budget and the number of K groups);
    an explicit `split_k` is clamped to [1, G]. Either way the split is normalized so none is empty.
    Heuristic partials are added by the last program at BM 16 (few rows: a short tail), by a second launch
    above (a tile's last program reads split x BM x BN fp32 alone: 4 us slower at BM 64 on the H200)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"small-M block-FP8 linear: M = {m} not in [1, {MAX_M}]")
    bm = max(16, triton.next_power_of_2(m))
    groups = cdiv(k, GROUP)
    entry = TUNED.get((n, k, bm)) if tuned and split_k is None and block_n is None and num_sms == TUNED_SMS \
        else None
    if entry is not None:
        block_n, split_k, warps, reduce = entry
    else:
        warps, reduce = (4, "last") if bm <= 16 else (8, "kernel")
    bn = block_n or (128 if bm >= 64 else 64)
    if GROUP % bn or bn < 16:
        raise ValueError(f"block_n {bn} must divide {GROUP} (one weight-scale row per tile)")
    if split_k is None:
        n_tiles = cdiv(n, bn)
        want = 1 if n_tiles >= num_sms else cdiv(PROGRAMS_PER_SM[bm] * num_sms, n_tiles)
        budget = int(PARTIAL_BYTES_FRACTION * n * k / (2 * 4 * m * n))     # 2 x split x M x N x 4 <= frac x N x K
        split = max(1, min(want, budget, groups))
    else:
        split = max(1, min(int(split_k), groups))
    gps = cdiv(groups, split)
    split = cdiv(groups, gps)
    stages = 4 if bm <= 16 else 3
    return SmallMConfig(bm, bn, split, gps, warps, stages, reduce)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=['M'])   # sizes that change per step: no recompiles (cuda/__init__)
def _fp8_small_m_kernel(x_ptr, w_ptr, ws_ptr, o_ptr, out_ptr, cnt_ptr, M, N, K, G,
                        stride_xm, stride_wn, stride_wsn, stride_wsk, stride_os, stride_om, stride_outm, eps, fmax,
                        UE8M0: tl.constexpr, INTERP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        GPS: tl.constexpr, SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, PDL: tl.constexpr):
    """o[pid_k, m, n] = sum over the K groups g of split pid_k of
    dot(quant(x[m, g]), w[n, g]) * s_x[m, g] * w_scale[n // 128, g]   (fp32 accumulate);
    LAST_REDUCES: the last of a column tile's SPLIT programs also writes out[m, n] = sum_k o[k, m, n].
    PDL (launched as a programmatic dependent launch): the next PDL kernel may start launching at once
    (it waits for this grid's completion before reading anything), and this one waits for the previous
    grid's completion and memory flush before its first load."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, 128)
    x_rows = x_ptr + rows[:, None] * stride_xm                                   # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn                    # [1, BN]
    ws_row = ws_ptr + ((pid_n * BN) // 128) * stride_wsn                         # the tile's one scale row
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, GPS):                      # constexpr trip count: see module docstring
        g = pid_k * GPS + i
        kk = g * 128 + offs_k                                                    # [128]
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        q, s = _fp8_group_quant(x, eps, fmax, UE8M0, INTERP)                     # [BM, 128] e4m3, [BM] fp32
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)   # [128, BN] e4m3
        w_s = tl.load(ws_row + g * stride_wsk, mask=g < G, other=0.0)            # scalar fp32
        if INTERP:
            q = q.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(q, w) * (s[:, None] * w_s)
    tile_ok = row_ok[:, None] & n_ok[None, :]
    o_ptrs = o_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=tile_ok)
    if LAST_REDUCES:
        tl.debug_barrier()                       # every thread's partial stored before the release below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:                 # the tile's last program: all SPLIT partials are visible
            p_ptrs = o_ptr + rows[:, None] * stride_om + offs_n[None, :]
            tot = tl.load(p_ptrs, mask=tile_ok, other=0.0, cache_modifier=".cg")            # [BM, BN] fp32
            for j in tl.static_range(1, SPLIT):
                tot += tl.load(p_ptrs + j * stride_os, mask=tile_ok, other=0.0, cache_modifier=".cg")
            out_ptrs = out_ptr + rows[:, None] * stride_outm + offs_n[None, :]
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=tile_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit(do_not_specialize=['MN'])   # sizes that change per step: no recompiles (cuda/__init__)
def _split_k_sum_kernel(p_ptr, o_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """o[i] = ((p[0, i] + p[1, i]) + p[2, i]) + ... in split order (deterministic), cast to o's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------

_counters: dict[tuple[str, int | None, int], torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The zeroed int32 arrival counters for reduce="last" of the device and the current stream lane
    (kernels/streams.py: each launch leaves them at 0; a layer's side lane has its own, so launches that
    run concurrently on two streams never share a counter), or None while a CUDA graph is being captured
    before they exist (allocating them there would put a memset into the graph and the buffer into its
    private pool)."""
    key = (device.type, device.index, lane())
    buf = _counters.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        for ln in LANES:          # every lane's at once: a lane first used inside a capture finds its own
            _counters.setdefault((device.type, device.index, ln), torch.zeros(COUNTERS, dtype=torch.int32,
                                                                              device=device))
        buf = _counters[key]
    return buf


def block_fp8_linear_small_m(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, *,
                             out_dtype: torch.dtype | None = None, act_ue8m0: bool = False,
                             split_k: int | None = None, config: SmallMConfig | None = None,
                             reduce: str | None = None, pdl: bool = False) -> torch.Tensor:
    """y [M, N] = quant_1x128(x) @ dequant(w)^T in one fused launch, for M <= 64.

    x [M, K] bf16/fp16 (fp32 accepted), unit last stride (any row stride); w float8_e4m3fn [N, K] with
    unit last stride (any row stride: the padded corner views of `block_fp8_linear_prepare` work);
    w_scale_inv fp32 [ceil(N/128), ceil(K/128)] (any strides). out_dtype: default x.dtype.
    `split_k` None = heuristic (see `small_m_config`); `config` overrides the whole tile config (tuning);
    `reduce` = who adds split-K partials: "last" program of each tile (one launch) or a second "kernel";
    None = the config's. `pdl`: launch as a programmatic dependent launch (sm_90+; an experiment, see
    bench_kernels --small-m-pdl: not used by the engine).
    """
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (tuple(x.shape), tuple(w.shape))
    assert reduce is None or reduce in REDUCE_MODES, reduce
    m, k = x.shape
    n = w.shape[0]
    odt = out_dtype or x.dtype
    assert m <= MAX_M, f"block_fp8_linear_small_m is designed for M <= {MAX_M} (got M = {m})"
    assert w.dtype == torch.float8_e4m3fn and w.stride(1) == 1, (w.dtype, w.stride())
    assert w_scale_inv.dtype == torch.float32 and tuple(w_scale_inv.shape) == (cdiv(n, GROUP), cdiv(k, GROUP)), \
        (w_scale_inv.dtype, tuple(w_scale_inv.shape))
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=odt, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or small_m_config(m, n, k, split_k=split_k, num_sms=num_sms(x.device))
    groups = cdiv(k, GROUP)
    assert cfg.split * cfg.groups_per_split >= groups and GROUP % cfg.block_n == 0 and cfg.block_m >= m, cfg
    kdt = torch.float32 if INTERPRET else odt          # interpreter: fp32 out, cast by torch (see docstring)
    out = torch.empty(m, n, dtype=kdt, device=x.device)
    n_tiles = cdiv(n, cfg.block_n)
    reduce = reduce or cfg.reduce
    counters = None
    if cfg.split > 1:
        dst = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)      # [split, M, N] partials
        stride_os, stride_om = dst.stride(0), dst.stride(1)
        if reduce == "last" and n_tiles <= COUNTERS:
            counters = _arrival_counters(x.device)
    else:
        dst, stride_os, stride_om = out, 0, out.stride(0)
    last = counters is not None
    _fp8_small_m_kernel[(n_tiles, cfg.split)](
        x, w, w_scale_inv, dst, out, counters if last else dst, m, n, k, groups,
        x.stride(0), w.stride(0), w_scale_inv.stride(0), w_scale_inv.stride(1), stride_os, stride_om,
        out.stride(0), ACT_EPS, FP8_MAX,
        UE8M0=act_ue8m0, INTERP=INTERPRET, BM=cfg.block_m, BN=cfg.block_n, GPS=cfg.groups_per_split,
        SPLIT=cfg.split, LAST_REDUCES=last, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}))
    if cfg.split > 1 and not last:
        _split_k_sum_kernel[(cdiv(m * n, SUM_BLOCK),)](dst, out, m * n, SPLIT=cfg.split, BLOCK=SUM_BLOCK,
                                                        num_warps=4)
    return out.to(odt)
