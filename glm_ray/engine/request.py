"""A request as the engine tracks it: tokens, progress, KV blocks, sampling state, timings."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from glm_ray.engine.outputs import LogprobDict
from glm_ray.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                                   # resolved (never None)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[LogprobDict] | None = None
    prompt_logprobs: list[LogprobDict | None] | None = None
    num_computed_tokens: int = 0                      # tokens whose KV is in the cache (or being computed)
    num_inflight: int = 0                             # async scheduling: sampled tokens not read back yet
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0                    # leading blocks in the prefix cache (-1: chain stopped)
    num_cached_tokens: int | None = None              # prompt tokens found in the prefix cache (first admission)
    state_slot: int | None = None                     # row in the recurrent-state caches while running
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    sent_to_workers: bool = False                     # workers hold a state for it
    blocks_reset: bool = True                         # next step sends the full block table
    prompt_logprobs_done: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.output_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
