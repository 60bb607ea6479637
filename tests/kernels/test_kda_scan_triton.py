"""kernels/cuda/kda.py's `kda_chunk_scan` (the sequential part of the chunked KDA prefill, GLM_RAY_CUDA_KDA_SCAN=
triton) under TRITON_INTERPRET=1 against the torch reference's `chunk_scan`, through `kda_chunked` (several
batches of chunks, so the state is carried between launches), and the cuda backend's op wiring on CPU (the
reference there: no GPU). tests/gpu/test_cuda_kernels.py runs the compiled kernel."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter check is CPU-only (tests/gpu covers the compiled kernel)")

from glm_ray import kernels  # noqa: E402
from glm_ray.kernels.cuda.kda import kda_chunk_scan  # noqa: E402
from glm_ray.kernels.torch_ref.kda import chunk_scan, chunk_terms, kda_chunked, kda_chunked_cached  # noqa: E402
from tests.kernels.cases import kda_case  # noqa: E402


@pytest.mark.parametrize("dk,dv,L", [(16, 8, 150), (32, 40, 64), (128, 128, 130)])
def test_triton_scan_equals_the_torch_scan(dk, dv, L):
    """dv not a multiple of the value tile included (40); 130 rows = three chunks, the last one padded."""
    q, k, v, g, beta, s0 = kda_case(2, L, 2, dk, dv, dk + L)
    o_ref, s_ref = kda_chunked(q, k, v, g, beta, s0, max_bytes=1 << 20)
    o_got, s_got = kda_chunked(q, k, v, g, beta, s0, scan=kda_chunk_scan, max_bytes=1 << 20)
    torch.testing.assert_close(o_got, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)


def test_scan_writes_a_chunk_range_view_and_returns_the_state():
    """The contract kda_chunked relies on: o may be a chunk-range view of a larger output (only its chunks are
    written) and the returned state is the one after the range's last chunk."""
    q, k, v, g, beta, _ = kda_case(1, 256, 2, 16, 16, 3)
    N, n, C = 2, 4, 64
    def prep(x):
        return x.float().transpose(1, 2).reshape(N, n, C, x.shape[-1])
    from glm_ray.kernels.torch_ref.kda import l2norm
    t = chunk_terms(prep(l2norm(q) * 16 ** -0.5), prep(l2norm(k)), prep(v), prep(g), prep(beta[..., None]), 8)
    part = type(t)(**{f: getattr(t, f)[:, 1:3] for f in ("W", "U0", "Qd", "P", "Kd", "decay")})
    S0 = torch.randn(N, 16, 16)
    o_ref, o_got = torch.zeros(N, n, C, 16), torch.full((N, n, C, 16), 7.0)
    s_ref = chunk_scan(part, S0.clone(), o_ref[:, 1:3])
    s_got = kda_chunk_scan(part, S0.clone(), o_got[:, 1:3])
    torch.testing.assert_close(o_got[:, 1:3], o_ref[:, 1:3], rtol=1e-5, atol=1e-5)
    assert (o_got[:, 0] == 7.0).all() and (o_got[:, 3] == 7.0).all()
    torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)


def test_cuda_backend_op_on_cpu_is_the_reference(monkeypatch):
    """With GLM_RAY_CUDA_KDA_SCAN=triton the cuda backend still runs the reference for CPU tensors (a fallback
    with its reason), writing the cached state rows as the torch backend does."""
    monkeypatch.setenv("GLM_RAY_CUDA_KDA_SCAN", "triton")
    ck = kernels.init_backend("cuda")
    try:
        q, k, v, g, beta, _ = kda_case(2, 70, 2, 16, 8, 11)
        state = torch.randn(4, 2, 16, 8)
        slots, fresh = torch.tensor([2, 0]), torch.tensor([False, True])
        s_ref, s_got = state.clone(), state.clone()
        want = kda_chunked_cached(q, k, v, g, beta, s_ref, slots, fresh)
        got = ck.kda_chunked(q, k, v, g, beta, s_got, slots, fresh)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(s_got, s_ref)
        assert any(op == "kda_chunked" for op, _ in ck.kda_chunked.__self__.fallbacks)
    finally:
        kernels.init_backend("torch")
