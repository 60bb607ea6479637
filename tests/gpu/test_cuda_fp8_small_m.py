"""The fused small-M block-FP8 W8A8 linear (glm_ray/kernels/cuda/fp8_small_m.py) on the GPU (skipped without
an NVIDIA sm_90 GPU), at the dense projection shapes of tests/gpu/test_cuda_kernels.py (glm5-slice-6l and
glm5-flash-31b) and M in {1, 2, 8, 32, 64}, against the torch reference; plus CUDA-graph replay == eager.

Tolerances (relative Frobenius error, `rel_err`), as tests/gpu/test_cuda_kernels.py argues them:
* tight 4e-3 (bf16 output) — against the reference GEMM on the activations quantized by the backend's
  `act_quant_fp8`; the fused kernel runs the same `_fp8_group_quant`, so the FP8 operands are identical and
  only the fp32 summation order and the bf16 output rounding (2^-9 per element) remain.
* tight 1e-3 (fp32 output) — same oracle, no output rounding: what is left is the FP8 MMA's own
  accumulation inside each 128-wide K group (Hopper keeps fewer than 24 mantissa bits there, ~2^-14
  relative per group, DeepSeek-V3 report §3.3.2) before the fp32 promotion; 1e-3 leaves a wide margin.
* e2e 1.5e-2 — against the stock torch reference run on the GPU, whose CUDA `amax / 448` differs from the
  IEEE quotient by 1 ulp in about half of the groups and flips ~1% of e4m3 roundings (measured dense e2e
  <= 7e-3 on the H200).
Each new (K, split, BM) is a Triton compile, so the M grid is trimmed per shape.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.cuda import layout as L  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear as ref_block_fp8_linear  # noqa: E402
from glm_ray.kernels.torch_ref.fp8 import w8a8_block_fp8_matmul  # noqa: E402
from tests.kernels.cases import dense_fp8_case, rel_err  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
TOL = {"tight": 4e-3, "tight_fp32": 1e-3, "e2e": 1.5e-2}
MS = (1, 2, 8, 32, 64)

# (name, N, K, M values): the dense shapes of tests/gpu/test_cuda_kernels.py
SHAPES = [
    ("slice.q_b_proj", 16384, 2048, MS),
    ("slice.o_proj", 6144, 16384, (1, 64)),
    ("slice.kv_a_proj_with_mqa", 576, 6144, (1, 8, 64)),
    ("flash.q_b_proj(K=768)", 8192, 768, MS),
    ("flash.o_proj", 2048, 8192, MS),
    ("K=640", 1024, 640, (1, 64)),
]


def _sm() -> int:
    a, b = torch.cuda.get_device_capability()
    return 10 * a + b


@pytest.fixture(scope="module")
def mods():
    if _sm() < 90:
        pytest.skip("FP8 kernels need sm_90")
    pytest.importorskip("triton")
    from glm_ray.kernels.cuda import fp8_small_m
    from glm_ray.kernels.cuda import triton_kernels as tk
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False                    # the fp32 reference GEMMs
    yield fp8_small_m, tk
    torch.backends.cuda.matmul.allow_tf32 = prev


def _oracle(tk, x, w, s, ue8m0=False):
    """The reference GEMM on the backend quantizer's own FP8 activations (fp32 result)."""
    xq, xs = tk.act_quant_fp8(x, ue8m0=ue8m0)
    return w8a8_block_fp8_matmul(xq, xs, w, s, out_dtype=torch.float32)


@pytest.mark.parametrize("name,n,k,ms", SHAPES, ids=[s[0] for s in SHAPES])
def test_small_m_matches_reference(mods, name, n, k, ms):
    sm, tk = mods
    _, w, s = dense_fp8_case(1, n, k, device=DEV)
    wv, sv, _ = L.prepare_scaled_mm_weight(w, s)        # the padded corner views the backend's layers hold
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        cfg = sm.small_m_config(m, n, k, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
        y = sm.block_fp8_linear_small_m(x, wv, sv)
        assert y.shape == (m, n) and y.dtype == BF16 and y.is_contiguous()
        info = f"{name} M={m} split={cfg.split}"
        err = rel_err(y, _oracle(tk, x, w, s))
        assert err <= TOL["tight"], f"{info}: rel err {err:.3e} vs oracle"
        err = rel_err(y, ref_block_fp8_linear(x, w, s, out_dtype=torch.float32))
        assert err <= TOL["e2e"], f"{info}: rel err {err:.3e} vs torch reference"


def test_small_m_fp32_out_ue8m0_and_forced_splits(mods):
    sm, tk = mods
    n, k = 2048, 8192                                               # flash.o_proj: split-K by default at M = 1
    x, w, s = dense_fp8_case(8, n, k, device=DEV)
    for ue8m0 in (False, True):
        o = _oracle(tk, x, w, s, ue8m0)
        for split_k in (None, 1, 5):
            y = sm.block_fp8_linear_small_m(x, w, s, out_dtype=torch.float32, act_ue8m0=ue8m0, split_k=split_k)
            err = rel_err(y, o)
            assert err <= TOL["tight_fp32"], f"ue8m0={ue8m0} split_k={split_k}: rel err {err:.3e}"
    # fp16 activations and output
    y = sm.block_fp8_linear_small_m(x.half(), w, s)
    assert y.dtype == torch.float16 and rel_err(y, _oracle(tk, x.half(), w, s)) <= TOL["tight"]


def test_small_m_is_deterministic_and_sync_free(mods):
    sm, _ = mods
    x, w, s = dense_fp8_case(3, 2048, 8192, device=DEV)
    assert sm.small_m_config(3, 2048, 8192).split > 1
    y = sm.block_fp8_linear_small_m(x, w, s)                        # compiles outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")                          # any host sync raises
    try:
        y2 = sm.block_fp8_linear_small_m(x, w, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, y2)                                       # fixed-order split-K sum: bit-identical


@pytest.mark.parametrize("m,n,k", [(1, 2048, 8192), (8, 16384, 2048)], ids=["split-k", "one-launch"])
def test_small_m_cuda_graph_replay_equals_eager(mods, m, n, k):
    sm, _ = mods
    x, w, s = dense_fp8_case(m, n, k, device=DEV)
    fn = lambda a: sm.block_fp8_linear_small_m(a, w, s)             # noqa: E731
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                   # compile + warm up off the capture
        fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = fn(static_x)
    for seed in (1, 2):
        x_new = torch.randn(m, k, device=DEV, dtype=BF16, generator=torch.Generator(device=DEV).manual_seed(seed))
        static_x.copy_(x_new)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, fn(x_new))


@pytest.mark.parametrize("m,n,k", [(1, 2048, 8192), (1, 576, 2048), (16, 768, 2048), (64, 2048, 8192)],
                         ids=["o_proj-M1", "kv_a-M1", "q_a-M16", "o_proj-M64"])
def test_last_program_reduce_equals_the_sum_kernel_bit_for_bit(mods, m, n, k):
    """reduce="last" (one launch; the last program of a column tile adds the partials after an acq_rel
    counter) must give the bits of the two-launch reduction on every run: a memory-ordering bug shows as a
    missing or stale partial in some run, so it runs 50 times eagerly and 50 graph replays, forced splits
    included, and the counters must be back at 0."""
    sm, _ = mods
    x, w, s = dense_fp8_case(m, n, k, device=DEV)
    for split_k in (None, 2, 7, 64):
        cfg = sm.small_m_config(m, n, k, split_k=split_k)
        if cfg.split == 1:
            continue
        want = sm.block_fp8_linear_small_m(x, w, s, split_k=split_k, reduce="kernel")
        for _ in range(50):
            assert torch.equal(sm.block_fp8_linear_small_m(x, w, s, split_k=split_k, reduce="last"), want), cfg
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = sm.block_fp8_linear_small_m(x, w, s, split_k=split_k, reduce="last")
        for _ in range(50):
            static_y.zero_()
            g.replay()
            assert torch.equal(static_y, want), cfg
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in sm._counters.values())


def test_programmatic_dependent_launch_keeps_the_chain_order(mods):
    """pdl=True (the kernel starts launching its successor at once and waits for its predecessor before
    its first load): a chain where each call reads the previous call's output must give the plain launches'
    bits, eagerly and as a CUDA-graph replay (a missing wait would read a stale or half-written x)."""
    sm, _ = mods
    if _sm() < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    n = k = 2048
    layers = [dense_fp8_case(1, n, k, device=DEV, seed=i)[1:] for i in range(6)]
    x0 = torch.randn(1, k, device=DEV, dtype=BF16)

    def chain(x, pdl):
        # the next call reads this output: directly (PDL kernel after PDL kernel) or through a residual add
        for i, (w, s) in enumerate(layers):
            y = sm.block_fp8_linear_small_m(x, w, s, pdl=pdl)
            x = y if i % 2 == 0 else y * 0.5 + x
        return x
    want = chain(x0, False)
    for _ in range(20):
        assert torch.equal(chain(x0, True), want)
    static_x = x0.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = chain(static_x, True)
    for _ in range(20):
        static_y.zero_()
        g.replay()
        assert torch.equal(static_y, want)


def test_last_reduction_on_two_lanes_concurrently(mods):
    """reduce="last" keeps its arrival counters per stream lane (kernels/streams.py): the same launches
    running concurrently on the main stream and a side stream, many times, stay exact."""
    from glm_ray.kernels import streams
    sm, _ = mods
    n, k = 2048, 8192
    _, w, s = dense_fp8_case(1, n, k, device=DEV)
    xs = [torch.randn(4, k, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    want = [sm.block_fp8_linear_small_m(x, w, s, split_k=8, reduce="kernel") for x in xs]
    side = streams.side_stream_for(xs[1], 64)
    for _ in range(50):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with streams.on_side(side):
            got_side = sm.block_fp8_linear_small_m(xs[1], w, s, split_k=8, reduce="last")
        got_main = sm.block_fp8_linear_small_m(xs[0], w, s, split_k=8, reduce="last")
        main.wait_stream(side)
        assert torch.equal(got_main, want[0]) and torch.equal(got_side, want[1])
    torch.cuda.synchronize()
    assert len([key for key in sm._counters if key[0] == "cuda"]) >= 2    # one buffer per lane
    assert all(int(c.abs().sum()) == 0 for c in sm._counters.values())
