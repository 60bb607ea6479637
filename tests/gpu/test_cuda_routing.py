"""The MoE routing Triton kernel (kernels/cuda/routing.py) against the torch reference
(kernels/torch_ref/routing.py) run on the same GPU, and under CUDA-graph capture + replay.

Inputs are tie-free (`separated_logits`, gap 1e-5 here): compiled Triton's `tl.sigmoid` uses the
approximate `ex2` and division, torch's CUDA sigmoid the accurate `expf`; both are within ~5e-7
(relative, |logit| <= ~8) of the exact sigmoid, so choices and group top-2 sums of the two disagree by
at most ~2e-6 and a 1e-5 separation makes the id sets and their order identical.
Weights: rel err <= 2e-6 (the same sigmoid ulps on values <= 1, plus the order of the K-term sum).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.torch_ref.routing import moe_routing as ref_routing  # noqa: E402
from tests.kernels.cases import rel_err  # noqa: E402
from tests.kernels.test_routing import CASES, SCALE, make_bias, separated_logits  # noqa: E402

DEV = "cuda"
GAP = 1e-5


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("e,k,n_group,topk_group", CASES)
def test_cuda_routing_matches_reference(e, k, n_group, topk_group, t, renorm):
    from glm_ray.kernels.cuda.routing import moe_routing
    bias = make_bias(e)
    logits = separated_logits(t, e, n_group, bias, seed=t, gap=GAP).to(DEV)
    bias = bias.to(DEV)
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, renormalize=renorm, scale=SCALE)
    w_ref, ids_ref = ref_routing(logits, bias, **kw)
    w, ids = moe_routing(logits, bias, **kw)
    torch.cuda.synchronize()
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == (t, k)
    assert torch.equal(ids, ids_ref), (ids != ids_ref).any(-1).sum().item()
    assert rel_err(w, w_ref) <= 2e-6


@pytest.mark.parametrize("e,k,n_group,topk_group", [(64, 4, 1, 1), (256, 8, 8, 4)])
def test_cuda_routing_graph_replay(e, k, n_group, topk_group):
    from glm_ray.kernels.cuda.routing import moe_routing
    t = 64
    bias = make_bias(e).to(DEV)
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, renormalize=True, scale=SCALE)
    static = separated_logits(t, e, n_group, bias, seed=11, gap=GAP).to(DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                             # warm-up: compile outside capture
        moe_routing(static, bias, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_g, ids_g = moe_routing(static, bias, **kw)
    new = separated_logits(t, e, n_group, bias, seed=12, gap=GAP).to(DEV)
    static.copy_(new)
    graph.replay()
    w_e, ids_e = moe_routing(new, bias, **kw)
    torch.cuda.synchronize()
    assert torch.equal(ids_g, ids_e) and torch.equal(w_g, w_e)
    w_ref, ids_ref = ref_routing(new, bias, **kw)
    assert torch.equal(ids_g, ids_ref)
    assert rel_err(w_g, w_ref) <= 2e-6


# ---- the router GEMM and the SwiGLU kernel, at glm5-flash-31b / GLM-5 shapes ---------------------------
@pytest.mark.parametrize("t", [1, 8, 64, 256])
@pytest.mark.parametrize("e,d", [(64, 2048), (256, 6144), (32, 2048), (64, 6144)])   # routers, indexer weights
def test_cuda_fp32_linear_matches_reference(t, e, d):
    from glm_ray.kernels.cuda.fp32_linear import fp32_linear
    from glm_ray.kernels.torch_ref.linear import fp32_linear as ref
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(e, d, generator=g) * d ** -0.5).to(DEV)
    out, want = fp32_linear(x, w), ref(x, w)
    exact = x.double() @ w.double().T                                        # both within fp32 round-off of it
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert (out.double() - exact).abs().max().item() <= 1e-6 * scale
    assert (want.double() - exact).abs().max().item() <= 1e-6 * scale


@pytest.mark.parametrize("t", [512, 8192])
@pytest.mark.parametrize("e,d", [(64, 2048), (256, 6144), (32, 2048), (64, 6144)])   # routers, indexer weights
def test_cuda_fp32_linear_prefill_split(ck, t, e, d):
    """From FP32_LINEAR_SPLIT_MIN_ROWS rows the op runs the split-weight tensor-core kernel: within fp32 round-off of
    the exact dot products, the split kept on the weight, no fallback. The kernel sums 3 x D exact products in one
    fp32 accumulator, so its bound is the probabilistic one of an n-term fp32 sum (Higham & Mary), sqrt(n) * u *
    sum |x||w| with n = 3D, u = 2^-24 — not cuBLAS's sgemm's 1e-6 (on an H100, session 43: 1.1e-6 at D = 2048, 2.0e-6
    at D = 6144, i.e. ~0.4 sqrt(n) u; a dropped middle part would be off by ~2^-9 relative)."""
    from glm_ray.kernels.torch_ref.linear import fp32_linear as ref
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(e, d, generator=g) * d ** -0.5).to(DEV)
    ck.fallbacks.clear()                                                     # (the module-scoped ck's, so far)
    out = ck.fp32_linear(x, w)
    assert w._glm_ray_split3.shape == (3, e, d) and not ck.fallbacks
    exact = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert (out.double() - exact).abs().max().item() <= (3 * d) ** 0.5 * 2.0 ** -24 * scale
    assert (ref(x, w).double() - exact).abs().max().item() <= 1e-6 * scale


@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("t,i", [(1, 1536), (64, 1536), (2048, 10240), (8, 2048)])
def test_cuda_swiglu_bit_equal_to_torch(t, i, limit):
    from glm_ray.kernels.cuda.swiglu import swiglu
    from glm_ray.kernels.torch_ref.moe import swiglu as ref
    g = torch.Generator().manual_seed(i + t)
    gu = (torch.randn(t, 2 * i, generator=g) * 4).to(torch.bfloat16).to(DEV)   # gate | up halves
    out = swiglu(gu[:, :i], gu[:, i:], limit)
    assert torch.equal(out, ref(gu[:, :i], gu[:, i:], limit))             # expf + IEEE division, as ATen
