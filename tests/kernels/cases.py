"""Case builders shared by the cuda-backend tests (CPU interpreter + GPU) and scripts/bench_kernels.py:
checkpoint-format expert weights (per-half block-FP8 scales, packed MXFP4) with the padding layout of
quant_contracts.md §4.6, routings, chunked-KDA inputs, the error metrics, and (tests only) the interpreted Triton module
fixture body. Pure torch at import; Triton and pytest only inside `interpreted`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm_ray.kernels.torch_ref.fp8 import quant_weight_block
from glm_ray.kernels.torch_ref.mxfp4 import quant_mxfp4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (the tests' tolerance metric)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


ULP_BF16 = 2.0 ** -7                 # one bf16 ulp, relative to the value, at worst


def assert_within_one_bf16_ulp(y: torch.Tensor, r: torch.Tensor) -> None:
    """Every element of y within one bf16 ulp of r (relative), plus 1e-6 of r's largest magnitude."""
    y, r = y.float(), r.float()
    bound = ULP_BF16 * r.abs() + 1e-6 * r.abs().max()
    assert ((y - r).abs() <= bound).all(), float(((y - r).abs() / bound).max())


def interpreted(module: str):
    """`glm_ray.kernels.cuda.<module>` with its Triton kernels interpreted, for a CPU test's fixture; skips
    without triton, or when triton was imported before TRITON_INTERPRET=1 could be set (a GPU machine, an
    earlier import): the interpreter must be on when triton itself is imported, so the test modules set it
    at collection time on machines without a GPU."""
    import importlib
    import os

    import pytest
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (GPU machine or earlier import)")
    mod = importlib.import_module(f"glm_ray.kernels.cuda.{module}")
    if not mod.INTERPRET:
        pytest.skip(f"{module} was imported in compiled mode")
    return mod


def grouped_moe(c: "MoECase", w_mode: str, **kw) -> torch.Tensor:
    """A case through the grouped `fused_moe_triton` (the older cuda-backend MoE both newer kernels are
    checked against)."""
    from glm_ray.kernels.cuda import triton_kernels as tk
    return tk.fused_moe_triton(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w_mode=w_mode, w13_scale=c.s13,
                               w2_scale=c.s2, hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)


def routing(t: int, e: int, k: int, *, seed: int = 0, device="cpu", skew: float = 0.0):
    """Random top-k routing without repeats: (weights fp32 [T, K] summing to 1, ids int64 [T, K]).
    `skew` > 0 concentrates tokens on low expert ids (hot experts)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(t, e, generator=g) - skew * torch.arange(e, dtype=torch.float32) / e
    ids = logits.topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=g) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(device), ids.to(device)


@dataclass
class MoECase:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    hidden_pad: int
    intermediate_pad: int


def _pad_halves(w13: torch.Tensor, inter: int, ipad: int, hpad: int) -> torch.Tensor:
    """[E, 2I, D] -> [E, 2(I+ipad), D+hpad]: [gate ; 0 ; up ; 0] rows, zero columns appended."""
    g, u = w13[:, :inter], w13[:, inter:]
    g, u = F.pad(g, (0, hpad, 0, ipad)), F.pad(u, (0, hpad, 0, ipad))
    return torch.cat([g, u], 1)


def moe_case(t: int, d: int, inter: int, e: int, k: int, fmt: str, *, device="cpu", dtype=torch.bfloat16,
             hidden_pad: int = 0, intermediate_pad: int = 0, gate_scale: float = 1.0, seed: int = 0,
             x_scale: float = 1.0) -> MoECase:
    """Routed-expert operands in the runtime layout of `fmt` ("bf16" | "fp8" | "mxfp4").
    Weights ~ N(0, 1/fan_in) (gate rows times `gate_scale`, to drive |gate| past a swiglu_limit)."""
    g = torch.Generator(device=device).manual_seed(seed)                        # built on `device` (GPU: fast)
    w13 = torch.randn(e, 2 * inter, d, generator=g, device=device) * d ** -0.5
    w13[:, :inter] *= gate_scale
    w2 = torch.randn(e, d, inter, generator=g, device=device) * inter ** -0.5
    x = (torch.randn(t, d, generator=g, device=device) * x_scale).to(dtype)
    tw, ids = routing(t, e, k, seed=seed + 1, device=device)
    w13p = _pad_halves(w13, inter, intermediate_pad, hidden_pad)                 # [E, 2I', D']
    w2p = F.pad(w2, (0, intermediate_pad, 0, hidden_pad))                       # [E, D', I']
    s13 = s2 = None
    if fmt == "bf16":
        w13r, w2r = w13p.to(dtype), w2p.to(dtype)
    elif fmt == "fp8":
        half = inter + intermediate_pad
        qg, sg = quant_weight_block(w13p[:, :half])
        qu, su = quant_weight_block(w13p[:, half:])
        w13r, s13 = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
        w2r, s2 = quant_weight_block(w2p)
    elif fmt == "mxfp4":
        w13r, s13 = quant_mxfp4(w13p, "even")
        w2r, s2 = quant_mxfp4(w2p, "even")
    else:
        raise ValueError(fmt)
    del w13, w2, w13p, w2p
    return MoECase(x, w13r, w2r, s13, s2, tw, ids, hidden_pad, intermediate_pad)


def dense_fp8_case(m: int, n: int, k: int, *, device="cpu", dtype=torch.bfloat16, seed: int = 0):
    """(x [M, K] dtype, w e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)])."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    wq, ws = quant_weight_block(w)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    return x, wq, ws


def kda_case(B: int, L: int, H: int, dk: int, dv: int, seed: int):
    """Chunked-KDA inputs (kernels/torch_ref/kda.py's layout): q, k [B, L, H, dk], v [B, L, H, dv], log-decay gate
    in (-5, 0) [B, L, H, dk] (GLM-5.3-Flash's lower bound), beta in (0, 1) [B, L, H], a state [B, H, dk, dv]."""
    g = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g)
    gate = -5.0 * torch.sigmoid(r(B, L, H, dk))
    return r(B, L, H, dk), r(B, L, H, dk), r(B, L, H, dv), gate, torch.sigmoid(r(B, L, H)), 0.5 * r(B, H, dk, dv)
