"""aiter-backed quantized ops (see the package docstring). The contract with aiter, per op:

Dense block-FP8 linear (`block_fp8_linear`, §2.4/§2.6):
  x (bf16) -> `get_hip_quant(QuantType.per_1x128)(x, quant_dtype=dtypes.fp8, transpose_scale=False)`
  -> (xq [M, K] fp8, x_scale [M, K/128] fp32 row-major) ->
  preshuffled weights: `gemm_a8w8_blockscale_bpreshuffle(xq, WQ, x_scale_colmajor, w_scale, dtype=bf16)` with
    WQ = `shuffle_weight(W, (16, 16))` (done once by `block_fp8_linear_prepare`) and x_scale in
    column-major layout (strides (1, M): `x_scale.t().contiguous().t()`);
  plain weights: `gemm_a8w8_blockscale(xq, W, x_scale, w_scale, dtype=bf16)`.
  Shapes/options not known to be supported (block != 128x128, N or K not multiples of 128 — e.g. GLM's
  kv_a_proj_with_mqa N=576 —, UE8M0 activations, pre-quantized tuple input) use the torch reference
  on the (un-shuffled) weight, logged once per shape.

Fused MoE (`fused_moe_block_fp8` / `fused_moe_mxfp4`, §4.1-4.7):
  `fused_moe(hidden_states, w1, w2, topk_weight fp32, topk_ids int32, activation=ActivationType.Silu,
   quant_type=QuantType.per_128x128 | per_1x32, doweight_stage1=False, w1_scale, w2_scale,
   dtype=bf16, hidden_pad, intermediate_pad, swiglu_limit, gate_mode="separated")`
  * routing weights already include GLM's routed_scaling_factor (applied by our router);
  * block FP8: w1/w2 = shuffle_weight(., (16, 16)) per expert, fp32 scales untouched
    ([E, 2I/128, D/128], [E, D/128, I/128]);
  * MXFP4: packed uint8 shuffled (16, 16) then viewed as `dtypes.fp4x2`; scales `e8m0_shuffle` of the
    2-D views [E*2I, D/32] / [E*D, I/32], viewed back to 3-D and as `dtypes.fp8_e8m0`;
    `is_shuffled = True` on every weight handed over (aiter reads it);
  * hidden_pad: hidden_states are given with D' = D + hidden_pad columns (zeros) — aiter's model_dim is
    w2.shape[1] — and the output's pad columns are dropped (ASSUMPTION from aiter's model_dim
    derivation; to be confirmed on MI355X).
Dense MXFP4 (shared experts / dense layers of Quark checkpoints): not wired to aiter's a4w4 GEMM yet;
  the Triton W4A16 GEMM with the MXFP4 activation qdq (below) — aiter's a4w4 GEMM is a GPU TODO.
Absorbed MLA decode (`mla_decode`; aiter/mla.py, ROCm/aiter e4048607):
  `mla_decode_fwd(q [B, H', 576] bf16 contiguous, kv_buffer, o [B, H', 512] bf16 (written in place),
   qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q=1, sm_scale=scale)`
  (non-persistent split-KV path: no work_meta_data), every index tensor int32;
  * page size 1: kv_buffer = kv_cache.view(S, 1, 1, 576) ([num_pages, page_size, nhead_kv, D]) and
    kv_indices = the flat cache slot of every attended position, packed per sequence (kv_indptr [B+1] =
    cumulative counts, kv_last_page_lens = ones). aiter's decode is validated (op_tests/test_mla.py,
    vLLM's AITER MLA backend: kernel block size 1, sglang's NSA decode) at page size 1 only, and older
    aiter derived the page size from kv_buffer.shape[1] instead of a `page_size` argument: both read the
    same here. page_size / nhead_kv are left at their default (1) for the same reason;
  * dense: the slots of positions 0..ctx-1 over the key width kv_capacity or max_context_len; DSA top-k
    (int32 positions [B, 1, k], -1 padded — a page table of page size 1): slot = block_table[b, p // bs]
    * bs + p % bs of each valid position (0 <= p < ctx, so -1 may sit anywhere in a row). Built on the
    device by `mla_page_table` (cumsum + scatter into a zeroed [B*K] buffer; entries past kv_indptr[B]
    are never read): no host sync, static shapes, CUDA-graph capturable. aiter's own host work
    (get_meta_param's split count) depends on shapes only (B, kv_indices.numel(), heads), never values;
  * heads: the bf16 asm decode kernels exist for H' in {8, 16, 32, 64, 128} (hsa/gfx950/mla/mla_asm.csv,
    max_seqlen_q 1): H heads are zero-padded up to the next of those (the pad heads' output is dropped);
  * torch reference instead: more than one query per sequence, a bool-mask selection (k-pool indexer),
    non-bf16 q or cache (fp8 needs q/kv scales), a latent width other than 512 + 64, more than 128
    heads, a cache whose rows are not contiguous — each logged once.
MoE routing (`moe_routing`; aiter/ops/topk.py):
  `biased_grouped_topk(gating_output [T, E], correction_bias [E] (the gating dtype: the HIP kernel reads
   it as such), topk_weights [T, K] fp32, topk_ids [T, K] int32, num_expert_group, topk_group,
   need_renorm, routed_scaling_factor)` filled in place: sigmoid scores, biased selection, the top-2-sum
   group score, un-biased weights / sum * scale. Neither its opt-sort kernel nor the `moe_fused_gate`
   path (T > 212 * CUs with <= 32 experts per group) promises descending order, so the pairs are
   re-sorted by biased score here (a [T, K] sort). bias None = zeros (selection on the plain scores).
  The reference instead for n_group not in (1, 8) (2 and 4 dispatch, but the group-score reduction of
  that kernel has no cross-lane steps when more than 8 lanes serve a group), top_k > 64 (one lane per
  pick), E % n_group != 0, and renormalize=False where `moe_fused_gate` (asserts need_renorm) may run.
DSA indexer (`indexer_topk`): the Triton kernels (below). aiter's indexer pieces —
  `deepgemm_fp8_paged_mqa_logits` (FP8 queries against an FP8 key cache with per-token scales in
  DeepGEMM's paged layout) and `top_k_per_row_decode` — do not fit this op's contract (fp32 queries, a
  bf16 key cache [S, di]): using them means an FP8 index-key cache first (a GPU TODO).
Everything else — what aiter has no op for, and the shapes above that aiter's kernels do not take (the
  mla_decode and moe_routing fallbacks) — runs the cuda backend's plain-Triton kernels
  (`cuda.ops.ROCM_PORTABLE`: no TMA, PDL, `.cg` loads or `_scaled_mm`, so they compile for gfx950 as for
  Hopper): mla_prefill, indexer_topk, the bf16 fused_moe, mxfp4_linear, kda_decode, mhc_coefficients,
  swiglu, rms_norm, rope_inplace, fp32_linear and the two cache writes. Each falls back to the torch
  reference itself (unsupported shape, or a kernel that failed to compile: logged, once). Their tile
  configs are Hopper's, untuned for CDNA — correct first, tuned on an MI355X later. indexer_kpool_topk and
  causal_conv1d have no kernel in any backend, and kda_chunked's scan kernel is the cuda backend's alone (3xTF32
  dots, opt-in there): the torch reference.

  Known numerics differences from the torch reference (documented, measured on GPU later):
  * aiter HIP MXFP4 activation quant uses RoundUp E8M0 scales (aiter#3212); Quark checkpoints
    declare "even" — logged once;
  * swiglu_limit is honoured only by FlyDSL/Opus stage-1 kernels at aiter HEAD (§4.5): the FP8 CK/asm
    path may silently skip the clamp — the |gate| > 10 GPU test must decide.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from glm_ray.kernels.cuda.ops import ROCM_PORTABLE, CudaKernels
from glm_ray.kernels.table import KernelOps
from glm_ray.kernels.torch_ref import attention as ref_attention
from glm_ray.kernels.torch_ref import quant_ops as ref
from glm_ray.kernels.torch_ref.aiter_layout import unshuffle_weight, x_scale_to_col_major
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear
from glm_ray.kernels.torch_ref.fp8 import normalize_e4m3fn_to_e4m3fnuz
from glm_ray.kernels.torch_ref.routing import moe_routing as ref_moe_routing

logger = logging.getLogger(__name__)

AITER_PADDING_FP4 = 256          # aiter pads the MXFP4 intermediate dim to 128 bytes = 256 fp4 (§4.6)
BLOCK = (128, 128)
MLA_HEADS = (8, 16, 32, 64, 128)   # heads of aiter's bf16 asm MLA decode kernels (max_seqlen_q 1, non-persistent)
MLA_DIMS = (512, 64)               # (kv_lora_rank, rope dim) those kernels are built for
ROUTING_GROUPS = (1, 8)            # n_group values biased_grouped_topk reduces correctly (see the docstring)
ROUTING_MAX_TOPK = 64              # one lane of a 64-wide wave per pick
FUSED_GATE_MAX_PER_GROUP = 32      # biased_grouped_topk may take moe_fused_gate (need_renorm only) up to this


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def mla_page_table(block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                   positions: torch.Tensor | None, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-size-1 page table aiter's MLA decode reads: (kv_indptr [B+1] int32, kv_indices [B*K] int32).

    positions None: every context position 0..ctx-1 (K = kmax); else int [B, K] key positions, -1 (or
    >= ctx) = none. Sequence b's flat cache slots sit at kv_indices[kv_indptr[b]:kv_indptr[b+1]] in
    position order; the tail past kv_indptr[B] is zeros (a valid slot, never read). Device ops only.
    """
    B, nb = block_table.shape
    dev = block_table.device
    ctx = context_lens.long()[:, None]                                      # [B, 1]
    if positions is None:
        pos = torch.arange(kmax, device=dev).expand(B, kmax)               # [B, K]
    else:
        pos = positions.long()                                              # [B, K]
    K = pos.shape[1]
    valid = (pos >= 0) & (pos < ctx)                                        # [B, K]
    pos = torch.where(valid, pos, 0)
    blk = block_table.long().gather(1, (pos // block_size).clamp(max=nb - 1))   # [B, K]
    slots = (blk * block_size + pos % block_size).to(torch.int32)          # [B, K]
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = valid.sum(1).cumsum(0)                                  # [B+1]
    # packed destination of every valid entry; the invalid ones all land in one spare cell past the end
    dest = kv_indptr[:-1, None].long() + valid.long().cumsum(1) - 1         # [B, K]
    dest = torch.where(valid, dest, B * K)
    kv_indices = torch.zeros(B * K + 1, dtype=torch.int32, device=dev)
    kv_indices.scatter_(0, dest.flatten(), slots.flatten())
    return kv_indptr, kv_indices[:B * K]


class AiterKernels:
    """Holds the imported aiter entry points; methods are the KernelOps fields."""

    name = "aiter"

    def __init__(self, aiter_module=None, triton: CudaKernels | None = None):
        self.triton = triton                                                 # the Triton fallback (None: torch)
        if aiter_module is None:
            import aiter as aiter_module  # noqa: PLC0415 (lazy by design)
        from aiter.fused_moe import fused_moe  # noqa: PLC0415 - aiter (optional, ROCm only)
        from aiter.ops.shuffle import shuffle_weight  # noqa: PLC0415 - aiter (optional, ROCm only)
        from aiter.utility.fp4_utils import e8m0_shuffle  # noqa: PLC0415 - aiter (optional, ROCm only)
        self.aiter = aiter_module
        self.dtypes = aiter_module.dtypes
        self.QuantType = aiter_module.QuantType
        self.ActivationType = aiter_module.ActivationType
        from aiter.mla import mla_decode_fwd  # noqa: PLC0415 - aiter (optional, ROCm only)
        self.fused_moe = fused_moe
        self.mla_decode_fwd = mla_decode_fwd
        self.shuffle_weight = shuffle_weight
        self.e8m0_shuffle = e8m0_shuffle
        self.fp8 = self.dtypes.fp8                                           # e4m3fn on gfx950, fnuz on gfx942
        self._warned: set[str] = set()

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def _slow(self, op: str, reason: str, reference):
        """What runs `op` where aiter's kernel cannot: the Triton kernel (which has its own reference fallback),
        else the torch reference; logged once per reason."""
        slow = getattr(self.triton, op) if self.triton is not None else reference
        self._warn_once(f"{op}:{reason}", "aiter backend: %s uses %s: %s", op,
                        "the Triton kernel" if self.triton is not None else "the torch reference", reason)
        return slow

    # ---- dense block-FP8 ------------------------------------------------------------------------
    def block_fp8_linear_prepare(self, w: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK):
        n, k = w.shape
        if self.fp8 == torch.float8_e4m3fnuz and w.dtype == torch.float8_e4m3fn:
            w, scale_inv = normalize_e4m3fn_to_e4m3fnuz(w, scale_inv)        # gfx942 only
        if tuple(block) != BLOCK or n % 128 or k % 128:
            return w, scale_inv, {}
        ws = self.shuffle_weight(w, (16, 16))
        return ws, scale_inv, {"preshuffled": True}

    def block_fp8_linear(self, x, w, scale_inv, block=BLOCK, out_dtype=None, *, act_ue8m0: bool = False,
                         bias=None, mode: str = "w8a8", preshuffled: bool = False, out: torch.Tensor | None = None,
                         **kw):
        y = self._block_fp8_linear(x, w, scale_inv, block, out_dtype, act_ue8m0=act_ue8m0, bias=bias, mode=mode,
                                   preshuffled=preshuffled, **kw)
        return y if out is None else out.copy_(y)        # (aiter's blockscale GEMMs allocate their output)

    def _block_fp8_linear(self, x, w, scale_inv, block, out_dtype, *, act_ue8m0, bias, mode, preshuffled, **kw):
        k = w.shape[-1]
        if (isinstance(x, (tuple, list)) or tuple(block) != BLOCK or mode != "w8a8" or act_ue8m0 or k % 128
                or w.shape[0] % 128):
            self._warn_once(f"lin{tuple(w.shape)}", "aiter block_fp8_linear: shape %s / options not supported by "
                            "aiter, using the torch reference", tuple(w.shape))
            wp = unshuffle_weight(w) if preshuffled else w
            return ref_block_fp8_linear(x, wp, scale_inv, block, out_dtype, mode=mode, act_ue8m0=act_ue8m0, bias=bias,
                                        fp8_dtype=wp.dtype, **kw)
        lead = x.shape[:-1]
        odt = out_dtype or x.dtype
        kdt = odt if odt in (torch.bfloat16, torch.float16) else torch.bfloat16
        x2 = x.reshape(-1, k).to(kdt)
        quant = self.aiter.get_hip_quant(self.QuantType.per_1x128)
        xq, xs = quant(x2, quant_dtype=self.fp8, transpose_scale=False)      # [M, K], [M, K/128] row-major
        if preshuffled:
            y = self.aiter.gemm_a8w8_blockscale_bpreshuffle(xq, w, x_scale_to_col_major(xs), scale_inv, dtype=kdt)
        else:
            y = self.aiter.gemm_a8w8_blockscale(xq, w, xs, scale_inv, dtype=kdt)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(odt).reshape(*lead, w.shape[0])

    # ---- fused MoE ------------------------------------------------------------------------------
    def moe_quant_layout(self, kind: str, num_experts: int, hidden: int, inter: int, block=None):
        if kind == "fp8_block":
            if block is not None and tuple(block) != BLOCK:
                return ref.MoEQuantLayout(unsupported=f"aiter fused_moe runs 128x128 FP8 blocks only, got {block}")
            return ref.MoEQuantLayout(hidden_pad=_round_up(hidden, 128) - hidden,
                                      intermediate_pad=_round_up(inter, 128) - inter)
        if kind == "mxfp4":
            # I -> multiple of 256 fp4 (128 packed bytes); D -> multiple of 256 so that the scale
            # preshuffle needs no padding ((D/32) % 8 == 0 and E*D % 256 == 0).
            if hidden % 32 or inter % 32:
                return ref.MoEQuantLayout(unsupported="MXFP4 dims must be multiples of 32")
            return ref.MoEQuantLayout(hidden_pad=_round_up(hidden, 256) - hidden,
                                      intermediate_pad=_round_up(inter, AITER_PADDING_FP4) - inter)
        return ref.MoEQuantLayout(unsupported=f"no aiter MoE runner for {kind!r}")

    def _shuffled(self, w: torch.Tensor) -> torch.Tensor:
        y = self.shuffle_weight(w, (16, 16))
        y.is_shuffled = True
        return y

    def _e8m0_shuffled(self, s: torch.Tensor) -> torch.Tensor:
        e, rows, cols = s.shape
        flat = self.e8m0_shuffle(s.reshape(e * rows, cols))
        if tuple(flat.shape) != (e * rows, cols):
            raise ValueError(f"e8m0_shuffle padded scales {tuple(s.shape)} -> {tuple(flat.shape)}; "
                             "moe_quant_layout should have padded D/I")
        return flat.view(e, rows, cols)

    def moe_quant_prepare(self, kind: str, w13, w13_scale, w2, w2_scale):
        if kind == "fp8_block":
            if self.fp8 == torch.float8_e4m3fnuz and w13.dtype == torch.float8_e4m3fn:
                w13, w13_scale = normalize_e4m3fn_to_e4m3fnuz(w13, w13_scale)
                w2, w2_scale = normalize_e4m3fn_to_e4m3fnuz(w2, w2_scale)
            return self._shuffled(w13), w13_scale, self._shuffled(w2), w2_scale, {"preshuffled": True}
        if kind == "mxfp4":
            fp4x2, e8m0 = self.dtypes.fp4x2, self.dtypes.fp8_e8m0
            w13s = self.shuffle_weight(w13.view(torch.uint8), (16, 16)).view(fp4x2)
            w2s = self.shuffle_weight(w2.view(torch.uint8), (16, 16)).view(fp4x2)
            w13s.is_shuffled = True                                         # views lose the attribute: re-set
            w2s.is_shuffled = True
            s13 = self._e8m0_shuffled(w13_scale.view(torch.uint8)).view(e8m0)
            s2 = self._e8m0_shuffled(w2_scale.view(torch.uint8)).view(e8m0)
            return w13s, s13, w2s, s2, {"preshuffled": True}
        raise ValueError(f"no aiter MoE runner for {kind!r}")

    def _run_moe(self, quant_type, x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *, swiglu_limit,
                 gate_mode, hidden_pad, intermediate_pad):
        d = x.shape[-1]
        kdt = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        xp = F.pad(x, (0, hidden_pad)) if hidden_pad else x
        out = self.fused_moe(
            xp.to(kdt), w13, w2, topk_weights.to(torch.float32), topk_ids.to(torch.int32),
            activation=self.ActivationType.Silu, quant_type=quant_type, doweight_stage1=False,
            w1_scale=w13_scale, w2_scale=w2_scale, dtype=kdt, hidden_pad=hidden_pad,
            intermediate_pad=intermediate_pad, swiglu_limit=swiglu_limit, gate_mode=gate_mode)
        return (out[:, :d] if hidden_pad else out).to(x.dtype)

    def fused_moe_block_fp8(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, *,
                            block=BLOCK, act_ue8m0=False, swiglu_limit=None, gate_mode="separated", hidden_pad=0,
                            intermediate_pad=0, preshuffled=False):
        if not preshuffled:
            raise RuntimeError("aiter fused_moe (block FP8) needs weights prepared by the aiter runner")
        if act_ue8m0:
            self._warn_once("moe_ue8m0", "aiter fused_moe quantizes MoE activations with fp32 scales; the "
                            "checkpoint's UE8M0 activation-scale rounding is not reproduced")
        return self._run_moe(self.QuantType.per_128x128, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights,
                             topk_ids, swiglu_limit=swiglu_limit, gate_mode=gate_mode, hidden_pad=hidden_pad,
                             intermediate_pad=intermediate_pad)

    def fused_moe_mxfp4(self, x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *, act_mode="even",
                        swiglu_limit=None, gate_mode="separated", hidden_pad=0, intermediate_pad=0,
                        preshuffled=False):
        if not preshuffled:
            raise RuntimeError("aiter fused_moe (MXFP4) needs weights prepared by the aiter runner")
        if act_mode != "round_up":
            self._warn_once(f"mx_{act_mode}", "checkpoint declares MXFP4 activation scale mode %r; aiter's HIP "
                            "MoE quantizes activations with RoundUp scales", act_mode)
        return self._run_moe(self.QuantType.per_1x32, x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                             swiglu_limit=swiglu_limit, gate_mode=gate_mode, hidden_pad=hidden_pad,
                             intermediate_pad=intermediate_pad)

    # ---- absorbed MLA decode ----------------------------------------------------------------------
    def _mla_reason(self, q, kv_cache, group, selection, kv_lora_rank: int) -> str | None:
        D = kv_cache.shape[-1]
        if group.q_index.shape[1] != 1:
            return "more than one query per sequence"
        if selection is not None and (not isinstance(selection, torch.Tensor) or selection.dtype == torch.bool):
            return "a mask selection (bool or bitmap)"
        if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
            return f"q / cache dtype {q.dtype} / {kv_cache.dtype} (bf16 kernels)"
        if (kv_lora_rank, D - kv_lora_rank) != MLA_DIMS or q.shape[-1] != D:
            return f"latent width {kv_lora_rank} + {D - kv_lora_rank} (kernels for {MLA_DIMS[0]} + {MLA_DIMS[1]})"
        if q.shape[1] > MLA_HEADS[-1]:
            return f"{q.shape[1]} heads > {MLA_HEADS[-1]}"
        if kv_cache.dim() != 2 or kv_cache.stride() != (D, 1):
            return "cache rows not contiguous"
        return None

    def mla_decode(self, q, kv_cache, group, selection, *, kv_lora_rank: int, scale: float,
                   max_bytes: int = ref_attention.ATTN_BYTES):
        reason = self._mla_reason(q, kv_cache, group, selection, kv_lora_rank)
        if reason is not None:
            slow = self._slow("mla_decode", reason, ref_attention.mla_decode)
            return slow(q, kv_cache, group, selection, kv_lora_rank=kv_lora_rank, scale=scale, max_bytes=max_bytes)
        B, h, D = group.q_index.shape[0], q.shape[1], kv_cache.shape[-1]
        hp = next(n for n in MLA_HEADS if n >= h)                           # kernel head count
        qg = group.rows_of(q).contiguous()                                 # [B, h, D] (aiter: contiguous q)
        if hp != h:
            qk = qg.new_zeros(B, hp, D)                                     # [B, hp, D] zero pad heads
            qk[:, :h] = qg
        else:
            qk = qg
        kmax = group.kv_capacity or group.max_context_len                   # host int, static in a graph
        positions = None if selection is None else selection[:, 0]          # [B, k]
        kv_indptr, kv_indices = mla_page_table(group.block_table, group.context_lens, group.block_size, positions,
                                               kmax)
        dev = q.device
        qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)      # one query per sequence
        last_page_lens = torch.ones(B, dtype=torch.int32, device=dev)       # page size 1
        o = q.new_empty(B, hp, kv_lora_rank)                                # [B, hp, r] written by aiter
        self.mla_decode_fwd(qk, kv_cache.view(-1, 1, 1, D), o, qo_indptr, kv_indptr, kv_indices, last_page_lens, 1,
                            sm_scale=scale)
        return o if hp == h else o[:, :h]                                   # [Tg = B, h, r]

    # ---- MoE routing ------------------------------------------------------------------------------
    def moe_routing(self, logits, bias, *, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                    scale: float):
        T, E = logits.shape
        reason = ((f"n_group {n_group} (aiter: {ROUTING_GROUPS})" if n_group not in ROUTING_GROUPS else None)
                  or (f"{E} experts not divisible by n_group {n_group}" if E % n_group else None)
                  or (f"top_k {top_k} > {ROUTING_MAX_TOPK}" if top_k > ROUTING_MAX_TOPK else None)
                  or (f"topk_group {topk_group} not in [1, {n_group}]"
                      if n_group > 1 and not 1 <= topk_group <= n_group else None)
                  or ("renormalize=False (aiter's moe_fused_gate path requires it)"
                      if not renormalize and E // n_group <= FUSED_GATE_MAX_PER_GROUP else None))
        if reason is not None:
            slow = self._slow("moe_routing", reason, ref_moe_routing)
            return slow(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                        scale=scale)
        g = logits.float().contiguous()                                     # [T, E] fp32
        b = g.new_zeros(E) if bias is None else bias.to(torch.float32).contiguous()   # [E] the gating dtype
        weights = torch.empty(T, top_k, dtype=torch.float32, device=g.device)
        ids = torch.empty(T, top_k, dtype=torch.int32, device=g.device)
        self.aiter.biased_grouped_topk(g, b, weights, ids, n_group, topk_group if n_group > 1 else 1, renormalize,
                                       scale)
        # the contract's order: descending biased score
        idx = ids.long()                                                    # [T, K]
        choice = g.gather(1, idx).sigmoid() + b[idx]                        # [T, K]
        order = choice.argsort(dim=1, descending=True)
        return weights.gather(1, order), ids.gather(1, order)


def triton_fallback() -> CudaKernels | None:
    """The cuda backend's Triton kernels, for the ops aiter has none for (its ROCM_PORTABLE ones: plain
    Triton, which compiles for gfx950 too); None when triton cannot be imported."""
    t = CudaKernels(name="aiter")
    return t if t.tk is not None else None


def make_ops(aiter_module=None, triton: CudaKernels | None | str = "auto"):
    """KernelOps for the aiter backend: aiter's ops, then the portable Triton kernels for the rest
    (`triton`: "auto" = `triton_fallback()`, None = none), then (by `kernels.init_backend`) the torch reference."""
    t = triton_fallback() if triton == "auto" else triton
    k = AiterKernels(aiter_module, triton=t)
    portable = {op: getattr(t, op) for op in ROCM_PORTABLE} if t is not None else {}
    own = dict(block_fp8_linear=k.block_fp8_linear, block_fp8_linear_prepare=k.block_fp8_linear_prepare,
               moe_quant_layout=k.moe_quant_layout, moe_quant_prepare=k.moe_quant_prepare,
               fused_moe_block_fp8=k.fused_moe_block_fp8, fused_moe_mxfp4=k.fused_moe_mxfp4,
               mla_decode=k.mla_decode, moe_routing=k.moe_routing)
    return KernelOps(name="aiter", **{"fused_moe": None, **portable, **own})
