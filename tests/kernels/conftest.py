"""Fixtures of the kernel tests: the `cuda` backend's dispatch run on CPU tensors (Triton interpreted), and spies
on the kernel entry points it chooses between."""
from __future__ import annotations

import pytest


@pytest.fixture
def gpu_check_off(monkeypatch):
    """CudaKernels' per-call device check passes every call: its dispatch (sizes, dtypes, env thresholds) then runs
    on CPU tensors, the kernels under the Triton interpreter."""
    from glm_ray.kernels.cuda import CudaKernels
    monkeypatch.setattr(CudaKernels, "_gpu_reason", lambda self, t, min_sm, need_triton, op: None)


@pytest.fixture
def spy(monkeypatch):
    """spy(owner, name, record=...) -> calls: owner.name still runs, and each call first appends
    record(*args, **kwargs) (default 1) to the returned list."""
    def install(owner, name: str, record=lambda *a, **k: 1) -> list:
        calls, real = [], getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(record(*a, **k)) or real(*a, **k))
        return calls
    return install
