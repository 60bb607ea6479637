"""What the prefix-affinity request router remembers of the prompts it routed, and its routing decision.

`PrefixIndex` records, per Router replica, the prompt blocks this process sent there: a prompt's token ids
cut into full `block_size` blocks (the engine's KV block size, so a remembered block is exactly a unit the
replica's prefix cache can hold), each block named by a hash chained over its parent's name and its own
token ids. A name therefore stands for the whole token prefix up to the block's end, and the record is a
prefix tree with one block per edge: the longest remembered prefix of a prompt is the longest run of its
leading block names that one replica holds.

Why token ids and not text: the ingress hands the Router `generate(request_id, prompt_token_ids, params)`,
the ids the engine caches by, after the chat template; text would need the template applied again and
would match prefixes the engine cannot reuse (a partial block, a different tokenization at the seam).
Why whole blocks: the engine's prefix cache only reuses whole blocks, so a partial block is worth nothing.

Hashes are Python's 64-bit `hash` of `(parent hash, block token tuple)` (deterministic for ints, no
PYTHONHASHSEED effect). A collision is possible in principle (~n^2 / 2^64 for n blocks) and harmless: the
index is a routing hint; the engine's own cache compares full token ids, so a collision can only send a
request to a replica that then computes the prompt itself, as without affinity.

Memory is bounded per replica: an LRU of at most `max_blocks_per_replica` block names (measured: ~340
bytes for a block one replica holds, ~170 more per further holder; hashing a 128k-token prompt ~2 ms). A prompt's blocks are touched deepest first, so a block is
never older than its descendants and eviction takes a prefix's tail before its head (as the engine frees
a request's blocks). `retain` drops the replicas that left the deployment.

`decide` is the routing decision, a pure function of the index, the prompt and the replicas' queue
lengths (tests drive it with fake replicas): the replica holding the longest remembered prefix when it
covers at least `min_match_ratio` of the prompt and that replica's queue is at most `max_imbalance`
requests longer than the shortest; otherwise Serve's power of two choices — two random replicas, the
shorter queue wins, ties to the replica remembering fewer blocks (new prefixes spread over the replicas
instead of piling onto one, as sglang's cache-aware router does).
"""
from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

#: `Decision.reason` values: where the request went and why
PREFIX = "prefix"                 # the replica holding the longest remembered prefix
NO_MATCH = "no_match"             # no replica holds the prompt's first block: least loaded
SHORT_MATCH = "short_match"       # the longest remembered prefix is below min_match_ratio: least loaded
IMBALANCED = "imbalanced"         # the prefix holder's queue is too long: least loaded
REASONS = (PREFIX, NO_MATCH, SHORT_MATCH, IMBALANCED)


@dataclass(frozen=True)
class AffinityConfig:
    """The knobs of prefix-affinity routing (`ServeArgs.prefix_affinity_*` and the engine's block size)."""

    block_size: int = 16
    min_match_ratio: float = 0.1           # matched tokens / prompt tokens below this: route by load
    max_imbalance: int = 32                # holder's queue - shortest queue above this: route by load
    max_tokens_per_replica: int = 1 << 20  # tokens remembered per replica (whole blocks)
    prefix_matching: bool = True           # False (prefix caching off): always route by load

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        if self.max_tokens_per_replica < self.block_size:
            raise ValueError(f"max_tokens_per_replica must hold one block ({self.block_size} tokens), "
                             f"got {self.max_tokens_per_replica}")

    @property
    def max_blocks_per_replica(self) -> int:
        return self.max_tokens_per_replica // self.block_size


@dataclass(frozen=True)
class Decision:
    replica: Hashable            # the replica id chosen
    reason: str                  # one of REASONS
    matched_tokens: int          # the longest remembered prefix of the prompt, over all replicas


class PrefixIndex:
    """Per-replica LRU records of prompt blocks (see the module docstring). Thread-safe."""

    def __init__(self, block_size: int, max_blocks_per_replica: int):
        if block_size < 1 or max_blocks_per_replica < 1:
            raise ValueError("block_size and max_blocks_per_replica must be >= 1")
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self._holders: dict[int, set[Hashable]] = {}                  # block name -> replicas holding it
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}        # replica -> its names, oldest first
        self._lock = threading.Lock()

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The chained names of the prompt's full blocks (a trailing partial block has none)."""
        bs, h, out = self.block_size, 0, []
        for i in range(0, len(token_ids) - bs + 1, bs):
            h = hash((h, tuple(token_ids[i:i + bs])))
            out.append(h)
        return out

    def match(self, hashes: Sequence[int], replicas: Sequence[Hashable]) -> tuple[int, set[Hashable]]:
        """(blocks, holders): the longest run of leading `hashes` that one of `replicas` holds, and every
        replica of `replicas` holding that whole run ((0, empty) when none holds the first block)."""
        with self._lock:
            alive, n = set(replicas), 0
            for h in hashes:
                holders = self._holders.get(h)
                if not holders:
                    break
                nxt = alive & holders
                if not nxt:
                    break
                alive, n = nxt, n + 1
            return n, (alive if n else set())

    def insert(self, hashes: Sequence[int], replica: Hashable) -> None:
        """Record that `replica` holds the prefix `hashes` (now the most recently used), evicting its
        least recently used blocks beyond the bound."""
        with self._lock:
            lru = self._lru.setdefault(replica, OrderedDict())
            for h in reversed(hashes):               # deepest first: the head ends up most recent
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
                    self._holders.setdefault(h, set()).add(replica)
            while len(lru) > self.max_blocks_per_replica:
                h, _ = lru.popitem(last=False)
                self._release(h, replica)

    def remove(self, replica: Hashable) -> None:
        """Forget a replica (it left the deployment)."""
        with self._lock:
            for h in self._lru.pop(replica, ()):
                self._release(h, replica)

    def retain(self, replicas: Sequence[Hashable]) -> None:
        """Forget every replica not in `replicas`."""
        keep = set(replicas)
        for r in [r for r in list(self._lru) if r not in keep]:
            self.remove(r)

    def num_blocks(self, replica: Hashable) -> int:
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def replicas(self) -> list[Hashable]:
        return list(self._lru)

    def total_entries(self) -> int:
        """(replica, block) entries held: what the memory bound counts."""
        return sum(len(v) for v in self._lru.values())

    def _release(self, h: int, replica: Hashable) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]


def decide(index: PrefixIndex, hashes: Sequence[int], num_tokens: int,
           queue_lens: Mapping[Hashable, int | None], cfg: AffinityConfig,
           rng: random.Random | None = None) -> Decision:
    """Where one prompt goes among the replicas of `queue_lens` (replica id -> queue length; None =
    unknown, ranked after every known one). See the module docstring for the rule."""
    if not queue_lens:
        raise ValueError("no replica to route to")
    rng = rng or random
    candidates = list(queue_lens)

    def load(r) -> float:
        q = queue_lens[r]
        return math.inf if q is None else q

    known = [q for q in queue_lens.values() if q is not None]
    shortest = min(known, default=0)
    matched, reason = 0, NO_MATCH
    if cfg.prefix_matching and hashes:
        blocks, holders = index.match(hashes, candidates)
        matched = blocks * index.block_size
        if holders:
            if matched < cfg.min_match_ratio * num_tokens:
                reason = SHORT_MATCH
            else:
                best = min(holders, key=lambda r: (load(r), rng.random()))
                if load(best) - shortest <= cfg.max_imbalance:
                    return Decision(best, PREFIX, matched)
                reason = IMBALANCED
    pair = rng.sample(candidates, 2) if len(candidates) > 2 else candidates
    best = min(pair, key=lambda r: (load(r), index.num_blocks(r), rng.random()))
    return Decision(best, reason, matched)
