"""The `cuda` (Hopper) kernel backend against the torch references, on the GPU (skipped without CUDA).

Shapes are those of shared/configs/glm5-flash-31b.json (hidden 2048, q_lora 768, 32 heads x 256,
64 experts top-4, moe_inter 1536) and glm5-slice-6l.json (hidden 6144, q_lora 2048, 64 heads x 256,
moe_inter 2048, top-8; its 256 experts are cut to 16 here: per-expert GEMM shapes are what the kernels
see, and the fp32 reference dequantizes every expert). The M grid is trimmed per op for time (each new
Triton tile config is a compile).

Tolerances (relative Frobenius error vs the reference, `rel_err`), and why:
* block_fp8_linear 5e-3: both sides use bit-identical FP8 operands (the quantizer is checked
  separately); what remains is fp32 summation order and the bf16 output rounding (2^-9 per element,
  ~1e-3 in norm).
* fused_moe bf16 1e-2: the bf16 reference rounds h, silu(g) and the product to bf16; the kernel rounds
  only the stage-2 input and each pair's output (a few x 2^-9).
* fused_moe_block_fp8 1e-2 / fused_moe_mxfp4 1.5e-2: identical quantizers, but a different fp32
  summation order can flip a re-quantized stage-2 input by one FP8 (2^-3) or E2M1 step on a few
  elements; plus the bf16 per-pair outputs.
Every test also asserts that no op fell back to the reference (`CudaKernels.fallbacks` stays empty).
Set GLM_RAY_KERNEL_REPORT=path.json to dump the measured errors.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray import kernels  # noqa: E402
from glm_ray.kernels.cuda import layout as L  # noqa: E402
from glm_ray.kernels.cuda.testing import dense_fp8_case, moe_case, rel_err  # noqa: E402
from glm_ray.kernels.torch_ref import fused_moe as ref_fused_moe  # noqa: E402
from glm_ray.kernels.torch_ref import quant_ops as ref  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import per_token_group_quant_fp8  # noqa: E402
from glm_ray.kernels.torch_ref.mxfp4 import quant_mxfp4  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
TOL = {"dense": 5e-3, "bf16": 1e-2, "fp8": 1e-2, "mxfp4": 1.5e-2}
REPORT: list[dict] = []

# (name, N, K): dense projections of glm5-slice-6l (slice) and glm5-flash-31b (flash)
DENSE = [
    ("slice.q_b_proj", 16384, 2048, (1, 7, 128, 513, 2048, 8192)),
    ("slice.o_proj", 6144, 16384, (1, 513, 2048)),
    ("slice.kv_a_proj_with_mqa", 576, 6144, (1, 7, 513)),
    ("flash.q_b_proj(K=768 trap)", 8192, 768, (1, 7, 128, 2048)),
    ("flash.o_proj", 2048, 8192, (7, 513)),
    ("K=640 trap", 1024, 640, (1, 513)),
]


def _sm() -> int:
    a, b = torch.cuda.get_device_capability()
    return 10 * a + b


needs_sm90 = pytest.mark.skipif(torch.cuda.is_available() and _sm() < 90, reason="FP8 kernels need sm_90")


@pytest.fixture(scope="module")
def ck():
    from glm_ray.kernels.cuda import CudaKernels
    k = CudaKernels("scaled_mm")
    if k.tk is None:
        pytest.skip(k.triton_error)
    return k


@pytest.fixture(autouse=True)
def _no_fallbacks(ck):
    ck.fallbacks.clear()
    yield
    assert not ck.fallbacks, f"reference fallbacks: {dict(ck.fallbacks)}"


@pytest.fixture(scope="module", autouse=True)
def _report():
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    path = os.environ.get("GLM_RAY_KERNEL_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)
    worst = {}
    for r in REPORT:
        worst[r["op"]] = max(worst.get(r["op"], 0.0), r["rel_err"])
    print("\n[cuda kernels] worst rel err per op:", {k: f"{v:.2e}" for k, v in worst.items()})


def _record(op, err, tol, **kw):
    REPORT.append({"op": op, "rel_err": err, "tol": tol, **kw})
    assert err <= tol, f"{op} {kw}: rel err {err:.3e} > {tol}"


def test_auto_backend_is_cuda():
    ops = kernels.init_backend("auto", "cuda")
    try:
        assert ops.name == "cuda"
        assert ops.fused_moe.__self__.__class__.__name__ == "CudaKernels"
    finally:
        kernels.init_backend("torch")


# ------------------------------------------------------------------------------- dense FP8

@needs_sm90
@pytest.mark.parametrize("ue8m0", [False, True])
def test_act_quant_bit_exact(ck, ue8m0):
    x = torch.randn(513, 2048 + 64, device=DEV, dtype=BF16) * 4
    q, s = ck.tk.act_quant_fp8(x, ue8m0=ue8m0)
    rq, rs = per_token_group_quant_fp8(x, ue8m0=ue8m0)
    mism = (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean().item()
    assert torch.equal(s, rs)
    _record("act_quant_fp8", mism, 1e-4, ue8m0=ue8m0, note="fraction of fp8 bytes differing from the reference")


@needs_sm90
@pytest.mark.parametrize("name,n,k,ms", DENSE, ids=[d[0] for d in DENSE])
def test_block_fp8_linear_scaled_mm(ck, name, n, k, ms):
    _, w, s = dense_fp8_case(1, n, k, device=DEV)
    wv, sv, meta = ck.block_fp8_linear_prepare(w, s, (128, 128))
    assert wv.shape == w.shape and meta == {"n_pad": L.round_up(n, 128), "k_pad": L.round_up(k, 512)}
    assert ck._selfcheck.get((meta["k_pad"], w.device.index)), f"_scaled_mm self-check failed at Kp={meta['k_pad']}"
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        y = ck.block_fp8_linear(x, wv, sv, (128, 128), **meta)
        assert y.shape == (m, n) and y.dtype == BF16 and y.is_contiguous()
        r = ref_block_fp8_linear(x, w, s, out_dtype=torch.float32)
        _record("block_fp8_linear[scaled_mm]", rel_err(y, r), TOL["dense"], shape=name, m=m)


@needs_sm90
@pytest.mark.parametrize("k", [640, 768])
def test_scaled_mm_k_trap_regression(ck, k):
    """torch 2.11 `_scaled_mm` blockwise returns garbage, silently, when K/128 % 4 != 0. Record what the
    raw unpadded call does here; our op (K padded to 1024 at prepare) must be right either way."""
    m, n = 64, 1024
    x, w, s = dense_fp8_case(m, n, k, device=DEV)
    r = ref_block_fp8_linear(x, w, s, out_dtype=torch.float32)
    xq, xs = ck.tk.act_quant_fp8(x, col_major_scale=True)
    try:
        raw = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.t(), out_dtype=BF16)
        raw_err = rel_err(raw, r)
    except RuntimeError as e:
        raw_err = float("nan")
        print(f"raw _scaled_mm at K={k} raised: {str(e).splitlines()[0]}")
    REPORT.append({"op": "raw _scaled_mm (unpadded, informational)", "k": k, "rel_err": raw_err, "tol": None})
    wv, sv, meta = ck.block_fp8_linear_prepare(w, s)
    assert meta["k_pad"] == 1024
    _record("block_fp8_linear[K trap]", rel_err(ck.block_fp8_linear(x, wv, sv, **meta), r), TOL["dense"], k=k)
    # and an un-prepared weight (padded per call) gives the same
    _record("block_fp8_linear[K trap, unprepared]", rel_err(ck.block_fp8_linear(x, w, s), r), TOL["dense"], k=k)


@needs_sm90
def test_block_fp8_linear_triton_gemm_and_ue8m0():
    from glm_ray.kernels.cuda import CudaKernels
    kt = CudaKernels("triton")
    for name, n, k, m in [("slice.kv_a_proj_with_mqa", 576, 6144, 7), ("flash.q_b_proj", 8192, 768, 513)]:
        x, w, s = dense_fp8_case(m, n, k, device=DEV)
        wv, sv, meta = kt.block_fp8_linear_prepare(w, s)
        assert meta == {}
        for ue in (False, True):
            y = kt.block_fp8_linear(x, wv, sv, act_ue8m0=ue, **meta)
            r = ref_block_fp8_linear(x, w, s, out_dtype=torch.float32, act_ue8m0=ue)
            _record("block_fp8_linear[triton]", rel_err(y, r), TOL["dense"], shape=name, m=m, ue8m0=ue)
    assert not kt.fallbacks


# ------------------------------------------------------------------------------- fused MoE

FLASH = dict(d=2048, i=1536, e=64, k=4)
SLICE = dict(d=6144, i=2048, e=16, k=8)
MOE = [
    # fmt, geometry, T values, kwargs
    ("bf16", FLASH, (1, 2048), {}),
    ("bf16", SLICE, (7,), {"swiglu_limit": 10.0}),
    ("fp8", FLASH, (1, 2048), {}),
    ("fp8", SLICE, (128,), {"swiglu_limit": 10.0}),
    ("mxfp4", FLASH, (1, 2048), {"act_mode": "even"}),
    ("mxfp4", SLICE, (7,), {"act_mode": "round_up", "swiglu_limit": 10.0}),
]


def _run_moe(ck, fmt, c, **kw):
    if fmt == "bf16":
        return ck.fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, intermediate_pad=c.intermediate_pad, **kw)
    if fmt == "fp8":
        return ck.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids,
                                      hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)
    return ck.fused_moe_mxfp4(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids, hidden_pad=c.hidden_pad,
                              intermediate_pad=c.intermediate_pad, **kw)


def _ref_moe(fmt, c, **kw):
    if fmt == "bf16":
        return ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, intermediate_pad=c.intermediate_pad, **kw)
    if fmt == "fp8":
        return ref.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids,
                                       hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)
    return ref.fused_moe_mxfp4(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids, hidden_pad=c.hidden_pad,
                               intermediate_pad=c.intermediate_pad, **kw)


@pytest.mark.parametrize("fmt,geo,ts,kw", MOE, ids=[f"{m[0]}-{'flash' if m[1] is FLASH else 'slice'}" for m in MOE])
def test_fused_moe_matches_reference(ck, fmt, geo, ts, kw):
    if fmt == "fp8" and _sm() < 90:
        pytest.skip("FP8 kernels need sm_90")
    big = max(ts)
    c = moe_case(big, geo["d"], geo["i"], geo["e"], geo["k"], fmt, device=DEV,
                 gate_scale=8.0 if "swiglu_limit" in kw else 1.0, x_scale=2.0 if "swiglu_limit" in kw else 1.0)
    for t in ts:
        sub = type(c)(c.x[:t], c.w13, c.w2, c.s13, c.s2, c.topk_weights[:t], c.topk_ids[:t], 0, 0)
        t0 = time.perf_counter()
        y = _run_moe(ck, fmt, sub, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        r = _ref_moe(fmt, sub, **kw)
        assert y.shape == sub.x.shape and y.dtype == sub.x.dtype
        _record(f"fused_moe[{fmt}]", rel_err(y, r), TOL[fmt], d=geo["d"], i=geo["i"], e=geo["e"], k=geo["k"], t=t,
                first_call_s=round(dt, 3), **kw)
        if "swiglu_limit" in kw:
            # the clamp is live at these inputs: without it the result moves a lot
            free = {a: b for a, b in kw.items() if a != "swiglu_limit"}
            assert rel_err(_run_moe(ck, fmt, sub, **free), y) > 0.05


@pytest.mark.parametrize("fmt,hp,ip", [("fp8", 128, 128), ("mxfp4", 32, 96), ("bf16", 0, 64)])
def test_fused_moe_padding(ck, fmt, hp, ip):
    if fmt == "fp8" and _sm() < 90:
        pytest.skip("FP8 kernels need sm_90")
    c = moe_case(150, 2048, 1536 - ip, 8, 2, fmt, device=DEV, hidden_pad=hp if fmt != "bf16" else 0,
                 intermediate_pad=ip)
    kw = {"act_mode": "even"} if fmt == "mxfp4" else {}
    _record(f"fused_moe[{fmt}] padded", rel_err(_run_moe(ck, fmt, c, **kw), _ref_moe(fmt, c, **kw)), TOL[fmt],
            hidden_pad=hp, intermediate_pad=ip)


def test_mxfp4_linear(ck):
    for n, k, m in [(3072, 2048, 7), (2048, 1536, 513)]:
        w, s = quant_mxfp4(torch.randn(n, k, device=DEV) * k ** -0.5)
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        for mode in ("even", None):
            y = ck.mxfp4_linear(x, w, s, act_mode=mode)
            r = ref.mxfp4_linear(x.float(), w, s, act_mode=mode)
            _record("mxfp4_linear", rel_err(y, r), TOL["mxfp4"], n=n, k=k, m=m, act_mode=mode)
