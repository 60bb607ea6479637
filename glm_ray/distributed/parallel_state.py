"""The tensor-parallel group of this process: rank, size and the two collectives layers use.

Initialized once per worker (`init_tensor_parallel`); with TP=1 nothing is initialized and the
collectives are identities. Collectives go over torch.distributed (NCCL on CUDA, RCCL via the
"nccl" backend name on ROCm, gloo on CPU), never over Ray. With TP>1 a second group on gloo over
the same ranks (`cpu_group()`) carries host-side messages: rank 0 hands each engine step to the
other ranks over it (worker/step_channel.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    backend: str | None = None


_TP = TPState()

# NOTE: the host-message group's timeout differs per rank, on purpose. Rank 0 only waits on the others
# inside a step, so a lost rank must turn into an exception there, not a hang (gloo raises at once when
# the peer's process died and its sockets closed; after this long when it hangs or its host vanished).
# The other ranks wait in `recv` for as long as the engine idles, so they must not time out there: a
# dead rank 0 closes its sockets, which ends their wait at once.
CPU_GROUP_TIMEOUT_S = 120.0
FOLLOWER_CPU_GROUP_TIMEOUT_S = 30 * 24 * 3600.0    # 30 days: finite, so `now + timeout` fits a ns clock

_CPU_GROUP: dist.ProcessGroup | None = None


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
    global _TP, _CPU_GROUP
    if size == 1:
        _TP = TPState()
        _CPU_GROUP = None
        return _TP
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    timeout = CPU_GROUP_TIMEOUT_S if rank == 0 else FOLLOWER_CPU_GROUP_TIMEOUT_S
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    _TP = TPState(rank=rank, size=size, backend=backend)
    logger.info("TP rank %d/%d joined (%s)", rank, size, backend)
    return _TP


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def cpu_group() -> dist.ProcessGroup | None:
    """The gloo group over the TP ranks for host-side messages (None at TP=1)."""
    return _CPU_GROUP


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


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`x` from TP rank `src` to every rank, in place (on CUDA queued on the stream: no host wait)."""
    if _TP.size > 1:
        dist.broadcast(x, src=src)
    return x
