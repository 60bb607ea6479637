"""`KernelOps`: the table of kernel entry points a backend fills, each with its shape contract.

Its own module so the backends (kernels/cuda, kernels/aiter) can build a table without importing the
registry (kernels/__init__.py), which imports them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelOps:
    name: str
    # y[T, N] = dequant(x)[T, K] @ dequant(w)[N, K].T ; w e4m3 [N, K], w_scale_inv fp32 [ceil(N/bn), ceil(K/bk)];
    # `out=` a contiguous [T, N] destination of the output dtype, written and returned (directly where the GEMM
    # takes an output buffer, else copied)
    block_fp8_linear: Callable
    # routed experts; x [T, D], w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], topk_* [T, K] -> [T, D]
    fused_moe: Callable
    # --- quantized paths (torch references in kernels/torch_ref/quant_ops.py document the contracts) ---
    # (w, scale_inv, block) -> (w', scale_inv', meta): runtime layout of a block-FP8 linear; `meta` (e.g.
    # {"preshuffled": True}) is forwarded as kwargs to block_fp8_linear by the method that called it
    block_fp8_linear_prepare: Callable | None = None
    # (kind "fp8_block"|"mxfp4", num_experts, hidden, inter, block) -> MoEQuantLayout(hidden_pad, intermediate_pad,
    # unsupported reason): what this backend's quantized MoE runner needs, asked at model construction
    moe_quant_layout: Callable | None = None
    # (kind, w13, w13_scale, w2, w2_scale) -> (w13', w13_scale', w2', w2_scale', meta): preshuffle etc.
    moe_quant_prepare: Callable | None = None
    # block-FP8 W8A8 experts: x [T, D], w13 e4m3 [E, 2I', D'], w13_scale_inv [E, 2*ceil(I'/bn), ceil(D'/bk)],
    # w2 e4m3 [E, D', I'], w2_scale_inv [E, ceil(D'/bn), ceil(I'/bk)] (D' = D + hidden_pad, I' = I + intermediate_pad)
    fused_moe_block_fp8: Callable | None = None
    # MXFP4 W4A4 experts: packed uint8 w13 [E, 2I', D'/2] + e8m0 [E, 2I', D'/32], w2 [E, D', I'/2] + [E, D', I'/32]
    fused_moe_mxfp4: Callable | None = None
    # dense MXFP4 W4A4 linear: x [..., K], w uint8 [N, K/2], w_scale uint8 [N, K/32], act_mode -> [..., N]
    mxfp4_linear: Callable | None = None
    # mHC (GLM-5.3-Flash): (m [T, (2+n)n] fp32, base, scale [3], n, eps, iters) -> pre [T, n], post [T, n],
    # comb [T, n, n]: sigmoid weights and the softmax + Sinkhorn recombination (kernels/torch_ref/mhc.py)
    mhc_coefficients: Callable | None = None
    # KDA decode step against the state cache (GLM-5.3-Flash): (q, k, g [B, H, dk], v [B, H, dv], beta [B, H],
    # state [S, H, dk, dv] fp32 updated in place at slots [B], fresh [B] bool) -> o [B, H, dv]
    # (the recurrent form; there is no separate `kda_recurrent` op: decode is its only caller)
    kda_decode: Callable | None = None
    # --- attention, indexer, linear attention (references: kernels/torch_ref/{attention,indexer,kda}.py) ---
    # Common to the group ops: `group` is one `AttnGroup` of the step (forward_batch.py): q_index /
    # q_valid [B, Qmax] (queries gathered from the step's packed rows T), kv_slots [B, Kmax] (flat cache
    # slot of every context position; block = slot // block_size), causal [B, Qmax, Kmax]. Row inputs are
    # [T, ...] for the whole step (the op reads its group's rows); outputs are the group's rows [Tg, ...]
    # in q_valid order (= group.token_index). `selection`: None = dense causal; int32 [B, Qmax, k] = DSA
    # top-k key positions (-1 padded; a page table of page size 1 over group.block_table); bool
    # [B, Qmax, Kmax] = a mask (selection AND causal; the k-pool indexer); `SelectionBits` (kernels/torch_ref/topk.py)
    # = the top-k as a packed bitmap [Tg, ceil(Kmax/32)] int32 (a backend's indexer may return it for naive-form
    # groups; every mla_prefill accepts it, the references through `selection_mask`). `max_bytes` bounds the op's transient memory (the
    # reference walks key / query tiles above it; a kernel that needs no workspace ignores it).
    #
    # MLA naive (expanded) form, prefill groups: (q [T, h, dn+dr] nope|roped, kv_cache [S, r+dr] latent
    # rows [c | k_pe], group, selection, kv_b: latents [N, r] -> [N, h*(dn+dv)] (the layer's kv_b_proj,
    # any quant method), *, kv_lora_rank r, v_head_dim dv, scale, max_bytes, out=None) -> o [Tg, h, dv]; `out`: a
    # [Tg, h, dv] destination of q.dtype with unit last stride (the group's rows of the step's attention output)
    # that the op writes and returns (a kernel writes it directly: no copy after)
    mla_prefill: Callable | None = None
    # MLA absorbed form (latent MQA, one KV head = the cache row, value = its first r dims), decode
    # groups (any group when mla_mode forces it, so Qmax may exceed 1): (q [T, h, r+dr] W_UK-absorbed |
    # roped, kv_cache [S, r+dr], group, selection, *, kv_lora_rank r, scale, max_bytes) -> o_lat [Tg, h, r]
    # (the layer unfolds W_UV). A paged kernel reads the cache rows through group.block_table /
    # group.context_lens (dense) or the top-k positions (sparse); the references use the padded views.
    mla_decode: Callable | None = None
    # DSA lightning indexer scoring + top-k (GLM-5): (qi [T, Hi, di] fp32 or bf16 (wq_b's output dtype; scored
    # in fp32), w [T, Hi] fp32 head weights, key_cache [S, di], group, topk, *, max_bytes)
    # -> positions [B, Qmax, min(topk, Kmax)] int32 (-1 padded), or, for a naive-form (prefill) group, the same picks
    # as `SelectionBits` where the backend's prefill kernel reads a bitmap (cuda)
    indexer_topk: Callable | None = None
    # k-pool indexer (GLM-5.3-Flash): (qi [T, Hi, di] fp32 / bf16, w [T, Hi] fp32, key_cache [S, 2di] rows [ki | gi],
    # group, ape [kpool, di] fp32, *, kpool, pool_topk, tail, max_bytes) -> selection [B, Qmax, Kmax] bool
    indexer_kpool_topk: Callable | None = None
    # KDA short conv against the conv-state cache: (x [B, L, C] padded group view, weight [C, K] fp32,
    # lengths [B], conv_state [S, K-1, C] updated in place at slots [B], fresh [B] bool) -> y [B, L, C]
    # (depthwise causal conv + SiLU; rows past lengths are garbage)
    causal_conv1d: Callable | None = None
    # KDA chunked form against the state cache: (q, k, g [B, L, H, dk], v [B, L, H, dv], beta [B, L, H]
    # (padding rows k = v = g = beta = 0), state [S, H, dk, dv] fp32 updated in place at slots [B], fresh [B]
    # bool) -> o [B, L, H, dv]
    kda_chunked: Callable | None = None
    # an fp32 GEMM of (bf16) activations (the MoE router logits, the DSA indexer's head weights): (x [T, D],
    # weight [N, D] fp32) -> [T, N] fp32 = x.float() @ weight.T (fp32 products; a kernel may sum in another
    # order) — kernels/torch_ref/linear.py
    fp32_linear: Callable | None = None
    # MoE routing after the router GEMM: (logits [T, E] fp32, bias [E] fp32 | None (selection only), *, top_k,
    # n_group, topk_group, renormalize, scale) -> weights [T, K] fp32 (un-biased sigmoid, renormalized, scaled),
    # ids [T, K] int32 (descending biased score) — kernels/torch_ref/routing.py
    moe_routing: Callable | None = None
    # SwiGLU activation: (gate [..., I], up [..., I], limit float | None) -> silu(gate) * up, or the clamped
    # form silu(min(gate, L)) * clamp(up, -L, L) (dense MLP / shared experts; the MoE ops apply their own)
    swiglu: Callable | None = None
    # --- per-token KV-cache writes (reference: kernels/torch_ref/cache_write.py); in place, return None ---
    # MLA latent row: (ckv [T, r+dr] kv_a_proj output, norm_weight [r], eps, cos [T, dr], sin [T, dr] (RopeCache
    # layout: (c, c), (-s, s); None when dr = 0), interleave, kv_cache [S, r+dr], slot_mapping [T] int64):
    # kv_cache[slot] = [weight * rms_norm(c.float()).to(dtype) | apply_rope(k_pe) (its de-interleaved layout)]
    mla_kv_write: Callable | None = None
    # DSA indexer key: (k [T, di] wk output, ln_weight [di], ln_bias [di], eps, cos, sin [T, rope_dim] (None when
    # rope_dim = 0), rope_dim, interleave, key_cache [S, di], slot_mapping [T] int64):
    # key_cache[slot] = LayerNorm(k) (input dtype) with apply_rope on its FIRST rope_dim dims
    indexer_key_write: Callable | None = None
    # rotary embedding of a query's rope dims, in place: (x [T, H, D] unit last stride, cos [T, dr], sin [T, dr]
    # (RopeCache layout), interleave, start) -> None; x[..., start:start+dr] = apply_rope(x[..., start:start+dr])
    # (MLA's q: start = qk_nope_head_dim; the DSA indexer's q: start = 0) — kernels/torch_ref/rope.py
    rope_inplace: Callable | None = None
    # RMSNorm, fp32 statistics: (x [T, D], weight [D], eps, residual [T, D] | None) -> y [T, D] =
    # weight * rms_norm(x.float()).to(x.dtype); with a residual -> (y of s, s = x + residual in x's dtype, the
    # new residual stream) — kernels/torch_ref/norm.py. x / residual may be strided row views ([..., D] accepted);
    # `in_place=True`: s is stored into `residual` (returned as s)
    rms_norm: Callable | None = None
    # --- policy the backend owns (a judgement of its own kernels, not an op) ---
    # a prefill chunk of at most this many tokens over a cached context at least as long runs as one-query rows
    # of the step's decode group (forward_batch._attention_units) — worth it where the absorbed decode kernel
    # reads a shared context once per tile of rows (cuda: the H100's mixed step 51.8 -> 39.1 ms); the torch
    # reference gathers every row's whole context (CPU tiny model: 28 -> 38 ms), so 0 there.
    # GLM_RAY_ABSORB_PREFILL_TOKENS overrides it.
    absorb_prefill_tokens: int = 0
