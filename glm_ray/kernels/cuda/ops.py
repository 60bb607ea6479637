"""The `cuda` (NVIDIA Hopper) KernelOps: what runs where, and when the torch reference is used instead
(logged once per reason and counted in `CudaKernels.fallbacks`).

* block_fp8_linear: dynamic 1x128 activation quant (Triton; torch ops without triton) +
  `torch._scaled_mm` blockwise on weights padded once to (Np % 128, Kp % 512) (layout.py), or the
  Triton block-FP8 GEMM (`GLM_RAY_CUDA_FP8_GEMM=triton`, or for a K at which `_scaled_mm` failed its
  load-time self-check). Reference when: not CUDA, sm < 90, block != 128x128, a pre-quantized
  (x_q, x_s) input, mode "w8a16", output dtype not bf16/fp16, non-e4m3fn weights.
* block_fp8_linear_prepare: zero-pads and keeps [N, K] corner views (meta {"n_pad", "k_pad"}) and
  self-checks `_scaled_mm` against the reference once per Kp; unchanged layout where the op falls back.
* fused_moe (bf16/fp16): Triton grouped kernels. Reference when: not CUDA, sm < 80, x not bf16/fp16
  (fp32 runs are test configurations and get the exact reference).
* fused_moe_block_fp8: Triton grouped kernels, W8A8 1x128 / 128x128. Reference when: not CUDA,
  sm < 90, block != 128x128. fused_moe / fused_moe_block_fp8 calls of at most GLM_RAY_CUDA_MOE_DECODE_PAIRS
  (token, expert) pairs take the sort-free two-launch decode kernels (moe_decode.py) instead; block-FP8
  calls of at least GLM_RAY_CUDA_MOE_PREFILL_ROWS pairs per expert the prefill kernels (moe_prefill.py:
  sorted pre-quantized activations, gate + up in one accumulator), whose failure falls back to the
  grouped kernels (op "fused_moe_block_fp8_prefill"), not to the reference.
* block_fp8_linear of at most GLM_RAY_CUDA_FP8_SMALL_M rows: one Triton launch with the activation quant
  fused (fp8_small_m.py).
* fused_moe_mxfp4: Triton grouped kernels, W4A16 (e2m1/e8m0 dequantized in registers) plus MXFP4 qdq
  of both stage inputs when `act_mode` is set (= the W4A4 numerics of the reference). Reference when:
  not CUDA, sm < 80, unknown act_mode, sizes not multiples of 32.
* mxfp4_linear: MXFP4 qdq (Triton) + the Triton W4A16 GEMM in identity dispatch. Reference when: not
  CUDA, sm < 80, K % 32.
* moe_quant_layout / moe_quant_prepare: inherited from torch (no padding, no re-layout needed).
* mhc_coefficients: one Triton launch. Reference when: not CUDA, sm < 70, hc_mult not a power of 2.
* kda_decode: Triton, state updated in place. Reference when: not CUDA, sm < 70, head dim not a power
  of 2, state not fp32.
* mla_decode: the Triton paged kernel (mla_decode.py: all heads of a token in one tile, split over keys,
  merged by log-sum-exp) over the block table (dense) or the DSA top-k positions (sparse). Reference
  when: not CUDA, sm < 80, not bf16/fp16, more than one query per sequence (a forced absorbed prefill),
  a bool-mask selection (the k-pool indexer).
* indexer_topk: the paged key cache scored in one Triton kernel (indexer.py) — a row per sequence in
  decode, a row per query token with its causal length in prefill — then the multi-program radix select
  of topk.py (GLM_RAY_CUDA_INDEXER_TOPK=torch: torch.topk). Reference when: not CUDA, sm < 80.
* moe_routing: one Triton kernel (routing.py). Reference when: not CUDA, sm < 70, E > 1024.
* fp32_linear (router logits, indexer head weights): at prefill sizes a tensor-core GEMM of the weight split into three
  bf16 parts (fp32_split.py, NVIDIA only, from layout.FP32_LINEAR_SPLIT_MIN_ROWS rows); one Triton launch at
  decode sizes (fp32_linear.py,
  T x N x D <= FP32_LINEAR_MAX_FMAS); cuBLAS's fp32 GEMM (the reference) above it and when: not CUDA, sm < 70.
* swiglu: one Triton launch (swiglu.py; torch runs silu and the product as two). Reference when: not
  CUDA, sm < 80, not bf16/fp16, gate / up not [T, I] with unit last strides.
* mla_kv_write / indexer_key_write: norm + rope + cast + scatter of a token's cache row in one Triton launch
  (cache_write.py). Reference when: not CUDA, sm < 80, an activation / weight / cache dtype other than
  bf16 / fp16 / fp32, a cache whose rows are not contiguous, an odd rope width.
* rope_inplace: one Triton launch (rope.py). Reference when: not CUDA, sm < 80, a dtype other than
  bf16 / fp16 / fp32, x not [T, H, D] with a unit last stride, an odd rope width.
* rms_norm (with the optional fused residual add): one Triton launch (norm.py). Reference when: not CUDA,
  sm < 80, x not bf16/fp16 (fp32 runs are test configurations and get the exact reference), weight or
  residual dtype != x's, D > 8192.
* mla_prefill: the Triton varlen flash-attention kernel (mla_prefill.py: context latents gathered through
  the block table and expanded once with kv_b, packed queries, causal with the prefix offset) dense or
  over the DSA top-k positions (a per-query bitmap). Reference when: not CUDA, sm < 80, not bf16/fp16,
  cache dtype != q's, a bool-mask selection (the k-pool indexer), qk_nope_head_dim < 16.
* kda_chunked: the reference's batched per-chunk terms, then (GLM_RAY_CUDA_KDA_SCAN=triton; default torch
  until it has run on a GPU) one Triton launch for the scan over the chunks (kda.py). Reference when: the
  env is torch, not CUDA, sm < 80, head dim not a power of 2 >= 16, state not fp32.
* indexer_kpool_topk, causal_conv1d: inherited from torch (tiled top-k).
* Any kernel exception (e.g. a Triton compile error on an untested GPU/Triton pair) marks that op
  broken for the process: logged with its traceback, reference from then on (`_guarded`).
* On ROCm (a HIP build of torch) only the `ROCM_PORTABLE` ops take their kernels, with no capability check;
  the aiter backend builds its Triton fallback from this class (`CudaKernels(name="aiter")`).
gate_mode must be "separated" everywhere (the torch contract check raises otherwise).

No host syncs on the hot paths: routing is aligned on the device (moe_align.py: one launch at decode sizes;
`layout.moe_align`'s device ops above), grids are sized
from shapes, unused blocks exit on a device-side count. The `_scaled_mm` self-check syncs once per
K at load time (never during CUDA-graph capture).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F

from glm_ray import envs
from glm_ray.kernels.cuda import layout as L
from glm_ray.kernels.cuda.compile_log import install_logging
from glm_ray.kernels.table import KernelOps
from glm_ray.kernels.torch_ref import attention as ref_attention
from glm_ray.kernels.torch_ref import cache_write as ref_cache_write
from glm_ray.kernels.torch_ref import fused_moe as ref_fused_moe
from glm_ray.kernels.torch_ref import indexer as ref_indexer
from glm_ray.kernels.torch_ref import quant_ops as ref
from glm_ray.kernels.torch_ref.fp8 import FP8_DTYPE, per_token_group_quant_fp8
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear
from glm_ray.kernels.torch_ref.kda import kda_chunked_cached as ref_kda_chunked
from glm_ray.kernels.torch_ref.kda import kda_decode as ref_kda_decode
from glm_ray.kernels.torch_ref.linear import fp32_linear as ref_fp32_linear
from glm_ray.kernels.torch_ref.mhc import mhc_coefficients as ref_mhc
from glm_ray.kernels.torch_ref.moe import swiglu as ref_swiglu
from glm_ray.kernels.torch_ref.mxfp4 import canonical_scale_mode
from glm_ray.kernels.torch_ref.norm import rms_norm as ref_rms_norm
from glm_ray.kernels.torch_ref.rope import rope_inplace as ref_rope_inplace
from glm_ray.kernels.torch_ref.routing import moe_routing as ref_moe_routing
from glm_ray.kernels.torch_ref.topk import SelectionBits

logger = logging.getLogger(__name__)
PREFILL_BITS = True      # `prefill_selection_bits`' switch (bench.prefill --prefill-selection's A/B)


def _mask_reason(selection, *, bitmap_ok: bool = False) -> str | None:
    """Why a selection keeps an attention op on its reference: a bool mask (the k-pool indexer's), or a
    bitmap where the kernel reads indices (`bitmap_ok`: the op's kernel reads the bitmap itself)."""
    if isinstance(selection, SelectionBits):
        return None if bitmap_ok else "a bitmap selection"
    return "a bool-mask selection" if selection is not None and selection.dtype == torch.bool else None


def prefill_selection_bits(group) -> bool:
    """Whether the indexer hands a prefill group its picks as `SelectionBits`: the group attends in the naive
    form (the sparse MLA prefill kernel reads a bitmap), the radix top-k is on and a row is at most
    BITS_MAX_KEYS scores (one `topk_bits` program walks a whole row). `PREFILL_BITS = False` turns it off."""
    from glm_ray.kernels.cuda import indexer as IK  # noqa: PLC0415 (imports triton)
    return (PREFILL_BITS and group.mla_mode == "naive" and IK.TOPK_IMPL == "triton"
            and group.max_context_len <= IK.radix_topk.BITS_MAX_KEYS)


BLOCK = (128, 128)
HALF_DTYPES = (torch.bfloat16, torch.float16)
SCALED_MM_SELFCHECK_RTOL = 3e-2     # garbage measured on the K trap was 1e3..2e5 relative; valid runs ~2e-3

# The ops whose kernels are plain Triton — no TMA descriptors, PDL (`tl.extra.cuda`), `.cg` loads or
# `torch._scaled_mm` — with the kernel modules (glm_ray/kernels/cuda/<name>.py) each launches. They also run on
# ROCm (tests/kernels/test_triton_on_rocm.py scans these modules for the NVIDIA-only constructs); the aiter
# backend takes them for what aiter has no op for. The rest — block_fp8_linear (`_scaled_mm`, fp8_small_m's PDL
# and `.cg` loads) and fused_moe_block_fp8 (moe_prefill's TMA descriptors) — are NVIDIA-only.
ROCM_PORTABLE: dict[str, tuple[str, ...]] = {
    "fused_moe": ("triton_kernels", "moe_align", "moe_decode"),
    "fused_moe_mxfp4": ("triton_kernels", "moe_align"),
    "mxfp4_linear": ("triton_kernels", "moe_align"),
    "mhc_coefficients": ("mhc",),
    "kda_decode": ("kda",),
    "mla_decode": ("mla_decode",),
    "mla_prefill": ("mla_prefill",),
    "indexer_topk": ("indexer", "topk"),
    "moe_routing": ("routing",),
    "fp32_linear": ("fp32_linear",),
    "swiglu": ("swiglu",),
    "mla_kv_write": ("cache_write",),
    "indexer_key_write": ("cache_write",),
    "rope_inplace": ("rope", "cache_write"),
    "rms_norm": ("norm",),
}


class CudaKernels:
    """Methods are the KernelOps fields. `fallbacks` counts reference fallbacks per (op, reason) — the GPU
    tests assert it stays empty for every supported shape, so a silent fallback cannot pass as a kernel."""

    def __init__(self, fp8_gemm: str | None = None, name: str = "cuda"):
        self.name = name                                             # the backend this table serves (logs)
        self._warned: set[str] = set()
        self.fallbacks: Counter = Counter()
        self.fp8_gemm = fp8_gemm or envs.CUDA_FP8_GEMM.get()
        if self.fp8_gemm not in ("scaled_mm", "triton"):
            raise ValueError(f"{envs.CUDA_FP8_GEMM.name}={self.fp8_gemm!r}: expected 'scaled_mm' or 'triton'")
        self._selfcheck: dict[tuple, bool] = {}
        self.broken: dict[str, str] = {}                             # op -> first kernel error
        self._sm: dict[int, tuple[int, int]] = {}
        try:
            from glm_ray.kernels.cuda import triton_kernels as tk  # noqa: PLC0415 (imports triton)
            self.tk, self.triton_error = tk, None
        except Exception as e:                                      # noqa: BLE001 — any import failure
            self.tk, self.triton_error = None, f"triton unavailable ({type(e).__name__}: {e})"
            logger.warning("cuda kernel backend: %s; MoE / MXFP4 ops use the torch reference", self.triton_error)
        # decode-size thresholds of the one-launch kernels (0 = off; envs.py says why)
        self.small_m = min(envs.CUDA_FP8_SMALL_M.get(), 64) if self.tk is not None else 0   # fp8_small_m.MAX_M
        self.moe_decode_pairs = envs.CUDA_MOE_DECODE_PAIRS.get() if self.tk is not None else 0
        self.moe_prefill_rows = envs.CUDA_MOE_PREFILL_ROWS.get() if self.tk is not None else 0
        self.kda_scan = envs.CUDA_KDA_SCAN.get()                     # "triton" | "torch" (kda_chunked)
        self.mla_key_tma = envs.CUDA_MLA_PREFILL_TMA.get()            # mla_prefill's key tiles as TMA boxes

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args, level=logging.WARNING) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, msg, *args)

    def _fallback(self, op: str, reason: str, slow_name: str = "the torch reference") -> None:
        self.fallbacks[(op, reason)] += 1
        self._warn_once(f"{op}:{reason}", "%s backend: %s uses %s: %s", self.name, op, slow_name, reason)

    def _guarded(self, op: str, fast, slow, slow_name: str = "the torch reference"):
        """Run `fast()`; if it raises (e.g. a Triton compile error on this GPU/Triton), log it, mark the op
        broken for the process and run `slow()` (the reference, or `slow_name`) — now and on every later call.
        Out-of-memory is re-raised (not a kernel defect)."""
        if op in self.broken:
            self._fallback(op, f"kernel failed earlier: {self.broken[op]}", slow_name)
            return slow()
        try:
            return fast()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:                                      # noqa: BLE001
            self.broken[op] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            logger.exception("%s backend: %s kernel failed; using %s from now on", self.name, op, slow_name)
            self._fallback(op, f"kernel failed: {self.broken[op]}", slow_name)
            return slow()

    def capability(self, device: torch.device) -> tuple[int, int]:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._sm:
            self._sm[idx] = torch.cuda.get_device_capability(idx)
        return self._sm[idx]

    def _gpu_reason(self, t: torch.Tensor, min_sm: int, need_triton: bool, op: str) -> str | None:
        """Why this tensor cannot take op's fast path (None = it can). On ROCm only the ROCM_PORTABLE ops run,
        with no capability check (torch reports the gfx version there, e.g. (9, 5) on gfx950, not an sm)."""
        if t.device.type != "cuda":
            return f"tensor on {t.device.type} (needs a GPU)"
        if getattr(torch.version, "hip", None):
            if op not in ROCM_PORTABLE:
                return f"ROCm: {op}'s kernels are NVIDIA-only (see ROCM_PORTABLE)"
        else:
            sm = self.capability(t.device)
            if sm[0] * 10 + sm[1] < min_sm:
                return f"sm_{sm[0]}{sm[1]} < sm_{min_sm}"
        if need_triton and self.tk is None:
            return self.triton_error
        return None

    # ---- dynamic 1x128 activation quant -----------------------------------------------------------
    def _act_quant(self, x2: torch.Tensor, m_out: int, k_out: int, ue8m0: bool, col_major: bool):
        if self.tk is not None:
            return self.tk.act_quant_fp8(x2, m_out=m_out, k_out=k_out, ue8m0=ue8m0, col_major_scale=col_major)
        m, k = x2.shape                                              # torch ops (no host sync either)
        xp = F.pad(x2, (0, k_out - k, 0, m_out - m)) if (m_out, k_out) != (m, k) else x2
        q, s = per_token_group_quant_fp8(xp, 128, ue8m0=ue8m0)
        return q, (s.t().contiguous().t() if col_major else s)

    # ---- dense block-FP8 --------------------------------------------------------------------------
    def _fp8_linear_reason(self, w: torch.Tensor, block) -> str | None:
        if tuple(block) != BLOCK:
            return f"block {tuple(block)} != (128, 128)"
        if w.dtype != FP8_DTYPE:
            return f"weight dtype {w.dtype} (needs float8_e4m3fn)"
        return self._gpu_reason(w, 90, need_triton=self.fp8_gemm == "triton", op="block_fp8_linear")

    def block_fp8_linear_prepare(self, w: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK):
        if self._fp8_linear_reason(w, block) is not None or self.fp8_gemm == "triton":
            return w, scale_inv, {}
        wv, sv, meta = L.prepare_scaled_mm_weight(w, scale_inv)
        wp, sp, _ = L.scaled_mm_operands(wv, sv, **meta)
        self._scaled_mm_ok(wp, sp)
        return wv, sv, meta

    def _scaled_mm(self, xq, xs, wp, sp, out=None):
        if out is not None:
            return torch._scaled_mm(xq, wp.t(), scale_a=xs, scale_b=sp.t(), out_dtype=torch.bfloat16, out=out)
        return torch._scaled_mm(xq, wp.t(), scale_a=xs, scale_b=sp.t(), out_dtype=torch.bfloat16)

    def _scaled_mm_ok(self, wp: torch.Tensor, sp: torch.Tensor) -> bool:
        """Self-check of `_scaled_mm` at this (Np, Kp) on 128 rows of the real weight vs the reference
        (once per shape; a host sync, so never while a CUDA graph is being captured)."""
        key = (wp.shape[1], wp.device.index)
        if key in self._selfcheck:
            return self._selfcheck[key]
        if torch.cuda.is_current_stream_capturing():
            return True
        g = torch.Generator(device=wp.device).manual_seed(1234)
        x = torch.randn(8, wp.shape[1], generator=g, device=wp.device, dtype=torch.bfloat16)
        w1, s1 = wp[:128], sp[:1]
        try:
            xq, xs = self._act_quant(x, 8, wp.shape[1], False, True)
            y = self._scaled_mm(xq, xs, w1, s1).float()
            err = None
        except RuntimeError as e:
            y, err = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if y is not None:
            r = ref_block_fp8_linear(x, w1, s1, BLOCK, torch.float32)
            rel = float((y - r).norm() / r.norm().clamp_min(1e-30))
            if not rel < SCALED_MM_SELFCHECK_RTOL:
                err = f"relative error {rel:.3g} vs the reference"
        ok = err is None
        self._selfcheck[key] = ok
        if not ok:
            logger.error("cuda backend: torch._scaled_mm blockwise failed its self-check at K=%d (%s); this shape "
                         "uses the %s", wp.shape[1], err, "Triton block-FP8 GEMM" if self.tk else "torch reference")
        return ok

    def block_fp8_linear(self, x, w, scale_inv, block=BLOCK, out_dtype=None, *, mode: str = "w8a8",
                         act_ue8m0: bool = False, bias=None, n_pad: int | None = None, k_pad: int | None = None,
                         fp8_dtype=FP8_DTYPE, fp8_max=None, out: torch.Tensor | None = None, **kw):
        reason = self._fp8_linear_reason(w, block)
        if reason is None:
            if isinstance(x, (tuple, list)):
                reason = "pre-quantized (x_q, x_s) input"
            elif mode != "w8a8":
                reason = f"mode {mode!r}"
            elif (out_dtype or x.dtype) not in HALF_DTYPES:
                reason = f"output dtype {out_dtype or x.dtype} (fp32 outputs use the exact reference)"
            elif fp8_dtype != FP8_DTYPE or fp8_max is not None:
                reason = "non-default activation fp8 format"
        if reason is not None:
            self._fallback("block_fp8_linear", reason)
            return ref_block_fp8_linear(x, w, scale_inv, block, out_dtype, mode=mode, act_ue8m0=act_ue8m0, bias=bias,
                                        fp8_dtype=fp8_dtype, fp8_max=fp8_max, out=out, **kw)
        return self._guarded(
            "block_fp8_linear",
            lambda: self._block_fp8_linear(x, w, scale_inv, out_dtype, act_ue8m0, bias, n_pad, k_pad, out),
            lambda: ref_block_fp8_linear(x, w, scale_inv, block, out_dtype, act_ue8m0=act_ue8m0, bias=bias, out=out))

    def _block_fp8_linear(self, x, w, scale_inv, out_dtype, act_ue8m0, bias, n_pad, k_pad, out=None):
        y = self._block_fp8_gemm(x, w, scale_inv, out_dtype, act_ue8m0, bias, n_pad, k_pad, out)
        if out is None:
            return y
        return out if y.data_ptr() == out.data_ptr() else out.copy_(y)

    def _block_fp8_gemm(self, x, w, scale_inv, out_dtype, act_ue8m0, bias, n_pad, k_pad, out):
        """The GEMM of `block_fp8_linear`; `_scaled_mm` writes `out` directly where its padded shape is out's."""
        odt = out_dtype or x.dtype
        n, k = w.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if m == 0:
            return x.new_empty(*lead, n, dtype=odt)
        if m <= self.small_m:                        # decode sizes: one launch, activation quant fused
            from glm_ray.kernels.cuda.fp8_small_m import block_fp8_linear_small_m  # noqa: PLC0415 (triton)
            y = block_fp8_linear_small_m(x2, w, scale_inv, out_dtype=odt, act_ue8m0=act_ue8m0)
            return (y if bias is None else y + bias.to(y.dtype)).to(odt).reshape(*lead, n)
        use_triton = self.fp8_gemm == "triton"
        if not use_triton:
            wp, sp, copied = L.scaled_mm_operands(w, scale_inv, n_pad, k_pad)
            if copied:
                self._warn_once(f"pad{n}x{k}", "cuda block_fp8_linear: weight [%d, %d] was not prepared by "
                                "block_fp8_linear_prepare; padding it on every call", n, k)
            if not self._scaled_mm_ok(wp, sp):
                if self.tk is None:
                    self._fallback("block_fp8_linear", f"_scaled_mm self-check failed at K={wp.shape[1]}")
                    return ref_block_fp8_linear(x, w, scale_inv, BLOCK, out_dtype, act_ue8m0=act_ue8m0, bias=bias)
                use_triton = True
        if use_triton:
            xq, xs = self._act_quant(x2, m, k, act_ue8m0, False)
            y = self.tk.dense_gemm_triton(xq, w, w_mode="fp8", a_scale=xs, w_scale=scale_inv,
                                          out_dtype=odt, n=n, k=k)
        else:
            mp = L.round_up(m, L.SCALED_MM_M_ALIGN)
            xq, xs = self._act_quant(x2, mp, wp.shape[1], act_ue8m0, True)   # [Mp, Kp], [Mp, Kp/128] col-major
            if out is not None and bias is None and odt == torch.bfloat16 and (mp, wp.shape[0]) == (m, n):
                return self._scaled_mm(xq, xs, wp, sp, out=out.view(m, n))   # no padding: straight into out
            y = self._scaled_mm(xq, xs, wp, sp)[:m, :n]
            if wp.shape[0] != n:
                y = y.contiguous()
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(odt).reshape(*lead, n)

    # ---- fused MoE --------------------------------------------------------------------------------
    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, *, swiglu_limit=None, intermediate_pad: int = 0):
        reason = self._gpu_reason(x, 80, need_triton=True, op="fused_moe")
        if reason is None and (x.dtype not in HALF_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype):
            reason = f"dtypes x {x.dtype} / w13 {w13.dtype} / w2 {w2.dtype} (bf16/fp16 kernel; fp32 is exact ref)"
        if reason is not None:
            self._fallback("fused_moe", reason)
            return ref_fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit=swiglu_limit,
                                 intermediate_pad=intermediate_pad)
        if topk_ids.numel() <= self.moe_decode_pairs:
            from glm_ray.kernels.cuda.moe_decode import fused_moe_decode  # noqa: PLC0415 (imports triton)
            return self._guarded("fused_moe", lambda: fused_moe_decode(
                x, w13, w2, topk_weights, topk_ids, w_mode="bf16", intermediate_pad=intermediate_pad,
                swiglu_limit=swiglu_limit), lambda: ref_fused_moe(x, w13, w2, topk_weights, topk_ids,
                                                                  swiglu_limit=swiglu_limit,
                                                                  intermediate_pad=intermediate_pad))
        return self._guarded(
            "fused_moe",
            lambda: self.tk.fused_moe_triton(x, w13.contiguous(), w2.contiguous(), topk_weights, topk_ids,
                                             w_mode="bf16", intermediate_pad=intermediate_pad,
                                             swiglu_limit=swiglu_limit),
            lambda: ref_fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit=swiglu_limit,
                                  intermediate_pad=intermediate_pad))

    def _moe_x(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dtype in HALF_DTYPES else x.to(torch.bfloat16)

    def fused_moe_block_fp8(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, *, block=BLOCK,
                            act_ue8m0: bool = False, swiglu_limit=None, gate_mode: str = "separated",
                            hidden_pad: int = 0, intermediate_pad: int = 0, **meta):
        ref._check_contract(gate_mode, x, w13, w2, hidden_pad)
        reason = self._gpu_reason(x, 90, need_triton=True, op="fused_moe_block_fp8")
        if reason is None and tuple(block) != BLOCK:
            reason = f"block {tuple(block)} != (128, 128)"
        if reason is None and w13.dtype != FP8_DTYPE:
            reason = f"weight dtype {w13.dtype}"
        def slow():
            return ref.fused_moe_block_fp8(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                                           block=block, act_ue8m0=act_ue8m0, swiglu_limit=swiglu_limit,
                                           gate_mode=gate_mode, hidden_pad=hidden_pad,
                                           intermediate_pad=intermediate_pad)
        if reason is not None:
            self._fallback("fused_moe_block_fp8", reason)
            return slow()
        if topk_ids.numel() <= self.moe_decode_pairs:
            from glm_ray.kernels.cuda.moe_decode import fused_moe_decode  # noqa: PLC0415 (imports triton)
            return self._guarded("fused_moe_block_fp8", lambda: fused_moe_decode(
                self._moe_x(x), w13, w2, topk_weights, topk_ids, w_mode="fp8",
                w13_scale=w13_scale_inv.float(), w2_scale=w2_scale_inv.float(), hidden_pad=hidden_pad,
                intermediate_pad=intermediate_pad, swiglu_limit=swiglu_limit, act_ue8m0=act_ue8m0).to(x.dtype), slow)
        kw = dict(w13_scale=w13_scale_inv.float().contiguous(), w2_scale=w2_scale_inv.float().contiguous(),
                  hidden_pad=hidden_pad, intermediate_pad=intermediate_pad, swiglu_limit=swiglu_limit,
                  act_ue8m0=act_ue8m0)
        def grouped():
            return self._guarded("fused_moe_block_fp8", lambda: self.tk.fused_moe_triton(
                self._moe_x(x), w13.contiguous(), w2.contiguous(), topk_weights, topk_ids, w_mode="fp8",
                **kw).to(x.dtype), slow)
        if self.moe_prefill_rows and topk_ids.numel() >= self.moe_prefill_rows * w13.shape[0]:
            from glm_ray.kernels.cuda.moe_prefill import fused_moe_prefill  # noqa: PLC0415 (imports triton)
            return self._guarded("fused_moe_block_fp8_prefill", lambda: fused_moe_prefill(
                self._moe_x(x), w13.contiguous(), w2.contiguous(), topk_weights, topk_ids, **kw).to(x.dtype),
                grouped, slow_name="the grouped kernels")
        return grouped()

    def fused_moe_mxfp4(self, x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *, act_mode="even",
                        swiglu_limit=None, gate_mode: str = "separated", hidden_pad: int = 0,
                        intermediate_pad: int = 0, **meta):
        ref._check_contract(gate_mode, x, w13, w2, hidden_pad, packed=2)
        reason = self._gpu_reason(x, 80, need_triton=True, op="fused_moe_mxfp4")
        mode = None
        if reason is None and act_mode is not None:
            try:
                mode = canonical_scale_mode(act_mode)
            except ValueError as e:
                reason = str(e)
        if reason is None and (x.shape[-1] % 32 or (w13.shape[1] // 2 - intermediate_pad) % 32):
            reason = "hidden / intermediate sizes not multiples of 32"
        def slow():
            return ref.fused_moe_mxfp4(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, act_mode=act_mode,
                                       swiglu_limit=swiglu_limit, gate_mode=gate_mode, hidden_pad=hidden_pad,
                                       intermediate_pad=intermediate_pad)
        if reason is not None:
            self._fallback("fused_moe_mxfp4", reason)
            return slow()
        return self._guarded("fused_moe_mxfp4", lambda: self.tk.fused_moe_triton(
            self._moe_x(x), w13.view(torch.uint8).contiguous(), w2.view(torch.uint8).contiguous(), topk_weights,
            topk_ids, w_mode="mxfp4", w13_scale=w13_scale.view(torch.uint8).contiguous(),
            w2_scale=w2_scale.view(torch.uint8).contiguous(), hidden_pad=hidden_pad, intermediate_pad=intermediate_pad,
            swiglu_limit=swiglu_limit, mx_act_mode=mode).to(x.dtype), slow)

    # ---- dense MXFP4 ------------------------------------------------------------------------------
    def mxfp4_linear(self, x, w, w_scale, *, act_mode="even", out_dtype=None):
        k = x.shape[-1]
        reason = self._gpu_reason(x, 80, need_triton=True, op="mxfp4_linear")
        mode = None
        if reason is None and k % 32:
            reason = f"K={k} not a multiple of 32"
        if reason is None and act_mode is not None:
            try:
                mode = canonical_scale_mode(act_mode)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            self._fallback("mxfp4_linear", reason)
            return ref.mxfp4_linear(x, w, w_scale, act_mode=act_mode, out_dtype=out_dtype)
        def fast():
            lead = x.shape[:-1]
            x2 = x.reshape(-1, k)
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            a = (self.tk.mx_qdq_rows(x2, mode, torch.bfloat16) if mode is not None
                 else x2.to(torch.bfloat16).contiguous())
            y = self.tk.dense_gemm_triton(a, w.view(torch.uint8), w_mode="mxfp4", w_scale=w_scale.view(torch.uint8),
                                          out_dtype=out_dtype or x.dtype, n=w.shape[0], k=k)
            return y.reshape(*lead, w.shape[0])
        return self._guarded("mxfp4_linear", fast,
                             lambda: ref.mxfp4_linear(x, w, w_scale, act_mode=act_mode, out_dtype=out_dtype))

    # ---- mHC mixing coefficients (GLM-5.3-Flash) ---------------------------------------------------
    def mhc_coefficients(self, m, base, scale, n: int, eps: float, iters: int):
        reason = self._gpu_reason(m, 70, need_triton=True, op="mhc_coefficients") or (
            f"hc_mult {n} is not a power of 2" if n & (n - 1) else None)
        if reason is not None:
            self._fallback("mhc_coefficients", reason)
            return ref_mhc(m, base, scale, n, eps, iters)
        from glm_ray.kernels.cuda.mhc import mhc_coefficients as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("mhc_coefficients", lambda: fast(m, base, scale, n, eps, iters),
                             lambda: ref_mhc(m, base, scale, n, eps, iters))

    # ---- KDA decode step (GLM-5.3-Flash) ----------------------------------------------------------
    def kda_decode(self, q, k, v, g, beta, state, slots, fresh):
        args = (q, k, v, g, beta, state, slots, fresh)
        dk = k.shape[-1]
        reason = (self._gpu_reason(q, 70, need_triton=True, op="kda_decode")
                  or (f"head dim {dk} is not a power of 2" if dk & (dk - 1) else None)
                  or (f"state dtype {state.dtype} (needs float32)" if state.dtype != torch.float32 else None))
        if reason is not None:
            self._fallback("kda_decode", reason)
            return ref_kda_decode(*args)
        from glm_ray.kernels.cuda.kda import kda_decode as fast  # noqa: PLC0415 (imports triton)
        # NOTE: the kernel writes the state in place; a failure before any store leaves it intact
        return self._guarded("kda_decode", lambda: fast(*args), lambda: ref_kda_decode(*args))

    # ---- KDA chunked prefill (GLM-5.3-Flash) --------------------------------------------------------
    def kda_chunked(self, q, k, v, g, beta, state, slots, fresh):
        """The chunks' state-free terms batched in torch, then (GLM_RAY_CUDA_KDA_SCAN=triton) one Triton launch
        for the sequential part instead of the reference's loop over chunks."""
        args = (q, k, v, g, beta, state, slots, fresh)
        if self.kda_scan != "triton":
            return ref_kda_chunked(*args)
        dk = k.shape[-1]
        reason = (self._gpu_reason(q, 80, need_triton=True, op="kda_chunked")
                  or (f"head dim {dk} is not a power of 2 >= 16" if dk & (dk - 1) or dk < 16 else None)
                  or (f"state dtype {state.dtype} (needs float32)" if state.dtype != torch.float32 else None))
        if reason is not None:
            self._fallback("kda_chunked", reason)
            return ref_kda_chunked(*args)
        from glm_ray.kernels.cuda.kda import kda_chunk_scan  # noqa: PLC0415 (imports triton)
        # NOTE: the cached state is written only after the whole scan (index_copy_ at the end), so a failure
        # inside it leaves the state for the reference to start from
        return self._guarded("kda_chunked", lambda: ref_kda_chunked(*args, scan=kda_chunk_scan),
                             lambda: ref_kda_chunked(*args))


    # ---- attention and the DSA indexer: decode groups -------------------------------------------
    def _decode_reason(self, x: torch.Tensor, group, op: str) -> str | None:
        return (self._gpu_reason(x, 80, need_triton=True, op=op)
                or (f"dtype {x.dtype} (bf16/fp16 kernel)" if x.dtype not in HALF_DTYPES else None)
                or ("more than one query per sequence" if group.q_index.shape[1] != 1 else None))

    def mla_decode(self, q, kv_cache, group, selection, *, kv_lora_rank: int, scale: float,
                   max_bytes: int = ref_attention.ATTN_BYTES):
        def slow():
            return ref_attention.mla_decode(q, kv_cache, group, selection, kv_lora_rank=kv_lora_rank, scale=scale,
                                            max_bytes=max_bytes)
        reason = self._decode_reason(q, group, "mla_decode") or (
            f"cache dtype {kv_cache.dtype} != {q.dtype}" if kv_cache.dtype != q.dtype else None) or (
            _mask_reason(selection))
        if reason is not None:
            self._fallback("mla_decode", reason)
            return slow()
        from glm_ray.kernels.cuda.mla_decode import mla_decode_paged  # noqa: PLC0415 (imports triton)
        def fast():
            idx = None if selection is None else selection[:, 0]            # [B, k] positions
            return mla_decode_paged(group.rows_of(q), kv_cache, group.block_table, group.context_lens, group.block_size,
                                    kv_lora_rank=kv_lora_rank, scale=scale, indices=idx)   # [B, h, r]
        return self._guarded("mla_decode", fast, slow)

    def mla_prefill(self, q, kv_cache, group, selection, kv_b, *, kv_lora_rank: int, v_head_dim: int, scale: float,
                    max_bytes: int = ref_attention.ATTN_BYTES, out: torch.Tensor | None = None):
        kw = dict(kv_lora_rank=kv_lora_rank, v_head_dim=v_head_dim, scale=scale, max_bytes=max_bytes, out=out)
        def slow():
            return ref_attention.mla_prefill(q, kv_cache, group, selection, kv_b, **kw)
        dn = q.shape[-1] - (kv_cache.shape[-1] - kv_lora_rank)
        reason = (self._gpu_reason(q, 80, need_triton=True, op="mla_prefill")
                  or (f"dtype {q.dtype} (bf16/fp16 kernel)" if q.dtype not in HALF_DTYPES else None)
                  or (f"cache dtype {kv_cache.dtype} != {q.dtype}" if kv_cache.dtype != q.dtype else None)
                  or _mask_reason(selection, bitmap_ok=True)
                  or (f"qk_nope_head_dim {dn} < 16" if dn < 16 else None))
        if reason is not None:
            self._fallback("mla_prefill", reason)
            return slow()
        from glm_ray.kernels.cuda.mla_prefill import mla_prefill_group  # noqa: PLC0415 (imports triton)
        descs = None
        if (self.mla_key_tma and q.is_cuda and not getattr(torch.version, "hip", None)
                and self.capability(q.device) >= (9, 0)):                  # TMA: NVIDIA Hopper and later
            from glm_ray.kernels.cuda.tma import mla_key_descriptors as descs  # noqa: PLC0415 (imports triton)
        return self._guarded("mla_prefill", lambda: mla_prefill_group(q, kv_cache, group, selection, kv_b,
                                                                      key_descriptors=descs, **kw), slow)

    def indexer_topk(self, qi, w, key_cache, group, topk: int, *, max_bytes: int = ref_indexer.SCORE_BYTES):
        def slow():
            return ref_indexer.indexer_topk(qi, w, key_cache, group, topk, max_bytes=max_bytes)
        reason = self._gpu_reason(qi, 80, need_triton=True, op="indexer_topk")
        if reason is not None:
            self._fallback("indexer_topk", reason)
            return slow()
        from glm_ray.kernels.cuda.indexer import indexer_decode_topk, indexer_prefill_topk  # noqa: PLC0415
        if group.q_index.shape[1] != 1:                                     # prefill: a row per query token
            # the sparse MLA prefill kernel (naive form) reads a bitmap: the top-k writes it directly
            bits = prefill_selection_bits(group)
            return self._guarded("indexer_topk", lambda: indexer_prefill_topk(qi, w, key_cache, group, topk,
                                                                              max_bytes=max_bytes, bits=bits), slow)
        def fast():
            kmax = group.kv_capacity or group.max_context_len
            idx = indexer_decode_topk(group.rows_of(qi), group.rows_of(w), key_cache, group.block_table, group.context_lens,
                                      group.block_size, topk, kmax)         # [B, k]
            return idx[:, None, :]                                          # [B, 1, k]
        return self._guarded("indexer_topk", fast, slow)

    # ---- MoE routing ------------------------------------------------------------------------------
    def moe_routing(self, logits, bias, *, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                    scale: float):
        kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scale=scale)
        reason = self._gpu_reason(logits, 70, need_triton=True, op="moe_routing") or (
            f"{logits.shape[-1]} experts > 1024" if logits.shape[-1] > 1024 else None)
        if reason is not None:
            self._fallback("moe_routing", reason)
            return ref_moe_routing(logits, bias, **kw)
        from glm_ray.kernels.cuda.routing import moe_routing as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("moe_routing", lambda: fast(logits, bias, **kw), lambda: ref_moe_routing(logits, bias, **kw))

    def fp32_linear(self, x, weight):
        reason = self._gpu_reason(x, 70, need_triton=True, op="fp32_linear")
        if (reason is None and x.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
                and x.shape[0] >= L.FP32_LINEAR_SPLIT_MIN_ROWS                # prefill sizes: the tensor cores
                and x.shape[1] % 8 == 0                                       # TMA rows: 16-byte multiples
                and not getattr(torch.version, "hip", None)                   # TMA: NVIDIA only
                and self._gpu_reason(x, 90, need_triton=True, op="fp32_linear") is None):
            from glm_ray.kernels.cuda.fp32_split import fp32_linear_split  # noqa: PLC0415 (imports triton)
            w3 = self._split3(weight)
            return self._guarded("fp32_linear", lambda: fp32_linear_split(x, w3), lambda: ref_fp32_linear(x, weight))
        if reason is not None or x.dim() != 2 or x.shape[0] * weight.shape[0] * weight.shape[1] > L.FP32_LINEAR_MAX_FMAS:
            if reason is not None:
                self._fallback("fp32_linear", reason)
            return ref_fp32_linear(x, weight)
        from glm_ray.kernels.cuda.fp32_linear import fp32_linear as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("fp32_linear", lambda: fast(x, weight), lambda: ref_fp32_linear(x, weight))

    @staticmethod
    def _split3(weight: torch.Tensor) -> torch.Tensor:
        """The weight's three bf16 parts (`fp32_split.split3`), made on first use and kept on the weight (a
        loaded parameter: the warm-up steps before graph capture make them outside any graph)."""
        w3 = getattr(weight, "_glm_ray_split3", None)
        if w3 is None or w3.shape[1:] != weight.shape or w3.device != weight.device:
            from glm_ray.kernels.cuda.fp32_split import split3  # noqa: PLC0415 (imports triton)
            w3 = split3(weight)
            weight._glm_ray_split3 = w3
        return w3

    def swiglu(self, gate, up, limit=None):
        reason = (self._gpu_reason(gate, 80, need_triton=True, op="swiglu")
                  or (f"dtype {gate.dtype}" if gate.dtype not in HALF_DTYPES or up.dtype != gate.dtype else None)
                  or ("not [T, I] rows with unit last strides" if gate.dim() != 2 or gate.shape != up.shape
                      or gate.stride(-1) != 1 or up.stride(-1) != 1 else None))
        if reason is not None:
            self._fallback("swiglu", reason)
            return ref_swiglu(gate, up, limit)
        from glm_ray.kernels.cuda.swiglu import swiglu as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("swiglu", lambda: fast(gate, up, limit), lambda: ref_swiglu(gate, up, limit))

    # ---- per-token KV-cache writes (norm + rope + cast + scatter) -----------------------------------
    def _cache_write_reason(self, x, tensors, cache, rope_dim: int, op: str) -> str | None:
        return (self._gpu_reason(x, 80, need_triton=True, op=op)
                or next((f"dtype {t.dtype} (bf16/fp16/fp32 kernel)" for t in (x, *tensors, cache)
                         if t.dtype not in (*HALF_DTYPES, torch.float32)), None)
                or ("cache rows not contiguous" if cache.stride(-1) != 1 else None)
                or (f"odd rope width {rope_dim}" if rope_dim % 2 else None))

    def mla_kv_write(self, ckv, norm_weight, eps, cos, sin, interleave, kv_cache, slot_mapping):
        args = (ckv, norm_weight, eps, cos, sin, interleave, kv_cache, slot_mapping)
        reason = self._cache_write_reason(ckv, (norm_weight,), kv_cache, ckv.shape[-1] - norm_weight.shape[0],
                                          "mla_kv_write")
        if reason is not None:
            self._fallback("mla_kv_write", reason)
            return ref_cache_write.mla_kv_write(*args)
        from glm_ray.kernels.cuda.cache_write import mla_kv_write as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("mla_kv_write", lambda: fast(*args), lambda: ref_cache_write.mla_kv_write(*args))

    def indexer_key_write(self, k, ln_weight, ln_bias, eps, cos, sin, rope_dim, interleave, key_cache, slot_mapping):
        args = (k, ln_weight, ln_bias, eps, cos, sin, rope_dim, interleave, key_cache, slot_mapping)
        reason = self._cache_write_reason(k, (ln_weight, ln_bias), key_cache, rope_dim, "indexer_key_write")
        if reason is not None:
            self._fallback("indexer_key_write", reason)
            return ref_cache_write.indexer_key_write(*args)
        from glm_ray.kernels.cuda.cache_write import indexer_key_write as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("indexer_key_write", lambda: fast(*args),
                             lambda: ref_cache_write.indexer_key_write(*args))

    # ---- rotary embedding of a query, in place ----------------------------------------------------
    def rope_inplace(self, x, cos, sin, interleave: bool, start: int):
        args = (x, cos, sin, interleave, start)
        reason = (self._gpu_reason(x, 80, need_triton=True, op="rope_inplace")
                  or (f"dtype {x.dtype}" if x.dtype not in (*HALF_DTYPES, torch.float32) else None)
                  or (f"cos/sin dtype {cos.dtype}/{sin.dtype}" if cos.dtype not in (*HALF_DTYPES, torch.float32)
                      or sin.dtype not in (*HALF_DTYPES, torch.float32) else None)
                  or ("x is not [T, H, D] with a unit last stride" if x.dim() != 3 or x.stride(-1) != 1 else None)
                  or (f"odd rope width {cos.shape[-1]}" if cos.shape[-1] % 2 else None))
        if reason is not None:
            self._fallback("rope_inplace", reason)
            return ref_rope_inplace(*args)
        from glm_ray.kernels.cuda.rope import rope_inplace as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("rope_inplace", lambda: fast(x, cos.contiguous(), sin.contiguous(), interleave, start),
                             lambda: ref_rope_inplace(*args))

    # ---- RMSNorm (+ fused residual add) ---------------------------------------------------------
    def rms_norm(self, x, weight, eps: float, residual=None, *, in_place: bool = False):
        reason = (self._gpu_reason(x, 80, need_triton=True, op="rms_norm")
                  or (f"dtype {x.dtype} (bf16/fp16 kernel)" if x.dtype not in HALF_DTYPES else None)
                  or (f"weight dtype {weight.dtype} != {x.dtype}" if weight.dtype != x.dtype else None)
                  or (f"residual {residual.dtype} {tuple(residual.shape)} != x {x.dtype} {tuple(x.shape)}"
                      if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape) else None)
                  or (f"D={x.shape[-1]} > 8192" if x.shape[-1] > 8192 else None))
        if reason is not None:
            self._fallback("rms_norm", reason)
            return ref_rms_norm(x, weight, eps, residual, in_place=in_place)
        from glm_ray.kernels.cuda.norm import rms_norm as fast  # noqa: PLC0415 (imports triton)
        return self._guarded("rms_norm", lambda: fast(x, weight, eps, residual, in_place=in_place),
                             lambda: ref_rms_norm(x, weight, eps, residual, in_place=in_place))


def make_ops(fp8_gemm: str | None = None):
    """KernelOps for the cuda backend (moe_quant_layout / moe_quant_prepare are inherited from torch)."""
    k = CudaKernels(fp8_gemm)
    if envs.LOG_TRITON_COMPILES.get():
        install_logging()
    return KernelOps(name="cuda", block_fp8_linear=k.block_fp8_linear, fused_moe=k.fused_moe,
                     block_fp8_linear_prepare=k.block_fp8_linear_prepare, fused_moe_block_fp8=k.fused_moe_block_fp8,
                     fused_moe_mxfp4=k.fused_moe_mxfp4, mxfp4_linear=k.mxfp4_linear,
                     mhc_coefficients=k.mhc_coefficients, kda_decode=k.kda_decode, kda_chunked=k.kda_chunked,
                     mla_decode=k.mla_decode,
                     mla_prefill=k.mla_prefill, indexer_topk=k.indexer_topk, moe_routing=k.moe_routing,
                     fp32_linear=k.fp32_linear, swiglu=k.swiglu,
                     rms_norm=k.rms_norm, rope_inplace=k.rope_inplace,
                     mla_kv_write=k.mla_kv_write, indexer_key_write=k.indexer_key_write, absorb_prefill_tokens=256)
