"""MoE routing after the router GEMM: the torch reference (kernels/torch_ref/routing.py) against
`TopKRouter.forward`, and the Triton kernel (kernels/cuda/routing.py) under TRITON_INTERPRET=1 against
the reference.

Inputs are tie-free by construction (`separated_logits`): every row's choice values, and its group
scores, are at least 2e-6 apart in exact arithmetic, ten times the worst disagreement of two fp32
sigmoid implementations (a few ulp of values <= 2, ~2e-7), so the kernel and torch.topk must pick the
same ids in the same order. Weights tolerance rel err <= 1e-6: the kernel and torch differ only by the
sigmoid's last ulp and the order of the K-term renormalization sum (fp32 round-off, ~1e-7).
"""
from __future__ import annotations

import json
import os
import sys
from importlib import resources

import pytest
import torch
import torch.nn.functional as F

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray.config import ModelConfig  # noqa: E402
from glm_ray.kernels.torch_ref.routing import moe_routing as ref_routing  # noqa: E402
from tests.kernels.cases import rel_err  # noqa: E402

# (E, top_k, n_group, topk_group): glm5-flash-31b, GLM-5, DeepSeek-style grouped, a tiny grouped one
CASES = [(64, 4, 1, 1), (256, 8, 1, 1), (256, 8, 8, 4), (16, 2, 4, 2)]
PADDED = [(160, 6, 8, 3)]   # DeepSeek-V2 shape: E not a power of two (pad columns), groups of 20
SCALE = 2.5


def separated_logits(t: int, e: int, n_group: int, bias: torch.Tensor | None, *, seed: int = 0,
                     gap: float = 2e-6) -> torch.Tensor:
    """Random logits [T, E] fp32 (CPU) whose rows have all choices sigmoid(l) + bias, and all group
    top-2 sums, pairwise >= `gap` apart (checked in float64; offending rows are redrawn)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    b = torch.zeros(e, dtype=torch.float64) if bias is None else bias.detach().double().cpu()
    while True:
        choice = logits.double().sigmoid() + b                                # [T, E]
        bad = (choice.sort(-1).values.diff(dim=-1) < gap).any(-1)              # [T]
        if n_group > 1:
            gs = choice.view(t, n_group, -1).topk(2, dim=-1).values.sum(-1)    # [T, G]
            bad |= (gs.sort(-1).values.diff(dim=-1) < gap).any(-1)
        n_bad = int(bad.sum())
        if n_bad == 0:
            return logits
        logits[bad] = torch.randn(n_bad, e, generator=g) * 2


def make_bias(e: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(e, generator=torch.Generator().manual_seed(seed)) * 0.1


# ------------------------------------------------------------------------ reference == TopKRouter

def _original_router_math(logits, bias, top_k, n_group, topk_group, norm, scale):
    """`TopKRouter.forward` after its GEMM as it was before the layer moved to the `moe_routing` op
    (frozen here, so the reference stays pinned to the original results)."""
    T, E = logits.shape
    scores = logits.sigmoid()                                                 # [T, E] fp32
    choice = scores + bias                                                    # [T, E]
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group)                             # [T, G, E/G]
        group_scores = g.topk(2, dim=-1).values.sum(-1)                       # [T, G]
        keep = group_scores.topk(topk_group, dim=-1).indices                  # [T, topk_group]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = g.masked_fill(~mask[..., None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices                                  # [T, K]
    w = scores.gather(1, ids)                                                 # [T, K] un-biased
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def _router(e: int, k: int, n_group: int, topk_group: int, norm: bool):
    from glm_ray.layers.moe import TopKRouter
    hf = json.loads(resources.files("glm_ray").joinpath("configs/glm5-tiny.json").read_text())
    hf.update(n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
              norm_topk_prob=norm, routed_scaling_factor=SCALE)
    router = TopKRouter(ModelConfig.from_hf(hf, dtype="float32"))
    g = torch.Generator().manual_seed(e + k)
    router.weight.data.copy_(torch.randn(router.weight.shape, generator=g) * 0.1)
    router.e_score_correction_bias.data.copy_(make_bias(e))
    return router


@pytest.mark.parametrize("e,k,n_group,topk_group,norm",
                         [(8, 2, 2, 1, True), (64, 4, 1, 1, True), (256, 8, 8, 4, True), (256, 8, 1, 1, False)])
def test_reference_matches_router(e, k, n_group, topk_group, norm):
    """Bit-exact: the reference == the original router math == `TopKRouter.forward` (torch backend)."""
    router = _router(e, k, n_group, topk_group, norm)
    x = torch.randn(37, router.weight.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    logits = F.linear(x.float(), router.weight)                               # [T, E] fp32
    bias = router.e_score_correction_bias
    w_orig, ids_orig = _original_router_math(logits, bias, k, n_group, topk_group, norm, SCALE)
    w, ids = ref_routing(logits, bias, top_k=k, n_group=n_group, topk_group=topk_group, renormalize=norm,
                         scale=SCALE)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_orig.to(torch.int32))
    assert torch.equal(w, w_orig)
    w_layer, ids_layer = router(x)
    assert torch.equal(ids_layer.to(torch.int32), ids) and torch.equal(w_layer, w)


def test_reference_bias_none_is_zeros():
    logits = separated_logits(9, 64, 1, None)
    a = ref_routing(logits, None, top_k=4, n_group=1, topk_group=1, renormalize=True, scale=SCALE)
    b = ref_routing(logits, torch.zeros(64), top_k=4, n_group=1, topk_group=1, renormalize=True, scale=SCALE)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------ Triton kernel (interpreter)

triton_routing = pytest.importorskip("glm_ray.kernels.cuda.routing", reason="triton not importable")


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("e,k,n_group,topk_group", CASES + PADDED)
def test_kernel_matches_reference(e, k, n_group, topk_group, t, renorm):
    bias = make_bias(e)
    logits = separated_logits(t, e, n_group, bias, seed=t)
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, renormalize=renorm, scale=SCALE)
    w_ref, ids_ref = ref_routing(logits, bias, **kw)
    w, ids = triton_routing.moe_routing(logits, bias, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == (t, k)
    assert torch.equal(ids, ids_ref)
    assert rel_err(w, w_ref) <= 1e-6


def test_kernel_no_bias_and_strided_rows():
    logits_full = separated_logits(7, 96, 1, None, seed=5)                    # [T, 96]; use the first 64
    logits = logits_full[:, :64]
    kw = dict(top_k=4, n_group=1, topk_group=1, renormalize=True, scale=1.0)
    w_ref, ids_ref = ref_routing(logits, None, **kw)
    w, ids = triton_routing.moe_routing(logits, None, **kw)
    assert torch.equal(ids, ids_ref)
    assert rel_err(w, w_ref) <= 1e-6


def test_kernel_tie_rule_lowest_index_first():
    """Documented kernel contract for exact ties (torch.topk leaves it unspecified): lowest index
    first, for groups and for experts; weights then are equal."""
    logits = torch.zeros(3, 16)
    w, ids = triton_routing.moe_routing(logits, None, top_k=4, n_group=1, topk_group=1, renormalize=True,
                                        scale=1.0)
    assert torch.equal(ids, torch.arange(4, dtype=torch.int32).expand(3, 4))
    assert torch.allclose(w, torch.full((3, 4), 0.25))
    # 4 groups of 4, keep 2: groups 0 and 1 win the tie, so experts 0..5 (of 0..7)
    w, ids = triton_routing.moe_routing(logits, None, top_k=6, n_group=4, topk_group=2, renormalize=False,
                                        scale=1.0)
    assert torch.equal(ids, torch.arange(6, dtype=torch.int32).expand(3, 6))
    assert torch.allclose(w, torch.full((3, 6), 0.5))


def test_kernel_empty_batch():
    w, ids = triton_routing.moe_routing(torch.zeros(0, 64), None, top_k=4, n_group=1, topk_group=1,
                                        renormalize=True, scale=SCALE)
    assert w.shape == (0, 4) and ids.shape == (0, 4)


# ---- the router GEMM (`fp32_linear`, kernels/cuda/fp32_linear.py) and SwiGLU (kernels/cuda/swiglu.py) --------
from glm_ray.kernels.cuda.layout import FP32_LINEAR_PROGRAMS, fp32_linear_config  # noqa: E402
from glm_ray.kernels.torch_ref.linear import fp32_linear as ref_fp32_linear  # noqa: E402
from glm_ray.kernels.torch_ref.moe import swiglu as ref_swiglu  # noqa: E402

triton_fp32_linear = pytest.importorskip("glm_ray.kernels.cuda.fp32_linear", reason="triton not importable")


@pytest.mark.parametrize("t,e,d", [(1, 64, 2048), (64, 64, 2048), (1, 256, 6144), (256, 256, 6144), (3, 160, 1000)])
def test_fp32_linear_config(t, e, d):
    bt, be, bk = fp32_linear_config(t, e, d)
    assert bt * be * bk <= 4096 and bk >= 32 and be <= 16 and bt <= 16      # registers a thread at 4 warps
    for v in (bt, be, bk):
        assert v & (v - 1) == 0                                              # tl.arange needs powers of two
    programs = -(-e // be) * -(-t // bt)
    assert programs >= min(FP32_LINEAR_PROGRAMS // 2, e * -(-t // bt))           # the launch fills the SMs


@pytest.mark.parametrize("t,e,d", [(1, 64, 256), (5, 12, 200), (19, 40, 96)])
def test_fp32_linear_kernel_matches_reference(t, e, d):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    w = torch.randn(e, d, generator=g)
    out = triton_fp32_linear.fp32_linear(x, w)
    ref = ref_fp32_linear(x, w)                                              # F.linear(x.float(), w)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    # the same fp32 products summed in another order: within fp32 round-off of the dot's magnitude
    assert (out - ref).abs().max().item() <= 1e-5 * (x.float().abs() @ w.abs().T).max().item()
    strided = torch.randn(t, 2 * d, generator=g).to(torch.bfloat16)[:, :d]  # row stride 2d
    assert torch.allclose(triton_fp32_linear.fp32_linear(strided, w), ref_fp32_linear(strided, w), rtol=1e-5, atol=1e-4)
    assert triton_fp32_linear.fp32_linear(x[:0], w).shape == (0, e)


fp32_split = pytest.importorskip("glm_ray.kernels.cuda.fp32_split", reason="triton not importable")


def test_split3_is_exact():
    """The weight's three bf16 parts sum to it exactly in fp32 (router-sized and tiny / huge magnitudes)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 512, generator=g) * torch.logspace(-20, 20, 512)[None, :]
    p = fp32_split.split3(w)
    assert p.shape == (3, 64, 512) and p.dtype == torch.bfloat16
    assert torch.equal(p[0].float() + p[1].float() + p[2].float(), w)
    assert torch.equal(p[0].float() + (p[1].float() + p[2].float()), w)


@pytest.mark.parametrize("t,e,d", [(70, 64, 256), (33, 12, 200), (130, 40, 96)])
def test_fp32_linear_split_matches_reference(t, e, d):
    """The prefill-size path (tensor-core dots of the split weight): the fp32 dot products of the reference, summed
    in another order — the kernel's error within fp32 round-off of the dot's magnitude, as the SIMT kernel's."""
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    w = torch.randn(e, d, generator=g) / 7
    out = fp32_split.fp32_linear_split(x, fp32_split.split3(w))
    exact = (x.double() @ w.double().T)                                      # the products and sums in fp64
    assert out.dtype == torch.float32 and out.shape == (t, e)
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert (out.double() - exact).abs().max().item() <= 1e-6 * scale
    assert (ref_fp32_linear(x, w).double() - exact).abs().max().item() <= 1e-6 * scale   # (the bound holds there too)
    # only the first part: a bf16 weight's GEMM, ~2^-9 relative off — the other two parts are what make it fp32
    one = fp32_split.fp32_linear_split(x, torch.stack([w.bfloat16(), w.bfloat16() * 0, w.bfloat16() * 0]))
    assert (one.double() - exact).abs().max().item() > 100 * (out.double() - exact).abs().max().item()
    strided = torch.randn(t, 2 * d, generator=g).to(torch.bfloat16)[:, :d]  # row stride 2d
    assert torch.allclose(fp32_split.fp32_linear_split(strided, fp32_split.split3(w)),
                          ref_fp32_linear(strided, w), rtol=1e-5, atol=1e-5)
    assert fp32_split.fp32_linear_split(x[:0], fp32_split.split3(w)).shape == (0, e)


def test_cuda_kernels_route_prefill_sizes_to_the_split(gpu_check_off, spy):
    """CudaKernels.fp32_linear with the device check bypassed: from FP32_LINEAR_SPLIT_MIN_ROWS bf16 rows (and D a
    multiple of 8) the split kernel runs on parts made once and kept on the weight; fewer rows, fp32 x or an odd D
    take the other paths."""
    from glm_ray.kernels.cuda import CudaKernels
    from glm_ray.kernels.cuda.layout import FP32_LINEAR_SPLIT_MIN_ROWS as MIN_ROWS
    ck = CudaKernels()
    if ck.tk is None:
        pytest.skip(ck.triton_error)
    calls = spy(fp32_split, "fp32_linear_split", lambda x, *a: x.shape[0])
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 64, generator=g)
    x = torch.randn(MIN_ROWS, 64, generator=g).to(torch.bfloat16)
    y = ck.fp32_linear(x, w)
    parts = w._glm_ray_split3
    assert calls == [MIN_ROWS] and parts.shape == (3, 16, 64) and not ck.fallbacks
    assert torch.allclose(y, ref_fp32_linear(x, w), rtol=1e-5, atol=1e-5)
    ck.fp32_linear(x, w)
    assert w._glm_ray_split3 is parts and calls == [MIN_ROWS] * 2                # made once
    ck.fp32_linear(x[:MIN_ROWS - 1], w)
    ck.fp32_linear(x.float(), w)
    w_odd = torch.randn(16, 60, generator=g)
    ck.fp32_linear(x[:, :60], w_odd)
    assert calls == [MIN_ROWS] * 2


triton_swiglu = pytest.importorskip("glm_ray.kernels.cuda.swiglu", reason="triton not importable")


@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("t,i", [(1, 96), (3, 300), (4, 1536)])
def test_swiglu_kernel_matches_reference(t, i, limit):
    g = torch.Generator().manual_seed(i)
    gu = (torch.randn(t, 2 * i, generator=g) * 4).to(torch.bfloat16)         # [T, 2I]: gate | up, row stride 2I
    gate, up = gu[:, :i], gu[:, i:]
    out = triton_swiglu.swiglu(gate, up, limit)
    ref = ref_swiglu(gate, up, limit)
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    # the interpreter's exp is numpy's and its bf16 casts truncate (the GPU kernel rounds, uses expf as
    # ATen and must be bit-equal there: tests/gpu/test_cuda_routing.py): here two bf16 steps apart at most,
    # which still catches a swapped gate / up, a missed clamp or a wrong row stride (errors of O(1))
    assert torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=1e-6)
    if limit is not None:
        assert (gate.float() > limit).any()                                  # the clamp is exercised
