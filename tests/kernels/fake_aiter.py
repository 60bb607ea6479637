"""A fake `aiter` package for CPU contract tests of the aiter backend (glm_ray/kernels/aiter).

It implements the signatures of aiter's real Python API (gemm_a8w8_blockscale_bpreshuffle, the e8m0
shuffle, fused_moe, aiter.mla.mla_decode_fwd, biased_grouped_topk — as at ROCm/aiter e4048607)
and, like a faithful kernel, *interprets* what it is handed: weights are un-shuffled with the
documented permutation (written here independently of glm_ray's own layout helpers), scales are
un-shuffled / read in the documented layout, the MoE contract fields (`gate_mode`, `swiglu_limit`,
`hidden_pad`, `intermediate_pad`, `quant_type`, `activation`) change the math exactly as aiter's do,
and then the torch references compute the result. A wrong argument order, layout or field therefore
gives a wrong answer or an assertion here, not a silent pass. Every call is appended to `CALLS`.

`mla_decode_fwd` walks the page table it is given (kv_indptr / kv_indices / kv_last_page_lens over the
4-D kv_buffer [num_pages, page_size, nhead_kv, D]), asserting the dtypes (every index tensor int32) and
shapes of the real binding, and writes `o` in place; `biased_grouped_topk` emits its picks in ascending
expert-id order (the real opt-sort / fused-gate kernels promise no score order).

Numerics follow aiter HEAD: per_1x128 activations with fp32 scales (amax/448), MXFP4 activations
with RoundUp E8M0 scales (aiter#3212), the stage-2 input re-quantized, routing weights in stage 2.

`install(monkeypatch)` puts the package (and its submodules) into `sys.modules`.
"""
from __future__ import annotations

import enum
import sys
import types

import torch

from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, per_token_group_quant_fp8, w8a8_block_fp8_matmul
from glm_ray.kernels.torch_ref.moe_quant import fused_moe_act_qdq, qdq_fp8_1x128
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4, qdq_mxfp4

CALLS: list[tuple[str, tuple, dict]] = []


class QuantType(enum.IntEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


class ActivationType(enum.IntEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2
    Situv2 = 3


dtypes = types.SimpleNamespace(fp8=torch.float8_e4m3fn, fp4x2=torch.float4_e2m1fn_x2,
                               fp8_e8m0=torch.float8_e8m0fnu, bf16=torch.bfloat16, fp16=torch.float16,
                               fp32=torch.float32, i32=torch.int32, u8=torch.uint8)


# ---- layouts (independent of glm_ray.kernels.torch_ref.aiter_layout) ----------------------------

def shuffle_weight(x: torch.Tensor, layout=(16, 16), use_int4=False) -> torch.Tensor:
    """aiter/ops/shuffle.py: [..., N, K] -> tiles of 16 rows x 32 bytes, two 16x16 sub-tiles each."""
    CALLS.append(("shuffle_weight", (tuple(x.shape), x.dtype), {"layout": layout}))
    assert tuple(layout) == (16, 16), layout
    dt = x.dtype
    b = x.view(torch.uint8) if dt == dtypes.fp4x2 else x
    IN, IK = layout
    BK = IK * 2
    K = 16 // b.element_size()
    n, k = b.shape[-2:]
    assert n % IN == 0 and k % BK == 0, (n, k)
    y = b.reshape(-1, n // IN, IN, k // BK, BK // K, K).permute(0, 1, 3, 4, 2, 5).contiguous().view(b.shape)
    y = y.view(dt) if dt == dtypes.fp4x2 else y
    y.is_shuffled = True
    return y


def _unshuffle(w: torch.Tensor) -> torch.Tensor:
    """Closed form of §2.5 for 1-byte elements: (n, k) sits at ((n0*(K/32)+k0)*2+k1)*256 + n1*16 + k2."""
    b = w.view(torch.uint8) if w.dtype == dtypes.fp4x2 else w.view(torch.uint8)
    *lead, n, k = b.shape
    flat = b.reshape(-1, n * k)
    nn_ = torch.arange(n)[:, None]
    kk = torch.arange(k)[None, :]
    off = ((nn_ // 16 * (k // 32) + kk // 32) * 2 + (kk % 32) // 16) * 256 + (nn_ % 16) * 16 + kk % 16
    out = flat[:, off.reshape(-1)].reshape(*lead, n, k)
    return out.view(w.dtype) if w.dtype != dtypes.fp4x2 else out          # fp4x2 -> plain uint8 codes


def e8m0_shuffle(scale: torch.Tensor) -> torch.Tensor:
    """aiter/utility/fp4_utils.py: 2-D only; pads to [ceil(m/256)*256, ceil(n/8)*8]."""
    CALLS.append(("e8m0_shuffle", (tuple(scale.shape), scale.dtype), {}))
    assert scale.ndim == 2, "scale must be a 2D tensor"
    m, n = scale.shape
    sm, sn = -(-m // 256) * 256, -(-n // 8) * 8
    p = torch.zeros(sm, sn, dtype=scale.dtype)
    p[:m, :n] = scale
    return p.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def _e8m0_unshuffle(p: torch.Tensor) -> torch.Tensor:
    """Closed form of §3.5: (r, c), r = 32a+16b+cc, c = 8d+4e+f -> a*32*sn + d*256 + f*64 + cc*4 + e*2 + b."""
    sm, sn = p.shape
    r = torch.arange(sm)[:, None]
    c = torch.arange(sn)[None, :]
    a, b_, cc = r // 32, (r % 32) // 16, r % 16
    d, e, f = c // 8, (c % 8) // 4, c % 4
    off = a * 32 * sn + d * 256 + f * 64 + cc * 4 + e * 2 + b_
    return p.reshape(-1)[off.reshape(-1)].reshape(sm, sn)


# ---- dense ----------------------------------------------------------------------------------------

def get_hip_quant(qt):
    assert qt == QuantType.per_1x128, qt

    def quant(x, scale=None, quant_dtype=dtypes.fp8, transpose_scale=False, num_rows=None):
        CALLS.append(("hip_quant", (tuple(x.shape), x.dtype), {"quant_dtype": quant_dtype,
                                                                "transpose_scale": transpose_scale}))
        assert scale is None and x.dtype in (torch.bfloat16, torch.float16), x.dtype
        q, s = per_token_group_quant_fp8(x, 128, fp8_dtype=quant_dtype)
        if transpose_scale:
            s = s.t().contiguous().t()
        return q, s
    return quant


def _check_gemm_operands(XQ, WQ, x_scale, w_scale, dtype):
    m, k = XQ.shape
    n = WQ.shape[0]
    assert XQ.dtype == dtypes.fp8 and WQ.dtype == dtypes.fp8, (XQ.dtype, WQ.dtype)
    assert WQ.shape[1] == k and k % 128 == 0, (XQ.shape, WQ.shape)
    assert x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (m, k // 128), x_scale.shape
    assert w_scale.dtype == torch.float32 and tuple(w_scale.shape) == (-(-n // 128), k // 128), w_scale.shape
    assert dtype in (torch.bfloat16, torch.float16), dtype


def gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, isBpreshuffled=False):
    CALLS.append(("gemm_a8w8_blockscale", (XQ, WQ, x_scale, w_scale), {"dtype": dtype}))
    _check_gemm_operands(XQ, WQ, x_scale, w_scale, dtype)
    assert not isBpreshuffled
    assert x_scale.stride() == (x_scale.shape[1], 1), "row-major x_scale expected"
    return w8a8_block_fp8_matmul(XQ, x_scale, WQ, w_scale, out_dtype=dtype)


def gemm_a8w8_blockscale_bpreshuffle(XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, out=None):
    CALLS.append(("gemm_a8w8_blockscale_bpreshuffle", (XQ, WQ, x_scale, w_scale), {"dtype": dtype}))
    _check_gemm_operands(XQ, WQ, x_scale, w_scale, dtype)
    m = XQ.shape[0]
    assert m == 1 or x_scale.stride() == (1, m), f"column-major x_scale expected, strides {x_scale.stride()}"
    return w8a8_block_fp8_matmul(XQ, x_scale, _unshuffle(WQ), w_scale, out_dtype=dtype)


# ---- fused MoE --------------------------------------------------------------------------------------

def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu,
              quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None,
              a2_scale=None, block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None,
              hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None,
              linear_beta=None, gate_mode="separated", shared_w1=None, shared_w2=None, shared_w1_scale=None,
              shared_w2_scale=None, shared_expert_id=-1, stage2_scatter=None):
    kw = dict(activation=activation, quant_type=quant_type, doweight_stage1=doweight_stage1, dtype=dtype,
              hidden_pad=hidden_pad, intermediate_pad=intermediate_pad, swiglu_limit=swiglu_limit,
              gate_mode=gate_mode, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale,
              expert_mask=expert_mask)
    CALLS.append(("fused_moe", (hidden_states, w1, w2, topk_weight, topk_ids), kw))
    fp4 = w1.dtype == dtypes.fp4x2
    E, model_dim, inter = w2.shape[0], w2.shape[1], w2.shape[2] * (2 if fp4 else 1)
    T = hidden_states.shape[0]
    assert hidden_states.shape[1] == model_dim and w1.shape[2] * (2 if fp4 else 1) == model_dim, \
        (hidden_states.shape, w1.shape, w2.shape)
    assert w1.shape[1] == 2 * inter, "g1u1 expected"
    assert getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False), "weights must be preshuffled"
    assert topk_weight.dtype == torch.float32 and topk_ids.dtype == torch.int32
    assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == T
    assert activation == ActivationType.Silu, activation
    assert not doweight_stage1 and a1_scale is None and a2_scale is None and expert_mask is None
    assert gate_mode in ("separated", "interleave"), gate_mode
    out_dtype = hidden_states.dtype if dtype is None else dtype
    assert out_dtype in (torch.bfloat16, torch.float16)
    assert hidden_states.dtype in (torch.bfloat16, torch.float16)

    if quant_type in (QuantType.per_128x128, QuantType.per_1x128):
        assert w1.dtype == dtypes.fp8 and w2.dtype == dtypes.fp8
        assert w1_scale.dtype == torch.float32 and tuple(w1_scale.shape) == (E, 2 * inter // 128, model_dim // 128)
        assert w2_scale.dtype == torch.float32 and tuple(w2_scale.shape) == (E, model_dim // 128, inter // 128)
        w13 = dequant_block_fp8(_unshuffle(w1), w1_scale)
        w2f = dequant_block_fp8(_unshuffle(w2), w2_scale)
        qdq = qdq_fp8_1x128
    elif quant_type == QuantType.per_1x32:
        assert fp4 and w2.dtype == dtypes.fp4x2
        assert w1_scale.dtype == dtypes.fp8_e8m0 and w2_scale.dtype == dtypes.fp8_e8m0
        s1 = _e8m0_unshuffle(w1_scale.view(torch.uint8).reshape(E * 2 * inter, model_dim // 32))
        s2 = _e8m0_unshuffle(w2_scale.view(torch.uint8).reshape(E * model_dim, inter // 32))
        w13 = dequant_mxfp4(_unshuffle(w1), s1.view(E, 2 * inter, model_dim // 32))
        w2f = dequant_mxfp4(_unshuffle(w2), s2.view(E, model_dim, inter // 32))
        qdq = lambda a: qdq_mxfp4(a, "round_up")              # noqa: E731  (aiter HIP RoundUp)
    else:
        raise AssertionError(f"unexpected quant_type {quant_type}")

    # padding really is zero padding where the caller says it is
    if hidden_pad:
        assert hidden_states[:, model_dim - hidden_pad:].abs().max() == 0
        assert w13[:, :, model_dim - hidden_pad:].abs().max() == 0 and w2f[:, model_dim - hidden_pad:].abs().max() == 0
    if intermediate_pad:
        real = inter - intermediate_pad
        if gate_mode == "separated":
            assert w13[:, real:inter].abs().max() == 0 and w13[:, inter + real:].abs().max() == 0
        assert w2f[:, :, real:].abs().max() == 0
    if gate_mode == "interleave":                              # rows g0, u0, g1, u1, ...
        w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], 1)
    limit = swiglu_limit if swiglu_limit else None            # aiter: None / 0 = no clamp
    out = fused_moe_act_qdq(hidden_states.float(), w13, w2f, topk_weight, topk_ids.long(), act_qdq=qdq,
                            swiglu_limit=limit)
    return out.to(out_dtype)


# ---- MLA decode (aiter/mla.py) --------------------------------------------------------------------------

MLA_BF16_HEADS = {8, 16, 32, 64, 128}       # hsa/gfx950/mla/mla_asm.csv: bf16/bf16 non-persistent, qSeqLen 1


def _check_index(name, t, n=None):
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert t.dim() == 1 and t.is_contiguous(), f"{name} must be 1-D contiguous, got {tuple(t.shape)}"
    assert n is None or t.numel() == n, f"{name} has {t.numel()} entries, expected {n}"


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1,
                   nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                   work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False, g_kv_indptr=None, cp_world_size=1,
                   cp_rank=0, causal=True):
    CALLS.append(("mla_decode_fwd", (q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens),
                  {"max_seqlen_q": max_seqlen_q, "page_size": page_size, "nhead_kv": nhead_kv, "sm_scale": sm_scale,
                   "work_meta_data": work_meta_data, "q_scale": q_scale, "kv_scale": kv_scale}))
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    assert work_meta_data is None and num_kv_splits is None, "non-persistent path only"
    assert isinstance(max_seqlen_q, int) and max_seqlen_q >= 1, max_seqlen_q
    # Q [total_s, H, D] contiguous; KV [num_page, page_size, nhead_kv, D]; o [total_s, H, Lv]
    assert q.dim() == 3 and q.is_contiguous(), "only support Q.is_contiguous()"
    assert kv_buffer.dim() == 4, f"kv_buffer must be [num_page, page_size, nhead_kv, D], got {tuple(kv_buffer.shape)}"
    num_page, ps, nkv, D = kv_buffer.shape
    assert ps == page_size and page_size & (page_size - 1) == 0, (ps, page_size)
    assert nkv == nhead_kv == 1, "only support num_kv_heads==1"
    total_s, H, qd = q.shape
    assert qd == D, "only support head_size == KV.size(3)"
    assert q.dtype == torch.bfloat16 and kv_buffer.dtype == torch.bfloat16, (q.dtype, kv_buffer.dtype)
    assert H in MLA_BF16_HEADS, f"no bf16 decode kernel for {H} heads"
    assert o.dim() == 3 and o.shape[:2] == (total_s, H) and o.shape[2] < D and o.dtype == torch.bfloat16, \
        (tuple(o.shape), o.dtype)
    bs = qo_indptr.numel() - 1
    _check_index("qo_indptr", qo_indptr)
    _check_index("kv_indptr", kv_indptr, bs + 1)
    _check_index("kv_indices", kv_indices)
    _check_index("kv_last_page_lens", kv_last_page_lens, bs)
    qo, kvp, pages, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(), kv_last_page_lens.tolist()
    assert qo[0] == 0 and qo[-1] == total_s and kvp[0] == 0 and kvp[-1] <= len(pages), (qo, kvp, len(pages))
    scale = sm_scale if sm_scale is not None else D ** -0.5
    Lv = o.shape[2]
    tokens = kv_buffer.reshape(num_page * page_size, D).float()             # [num_page*page_size, D]
    for b in range(bs):                                                     # per sequence (a test double)
        nq = qo[b + 1] - qo[b]
        assert 1 <= nq <= max_seqlen_q and kvp[b + 1] > kvp[b], (b, nq, kvp)
        pg = torch.tensor(pages[kvp[b]:kvp[b + 1]], dtype=torch.long)
        assert int(pg.min()) >= 0 and int(pg.max()) < num_page, "page index out of range"
        n = len(pg) if page_size == 1 else (len(pg) - 1) * page_size + last[b]
        rows = (pg[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        k = tokens[rows]                                                    # [n, D]
        s = torch.einsum("qhd,kd->qhk", q[qo[b]:qo[b + 1]].float(), k) * scale
        if causal and nq > 1:
            qpos = n - nq + torch.arange(nq)
            s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[:, None, None], float("-inf"))
        o[qo[b]:qo[b + 1]] = torch.einsum("qhk,kd->qhd", s.softmax(-1), k[:, :Lv]).to(o.dtype)
    return o.view(total_s, 1, H, Lv), None


# ---- MoE routing (aiter/ops/topk.py) --------------------------------------------------------------------

def biased_grouped_topk(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
                        need_renorm, routed_scaling_factor=1.0):
    CALLS.append(("biased_grouped_topk", (gating_output, correction_bias, topk_weights, topk_ids),
                  {"num_expert_group": num_expert_group, "topk_group": topk_group, "need_renorm": need_renorm,
                   "routed_scaling_factor": routed_scaling_factor}))
    T, E = gating_output.shape
    K = topk_ids.shape[1]
    assert gating_output.stride(1) == 1, "gating_output last dimension must be contiguous"
    assert gating_output.dtype in (torch.float32, torch.bfloat16, torch.float16), gating_output.dtype
    # the HIP kernel reads correction_bias through a pointer of the gating dtype
    assert correction_bias.dtype == gating_output.dtype and tuple(correction_bias.shape) == (E,), \
        (correction_bias.dtype, tuple(correction_bias.shape))
    assert correction_bias.is_contiguous()
    assert topk_weights.dtype == torch.float32 and topk_ids.dtype == torch.int32, (topk_weights.dtype, topk_ids.dtype)
    assert tuple(topk_weights.shape) == (T, K) and tuple(topk_ids.shape) == (T, K)
    assert num_expert_group in (1, 2, 4, 8), f"Unsupported num_expert_group: {num_expert_group}"
    assert 1 <= topk_group <= num_expert_group, "topk_grp must be in [1, num_expert_group]"
    assert E % num_expert_group == 0 and K <= 64, (E, num_expert_group, K)
    if E // num_expert_group <= 32 and T > 256 * 212:
        assert need_renorm, "Renormalization is required for moe_fused_gate."
    sig = gating_output.float().sigmoid()                                    # [T, E]
    biased = sig + correction_bias.float()
    if num_expert_group > 1:
        per = biased.view(T, num_expert_group, -1)
        top2 = per.sort(dim=-1, descending=True).values[..., :2].sum(-1)   # [T, G]
        best = top2.argsort(dim=-1, descending=True)[:, :topk_group]
        keep = torch.zeros(T, num_expert_group, dtype=torch.bool).scatter(1, best, True)
        biased = per.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    picked = biased.argsort(dim=-1, descending=True)[:, :K].sort(dim=-1).values   # ascending expert id
    w = sig.gather(1, picked)
    w = w * (routed_scaling_factor / w.sum(-1, keepdim=True)) if need_renorm else w * routed_scaling_factor
    topk_weights.copy_(w)
    topk_ids.copy_(picked.to(torch.int32))


# ---- install ------------------------------------------------------------------------------------------

def build_modules() -> dict[str, types.ModuleType]:
    root = types.ModuleType("aiter")
    root.__path__ = []                                         # a package
    root.dtypes = dtypes
    root.QuantType = QuantType
    root.ActivationType = ActivationType
    root.get_hip_quant = get_hip_quant
    root.gemm_a8w8_blockscale = gemm_a8w8_blockscale
    root.gemm_a8w8_blockscale_bpreshuffle = gemm_a8w8_blockscale_bpreshuffle
    root.biased_grouped_topk = biased_grouped_topk
    mla = types.ModuleType("aiter.mla")
    mla.mla_decode_fwd = mla_decode_fwd
    root.mla = mla
    fm = types.ModuleType("aiter.fused_moe")
    fm.fused_moe = fused_moe
    ops = types.ModuleType("aiter.ops")
    ops.__path__ = []
    shuffle = types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight = shuffle_weight
    util = types.ModuleType("aiter.utility")
    util.__path__ = []
    fp4u = types.ModuleType("aiter.utility.fp4_utils")
    fp4u.e8m0_shuffle = e8m0_shuffle
    root.fused_moe = fm
    root.ops, ops.shuffle = ops, shuffle
    root.utility, util.fp4_utils = util, fp4u
    return {"aiter": root, "aiter.mla": mla, "aiter.fused_moe": fm, "aiter.ops": ops, "aiter.ops.shuffle": shuffle,
            "aiter.utility": util, "aiter.utility.fp4_utils": fp4u}


def install(monkeypatch) -> None:
    CALLS.clear()
    for name, mod in build_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
