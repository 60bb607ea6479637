"""The decode-size fused MoE (glm_ray/kernels/cuda/moe_decode.py) under TRITON_INTERPRET=1 on tiny shapes,
against the torch references and the grouped `fused_moe_triton`.

Tolerances (as tests/kernels/test_cuda_backend_cpu.py's interpreter MoE tests):
* fp8 with fp32 activations: rel err <= 1e-5 — the same quantizer op order (`_fp8_group_quant`) and
  fp32 stage outputs, so only fp32 summation order differs (a 1x128 re-quantization flip would cost
  ~1e-3 and fail).
* fp8 with bf16 activations: the outputs are rounded to bf16, so fp32-order differences can flip the
  last bit of a few elements (one flip is ~1e-4 rel at these sizes; the grouped path differs from the
  reference by that much): we check every element within one bf16 ulp (2^-7 relative) instead.
* bf16: rel err <= 1e-2 against the bf16 reference (which rounds h, silu and the intermediate to bf16);
  against the grouped kernel (same fp32 interpreter math, another summation order) within one bf16 ulp.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray.kernels.torch_ref import fused_moe as ref_fused_moe
from glm_ray.kernels.torch_ref import quant_ops as ref
from tests.kernels.cases import assert_within_one_bf16_ulp, grouped_moe, interpreted, moe_case, rel_err

E, D = 8, 256


@pytest.fixture(scope="module")
def md():
    return interpreted("moe_decode")


def _case(fmt, t, i, k, *, hp=0, ip=0, dtype=torch.bfloat16, seed=0):
    c = moe_case(t, D - hp, i, E, k, fmt, hidden_pad=hp, intermediate_pad=ip, gate_scale=4.0, x_scale=2.0,
                 dtype=dtype, seed=seed)
    ids = c.topk_ids
    assert all(len(set(r)) == k for r in ids.tolist())              # distinct within a token (top-k)
    if t > 1:
        assert len(set(ids.reshape(-1).tolist())) < t * k           # ... but repeated across tokens
    return c


def _decode(md, fmt, c, config=None, **kw):
    return md.fused_moe_decode(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w_mode=fmt, w13_scale=c.s13,
                               w2_scale=c.s2, hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad,
                               config=config, **kw)


def _ref(fmt, c, **kw):
    if fmt == "bf16":
        return ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, intermediate_pad=c.intermediate_pad,
                             swiglu_limit=kw.get("swiglu_limit"))
    return ref.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids,
                                   hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)


CASES = [
    # fmt, T, I, K, hidden_pad, inter_pad, x dtype, kwargs
    ("bf16", 1, 128, 2, 0, 0, torch.bfloat16, {}),
    ("bf16", 5, 192, 4, 0, 64, torch.bfloat16, {"swiglu_limit": 7.0}),
    ("fp8", 3, 128, 2, 0, 0, torch.float32, {"swiglu_limit": 7.0}),
    ("fp8", 5, 192, 4, 56, 64, torch.float32, {"act_ue8m0": True}),
    ("fp8", 3, 192, 4, 0, 64, torch.bfloat16, {}),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # sigmoid(-huge) = 0
@pytest.mark.parametrize("fmt,t,i,k,hp,ip,dt,kw", CASES)
def test_decode_moe_matches_reference_and_grouped(md, fmt, t, i, k, hp, ip, dt, kw):
    c = _case(fmt, t, i, k, hp=hp, ip=ip, dtype=dt)
    y = _decode(md, fmt, c, **kw)
    assert y.shape == c.x.shape and y.dtype == c.x.dtype
    r, g = _ref(fmt, c, **kw), grouped_moe(c, fmt, **kw)
    if fmt == "bf16":
        assert rel_err(y, r) <= 1e-2, rel_err(y, r)
        assert_within_one_bf16_ulp(y, g)
    elif dt == torch.float32:
        assert rel_err(y, r) <= 1e-5, rel_err(y, r)
        assert rel_err(y, g) <= 1e-5, rel_err(y, g)
    else:
        assert_within_one_bf16_ulp(y, r)
        assert_within_one_bf16_ulp(y, g)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_decode_moe_clamp_is_live(md):
    """|gate| >> limit at these inputs: the clamped result is far from the unclamped one."""
    c = _case("bf16", 3, 128, 2)
    assert rel_err(_decode(md, "bf16", c), _decode(md, "bf16", c, swiglu_limit=7.0)) > 0.1


@pytest.mark.parametrize("bn1,ue8m0", [(16, False), (32, True)])
def test_decode_moe_fp8_narrow_stage1_tiles_give_the_requant_bits(md, bn1, ue8m0):
    """fp8 with BN1 < 128 (an fp32 intermediate quantized by stage 2) == BN1 = 128 (stage 1 re-quantizes),
    bit for bit: the same quantizer sees the same fp32 values (I = 192: a ragged last group too)."""
    c = _case("fp8", 3, 192, 4, ip=64, dtype=torch.float32)
    base = dict(bk1=256, warps1=4, stages1=2, bn2=32, bk2=256, warps2=4, stages2=2)
    wide = _decode(md, "fp8", c, act_ue8m0=ue8m0, config=md.DecodeConfig(bn1=128, **base))
    narrow = _decode(md, "fp8", c, act_ue8m0=ue8m0, config=md.DecodeConfig(bn1=bn1, **base))
    assert torch.equal(narrow, wide)
    assert rel_err(narrow, _ref("fp8", c, act_ue8m0=ue8m0)) <= 1e-5


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_decode_moe_other_tiles(md, fmt):
    """Tiles other than the heuristic's: several 128-groups per K step in both stages (fp8: G = 2 scale
    groups per tile), a stage-2 tile narrower than a w2 scale block, one pipeline stage."""
    c = _case(fmt, 3, 192, 4, ip=64, dtype=torch.float32)
    cfg = md.DecodeConfig(bn1=128 if fmt == "fp8" else 32, bk1=256, warps1=4, stages1=1, bn2=32, bk2=256, warps2=4,
                          stages2=2)
    y = _decode(md, fmt, c, config=cfg)
    want = _decode(md, fmt, c)                                      # the heuristic's tiles
    assert rel_err(y, want) <= 1e-5, rel_err(y, want)
    assert rel_err(y, _ref(fmt, c)) <= 1e-5                         # fp32 activations and weights


def test_decode_config_is_shape_only_and_valid(md):
    for w_mode in ("bf16", "fp8"):
        for t in (1, 2, 4, 8, 16, 32, 64):
            for k, d, i in ((4, 2048, 1536), (8, 6144, 2048), (2, 256, 192)):
                cfg = md.decode_config(w_mode, t, k, d, i)
                assert cfg == md.decode_config(w_mode, t, k, d, i)
                for bn, bk in ((cfg.bn1, cfg.bk1), (cfg.bn2, cfg.bk2)):
                    assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and bk >= 128
                if w_mode == "fp8":
                    assert 128 % cfg.bn1 == 0 and 128 % cfg.bn2 == 0
    # too few pairs for 128-wide stage-1 tiles to cover 132 SMs: narrower tiles (fp32 intermediate)
    assert md.decode_config("fp8", 1, 4, 2048, 1536).bn1 == 32
    assert md.decode_config("fp8", 8, 4, 2048, 1536).bn1 == 128


def test_decode_moe_empty_and_bad_mode(md):
    c = _case("bf16", 1, 128, 2)
    y = md.fused_moe_decode(c.x[:0], c.w13, c.w2, c.topk_weights[:0], c.topk_ids[:0], w_mode="bf16")
    assert y.shape == (0, c.x.shape[1])
    with pytest.raises(ValueError, match="w_mode"):
        md.fused_moe_decode(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w_mode="mxfp4")
