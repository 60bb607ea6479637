"""Failures of one step, as the worker reports them, and the test-only fault injection that provokes them.

`classify(exc)` sorts an exception raised inside a step into "oom" (the device or host allocator ran
out: the request may fit later, 503) or "error" (anything else, 500). The engine fails the requests
of the step with it and goes on; see EngineCore._fail_requests.

Fault injection, for the reliability suite only: `GLM_RAY_FAULT_INJECTION="exception@900,oom@901,sample@902"`
(comma-separated `KIND@TOKEN_ID`). `exception` / `oom`: a step whose computed tokens include TOKEN_ID
raises RuntimeError / torch.OutOfMemoryError just before the model forward, on every rank.
`sample`: the sampler raises for the row of a request whose prompt contains TOKEN_ID. Unset (the
default), `FaultInjector.from_env()` is None and the step pays nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm_ray import envs

ENV = envs.FAULT_INJECTION.name
KINDS = ("exception", "oom", "sample")


def classify(exc: BaseException) -> str:
    """"oom" for allocator failures (CUDA/HIP OOM, host allocation), else "error"."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom"
    text = str(exc)
    if isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text):
        return "oom"
    return "error"


class InjectedFault(RuntimeError):
    """Raised by the fault injector (never in production: GLM_RAY_FAULT_INJECTION is unset)."""


@dataclass(frozen=True)
class FaultInjector:
    exception_tokens: frozenset[int]
    oom_tokens: frozenset[int]
    sample_tokens: frozenset[int]

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector":
        sets: dict[str, set[int]] = {k: set() for k in KINDS}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            kind, sep, token = item.partition("@")
            if not sep or kind not in KINDS or not token.strip().isdigit():
                raise ValueError(f"{ENV}: bad entry {item!r}; expected KIND@TOKEN_ID with KIND in {KINDS}")
            sets[kind].add(int(token))
        return cls(frozenset(sets["exception"]), frozenset(sets["oom"]), frozenset(sets["sample"]))

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = envs.FAULT_INJECTION.get()
        return cls.parse(spec) if spec else None

    def before_forward(self, token_ids: list[int]) -> None:
        present = set(token_ids)
        if present & self.oom_tokens:
            raise torch.OutOfMemoryError("injected: CUDA out of memory (fault injection)")
        if present & self.exception_tokens:
            raise InjectedFault("injected: exception inside the forward (fault injection)")

    def before_sample(self, prompt_ids_per_row: list[list[int]]) -> None:
        """Raises if any row is poisoned (the runner then samples row by row to find which)."""
        if self.sample_tokens and any(self.sample_tokens.intersection(p) for p in prompt_ids_per_row):
            raise InjectedFault("injected: exception in the sampler (fault injection)")
