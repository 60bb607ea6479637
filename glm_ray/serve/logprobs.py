"""Logprob rendering for the OpenAI API, testable without a server: the engine hands per-token dicts
`{token_id: logprob}` (the sampled/actual token first, then the top-k) and these functions render
OpenAI's completions shape (`tokens`/`token_logprobs`/`top_logprobs`/`text_offset`), its chat shape
(`content: [{token, logprob, bytes, top_logprobs}]`) and vLLM's `prompt_logprobs`.
"""
from __future__ import annotations

import math
from typing import Optional, Protocol

from glm_ray.serve.protocol import (
    MIN_LOGPROB,
)
from glm_ray.serve.responses import (
    ChatLogprobEntry,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


class TokenTexts(Protocol):
    """What the formatters need from a tokenizer (glm_ray.serve.detok.TokenStrings fits)."""

    def text(self, token_id: int) -> str: ...

    def bytes(self, token_id: int) -> bytes: ...


def clamp_logprob(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x) or x == -math.inf:
        return MIN_LOGPROB
    return max(x, MIN_LOGPROB)


def top_items(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token_id, logprob) pairs of one position, best first (stable on ties)."""
    if k <= 0:
        return []
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(token_ids: list[int], logprobs: list[Optional[dict[int, float]]],
                        k: int, tok: TokenTexts, initial_offset: int = 0) -> CompletionLogProbs:
    """Completions-API logprobs for a run of tokens.

    `logprobs[i]` is None for a position without logprobs (the first prompt token when echoing).
    `top_logprobs[i]` holds the top-k tokens by logprob plus the chosen token (so k or k+1
    entries; token strings that decode identically collapse). `text_offset` counts characters of
    the token strings from `initial_offset` (the length of text already returned for this choice).
    """
    out = CompletionLogProbs()
    offset = initial_offset
    for tid, lp in zip(token_ids, logprobs):
        s = tok.text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp_logprob(lp.get(tid)))
        top: dict[str, float] = {}
        for t, v in top_items(lp, k):
            top.setdefault(tok.text(t), clamp_logprob(v))
        if tid in lp:
            top.setdefault(s, clamp_logprob(lp[tid]))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[Optional[dict[int, float]]],
                  k: int, tok: TokenTexts) -> list[ChatLogprobEntry]:
    """Chat-API logprob entries: the chosen token plus exactly the top-k alternatives, best first."""
    entries = []
    for tid, lp in zip(token_ids, logprobs):
        lp = lp or {}
        entries.append(ChatLogprobEntry(
            token=tok.text(tid),
            logprob=clamp_logprob(lp.get(tid, MIN_LOGPROB)),
            bytes=list(tok.bytes(tid)),
            top_logprobs=[TopLogprob(token=tok.text(t), logprob=clamp_logprob(v), bytes=list(tok.bytes(t)))
                          for t, v in top_items(lp, k)],
        ))
    return entries


def format_prompt_logprobs(prompt_ids: list[int], plps: Optional[list[Optional[dict[int, float]]]],
                           k: int, tok: TokenTexts) -> Optional[PromptLogprobs]:
    """vLLM's `prompt_logprobs` shape: per prompt position None or {token_id: {logprob, rank, decoded_token}}
    holding the actual token and the top-k; `rank` is 1-based within what the engine returned
    (None for an actual token outside the top-k)."""
    if plps is None:
        return None
    out: PromptLogprobs = []
    for tid, lp in zip(prompt_ids, plps):
        if lp is None:
            out.append(None)
            continue
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])
        top = ranked[:k]
        entry: dict[int, PromptLogprob] = {}
        for r, (t, v) in enumerate(top, start=1):
            entry[t] = PromptLogprob(logprob=clamp_logprob(v), rank=r, decoded_token=tok.text(t))
        if tid in lp and tid not in entry:
            entry[tid] = PromptLogprob(logprob=clamp_logprob(lp[tid]), rank=None, decoded_token=tok.text(tid))
        out.append(entry)
    return out


