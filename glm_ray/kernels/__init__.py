"""Kernel backends behind one registry, resolved once at start-up.

Model and quant code call `kernels.ops().<op>(...)`; they never ask which device or vendor they
run on. A backend is a `KernelOps` table; `torch` (pure PyTorch, CPU or GPU) is complete and is the
oracle every other backend is tested against. `cuda` (Hopper) and `aiter` (gfx950) override what
they accelerate and inherit the rest. `auto` picks by device/arch and is logged once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelOps:
    name: str
    # y[T, N] = dequant(x)[T, K] @ dequant(w)[N, K].T ; w e4m3 [N, K], w_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]
    block_fp8_linear: Callable
    # routed experts; x [T, D], w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], topk_* [T, K] -> [T, D]
    fused_moe: Callable


_REGISTRY: dict[str, Callable[[], KernelOps]] = {}
_ACTIVE: KernelOps | None = None


def register(name: str):
    def deco(factory: Callable[[], KernelOps]):
        _REGISTRY[name] = factory
        return factory
    return deco


def _torch_ops() -> KernelOps:
    from glm_ray.kernels.torch_ref import block_fp8_linear, fused_moe
    return KernelOps(name="torch", block_fp8_linear=block_fp8_linear, fused_moe=fused_moe)


register("torch")(_torch_ops)


def resolve_backend_name(name: str, device_type: str) -> str:
    if name != "auto":
        return name
    if device_type == "cuda":
        import torch
        if getattr(torch.version, "hip", None):
            return "aiter" if "aiter" in _REGISTRY else "torch"
        return "cuda" if "cuda" in _REGISTRY else "torch"
    return "torch"


def init_backend(name: str = "auto", device_type: str = "cpu") -> KernelOps:
    """Resolve and install the process-wide backend (called once per worker)."""
    global _ACTIVE
    resolved = resolve_backend_name(name, device_type)
    if resolved not in _REGISTRY:
        raise ValueError(f"unknown kernel backend {resolved!r}; known: {sorted(_REGISTRY)}")
    base = _torch_ops()
    ops = _REGISTRY[resolved]()
    # Inherit anything the backend does not override from the torch reference.
    missing = {f.name: getattr(base, f.name) for f in fields(KernelOps) if getattr(ops, f.name) is None}
    _ACTIVE = replace(ops, **missing) if missing else ops
    logger.info("kernel backend: %s (requested %s, device %s)", _ACTIVE.name, name, device_type)
    return _ACTIVE


def ops() -> KernelOps:
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = _torch_ops()
    return _ACTIVE
