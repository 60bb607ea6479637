"""The `rms_norm` op (RMSNorm with the optional fused residual add): the torch reference
(kernels/torch_ref/norm.py) against the original `RMSNorm.forward` math, the layer and the cuda-backend
wiring on CPU, and the Triton kernel (kernels/cuda/norm.py) under TRITON_INTERPRET=1 against the reference.

Tolerances. The kernel rounds exactly like the reference at every step (residual sum in x's dtype, IEEE
mean, correctly rounded 1/sqrt, cast to x's dtype before the weight, one rounding of the weight product);
the one difference is the ORDER of the fp32 sum of squares. So:
* grid inputs (multiples of 1/8, |x| <= 4: every square and partial sum is exact in fp32, in any order)
  must match bit for bit, in fp32, bf16 and fp16;
* random inputs: fp32 rel err <= 2e-6 per element (a few fp32 ulps of rstd from the sum order); bf16 /
  fp16: the fp32 normalized value moves by ~1e-7 relative, which flips the cast-back rounding only next to
  a rounding midpoint: |diff| <= 2 ulps of the output dtype (one from the cast, one from the weight
  product's rounding), on at most 1% of the elements (observed: none). The residual sum is always exact.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray import kernels  # noqa: E402
from glm_ray.kernels.torch_ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from glm_ray.layers.norm import RMSNorm  # noqa: E402

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative size of 2 ulps of the output dtype (significand bits 24 / 8 / 11)
TWO_ULPS = {torch.float32: 2e-6, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grid_input(t: int, d: int, dtype, seed: int, k: int = 16) -> torch.Tensor:
    """[T, D] multiples of 1/8 in [-k/8, k/8]: squares and sums of squares exact in fp32 in any order."""
    return (torch.randint(-k, k + 1, (t, d), generator=_gen(seed)) / 8).to(dtype)


def rand_input(t: int, d: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(t, d, generator=_gen(seed)).to(dtype)


def norm_weight(d: int, dtype, seed: int = 7) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(d, generator=_gen(seed))).to(dtype)


def old_rms_norm(x, weight, eps):
    """`RMSNorm.forward` as it was before the layer moved to the op (frozen here)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def assert_close_ulps(y: torch.Tensor, ref: torch.Tensor):
    """|y - ref| <= 2 ulps of the dtype (relative); bf16 / fp16: on at most 1% of the elements (fp32: a
    different rstd moves every element of its row) — module docstring."""
    a, b = y.float(), ref.float()
    diff = (a - b).abs()
    assert bool((diff <= TWO_ULPS[ref.dtype] * b.abs()).all()), float((diff / b.abs().clamp_min(1e-30)).max())
    if ref.dtype != torch.float32:
        assert (y != ref).float().mean().item() <= 0.01


# ------------------------------------------------------------------------ reference == the old layer

@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_old_layer_math(dtype):
    x, r = rand_input(9, 256, dtype, 0), rand_input(9, 256, dtype, 1)
    w = norm_weight(256, dtype)
    assert torch.equal(ref_rms_norm(x, w, EPS), old_rms_norm(x, w, EPS))
    y, s = ref_rms_norm(x, w, EPS, r)
    assert torch.equal(s, x + r) and s.dtype == dtype
    assert torch.equal(y, old_rms_norm(x + r, w, EPS))


def test_layer_uses_the_op_and_keeps_the_plain_call():
    kernels.init_backend("torch")
    layer = RMSNorm(128, EPS, torch.bfloat16)
    layer.weight.data.copy_(norm_weight(128, torch.bfloat16))
    x, r = rand_input(5, 128, torch.bfloat16, 2), rand_input(5, 128, torch.bfloat16, 3)
    assert torch.equal(layer(x), old_rms_norm(x, layer.weight, EPS))
    y, s = layer(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, old_rms_norm(x + r, layer.weight, EPS))
    wide = rand_input(5, 160, torch.bfloat16, 4)                             # kv_a_layernorm: a row slice
    assert torch.equal(layer(wide[:, :128]), old_rms_norm(wide[:, :128], layer.weight, EPS))


def test_cuda_backend_on_cpu_falls_back_to_the_reference():
    try:
        ops = kernels.init_backend("cuda", "cpu")
        impl = ops.rms_norm.__self__
        x, r = rand_input(4, 64, torch.bfloat16, 5), rand_input(4, 64, torch.bfloat16, 6)
        w = norm_weight(64, torch.bfloat16)
        assert torch.equal(ops.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
        y, s = ops.rms_norm(x, w, EPS, r)
        y_ref, s_ref = ref_rms_norm(x, w, EPS, r)
        assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
        assert {op for op, _ in impl.fallbacks} == {"rms_norm"}
        assert all("cpu" in reason for _, reason in impl.fallbacks)
    finally:
        kernels.init_backend("torch")


# ------------------------------------------------------------------------ Triton kernel (interpreter)

triton_norm = pytest.importorskip("glm_ray.kernels.cuda.norm", reason="triton not importable")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 512), (5, 768), (3, 2048), (2, 6144), (17, 64)])
def test_kernel_bit_exact_on_grid_inputs(t, d, dtype, residual):
    x, w = grid_input(t, d, dtype, seed=d + t), norm_weight(d, dtype)
    if not residual:
        assert torch.equal(triton_norm.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
        return
    r = grid_input(t, d, dtype, seed=d + t + 1)                              # |x + r| <= 4: still exact
    y, s = triton_norm.rms_norm(x, w, EPS, r)
    y_ref, s_ref = ref_rms_norm(x, w, EPS, r)
    assert y.dtype == dtype and s.dtype == dtype and y.shape == s.shape == (t, d)
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 512), (7, 768), (4, 2048)])
def test_kernel_matches_reference_on_random_inputs(t, d, dtype, residual):
    x, w = rand_input(t, d, dtype, seed=d + t), norm_weight(d, dtype)
    if not residual:
        assert_close_ulps(triton_norm.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
        return
    r = rand_input(t, d, dtype, seed=d + t + 1) * 4
    y, s = triton_norm.rms_norm(x, w, EPS, r)
    y_ref, s_ref = ref_rms_norm(x, w, EPS, r)
    assert torch.equal(s, s_ref)
    assert_close_ulps(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_strided_and_batched_rows(dtype):
    """kv_a_layernorm reads ckv[:, :r] (row stride r + dr); leading dims are flattened and restored."""
    w = norm_weight(512, dtype)
    ckv = grid_input(6, 576, dtype, seed=1)
    c = ckv[:, :512]                                                          # [T, 512] row stride 576
    assert c.stride() == (576, 1)
    assert torch.equal(triton_norm.rms_norm(c, w, EPS), ref_rms_norm(c, w, EPS))
    res_wide = grid_input(6, 1024, dtype, seed=2)
    y, s = triton_norm.rms_norm(c, w, EPS, res_wide[:, 256:768])              # strided residual too
    y_ref, s_ref = ref_rms_norm(c, w, EPS, res_wide[:, 256:768])
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref) and y.is_contiguous() and s.is_contiguous()
    x3 = grid_input(6, 512, dtype, seed=3).view(2, 3, 512)                    # [2, 3, D]
    y3 = triton_norm.rms_norm(x3, w, EPS)
    assert y3.shape == (2, 3, 512) and torch.equal(y3, ref_rms_norm(x3, w, EPS))
    xt = grid_input(512, 6, dtype, seed=4).t()                                # last dim not unit-stride
    assert torch.equal(triton_norm.rms_norm(xt, w, EPS), ref_rms_norm(xt, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_residual(dtype):
    """`in_place`: the sum is stored into the residual tensor (a row range of a wider buffer, its neighbours
    untouched), which is returned: bit for bit the out-of-place s, the same y; the reference the same way; a
    residual without a unit last stride gets the sum copied back."""
    w = norm_weight(512, dtype)
    x = grid_input(5, 512, dtype, seed=11)
    for op in (triton_norm.rms_norm, ref_rms_norm):
        store = grid_input(8, 512, dtype, seed=12)
        keep = store.clone()
        r = store[2:7]
        y_want, s_want = op(x, w, EPS, r.clone())
        y, s = op(x, w, EPS, r, in_place=True)
        assert s is r and torch.equal(store[2:7], s_want) and torch.equal(y, y_want)
        assert torch.equal(store[:2], keep[:2]) and torch.equal(store[7:], keep[7:])
    rt = grid_input(512, 5, dtype, seed=13).t()                               # [5, 512], last dim strided
    want = ref_rms_norm(x, w, EPS, rt.clone())[1]
    y, s = triton_norm.rms_norm(x, w, EPS, rt, in_place=True)
    assert s is rt and torch.equal(rt, want)


def test_kernel_rounds_bf16_half_to_even():
    """Sums exactly half-way between two bf16 values round to even, like torch's add (the interpreter's
    own fp32 -> bf16 cast truncates: the kernel rounds on the bits; the grid tests cover the cast back and
    the weight product the same way)."""
    w = torch.ones(4, dtype=torch.bfloat16)
    a = torch.ones(1, 4, dtype=torch.bfloat16)
    b = torch.tensor([[2 ** -8, 3 * 2 ** -8, -(2 ** -9), 2 ** -7]], dtype=torch.bfloat16)   # 3 ties + 1 exact
    y, s = triton_norm.rms_norm(a, w, EPS, b)
    assert torch.equal(s, a + b) and torch.equal(s[0, :3].float(), torch.tensor([1.0, 1 + 2 ** -6, 1.0]))
    assert torch.equal(y, ref_rms_norm(a, w, EPS, b)[0])


def test_kernel_empty_batch():
    w = norm_weight(512, torch.bfloat16)
    assert triton_norm.rms_norm(torch.zeros(0, 512, dtype=torch.bfloat16), w, EPS).shape == (0, 512)
    y, s = triton_norm.rms_norm(torch.zeros(0, 512, dtype=torch.bfloat16), w, EPS,
                                torch.zeros(0, 512, dtype=torch.bfloat16))
    assert y.shape == s.shape == (0, 512)


def test_cuda_kernels_routes_supported_calls_to_the_kernel(gpu_check_off, spy):
    """CudaKernels.rms_norm with the device check bypassed: bf16 runs the Triton kernel (no fallback);
    fp32, a mismatched weight dtype and D > 8192 take the reference with their reason."""
    from glm_ray.kernels.cuda import CudaKernels
    ck = CudaKernels()
    if ck.tk is None:
        pytest.skip(ck.triton_error)
    calls = spy(triton_norm, "rms_norm")
    x, r = grid_input(3, 768, torch.bfloat16, 8), grid_input(3, 768, torch.bfloat16, 9)
    w = norm_weight(768, torch.bfloat16)
    y, s = ck.rms_norm(x, w, EPS, r)
    y_ref, s_ref = ref_rms_norm(x, w, EPS, r)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref) and calls == [1] and not ck.fallbacks
    assert torch.equal(ck.rms_norm(x.float(), w.float(), EPS), ref_rms_norm(x.float(), w.float(), EPS))
    assert torch.equal(ck.rms_norm(x, w.float(), EPS), ref_rms_norm(x, w.float(), EPS))
    big = grid_input(1, 8200, torch.bfloat16, 10)
    ck.rms_norm(big, norm_weight(8200, torch.bfloat16), EPS)
    reasons = " | ".join(reason for _, reason in ck.fallbacks)
    assert calls == [1] and "float32" in reasons and "weight dtype" in reasons and "8192" in reasons
