"""The tensor-parallel group of this process: rank, size and the two collectives layers use.

Initialized once per worker (`init_tensor_parallel`); with TP=1 nothing is initialized and the
collectives are identities. Collectives go over torch.distributed (NCCL on CUDA, RCCL via the
"nccl" backend name on ROCm, gloo on CPU), never over Ray.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    backend: str | None = None


_TP = TPState()


def init_tensor_parallel(rank: int, size: int, init_method: str, device_type: str) -> TPState:
    """Join the TP group. `init_method` is e.g. "tcp://127.0.0.1:29500" (rank 0's address)."""
    global _TP
    if size == 1:
        _TP = TPState()
        return _TP
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    _TP = TPState(rank=rank, size=size, backend=backend)
    logger.info("TP rank %d/%d joined (%s)", rank, size, backend)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPState()


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP ranks, in place when possible."""
    if _TP.size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
