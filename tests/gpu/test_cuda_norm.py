"""The RMSNorm Triton kernel (kernels/cuda/norm.py) through `CudaKernels.rms_norm` on the GPU, against
the torch reference (kernels/torch_ref/norm.py) on the same GPU and on the CPU, and under CUDA-graph
capture + replay. Every test asserts no reference fallback.

Tolerances (as in tests/kernels/test_norm_op.py): the kernel rounds like the reference at every step
(residual sum in x's dtype, IEEE mean, correctly rounded 1/sqrt via div_rn / sqrt_rn, cast back before
the weight, one rounding of the weight product); only the order of the fp32 sum of squares differs — and
torch's CUDA rms_norm also uses its own rsqrt. So:
* the residual sum is bit-exact;
* grid inputs (multiples of 1/8: exact sums of squares in any order) match the CPU reference bit for bit;
* random inputs: |diff| <= 2 ulps of the output dtype (the cast back and the weight product can each
  round the other way next to a midpoint), on at most 1% of the elements.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.torch_ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from tests.kernels.test_norm_op import EPS, assert_close_ulps, grid_input, norm_weight, rand_input  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _no_fallbacks(no_fallbacks):                      # tests/gpu/conftest.py (with its `ck`)
    yield


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
@pytest.mark.parametrize("t", [1, 8, 64, 1024])
@pytest.mark.parametrize("d", [512, 768, 2048, 6144])
def test_cuda_rms_norm_matches_reference(ck, d, t, residual):
    x, w = rand_input(t, d, BF16, seed=d + t).to(DEV), norm_weight(d, BF16).to(DEV)
    if not residual:
        y = ck.rms_norm(x, w, EPS)
        assert y.dtype == BF16 and y.shape == (t, d)
        assert_close_ulps(y, ref_rms_norm(x, w, EPS))                         # torch on the GPU
        assert_close_ulps(y.cpu(), ref_rms_norm(x.cpu(), w.cpu(), EPS))       # torch on the CPU
        return
    r = (rand_input(t, d, BF16, seed=d + t + 1) * 4).to(DEV)
    y, s = ck.rms_norm(x, w, EPS, r)
    y_ref, s_ref = ref_rms_norm(x, w, EPS, r)
    assert torch.equal(s, s_ref)
    assert_close_ulps(y, y_ref)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("t", [1, 64, 1024])
@pytest.mark.parametrize("d", [512, 768, 2048, 6144])
def test_cuda_rms_norm_bit_exact_on_grid_inputs(ck, d, t, dtype):
    x, r = grid_input(t, d, dtype, seed=d + t), grid_input(t, d, dtype, seed=d + t + 1)
    w = norm_weight(d, dtype)
    y, s = ck.rms_norm(x.to(DEV), w.to(DEV), EPS, r.to(DEV))
    y_ref, s_ref = ref_rms_norm(x, w, EPS, r)                                 # CPU reference
    assert torch.equal(s.cpu(), s_ref) and torch.equal(y.cpu(), y_ref)
    assert torch.equal(ck.rms_norm(x.to(DEV), w.to(DEV), EPS).cpu(), ref_rms_norm(x, w, EPS))


@pytest.mark.parametrize("t", [1, 64])
def test_cuda_rms_norm_strided_rows(ck, t):
    """kv_a_layernorm's input: ckv[:, :512] of [T, 576] rows (q_a_layernorm / kv sizes of GLM-5)."""
    w = norm_weight(512, BF16).to(DEV)
    ckv = grid_input(t, 576, BF16, seed=t).to(DEV)
    c = ckv[:, :512]
    assert torch.equal(ck.rms_norm(c, w, EPS).cpu(), ref_rms_norm(c.cpu(), w.cpu(), EPS))
    xr = rand_input(t, 576, BF16, seed=t + 1).to(DEV)[:, :512]
    assert_close_ulps(ck.rms_norm(xr, w, EPS), ref_rms_norm(xr, w, EPS))


def test_cuda_rms_norm_fp32_uses_the_exact_reference(ck):
    x, w = rand_input(8, 512, torch.float32, 0).to(DEV), norm_weight(512, torch.float32).to(DEV)
    assert torch.equal(ck.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
    assert {op for op, _ in ck.fallbacks} == {"rms_norm"}
    ck.fallbacks.clear()                                                      # expected: not a failure


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
def test_cuda_rms_norm_graph_replay(ck, residual):
    t, d = 64, 6144
    w = norm_weight(d, BF16).to(DEV)
    x = rand_input(t, d, BF16, seed=1).to(DEV)
    r = rand_input(t, d, BF16, seed=2).to(DEV) if residual else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                             # warm-up: compile outside capture
        ck.rms_norm(x, w, EPS, r)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = ck.rms_norm(x, w, EPS, r)
    x.copy_(rand_input(t, d, BF16, seed=3).to(DEV))
    if residual:
        r.copy_(rand_input(t, d, BF16, seed=4).to(DEV))
    graph.replay()
    out_e = ck.rms_norm(x, w, EPS, r)
    torch.cuda.synchronize()
    if residual:
        assert torch.equal(out_g[0], out_e[0]) and torch.equal(out_g[1], out_e[1])
        assert torch.equal(out_g[1], x + r)
    else:
        assert torch.equal(out_g, out_e)


@pytest.mark.parametrize("t", [8, 8192])
def test_cuda_rms_norm_in_place_residual(ck, t):
    """`in_place` (the piecewise graphs' residual carry): the sum lands in the residual's own rows of a wider
    buffer, bit for bit the out-of-place s, the same y; its neighbours untouched; also under graph replay."""
    d = 2048
    x, w = rand_input(t, d, BF16, seed=t).to(DEV), norm_weight(d, BF16).to(DEV)
    store = (rand_input(t + 4, d, BF16, seed=t + 1) * 4).to(DEV)
    keep = store.clone()
    y_want, s_want = ck.rms_norm(x, w, EPS, store[2:2 + t].clone())
    y, s = ck.rms_norm(x, w, EPS, store[2:2 + t], in_place=True)
    assert s.data_ptr() == store[2].data_ptr() and torch.equal(store[2:2 + t], s_want) and torch.equal(y, y_want)
    assert torch.equal(store[:2], keep[:2]) and torch.equal(store[2 + t:], keep[2 + t:])
    store.copy_(keep)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg, _ = ck.rms_norm(x, w, EPS, store[2:2 + t], in_place=True)
    store.copy_(keep)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(store[2:2 + t], s_want) and torch.equal(yg, y_want)
