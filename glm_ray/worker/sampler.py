"""Batched sampling from last-position logits: penalties, min_tokens, the structured-output token
bitmask, temperature, top-k, top-p, min-p, per-request seeds, and logprobs of the raw model distribution.

Penalties come two ways: from a `PenaltyBatch` (worker/penalties.py: device-resident histories, what the
model runner passes) or, without one, from the rows' host lists (`_penalize`: the reference the tables
are tested against, and what a caller without a runner gets).

All rows are processed together with masked tensor ops; the only per-row Python work is drawing
noise for seeded requests (each owns a torch.Generator) and packaging logprob dicts.
Sampling is `argmax(probs / E)` with E ~ Exp(1) (equivalent to multinomial), so greedy rows are
plain argmax and random rows share one kernel.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.structured import TokenBitmask, apply_token_bitmask
from glm_ray.staging import stage, to_device
from glm_ray.worker.penalties import PenaltyBatch, penalize_rows


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: tuple[int, ...]
    num_output: int | None = None      # tokens sampled before this step (None: len(output_ids)); under async
    #                                    scheduling the host's list may still lack the last step's token

    @property
    def n_out(self) -> int:
        return len(self.output_ids) if self.num_output is None else self.num_output


def _penalize(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency penalties on the rows that ask:
    every history is flattened to (row, token) pairs on the host and staged with the parameters in one
    copy; the counts are one accumulating scatter (integer-valued fp32: exact in any order)."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return logits
    N, V = len(idx), logits.shape[1]
    outs, prompts = [rows[i].output_ids for i in idx], [rows[i].prompt_ids for i in idx]
    n_out, n_prompt = [len(o) for o in outs], [len(q) for q in prompts]
    p = [rows[i].params for i in idx]
    sel, out_row, out_tok, prompt_row, prompt_tok, rep, pres, freq = stage([
        np.asarray(idx, dtype=np.int64),                                                   # [N]
        np.repeat(np.arange(N), n_out),                                                    # [P_out]
        np.fromiter(itertools.chain.from_iterable(outs), dtype=np.int64, count=sum(n_out)),
        np.repeat(np.arange(N), n_prompt),                                                 # [P_prompt]
        np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=sum(n_prompt)),
        np.array([x.repetition_penalty for x in p], dtype=np.float32),                     # [N] each
        np.array([x.presence_penalty for x in p], dtype=np.float32),
        np.array([x.frequency_penalty for x in p], dtype=np.float32)], logits.device)
    out_counts = torch.zeros(N, V, device=logits.device)                                  # [N, V]
    out_counts.index_put_((out_row, out_tok), torch.ones_like(out_tok, dtype=out_counts.dtype), accumulate=True)
    prompt_seen = torch.zeros(N, V, dtype=torch.bool, device=logits.device)               # [N, V]
    prompt_seen[prompt_row, prompt_tok] = True
    return penalize_rows(logits, sel, prompt_seen, out_counts, rep, pres, freq)


def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    blocked = [(i, list(r.eos_ids) + list(r.params.stop_token_ids)) for i, r in enumerate(rows)
               if r.n_out < r.params.min_tokens]
    rows_i = [i for i, ids in blocked for _ in ids]
    if not rows_i:
        return logits
    r, c = stage([np.asarray(rows_i, dtype=np.int64),                              # [P] each, one copy
                  np.asarray([t for _, ids in blocked for t in ids], dtype=np.int64)], logits.device)
    # a device-made value: `logits[r, c] = float("-inf")` would copy the scalar from pageable host memory
    return logits.index_put((r, c), logits.new_full((1,), float("-inf")))


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as masks in sorted space (only rows that ask)."""
    dev = logits.device
    temp, top_k, top_p, min_p = stage([                                          # [N] each, one copy
        np.array([max(r.params.temperature, 1e-5) for r in rows], dtype=np.float32),
        np.array([r.params.top_k if r.params.top_k and r.params.top_k > 0 else logits.shape[1] for r in rows],
                 dtype=np.int64),
        np.array([r.params.top_p for r in rows], dtype=np.float32),
        np.array([r.params.min_p for r in rows], dtype=np.float32)], dev)
    logits = logits / temp[:, None]
    if any((r.params.top_k or 0) > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows):
        sorted_logits, order = logits.sort(dim=-1, descending=True)               # [N, V]
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1) - probs                                            # mass strictly before
        drop |= cum >= top_p[:, None]
        drop |= probs < (min_p[:, None] * probs[:, :1])
        drop[:, 0] = False                                                        # always keep the best
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow], bitmask: TokenBitmask | None = None,
           penalties: PenaltyBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 -> (token ids [N], raw logprobs [N, V]). `bitmask` (engine/structured.py): the
    tokens the constrained rows may sample (structured outputs). `penalties`: the penalized rows'
    device-resident histories (every penalized row in it; its counts take this step's tokens), else the
    rows' host lists are read."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = penalties.apply(logits) if penalties is not None else _penalize(logits, rows)
    logits = _mask_min_tokens(logits, rows)
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    tokens = logits.argmax(-1)
    if not all(r.params.greedy for r in rows):
        greedy = to_device([r.params.greedy for r in rows], logits.device)
        probs = _filter(logits, rows).softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):           # seeded rows redraw their noise from their own generator
            if r.generator is not None and not r.params.greedy:
                noise[i].exponential_(generator=r.generator)                   # in place: one launch
        sampled = (probs / noise).argmax(-1)
        tokens = torch.where(greedy, tokens, sampled)
    tokens = _force(tokens, rows)
    if penalties is not None:
        penalties.record(tokens)
    return tokens, raw_logprobs


def _force(tokens: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Tests only: rows with `forced_token_ids` left to emit take their next one instead of the sample
    (SamplingParams.forced_token_ids; the server sets it only under GLM_RAY_TEST_FORCED_OUTPUT)."""
    forced = [(i, r.params.forced_token_ids[r.n_out]) for i, r in enumerate(rows)
              if r.n_out < len(r.params.forced_token_ids)]
    if not forced:
        return tokens
    tokens = tokens.clone()
    tokens[to_device([i for i, _ in forced], tokens.device, torch.long)] = to_device([t for _, t in forced],
                                                                                    tokens.device, tokens.dtype)
    return tokens


def logprob_tensors(raw_logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """On the device: [logprob of each row's token [N]] + (top-k ids [N, k], top-k logprobs [N, k]) if k."""
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]                  # [N]
    if k > 0:
        top = raw_logprobs.topk(k, dim=-1)
        return [chosen, top.indices, top.values]
    return [chosen]


def host_logprobs(tensors: list[torch.Tensor]) -> tuple[list, list]:
    """`logprob_tensors`' result (already on the host) as (chosen, [(top ids, top logprobs)] per row)."""
    chosen = tensors[0].tolist()
    if len(tensors) == 3:
        return chosen, list(zip(tensors[1].tolist(), tensors[2].tolist()))
    return chosen, [([], [])] * len(chosen)


def gather_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[list, list]:
    """(logprob of each row's token, top-k (ids, logprobs) per row) as host lists."""
    return host_logprobs(logprob_tensors(raw_logprobs, tokens, k))


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Start device->host copies of `tensors` now, on the current stream, into pinned memory; the event
    marks their completion (None on the CPU: the tensors are already there). Enqueued right after the
    step's sampling, so reading them never waits for work launched later (the next step's forward)."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = [t.to("cpu", non_blocking=True) for t in tensors]                # pinned destinations
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def to_logprob_dict(token: int, lp: float, top_ids: list[int], top_lps: list[float], k: int) -> dict[int, float]:
    d = {int(token): float(lp)}
    for t, v in zip(top_ids[:k], top_lps[:k]):
        d.setdefault(int(t), float(v))
    return d
