"""The `cuda` kernel backend on CPU: registry wiring and per-op fallbacks, the pure-torch layout helpers
(`_scaled_mm` padding views, MoE alignment, tile configs) and — when triton is importable — the Triton
kernels themselves under TRITON_INTERPRET=1 on small shapes, against the torch references.

Interpreter tolerances: the FP8 / MXFP4 paths match the references to fp32 round-off (same quantizer
op order; stage outputs kept in fp32 under the interpreter), so we ask rel err <= 1e-5. The bf16 path
differs from the bf16 reference by the reference's own bf16 roundings of h and the intermediate
(~2^-9 relative each), so rel err <= 1e-2 there.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray import kernels
from glm_ray.kernels.cuda import layout as L
from glm_ray.kernels.torch_ref import fused_moe as ref_fused_moe
from glm_ray.kernels.torch_ref import quant_ops as ref
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear
from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, per_token_group_quant_fp8
from glm_ray.kernels.torch_ref.mxfp4 import SCALE_MODES, qdq_mxfp4, quant_mxfp4
from tests.kernels.cases import dense_fp8_case, interpreted, moe_case, rel_err, routing

BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------- registry

@pytest.fixture
def cuda_backend():
    ops = kernels.init_backend("cuda", "cpu")
    yield ops
    kernels.init_backend("torch")


def test_cuda_backend_registered_and_resolved(monkeypatch):
    assert "cuda" in kernels._REGISTRY
    monkeypatch.setattr(torch.version, "hip", None)
    assert kernels.resolve_backend_name("auto", "cuda") == "cuda"
    assert kernels.resolve_backend_name("auto", "cpu") == "torch"
    monkeypatch.setattr(torch.version, "hip", "6.4")               # ROCm never resolves to cuda
    assert kernels.resolve_backend_name("auto", "cuda") != "cuda"


def test_torch_ops_env_sends_named_ops_to_the_reference(monkeypatch):
    try:
        ops = kernels.init_backend("cuda", "cpu")
        assert ops.fused_moe.__self__.__class__.__name__ == "CudaKernels"
        monkeypatch.setenv("GLM_RAY_TORCH_OPS", "fused_moe, block_fp8_linear")
        ops = kernels.init_backend("cuda", "cpu")
        assert ops.fused_moe is ref_fused_moe and ops.block_fp8_linear is ref_block_fp8_linear
        assert ops.fused_moe_mxfp4.__self__.__class__.__name__ == "CudaKernels"  # the rest stays
        monkeypatch.setenv("GLM_RAY_TORCH_OPS", "fused_moe,no_such_op")
        with pytest.raises(ValueError, match="no_such_op"):
            kernels.init_backend("cuda", "cpu")
    finally:
        monkeypatch.delenv("GLM_RAY_TORCH_OPS")
        kernels.init_backend("torch")


def test_cuda_backend_inherits_and_falls_back_on_cpu(cuda_backend):
    ops = cuda_backend
    assert ops.name == "cuda"
    assert ops.moe_quant_layout is ref.moe_quant_layout                # inherited: no padding needed
    assert ops.moe_quant_prepare is ref.moe_quant_prepare
    impl = ops.fused_moe.__self__
    # CPU tensors: every op is the reference, bit for bit, and the fallback is counted with its reason
    x, w, s = dense_fp8_case(5, 256, 384)
    assert ops.block_fp8_linear_prepare(w, s, (128, 128)) == (w, s, {})
    torch.testing.assert_close(ops.block_fp8_linear(x, w, s), ref_block_fp8_linear(x, w, s), rtol=0, atol=0)
    c = moe_case(6, 64, 32, 4, 2, "bf16", dtype=torch.float32)
    torch.testing.assert_close(ops.fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, swiglu_limit=1.0),
                               ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, swiglu_limit=1.0),
                               rtol=0, atol=0)
    c = moe_case(6, 64, 32, 4, 2, "mxfp4")
    torch.testing.assert_close(
        ops.fused_moe_mxfp4(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids),
        ref.fused_moe_mxfp4(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids), rtol=0, atol=0)
    reasons = {op for op, _ in impl.fallbacks}
    assert {"block_fp8_linear", "fused_moe", "fused_moe_mxfp4"} <= reasons
    assert all("cpu" in r for _, r in impl.fallbacks)


def test_bad_fp8_gemm_env_is_refused(monkeypatch):
    from glm_ray.kernels.cuda import CudaKernels
    monkeypatch.setenv("GLM_RAY_CUDA_FP8_GEMM", "cutlass")
    with pytest.raises(ValueError, match="GLM_RAY_CUDA_FP8_GEMM"):
        CudaKernels()


def test_kernel_failure_marks_op_broken_and_uses_reference(monkeypatch, caplog, gpu_check_off):
    from glm_ray.kernels.cuda import CudaKernels
    ck = CudaKernels()
    if ck.tk is None:
        pytest.skip(ck.triton_error)

    def boom(*a, **k):
        raise RuntimeError("simulated Triton compile error")
    monkeypatch.setattr(ck.tk, "fused_moe_triton", boom)
    c = moe_case(4, 64, 32, 4, 2, "bf16")
    want = ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids)
    for _ in range(2):
        torch.testing.assert_close(ck.fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids), want, rtol=0, atol=0)
    assert "simulated" in ck.broken["fused_moe"]
    assert sum(ck.fallbacks.values()) == 2 and "kernel failed" in caplog.text


def test_decode_size_thresholds_route_to_the_one_launch_kernels(monkeypatch, gpu_check_off, spy):
    """GLM_RAY_CUDA_FP8_SMALL_M: a block-FP8 linear of <= that many rows runs the fused small-M kernel
    (interpreted here) and equals the reference; above it, the usual path (default 64 = MAX_M)."""
    from glm_ray.kernels.cuda import CudaKernels, fp8_small_m
    monkeypatch.setenv("GLM_RAY_CUDA_FP8_SMALL_M", "4")
    ck = CudaKernels()
    if ck.tk is None or not ck.tk.INTERPRET:
        pytest.skip("needs triton interpreted")
    calls = spy(fp8_small_m, "block_fp8_linear_small_m")
    x, w, s = dense_fp8_case(3, 256, 384)
    y = ck.block_fp8_linear(x.float(), w, s, out_dtype=torch.bfloat16)
    assert calls == [1]
    want = ref_block_fp8_linear(x.float(), w, s, (128, 128), torch.float32)
    assert rel_err(y.float(), want) < 1e-2                                  # bf16 output rounding
    assert CudaKernels().small_m == 4 and ck.moe_decode_pairs == 4                  # the default
    monkeypatch.delenv("GLM_RAY_CUDA_FP8_SMALL_M")
    assert CudaKernels().small_m == 64                                # the default: the kernel's MAX_M
    monkeypatch.setenv("GLM_RAY_CUDA_FP8_SMALL_M", "4096")
    assert CudaKernels().small_m == fp8_small_m.MAX_M                 # clamped to what the kernel takes
    monkeypatch.delenv("GLM_RAY_CUDA_FP8_SMALL_M")
    # GLM_RAY_CUDA_MOE_DECODE_PAIRS: MoE calls of <= that many (token, expert) pairs take the decode kernels
    from glm_ray.kernels.cuda import moe_decode
    monkeypatch.setenv("GLM_RAY_CUDA_MOE_DECODE_PAIRS", "8")
    ck = CudaKernels()
    moe_calls = spy(moe_decode, "fused_moe_decode")
    c = moe_case(3, 64, 32, 4, 2, "bf16")                                 # 6 pairs
    got = ck.fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids)
    assert calls == [1] and moe_calls == [1]
    want = ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids)
    assert rel_err(got.float(), want.float()) < 1e-2


# ------------------------------------------------------------------------------ layout helpers

@pytest.mark.parametrize("n,k,np_,kp", [(576, 6144, 640, 6144), (8192, 768, 8192, 1024), (128, 640, 128, 1024),
                                        (16384, 2048, 16384, 2048), (6144, 16384, 6144, 16384),
                                        (256, 1280, 256, 1536), (200, 300, 256, 512)])
def test_scaled_mm_padded_dims(n, k, np_, kp):
    assert L.scaled_mm_padded_dims(n, k) == (np_, kp)
    assert kp % 512 == 0 and (kp // 128) % 4 == 0


@pytest.mark.parametrize("n,k", [(576, 384), (256, 768), (200, 300), (256, 512)])
def test_prepared_weight_views_keep_checkpoint_shape(n, k):
    _, w, s = dense_fp8_case(1, n, k)
    wv, sv, meta = L.prepare_scaled_mm_weight(w, s)
    np_, kp = L.scaled_mm_padded_dims(n, k)
    assert meta == {"n_pad": np_, "k_pad": kp}
    assert wv.shape == w.shape and sv.shape == s.shape
    assert torch.equal(wv.view(torch.uint8), w.view(torch.uint8)) and torch.equal(sv, s)
    # what MLA absorption / the reference see is unchanged
    torch.testing.assert_close(dequant_block_fp8(wv, sv), dequant_block_fp8(w, s), rtol=0, atol=0)
    wp, sp, copied = L.scaled_mm_operands(wv, sv, **meta)
    assert not copied and wp.shape == (np_, kp) and sp.shape == (np_ // 128, kp // 128)
    assert wp.is_contiguous() and sp.is_contiguous()
    assert wp.data_ptr() == wv.data_ptr()                            # no copy: same storage
    assert torch.equal(wp[:n, :k].view(torch.uint8), w.view(torch.uint8))
    assert not wp[n:].float().any() and not wp[:, k:].float().any()
    # a plain (non-view) weight is padded per call instead, to the same tensors
    wp2, sp2, copied2 = L.scaled_mm_operands(w.contiguous(), s.contiguous())
    assert copied2 == ((np_, kp) != (n, k))
    assert torch.equal(wp2.view(torch.uint8), wp.view(torch.uint8)) and torch.equal(sp2, sp)
    # padded GEMM == unpadded GEMM exactly (zero columns add exact zeros)
    x = torch.randn(3, k)
    xq, xs = per_token_group_quant_fp8(torch.nn.functional.pad(x, (0, kp - k)))
    y_pad = (xq.float() * xs.repeat_interleave(128, -1)) @ dequant_block_fp8(wp, sp).T
    torch.testing.assert_close(y_pad[:, :n], ref_block_fp8_linear(x, w, s), rtol=1e-6, atol=1e-6)


def test_padded_base_rejects_non_corner_views():
    t = torch.arange(12.0).view(3, 4)
    assert L.padded_base(t[:2, :3], 3, 4) is not None
    assert L.padded_base(t[:2, :3].contiguous(), 3, 4) is None
    assert L.padded_base(t[1:, :3], 3, 4) is None                   # storage too small for an offset corner
    assert L.padded_base(t.t(), 4, 3) is None


@pytest.mark.parametrize("t,e,k,bm,skew", [(1, 64, 4, 16, 0.0), (7, 256, 8, 16, 0.0), (33, 8, 2, 32, 0.0),
                                           (200, 16, 4, 64, 3.0), (50, 4, 4, 16, 0.0), (0, 8, 2, 16, 0.0)])
def test_moe_align_invariants(t, e, k, bm, skew):
    _, ids = routing(t, e, k, seed=3, skew=skew)
    al = L.moe_align(ids, e, bm)
    p = t * k
    assert al.max_blocks == L.moe_max_blocks(p, e, bm)
    sid = al.sorted_ids.long()
    npost = int(al.num_post_pad)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert npost == int(((counts + bm - 1) // bm * bm).sum()) and npost <= al.max_blocks * bm
    used = sid[:npost]
    real = used[used < p]
    assert sorted(real.tolist()) == list(range(p))                   # every pair exactly once
    assert (sid[npost:] == p).all()                                  # tail is padding
    flat = ids.reshape(-1)
    for b in range(npost // bm):
        rows = sid[b * bm:(b + 1) * bm]
        rows = rows[rows < p]
        assert rows.numel() > 0                                      # no empty block before npost
        assert (flat[rows] == al.expert_ids[b]).all()                # one expert per block
        assert (rows.diff() > 0).all()                               # stable: ascending pair order
    assert (al.expert_ids >= 0).all() and (al.expert_ids < e).all()


def test_tile_configs_respect_kernel_constraints():
    for mode in ("bf16", "fp8", "mxfp4"):
        for p, e in [(1, 64), (8, 256), (4 * 513, 64), (8 * 2048, 16), (8 * 8192, 256)]:
            c1, c2 = L.moe_configs(mode, p, e)
            assert c1.block_m == c2.block_m and c1.block_m in (16, 32, 64)
            if mode == "fp8":
                assert c1.block_n == 128 and c1.block_k == 128 and c2.block_k == 128
            if mode == "mxfp4":
                assert c1.block_n % 32 == 0 and c1.block_k % 32 == 0 and c2.block_k % 32 == 0


# ------------------------------------------------------------------ Triton kernels, interpreted

@pytest.fixture(scope="module")
def interp():
    """glm_ray/kernels/cuda/triton_kernels.py with its kernels interpreted. The interpreter must be on
    when triton itself is imported (its standard-library functions, e.g. tl.max, are built then), so
    this module switches it on at collection time on machines without a GPU (see the top of the file)."""
    return interpreted("triton_kernels")


@pytest.mark.parametrize("ue8m0", [False, True])
def test_interp_act_quant_matches_reference(interp, ue8m0):
    x = torch.randn(6, 300, dtype=BF16) * 5
    x[2, :128] = 0                                                   # an all-zero group (eps floor)
    q, s = interp.act_quant_fp8(x, ue8m0=ue8m0)
    rq, rs = per_token_group_quant_fp8(x, ue8m0=ue8m0)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    # the _scaled_mm operand layout: rows padded to 8, K to 512, column-major scales, zeros in the pad
    q2, s2 = interp.act_quant_fp8(x, m_out=8, k_out=512, ue8m0=ue8m0, col_major_scale=True)
    assert q2.shape == (8, 512) and s2.shape == (8, 4) and s2.stride() == (1, 8)
    assert torch.equal(q2[:6, :300].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s2[:6, :3], rs)
    assert not q2[6:].float().any() and not q2[:, 300:].float().any()


@pytest.mark.parametrize("mode", SCALE_MODES)
def test_interp_mx_qdq_matches_reference(interp, mode):
    x = torch.randn(5, 256) * torch.logspace(-3, 3, 256)
    x[1, :32] = 0
    x[3, 32:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5] * 4)   # E2M1 ties, amax 6.5
    y = interp.mx_qdq_rows(x, mode, torch.float32)
    torch.testing.assert_close(y, qdq_mxfp4(x, mode), rtol=0, atol=0)


def _ref_moe(fmt, c, **kw):
    if fmt == "bf16":
        return ref_fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, intermediate_pad=c.intermediate_pad,
                             swiglu_limit=kw.get("swiglu_limit"))
    if fmt == "fp8":
        return ref.fused_moe_block_fp8(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids,
                                       hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **kw)
    return ref.fused_moe_mxfp4(c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids, hidden_pad=c.hidden_pad,
                               intermediate_pad=c.intermediate_pad, **kw)


def _tk_moe(tk, fmt, c, *, swiglu_limit=None, act_ue8m0=False, act_mode="even"):
    return tk.fused_moe_triton(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids, w_mode=fmt, w13_scale=c.s13,
                               w2_scale=c.s2, hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad,
                               swiglu_limit=swiglu_limit, act_ue8m0=act_ue8m0,
                               mx_act_mode=act_mode if fmt == "mxfp4" else None)


MOE_CASES = [
    # fmt, T, D, I, E, K, hidden_pad, inter_pad, kwargs
    ("bf16", 9, 256, 96, 4, 2, 0, 0, {"swiglu_limit": 0.5}),
    ("bf16", 3, 128, 64, 8, 2, 0, 32, {}),
    ("fp8", 9, 256, 160, 4, 2, 0, 0, {"swiglu_limit": 1.0}),
    ("fp8", 5, 200, 128, 4, 2, 56, 64, {"act_ue8m0": True}),
    ("mxfp4", 9, 256, 64, 4, 2, 0, 0, {"act_mode": "even", "swiglu_limit": 0.7}),
    ("mxfp4", 4, 224, 96, 4, 2, 32, 32, {"act_mode": "round_up"}),
    ("mxfp4", 4, 128, 64, 4, 2, 0, 0, {"act_mode": None}),
]


@pytest.mark.parametrize("fmt,t,d,i,e,k,hp,ip,kw", MOE_CASES)
def test_interp_fused_moe_matches_reference(interp, fmt, t, d, i, e, k, hp, ip, kw):
    c = moe_case(t, d, i, e, k, fmt, hidden_pad=hp, intermediate_pad=ip, gate_scale=4.0, x_scale=2.0)
    y = _tk_moe(interp, fmt, c, **kw)
    r = _ref_moe(fmt, c, **kw)
    assert y.shape == r.shape == c.x.shape and y.dtype == c.x.dtype
    assert rel_err(y, r) <= (1e-2 if fmt == "bf16" else 1e-5), rel_err(y, r)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # sigmoid(-huge) = 0
def test_interp_clamp_is_applied(interp):
    """|gate| >> limit: the clamped result differs from the unclamped one, and matches the reference."""
    c = moe_case(8, 128, 64, 4, 2, "fp8", gate_scale=40.0, x_scale=3.0)
    y = _tk_moe(interp, "fp8", c, swiglu_limit=10.0)
    y_free = _tk_moe(interp, "fp8", c)
    assert rel_err(y_free, y) > 0.1
    assert rel_err(y, _ref_moe("fp8", c, swiglu_limit=10.0)) <= 1e-5


def test_interp_dense_gemms(interp):
    x, w, s = dense_fp8_case(5, 192, 320)
    xq, xs = interp.act_quant_fp8(x)
    y = interp.dense_gemm_triton(xq, w, w_mode="fp8", a_scale=xs, w_scale=s, out_dtype=torch.float32)
    torch.testing.assert_close(y, ref_block_fp8_linear(x, w, s, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)
    # on the padded corner views block_fp8_linear_prepare produces (strides (Kp, 1))
    wv, sv, _ = L.prepare_scaled_mm_weight(w, s)
    y2 = interp.dense_gemm_triton(xq, wv, w_mode="fp8", a_scale=xs, w_scale=sv, out_dtype=torch.float32)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    wm, sm = quant_mxfp4(torch.randn(96, 256) / 16)
    a = interp.mx_qdq_rows(x[:, :256].float(), "even", torch.float32)
    y3 = interp.dense_gemm_triton(a, wm, w_mode="mxfp4", w_scale=sm, out_dtype=torch.float32)
    torch.testing.assert_close(y3, ref.mxfp4_linear(x[:, :256].float(), wm, sm, act_mode="even"), rtol=1e-5,
                               atol=1e-5)


def test_scaled_mm_path_plumbing_with_emulated_gemm(interp, monkeypatch, gpu_check_off):
    """The `_scaled_mm` branch of block_fp8_linear end to end on CPU: Triton act quant (interpreted)
    into the padded column-major layout, the padded operands recovered from the prepared views, an
    exact emulation of the blockwise `_scaled_mm`, the un-padding — against the reference. With `out=`: where
    the padded operands' shape is the output's (rows a multiple of SCALED_MM_M_ALIGN, N of 128) `_scaled_mm` gets
    `out` itself, else its padded result is copied in; both write `out`'s rows only."""
    from glm_ray.kernels.cuda import CudaKernels
    direct = []

    def scaled_mm(xq, xs, wp, sp, out=None):                         # [Mp, Kp] x [Np, Kp] -> [Mp, Np] bf16
        a = xq.float() * xs.repeat_interleave(128, 1)
        y = (a @ dequant_block_fp8(wp, sp).T).to(BF16)
        direct.append(out is not None)
        return y if out is None else out.copy_(y)
    monkeypatch.setattr(CudaKernels, "_scaled_mm", lambda self, *a, **kw: scaled_mm(*a, **kw))
    monkeypatch.setattr(CudaKernels, "_scaled_mm_ok", lambda self, wp, sp: True)   # its GPU self-check
    ck = CudaKernels()
    ck.small_m = 0                                                   # (5 or 8 rows: the _scaled_mm branch)
    for n, k in ((200, 300), (256, 768)):                            # N and K padded / K padded to 1024
        for m in (5, 8):
            x, w, s = dense_fp8_case(m, n, k)
            wv, sv, meta = ck.block_fp8_linear_prepare(w, s)
            want = ref_block_fp8_linear(x.to(BF16), w, s, out_dtype=torch.float32)
            y = ck.block_fp8_linear(x.to(BF16), wv, sv, (128, 128), out_dtype=BF16, **meta)
            assert y.shape == (m, n) and rel_err(y, want) < 8e-3 and not ck.fallbacks
            store = torch.full((m + 3, n), float("nan"), dtype=BF16)
            direct.clear()
            got = ck.block_fp8_linear(x.to(BF16), wv, sv, (128, 128), out_dtype=BF16, out=store[1:1 + m], **meta)
            assert got.data_ptr() == store[1].data_ptr() and torch.equal(store[1:1 + m], y)
            assert store[0].isnan().all() and store[1 + m:].isnan().all()
            assert direct == [(m % 4 == 0) and n % 128 == 0]             # unpadded: straight into out


def _mhc_case(T, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (2 + n) * n
    return (torch.randn(T, w, generator=g) * 2, torch.randn(w, generator=g) * 0.5,
            1.0 + 0.3 * torch.randn(3, generator=g))


@pytest.mark.parametrize("T,n", [(1, 4), (37, 4), (64, 2)])
def test_interp_mhc_coefficients_match_reference(interp, T, n):
    """GLM-5.3-Flash mHC: sigmoids + softmax + 20 Sinkhorn iterations in one kernel == the torch reference."""
    from glm_ray.kernels.cuda import mhc as km
    from glm_ray.kernels.torch_ref.mhc import mhc_coefficients as ref
    m, base, scale = _mhc_case(T, n)
    for got, want in zip(km.mhc_coefficients(m, base, scale, n, 1e-6, 20), ref(m, base, scale, n, 1e-6, 20)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mhc_coefficients_fall_back_on_cpu(cuda_backend):
    from glm_ray.kernels.torch_ref.mhc import mhc_coefficients as ref
    m, base, scale = _mhc_case(5, 4)
    for got, want in zip(cuda_backend.mhc_coefficients(m, base, scale, 4, 1e-6, 20), ref(m, base, scale, 4, 1e-6, 20)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert any(op == "mhc_coefficients" and "cpu" in r for op, r in cuda_backend.mhc_coefficients.__self__.fallbacks)
    from glm_ray.kernels.torch_ref.kda import kda_decode as ref_kda
    q, k, v, g, beta, state, slots, fresh = _kda_case(3, 2, 32, 32, 6)
    s_ref, s_got = state.clone(), state.clone()
    torch.testing.assert_close(cuda_backend.kda_decode(q, k, v, g, beta, s_got, slots, fresh),
                               ref_kda(q, k, v, g, beta, s_ref, slots, fresh), rtol=0, atol=0)
    assert torch.equal(s_got, s_ref)


def _kda_case(B, H, dk, dv, S, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g, device=device)
    q, k, v = r(B, H, dk), r(B, H, dk), r(B, H, dv)
    gate = -torch.rand(B, H, dk, generator=g, device=device) * 2                # log-decay <= 0
    beta = torch.rand(B, H, generator=g, device=device)
    state = r(S, H, dk, dv)
    slots = torch.randperm(S, generator=g, device=device)[:B]
    fresh = torch.rand(B, generator=g, device=device) < 0.3
    return q, k, v, gate, beta, state, slots, fresh


@pytest.mark.parametrize("dk,dv", [(32, 32), (32, 48)])
def test_interp_kda_decode_matches_reference(interp, dk, dv):
    """GLM-5.3-Flash KDA decode: state read at the slots (zero when fresh), one delta-rule step, state
    written back in place — one kernel == the torch reference (output and every state row)."""
    from glm_ray.kernels.cuda import kda as kk
    from glm_ray.kernels.torch_ref.kda import kda_decode as ref
    q, k, v, g, beta, state, slots, fresh = _kda_case(3, 2, dk, dv, 6)
    fresh[:] = torch.tensor([False, True, False])
    s_ref, s_got = state.clone(), state.clone()
    want = ref(q, k, v, g, beta, s_ref, slots, fresh)
    got = kk.kda_decode(q, k, v, g, beta, s_got, slots, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)        # untouched rows equal too
