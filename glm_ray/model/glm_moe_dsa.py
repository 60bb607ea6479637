"""GLM-5 / 5.1 / 5.2 (`GlmMoeDsaForCausalLM`) and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`):
MLA + DSA indexer (with IndexShare) + MoE (sigmoid grouped routing, shared expert) + the MTP layer.

Module names mirror the checkpoint names, so the name map below only has to deal with merged
params (gate_up_proj) and stacked experts (w13/w2). The MTP layer (index num_hidden_layers) is
built and loaded but not run yet (speculative decoding comes later).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.mla import MLAAttention
from glm_ray.layers.moe import MLP, MoE
from glm_ray.layers.norm import RMSNorm
from glm_ray.layers.rotary import RotaryEmbedding
from glm_ray.forward_batch import ForwardBatch
from glm_ray.quant import Unquantized


def make_mlp(cfg: ModelConfig, sparse: bool, *, quant_config, prefix: str, params_dtype, tp: int) -> nn.Module:
    """The FFN of a decoder layer: routed + shared experts, or a dense (clamped) SwiGLU MLP."""
    if sparse:
        return MoE(cfg, quant_config=quant_config, prefix=prefix, params_dtype=params_dtype, tp=tp)
    return MLP(cfg.hidden_size, cfg.intermediate_size, quant_config=quant_config, prefix=prefix,
               params_dtype=params_dtype, tp=tp, swiglu_limit=cfg.swiglu_limit)


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

    def forward(self, x, batch, rope, kv_cache, index_cache, prev_mask):
        h, mask = self.self_attn(self.input_layernorm(x), batch, rope, kv_cache, index_cache, prev_mask)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, mask


class MTPLayer(DecoderLayer):
    """DeepSeek-style next-token-prediction layer: eh_proj(cat(enorm(e), hnorm(h))) -> decoder layer."""

    def __init__(self, cfg: ModelConfig, idx: int, **kw):
        super().__init__(cfg, idx, sparse=True, full_indexer=True if cfg.has_indexer else None, **kw)
        dt = kw["params_dtype"]
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        # NOTE: eh_proj stays bf16 in every GLM checkpoint (like lm_head), whatever the quant config says
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, quant_config=_lm_head_quant(None),
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
        mask = None
        for i in range(self.cfg.num_hidden_layers):
            x, mask = self.layers[i](x, batch, rope, kv_caches[i], index_caches.get(i), mask)
        return self.norm(x)


class GlmMoeDsaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config, params_dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.model = GlmMoeDsaModel(cfg, quant_config, params_dtype, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, quant_config=_lm_head_quant(quant_config),
                                      prefix="lm_head", params_dtype=params_dtype, tp=tp)

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None) -> torch.Tensor:
        return self.model(input_ids, batch, kv_caches, index_caches)            # [T, D] final-normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                                     # [N, V] fp32

    def process_weights_after_loading(self) -> None:
        for m in self.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None:
                qm.process_weights_after_loading(m)
        for m in self.modules():        # layers that derive runtime tensors (MLA's W_UK/W_UV, KDA's conv taps)
            if m is not self and callable(getattr(type(m), "process_weights_after_loading", None)):
                m.process_weights_after_loading()

    # ---- checkpoint names ------------------------------------------------------------------
    def checkpoint_params(self) -> dict[str, tuple[nn.Parameter, object, dict]]:
        """Every checkpoint tensor name this model expects -> (param, owner's weight_loader, kwargs)."""
        out: dict[str, tuple] = {}
        for name, p in self.named_parameters():
            loader = getattr(p, "weight_loader", None)
            owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            loader = loader or getattr(owner, "weight_loader", None)
            if loader is None:
                raise RuntimeError(f"parameter {name} has no weight_loader")
            for ckpt_name, kwargs in _checkpoint_names(name, owner):
                out[ckpt_name] = (p, loader, kwargs)
        return out


def _lm_head_quant(quant_config):
    return Unquantized()   # NOTE: lm_head stays bf16 in every GLM checkpoint


_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(w13|w2)_(\w+)$")


def _checkpoint_names(name: str, owner: nn.Module):
    """Yield (checkpoint tensor name, weight_loader kwargs) for one runtime parameter.

    A param may carry `checkpoint_suffix`: its on-disk last name component when that differs from the
    runtime one (Quark block-FP8 stores the runtime `weight_scale_inv` as `weight_scale`)."""
    disk = getattr(getattr(owner, name.rsplit(".", 1)[-1], None), "checkpoint_suffix", None)
    if disk:
        head, _, tail = name.rpartition(".")
        name = f"{head}.{tail.split('_', 1)[0]}_{disk}" if _EXPERT_PARAM.match(name) else f"{head}.{disk}"
    m = _EXPERT_PARAM.match(name)
    if m:
        base, which, suffix = m.groups()
        for e in range(owner.num_experts):
            if which == "w13":
                yield f"{base}.{e}.gate_proj.{suffix}", {"shard_id": "w1", "expert_id": e}
                yield f"{base}.{e}.up_proj.{suffix}", {"shard_id": "w3", "expert_id": e}
            else:
                yield f"{base}.{e}.down_proj.{suffix}", {"shard_id": "w2", "expert_id": e}
        return
    if ".gate_up_proj." in name:
        yield name.replace(".gate_up_proj.", ".gate_proj."), {"shard_id": 0}
        yield name.replace(".gate_up_proj.", ".up_proj."), {"shard_id": 1}
        return
    yield name, {}
