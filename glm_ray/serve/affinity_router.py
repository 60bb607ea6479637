"""`PrefixAffinityRouter`: the Serve request router of the ingress -> Router hop (Ray 2.60's custom request
router API, `request_router_config=RequestRouterConfig(request_router_class=...)`; `build_app` sets it on
the Router deployment when `request_router: prefix_affinity`, the default).

Serve runs one instance per handle, inside the caller's process: each ingress replica routes with its own
instance, which records what that instance routed (`serve/prefix_index.py`). No shared actor, so no Ray
call on the routing path; with several ingress replicas each one learns its share of the traffic (a
conversation's turns may go through different ingress replicas, and the second one then learns the prefix
from its own first routing of it).

Per call method (`pending_request.metadata.call_method`):
- `generate(request_id, prompt_token_ids, params)`: `prefix_index.decide` over the replicas' queue
  lengths (Serve's queue-length cache, probed where unknown or stale): the replica holding the longest
  remembered prefix, or the least loaded of two random replicas. The prompt's blocks are recorded for the
  chosen replica at once (so the next request with the same prefix follows it even before this one is
  accepted), and again for the replica that actually accepted it if that differs (the chosen one refused:
  a full queue). The other replicas come as a second rank, which Serve tries when the first refuses.
- `abort(request_id)`: the replica its `generate` was routed to (the ingress aborts a request whose stream
  never started, e.g. still queued in the engine; Serve's random choice would miss it with several
  replicas). A bounded record of recent placements; unknown ids go to two random replicas.
- anything else (`get_model_info`, `check_engine`, `stats`): two random replicas, the shorter queue wins
  (Serve's power of two choices).

No FIFO mixin: a chosen replica goes to exactly the request it was chosen for (FIFO would give it to the
oldest pending request, whatever its prefix). Serve's base class finds that request by its
`internal_request_id`, which the calls of one HTTP request share (Serve copies it from the ingress's request
context: n > 1 and several prompts fan out into several `generate` calls), so its lookup handed one
sub-request's replica to a sibling and left the other waiting forever. `_fulfill_next_pending_request`
matches the routing task's own request (its metadata object) instead, and the router's own records are
keyed by the engine request id, which is unique per call.
"""
from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from glm_ray.serve.prefix_index import AffinityConfig, Decision, PrefixIndex, decide

logger = logging.getLogger("glm_ray.serve.affinity_router")

#: Import path for `RequestRouterConfig.request_router_class` (resolved in each caller's process).
IMPORT_PATH = "glm_ray.serve.affinity_router:PrefixAffinityRouter"
#: request ids remembered for `abort` routing (recent placements, oldest dropped first)
MAX_PLACEMENTS = 65_536


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """`RequestRouterConfig.request_router_kwargs`: the `AffinityConfig` fields."""
        self.cfg = AffinityConfig(**kwargs)
        self.index = PrefixIndex(self.cfg.block_size, self.cfg.max_blocks_per_replica)
        self.decisions: Counter[str] = Counter()         # Decision.reason -> count (logs, tests)
        self._placed: OrderedDict[str, ReplicaID] = OrderedDict()        # request_id -> replica
        self._chosen: OrderedDict[str, tuple[ReplicaID, list[int]]] = OrderedDict()   # request id -> (replica, hashes)
        self._rng = random.Random()
        logger.info("prefix-affinity routing for %s: %s", self._deployment_id, self.cfg)

    # ---- Serve's hooks ------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        method = pending_request.metadata.call_method if pending_request is not None else None
        if method == "generate":
            call = _generate_call(pending_request)
            if call is not None:
                return await self._route_prompt(candidate_replicas, pending_request, *call)
        elif method == "abort":
            rid = _first_arg(pending_request, "request_id")
            target = self._placed.get(rid) if isinstance(rid, str) else None
            if target is not None and target in self._replicas:
                return [[self._replicas[target]], [r for r in candidate_replicas if r.replica_id != target]]
        return [self._two_random(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        call = _generate_call(pending_request) if pending_request.metadata.call_method == "generate" else None
        chosen = self._chosen.pop(call[0], None) if call is not None else None
        if chosen is None:
            return
        replica, hashes = chosen
        if replica != replica_id:                    # the chosen replica refused; another one took it
            self.index.insert(hashes, replica_id)
            self._remember(call[0], replica_id)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give `replica` to the request it was chosen for: the pending request whose metadata object is
        `request_metadata` (the routing task's own; see the module docstring for why not Serve's lookup
        by internal id). Requests whose future is done (cancelled) are passed over."""
        for pr in self._pending_requests_to_fulfill:         # pending requests in arrival order, lazily cleaned
            if pr.metadata is request_metadata:
                if not pr.future.done():
                    self._cancel_routing_task_for_pending_request(pr)
                    self._record_queue_wait_time(pr)
                    pr.future.set_result(replica)
                    self._remove_pending_request_from_indices(pr)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain(list(self._replica_id_set))        # replicas that left are forgotten

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)

    # ---- the decision -------------------------------------------------------------------------
    async def _route_prompt(self, candidates: list[RunningReplica], pr: PendingRequest, rid: str,
                            prompt: list[int]) -> list[list[RunningReplica]]:
        hashes = self.index.block_hashes(prompt)
        d: Decision = decide(self.index, hashes, len(prompt), await self._queue_lens(candidates), self.cfg,
                             self._rng)
        self.decisions[d.reason] += 1
        self.index.insert(hashes, d.replica)
        self._remember(rid, d.replica)
        self._chosen[rid] = (d.replica, hashes)
        while len(self._chosen) > MAX_PLACEMENTS:           # requests cancelled before they were routed
            self._chosen.popitem(last=False)
        logger.debug("route %s (%d prompt tokens): %s, matched %d", rid, len(prompt), d.reason, d.matched_tokens)
        chosen = next(r for r in candidates if r.replica_id == d.replica)
        return [[chosen], [r for r in candidates if r is not chosen]]

    async def _queue_lens(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Queue length per candidate: Serve's cache (fresh for `RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S`),
        probed where missing; None where the probe failed too."""
        out: dict[ReplicaID, int | None] = {}
        missing = []
        for r in candidates:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                missing.append(r)
            out[r.replica_id] = q
        if missing and len(candidates) > 1:          # one replica: nothing to compare, no probe
            for r, q in await self._probe_queue_lens(missing, 0):
                out[r.replica_id] = q
        return out

    def _two_random(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        return self._rng.sample(candidates, 2) if len(candidates) > 2 else list(candidates)

    def _remember(self, rid: str, replica: ReplicaID) -> None:
        self._placed[rid] = replica
        self._placed.move_to_end(rid)
        while len(self._placed) > MAX_PLACEMENTS:
            self._placed.popitem(last=False)


def _first_arg(pr: PendingRequest, name: str):
    if pr.args:
        return pr.args[0]
    return pr.kwargs.get(name)


def _generate_call(pr: PendingRequest) -> tuple[str, list[int]] | None:
    """(request_id, prompt_token_ids) of a `Router.generate` call, None if it is not shaped like one."""
    args = list(pr.args) + [None] * (2 - len(pr.args))
    rid = args[0] if args[0] is not None else pr.kwargs.get("request_id")
    prompt = args[1] if args[1] is not None else pr.kwargs.get("prompt_token_ids")
    if not isinstance(rid, str) or not isinstance(prompt, list):
        return None
    return rid, prompt
