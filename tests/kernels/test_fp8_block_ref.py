"""Block-FP8 references vs hand-computed values (quant_contracts.md §2)."""
import math

import pytest
import torch

from glm_ray.kernels.torch_ref.fp8 import (
    FP8_DTYPE,
    FP8_FNUZ_DTYPE,
    block_fp8_linear,
    ceil_to_ue8m0,
    dequant_block_fp8,
    dequant_per_token_group,
    fp32_pow2_to_e8m0_bytes,
    normalize_e4m3fn_to_e4m3fnuz,
    per_token_group_quant_fp8,
    quant_weight_block,
    quant_weight_ue8m0,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_kblocked,
)


def test_ceil_to_ue8m0_table():
    x = torch.tensor([1.0, 1.5, 0.3, 448.0, 2.0 ** -3, 0.0, 2.0 ** -130, 3.0e-7, 1000.0])
    want = [1.0, 2.0, 0.5, 512.0, 2.0 ** -3, 2.0 ** -126, 2.0 ** -126, 2.0 ** -21, 1024.0]
    assert ceil_to_ue8m0(x).tolist() == want


def test_fp32_pow2_to_e8m0_bytes():
    assert fp32_pow2_to_e8m0_bytes(torch.tensor([1.0, 2.0 ** -22, 0.5, 4.0])).tolist() == [127, 105, 126, 129]
    for bad in (0.75, -1.0, 0.0):
        with pytest.raises(ValueError):
            fp32_pow2_to_e8m0_bytes(torch.tensor([1.0, bad]))


def test_act_quant_hand_table():
    # group 0: amax 7 -> scale 7/448 = 2**-6, q = x * 64 (exact in e4m3)
    # group 1: amax 1 -> scale 1/448; with ue8m0 the scale is 2**-8 (1/448 = 0.00223 -> 0.00390625)
    g0 = torch.zeros(128)
    g0[:4] = torch.tensor([7.0, -3.5, 1.0, 0.5])
    g1 = torch.zeros(128)
    g1[:3] = torch.tensor([1.0, -0.5, 0.25])
    x = torch.cat([g0, g1])[None]                                   # [1, 256]
    q, s = per_token_group_quant_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == (1, 256) and s.shape == (1, 2)
    assert s[0, 0].item() == 2.0 ** -6
    assert s[0, 1].item() == pytest.approx(1.0 / 448.0, rel=1e-7)
    assert q[0, :4].float().tolist() == [448.0, -224.0, 64.0, 32.0]
    assert q[0, 128:131].float().tolist() == [448.0, -224.0, 112.0]
    qu, su = per_token_group_quant_fp8(x, ue8m0=True)
    assert su[0].tolist() == [2.0 ** -6, 2.0 ** -8]
    assert qu[0, 128:131].float().tolist() == [256.0, -128.0, 64.0]


def test_act_quant_zero_group_and_partial_group():
    x = torch.zeros(2, 200)
    x[1, 150] = -3.0                                               # lives in the 72-wide tail group
    q, s = per_token_group_quant_fp8(x)
    assert s.shape == (2, 2)
    assert s[0].tolist() == pytest.approx([1e-10 / 448] * 2, rel=1e-6)
    assert s[1, 1].item() == pytest.approx(3.0 / 448.0, rel=1e-7)
    assert q[1, 150].float().item() == -448.0
    assert torch.count_nonzero(q.float()) == 1


@pytest.mark.parametrize("ue8m0", [False, True])
def test_act_quant_error_bound(ue8m0):
    torch.manual_seed(0)
    x = torch.randn(8, 384) * torch.logspace(-3, 2, 384)
    q, s = per_token_group_quant_fp8(x, ue8m0=ue8m0)
    assert q.float().abs().max() <= 448.0
    if ue8m0:
        raw = x.view(8, 3, 128).abs().amax(-1) / 448.0
        assert (s >= raw).all() and (s < 2 * raw).all()
        assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s)
    err = (dequant_per_token_group(q, s) - x).abs()
    se = s.repeat_interleave(128, -1)
    # e4m3: 3 mantissa bits -> half-ulp 2**-4 relative for normals; subnormal step 2**-9 (half 2**-10)
    bound = torch.maximum(x.abs() * 2.0 ** -4, se * 2.0 ** -10) * (1 + 1e-6)
    assert (err <= bound).all()


def test_act_quant_fnuz_no_nan():
    x = torch.tensor([[300.0, -1000.0, 1.0] + [0.0] * 125])
    q, s = per_token_group_quant_fp8(x, fp8_dtype=FP8_FNUZ_DTYPE)
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().max().item() == 240.0
    q224, _ = per_token_group_quant_fp8(x, fp8_dtype=FP8_FNUZ_DTYPE, fp8_max=224.0)
    assert q224.float().abs().max().item() == 224.0


def test_dequant_block_hand_example():
    w = torch.ones(3, 5).to(FP8_DTYPE)
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    want = torch.tensor([[1, 1, 2, 2, 3], [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]], dtype=torch.float32)
    assert torch.equal(dequant_block_fp8(w, s, (2, 2)), want)
    assert dequant_block_fp8(w, s, (2, 2), torch.bfloat16).dtype == torch.bfloat16
    # non-square block (bn=2 rows, bk=3 cols)
    s23 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    want23 = torch.tensor([[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]], dtype=torch.float32)
    assert torch.equal(dequant_block_fp8(w, s23, (2, 3)), want23)
    w3 = torch.stack([w, w])                                        # [E, N, K] with [E, gn, gk] scales
    assert torch.equal(dequant_block_fp8(w3, torch.stack([s, 2 * s]), (2, 2))[1], 2 * want)


def _block_amax_loop(w, bn, bk):
    n, k = w.shape
    out = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
    return out


def test_quant_weight_block_scales_and_error():
    torch.manual_seed(1)
    w = torch.randn(300, 200) * 0.05
    w[:128, :128] *= 100
    q, s = quant_weight_block(w)
    assert q.dtype == FP8_DTYPE and q.shape == (300, 200) and s.shape == (3, 2)
    torch.testing.assert_close(s, _block_amax_loop(w, 128, 128) / 448.0, rtol=1e-7, atol=0)
    err = (dequant_block_fp8(q, s) - w).abs()
    se = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, se * 2.0 ** -10) * (1 + 1e-6)).all()


def test_quant_weight_block_exact_when_representable():
    # a block whose amax is 448 has scale exactly 1 -> e4m3-representable values survive exactly
    w = torch.tensor([448.0, -448.0, 0.5, 3.0, 240.0, -0.015625]).repeat(128 * 128 // 6 + 1)[:128 * 128]
    w = w.view(128, 128)
    q, s = quant_weight_block(w)
    assert s.item() == 1.0 and torch.equal(q.float(), w)


def test_quant_weight_ue8m0():
    w = torch.zeros(256, 384)
    w[:128, :128] = 300.0                      # 300/448 = 0.67 -> 1.0
    w[128:, 128:256] = 1.0                     # 1/448 -> 2**-8
    # block (0, 2) and (1, 0), (1, 2) stay all-zero -> amax clamp 1e-4: 1e-4/448 = 2.2e-7 -> 2**-22
    q, s = quant_weight_ue8m0(w, (128, 128))
    assert s.shape == (2, 3)
    assert s.tolist() == [[1.0, 2.0 ** -22, 2.0 ** -22], [2.0 ** -22, 2.0 ** -8, 2.0 ** -22]]
    assert q[0, 0].float().item() == 288.0     # 300 rounds to 288 on the e4m3 grid (step 32 in [256, 512))
    assert q[200, 200].float().item() == 256.0
    qf, sf = quant_weight_block(w, ue8m0=False)
    assert sf[0, 0].item() == pytest.approx(300.0 / 448.0)


def test_quant_weight_block_batched_matches_per_expert():
    torch.manual_seed(2)
    w = torch.randn(3, 130, 260)
    q, s = quant_weight_block(w)
    assert s.shape == (3, 2, 3)
    for e in range(3):
        qe, se = quant_weight_block(w[e])
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


@pytest.mark.parametrize("n,k", [(256, 256), (200, 256), (130, 200)])
def test_w8a8_matmul_forms_agree(n, k):
    torch.manual_seed(3)
    x = torch.randn(5, k)
    wq, ws = quant_weight_block(torch.randn(n, k) * 0.02)
    xq, xs = per_token_group_quant_fp8(x)
    a = w8a8_block_fp8_matmul(xq, xs, wq, ws, out_dtype=torch.float32)
    b = w8a8_block_fp8_matmul_kblocked(xq, xs, wq, ws)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    c = block_fp8_linear(x, wq, ws, out_dtype=torch.float32)
    torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)
    # and close to the unquantized product (fp8 noise on both operands)
    ref = x @ dequant_block_fp8(wq, ws).T
    assert (c - ref).norm() / ref.norm() < 0.05


def test_block_fp8_linear_modes_hand_example():
    # x = [1.0, 1.03]: scale 1.03/448, 1.0/scale = 434.95 -> e4m3 448 (step 32) -> dequant 1.03
    x = torch.tensor([[1.0, 1.03]])
    w = torch.eye(2).to(FP8_DTYPE)
    s = torch.ones(1, 1)
    y8 = block_fp8_linear(x, w, s, out_dtype=torch.float32)
    y16 = block_fp8_linear(x, w, s, out_dtype=torch.float32, mode="w8a16")
    assert y8[0].tolist() == pytest.approx([1.03, 1.03], rel=1e-6)
    assert y16[0].tolist() == pytest.approx([1.0, 1.03], rel=1e-6)
    with pytest.raises(ValueError):
        block_fp8_linear(x, w, s, mode="w4a4")


def test_block_fp8_linear_shapes_dtypes_and_prequant():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    wq, ws = quant_weight_block(torch.randn(200, 256) * 0.02)
    bias = torch.randn(200)
    y = block_fp8_linear(x, wq, ws, bias=bias)
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    xq, xs = per_token_group_quant_fp8(x)
    yp = block_fp8_linear((xq, xs), wq, ws, bias=bias)
    assert yp.dtype == torch.bfloat16 and torch.equal(yp, y)


def test_normalize_fnuz_roundtrip_value():
    torch.manual_seed(5)
    wq, ws = quant_weight_block(torch.randn(128, 128))
    wq = wq.clone()
    wq.view(torch.int8)[0, 0] = -128                               # e4m3fn -0
    wz, sz = normalize_e4m3fn_to_e4m3fnuz(wq, ws)
    assert wz.dtype == FP8_FNUZ_DTYPE and not torch.isnan(wz.float()).any()
    torch.testing.assert_close(dequant_block_fp8(wz, sz), dequant_block_fp8(wq, ws), rtol=0, atol=0)
