"""bench/kda.py's FLOP count against torch's own FLOP counter on the reference (CPU): the scan's four dots per
chunk exactly, and the whole call at least the counted matmuls (the counter does not count the triangular solve)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from glm_ray.bench import kda as bench
from glm_ray.kernels.torch_ref.kda import chunk_scan, chunk_terms


def test_scan_flops_match_torchs_counter():
    N, m, C, dk, dv = 3, 2, 64, 32, 16
    t = chunk_terms(torch.randn(N, m, C, dk), torch.randn(N, m, C, dk), torch.randn(N, m, C, dv),
                    -torch.rand(N, m, C, dk), torch.rand(N, m, C, 1), 8)
    with FlopCounterMode(display=False) as fc:
        chunk_scan(t, torch.zeros(N, dk, dv), torch.empty(N, m, C, dv))
    assert fc.get_total_flops() == N * m * (6 * C * dk * dv + 2 * C * C * dv)
    scan_only = bench.chunked_flops(1, C * m, N, dk, dv, C) - N * m * (4 * C * C * dk + C * C * (dk + dv))
    assert scan_only == fc.get_total_flops()


def test_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU check")
    with pytest.raises(SystemExit, match="needs CUDA"):
        bench.main(["--tokens", "64"])
