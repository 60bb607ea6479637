"""Pure-PyTorch reference kernels: the CPU backend and the oracle for every kernel test."""
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear
from glm_ray.kernels.torch_ref.moe import fused_moe, fused_moe_naive, swiglu

__all__ = ["fused_moe", "fused_moe_naive", "swiglu", "block_fp8_linear"]
