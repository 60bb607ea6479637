"""The prefill-size block-FP8 MoE (glm_ray/kernels/cuda/moe_prefill.py) compiled on the GPU at real expert shapes:
glm5-flash-31b (E=64, D=2048, I=1536, top-4) and GLM-5 (E=256, D=6144, I=2048, top-8), T in {512, 2048, 8192},
with the default tiles and the TMA forms, against the reference math, the old grouped `fused_moe_triton`, the
dispatch in `CudaKernels.fused_moe_block_fp8`, and itself under CUDA-graph replay. Skipped without an NVIDIA GPU
(sm_90 for FP8).

The oracle is the reference's math (`quant_ops.fused_moe_block_fp8`: dequantized weights, activations
quantize-dequantized per 1x128 before both GEMMs) computed one touched expert at a time, so the fp32 weights of
GLM-5's 256 experts (38 GB) never exist at once. Tolerances (relative Frobenius error, as
tests/gpu/test_cuda_moe_decode.py):
* 6e-3 against the oracle on the kernels' own (IEEE-division) 1x128 quantizer and against the old grouped
  kernels (the same quantizer): fp32 summation order (wgmma K-chunks, promotion per 128-K block), the bf16
  per-pair outputs, rare 1x128 re-quantization flips of the intermediate.
* 3e-2 against the oracle on the stock torch quantizer (the e2e reference: CUDA's `amax / 448` is a multiply by
  the rounded reciprocal, ~1% of elements round the other way; measured <= 1.7e-2 for the grouped path).
* CUDA-graph replay == eager bit for bit (no atomics; the same launches on the same inputs).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.cuda.layout import TileConfig  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import dequant_block_fp8, dequant_per_token_group, quant_weight_block  # noqa: E402
from glm_ray.kernels.torch_ref.moe import swiglu  # noqa: E402
from glm_ray.kernels.torch_ref.moe_quant import qdq_fp8_1x128  # noqa: E402
from tests.kernels.cases import rel_err, routing  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
TOL = {"fp8": 6e-3, "fp8_e2e": 3e-2}
GEOS = {"flash": dict(e=64, d=2048, i=1536, k=4), "glm5": dict(e=256, d=6144, i=2048, k=8)}
TS = (512, 2048, 8192)
CHUNK = 16                       # experts generated per step (GLM-5 fp32 temporaries stay ~1.6 GB)
TMA = (TileConfig(64, 256, 128, 8, 3, tma=True), TileConfig(64, 128, 128, 8, 3, tma=True))
TMA_256 = (TileConfig(64, 256, 128, 8, 4, tma=True), TileConfig(64, 256, 128, 8, 3, tma=True))
PERSISTENT = (TileConfig(64, 256, 128, 8, 3, tma=True, persistent=1),
              TileConfig(64, 128, 128, 8, 3, tma=True, persistent=1))
TWO_AN_SM = (TileConfig(64, 256, 128, 8, 2, tma=True, maxnreg=128), TileConfig(64, 128, 128, 8, 2, tma=True, maxnreg=128))


def _sm() -> int:
    a, b = torch.cuda.get_device_capability()
    return 10 * a + b


@pytest.fixture(scope="module", autouse=True)
def _fp8_gpu():
    if _sm() < 90:
        pytest.skip("FP8 kernels need sm_90")


@pytest.fixture(scope="module")
def mp():
    from glm_ray.kernels.cuda import moe_prefill
    return moe_prefill


@pytest.fixture(scope="module")
def tk():
    from glm_ray.kernels.cuda import triton_kernels
    return triton_kernels


@pytest.fixture(scope="module")
def experts():
    """experts(geo) -> (w13, s13, w2, s2) block-FP8 in the runtime layout (per-half 128x128 scales), built once
    per module (GLM-5: 9.7 GB): weights ~ N(0, 1/fan_in)."""
    cache: dict = {}

    def make(geo):
        if geo in cache:
            return cache[geo]
        cache.clear()                                                      # one geometry resident at a time
        torch.cuda.empty_cache()
        e, d, i = GEOS[geo]["e"], GEOS[geo]["d"], GEOS[geo]["i"]
        g = torch.Generator(device=DEV).manual_seed(0)
        w13 = torch.empty(e, 2 * i, d, dtype=torch.float8_e4m3fn, device=DEV)
        w2 = torch.empty(e, d, i, dtype=torch.float8_e4m3fn, device=DEV)
        s13 = torch.empty(e, 2 * (i // 128), d // 128, device=DEV)
        s2 = torch.empty(e, d // 128, i // 128, device=DEV)
        for a in range(0, e, CHUNK):
            b = min(e, a + CHUNK)
            w13f = torch.randn(b - a, 2 * i, d, generator=g, device=DEV) * d ** -0.5
            w2f = torch.randn(b - a, d, i, generator=g, device=DEV) * i ** -0.5
            qg, sg = quant_weight_block(w13f[:, :i])
            qu, su = quant_weight_block(w13f[:, i:])
            w13[a:b], s13[a:b] = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
            w2[a:b], s2[a:b] = quant_weight_block(w2f)
            del w13f, w2f, qg, qu
        cache[geo] = (w13, s13, w2, s2)
        return cache[geo]
    return make


def _inputs(geo, t, seed):
    gg = GEOS[geo]
    x = torch.randn(t, gg["d"], generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(BF16)
    tw, ids = routing(t, gg["e"], gg["k"], seed=seed + 1, device=DEV)
    return x, tw, ids


def _oracle(x, w13, s13, w2, s2, tw, ids, qdq, swiglu_limit=None):
    """quant_ops.fused_moe_block_fp8's math, one touched expert at a time (host syncs are fine here)."""
    inter, g = w13.shape[1] // 2, s13.shape[1] // 2
    xq = qdq(x.float())                                                          # [T, D]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        t, k = (ids == e).nonzero(as_tuple=True)                                 # [n], [n]
        w13e = torch.cat([dequant_block_fp8(w13[e, :inter], s13[e, :g]), dequant_block_fp8(w13[e, inter:], s13[e, g:])])
        h = xq[t] @ w13e.T                                                       # [n, 2I]
        a = qdq(swiglu(h[:, :inter], h[:, inter:], swiglu_limit))               # [n, I]
        out.index_add_(0, t, tw[t, k, None].float() * (a @ dequant_block_fp8(w2[e], s2[e]).T))
    return out.to(x.dtype)


def _checks(tk, y, x, w13, s13, w2, s2, tw, ids, **kw):
    def own_qdq(a):
        q, s = tk.act_quant_fp8(a.contiguous())
        return dequant_per_token_group(q, s)
    g = tk.fused_moe_triton(x, w13, w2, tw, ids, w_mode="fp8", w13_scale=s13, w2_scale=s2, **kw)
    return [("oracle", _oracle(x, w13, s13, w2, s2, tw, ids, own_qdq, **kw), TOL["fp8"]),
            ("grouped", g, TOL["fp8"]),
            ("ref e2e", _oracle(x, w13, s13, w2, s2, tw, ids, qdq_fp8_1x128, **kw), TOL["fp8_e2e"])]


PARAMS = [("flash", None, {}), ("flash", TMA, {"swiglu_limit": 10.0}), ("glm5", None, {"swiglu_limit": 10.0}),
          ("glm5", TMA_256, {}), ("flash", PERSISTENT, {"swiglu_limit": 10.0}), ("glm5", PERSISTENT, {}),
          ("flash", TWO_AN_SM, {})]


@pytest.mark.parametrize("geo,cfg,kw", PARAMS, ids=["flash-default", "flash-tma", "glm5-default", "glm5-tma256",
                                                    "flash-persistent", "glm5-persistent", "flash-r128"])
def test_prefill_moe_matches_reference_and_grouped(mp, tk, experts, geo, cfg, kw):
    w13, s13, w2, s2 = experts(geo)
    errs = []
    for t in TS:
        x, tw, ids = _inputs(geo, t, seed=t)
        y = mp.fused_moe_prefill(x, w13, w2, tw, ids, w13_scale=s13, w2_scale=s2, configs=cfg, **kw)
        assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
        for name, want, tol in _checks(tk, y, x, w13, s13, w2, s2, tw, ids, **kw):
            err = rel_err(y, want)
            errs.append(f"T={t} {name} {err:.2e}")
            assert err <= tol, f"{geo} {cfg} T={t} vs {name}: rel err {err:.3e} > {tol}"
    print(f"\n[moe_prefill {geo} {'default' if cfg is None else 'tma'}]", ", ".join(errs))


def test_dispatch_runs_the_prefill_kernels(ck, no_fallbacks, experts, monkeypatch):
    """`CudaKernels.fused_moe_block_fp8` sends a 2048-token glm5-flash-31b call (128 pairs per expert) to
    moe_prefill (default GLM_RAY_CUDA_MOE_PREFILL_ROWS) and a 64-token one (4 per expert) to the grouped kernels."""
    from glm_ray.kernels.cuda import moe_prefill
    calls = []
    real = moe_prefill.fused_moe_prefill
    monkeypatch.setattr(moe_prefill, "fused_moe_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w13, s13, w2, s2 = experts("flash")
    for t in (2048, 64):
        x, tw, ids = _inputs("flash", t, seed=7)
        y = ck.fused_moe_block_fp8(x, w13, s13, w2, s2, tw, ids)
        g = ck.tk.fused_moe_triton(x, w13, w2, tw, ids, w_mode="fp8", w13_scale=s13, w2_scale=s2)
        assert rel_err(y, g) <= TOL["fp8"]
    assert calls == [2048]


def test_prefill_moe_cuda_graph_replay_equals_eager(mp, experts):
    """Captured once at T = 512; replayed on new tokens AND new routing (one with two experts left empty, so the
    used-row count the kernels read on the device changes), equal to eager calls bit for bit."""
    w13, s13, w2, s2 = experts("flash")
    sx, stw, sids = _inputs("flash", 512, seed=100)                   # static buffers the graph reads

    def run():
        return mp.fused_moe_prefill(sx, w13, w2, stw, sids, w13_scale=s13, w2_scale=s2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                      # compile + allocator warm-up
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (101, 102):
        x, tw, ids = _inputs("flash", 512, seed=seed)
        if seed == 102:
            tw, ids = routing(512, 62, 4, seed=seed, device=DEV)
            ids = ids + 2                                              # experts 0 and 1 empty
        sx.copy_(x)
        stw.copy_(tw)
        sids.copy_(ids)
        graph.replay()
        eager = mp.fused_moe_prefill(x, w13, w2, tw, ids, w13_scale=s13, w2_scale=s2)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
