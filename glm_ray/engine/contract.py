"""The messages between the engine and its executor, and the `Executor` protocol the engine talks to.

Per step the engine sends one `SchedulerOutput` — a diff: new requests once, new block ids, finished
ids — to every rank, and gets back one `ModelRunnerOutput` (rank 0's sampled tokens and logprobs, and
the requests that failed in this step on any rank). Everything here is plain data (picklable, no
tensors): it crosses Ray process boundaries on every step. This module is the bottom of the engine:
workers import it (and sampling_params / outputs / errors), never the engine core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from glm_ray.engine.outputs import LogprobDict
from glm_ray.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class ScheduledSeq:
    req_id: str
    token_ids: list[int]              # tokens to compute this step (a prefill chunk, or 1 for decode)
    start_pos: int                    # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]              # new blocks; the whole table when `reset_blocks`
    reset_blocks: bool
    sample: bool                      # this chunk ends at the request's last token -> sample next
    prompt_logprobs: bool = False     # compute prompt logprobs over this chunk
    state_slot: int = 0               # row of the request in the recurrent-state caches


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)   # workers drop their state
    num_preempted: int = 0
    # async scheduling at TP > 1: the next step's decode tokens are placeholders, so rank 0 broadcasts this
    # step's sampled ids to every rank's device (ModelRunner._share_tokens)
    share_tokens: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepFailure:
    """Why a request failed in this step: `kind` "oom" | "error" (faults.classify), `message` one line."""
    kind: str
    message: str


@dataclass
class ModelRunnerOutput:
    """What rank 0 returns for one step (plain data); other ranks return None, or this with `failed` set."""
    sampled: dict[str, int] = field(default_factory=dict)                      # req_id -> token
    logprobs: dict[str, LogprobDict] = field(default_factory=dict)             # req_id -> {tok: lp}
    prompt_logprobs: dict[str, list[LogprobDict]] = field(default_factory=dict)  # req_id -> per target pos
    failed: dict[str, StepFailure] = field(default_factory=dict)               # req_id -> why it failed
    timings: dict[str, float] = field(default_factory=dict)                    # seconds: prepare/forward/sample


class Executor(Protocol):
    """Runs steps on the model's ranks: in-process (`worker.executor.LocalExecutor`) or one Ray actor per
    rank (`worker.worker_group.RayWorkerGroup`)."""
    num_blocks: int                     # KV-cache blocks every rank allocated (the engine's block pool)
    model_cfg: object                   # the loaded ModelConfig (vocab, context limits, EOS ids)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...
