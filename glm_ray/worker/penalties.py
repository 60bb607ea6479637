"""Device-resident penalty histories of rank 0's requests: repetition, presence and frequency penalties
without reading the host's token lists each step.

The penalties read every token a request has seen: repetition over its prompt and outputs, presence and
frequency over its outputs (counts). Rebuilt from the host's lists each step (the `_penalize` reference
in worker/sampler.py), that is O(prompt + output) host work and upload per step, and it needs the host's
output list complete, so under async scheduling the step first waited for the previous step's tokens
(no overlap). Here each penalized request owns a row of two device tables:

    prompt_seen [R, V] bool    set once, from the prompt, when the row is made
    counts      [R, V] fp32    output-token counts (integer-valued: exact), +1 per sampled token on the
                               device right after sampling (`PenaltyBatch.record`), so the next step needs
                               neither the host's lists nor the previous step's tokens on the host

A row is made (zeroed, filled from the host's prompt and outputs so far, in the same staged copy as the
step's parameters) the first time its request samples with penalties, and given back when the request
leaves the runner (`release`: finished or aborted). A preempted request keeps its row: its outputs are
kept and recomputed, not sampled again. The tables grow by doubling (sampling is never inside a CUDA
graph) and hold only penalized requests: ~5 bytes x vocabulary per row (0.8 MB at GLM-5's 154,880).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from glm_ray.staging import stage

MIN_ROWS = 8


def penalize_rows(logits: torch.Tensor, sel: torch.Tensor, prompt_seen: torch.Tensor, counts: torch.Tensor,
                  rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """The penalties' math, shared with the host-list reference (`sampler._penalize`): logits [B, V] -> a
    copy whose rows `sel` [N] are penalized given their prompt-token mask and output counts [N, V] and their
    repetition / presence / frequency penalties [N] (repetition over prompt + outputs, HF / vLLM; presence
    and frequency over the outputs, OpenAI)."""
    seen = prompt_seen | (counts > 0)                                           # [N, V]
    rep, pres, freq = rep[:, None], pres[:, None], freq[:, None]
    sub = logits[sel]                                                           # [N, V]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits = logits.clone()
    logits[sel] = sub
    return logits


@dataclass
class PenaltyBatch:
    """One step's penalized rows: where they sit in the step's logits and in the tables."""
    state: "PenaltyState"
    sel: torch.Tensor            # [N] int64: rows of the step's logits
    rows: torch.Tensor           # [N] int64: rows of the tables
    rep: torch.Tensor            # [N] fp32 repetition penalty
    pres: torch.Tensor           # [N] fp32 presence penalty
    freq: torch.Tensor           # [N] fp32 frequency penalty

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> a copy with the penalties applied to the selected rows."""
        counts = self.state.counts[self.rows]                                   # [N, V]
        return penalize_rows(logits, self.sel, self.state.prompt_seen[self.rows], counts,
                             self.rep, self.pres, self.freq)

    def record(self, tokens: torch.Tensor) -> None:
        """Count the step's sampled tokens (`tokens` [B], on the device) in their rows' output counts."""
        picked = tokens[self.sel].long()                                        # [N]
        self.state.counts.index_put_((self.rows, picked), torch.ones_like(picked, dtype=torch.float32),
                                     accumulate=True)


class PenaltyState:
    """The tables and which request owns which row (rank 0 of a runner)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)      # [R, V]
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)    # [R, V]
        self.row_of: dict[str, int] = {}
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def _grow(self, need: int) -> None:
        cap = max(MIN_ROWS, self.capacity)
        while cap < need:
            cap *= 2
        extra = cap - self.capacity
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(extra, self.vocab_size)])
        self._free.extend(range(cap - 1, cap - extra - 1, -1))          # lowest rows handed out first

    def batch(self, sel: list[int], req_ids: list[str], params: list, histories: list[tuple[list[int], list[int]]]
              ) -> PenaltyBatch:
        """The step's penalized rows: `sel` their indices in the step's logits, `req_ids` / `params` their
        requests, `histories` their (prompt ids, output ids) on the host — read only for requests without a
        row yet (the outputs sampled so far: complete then, as a row is made at its request's first
        penalized sample or after a preemption's wait for its in-flight token)."""
        new = [i for i, r in enumerate(req_ids) if r not in self.row_of]
        if len(self.row_of) + len(new) > self.capacity:
            self._grow(len(self.row_of) + len(new))
        for i in new:
            self.row_of[req_ids[i]] = self._free.pop()
        rows = [self.row_of[r] for r in req_ids]
        prompts, outs = [histories[i][0] for i in new], [histories[i][1] for i in new]
        n_prompt, n_out = [len(p) for p in prompts], [len(o) for o in outs]
        new_rows = np.asarray([rows[i] for i in new], dtype=np.int64)
        (sel_t, rows_t, rep, pres, freq, fresh, p_row, p_tok, o_row, o_tok) = stage([
            np.asarray(sel, dtype=np.int64),                                                  # [N]
            np.asarray(rows, dtype=np.int64),                                                 # [N]
            np.array([p.repetition_penalty for p in params], dtype=np.float32),               # [N] each
            np.array([p.presence_penalty for p in params], dtype=np.float32),
            np.array([p.frequency_penalty for p in params], dtype=np.float32),
            new_rows,                                                                         # [F]
            np.repeat(new_rows, n_prompt),                                                    # [P_prompt]
            np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=sum(n_prompt)),
            np.repeat(new_rows, n_out),                                                       # [P_out]
            np.fromiter(itertools.chain.from_iterable(outs), dtype=np.int64, count=sum(n_out))], self.device)
        if new:                                   # (re)made rows: zeroed, then their histories
            self.counts.index_fill_(0, fresh, 0.0)
            self.prompt_seen.index_fill_(0, fresh, False)
            self.prompt_seen.index_put_((p_row, p_tok), torch.ones_like(p_tok, dtype=torch.bool))
            self.counts.index_put_((o_row, o_tok), torch.ones_like(o_tok, dtype=torch.float32), accumulate=True)
        return PenaltyBatch(self, sel_t, rows_t, rep, pres, freq)


__all__ = ["PenaltyBatch", "PenaltyState", "penalize_rows"]
