"""DSA lightning indexer: picks, per query token, the `index_topk` context tokens MLA may attend to.

Keys `ki = LayerNorm(wk(x))` are cached per token (its own cache, one per *full* layer).
Score I[s,t] = sum_h w[s,h] * relu(qi[s,h] . ki[t] / sqrt(di)), w = weights_proj(x) / sqrt(Hi) (fp32).
RoPE is applied to the first `qk_rope_head_dim` dims (rope FIRST here; MLA puts rope last).
`write_keys` caches every new token's key; `select` returns, per attention group, a boolean mask
[B, Qmax, Kmax] (selected AND causal), or None while the group's contexts fit in `index_topk` (then
selection = dense causal, and the scoring is skipped).
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.norm import LayerNorm
from glm_ray.layers.rotary import RopeCache, apply_rope
from glm_ray.model.forward_batch import AttnGroup, ForwardBatch


_SCORE_BYTES = 256 * 2**20


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, quant_config, prefix: str, params_dtype):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.interleave = cfg.indexer_rope_interleave
        rq = cfg.q_lora_rank
        self.wq_b = ReplicatedLinear(rq, self.n_heads * self.head_dim, quant_config=quant_config,
                                     prefix=f"{prefix}.wq_b", params_dtype=params_dtype)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.head_dim, quant_config=quant_config,
                                   prefix=f"{prefix}.wk", params_dtype=params_dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=params_dtype)
        # NOTE: weights_proj stays fp32 and unquantized in every GLM checkpoint.
        from glm_ray.quant import Unquantized
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, quant_config=Unquantized(),
                                             prefix=f"{prefix}.weights_proj", params_dtype=torch.float32)

    def _rope(self, x, rope: RopeCache):
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], rope, self.interleave), x[..., r:]], dim=-1)

    def write_keys(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache, key_cache: torch.Tensor) -> None:
        """Cache the new tokens' index keys (every token of the step, once per layer)."""
        ki = self._rope(self.k_norm(self.wk(x)), rope)                       # [T, di]
        key_cache.index_copy_(0, batch.slot_mapping, ki.to(key_cache.dtype))

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, group: AttnGroup, rope: RopeCache,
               key_cache: torch.Tensor) -> torch.Tensor | None:
        """Top-k selection mask [B, Qmax, Kmax] of one attention group, or None when its contexts fit."""
        if group.max_context_len <= self.topk:
            return None
        T = x.shape[0]
        # NOTE: scores every row of T; with two groups needing selection that is done twice (small:
        # wq_b + weights_proj), the [B, Qmax, Hi, Kmax] scoring below is per group only.
        qi = self._rope(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), rope)   # [T, Hi, di]
        w = self.weights_proj(x.float()) * self.n_heads ** -0.5                 # [T, Hi] fp32
        K = key_cache[group.kv_slots].float()                                   # [B, Kmax, di]
        Q = qi.float()[group.q_index]                                           # [B, Qmax, Hi, di]
        W = w[group.q_index]                                                    # [B, Qmax, Hi]
        B, Qmax, Kmax = group.causal.shape
        k = min(self.topk, Kmax)
        selected = torch.zeros_like(group.causal)
        # NOTE: the per-head ReLU scores [B, q, Hi, Kmax] fp32 are the big tensor (GLM-5: 32 heads x
        # 8k keys = 1 MiB per query row); score query chunks of at most _SCORE_BYTES (a loop over
        # chunks, not tokens: one iteration up to ~240 rows at 8k context).
        qc = max(1, _SCORE_BYTES // (B * self.n_heads * Kmax * 4))
        for q0 in range(0, Qmax, qc):
            sl = slice(q0, q0 + qc)
            s = torch.einsum("bqhd,bkd->bqhk", Q[:, sl], K).mul_(self.head_dim ** -0.5).relu_()   # [B, q, Hi, Kmax]
            scores = torch.einsum("bqh,bqhk->bqk", W[:, sl], s)                 # [B, q, Kmax]
            scores.masked_fill_(~group.causal[:, sl], float("-inf"))
            top = scores.topk(k, dim=-1).indices                                # [B, q, k]
            selected[:, sl].scatter_(-1, top, True)
        return selected & group.causal
