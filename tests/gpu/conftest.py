"""Fixtures of the kernel-level GPU tests: the `cuda` backend's `CudaKernels` (skipped without Triton) and
the check that a test made no op fall back to its torch reference (a silent fallback must not pass as a
kernel). Modules that need another backend configuration define their own `ck`."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ck():
    from glm_ray.kernels.cuda import CudaKernels  # noqa: PLC0415 (imports triton; GPU runs only)
    k = CudaKernels()
    if k.tk is None:
        pytest.skip(k.triton_error)
    return k


@pytest.fixture
def no_fallbacks(ck):
    ck.fallbacks.clear()
    yield
    assert not ck.fallbacks, f"reference fallbacks: {dict(ck.fallbacks)}"
    assert not ck.broken, ck.broken
