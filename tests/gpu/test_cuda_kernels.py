"""The `cuda` (Hopper) kernel backend against the torch references, on the GPU (skipped without CUDA).

Shapes are those of shared/configs/glm5-flash-31b.json (hidden 2048, q_lora 768, 32 heads x 256,
64 experts top-4, moe_inter 1536) and glm5-slice-6l.json (hidden 6144, q_lora 2048, 64 heads x 256,
moe_inter 2048, top-8; its 256 experts are cut to 16 here: per-expert GEMM shapes are what the kernels
see, and the fp32 reference dequantizes every expert). The M grid is trimmed per op for time (each new
Triton tile config is a compile).

Two comparisons per op (relative Frobenius error, `rel_err`):
* tight — against the reference math on the kernel's OWN quantized activations (quant_contracts.md
  §2.2: compare the GEMM on identical FP8 operands, test the quantizer separately). The quantizer is
  checked first: its scales are the IEEE quotient amax / 448 (what the torch reference computes on
  CPU) and its elements are exactly the reference formula applied with those scales.
  dense 4e-3: only fp32 summation order and the bf16 output rounding (2^-9 per element) remain;
  MoE FP8 6e-3: plus the bf16 per-pair outputs and rare re-quantization flips from summation order.
* e2e — against the stock torch reference run on the GPU. There torch computes `amax / 448` as a
  multiply by the rounded reciprocal (CUDA scalar division), so its scales differ from the IEEE
  quotient by 1 ulp in about half of the groups, and since bf16 inputs often land exactly on e4m3
  rounding ties, ~1% of quantized elements round the other way (measured on the H200: dense e2e
  ≤ 7e-3, MoE FP8 e2e ≤ 1.7e-2, as the stage-2 re-quantization amplifies the stage-1 differences).
  Bounds 1.5e-2 (dense) / 3e-2 (MoE FP8).
* fused_moe bf16 1e-2: the bf16 reference rounds h, silu(g) and the product to bf16; the kernel
  rounds only the stage-2 input and each pair's output (a few x 2^-9).
* fused_moe_mxfp4 / mxfp4_linear 1.5e-2: E8M0 scales are powers of two (no division ties); summation
  order can still flip an E2M1 rounding of the re-quantized stage-2 input on a few elements.
Every test also asserts that no op fell back to the reference (`CudaKernels.fallbacks` stays empty).
Set GLM_RAY_KERNEL_REPORT=path.json to dump the measured errors.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray import kernels  # noqa: E402
from glm_ray.kernels.cuda import layout as L  # noqa: E402
from glm_ray.kernels.torch_ref import fused_moe as ref_fused_moe  # noqa: E402
from glm_ray.kernels.torch_ref import quant_ops as ref  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import (  # noqa: E402
    FP8_DTYPE,
    ceil_to_ue8m0,
    dequant_block_fp8,
    dequant_per_token_group,
    per_token_group_quant_fp8,
    w8a8_block_fp8_matmul,
)
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear  # noqa: E402
from glm_ray.kernels.torch_ref.moe_quant import fused_moe_act_qdq  # noqa: E402
from glm_ray.kernels.torch_ref.mxfp4 import quant_mxfp4  # noqa: E402
from tests.kernels.cases import dense_fp8_case, moe_case, rel_err  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
TOL = {"dense": 4e-3, "dense_e2e": 1.5e-2, "bf16": 1e-2, "fp8": 6e-3, "fp8_e2e": 3e-2, "mxfp4": 1.5e-2}
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
        if "rel_err" in r:                      # some records are bit-exactness checks without an error
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
def test_act_quant(ck, ue8m0):
    m, k = 513, 2048 + 64
    x = torch.randn(m, k, device=DEV, dtype=BF16) * 4
    x[3, :128] = 0                                                    # an all-zero group (eps floor)
    q, s = ck.tk.act_quant_fp8(x, ue8m0=ue8m0)
    g = -(-k // 128)
    xg = F.pad(x.float(), (0, g * 128 - k)).view(m, g, 128)
    eps32 = float(torch.tensor(1e-10, dtype=torch.float32))          # the kernel's fp32 eps, exactly
    s_ieee = (xg.abs().amax(-1).double().clamp_min(eps32) / 448.0).float()
    if ue8m0:
        s_ieee = ceil_to_ue8m0(s_ieee)
    assert torch.equal(s, s_ieee)                                     # IEEE amax / 448, as the CPU reference
    q_expect = (xg * (1.0 / s)[..., None]).clamp(-448.0, 448.0).to(FP8_DTYPE).view(m, g * 128)[:, :k]
    assert torch.equal(q.view(torch.uint8), q_expect.view(torch.uint8))
    rq, rs = per_token_group_quant_fp8(x, ue8m0=ue8m0)               # the stock reference on CUDA
    assert float(((s - rs).abs() / rs).max()) <= 2.0 ** -22
    REPORT.append({"op": "act_quant_fp8 vs CUDA torch reference (informational)", "ue8m0": ue8m0,
                   "scale_ulp_mismatch": float((s != rs).float().mean()),
                   "elem_mismatch": float((q.view(torch.uint8) != rq.view(torch.uint8)).float().mean())})


def _dense_oracle(ck, x, w, s, ue8m0=False):
    """The reference GEMM on the kernel's own quantized activations (fp32 result)."""
    xq, xs = ck.tk.act_quant_fp8(x.reshape(-1, x.shape[-1]), ue8m0=ue8m0)
    return w8a8_block_fp8_matmul(xq, xs, w, s, out_dtype=torch.float32)


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
        _record("block_fp8_linear[scaled_mm]", rel_err(y, _dense_oracle(ck, x, w, s)), TOL["dense"], shape=name, m=m)
        _record("block_fp8_linear[scaled_mm] e2e", rel_err(y, ref_block_fp8_linear(x, w, s, out_dtype=torch.float32)),
                TOL["dense_e2e"], shape=name, m=m)


@needs_sm90
@pytest.mark.parametrize("m", [64, 102, 2048])
def test_block_fp8_linear_into_out(ck, m):
    """`out=` (a projection into the piecewise graphs' static carry): `_scaled_mm` writes a row range of a larger
    buffer directly where no padding is needed, else the padded result is copied; both equal the op without
    `out` bit for bit and leave the rest of the buffer alone. q_b_proj's shape (glm5-flash-31b)."""
    n, k = 32 * 256, 768
    _, w, s = dense_fp8_case(1, n, k, device=DEV)
    wv, sv, meta = ck.block_fp8_linear_prepare(w, s, (128, 128))
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    want = ck.block_fp8_linear(x, wv, sv, (128, 128), **meta)
    store = torch.full((m + 16, n), float("nan"), device=DEV, dtype=BF16)
    got = ck.block_fp8_linear(x, wv, sv, (128, 128), out=store[8:8 + m], **meta)
    assert got.data_ptr() == store[8].data_ptr()
    torch.testing.assert_close(store[8:8 + m], want, rtol=0, atol=0)
    assert store[:8].isnan().all() and store[8 + m:].isnan().all()


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
    o = _dense_oracle(ck, x, w, s)
    y = ck.block_fp8_linear(x, wv, sv, **meta)
    _record("block_fp8_linear[K trap]", rel_err(y, o), TOL["dense"], k=k)
    _record("block_fp8_linear[K trap] e2e", rel_err(y, r), TOL["dense_e2e"], k=k)
    # and an un-prepared weight (padded per call) gives the same
    torch.testing.assert_close(ck.block_fp8_linear(x, w, s), y, rtol=0, atol=0)


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
            _record("block_fp8_linear[triton]", rel_err(y, _dense_oracle(kt, x, w, s, ue)), TOL["dense"], shape=name,
                    m=m, ue8m0=ue)
            r = ref_block_fp8_linear(x, w, s, out_dtype=torch.float32, act_ue8m0=ue)
            _record("block_fp8_linear[triton] e2e", rel_err(y, r), TOL["dense_e2e"], shape=name, m=m, ue8m0=ue)
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


def _fp8_moe_oracle(ck, c, *, act_ue8m0=False, swiglu_limit=None):
    """The FP8 MoE reference math with the kernel's own 1x128 quantizer for both stage inputs."""
    def qdq(a):
        q, s = ck.tk.act_quant_fp8(a.contiguous(), ue8m0=act_ue8m0)
        return dequant_per_token_group(q, s)
    inter = c.w13.shape[1] // 2
    g = c.s13.shape[1] // 2
    w13 = torch.cat([dequant_block_fp8(c.w13[:, :inter], c.s13[:, :g]),
                     dequant_block_fp8(c.w13[:, inter:], c.s13[:, g:])], 1)
    d = c.x.shape[1]
    xp = F.pad(c.x, (0, c.hidden_pad)) if c.hidden_pad else c.x
    out = fused_moe_act_qdq(xp, w13, dequant_block_fp8(c.w2, c.s2), c.topk_weights, c.topk_ids, act_qdq=qdq,
                            swiglu_limit=swiglu_limit, intermediate_pad=c.intermediate_pad)
    return out[:, :d]


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
        info = dict(d=geo["d"], i=geo["i"], e=geo["e"], k=geo["k"], t=t, first_call_s=round(dt, 3), **kw)
        if fmt == "fp8":
            _record("fused_moe[fp8]", rel_err(y, _fp8_moe_oracle(ck, sub, **kw)), TOL["fp8"], **info)
            _record("fused_moe[fp8] e2e", rel_err(y, r), TOL["fp8_e2e"], **info)
        else:
            _record(f"fused_moe[{fmt}]", rel_err(y, r), TOL[fmt], **info)
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
    y = _run_moe(ck, fmt, c, **kw)
    if fmt == "fp8":
        _record("fused_moe[fp8] padded", rel_err(y, _fp8_moe_oracle(ck, c)), TOL["fp8"], hidden_pad=hp,
                intermediate_pad=ip)
        _record("fused_moe[fp8] padded e2e", rel_err(y, _ref_moe(fmt, c)), TOL["fp8_e2e"], hidden_pad=hp,
                intermediate_pad=ip)
    else:
        _record(f"fused_moe[{fmt}] padded", rel_err(y, _ref_moe(fmt, c, **kw)), TOL[fmt], hidden_pad=hp,
                intermediate_pad=ip)


def test_mxfp4_linear(ck):
    for n, k, m in [(3072, 2048, 7), (2048, 1536, 513)]:
        w, s = quant_mxfp4(torch.randn(n, k, device=DEV) * k ** -0.5)
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        for mode in ("even", None):
            y = ck.mxfp4_linear(x, w, s, act_mode=mode)
            r = ref.mxfp4_linear(x.float(), w, s, act_mode=mode)
            _record("mxfp4_linear", rel_err(y, r), TOL["mxfp4"], n=n, k=k, m=m, act_mode=mode)


# ------------------------------------------------------------------------------- mHC (GLM-5.3-Flash)

@pytest.mark.parametrize("T", [1, 37, 8192])
def test_mhc_coefficients(ck, T):
    """One Triton launch for the pre/post sigmoids and the softmax + 20-iteration Sinkhorn of every token."""
    from glm_ray.kernels.torch_ref.mhc import mhc_coefficients as ref
    g = torch.Generator(device="cuda").manual_seed(T)
    m = torch.randn(T, 24, device="cuda", generator=g) * 2
    base, scale = torch.randn(24, device="cuda", generator=g) * 0.5, 1.0 + 0.3 * torch.randn(3, device="cuda", generator=g)
    got, want = ck.mhc_coefficients(m, base, scale, 4, 1e-6, 20), ref(m, base, scale, 4, 1e-6, 20)
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        _record("mhc_coefficients", rel_err(a, b), 1e-5, part=name, T=T)


@pytest.mark.parametrize("B", [1, 64])
def test_kda_decode(ck, B):
    """KDA decode step at GLM-5.3-Flash head shapes (dk = dv = 128), state updated in place at the slots."""
    from glm_ray.kernels.torch_ref.kda import kda_decode as ref
    g = torch.Generator(device="cuda").manual_seed(B)
    def r(*s):
        return torch.randn(*s, device="cuda", generator=g)
    q, k, v = r(B, 8, 128).bfloat16(), r(B, 8, 128).bfloat16(), r(B, 8, 128).bfloat16()
    gate, beta = -torch.rand(B, 8, 128, device="cuda", generator=g) * 2, torch.rand(B, 8, device="cuda", generator=g)
    state = r(96, 8, 128, 128)
    slots = torch.randperm(96, device="cuda", generator=g)[:B]
    fresh = torch.rand(B, device="cuda", generator=g) < 0.3
    s_ref, s_got = state.clone(), state.clone()
    want = ref(q, k, v, gate, beta, s_ref, slots, fresh)
    got = ck.kda_decode(q, k, v, gate, beta, s_got, slots, fresh)
    _record("kda_decode", rel_err(got.float(), want.float()), 1e-2, part="out", B=B)     # bf16 output rounding
    _record("kda_decode", rel_err(s_got, s_ref), 1e-5, part="state", B=B)


@pytest.mark.parametrize("B,L", [(1, 1000), (3, 200)])
def test_kda_chunked_triton_scan(B, L, monkeypatch):
    """The chunked KDA prefill with GLM_RAY_CUDA_KDA_SCAN=triton (one Triton launch walks the chunks) against the
    reference on the GPU, at GLM-5.3-Flash head shapes (dk = dv = 128), cached state rows read at the slots (zeros
    where fresh) and written back. The scan's dots are 3xTF32: about fp32, so the bounds are fp32-summation-order
    ones; the output rounds to bf16."""
    from glm_ray.kernels.cuda import CudaKernels
    from glm_ray.kernels.torch_ref.kda import kda_chunked_cached as ref
    monkeypatch.setenv("GLM_RAY_CUDA_KDA_SCAN", "triton")          # read when the backend is built
    ck = CudaKernels("scaled_mm")
    if ck.tk is None:
        pytest.skip(ck.triton_error)
    g = torch.Generator(device="cuda").manual_seed(B * L)
    def r(*s):
        return torch.randn(*s, device="cuda", generator=g)
    q, k, v = r(B, L, 8, 128).bfloat16(), r(B, L, 8, 128).bfloat16(), r(B, L, 8, 128).bfloat16()
    gate = (-5.0 * torch.sigmoid(r(B, L, 8, 128))).bfloat16()
    beta = torch.rand(B, L, 8, device="cuda", generator=g).bfloat16()
    state = 0.5 * r(16, 8, 128, 128)
    slots = torch.randperm(16, device="cuda", generator=g)[:B]
    fresh = torch.arange(B, device="cuda") == 0
    s_ref, s_got = state.clone(), state.clone()
    want = ref(q, k, v, gate, beta, s_ref, slots, fresh)
    got = ck.kda_chunked(q, k, v, gate, beta, s_got, slots, fresh)
    assert not ck.fallbacks, dict(ck.fallbacks)
    _record("kda_chunked", rel_err(got.float(), want.float()), 1e-2, part="out", B=B, L=L)   # bf16 output rounding
    _record("kda_chunked", rel_err(s_got, s_ref), 1e-4, part="state", B=B, L=L)
