"""Per-request sampling parameters: the one typed object every layer above the model agrees on.

Owned here: field names and defaults (vLLM's, so users can carry their habits over) and validation.
Validation raises `ValueError` with a message fit for an HTTP 400; the ingress maps it to OpenAI's
error shape with `param` set to the offending field.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SamplingParams:
    n: int = 1                                  # choices per prompt (fanned out into n requests)
    temperature: float = 1.0                    # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1                             # -1 / 0 -> disabled
    min_p: float = 0.0
    seed: int | None = None                     # per-request generator: same seed -> same tokens
    repetition_penalty: float = 1.0             # HF/vLLM style: divides positive logits, multiplies negative
    presence_penalty: float = 0.0               # OpenAI style, over generated tokens
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16                 # None -> until the context is full
    min_tokens: int = 0                         # EOS / stop ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None                 # top-k logprobs per generated token (0 = only the sampled)
    prompt_logprobs: int | None = None          # top-k logprobs per prompt token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str):
            err = ValueError(msg)
            err.param = param  # type: ignore[attr-defined]
            raise err

        if self.n < 1:
            bad("n", f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (self.top_k < -1):
            bad("top_k", f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
