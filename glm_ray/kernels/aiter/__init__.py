"""The "aiter" kernel backend (gfx950 / MI355X), written against ROCm/aiter's Python API as documented
in ROCm/aiter's own docs and tests (dense block-FP8 GEMM with bpreshuffle, the e8m0 scale shuffle,
fused MoE). `aiter` is imported by `make_ops()` only, i.e. only when this backend is selected.

What aiter has no op for (MLA prefill, the DSA indexer, the unquantized MoE, norms, rope, ...) runs the cuda
backend's plain-Triton kernels (`cuda.ops.ROCM_PORTABLE`), and the rest the torch reference
(`kernels.init_backend`).
"""
from glm_ray.kernels.aiter.ops import AiterKernels, make_ops

__all__ = ["AiterKernels", "make_ops"]
