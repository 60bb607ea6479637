"""Rank 0 hands each engine step to the other TP ranks over torch.distributed (the gloo `cpu_group()`),
never over Ray: the transport of the engine-in-rank-0 mode (the engine loop runs in rank 0's process).

- `StepChannel`: `send` (rank 0) / `recv` (ranks 1..N-1) of one `SchedulerOutput` (None = stop), and
  `exchange_failures`, which every rank calls after its execute so rank 0 learns the requests that
  failed on any rank.
- `BroadcastExecutor`: the `engine.contract.Executor` of rank 0: send, run rank 0's own `Worker`,
  exchange failures, merge them into rank 0's output.
- `follow(worker, channel)`: the loop of ranks 1..N-1 (recv -> execute -> exchange) until the stop.

Wire format: the step is pickled into a fixed 64 KiB uint8 buffer (an int64 length header, then the
bytes) and sent with ONE gloo broadcast; a larger step (a prefill carrying long prompts) sends the
rest in a second broadcast whose size the header gave. Measured on the 2-core CPU box (two gloo
processes over loopback, a 64-sequence decode step = 5.9 KB pickled; median us per step, the failure
exchange included): fixed-buffer broadcast 740, `broadcast_object_list` 1210, a length all_reduce +
payload broadcast 1200; the failure exchange alone 340 (two processes on two busy cores: mostly
scheduling). A 1 KiB and a 256 KiB broadcast cost the same there, hence the generous buffer.

The failure exchange is one int32 all_reduce ("how many requests failed on any rank"); only when it is
nonzero do the failure dicts travel (`gather_object` to rank 0). So a normal step costs two small
gloo collectives.

Timeouts (distributed/parallel_state.py): rank 0's side of the group times out after
`CPU_GROUP_TIMEOUT_S` (a lost rank is an exception in `execute` / `check_health`, not a hang; a
killed rank's closed sockets raise at once); the other ranks wait in `recv` for as long as the engine
idles. NOTE: a rank lost in the middle of a real step may first stall rank 0 inside the model's own
collectives (NCCL), which this channel cannot see; `check_health` (an empty step: no forward) reaches
the gloo collectives directly.

Callers serialize `execute` / `check_health` / `shutdown` (one engine thread); a lock guards it anyway,
since interleaved collectives would pair the wrong messages.
"""
from __future__ import annotations

import logging
import pickle
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from glm_ray.distributed.parallel_state import cpu_group, tp_rank, tp_size
from glm_ray.engine.contract import ModelRunnerOutput, SchedulerOutput, StepFailure

if TYPE_CHECKING:
    from glm_ray.worker.worker import Worker

logger = logging.getLogger(__name__)

BUFFER_BYTES = 64 * 1024        # one broadcast carries steps up to this size (64-seq decode: ~6 KB)
_HEADER = 8                     # int64 payload length


class StepChannel:
    """One engine step from rank 0 to every other rank, and the failed requests back (gloo group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int | None = None):
        self.group = group if group is not None else cpu_group()
        if self.group is None:
            raise RuntimeError("StepChannel needs the TP host group (TP > 1, after init_tensor_parallel)")
        self.rank = tp_rank() if rank is None else rank
        self.size = dist.get_world_size(self.group)
        self._buf = torch.zeros(BUFFER_BYTES, dtype=torch.uint8)      # [BUFFER_BYTES], reused every step
        self._np = self._buf.numpy()                                   # the same memory
        self._count = torch.zeros(1, dtype=torch.int32)                # [1] failed requests, summed

    # ---- the step -----------------------------------------------------------------------------
    def send(self, step: SchedulerOutput | None) -> None:
        """Rank 0: hand `step` (None = stop) to every other rank."""
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        head = min(n, BUFFER_BYTES - _HEADER)
        self._np[:_HEADER].view(np.int64)[0] = n
        self._np[_HEADER:_HEADER + head] = np.frombuffer(data, dtype=np.uint8, count=head)
        dist.broadcast(self._buf, src=0, group=self.group)
        if n > head:                                                   # the rest: a second broadcast
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)   # [n - head]
            dist.broadcast(rest, src=0, group=self.group)

    def recv(self) -> SchedulerOutput | None:
        """Ranks 1..N-1: the next step from rank 0 (blocks while the engine idles); None = stop."""
        dist.broadcast(self._buf, src=0, group=self.group)
        n = int(self._np[:_HEADER].view(np.int64)[0])
        head = min(n, BUFFER_BYTES - _HEADER)
        if n == head:
            return pickle.loads(self._np[_HEADER:_HEADER + n])
        rest = torch.empty(n - head, dtype=torch.uint8)                # [n - head]
        dist.broadcast(rest, src=0, group=self.group)
        return pickle.loads(self._np[_HEADER:_HEADER + head].tobytes() + rest.numpy().tobytes())

    # ---- the failures back --------------------------------------------------------------------
    def exchange_failures(self, out: ModelRunnerOutput | None) -> dict[str, StepFailure]:
        """Every rank, after its execute: the requests that failed this step on any rank (on rank 0;
        the others get {}). One int32 all_reduce; the dicts travel only when something failed."""
        failed = out.failed if out is not None else {}
        self._count.fill_(len(failed))
        dist.all_reduce(self._count, group=self.group)
        if int(self._count[0]) == 0:
            return {}
        gathered = [None] * self.size if self.rank == 0 else None
        dist.gather_object(failed, gathered, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if self.rank != 0:
            return {}
        union: dict[str, StepFailure] = {}
        for part in gathered:                                          # rank order: rank 0's reason wins
            for rid, failure in (part or {}).items():
                union.setdefault(rid, failure)
        return union


@dataclass
class _Launched:
    """A step rank 0 launched: its own pending step and the requests that failed on the other ranks."""
    pending: object
    remote_failures: dict[str, StepFailure]


class BroadcastExecutor:
    """The engine's executor on rank 0 (engine-in-rank-0 mode): each step goes to the other ranks over
    the channel, runs on rank 0's own `Worker` (device, model and cache already initialized), and
    comes back with the failures of every rank merged in."""

    def __init__(self, worker: Worker, channel: StepChannel):
        if channel.rank != 0:
            raise ValueError("BroadcastExecutor runs on rank 0; the other ranks run `follow`")
        self.worker = worker
        self.channel = channel
        runner = worker.runner
        self.num_blocks = runner.num_slots // runner.block_size           # what `init_cache` was given
        self.model_cfg = worker.model_cfg
        self._cuda = getattr(worker, "device", torch.device("cpu")).type == "cuda"
        self._lock = threading.Lock()
        self._closed = False

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(step))

    # async scheduling: the engine launches step N+1 before it collects step N. The collectives keep the
    # synchronous order on every rank (send, the step's forward, the failure exchange): the exchange
    # needs only the forward, which `launch` has run on every rank (rank 0's own sampling failures
    # stay on rank 0 and join in `collect`).
    def launch(self, step: SchedulerOutput) -> _Launched:
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor was shut down")
            if self._cuda:
                torch.cuda.set_device(self.worker.device)              # the engine loop runs on its own thread
            self.channel.send(step)
            try:
                pending = self.worker.launch(step)
            except BaseException:
                self.channel.exchange_failures(None)                   # keep the ranks in step, then surface it
                raise
            return _Launched(pending, self.channel.exchange_failures(None))

    def collect(self, launched: _Launched) -> ModelRunnerOutput:
        out = self.worker.collect(launched.pending)
        out = out if out is not None else ModelRunnerOutput()
        for rid, failure in launched.remote_failures.items():
            out.failed.setdefault(rid, failure)
            out.sampled.pop(rid, None)
            out.logprobs.pop(rid, None)
        return out

    def check_health(self) -> None:
        """An empty step through the same path; raises when a rank is gone (connection closed, timeout)."""
        self.execute(SchedulerOutput())

    def shutdown(self) -> None:
        """Stop the followers (their `follow` returns). Best effort: a rank already gone is logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.channel.send(None)
            except Exception as e:  # noqa: BLE001 - shutting down anyway; a dead rank cannot be stopped
                logger.warning("step channel: stop not delivered (%s: %s)", type(e).__name__, e)


def follow(worker: Worker, channel: StepChannel) -> None:
    """Ranks 1..N-1: run the steps rank 0 sends until it sends the stop. Transport errors (rank 0
    gone) propagate."""
    if channel.rank == 0:
        raise ValueError("follow runs on ranks 1..N-1; rank 0 runs the BroadcastExecutor")
    logger.info("rank %d/%d: following rank 0's steps", channel.rank, tp_size())
    while True:
        step = channel.recv()
        if step is None:
            logger.info("rank %d: stop received", channel.rank)
            return
        channel.exchange_failures(worker.execute(step))
