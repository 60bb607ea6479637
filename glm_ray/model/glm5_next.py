"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, text model): a hybrid of KDA linear attention
(3 of every 4 layers) and NoPE MLA with the k-pool DSA indexer, mHC hyper-connections around every
sublayer, and MoE with clamped SwiGLU.

    streams = embed(ids) copied to hc_mult streams                          [T, n, D]
    per layer:  x = hc_attn.collapse(streams) -> mixer(RMSNorm(x)) -> hc_attn.expand
                x = hc_ffn.collapse(streams)  -> mlp(RMSNorm(x))   -> hc_ffn.expand
    hidden = RMSNorm(mean over streams)

The mixer is `KimiDeltaAttention` (a fixed-size recurrent state per sequence, `state_caches`) or
`MLAAttention` (paged latent cache, `kv_caches`; its indexer is the k-pool one). The vision tower and
the MTP layer of the checkpoint are not loaded (text serving; speculative decoding comes later).
Checkpoint names are the on-disk ones: `model.language_model.*`, `lm_head.weight`.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.forward_batch import ForwardBatch
from glm_ray.layers.embedding import VocabParallelEmbedding
from glm_ray.layers.kda import KimiDeltaAttention
from glm_ray.layers.mhc import HyperConnection
from glm_ray.layers.mla import MLAAttention
from glm_ray.layers.norm import RMSNorm
from glm_ray.model.base import CausalLM, make_mlp

# KDA layer index -> (conv_state [S, K-1, 3·H·dk], recurrent state [S, H, dk, dv] fp32)
StateCaches = dict[int, tuple[torch.Tensor, torch.Tensor]]


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, *, quant_config, params_dtype, tp: int):
        super().__init__()
        prefix = f"model.language_model.layers.{idx}"
        self.linear = cfg.layer_types[idx] == "linear_attention"
        kw = dict(quant_config=quant_config, prefix=f"{prefix}.self_attn", params_dtype=params_dtype, tp=tp)
        if self.linear:
            self.self_attn = KimiDeltaAttention(cfg, layer_idx=idx, **kw)
        else:
            t = cfg.indexer_types[idx]
            self.self_attn = MLAAttention(cfg, layer_idx=idx, full_indexer=None if t == "none" else t == "full", **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.mlp = make_mlp(cfg, cfg.mlp_layer_types[idx] == "sparse", quant_config=quant_config,
                            prefix=f"{prefix}.mlp", params_dtype=params_dtype, tp=tp)
        hc = dict(rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
        self.hc_attn = HyperConnection(cfg.hc_mult, cfg.hidden_size, **hc)
        self.hc_ffn = HyperConnection(cfg.hc_mult, cfg.hidden_size, **hc)

    def forward(self, streams, batch, kv_cache, index_cache, state, prev_mask):
        x, post, comb = self.hc_attn.collapse(streams)                          # [T, D]
        x = self.input_layernorm(x)
        mask = prev_mask                                                        # IndexShare masks pass KDA layers
        if self.linear:
            h = self.self_attn(x, batch, *state)
        else:
            h, mask = self.self_attn(x, batch, None, kv_cache, index_cache, prev_mask)
        streams = self.hc_attn.expand(h, streams, post, comb)                   # [T, n, D]
        x, post, comb = self.hc_ffn.collapse(streams)
        h = self.mlp(self.post_attention_layernorm(x))
        return self.hc_ffn.expand(h, streams, post, comb), mask


class Glm5NextTextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config, params_dtype, tp: int):
        super().__init__()
        if cfg.hc_mult < 1:
            raise ValueError("glm5_next without mHC (hc_mult=0 / mhc=false) is not supported yet")
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, params_dtype, tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, quant_config=quant_config, params_dtype=params_dtype,
                                                       tp=tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches, index_caches,
                state_caches: StateCaches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                        # [T, D]
        streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()   # [T, n, D]
        mask = None
        for i, layer in enumerate(self.layers):
            streams, mask = layer(streams, batch, kv_caches[i], index_caches.get(i), state_caches.get(i), mask)
        return self.norm(streams.mean(1))                                       # [T, D]


class Glm5NextForCausalLM(CausalLM):
    """The text model of a GLM-5.3-Flash checkpoint, with our engine's forward signature."""

    def __init__(self, cfg: ModelConfig, quant_config, params_dtype: torch.dtype, tp: int = 1):
        super().__init__(cfg, params_dtype, tp)
        self.model = nn.Module()
        self.model.language_model = Glm5NextTextModel(cfg, quant_config, params_dtype, tp)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Not served: the vision tower, and the MTP layer(s) after the last decoder layer."""
        if name.startswith("model.visual."):
            return True
        m = re.match(r"^model\.language_model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.cfg.num_hidden_layers

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None) -> torch.Tensor:
        return self.model.language_model(input_ids, batch, kv_caches, index_caches, state_caches or {})

    def checkpoint_name(self, name: str) -> str:
        """mHC parameters are flat on disk: `...hc_attn.fn` is stored as `...hc_attn_fn`."""
        return re.sub(r"\.(hc_attn|hc_ffn)\.(fn|base|scale)$", r".\1_\2", name)
