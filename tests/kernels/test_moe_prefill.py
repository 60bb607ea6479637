"""The prefill-size block-FP8 MoE (glm_ray/kernels/cuda/moe_prefill.py) under TRITON_INTERPRET=1 on small shapes
(E=4, D=256, I=256, top-2, T up to 40, experts left empty, clamped SwiGLU on and off, UE8M0 scales, padded
D / I), in both operand forms (pointer tiles and TMA tensor descriptors), against the torch reference, the old
grouped `fused_moe_triton`, and the dispatch in `CudaKernels.fused_moe_block_fp8`.

Tolerances (as tests/kernels/test_cuda_backend_cpu.py's interpreter FP8 MoE tests): rel err <= 1e-5 with fp32
activations (the same quantizer op order and fp32 stage outputs; only the fp32 rounding of the folded scale
a_s * w_s and the summation order differ, while one 1x128 re-quantization flip would cost ~1e-3); with bf16
activations every element within one bf16 ulp (2^-7 relative) of the old grouped path.
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
from glm_ray.kernels.cuda.layout import TileConfig
from glm_ray.kernels.torch_ref import quant_ops as ref
from glm_ray.kernels.torch_ref.fp8 import per_token_group_quant_fp8
from tests.kernels.cases import assert_within_one_bf16_ulp, grouped_moe, interpreted, moe_case, rel_err

E, D, I, K = 4, 256, 256, 2


@pytest.fixture(scope="module")
def mp():
    return interpreted("moe_prefill")


def _case(t, *, d=D, i=I, hp=0, ip=0, dtype=torch.float32, seed=0, empty=()):
    """A fp8 case; `empty` experts get no token (their slots are moved onto the others, still distinct)."""
    c = moe_case(t, d, i, E, K, "fp8", hidden_pad=hp, intermediate_pad=ip, gate_scale=4.0, x_scale=2.0, dtype=dtype,
                 seed=seed)
    if empty:
        live = [e for e in range(E) if e not in empty]
        assert len(live) >= K
        g = torch.Generator().manual_seed(seed + 7)
        c.topk_ids = torch.stack([torch.tensor(live)[torch.randperm(len(live), generator=g)[:K]] for _ in range(t)])
    return c


def _cfg(bm, bn2=128, tma=False, warps=4, stages=2, persistent=0):
    return (TileConfig(bm, 256, 128, warps, stages, tma=tma, persistent=persistent),
            TileConfig(bm, bn2, 128, warps, stages, tma=tma, persistent=persistent))


def _prefill(mp, c, configs=None, **kw):
    return mp.fused_moe_prefill(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w13_scale=c.s13, w2_scale=c.s2,
                                hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, configs=configs, **kw)


def _grouped(c, **kw):
    return grouped_moe(c, "fp8", **kw)


def _ref(c, **kw):
    return ref.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids,
                                   hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)


CASES = [
    # T, config (BM, BN2, TMA), hidden_pad, inter_pad, empty experts, kwargs
    (1, (16, 128, False), 0, 0, (), {}),
    (7, (16, 64, False), 0, 0, (1,), {"swiglu_limit": 1.0}),
    (40, (32, 256, False), 0, 0, (0, 3), {}),
    (40, (16, 128, True), 0, 0, (2,), {"swiglu_limit": 0.5}),
    (23, (32, 256, True), 0, 0, (), {"act_ue8m0": True}),
    (17, (16, 128, False), 56, 96, (1,), {}),           # D = 200 of 256, I = 160 of 256: masked tiles
    (17, (16, 256, True), 56, 96, (), {"swiglu_limit": 1.0}),
    (12, (64, 128, False), 0, 0, (3,), {}),
]
PERSISTENT_CASES = [
    # T, config (BM, BN2, TMA), hidden_pad, inter_pad, empty experts, kwargs, programs (the grid: an "SM" each)
    (40, (16, 128, False), 0, 0, (2,), {"swiglu_limit": 0.5}, 1),    # one program walks every tile
    (40, (16, 64, True), 0, 0, (), {}, 3),                           # tiles not a multiple of the programs
    (17, (16, 256, True), 56, 96, (1,), {"act_ue8m0": True}, 2),     # masked tiles
]


@pytest.mark.parametrize("t,cfg,hp,ip,empty,kw", CASES)
def test_prefill_moe_matches_reference_and_grouped(mp, t, cfg, hp, ip, empty, kw):
    c = _case(t, d=D - hp, i=I - ip, hp=hp, ip=ip, empty=empty, seed=t)
    bm, bn2, tma = cfg
    y = _prefill(mp, c, _cfg(bm, bn2, tma), **kw)
    assert y.shape == c.x.shape and y.dtype == c.x.dtype
    assert rel_err(y, _ref(c, **kw)) <= 1e-5, rel_err(y, _ref(c, **kw))
    assert rel_err(y, _grouped(c, **kw)) <= 1e-5, rel_err(y, _grouped(c, **kw))


@pytest.mark.parametrize("t,cfg,hp,ip,empty,kw,programs", PERSISTENT_CASES)
def test_persistent_programs_stride_over_the_used_tiles(mp, monkeypatch, t, cfg, hp, ip, empty, kw, programs):
    """`TileConfig.persistent`: a grid of `programs` (one an SM, the SM count set to `programs`) walks every used
    tile of both kernels in its flattened loop — the result equals the one-program-a-tile launch exactly (the
    same tiles, the same math) and the reference."""
    c = _case(t, d=D - hp, i=I - ip, hp=hp, ip=ip, empty=empty, seed=t + programs)
    bm, bn2, tma = cfg
    grids = []
    monkeypatch.setattr(mp, "num_sms", lambda device: programs)
    real_grid = mp._grid
    monkeypatch.setattr(mp, "_grid", lambda *a: grids.append(real_grid(*a)) or grids[-1])
    y = _prefill(mp, c, _cfg(bm, bn2, tma, persistent=1), **kw)
    assert grids == [(programs,), (programs,)]                        # up, down: fewer programs than tiles
    assert torch.equal(y, _prefill(mp, c, _cfg(bm, bn2, tma), **kw))
    assert rel_err(y, _ref(c, **kw)) <= 1e-5, rel_err(y, _ref(c, **kw))


def test_prefill_moe_bf16_within_one_ulp_of_grouped_and_default_configs(mp):
    c = _case(33, dtype=torch.bfloat16, empty=(2,), seed=5)
    y = _prefill(mp, c, swiglu_limit=1.0)                       # configs from layout.moe_prefill_configs
    assert y.dtype == torch.bfloat16
    assert_within_one_bf16_ulp(y, _grouped(c, swiglu_limit=1.0))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # sigmoid(-huge) = 0
def test_prefill_clamp_is_applied(mp):
    c = moe_case(8, 128, 128, 4, 2, "fp8", gate_scale=40.0, x_scale=3.0, dtype=torch.float32)
    y = _prefill(mp, c, _cfg(16), swiglu_limit=10.0)
    assert rel_err(_prefill(mp, c, _cfg(16)), y) > 0.1
    assert rel_err(y, _ref(c, swiglu_limit=10.0)) <= 1e-5


def test_sorted_act_quant_rows_are_the_gathered_quantized_tokens(mp):
    from glm_ray.kernels.cuda.moe_align import moe_align_auto
    c = _case(9, d=200, hp=56, empty=(1,), seed=3)
    al = moe_align_auto(c.topk_ids, E, 16)
    em = al.max_blocks * 16
    q, s = mp.sorted_act_quant(c.x, al.sorted_ids, al.num_post_pad, K, em)
    assert q.shape == (em, 256) and s.shape == (2, em)
    npost, p = int(al.num_post_pad), c.topk_ids.numel()
    rq, rs = per_token_group_quant_fp8(c.x)                    # [T, 200] e4m3, [T, 2]
    sid = al.sorted_ids[:npost].long()
    real = sid < p
    tok = sid[real] // K
    assert torch.equal(q[:npost][real][:, :200].view(torch.uint8), rq[tok].view(torch.uint8))
    assert torch.equal(s[:, :npost][:, real], rs[tok].t())
    assert not q[:npost][real][:, 200:].float().any()           # pad columns
    assert not q[:npost][~real].float().any() and not s[:, :npost][:, ~real].any()   # pad rows


def test_configs_table_and_constraints(mp):
    for p, e in [(512, 64), (2048, 64), (32768, 64), (4096, 256), (65536, 256)]:
        c1, c2 = L.moe_prefill_configs(p, e)
        mp.check_configs(c1, c2)
    assert L.moe_prefill_configs(32768, 64)[0].block_m == 64
    for bad in [(TileConfig(64, 128, 128, 8, 3), TileConfig(64, 128, 128, 8, 3)),      # stage 1 BN != 256
                (TileConfig(64, 256, 128, 8, 3), TileConfig(32, 128, 128, 8, 3)),      # BM differs
                (TileConfig(64, 256, 128, 8, 3), TileConfig(64, 96, 128, 8, 3))]:      # stage 2 BN
        with pytest.raises(ValueError):
            mp.check_configs(*bad)


def test_dispatch_takes_the_prefill_kernels_and_falls_back_to_the_grouped_ones(mp, monkeypatch, gpu_check_off, spy):
    """GLM_RAY_CUDA_MOE_PREFILL_ROWS: block-FP8 calls with >= that many pairs per expert run moe_prefill; a
    failure there marks only the prefill op broken and runs the grouped kernels (not the reference)."""
    from glm_ray.kernels.cuda import CudaKernels
    from glm_ray.kernels.cuda import moe_prefill as module
    monkeypatch.setenv("GLM_RAY_CUDA_MOE_PREFILL_ROWS", "4")
    ck = CudaKernels()
    calls = spy(module, "fused_moe_prefill", lambda x, *a, **k: x.shape[0])
    big = _case(16, seed=1, dtype=torch.bfloat16)              # 32 pairs on E = 4: 8 per expert
    small = _case(6, seed=2, dtype=torch.bfloat16)             # 3 per expert

    def run(c):
        return ck.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids)
    assert_within_one_bf16_ulp(run(big), _grouped(big))
    assert calls == [16]
    torch.testing.assert_close(run(small), _grouped(small), rtol=0, atol=0)   # below the threshold: grouped
    assert calls == [16] and not ck.fallbacks and not ck.broken

    def boom(*a, **k):
        raise RuntimeError("simulated Triton compile error")
    monkeypatch.setattr(module, "fused_moe_prefill", boom)
    for _ in range(2):
        torch.testing.assert_close(run(big), _grouped(big), rtol=0, atol=0)
    assert "simulated" in ck.broken["fused_moe_block_fp8_prefill"] and "fused_moe_block_fp8" not in ck.broken
    assert sum(ck.fallbacks.values()) == 2
    monkeypatch.setenv("GLM_RAY_CUDA_MOE_PREFILL_ROWS", "0")
    assert CudaKernels().moe_prefill_rows == 0


def test_long_calls_run_in_token_chunks_with_the_same_result(mp, monkeypatch):
    """Past MAX_PAIRS_PER_CHUNK (token, expert) pairs both MoE paths run consecutive token chunks (bounding their
    [P, I] temporaries): with the bound at 16 pairs (8 tokens at top-2) a 21-token call is 3 chunks, and each path's
    rows equal its one-call result bit for bit (tokens are independent; a chunk's combine sums the same pairs)."""
    from glm_ray.kernels.cuda import triton_kernels as tk
    c = _case(21, seed=5)
    whole_new, whole_old = _prefill(mp, c), _grouped(c)
    calls = []
    real = mp.fused_moe_prefill
    monkeypatch.setattr(tk, "MAX_PAIRS_PER_CHUNK", 16)
    monkeypatch.setattr(mp, "fused_moe_prefill", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    assert torch.equal(real(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w13_scale=c.s13, w2_scale=c.s2), whole_new)
    assert calls == [8, 8, 5]
    calls.clear()
    real_old = tk.fused_moe_triton
    monkeypatch.setattr(tk, "fused_moe_triton", lambda x, *a, **kw: calls.append(x.shape[0]) or real_old(x, *a, **kw))
    assert torch.equal(real_old(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w_mode="fp8", w13_scale=c.s13,
                                w2_scale=c.s2), whole_old)
    assert calls == [8, 8, 5]
