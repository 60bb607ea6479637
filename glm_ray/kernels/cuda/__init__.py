"""The "cuda" kernel backend (NVIDIA Hopper, sm_90; parts run on sm_80+).

* `layout.py` — pure torch: `_scaled_mm` weight padding (the torch 2.11 K/128 % 4 trap, N % 128),
  the sorted/grouped MoE dispatch, tile-config heuristics (CPU-testable).
* `triton_kernels.py` — the Triton kernels (imports triton): 1x128 FP8 activation quant, the two
  grouped MoE stages (bf16 / block-FP8 W8A8 / MXFP4 W4A16 with optional W4A4 activation qdq), MXFP4 qdq.
* `ops.py` — `CudaKernels`, the KernelOps fields with their per-op fallbacks (see its table).

Compiles belong at start-up, not inside a step (a compile is seconds; `compile_log.py` records them).
So sizes that change from step to step (token and row counts, context lengths, bitmap words, split
counts) are runtime arguments marked `do_not_specialize` — Triton otherwise compiles one variant per class
of each integer (== 1, divisible by 16, other) — and a constexpr is only ever a model dimension, a tile
config or a flag from a small fixed set. Strides stay specialized (fixed per model). (On the H200 an eager
mixed step took 4.1-4.3 s with the size arguments specialized or not; the split-count constexpr of
`mla_decode.py`, made a runtime argument afterwards, is the suspect, not yet re-measured.)

Neither this package nor `ops.py` imports triton at import time; `make_ops()` (called by
`kernels.init_backend` when this backend is selected) does, and degrades to the torch reference for the
Triton ops, logged, when it cannot.
"""
from glm_ray.kernels.cuda.ops import CudaKernels, make_ops

__all__ = ["CudaKernels", "make_ops"]
