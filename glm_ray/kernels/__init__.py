"""Kernel backends behind one registry, resolved once at start-up.

Model, layer and quant code call `kernels.ops().<op>(...)`; they never ask which device or vendor
they run on (nor import `torch_ref` directly). A backend is a `KernelOps` table; `torch` (pure
PyTorch, CPU or GPU) is complete and is the oracle every other backend is tested against. `cuda`
(Hopper) and `aiter` (gfx950) override what they accelerate and inherit the rest. `auto` picks by
device/arch and is logged once.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import fields, replace
from typing import Callable

import torch

from glm_ray import envs
from glm_ray.kernels import aiter, cuda
from glm_ray.kernels.table import KernelOps
from glm_ray.kernels.torch_ref import attention, block_fp8_linear, cache_write, fused_moe, indexer, kda
from glm_ray.kernels.torch_ref import quant_ops as q
from glm_ray.kernels.torch_ref.linear import fp32_linear
from glm_ray.kernels.torch_ref.mhc import mhc_coefficients
from glm_ray.kernels.torch_ref.moe import swiglu
from glm_ray.kernels.torch_ref.norm import rms_norm
from glm_ray.kernels.torch_ref.rope import rope_inplace
from glm_ray.kernels.torch_ref.routing import moe_routing

logger = logging.getLogger(__name__)


_REGISTRY: dict[str, Callable[[], KernelOps]] = {}
_ACTIVE: KernelOps | None = None


def register(name: str):
    def deco(factory: Callable[[], KernelOps]):
        _REGISTRY[name] = factory
        return factory
    return deco


def _torch_ops() -> KernelOps:
    return KernelOps(name="torch", block_fp8_linear=block_fp8_linear, fused_moe=fused_moe,
                     block_fp8_linear_prepare=q.block_fp8_linear_prepare, moe_quant_layout=q.moe_quant_layout,
                     moe_quant_prepare=q.moe_quant_prepare, fused_moe_block_fp8=q.fused_moe_block_fp8,
                     fused_moe_mxfp4=q.fused_moe_mxfp4, mxfp4_linear=q.mxfp4_linear,
                     mhc_coefficients=mhc_coefficients, kda_decode=kda.kda_decode,
                     mla_prefill=attention.mla_prefill, mla_decode=attention.mla_decode,
                     indexer_topk=indexer.indexer_topk, indexer_kpool_topk=indexer.indexer_kpool_topk,
                     causal_conv1d=kda.causal_conv1d_cached, kda_chunked=kda.kda_chunked_cached, swiglu=swiglu,
                     moe_routing=moe_routing, fp32_linear=fp32_linear, rms_norm=rms_norm,
                     mla_kv_write=cache_write.mla_kv_write,
                     indexer_key_write=cache_write.indexer_key_write, rope_inplace=rope_inplace)


def _aiter_ops() -> KernelOps:
    # NOTE: make_ops imports the `aiter` package, i.e. only when this backend is selected.
    return aiter.make_ops()


def _cuda_ops() -> KernelOps:
    # NOTE: make_ops imports triton, i.e. only when this backend is selected.
    return cuda.make_ops()


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


register("torch")(_torch_ops)
register("aiter")(_aiter_ops)
register("cuda")(_cuda_ops)


def resolve_backend_name(name: str, device_type: str) -> str:
    if name != "auto":
        return name
    if device_type == "cuda":
        if getattr(torch.version, "hip", None):
            return "aiter" if "aiter" in _REGISTRY and _module_available("aiter") else "torch"
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
    # Inherit anything the backend does not override from the torch reference; GLM_RAY_TORCH_OPS
    # (comma-separated op names) sends chosen ops to the reference too: A/B of one kernel in a run.
    op_names = {f.name for f in fields(KernelOps)} - {"name"}
    forced = set(envs.TORCH_OPS.get())
    if forced - op_names:
        raise ValueError(f"GLM_RAY_TORCH_OPS: unknown op(s) {sorted(forced - op_names)}; known: {sorted(op_names)}")
    take = {n: getattr(base, n) for n in op_names if n in forced or getattr(ops, n) is None}
    _ACTIVE = replace(ops, **take) if take else ops
    logger.info("kernel backend: %s (requested %s, device %s)%s", _ACTIVE.name, name, device_type,
                f"; torch reference for {sorted(forced)}" if forced else "")
    return _ACTIVE


__all__ = ["KernelOps", "init_backend", "ops", "register", "resolve_backend_name"]


def ops() -> KernelOps:
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = _torch_ops()
    return _ACTIVE
