"""The tensor-parallel group of this process: rank, size and the two collectives layers use.

Initialized once per worker (`init_tensor_parallel`); with TP=1 nothing is initialized and the
collectives are identities. Collectives go over torch.distributed (NCCL on CUDA, RCCL via the
"nccl" backend name on ROCm, gloo on CPU), never over Ray.
"""
from __future__ import annotations

import logging
import time
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


class CollectiveTimer:
    """Opt-in timing of the TP collectives of one step (measurement runs only: on CUDA it records
    events and reads them after the step's own host sync)."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self._spans: list = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, t0) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._spans.append((t0, ev))
        else:
            self._spans.append(time.perf_counter() - t0)

    def collect(self) -> float:
        """Seconds spent in collectives since the last call."""
        spans, self._spans = self._spans, []
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return float(sum(spans))


_TIMER: CollectiveTimer | None = None


def enable_collective_timing(device_type: str) -> CollectiveTimer:
    global _TIMER
    _TIMER = CollectiveTimer(device_type)
    return _TIMER


def collective_timer() -> CollectiveTimer | None:
    return _TIMER


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


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP ranks, in place when possible."""
    if _TP.size == 1:
        return x
    if _TIMER is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):   # no timing in a graph
        dist.all_reduce(x)
        return x
    t0 = _TIMER.start()
    dist.all_reduce(x)
    _TIMER.stop(t0)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    t0 = _TIMER.start() if _TIMER is not None else None
    dist.all_gather(parts, x.contiguous())
    if _TIMER is not None:
        _TIMER.stop(t0)
    return torch.cat(parts, dim=dim)
