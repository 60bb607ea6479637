"""DSA lightning indexer: picks, per query token, the `index_topk` context tokens MLA may attend to.

Keys `ki = LayerNorm(wk(x))` are cached per token (its own cache, one per *full* layer).
Score I[s,t] = sum_h w[s,h] * relu(qi[s,h] . ki[t] / sqrt(di)), w = weights_proj(x) / sqrt(Hi) (fp32).
RoPE is applied to the first `qk_rope_head_dim` dims (rope FIRST here; MLA puts rope last).
Returns a boolean mask [B, Qmax, Kmax] (selected AND causal), or None while every context fits in
`index_topk` (then selection = dense causal, and the scoring is skipped).
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.norm import LayerNorm
from glm_ray.layers.rotary import apply_rope
from glm_ray.model.forward_batch import ForwardBatch


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

    def _rope(self, x, cos, sin):
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin, self.interleave), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, cos, sin,
                key_cache: torch.Tensor) -> torch.Tensor | None:
        T = x.shape[0]
        ki = self._rope(self.k_norm(self.wk(x)), cos, sin)                       # [T, di]
        key_cache.index_copy_(0, batch.slot_mapping, ki.to(key_cache.dtype))
        if batch.max_context_len <= self.topk:
            return None
        qi = self._rope(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), cos, sin)   # [T, Hi, di]
        w = self.weights_proj(x.float()) * self.n_heads ** -0.5                 # [T, Hi] fp32
        K = key_cache[batch.kv_slots].float()                                   # [B, Kmax, di]
        Q = qi.float()[batch.q_index]                                           # [B, Qmax, Hi, di]
        s = torch.einsum("bqhd,bkd->bqhk", Q, K).mul_(self.head_dim ** -0.5).relu_()   # [B, Qmax, Hi, Kmax]
        scores = torch.einsum("bqh,bqhk->bqk", w[batch.q_index], s)             # [B, Qmax, Kmax]
        scores = scores.masked_fill(~batch.causal, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        top = scores.topk(k, dim=-1).indices                                    # [B, Qmax, k]
        selected = torch.zeros_like(batch.causal).scatter_(-1, top, True)
        return selected & batch.causal
