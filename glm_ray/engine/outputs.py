"""The wire contract between the engine (or the Router deployment) and its callers.

`TokenDelta` is what the engine emits per request per step (a diff: only the new tokens), and
what the Router deployment streams to the ingress. `RequestOutput`/`CompletionOutput` are the
accumulated, vLLM-shaped results returned by the offline `LLM.generate`.
Everything here is plain data (picklable, no tensors) so it crosses Ray process boundaries cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: {token_id: logprob}, the sampled/actual token first, then the top-k.
LogprobDict = dict[int, float]


@dataclass
class TokenDelta:
    request_id: str
    new_token_ids: list[int]                          # tokens produced this step (usually 1)
    new_text: str = ""                                # detokenized text for them (stop strings already cut)
    new_logprobs: list[LogprobDict] | None = None     # one dict per new token when logprobs requested
    finished: bool = False
    finish_reason: str | None = None                  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None              # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobDict | None] | None = None   # sent once, with the first delta
    error: str | None = None                          # set with finish_reason "error": one line for the client
    error_type: str | None = None                     # "engine_error" | "out_of_memory" (errors.request_failure)
    # Timing (monotonic seconds, engine clock) for metrics: arrival and first scheduling; the first token's
    # time only on the delta that carries a request's first token.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Where the first token's time went, set on its way out (serve/ttft_split.py): seconds per part
    ttft_parts: dict[str, float] | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobDict] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids)))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[LogprobDict | None] | None = None
    finished: bool = False


def carries_tokens(d) -> bool:
    """`d` is a token delta that may be merged with its neighbours (`merge_deltas`): not an exception, not
    None (a stream's end), not an error delta."""
    return isinstance(d, TokenDelta) and d.finish_reason != "error"


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """`a` then `b` (the next delta of the same request) as one delta: what a stream consumer that fell
    behind the engine takes in one chunk, as vLLM's output collector merges a slow client's backlog.
    Neither may be an error delta; `a` is not finished (nothing follows a finished delta)."""
    lps = None if a.new_logprobs is None and b.new_logprobs is None else \
        (a.new_logprobs or []) + (b.new_logprobs or [])
    return TokenDelta(
        request_id=a.request_id, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
        new_logprobs=lps, finished=b.finished, finish_reason=b.finish_reason, stop_reason=b.stop_reason,
        num_prompt_tokens=b.num_prompt_tokens or a.num_prompt_tokens,
        num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        error=b.error, error_type=b.error_type, arrival_time=a.arrival_time,
        first_scheduled_time=a.first_scheduled_time if a.first_scheduled_time is not None else b.first_scheduled_time,
        first_token_time=a.first_token_time if a.first_token_time is not None else b.first_token_time,
        ttft_parts=a.ttft_parts if a.ttft_parts is not None else b.ttft_parts)
