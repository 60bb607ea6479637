"""The fused small-M block-FP8 W8A8 linear (glm_ray/kernels/cuda/fp8_small_m.py) under TRITON_INTERPRET=1
on CPU, against the torch reference `block_fp8_linear(..., mode="w8a8")`; plus its pure-Python tile config.

Tolerance: rel err (and elementwise rtol/atol) <= 1e-5, as the other FP8 interpreter tests. The kernel
quantizes x with the project's quantizer (bit-exact with the reference: same op order, RNE onto the e4m3
grid), products of e4m3 values are exact in fp32, and both sides accumulate in fp32 — only the summation
order differs (per-128-group partial dots, split-K partials), ~1e-7 relative at these K. A single flipped
e4m3 element would already cost ~1e-3 relative here, so 1e-5 checks the quantization bit for bit.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray.kernels.cuda import layout as L
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear
from tests.kernels.cases import dense_fp8_case, interpreted, rel_err

BF16 = torch.bfloat16
TOL = 1e-5


@pytest.fixture(scope="module")
def sm():
    """fp8_small_m with its kernels interpreted (skipped if triton was imported compiled: GPU machine)."""
    return interpreted("fp8_small_m")


def _check(y, x, w, s, ue8m0):
    want = ref_block_fp8_linear(x, w, s, (128, 128), torch.float32, act_ue8m0=ue8m0)
    assert y.shape == want.shape and y.dtype == torch.float32
    assert rel_err(y, want) <= TOL
    torch.testing.assert_close(y, want, rtol=TOL, atol=TOL)


# ------------------------------------------------------------------------------------- config

def test_config_is_shape_only_and_splits_are_never_empty():
    from glm_ray.kernels.cuda.fp8_small_m import GROUP, small_m_config
    for m in (1, 2, 3, 16, 17, 33, 64):
        for n, k in [(2048, 8192), (16384, 2048), (576, 6144), (128, 130), (200, 384), (6144, 16384)]:
            for split_k in (None, 1, 2, 3, 7, 1000):
                c = small_m_config(m, n, k, split_k=split_k)
                g = L.cdiv(k, GROUP)
                assert c.block_m >= max(16, m) and c.block_m & (c.block_m - 1) == 0 and c.block_m <= 64
                assert GROUP % c.block_n == 0
                assert 1 <= c.split <= g and c.split * c.groups_per_split >= g
                assert (c.split - 1) * c.groups_per_split < g                     # the last split has work
                if split_k is not None:
                    assert c.split <= split_k
    # N = 2048 at M = 1 cannot fill 132 SMs with 32 column tiles: split-K kicks in
    c = small_m_config(1, 2048, 8192)
    assert c.split > 1 and L.cdiv(2048, c.block_n) * c.split >= 132
    assert small_m_config(1, 16384, 2048).split == 1                            # 256 tiles: enough already
    assert small_m_config(64, 2048, 1024).split == 1                            # partial traffic over budget
    with pytest.raises(ValueError):
        small_m_config(65, 128, 128)


def test_tuned_table_entries_are_valid_and_used_only_where_they_were_measured():
    from glm_ray.kernels.cuda.fp8_small_m import GROUP, REDUCE_MODES, TUNED, TUNED_SMS, small_m_config
    for (n, k, bm), (bn, split, warps, reduce) in TUNED.items():
        assert GROUP % bn == 0 and 1 <= split <= L.cdiv(k, GROUP) and warps in (2, 4, 8) and reduce in REDUCE_MODES
        for m in {bm // 2 + 1, bm} if bm > 16 else {1, bm}:
            c = small_m_config(m, n, k, num_sms=TUNED_SMS)
            assert (c.block_m, c.block_n, c.num_warps, c.reduce) == (bm, bn, warps, reduce)
            assert c.split * c.groups_per_split >= L.cdiv(k, GROUP) and c.split <= split
            # another SM count, an explicit split or BN, or tuned=False: the heuristic
            h = small_m_config(m, n, k, num_sms=TUNED_SMS, tuned=False)
            assert small_m_config(m, n, k, num_sms=78) == small_m_config(m, n, k, num_sms=78, tuned=False)
            assert small_m_config(m, n, k, num_sms=TUNED_SMS, block_n=h.block_n, split_k=h.split) == h
    # the heuristic's reduction: the last program at BM 16, a second launch above
    assert small_m_config(1, 16384, 4096, split_k=2).reduce == "last"
    assert small_m_config(40, 16384, 4096, split_k=2).reduce == "kernel"


# ------------------------------------------------------------------------------ interpreted kernel

@pytest.mark.parametrize("n,k", [(256, 512), (200, 384), (128, 130)])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_interp_small_m_matches_reference(sm, m, n, k):
    x, w, s = dense_fp8_case(m, n, k, seed=m)
    x = x * 3
    x[0, :128] = 0                                                   # an all-zero group (eps floor)
    for ue8m0 in (False, True):
        for split_k in (1, 2):
            y = sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, act_ue8m0=ue8m0, split_k=split_k)
            _check(y, x, w, s, ue8m0)


def test_interp_split_k_with_a_ragged_last_split_and_bn32(sm):
    # K = 640: 5 groups; split 3 -> 2 groups per split, the last split has 1 real group + 1 masked one
    x, w, s = dense_fp8_case(5, 96, 640, dtype=torch.float16)
    cfg = sm.SmallMConfig(block_m=16, block_n=32, split=3, groups_per_split=2, num_warps=4, num_stages=2)
    y = sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, config=cfg)
    _check(y, x, w, s, False)
    assert sm.small_m_config(5, 96, 640, split_k=3) == sm.SmallMConfig(16, 64, 3, 2, 4, 4)


def test_interp_strided_operands_out_dtype_and_determinism(sm):
    m, n, k = 4, 200, 300
    x, w, s = dense_fp8_case(m, n, k)
    # x as a column slice of a wider activation (row stride > K); w / s as the padded corner views that
    # block_fp8_linear_prepare hands to the op (strides (Kp, 1))
    xw = torch.randn(m, k + 50).to(BF16)
    xw[:, :k] = x
    xv = xw[:, :k]
    wv, sv, _ = L.prepare_scaled_mm_weight(w, s)
    assert wv.stride() != w.stride()
    y = sm.block_fp8_linear_small_m(xv, wv, sv, out_dtype=torch.float32, split_k=2)
    _check(y, x, w, s, False)
    assert torch.equal(y, sm.block_fp8_linear_small_m(xv, wv, sv, out_dtype=torch.float32, split_k=2))
    # default out dtype = x.dtype; bf16 output = the fp32 result rounded once
    yb = sm.block_fp8_linear_small_m(x, w, s, split_k=2)
    assert yb.dtype == BF16 and yb.shape == (m, n)
    torch.testing.assert_close(yb, y.to(BF16), rtol=0, atol=0)
    assert sm.block_fp8_linear_small_m(x[:0], w, s).shape == (0, n)
    with pytest.raises(AssertionError):
        sm.block_fp8_linear_small_m(torch.zeros(65, k, dtype=BF16), w, s)


@pytest.mark.parametrize("m,n,k,split", [(1, 256, 512, 4), (5, 96, 640, 3), (33, 200, 384, 2)])
def test_interp_last_program_reduces_like_the_sum_kernel(sm, m, n, k, split):
    """reduce="last" (one launch: the last of a tile's programs adds the partials) gives the bits of the
    two-launch "kernel" reduction, leaves the arrival counters at 0, and repeats bit for bit."""
    x, w, s = dense_fp8_case(m, n, k, seed=split)
    two = sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, split_k=split, reduce="kernel")
    one = sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, split_k=split, reduce="last")
    assert sm.small_m_config(m, n, k, split_k=split).split == split
    assert torch.equal(one, two)
    _check(one, x, w, s, False)
    counters = sm._counters[("cpu", None, 0)]
    assert int(counters.abs().sum()) == 0
    assert ("cpu", None, 1) in sm._counters                     # the side lane's made with it (never in a capture)
    assert torch.equal(one, sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, split_k=split))
    with pytest.raises(AssertionError):
        sm.block_fp8_linear_small_m(x, w, s, reduce="atomic")
