"""The per-token KV-cache write kernels (kernels/cuda/cache_write.py) through `CudaKernels.mla_kv_write` /
`CudaKernels.indexer_key_write` on the GPU at the real shapes (r = 512, dr = 64; di = 128, rope_dim = 64;
T = 1 / 64 / 2048 tokens scattered over a paged cache), against the torch references
(kernels/torch_ref/cache_write.py) on the same GPU and on the CPU, and under CUDA-graph capture + replay.
Every test asserts that no op fell back to the reference.

Tolerances (`assert_rows_match`, tests/kernels/test_cache_write_ops.py): bf16 rows equal except for
rare one-ulp flips where the norm statistics (sum order; torch's CUDA rms_norm / layer_norm use their own
reduction and rsqrt) put a value next to a bf16 rounding midpoint (<= 0.2% of the elements, each within
2 eps(bf16) * max|row|); fp32 within 2e-6. The rope itself is reproduced at every rounding point, and on
grid inputs the MLA row is bit-exact against the CPU reference.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.torch_ref import cache_write as ref  # noqa: E402
from tests.kernels.test_cache_write_ops import (  # noqa: E402
    EPS,
    assert_rows_match,
    cache,
    cos_sin,
    grid_input,
    indexer_case,
    mla_case,
    paged_slots,
    rope_cache,
)

DEV = "cuda"
BF16 = torch.bfloat16
R, DR, DI, ROPE_DIM = 512, 64, 128, 64
NUM_BLOCKS = 256                                     # 4096 slots of 16


@pytest.fixture(autouse=True)
def _no_fallbacks(no_fallbacks):                      # tests/gpu/conftest.py
    yield


def _gpu(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_cuda_mla_kv_write_matches_reference(ck, t, interleave, dtype):
    ckv, w, rope = mla_case(t, R, DR, dtype, seed=t)
    cos, sin = cos_sin(rope)
    slots = paged_slots(t, NUM_BLOCKS, seed=t)
    base = cache(NUM_BLOCKS, R + DR, dtype)
    out, want = base.to(DEV), base.to(DEV)
    ck.mla_kv_write(*_gpu(ckv, w), EPS, *_gpu(cos, sin), interleave, out, slots.to(DEV))
    ref.mla_kv_write(*_gpu(ckv, w), EPS, *_gpu(cos, sin), interleave, want, slots.to(DEV))   # torch on the GPU
    assert_rows_match(out, want, dtype)
    want_cpu = base.clone()
    ref.mla_kv_write(ckv, w, EPS, cos, sin, interleave, want_cpu, slots)                     # torch on the CPU
    assert_rows_match(out.cpu(), want_cpu, dtype)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_cuda_mla_kv_write_nope_and_fp32_weight(ck, t, interleave):
    """dr = 0 (GLM-5.3-Flash NoPE: cos / sin None) and an fp32 norm weight on bf16 activations."""
    ckv, w, _ = mla_case(t, R, 0, BF16, w_dtype=torch.float32, seed=t)
    slots = paged_slots(t, NUM_BLOCKS, seed=t)
    out, want = cache(NUM_BLOCKS, R, BF16).to(DEV), cache(NUM_BLOCKS, R, BF16)
    ck.mla_kv_write(*_gpu(ckv, w), EPS, None, None, interleave, out, slots.to(DEV))
    ref.mla_kv_write(ckv, w, EPS, None, None, interleave, want, slots)
    assert_rows_match(out.cpu(), want, BF16)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_cuda_mla_kv_write_bit_exact_on_grid_inputs(ck, t, interleave, dtype):
    ckv, (_, w, rope) = grid_input(t, R + DR, dtype, seed=t), mla_case(t, R, DR, dtype, seed=t)
    slots = paged_slots(t, NUM_BLOCKS, seed=t)
    base = cache(NUM_BLOCKS, R + DR, dtype)
    out, want = base.to(DEV), base.clone()
    ck.mla_kv_write(*_gpu(ckv, w), EPS, *_gpu(*cos_sin(rope)), interleave, out, slots.to(DEV))
    ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, want, slots)                   # CPU reference
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rope_dim", [ROPE_DIM, 0])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_cuda_indexer_key_write_matches_reference(ck, t, interleave, rope_dim, dtype):
    k, lw, lb = indexer_case(t, DI, dtype, seed=t)
    cos, sin = cos_sin(rope_cache(t, rope_dim, dtype, seed=t) if rope_dim else None)
    slots = paged_slots(t, NUM_BLOCKS, seed=t)
    base = cache(NUM_BLOCKS, DI, dtype)
    out, want = base.to(DEV), base.to(DEV)
    args = (*_gpu(k, lw, lb), EPS, *_gpu(cos, sin), rope_dim, interleave)
    ck.indexer_key_write(*args, out, slots.to(DEV))
    ref.indexer_key_write(*args, want, slots.to(DEV))                                         # torch on the GPU
    assert_rows_match(out, want, dtype)
    want_cpu = base.clone()
    ref.indexer_key_write(k, lw, lb, EPS, cos, sin, rope_dim, interleave, want_cpu, slots)   # torch on the CPU
    assert_rows_match(out.cpu(), want_cpu, dtype)


def test_cuda_cache_writes_graph_replay(ck):
    """Captured with static buffers, replayed after inputs, cos / sin and slots changed in place: equal to
    eager runs of the kernels."""
    t = 64
    ckv, w, rope = mla_case(t, R, DR, BF16, seed=1)
    ckv, w = _gpu(ckv, w)
    k, lw, lb = _gpu(*indexer_case(t, DI, BF16, seed=1))
    cos, sin = rope.cos.to(DEV), rope.sin.to(DEV)
    slots = paged_slots(t, NUM_BLOCKS, seed=1).to(DEV)
    kv, kc = cache(NUM_BLOCKS, R + DR, BF16).to(DEV), cache(NUM_BLOCKS, DI, BF16).to(DEV)

    def step():
        ck.mla_kv_write(ckv, w, EPS, cos, sin, True, kv, slots)
        ck.indexer_key_write(k, lw, lb, EPS, cos, sin, ROPE_DIM, False, kc, slots)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                             # warm-up: compile outside capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ckv2, _, rope2 = mla_case(t, R, DR, BF16, seed=2)
    ckv2 = ckv2.to(DEV)
    k2 = indexer_case(t, DI, BF16, seed=2)[0].to(DEV)
    ckv.copy_(ckv2)
    k.copy_(k2)
    cos.copy_(rope2.cos)
    sin.copy_(rope2.sin)
    slots.copy_(paged_slots(t, NUM_BLOCKS, seed=2).to(DEV))
    kv_e, kc_e = kv.clone(), kc.clone()
    graph.replay()
    ck.mla_kv_write(ckv, w, EPS, cos, sin, True, kv_e, slots)
    ck.indexer_key_write(k, lw, lb, EPS, cos, sin, ROPE_DIM, False, kc_e, slots)
    torch.cuda.synchronize()
    assert torch.equal(kv, kv_e) and torch.equal(kc, kc_e)
