"""Host-side TMA tensor descriptors (`triton.tools.tensor_descriptor`, NVIDIA Hopper and later) for kernels that
can load their tiles either way: the NVIDIA-only half of them, so that a module the ROCm Triton path also runs
(`ROCM_PORTABLE` in ops.py) takes the descriptors from its caller and never imports this one."""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor of the whole of `t` (its shape and strides) with box `block`."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def mla_key_descriptors(kv: torch.Tensor, pe: torch.Tensor, block_n: int, dn1: int, block_dn2: int, block_dr: int,
                        block_dv: int) -> tuple:
    """The MLA prefill kernel's key boxes (`mla_prefill.mla_prefill_varlen(key_descriptors=...)`): kv [N, h, dn+dv]
    viewed [N, h*(dn+dv)] with boxes [BN, DN1] / [BN, BLOCK_DN2] / [BN, BLOCK_DV] (a head's k_nope parts and v at
    its column), the rope rows pe [N, dr] with [BN, BLOCK_DR] -> (k1, k2, v, pe); a part the head does not have
    (dn2 = 0, dr = 0) repeats k1 (never loaded)."""
    kv2 = kv.reshape(kv.shape[0], -1)                                          # [N, h*(dn+dv)] (a view)
    k1 = descriptor(kv2, [block_n, dn1])
    return (k1, descriptor(kv2, [block_n, block_dn2]) if block_dn2 else k1, descriptor(kv2, [block_n, block_dv]),
            descriptor(pe, [block_n, block_dr]) if block_dr else k1)


__all__ = ["descriptor", "mla_key_descriptors"]
