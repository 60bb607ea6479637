"""The caches of one rank: how many bytes a token and a running sequence cost, and the zeroed tensors.

One latent cache per MLA layer and one indexer-key cache per full-indexer layer, `num_slots` rows
each (block b owns rows [b*bs, (b+1)*bs)); for hybrid models (GLM-5.3-Flash's KDA layers) a conv and
a recurrent state per linear-attention layer, one row per state slot (running sequence). The engine's
block manager (engine/kv_cache.py) hands out block ids; this module is what they index.
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


def allocate_caches(model_cfg: ModelConfig, num_slots: int, num_seqs: int, tp: int, device: torch.device):
    """Zeroed caches of one rank: the MLA latent per attention layer (None for KDA layers), the index
    keys per full-indexer layer, and the KDA recurrent states (conv, recurrent) per linear layer.
    Block b of layer l is rows [b*bs, (b+1)*bs) of kv_caches[l]; a sequence's state is row state_slot."""
    attn = set(model_cfg.attention_layers())
    kv = [torch.zeros(num_slots, model_cfg.kv_cache_dim, dtype=model_cfg.dtype, device=device) if l in attn else None
          for l in range(model_cfg.num_hidden_layers)]
    index = {l: torch.zeros(num_slots, model_cfg.index_cache_dim, dtype=model_cfg.dtype, device=device)
             for l in model_cfg.full_indexer_layers()} if model_cfg.has_indexer else {}
    conv, rec = state_shapes(model_cfg, num_seqs, tp)
    states = {l: (torch.zeros(conv, dtype=model_cfg.dtype, device=device),
                  torch.zeros(rec, dtype=torch.float32, device=device))
              for l in model_cfg.linear_attention_layers()}
    return kv, index, states
