"""Pure-torch helpers of the `cuda` backend: block-FP8 weight padding for `torch._scaled_mm`, the
sorted/grouped MoE dispatch ("align"), and the tile-config heuristics. No Triton, no CUDA needed:
everything here runs (and is unit-tested) on CPU.

Padding for `torch._scaled_mm` blockwise (1x128 activations x 128x128 weights):

* K is padded to a multiple of `SCALED_MM_K_ALIGN` = 512 (K/128 % 4 == 0). torch 2.11's cuBLASLt path
  silently returns garbage when K/128 is not a multiple of 4 (measured: K=640, 768 wrong; 1024, 1536,
  2048, 5120, 18432 right, on H200: docs/measurements/2026-11-30). GLM shapes hit it: GLM-4.7-Flash /
  glm5-flash-31b `q_b_proj` has K = q_lora_rank = 768, and a TP8 dense `down_proj` of 10240 has K=1280.
  We pad rather than fall back to the reference: zero weight columns times zero activation columns add
  exactly 0 to every fp32 partial sum, so the result is the unpadded GEMM's, at (Kp-K)/K extra bytes
  (768 -> 1024: +33% on that one matrix), while the reference would dequantize the whole weight on
  every call (an N x K fp32 temporary and a plain fp32 GEMM: ~10x slower and more memory).
* N is padded to a multiple of 128 (kv_a_proj_with_mqa: N = 512 + 64 = 576 -> 640). The 128x128
  scale-shape check accepts ceil(N/128) rows, but whether cuBLASLt handles a partial last N block was
  not measured; zero rows are exact and the output is sliced back to N columns.
* M is padded to a multiple of 4 per call (the activation quant kernel writes the padded rows as
  zeros; no extra copy).

The padded weight is stored ONCE, at `block_fp8_linear_prepare`, and the layer keeps a *view* of its
top-left [N, K] corner (strides (Kp, 1)), so the parameter keeps its checkpoint shape (loaders,
`dequantized_weight` for MLA absorption and the torch reference still see [N, K]); the kernel recovers
the padded tensor from the view's storage (`padded_base`). If the view was replaced by a plain
tensor (someone called `.contiguous()`), `padded_base` returns None and the op pads per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

SCALED_MM_K_ALIGN = 512          # K/128 % 4 == 0 (the torch 2.11 cuBLASLt blockwise trap)
SCALED_MM_N_ALIGN = 128          # whole 128-row weight blocks
SCALED_MM_M_ALIGN = 4            # rows of the activation operand
BLOCK = (128, 128)


DEFAULT_SMS = 132                # H100 / H200 SXM: the tile heuristics' SM count off a CUDA device (interpreter)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached per device; DEFAULT_SMS off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# --------------------------------------------------------------------------------------------
# block-FP8 dense weights
# --------------------------------------------------------------------------------------------

def row_tiles(rows: torch.Tensor, block: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile table of a grid over segments of consecutive rows (a varlen kernel's query tiles): segment b
    has rows[b] rows (device ints), cut into tiles of `block`. Returns (tile_seg [NT] int32: the segment of
    each program, -1 = a surplus program; tile_off [NT] int32: its tile's first row within the segment), with
    NT = cdiv(total, block) + B from host ints (`total` >= sum(rows)): device ops only, no host sync."""
    B = rows.shape[0]
    n = rows.long()
    tiles = (n + block - 1) // block                                       # [B]
    ends = torch.cumsum(tiles, 0)                                          # [B] inclusive
    t = torch.arange(cdiv(total, block) + B, device=rows.device)           # [NT]
    seg = torch.searchsorted(ends, t, right=True)                          # first b with end > t
    live = seg < B
    segc = seg.clamp(max=B - 1)
    tile_seg = torch.where(live, segc, -1).to(torch.int32)
    tile_off = torch.where(live, (t - (ends - tiles)[segc]) * block, 0).to(torch.int32)
    return tile_seg, tile_off


def scaled_mm_padded_dims(n: int, k: int) -> tuple[int, int]:
    """(Np, Kp) the blockwise `_scaled_mm` path runs an [N, K] weight at."""
    return round_up(n, SCALED_MM_N_ALIGN), round_up(k, SCALED_MM_K_ALIGN)


def pad_block_fp8_weight(w: torch.Tensor, scale_inv: torch.Tensor, np_: int, kp: int,
                         scale_fill: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad w [N, K] (fp8) to [Np, Kp] and scale_inv [ceil(N/128), ceil(K/128)] to [Np/128, Kp/128]
    (new scale entries = `scale_fill`; they only ever multiply zero weights). Both results are
    contiguous; returns (w_padded, scale_padded)."""
    n, k = w.shape
    gn, gk = scale_inv.shape
    if (gn, gk) != (cdiv(n, BLOCK[0]), cdiv(k, BLOCK[1])):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} in 128x128 blocks")
    wp = torch.zeros(np_, kp, dtype=w.dtype, device=w.device)
    wp[:n, :k] = w
    sp = torch.full((np_ // BLOCK[0], kp // BLOCK[1]), scale_fill, dtype=torch.float32, device=scale_inv.device)
    sp[:gn, :gk] = scale_inv.to(torch.float32)
    return wp, sp


def corner_view(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] top-left view of a contiguous 2-D tensor (shares its storage)."""
    return t[:rows, :cols]


def padded_base(view: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
    """Recover the contiguous [rows, cols] tensor whose top-left corner `view` is (see `corner_view`),
    or None if `view` is not such a corner (different strides, or its storage is too small)."""
    if view.dim() != 2 or view.shape[0] > rows or view.shape[1] > cols:
        return None
    if view.shape == (rows, cols) and view.is_contiguous():
        return view
    if view.stride() != (cols, 1):
        return None
    need = (view.storage_offset() + rows * cols) * view.element_size()
    if view.untyped_storage().nbytes() < need:
        return None
    return view.as_strided((rows, cols), (cols, 1), view.storage_offset())


def prepare_scaled_mm_weight(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`block_fp8_linear_prepare` layout for the `_scaled_mm` path: (w_view [N, K], scale_view
    [ceil(N/128), ceil(K/128)], meta) where the views are corners of the zero-padded [Np, Kp] /
    [Np/128, Kp/128] tensors and meta = {"n_pad": Np, "k_pad": Kp} (forwarded to block_fp8_linear)."""
    n, k = w.shape
    np_, kp = scaled_mm_padded_dims(n, k)
    if (np_, kp) == (n, k):
        return w.contiguous(), scale_inv.to(torch.float32).contiguous(), {"n_pad": np_, "k_pad": kp}
    wp, sp = pad_block_fp8_weight(w, scale_inv, np_, kp)
    gn, gk = scale_inv.shape
    return corner_view(wp, n, k), corner_view(sp, gn, gk), {"n_pad": np_, "k_pad": kp}


def scaled_mm_operands(w: torch.Tensor, scale_inv: torch.Tensor, n_pad: int | None = None,
                       k_pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The padded contiguous (w [Np, Kp], scale [Np/128, Kp/128]) for `_scaled_mm`, from prepared
    views when possible (no copy), else by padding now. Returns (wp, sp, copied)."""
    n, k = w.shape
    np_, kp = scaled_mm_padded_dims(n, k)
    if n_pad is not None and (n_pad, k_pad) != (np_, kp):
        raise ValueError(f"weight prepared for ({n_pad}, {k_pad}) but needs ({np_}, {kp})")
    wp = padded_base(w, np_, kp)
    sp = padded_base(scale_inv, np_ // BLOCK[0], kp // BLOCK[1]) if scale_inv.dtype == torch.float32 else None
    if wp is not None and sp is not None:
        return wp, sp, False
    wp, sp = pad_block_fp8_weight(w, scale_inv, np_, kp)
    return wp, sp, True


# --------------------------------------------------------------------------------------------
# MoE dispatch: (token, slot) pairs sorted by expert, each expert's run padded to BLOCK_M
# --------------------------------------------------------------------------------------------

@dataclass
class MoEAlign:
    sorted_ids: torch.Tensor     # int32 [max_blocks * BM]: pair id (t*K + k) per sorted slot; P = padding
    expert_ids: torch.Tensor     # int32 [max_blocks]: the expert of each BM-row block
    num_post_pad: torch.Tensor   # int32 [1]: used rows (a multiple of BM); blocks at/after it are skipped
    max_blocks: int              # host-side grid bound (static: from shapes, no device read)
    block_m: int


def moe_max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / BM): every non-empty expert wastes < 1 block."""
    return min(cdiv(num_pairs, block_m) + min(num_experts, num_pairs), cdiv(num_pairs + num_experts * (block_m - 1),
                                                                         block_m))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlign:
    """Sort the T*K (token, slot) pairs by expert and pad each expert's run to a multiple of `block_m`,
    with device ops only (no `.item()`, no bincount — CUDA bincount reads the max back to the host —
    so it is CUDA-graph capturable). Within an expert, pairs keep ascending pair order (stable sort).

    topk_ids [T, K] (any int dtype, values in [0, E)) -> MoEAlign.
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    pstart = torch.cumsum(padded, 0) - padded                          # [E] first padded row of e
    start = torch.cumsum(counts, 0) - counts                           # [E] first sorted pair of e
    order = torch.argsort(flat, stable=True)                           # [P] pair ids sorted by expert
    se = flat[order]
    rank = torch.arange(p, device=dev) - start[se]
    dest = pstart[se] + rank
    max_blocks = moe_max_blocks(p, num_experts, block_m)
    sorted_ids = torch.full((max_blocks * block_m,), p, dtype=torch.int32, device=dev)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    cum_blocks = torch.cumsum(padded // block_m, 0)                    # [E]
    blk = torch.arange(max_blocks, device=dev)
    expert_ids = torch.searchsorted(cum_blocks, blk, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    num_post_pad = (cum_blocks[-1:] * block_m).to(torch.int32)
    return MoEAlign(sorted_ids, expert_ids, num_post_pad, max_blocks, block_m)


# --------------------------------------------------------------------------------------------
# tile configs (static heuristics; not tuned per shape yet)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False            # operands through tensor descriptors (TMA); read by moe_prefill.py only
    # registers a thread may use (ptxas .maxnreg; moe_prefill.py only): the up kernel's 158 at 8 warps leave room
    # for one CTA an SM; <= 128 (with 2 stages: 80 KiB of shared memory) lets two share one, so one's promotion
    # and epilogue overlap the other's wgmma (sm_90a compile: 128 spills ~100 bytes a thread). None: ptxas decides
    maxnreg: int | None = None
    # moe_prefill.py only: > 0 launches that many programs an SM, each striding over the used tiles in one flattened
    # loop (Triton's persistent matmul): the next tile's loads are issued under this one's epilogue, and the grid
    # holds no programs past the device's row count. 0: one program a tile
    persistent: int = 0


def moe_configs(w_mode: str, num_pairs: int, num_experts: int) -> tuple[TileConfig, TileConfig]:
    """(stage-1 config, stage-2 config) for the grouped MoE kernels. BM is shared (one alignment).

    w_mode "bf16" | "fp8" | "mxfp4". FP8 needs BK = 128 (one scale group per K step) and a stage-1
    BN of 128 (the re-quantization group of the stage-2 input is the tile's row); MXFP4 needs BN and BK
    multiples of 32. Stage 1 holds two fp32 accumulators (gate and up), so its BM stays <= 64.
    """
    avg = num_pairs / max(1, num_experts)           # mean rows per expert (uniform-routing estimate)
    if avg <= 16:
        bm, warps, stages = 16, 4, 4
    elif avg <= 48:
        bm, warps, stages = 32, 4, 4
    else:
        bm, warps, stages = 64, 8, 3
    bk = 128 if w_mode == "fp8" else 64
    small = avg <= 16
    bn1 = 128 if (w_mode == "fp8" or not small) else 64
    bn2 = 64 if small else 128
    # two BM x 128 fp32 accumulators + dequantized tiles spill at 4 warps from BM = 32 (ptxas -v, sm_90a)
    warps1 = 8 if (bm >= 32 and bn1 == 128) else warps
    return TileConfig(bm, bn1, bk, warps1, stages), TileConfig(bm, bn2, bk, warps, stages)


# The prefill kernels' tiles (moe_prefill.py), by mean rows per expert P / E (uniform-routing estimate): the
# first row whose bound is >= that mean. Stage 1's BN is 256 = 128 gate + 128 up columns in one accumulator
# (fixed: one scale block and one re-quantization group per half); BK = 128 (one scale group per K step).
# Register budget (sm_90a, ptxas -v with Triton 3.6): the fp32 accumulator plus each K step's dot result are
# 2 x BM x BN / (32 x warps) registers a thread, so BM 64 x BN 256 needs 8 warps and BM 128 x 256 does not fit.
# H200 (2026-12-04, `python -m glm_ray.bench.moe_prefill --geo flash glm5 --mode fp8 --tokens 2048 8192 --path
# old new --new-configs default 64:256:128:128:8:8:3:tma 64:256:128:128:8:8:4:tma --stages`): TMA operands at
# 3 stages were the fastest or within 3% at every point: glm5-flash-31b 8192 tokens 1.10 ms vs 1.17 (pointer
# loads) vs 1.45 (the grouped kernels), 2048 tokens 0.386 vs 0.414 vs 0.457; GLM-5 8192 8.67 vs 9.58 vs 11.03,
# 2048 3.22 vs 3.50 vs 3.59 ms. The BM 32 row (<= 24 rows per expert) is not measured yet.
MOE_PREFILL_TABLE: tuple[tuple[float, TileConfig, TileConfig], ...] = (
    (24.0, TileConfig(32, 256, 128, 8, 4), TileConfig(32, 128, 128, 4, 4)),
    (float("inf"), TileConfig(64, 256, 128, 8, 3, tma=True), TileConfig(64, 128, 128, 8, 3, tma=True)),
)


def moe_prefill_configs(num_pairs: int, num_experts: int) -> tuple[TileConfig, TileConfig]:
    """(stage-1 config, stage-2 config) of the prefill FP8 MoE kernels (`MOE_PREFILL_TABLE`); BM is shared."""
    avg = num_pairs / max(1, num_experts)
    for bound, c1, c2 in MOE_PREFILL_TABLE:
        if avg <= bound:
            return c1, c2
    return MOE_PREFILL_TABLE[-1][1:]


def dense_config(w_mode: str, m: int) -> TileConfig:
    """Config for the dense (identity-dispatch) use of the down-projection kernel."""
    bk = 128 if w_mode == "fp8" else 64
    if m <= 16:
        return TileConfig(16, 64, bk, 4, 4)
    if m <= 64:
        return TileConfig(32, 64, bk, 4, 4)
    if m <= 256:
        return TileConfig(64, 128, bk, 4, 3)
    return TileConfig(128, 128, bk, 8, 3)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


# `fp32_linear`'s one launch while T x N x D <= this many FMAs, cuBLAS's fp32 GEMM above: on the H200 (graph
# replays, `scripts/bench_kernels.py --decode-small-ops`) the kernel won at glm5-flash-31b's router up to T = 32
# (13.4 vs 16.5 us; 4.2M FMAs), tied at GLM-5's at T = 8 (28.6 vs 29.2 us; 12.6M) and lost above (20.1 vs
# 16.7 us at flash T = 64; 90 vs 25 us at GLM-5 T = 32): its FMAs run on the CUDA cores
FP32_LINEAR_MAX_FMAS = 6_000_000
FP32_LINEAR_PROGRAMS = 128  # programs a launch aims at (~one per H200 SM)
# From this many rows (bf16 / fp16 x: prefill and mixed steps) `fp32_linear` runs on the tensor cores with the weight
# split into three bf16 parts (fp32_linear.py, `split3`): the session-34 profile of a glm5-flash-31b 8 x 1k step had
# cuBLAS's fp32 SIMT GEMM (`sm80_xmma_gemm_f32f32`) at 2.7 ms a step (58 us a router call, ~37 TFLOP/s). Below it
# (decode) the paths measured in session 25 stay. H100, session 43 (`bench_kernels --prefill-fp32-linear`): the split
# kernel vs cuBLAS fp32 at M = 512 / 2048 / 8192 — flash router 22.1 / 24.1 / 33.4 vs 24.6 / 42.3 / 117.0 us, GLM-5
# router 57.1 / 63.4 / 146.2 vs 70.7 / 183.3 / 663.8; the indexer's weights_proj tie at flash M = 512 (21.4 vs 20.6)
# and lose at GLM-5's (56.0 vs 40.8; from 2,048 rows they win 1.7-4.1x): 512 stays, 1,024 is unmeasured.
FP32_LINEAR_SPLIT_MIN_ROWS = 512


def fp32_linear_split_config(T: int, N: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) of the split-weight tensor-core kernel: 64-row tiles (at 8k rows and N = 64
    that is 128 programs: ~one per SM), the outputs in one or a few 64-wide tiles."""
    return 64, max(16, min(64, next_pow2(N))), 64, 4, 3


def fp32_linear_config(T: int, N: int, D: int) -> tuple[int, int, int]:
    """(BT, BN, BK): tokens x outputs per program so that a launch has ~FP32_LINEAR_PROGRAMS programs, and a
    [BT, BN, BK] product tile of <= 4096 fp32 (32 registers a thread at 4 warps). Shapes only."""
    bt = min(16, next_pow2(max(T, 1)))
    want = N * cdiv(max(T, 1), bt) // FP32_LINEAR_PROGRAMS
    bn = max(1, min(16, next_pow2(max(want, 1)), next_pow2(N), 4096 // (32 * bt)))
    bk = max(32, min(next_pow2(D), 4096 // (bt * bn)))
    return bt, bn, bk
