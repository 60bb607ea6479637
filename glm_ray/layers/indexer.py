"""DSA lightning indexer: picks, per query token, the `index_topk` context tokens MLA may attend to.

Keys `ki = LayerNorm(wk(x))` are cached per token (its own cache, one per *full* layer).
Score I[s,t] = sum_h w[s,h] * relu(qi[s,h] . ki[t] / sqrt(di)), w = weights_proj(x) / sqrt(Hi) (fp32).
RoPE is applied to the first `qk_rope_head_dim` dims (rope FIRST here; MLA puts rope last).
`write_keys` caches every new token's key (the `indexer_key_write` kernel op); `queries` computes the index
queries of a step once per layer; `select` returns, per attention group, the selected key positions
[B, Qmax, k] int32 (-1 padded): the scoring + top-k is the kernel op `indexer_topk`.
While a group's contexts fit in `index_topk` the caller skips `select` (selection = dense causal).
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray import kernels
from glm_ray.config import ModelConfig
from glm_ray.forward_batch import AttnGroup, ForwardBatch
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.norm import LayerNorm
from glm_ray.layers.rotary import RopeCache
from glm_ray.quant import Unquantized

# Bound on one scoring tile (per-head scores, gathered keys) of the selection, passed to the kernel op
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
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, quant_config=Unquantized(),
                                             prefix=f"{prefix}.weights_proj", params_dtype=torch.float32)


    def write_keys(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache, key_cache: torch.Tensor) -> None:
        """Cache the new tokens' index keys (every token of the step, once per layer): k_norm + rope + cast +
        scatter in one `indexer_key_write` kernel op."""
        cos, sin = (rope.cos, rope.sin) if self.rope_dim else (None, None)   # [T, rope_dim] each
        kernels.ops().indexer_key_write(self.wk(x), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps, cos, sin,
                                        self.rope_dim, self.interleave, key_cache, batch.slot_mapping)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope: RopeCache, qi_out: torch.Tensor | None = None,
                w_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, Hi, di] in wq_b's output dtype (bf16 models: bf16 — an fp32 copy would hold
        the same values and make the GPU kernel split each query into three bf16 parts, two of them zero)
        and head weights [T, Hi] fp32, of every row of T (once per layer, shared by its groups); written
        into `qi_out` / `w_out` when given."""
        T = x.shape[0]
        qi = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)           # [T, Hi, di]
        if self.rope_dim:                                                     # rope FIRST, in place (NoPE: none)
            kernels.ops().rope_inplace(qi, rope.cos, rope.sin, self.interleave, 0)
        w = kernels.ops().fp32_linear(x, self.weights_proj.weight)             # [T, Hi] fp32 = weights_proj(x.float())
        w = torch.mul(w, self.n_heads ** -0.5, out=w_out)
        return (qi if qi_out is None else qi_out.copy_(qi)), w

    def select(self, group: AttnGroup, queries: tuple[torch.Tensor, torch.Tensor],
               key_cache: torch.Tensor) -> torch.Tensor:
        """Top-k key positions [B, Qmax, k] int32 (-1 padded) of one attention group: the `indexer_topk`
        kernel op (scores and keys tiled within _SCORE_BYTES)."""
        qi, w = queries
        return kernels.ops().indexer_topk(qi, w, key_cache, group, self.topk, max_bytes=_SCORE_BYTES)
