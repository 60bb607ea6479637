"""MXFP4 references vs the worked tables of quant_contracts.md §3."""
import math

import pytest
import torch

from glm_ray.kernels.torch_ref.mxfp4 import (
    canonical_scale_mode,
    dequant_mxfp4,
    e2m1_to_f32,
    e8m0_to_f32,
    f32_to_e2m1,
    mx_scale_exponent,
    mxfp4_linear,
    pack_fp4,
    qdq_mxfp4,
    quant_mxfp4,
    unpack_fp4,
)

DOC_LUT = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def test_decode_table():
    v = e2m1_to_f32(torch.arange(16, dtype=torch.uint8))
    assert v.tolist() == DOC_LUT
    assert torch.signbit(v[8]).item() and not torch.signbit(v[0]).item()


def test_e2m1_rne_ties():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert f32_to_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]                 # 0, 1, 1, 2, 2, 4, 4
    assert e2m1_to_f32(f32_to_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert e2m1_to_f32(f32_to_e2m1(-ties)).tolist() == [-0., -1, -1, -2, -2, -4, -4]
    # legacy Triton kernels: ties away from zero
    assert e2m1_to_f32(f32_to_e2m1(ties, "half_away")).tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]


def test_e2m1_non_ties_and_saturation():
    y = torch.tensor([0.2, 0.3, 0.74, 0.76, 2.9, 4.9, 5.1, 6.0, 100.0, float("inf"), -0.1, -7.0])
    assert e2m1_to_f32(f32_to_e2m1(y)).tolist() == [0, 0.5, 0.5, 1, 3, 4, 6, 6, 6, 6, -0., -6]
    assert f32_to_e2m1(torch.tensor([-0.1, -6.0, 6.0])).tolist() == [0x8, 0xF, 0x7]
    with pytest.raises(ValueError):
        f32_to_e2m1(y, "stochastic")


def test_pack_nibble_order():
    assert pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    assert pack_fp4(torch.tensor([[0xF, 0x0, 0x3, 0xC]], dtype=torch.uint8)).tolist() == [[0x0F, 0xC3]]
    assert unpack_fp4(torch.tensor([0x21, 0xC3], dtype=torch.uint8)).tolist() == [1, 2, 3, 0xC]
    c = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(c)), c)
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_e8m0_decode_specials():
    b = torch.tensor([127, 128, 126, 134, 0, 255, 1, 254], dtype=torch.uint8)
    v = e8m0_to_f32(b)
    assert v[:4].tolist() == [1.0, 2.0, 0.5, 128.0]
    assert v[4].view(torch.int32).item() == 0x00400000 and v[4].item() == 2.0 ** -127
    assert math.isnan(v[5].item())
    assert v[6].item() == 2.0 ** -126 and v[7].item() == 2.0 ** 127
    assert torch.equal(e8m0_to_f32(b[:4].view(torch.float8_e8m0fnu)), v[:4])


# quant_contracts.md §3.4 worked table (unbiased exponent), amax = 3, 5, 6, 6.5, 7, 8, 12
AMAX = [3.0, 5.0, 6.0, 6.5, 7.0, 8.0, 12.0]
DOC_TABLE = {
    "round_up": [-1, 0, 0, 1, 1, 1, 1],
    "even": [-1, 0, 0, 0, 1, 1, 1],
    "round_down": [-1, 0, 0, 0, 0, 1, 1],
    # ceil_pow2(amax / 4): .75->1, 1.25->2, 1.5->2, 1.625->2, 1.75->2, 2->2, 3->4
    "ceil": [0, 1, 1, 1, 1, 1, 2],
}


@pytest.mark.parametrize("mode", sorted(DOC_TABLE))
def test_scale_mode_table(mode):
    got = mx_scale_exponent(torch.tensor(AMAX), mode).to(torch.int32) - 127
    assert got.tolist() == DOC_TABLE[mode]


def test_scale_mode_edges_and_aliases():
    for mode in DOC_TABLE:
        assert mx_scale_exponent(torch.tensor([0.0]), mode).item() == 0          # clamp at 0
    big = torch.tensor([3.0e38])                                                 # 1.76 * 2**127
    assert mx_scale_exponent(big, "round_down").item() == 125 + 127
    assert mx_scale_exponent(big, "round_up").item() == 126 + 127                # 3e38/6 = 1.76 * 2**125 -> 2**126
    for mode in DOC_TABLE:
        assert mx_scale_exponent(torch.tensor([float("inf")]), mode).item() == 254   # clamp at 254
    assert canonical_scale_mode("even_round") == "even" and canonical_scale_mode("floor") == "round_down"
    with pytest.raises(ValueError):
        mx_scale_exponent(big, "nearest")


def test_quant_hand_block():
    # block 0 (mode even): amax 6 -> exponent 0 (byte 127), codes by RNE
    b0 = torch.zeros(32)
    b0[:8] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.25, 0.25, -6.0, 0.75])
    # block 1: amax 6.5 -> even: exponent 0 (6.5 saturates to 6); round_up: exponent +1 (x/2)
    b1 = torch.zeros(32)
    b1[:2] = torch.tensor([6.5, 1.0])
    x = torch.cat([b0, b1])[None]                                                  # [1, 64]
    p, s = quant_mxfp4(x, "even")
    assert p.shape == (1, 32) and s.shape == (1, 2) and p.dtype == torch.uint8
    assert s.tolist() == [[127, 127]]
    # codes: 6->7, 5->6, 3.5->6, 2.5->4, 1.25->2, .25->0, -6->15, .75->2 ; bytes = hi<<4 | lo
    assert p[0, :4].tolist() == [0x67, 0x46, 0x02, 0x2F]
    assert p[0, 16].item() == 0x27                                                 # (6.5 -> 6, 1.0 -> 1)
    p2, s2 = quant_mxfp4(x, "round_up")
    assert s2.tolist() == [[127, 128]]
    assert p2[0, 16].item() == 0x15                                                # (3.25 -> 3, 0.5)
    d = dequant_mxfp4(p2, s2)
    assert d[0, 32:34].tolist() == [6.0, 1.0]
    assert d[0, :8].tolist() == [6.0, 4.0, 4.0, 2.0, 1.0, 0.0, -6.0, 1.0]


@pytest.mark.parametrize("mode,bound", [("round_up", 1.0), ("ceil", 0.5), ("even", 1.0), ("round_down", 2.0)])
def test_qdq_error_bound(mode, bound):
    # |y| = |x|/scale stays <= 6 (round_up), <= 4 (ceil), < 7 (even), < 8 (round_down); the largest
    # grid step above 4 is 2, so the error is <= bound * scale (saturation included).
    torch.manual_seed(0)
    x = torch.randn(16, 256) * torch.logspace(-4, 3, 256)
    p, s = quant_mxfp4(x, mode)
    err = (dequant_mxfp4(p, s) - x).abs()
    scale = e8m0_to_f32(s).repeat_interleave(32, -1)
    assert (err <= bound * scale).all()
    rel = (qdq_mxfp4(x, mode) - x).norm() / x.norm()
    assert rel < 0.2


def test_quant_batched_and_bad_shape():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64)
    p, s = quant_mxfp4(x)
    assert p.shape == (2, 3, 32) and s.shape == (2, 3, 2)
    p1, s1 = quant_mxfp4(x[1])
    assert torch.equal(p[1], p1) and torch.equal(s[1], s1)
    with pytest.raises(ValueError):
        quant_mxfp4(torch.randn(2, 48))


def test_mxfp4_linear():
    torch.manual_seed(2)
    w = torch.randn(48, 128)
    wp, ws = quant_mxfp4(w)
    x = torch.randn(3, 128)
    y16 = mxfp4_linear(x, wp, ws, act_mode=None)
    torch.testing.assert_close(y16, x @ dequant_mxfp4(wp, ws).T)
    y44 = mxfp4_linear(x, wp, ws, act_mode="even")
    torch.testing.assert_close(y44, qdq_mxfp4(x) @ dequant_mxfp4(wp, ws).T)
    assert not torch.equal(y44, y16)
