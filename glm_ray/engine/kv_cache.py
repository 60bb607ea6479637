"""KV-cache bookkeeping on the host: a free list of fixed-size blocks and per-request block tables.

The device tensors (one latent cache per attention layer, one indexer-key cache per full-indexer layer,
and for hybrid models one fixed-size recurrent state per KDA layer and running sequence) live in the
workers; this module only decides which blocks a request owns and sizes the caches. Capacity comes from a memory
budget divided by the bytes one token costs across all layers (`kv_bytes_per_token`).
"""
from __future__ import annotations

import math

import torch

from glm_ray.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of cache one token needs on one rank (MLA latent is replicated under TP)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    latent = len(cfg.attention_layers()) * cfg.kv_cache_dim
    index = len(cfg.full_indexer_layers()) * cfg.index_cache_dim if cfg.has_indexer else 0
    return (latent + index) * elem


def state_shapes(cfg: ModelConfig, num_seqs: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per KDA layer and rank: conv state [S, K-1, 3·H/tp·dk] (model dtype: the last K-1 q|k|v inputs)
    and recurrent state [S, H/tp, dk, dv] (fp32), one row per running sequence."""
    h, dk = cfg.linear_num_heads // tp, cfg.linear_head_dim
    return (num_seqs, cfg.linear_conv_kernel_dim - 1, 3 * h * dk), (num_seqs, h, dk, dk)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype, num_seqs: int, tp: int) -> int:
    """Bytes of the fixed-size recurrent-state caches on one rank (0 for pure-attention models)."""
    conv, rec = state_shapes(cfg, num_seqs, tp)
    elem = torch.empty(0, dtype=dtype).element_size()
    return len(cfg.linear_attention_layers()) * (math.prod(conv) * elem + math.prod(rec) * 4)


def num_blocks_for_budget(budget_bytes: int, cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    return max(0, budget_bytes // (kv_bytes_per_token(cfg, dtype) * block_size))


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
