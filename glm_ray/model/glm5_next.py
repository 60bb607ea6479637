"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, text model): a hybrid of KDA linear attention
(3 of every 4 layers) and NoPE MLA with the k-pool DSA indexer, mHC hyper-connections around every
sublayer, and MoE with clamped SwiGLU.

    streams = embed(ids) copied to hc_mult streams                          [T, n, D]
    per layer:  x = hc_attn.collapse(streams) -> mixer(RMSNorm(x)) -> hc_attn.expand
                x = hc_ffn.collapse(streams)  -> mlp(RMSNorm(x))   -> hc_ffn.expand
    hidden = RMSNorm(mean over streams)

The forward is a loop of pieces (everything between two mixer cores) and cores (KDA's conv + delta
rule, MLA's attention), as GLM-5's: the piecewise CUDA graphs replay the pieces.

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
from glm_ray.layers.mla import MLAAttention, MLAQuery
from glm_ray.layers.norm import RMSNorm
from glm_ray.model.base import CausalLM, forward_by_pieces, make_mlp

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

    # ---- a layer around its mixer's core; the core is the boundary a piecewise CUDA graph leaves eager
    def mixer_inputs(self, streams, batch, kv_cache, index_cache, index_queries: bool, out=None) -> dict:
        """streams [T, n, D] -> the carry of this layer's mixer core: the streams with the hc_attn
        coefficients (post [T, n], comb [T, n, n]) and the mixer's projections (KDA: mixed / g / beta /
        gate; MLA: q and, when computed, the index queries iq / iw; cache rows written)."""
        x, post, comb = self.hc_attn.collapse(streams)                          # [T, D]
        x = self.input_layernorm(x)
        carry = {"streams": streams, "post": post, "comb": comb}
        if self.linear:
            carry.update(self.self_attn.project(x))
        else:
            query = self.self_attn.project(x, batch, None, kv_cache, index_cache, index_queries, out)
            carry["q"] = query.q
            if query.index_q is not None:
                carry["iq"], carry["iw"] = query.index_q
            if query.selections is not None:                                    # a decode step's, made early
                carry["sel"] = query.selections
        return carry

    def after_mixer(self, carry: dict, o: torch.Tensor) -> torch.Tensor:
        """The mixer core's output o [T, h, dv] -> the layer's output streams [T, n, D] (mixer output
        projection, hc_attn expand, then the FFN sublayer between hc_ffn's collapse and expand)."""
        if self.linear:
            h = self.self_attn.finish(o, carry["gate"])
        else:
            h = self.self_attn.o_proj(o.reshape(o.shape[0], -1))
        streams = self.hc_attn.expand(h, carry["streams"], carry["post"], carry["comb"])   # [T, n, D]
        x, post, comb = self.hc_ffn.collapse(streams)
        h = self.mlp(self.post_attention_layernorm(x))
        return self.hc_ffn.expand(h, streams, post, comb)


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

    # ---- the forward as pieces between mixer cores (worker/piecewise_graph.py replays `piece` as graphs)
    @property
    def num_pieces(self) -> int:
        return self.cfg.num_hidden_layers + 1

    def out_key(self, i: int) -> str:
        """The carry key of layer i's core output (KDA and MLA outputs differ in shape)."""
        return "o_kda" if self.layers[i].linear else "o"

    def attn_outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Row shape and dtype of each core output key."""
        out, dt = {}, self.embed_tokens.weight.dtype
        for layer in self.layers:
            a = layer.self_attn
            out["o_kda" if layer.linear else "o"] = ((a.h, a.dv), dt)
        return out

    def index_queries(self, batch: ForwardBatch) -> bool:
        return any(not layer.linear and layer.self_attn.scores(batch) for layer in self.layers)

    def piece(self, k: int, carry: dict, batch: ForwardBatch, kv_caches, index_caches, index_queries: bool,
              out: dict | None = None) -> dict:
        """Piece k: embedding + layer 0's mixer inputs (k = 0); layer k-1 after its core + layer k's mixer
        inputs; the final norm over the mean of the streams (k = L) -> {"hidden"}. See GlmMoeDsaModel.piece."""
        if k == 0:
            x = self.embed_tokens(carry["ids"])                                 # [T, D]
            streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()   # [T, n, D]
        else:
            streams = self.layers[k - 1].after_mixer(carry, carry[self.out_key(k - 1)])
        if k == self.cfg.num_hidden_layers:
            return {"hidden": self.norm(streams.mean(1))}                       # [T, D]
        return self.layers[k].mixer_inputs(streams, batch, kv_caches[k], index_caches.get(k), index_queries, out)

    def attend(self, i: int, carry: dict, batch: ForwardBatch, kv_caches, index_caches, state_caches: StateCaches,
               prev_mask, out: torch.Tensor | None = None):
        """Layer i's mixer core (eager in a piecewise graph) -> (o [T, h, dv], the IndexShare selections;
        KDA layers pass the previous ones on)."""
        layer = self.layers[i]
        if layer.linear:
            return layer.self_attn.attend(carry, batch, *state_caches[i], out), prev_mask
        iq = (carry["iq"], carry["iw"]) if "iq" in carry else None
        return layer.self_attn.attend(MLAQuery(carry["q"], iq, carry.get("sel")), batch, kv_caches[i], index_caches.get(i),
                                      prev_mask, out)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches, index_caches,
                state_caches: StateCaches, run_piece=None) -> torch.Tensor:
        """ids [T] -> hidden [T, D]; `run_piece` as GlmMoeDsaModel.forward's."""
        return forward_by_pieces(
            self, input_ids, batch, run_piece,
            lambda k, carry, iq: self.piece(k, carry, batch, kv_caches, index_caches, iq),
            lambda i, carry, mask, out: self.attend(i, carry, batch, kv_caches, index_caches, state_caches, mask, out))


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

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None, run_piece=None) -> torch.Tensor:
        return self.model.language_model(input_ids, batch, kv_caches, index_caches, state_caches or {}, run_piece)

    def piecewise(self):
        return self.model.language_model

    def checkpoint_name(self, name: str) -> str:
        """mHC parameters are flat on disk: `...hc_attn.fn` is stored as `...hc_attn_fn`."""
        return re.sub(r"\.(hc_attn|hc_ffn)\.(fn|base|scale)$", r".\1_\2", name)
