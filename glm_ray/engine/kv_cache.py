"""KV-cache bookkeeping on the host: the block pool, per-request block tables, and the prefix cache.

The device tensors live in the workers (worker/cache.py sizes and allocates them); this module only
decides which of the `num_blocks` blocks every rank allocated a request owns. Both GLM-5 caches (the
MLA latent and the DSA indexer keys) are indexed by the same block table, so one block id covers both.

Automatic prefix caching (vLLM's, on by default): a block whose `block_size` tokens are all computed is
registered under the key (parent block id, its token ids) — the parent being the registered block that
holds the previous `block_size` tokens, -1 for a sequence's first block. A key therefore names the whole
token prefix up to the block's end, and the dict compares full token tuples on lookup: two different
prefixes can never share a block (no hash collision is possible by construction). Registered blocks
stay registered after their requests finish, in the free queue: least recently freed first, a request's
tail blocks before its head, never-registered blocks before all registered ones. A block leaves the
cache only when the allocator hands it out again (its registered descendants, all unreferenced since
any holder of a block holds its whole prefix, leave with it). A referenced block is never handed out.

Admission (`match` then `admit`): a new or preempted request takes the longest registered prefix of its
tokens, at most `num_tokens - 1` tokens (its last token is always computed, for the logits), whole blocks
only; the scheduler computes the rest. A request registers its own blocks as steps complete (`register`,
called by the engine when a step's results are applied, so no request ever reads a block that is still
being written). When a request computes a block some other request registered first (the same prompt
admitted in the same step), its chain of registrations stops there — the block it holds is a copy, and
registering children under another request's block id could outlive that block.
"""
from __future__ import annotations

import math
from collections import OrderedDict


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block at all; raise the memory budget")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks                              # requests holding each block
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))   # front = next out
        self._key: list[tuple | None] = [None] * num_blocks       # (parent id, token ids) while registered
        self._cached: dict[tuple, int] = {}                       # key -> block id
        self._children: dict[int, set[int]] = {}                  # registered block -> registered children
        self.prefix_queries = 0                                   # prompt tokens looked up (admissions)
        self.prefix_hits = 0                                      # of them, found in the cache

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Share of blocks held by requests (free-but-cached blocks count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.num_blocks

    # ---- growing and freeing a request's table -----------------------------------------------
    def blocks_needed(self, req, num_tokens: int) -> int:
        return max(0, math.ceil(num_tokens / self.block_size) - len(req.block_ids))

    def can_allocate(self, req, num_tokens: int) -> bool:
        return self.blocks_needed(req, num_tokens) <= len(self._free)

    def allocate(self, req, num_tokens: int) -> list[int]:
        """Grow `req.block_ids` to cover `num_tokens`; returns the newly added block ids."""
        n = self.blocks_needed(req, num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self._free)}")
        new = [self._pop_free() for _ in range(n)]
        req.block_ids.extend(new)
        return new

    def free(self, req) -> None:
        """Drop the request's hold on its blocks (tail first, so its tail is evicted before its head)."""
        for b in reversed(req.block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._key[b] is None:
                    self._free.move_to_end(b, last=False)         # nothing to keep: hand it out first
        req.block_ids = []
        req.num_registered_blocks = 0

    def _pop_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        if self._key[b] is not None:
            self._evict(b)
        self._ref[b] = 1
        return b

    def _evict(self, block: int) -> None:
        """Unregister `block` and its registered descendants (all unreferenced: see the docstring)."""
        stack = [block]
        while stack:
            b = stack.pop()
            key = self._key[b]
            del self._cached[key]
            self._key[b] = None
            if key[0] >= 0:
                self._children.get(key[0], set()).discard(b)
            stack.extend(self._children.pop(b, ()))

    # ---- the prefix cache --------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (vLLM's `reset_prefix_cache`); returns how many.
        Held blocks stay registered: their holders' chains go on. Counters are kept."""
        free_cached = [b for b in self._free if self._key[b] is not None]
        for b in free_cached:
            if self._key[b] is not None:             # (a parent's eviction may have taken it already)
                self._evict(b)
        for b in free_cached:                        # hand the forgotten blocks out first, as never-registered
            self._free.move_to_end(b, last=False)
        return len(free_cached)

    def match(self, req) -> list[int]:
        """The registered blocks holding the longest cached prefix of the request's tokens (not yet held)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []          # prompt logprobs need the logits of every prompt position: compute them all
        tokens, bs = req.all_token_ids, self.block_size
        hit, parent = [], -1
        for i in range((len(tokens) - 1) // bs):
            b = self._cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            hit.append(b)
            parent = b
        return hit

    def can_admit(self, hit: list[int], num_tokens: int) -> bool:
        """Whether a request holding nothing can take `hit` and grow to `num_tokens` tokens."""
        taken = sum(1 for b in hit if self._ref[b] == 0)          # cached blocks sitting in the free queue
        need = max(0, math.ceil(num_tokens / self.block_size) - len(hit))
        return need + taken <= len(self._free)

    def admit(self, req, hit: list[int]) -> None:
        """Start the request on its cached prefix `hit`: the blocks are held, the tokens are computed."""
        assert not req.block_ids, "admit a request that holds no blocks"
        for b in hit:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        req.block_ids = list(hit)
        req.num_computed_tokens = len(hit) * self.block_size
        req.num_registered_blocks = len(hit)
        if self.enable_prefix_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += req.num_computed_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens

    def register(self, req, num_computed: int) -> None:
        """Register the request's blocks that `num_computed` computed tokens fill (a step's results)."""
        if not self.enable_prefix_caching or req.num_registered_blocks < 0:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return                                                # most steps: no block filled up
        tokens = req.all_token_ids                                # (a copy of prompt + output: only when needed)
        for i in range(req.num_registered_blocks, full):
            b = req.block_ids[i]
            parent = req.block_ids[i - 1] if i else -1
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if key in self._cached or self._key[b] is not None:
                req.num_registered_blocks = -1                    # a copy: the chain stops (docstring)
                return
            self._cached[key] = b
            self._key[b] = key
            if parent >= 0:
                self._children.setdefault(parent, set()).add(b)
            req.num_registered_blocks = i + 1
