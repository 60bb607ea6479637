"""GLM-5 / 5.1 / 5.2 (`GlmMoeDsaForCausalLM`) and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`):
MLA + DSA indexer (with IndexShare) + MoE (sigmoid grouped routing, shared expert) + the MTP layer.

Module names mirror the checkpoint names, so the name map below only has to deal with merged
params (gate_up_proj) and stacked experts (w13/w2). The MTP layer (index num_hidden_layers) is
built and loaded but not run yet (speculative decoding comes later).
The decoder layers carry the residual stream un-added: each add is fused into the RMSNorm that follows
it (the `rms_norm` kernel op's residual form), the last one into the final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.forward_batch import ForwardBatch
from glm_ray.layers.embedding import VocabParallelEmbedding
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.mla import MLAAttention
from glm_ray.layers.norm import RMSNorm
from glm_ray.layers.rotary import RotaryEmbedding
from glm_ray.model.base import CausalLM, make_mlp
from glm_ray.quant import Unquantized


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, *, sparse: bool, full_indexer: bool | None, quant_config,
                 params_dtype, tp: int):
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.layer_idx = idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.self_attn = MLAAttention(cfg, layer_idx=idx, full_indexer=full_indexer, quant_config=quant_config,
                                      prefix=f"{prefix}.self_attn", params_dtype=params_dtype, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.mlp = make_mlp(cfg, sparse, quant_config=quant_config, prefix=f"{prefix}.mlp", params_dtype=params_dtype,
                            tp=tp)

    def forward(self, x, residual, batch, rope, kv_cache, index_cache, prev_mask):
        """Residual stream carried un-added (vLLM's fused-add pattern): `x` [T, D] is the previous layer's
        MLP output and `residual` [T, D] the stream before it (None for the first layer: x is the
        embedding). Returns (this layer's MLP output, the stream before it, mask); the caller's next norm
        adds them. The same adds in the same order as `x = x + h; x = x + mlp(norm(x))`."""
        if residual is None:
            residual, n = x, self.input_layernorm(x)                            # [T, D] each
        else:
            n, residual = self.input_layernorm(x, residual)                     # stream += previous MLP output
        h, mask = self.self_attn(n, batch, rope, kv_cache, index_cache, prev_mask)
        n, residual = self.post_attention_layernorm(h, residual)                # stream += attention output
        return self.mlp(n), residual, mask


class MTPLayer(DecoderLayer):
    """DeepSeek-style next-token-prediction layer: eh_proj(cat(enorm(e), hnorm(h))) -> decoder layer."""

    def __init__(self, cfg: ModelConfig, idx: int, **kw):
        super().__init__(cfg, idx, sparse=True, full_indexer=True if cfg.has_indexer else None, **kw)
        dt = kw["params_dtype"]
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        # NOTE: eh_proj stays bf16 in every GLM checkpoint (like lm_head), whatever the quant config says
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, quant_config=Unquantized(),
                                        prefix=f"model.layers.{idx}.eh_proj", params_dtype=dt)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config, params_dtype, tp: int, with_mtp: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, params_dtype, tp)
        kw = dict(quant_config=quant_config, params_dtype=params_dtype, tp=tp)
        layers = []
        for i in range(cfg.num_hidden_layers):
            t = cfg.indexer_types[i]
            full = None if t == "none" else (t == "full")
            layers.append(DecoderLayer(cfg, i, sparse=cfg.mlp_layer_types[i] == "sparse", full_indexer=full, **kw))
        if with_mtp:
            layers += [MTPLayer(cfg, cfg.num_hidden_layers + j, **kw) for j in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.rotary_emb = RotaryEmbedding(cfg.rope, max(cfg.qk_rope_head_dim, 2))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[torch.Tensor],
                index_caches: dict[int, torch.Tensor]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                        # [T, D]
        rope = self.rotary_emb(batch.positions, x.dtype)                        # cos/sin [T, dr] each
        mask, residual = None, None
        for i in range(self.cfg.num_hidden_layers):
            x, residual, mask = self.layers[i](x, residual, batch, rope, kv_caches[i], index_caches.get(i), mask)
        if residual is None:                                                    # no decoder layers
            return self.norm(x)
        return self.norm(x, residual)[0]                                        # the last add fused in


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, quant_config, params_dtype: torch.dtype, tp: int = 1):
        super().__init__(cfg, params_dtype, tp)
        self.model = GlmMoeDsaModel(cfg, quant_config, params_dtype, tp)

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None) -> torch.Tensor:
        return self.model(input_ids, batch, kv_caches, index_caches)            # [T, D] final-normed
