"""K-pool DSA indexer (GLM-5.3-Flash, `glm5_next`): the lightning indexer scores *pools* of
`index_kpool` consecutive tokens instead of single tokens. Same interface as `indexer.Indexer`.

NoPE: no rotary anywhere (qk_rope_head_dim = 0; the `rope` arguments may be None). The projections
(wq_b, wk, k_norm, weights_proj) and `queries` are the GLM-5 `Indexer`'s. Per token the index cache row holds
`[ki | gi]` (2·di): the key `ki = LayerNorm(wk(x))` and its pool gate score `gi = x @ gateᵀ`.
Pools tile every sequence from position 0: pool p = positions [p·kp, (p+1)·kp). Its key is the
per-channel softmax-weighted mean of its tokens' keys, logits `gi + ape[offset in pool]`.
For a query at position s (kp = index_kpool, di = index_head_dim, Hi = index_n_heads):
  I[s,p]    = Σ_h w[s,h] · relu(qi[s,h] · kpool[p] · di^-0.5),  w = weights_proj(x) · Hi^-0.5 (fp32)
  candidate = the pool's last token (p+1)·kp - 1 <= s (it is then complete and visible)
  selected  = the index_topk // kp best candidates, expanded to their kp tokens
  tail      = (index_kpool_always_select_tail) the tokens t <= s of the pools that are not candidates,
              i.e. positions [s+1 - (s+1) % kp, s]: the query's incomplete pool
  mask[s,t] = (t in selected or t in tail) and causal[s,t]
This is transformers' Glm5NextTextIndexer without left padding (its pools start at the first valid
token; ours at position 0, where every sequence starts).

Dense-causal skip (the MLA layer skips `select` while `max_context_len <= topk`): with the tail on, a
query at s has floor((s+1)/kp) <= index_topk // kp candidates when s < ctx <= index_topk, so every
candidate is selected and candidates + tail = all of 0..s, i.e. the mask is exactly causal. Without
the tail it is not (a query's incomplete pool is never attended, and queries s < kp-1 attend nothing),
so then `topk` is 0 and `select` always runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray import kernels
from glm_ray.config import ModelConfig
from glm_ray.forward_batch import AttnGroup, ForwardBatch
from glm_ray.layers.indexer import Indexer
from glm_ray.layers.rotary import RopeCache
from glm_ray.weights import load_sharded, set_weight_attrs

# Bound on one scoring tile of the selection, passed to the kernel op
_SCORE_BYTES = 256 * 2**20


class KPoolIndexer(Indexer):
    """The GLM-5 indexer's projections and queries (inherited), with pooled keys: its own cache row
    layout (`write_keys`) and selection (`select`)."""

    def __init__(self, cfg: ModelConfig, *, quant_config, prefix: str, params_dtype):
        if cfg.index_kpool <= 0:
            raise ValueError("KPoolIndexer needs index_kpool > 0")
        if cfg.qk_rope_head_dim:
            raise ValueError("the k-pool indexer is NoPE (GLM-5.3-Flash): qk_rope_head_dim must be 0")
        super().__init__(cfg, quant_config=quant_config, prefix=prefix, params_dtype=params_dtype)
        self.kpool, self.tail = cfg.index_kpool, cfg.index_kpool_always_select_tail
        self.pool_topk = cfg.index_topk // cfg.index_kpool                 # pools selected per query
        # threshold of the MLA layer's dense-causal skip: exact only with the tail (module docstring)
        self.topk = cfg.index_topk if self.tail else 0
        self.cache_dim = 2 * self.head_dim                                   # [ki | gi] per token
        di, D = self.head_dim, cfg.hidden_size
        # plain (never quantized) params: ape is only added to fp32 logits; gate runs in the model dtype
        self.index_kpool_compress_ape = self._param(torch.zeros(self.kpool, di, dtype=torch.float32))
        self.index_kpool_compress_gate = self._param(torch.zeros(di, D, dtype=params_dtype))

    @staticmethod
    def _param(t: torch.Tensor) -> nn.Parameter:
        return set_weight_attrs(nn.Parameter(t, requires_grad=False), weight_loader=KPoolIndexer._load)

    @staticmethod
    def _load(param, ckpt, shard_id=None, **_):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)          # replicated on every rank

    def write_keys(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache | None,
                   key_cache: torch.Tensor) -> None:
        """Cache every new token's [ki | gi] (once per layer; `rope` unused: NoPE)."""
        ki = self.k_norm(self.wk(x))                                          # [T, di]
        gi = F.linear(x, self.index_kpool_compress_gate.to(x.dtype))          # [T, di]
        key_cache.index_copy_(0, batch.slot_mapping, torch.cat([ki, gi], -1).to(key_cache.dtype))

    def select(self, group: AttnGroup, queries: tuple[torch.Tensor, torch.Tensor],
               key_cache: torch.Tensor) -> torch.Tensor:
        """Selection mask [B, Qmax, Kmax] (selected pools' tokens ∪ tail, AND causal) of one group: the
        `indexer_kpool_topk` kernel op (pool and query tiles of at most _SCORE_BYTES of scores)."""
        qi, w = queries
        return kernels.ops().indexer_kpool_topk(qi, w, key_cache, group, self.index_kpool_compress_ape,
                                                kpool=self.kpool, pool_topk=self.pool_topk, tail=self.tail,
                                                max_bytes=_SCORE_BYTES)
