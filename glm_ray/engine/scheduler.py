"""Continuous batching: which requests run this step, and how many of their tokens.

Policy (one step, under `max_num_batched_tokens`):
  1. running requests first, FCFS: decodes take 1 token, unfinished prefills their next chunk;
     when blocks run out the latest-arrived running request is preempted (blocks freed, recomputed
     later from its prompt + outputs so far);
  2. then waiting requests, FCFS, while the budget, `max_num_seqs` and free blocks allow — a request
     starts after the longest prefix of its tokens the prefix cache holds (engine/kv_cache.py), and a
     long rest is split into chunks (chunked prefill), so prefill and decode share a step.
     In-flight prefix sharing (sglang's in-batch prefix caching): a waiting request whose next uncached
     block a running request is computing right now — the same block under the same cached prefix —
     waits for that block to reach the cache instead of computing a copy, and requests behind it go
     first. A burst of prompts sharing a new system prompt then computes the prefix once, not once per
     prompt. The wait lasts until the running request's chunk lands (a step or two) or it leaves.
     With `policy="lpm"` (sglang's longest prefix match) fresh waiting requests are taken longest cached
     prefix first (FCFS among equals) while the queue holds at most `_LPM_MAX_QUEUE` of them: a cache
     hit needs only its tail and goes before uncached prompts, which still chunk into the rest of each
     step's budget, so they progress every step a budget is left.
No request is ever dropped: preempted requests go back to the head of the queue.
Every running request also holds one of `max_num_seqs` state slots (its row in the fixed-size
recurrent-state caches of hybrid models such as GLM-5.3-Flash's KDA layers), taken on admission and
given back on preemption or finish.

Its output is the per-step message to the workers (`SchedulerOutput`, engine/contract.py): a diff
(new requests once, new block ids, finished ids), not the whole state.

Async scheduling (`async_mode`): step N+1 is scheduled before step N's sampled tokens are known. A
request's progress (`num_computed_tokens`) then advances when it is scheduled, and a token still being
sampled (`num_inflight`) is scheduled as a -1 placeholder the worker takes from the device. A request
whose in-flight token is certain to end it by length (max_tokens, max_model_len) is not scheduled
again; one that ends on a stop condition costs one discarded token.
"""
from __future__ import annotations

import time
from collections import deque

from glm_ray.config import SchedulerConfig
from glm_ray.engine.contract import NewRequestData, ScheduledSeq, SchedulerOutput
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.request import Request, RequestStatus

_MAX_DEFERRED = 64      # waiting requests passed over in one step for in-flight prefixes (bounds the scan)
_LPM_MAX_QUEUE = 128    # lpm orders queues up to this long, FCFS beyond (sglang's fallback: a match per request)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager):
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []     # to tell the workers next step
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))   # state slots; pop() -> lowest
        self.async_mode = False                 # set by the engine (async scheduling)
        self.max_model_len: int | None = None   # set by the engine: a length-finished request is not rescheduled
        self.share_inflight_prefixes = True     # False: concurrent copies of a new prefix each compute it (A/B)
        self.policy = cfg.policy                # "fcfs" | "lpm" (a bench may switch it between runs)

    # ---- queue --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Mark finished (stop/length/abort), free its blocks, remember to tell the workers."""
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._release_slot(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        if req.sent_to_workers:
            self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.cfg.max_num_batched_tokens
        now = time.monotonic()
        preempted_now = False

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            if req.num_inflight and self._ends_by_length(req):
                idx += 1                        # its in-flight token is its last: nothing more to compute
                continue
            n = min(req.num_tokens + req.num_inflight - req.num_computed_tokens, budget)
            while not self.kv.can_allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                preempted_now = True
                if victim is req:
                    break
            else:
                self._schedule_seq(out, req, n)
                budget -= n
                idx += 1
                continue
            break   # `req` itself was preempted; everything after it is gone too

        if self.policy == "lpm" and self.kv.enable_prefix_caching and 1 < len(self.waiting) <= _LPM_MAX_QUEUE:
            self._order_by_cached_prefix()
        idx = deferred = 0
        while (idx < len(self.waiting) and budget > 0 and not preempted_now
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[idx]
            if req.num_inflight:
                break                           # preempted with a token in flight: back once it is known
            hit = self.kv.match(req)            # its longest cached prefix (whole blocks), [] if none
            if self._prefix_in_flight(req, hit):
                deferred += 1                   # a running request is computing its next block: wait for it
                if deferred >= _MAX_DEFERRED:
                    break
                idx += 1
                continue
            cached = len(hit) * self.kv.block_size
            n = min(req.num_tokens - cached, budget)
            if not self.kv.can_admit(hit, cached + n):
                break
            del self.waiting[idx]
            self.kv.admit(req, hit)             # holds the hit blocks; num_computed_tokens = cached
            req.status = RequestStatus.RUNNING
            req.state_slot = self._free_slots.pop()     # running < max_num_seqs: never empty
            self.running.append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if not req.sent_to_workers:
                out.new_requests.append(NewRequestData(req.request_id, list(req.prompt_token_ids), req.params))
                req.sent_to_workers = True
            self._schedule_seq(out, req, n)
            budget -= n
        return out

    def _schedule_seq(self, out: SchedulerOutput, req: Request, n: int) -> None:
        new_blocks = self.kv.allocate(req, req.num_computed_tokens + n)
        start = req.num_computed_tokens
        end = start + n
        known = req.all_token_ids[start:end]
        sample = end == req.num_tokens + req.num_inflight
        out.seqs.append(ScheduledSeq(
            req_id=req.request_id,
            token_ids=known + [-1] * (n - len(known)),          # -1: the in-flight token (async scheduling)
            start_pos=start,
            block_ids=list(req.block_ids) if req.blocks_reset else new_blocks,
            reset_blocks=req.blocks_reset,
            sample=sample,
            prompt_logprobs=(req.params.prompt_logprobs is not None and not req.prompt_logprobs_done
                             and start < req.num_prompt_tokens),
            state_slot=req.state_slot,
        ))
        req.blocks_reset = False
        if self.async_mode:                     # progress advances now; the token is read back later
            req.num_computed_tokens = end
            req.num_inflight += int(sample)

    def _order_by_cached_prefix(self) -> None:
        """lpm: the fresh waiting requests by their longest cached prefix, longest first (a stable sort: FCFS
        among equals); preempted requests keep the head of the queue, in their order."""
        preempted = [r for r in self.waiting if r.num_preemptions]
        fresh = sorted((r for r in self.waiting if not r.num_preemptions), key=lambda r: -len(self.kv.match(r)))
        self.waiting = deque(preempted + fresh)

    def _prefix_in_flight(self, req: Request, hit: list[int]) -> bool:
        """Whether a running request is computing the block that follows `req`'s cached prefix `hit`: the
        same prompt tokens after the same cached blocks, not registered yet, in a chain that will register
        it (kv_cache.py: a copy's chain stops). Only a fresh request that could take that block from the
        cache (a whole block before its last token, no prompt logprobs) waits; a preempted one never."""
        bs, m = self.kv.block_size, len(hit)
        if not (self.kv.enable_prefix_caching and self.share_inflight_prefixes):
            return False
        if req.num_preemptions or req.params.prompt_logprobs is not None or (m + 1) * bs > req.num_prompt_tokens - 1:
            return False
        block = req.prompt_token_ids[m * bs:(m + 1) * bs]
        return any(0 <= lead.num_registered_blocks <= m and (m + 1) * bs <= lead.num_prompt_tokens
                   and lead.block_ids[:m] == hit and lead.prompt_token_ids[m * bs:(m + 1) * bs] == block
                   for lead in self.running)

    def _ends_by_length(self, req: Request) -> bool:
        n = len(req.output_token_ids) + req.num_inflight
        return n >= req.max_tokens or (self.max_model_len is not None
                                       and req.num_tokens + req.num_inflight >= self.max_model_len)

    def _release_slot(self, req: Request) -> None:
        self._free_slots.append(req.state_slot)
        req.state_slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_slot(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.blocks_reset = True
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
