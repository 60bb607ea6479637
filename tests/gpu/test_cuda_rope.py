"""The `rope_inplace` kernel (kernels/cuda/rope.py) through `CudaKernels.rope_inplace` on the GPU at the real
query shapes (MLA: h = 32 / 64, 192 + 64, rope last; the DSA indexer: 32 x 128, rope first; T = 1 / 64 /
2048), against the torch reference on the same GPU and on the CPU, bit-exact (every rounding point of
apply_rope is reproduced), and under CUDA-graph capture + replay. No op may fall back to the reference."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.torch_ref.rope import rope_inplace as ref  # noqa: E402
from tests.kernels.test_cache_write_ops import rope_cache  # noqa: E402


@pytest.fixture(autouse=True)
def _no_fallbacks(no_fallbacks):                      # tests/gpu/conftest.py
    yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("h,d,start", [(32, 256, 192), (64, 256, 192), (32, 128, 0)])
def test_rope_inplace_equals_reference(ck, dtype, T, h, d, start):
    rope = rope_cache(T, 64, dtype, seed=T)
    q = (torch.randn(T, h, d, generator=torch.Generator().manual_seed(h)) * 3).to(dtype)
    cpu = q.clone()
    ref(cpu, rope.cos, rope.sin, True, start)
    gpu_ref, got = q.cuda(), q.cuda()
    cos, sin = rope.cos.cuda(), rope.sin.cuda()
    ref(gpu_ref, cos, sin, True, start)
    ck.rope_inplace(got, cos, sin, True, start)
    assert torch.equal(got, gpu_ref)
    assert torch.equal(got.cpu(), cpu)


def test_rope_inplace_in_a_cuda_graph(ck):
    T, h, d, start = 64, 32, 256, 192
    rope = rope_cache(T, 64, torch.bfloat16, seed=9)
    cos, sin = rope.cos.cuda(), rope.sin.cuda()
    q = torch.zeros(T, h, d, dtype=torch.bfloat16, device="cuda")
    src = (torch.randn(T, h, d) * 3).to(torch.bfloat16).cuda()
    q.copy_(src)
    ck.rope_inplace(q, cos, sin, True, start)                     # warm-up (compile) outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ck.rope_inplace(q, cos, sin, True, start)
    q.copy_(src)
    g.replay()
    want = src.clone()
    ref(want, cos, sin, True, start)
    assert torch.equal(q, want)
