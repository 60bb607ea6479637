"""KV-cache bookkeeping on the host: a free list of fixed-size blocks and per-request block tables.

The device tensors live in the workers (worker/cache.py sizes and allocates them); this module only
decides which of the `num_blocks` blocks every rank allocated a request owns.
"""
from __future__ import annotations

import math


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))    # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self._free)}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block at all; raise the memory budget")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.num_blocks

    def blocks_needed(self, req, num_tokens: int) -> int:
        return max(0, math.ceil(num_tokens / self.block_size) - len(req.block_ids))

    def can_allocate(self, req, num_tokens: int) -> bool:
        return self.blocks_needed(req, num_tokens) <= self.allocator.num_free

    def allocate(self, req, num_tokens: int) -> list[int]:
        """Grow `req.block_ids` to cover `num_tokens`; returns the newly added block ids."""
        new = self.allocator.allocate(self.blocks_needed(req, num_tokens))
        req.block_ids.extend(new)
        return new

    def free(self, req) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []
