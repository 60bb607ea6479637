"""DSA lightning indexer: picks, per query token, the `index_topk` context tokens MLA may attend to.

Keys `ki = LayerNorm(wk(x))` are cached per token (its own cache, one per *full* layer).
Score I[s,t] = sum_h w[s,h] * relu(qi[s,h] . ki[t] / sqrt(di)), w = weights_proj(x) / sqrt(Hi) (fp32).
RoPE is applied to the first `qk_rope_head_dim` dims (rope FIRST here; MLA puts rope last).
`write_keys` caches every new token's key; `queries` computes the index queries of a step once per
layer; `select` returns, per attention group, a boolean mask [B, Qmax, Kmax] (selected AND causal).
While a group's contexts fit in `index_topk` the caller skips `select` (selection = dense causal).
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.norm import LayerNorm
from glm_ray.layers.rotary import RopeCache, apply_rope
from glm_ray.forward_batch import AttnGroup, ForwardBatch


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

    def _rope(self, x, rope: RopeCache | None):
        r = self.rope_dim
        if r == 0:                                                           # NoPE (GLM-5.3-Flash)
            return x
        return torch.cat([apply_rope(x[..., :r], rope, self.interleave), x[..., r:]], dim=-1)

    def write_keys(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache, key_cache: torch.Tensor) -> None:
        """Cache the new tokens' index keys (every token of the step, once per layer)."""
        ki = self._rope(self.k_norm(self.wk(x)), rope)                       # [T, di]
        key_cache.index_copy_(0, batch.slot_mapping, ki.to(key_cache.dtype))

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope: RopeCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries and head weights of every row of T (once per layer, shared by its groups)."""
        T = x.shape[0]
        qi = self._rope(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), rope)   # [T, Hi, di]
        w = self.weights_proj(x.float()) * self.n_heads ** -0.5                 # [T, Hi] fp32
        return qi.float(), w

    def select(self, group: AttnGroup, queries: tuple[torch.Tensor, torch.Tensor],
               key_cache: torch.Tensor) -> torch.Tensor:
        """Top-k selection mask [B, Qmax, Kmax] (selected AND causal) of one attention group.

        The per-head ReLU scores [B, q, Hi, k] fp32 are the big tensor (GLM-5: 32 heads x 8k keys =
        1 MiB per query row), and the gathered keys [B, Kmax, di] fp32 grow with the group's contexts:
        both are tiled — queries into chunks, and keys into chunks whose top-k are merged — so each
        tile stays within _SCORE_BYTES. Loops over tiles, not tokens; one tile in the common case.
        """
        qi, w = queries
        Q, W = qi[group.q_index], w[group.q_index]                              # [B, Qmax, Hi, di], [B, Qmax, Hi]
        B, Qmax, Kmax = group.causal.shape
        k = min(self.topk, Kmax)
        kc = max(k, min(Kmax, _SCORE_BYTES // (B * self.head_dim * 4)))       # keys per tile
        qc = max(1, _SCORE_BYTES // (B * self.n_heads * kc * 4))              # queries per tile
        selected = torch.zeros_like(group.causal)
        for q0 in range(0, Qmax, qc):
            sl = slice(q0, q0 + qc)
            best_v = best_i = None
            for k0 in range(0, Kmax, kc):
                ks = slice(k0, k0 + kc)
                K = key_cache[group.kv_slots[:, ks]].float()                    # [B, n, di]
                s = torch.einsum("bqhd,bkd->bqhk", Q[:, sl], K).mul_(self.head_dim ** -0.5).relu_()   # [B, q, Hi, n]
                scores = torch.einsum("bqh,bqhk->bqk", W[:, sl], s)             # [B, q, n]
                scores.masked_fill_(~group.causal[:, sl, ks], float("-inf"))
                v, i = scores.topk(min(k, scores.shape[-1]), dim=-1)            # [B, q, <=k]
                i = i + k0
                if best_v is not None:                                          # merge with earlier tiles
                    v, j = torch.cat([best_v, v], -1).topk(k, dim=-1)
                    i = torch.cat([best_i, i], -1).gather(-1, j)
                best_v, best_i = v, i
            selected[:, sl].scatter_(-1, best_i, True)
        return selected & group.causal
