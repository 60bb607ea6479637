"""Quantized MoE references (quant_contracts.md §4.6-4.8): an independent per-(token, slot) oracle."""
import pytest
import torch
import torch.nn.functional as F

from glm_ray.kernels.torch_ref.aiter_layout import deinterleave_gate_up_rows, interleave_gate_up_rows
from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, quant_weight_block
from glm_ray.kernels.torch_ref.moe import fused_moe_naive
from glm_ray.kernels.torch_ref.moe_quant import (
    fused_moe_w4a4_mxfp4,
    fused_moe_w8a8_block_fp8,
    qdq_fp8_1x128,
)
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4, qdq_mxfp4, quant_mxfp4

T, D, I, E, K = 6, 128, 64, 4, 2


def _routing(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return w / w.sum(-1, keepdim=True), ids


def _oracle(x, w13, w2, tw, ids, qdq, limit, gate_mode="separated"):
    """Plain loop, gate/up split by `gate_mode`, activations qdq'd before both GEMMs."""
    out = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            e = ids[t, k].item()
            h = qdq(x[t:t + 1]) @ w13[e].T
            g, u = (h[:, :I], h[:, I:]) if gate_mode == "separated" else (h[:, 0::2], h[:, 1::2])
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += tw[t, k] * (qdq(F.silu(g) * u) @ w2[e].T)[0]
    return out


@pytest.fixture(scope="module")
def mx_weights():
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, D) * 0.3
    w2 = torch.randn(E, D, I) * 0.3
    return quant_mxfp4(w13) + quant_mxfp4(w2)


@pytest.mark.parametrize("mode", ["even", "round_up"])
def test_w4a4_matches_oracle(mx_weights, mode):
    w13p, w13s, w2p, w2s = mx_weights
    x = torch.randn(T, D) * 2
    tw, ids = _routing()
    got = fused_moe_w4a4_mxfp4(x, w13p, w13s, w2p, w2s, tw, ids, act_mode=mode, swiglu_limit=10.0)
    want = _oracle(x, dequant_mxfp4(w13p, w13s), dequant_mxfp4(w2p, w2s), tw, ids,
                   lambda a: qdq_mxfp4(a, mode), 10.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_w4a4_variants(mx_weights):
    w13p, w13s, w2p, w2s = mx_weights
    x = torch.randn(T, D)
    tw, ids = _routing(1)
    w13, w2 = dequant_mxfp4(w13p, w13s), dequant_mxfp4(w2p, w2s)
    # W4A16: no activation quant at all == the plain (unquantized-math) MoE on dequantized weights
    a16 = fused_moe_w4a4_mxfp4(x, w13p, w13s, w2p, w2s, tw, ids, act_mode=None)
    torch.testing.assert_close(a16, fused_moe_naive(x, w13, w2, tw, ids), rtol=1e-5, atol=1e-5)
    # stage-1-only quant == fused_moe on qdq(x)
    s1 = fused_moe_w4a4_mxfp4(x, w13p, w13s, w2p, w2s, tw, ids, requant_intermediate=False)
    torch.testing.assert_close(s1, fused_moe_naive(qdq_mxfp4(x), w13, w2, tw, ids), rtol=1e-5, atol=1e-5)
    full = fused_moe_w4a4_mxfp4(x, w13p, w13s, w2p, w2s, tw, ids)
    assert not torch.allclose(full, s1, rtol=1e-5, atol=1e-5)         # the stage-2 requant is real
    assert (full - a16).norm() / a16.norm() < 0.3                      # but only quantization noise


def test_swiglu_limit_active():
    torch.manual_seed(2)
    w13 = torch.randn(E, 2 * I, D)
    w2 = torch.randn(E, D, I) * 0.1
    w13q, w13s = quant_weight_block(w13)
    w2q, w2s = quant_weight_block(w2)
    x = torch.randn(T, D) * 3                                          # |gate| >> 10
    tw, ids = _routing(2)
    lim = fused_moe_w8a8_block_fp8(x, w13q, w13s, w2q, w2s, tw, ids, swiglu_limit=10.0)
    nolim = fused_moe_w8a8_block_fp8(x, w13q, w13s, w2q, w2s, tw, ids, swiglu_limit=None)
    assert not torch.allclose(lim, nolim)
    want = _oracle(x, dequant_block_fp8(w13q, w13s), dequant_block_fp8(w2q, w2s), tw, ids, qdq_fp8_1x128, 10.0)
    torch.testing.assert_close(lim, want, rtol=1e-5, atol=1e-4)


def test_intermediate_pad_is_neutral(mx_weights):
    w13p, w13s, w2p, w2s = mx_weights
    x = torch.randn(T, D)
    tw, ids = _routing(3)
    pad = 64                                                           # zero rows per half / zero cols
    w13, w2 = dequant_mxfp4(w13p, w13s), dequant_mxfp4(w2p, w2s)
    z = torch.zeros(E, pad, D)
    w13_pad = torch.cat([w13[:, :I], z, w13[:, I:], z], 1)             # [gate ; 0 ; up ; 0]
    w2_pad = torch.cat([w2, torch.zeros(E, D, pad)], 2)
    p13, s13 = quant_mxfp4(w13_pad)
    p2, s2 = quant_mxfp4(w2_pad)
    base = fused_moe_w4a4_mxfp4(x, w13p, w13s, w2p, w2s, tw, ids, swiglu_limit=10.0)
    padded = fused_moe_w4a4_mxfp4(x, p13, s13, p2, s2, tw, ids, swiglu_limit=10.0, intermediate_pad=pad)
    torch.testing.assert_close(padded, base, rtol=1e-5, atol=1e-5)


def test_interleaved_rows_give_same_result():
    torch.manual_seed(4)
    w13 = torch.randn(E, 2 * I, D) * 0.3
    w2 = torch.randn(E, D, I) * 0.3
    x = torch.randn(T, D) * 4
    tw, ids = _routing(4)
    q = lambda a: a                                                    # noqa: E731
    sep = _oracle(x, w13, w2, tw, ids, q, 10.0, "separated")
    il = _oracle(x, interleave_gate_up_rows(w13), w2, tw, ids, q, 10.0, "interleave")
    torch.testing.assert_close(sep, il, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(deinterleave_gate_up_rows(interleave_gate_up_rows(w13)), w13)
