"""The "cuda" kernel backend (NVIDIA Hopper, sm_90; parts run on sm_80+).

* `layout.py` — pure torch: `_scaled_mm` weight padding (the torch 2.11 K/128 % 4 trap, N % 128),
  the sorted/grouped MoE dispatch, tile-config heuristics (CPU-testable).
* `triton_kernels.py` — the Triton kernels (imports triton): 1x128 FP8 activation quant, the two
  grouped MoE stages (bf16 / block-FP8 W8A8 / MXFP4 W4A16 with optional W4A4 activation qdq), MXFP4 qdq.
* `ops.py` — `CudaKernels`, the KernelOps fields with their per-op fallbacks (see its table).

Sizes that change from step to step (token and row counts, context lengths, bitmap words) are
`do_not_specialize` in every kernel: Triton otherwise compiles one variant per class of each integer
argument (== 1, divisible by 16, other), so an eager prefill or mixed step with a new combination stalled
for seconds while it compiled (seen on the H200: a 4.3 s mixed step in `scripts/profile_step.py`).
Strides and model dimensions stay specialized (fixed per model).

Neither this package nor `ops.py` imports triton at import time; `make_ops()` (called by
`kernels.init_backend` when this backend is selected) does, and degrades to the torch reference for the
Triton ops, logged, when it cannot.
"""
from glm_ray.kernels.cuda.ops import CudaKernels, make_ops

__all__ = ["CudaKernels", "make_ops"]
