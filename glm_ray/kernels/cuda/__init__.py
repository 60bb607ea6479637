"""The "cuda" kernel backend (NVIDIA Hopper, sm_90; parts run on sm_80+).

* `layout.py` — pure torch: `_scaled_mm` weight padding (the torch 2.11 K/128 % 4 trap, N % 128),
  the sorted/grouped MoE dispatch, tile-config heuristics (CPU-testable).
* `triton_kernels.py` — the Triton kernels (imports triton): 1x128 FP8 activation quant, the two
  grouped MoE stages (bf16 / block-FP8 W8A8 / MXFP4 W4A16 with optional W4A4 activation qdq), MXFP4 qdq.
* `ops.py` — `CudaKernels`, the KernelOps fields with their per-op fallbacks (see its table).

Neither this package nor `ops.py` imports triton at import time; `make_ops()` (called by
`kernels.init_backend` when this backend is selected) does, and degrades to the torch reference for the
Triton ops, logged, when it cannot.
"""
from glm_ray.kernels.cuda.ops import CudaKernels, make_ops

__all__ = ["CudaKernels", "make_ops"]
