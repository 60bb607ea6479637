"""GLM-5 / 5.1 / 5.2 (`GlmMoeDsaForCausalLM`) and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`):
MLA + DSA indexer (with IndexShare) + MoE (sigmoid grouped routing, shared expert) + the MTP layer.

Module names mirror the checkpoint names, so the name map below only has to deal with merged
params (gate_up_proj) and stacked experts (w13/w2). The MTP layer (index num_hidden_layers) is
built and loaded but not run yet (speculative decoding comes later).
The decoder layers carry the residual stream un-added: each add is fused into the RMSNorm that follows
it (the `rms_norm` kernel op's residual form, in place: the stream's buffer is updated, so a piecewise graph's
static residual carry needs no copy after its piece), the last one into the final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.forward_batch import ForwardBatch
from glm_ray.layers.embedding import VocabParallelEmbedding
from glm_ray.layers.linear import ReplicatedLinear
from glm_ray.layers.mla import MLAAttention, MLAQuery
from glm_ray.layers.norm import RMSNorm
from glm_ray.layers.rotary import RopeCache, RotaryEmbedding
from glm_ray.model.base import CausalLM, forward_by_pieces, make_mlp
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

    # ---- a layer in three parts; the attention part is the boundary a piecewise CUDA graph leaves eager
    def attention_inputs(self, x, residual, batch, rope, kv_cache, index_cache, index_queries: bool, out=None):
        """Residual stream carried un-added (vLLM's fused-add pattern): `x` [T, D] is the previous layer's
        MLP output and `residual` [T, D] the stream before it (None for the first layer: x is the
        embedding). Returns (the stream with x added, this layer's MLAQuery); the cache rows are written.
        `out`: destination buffers for the query tensors (MLAAttention.project)."""
        if residual is None:
            residual, n = x, self.input_layernorm(x)                            # [T, D] each
        else:
            n, residual = self.input_layernorm(x, residual, in_place=True)      # stream += previous MLP output
        return residual, self.self_attn.project(n, batch, rope, kv_cache, index_cache, index_queries, out)

    def ffn(self, o, residual):
        """o [T, h, dv] attention output -> (this layer's MLP output, the stream before it); the next norm
        adds them. The same adds in the same order as `x = x + h; x = x + mlp(norm(x))`."""
        h = self.self_attn.o_proj(o.reshape(o.shape[0], -1))                  # [T, D]
        n, residual = self.post_attention_layernorm(h, residual, in_place=True)   # stream += attention output
        return self.mlp(n), residual


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

    # ---- the forward as pieces between attentions (worker/piecewise_graph.py replays `piece` as graphs)
    @property
    def num_pieces(self) -> int:
        return self.cfg.num_hidden_layers + 1

    def out_key(self, i: int) -> str:
        """The carry key of layer i's attention output."""
        return "o"

    def attn_outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Row shape (heads on this rank, v_head_dim) and dtype of the attention output."""
        attn = self.layers[0].self_attn
        return {"o": ((attn.h, attn.dv), self.embed_tokens.weight.dtype)}

    def piece(self, k: int, carry: dict, batch: ForwardBatch, kv_caches: list[torch.Tensor],
              index_caches: dict[int, torch.Tensor], index_queries: bool,
              out: dict[str, torch.Tensor] | None = None) -> dict:
        """Piece k of the forward, everything between attention k-1 and attention k: piece 0 embeds
        (`carry["ids"]`) and projects layer 0's queries; piece k finishes layer k-1 (o_proj, MLP) from
        `carry["o"]` and projects layer k's; the last piece (k = L) finishes layer L-1 and applies the final
        norm -> {"hidden"}. Reads from `batch` only positions (piece 0) and slot_mapping. Returns the
        carry for the next attention: residual [T, D], cos/sin [T, dr], q [T, h, dn+dr], and the index
        queries iq [T, Hi, di] / iw [T, Hi] where the layer computes them. `out`: buffers to write q / iq / iw
        into (the piecewise graphs' static carry) instead of new tensors."""
        L = self.cfg.num_hidden_layers
        if k == 0:
            x, residual = self.embed_tokens(carry["ids"]), None                 # [T, D]
            rope = self.rotary_emb(batch.positions, x.dtype)                    # cos/sin [T, dr] each
        else:
            rope = RopeCache(carry["cos"], carry["sin"])
            x, residual = self.layers[k - 1].ffn(carry["o"], carry["residual"])
        if k == L:
            return {"hidden": self.norm(x) if residual is None else self.norm(x, residual)[0]}   # [T, D]
        residual, query = self.layers[k].attention_inputs(x, residual, batch, rope, kv_caches[k],
                                                          index_caches.get(k), index_queries, out)
        out = {"residual": residual, "cos": rope.cos, "sin": rope.sin, "q": query.q}
        if query.index_q is not None:
            out["iq"], out["iw"] = query.index_q
        if query.selections is not None:                                        # a decode step's, made early
            out["sel"] = query.selections
        return out

    def attend(self, i: int, carry: dict, batch: ForwardBatch, kv_caches: list[torch.Tensor],
               index_caches: dict[int, torch.Tensor], prev_mask, out: torch.Tensor | None = None):
        """Attention of layer i (eager in a piecewise graph) -> (o [T, h, dv], selections)."""
        iq = (carry["iq"], carry["iw"]) if "iq" in carry else None
        return self.layers[i].self_attn.attend(MLAQuery(carry["q"], iq, carry.get("sel")), batch, kv_caches[i], index_caches.get(i),
                                               prev_mask, out)

    def index_queries(self, batch: ForwardBatch) -> bool:
        """Whether some layer's indexer scores this step (then every indexer layer computes its queries)."""
        return any(layer.self_attn.scores(batch) for layer in self.layers[:self.cfg.num_hidden_layers])

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[torch.Tensor],
                index_caches: dict[int, torch.Tensor], run_piece=None) -> torch.Tensor:
        """ids [T] -> final-normed hidden [T, D]. `run_piece(k, carry)` runs piece k (default: eagerly);
        the piecewise graphs pass their replay, and the attentions between the pieces run here."""
        return forward_by_pieces(
            self, input_ids, batch, run_piece,
            lambda k, carry, iq: self.piece(k, carry, batch, kv_caches, index_caches, iq),
            lambda i, carry, mask, out: self.attend(i, carry, batch, kv_caches, index_caches, mask, out))


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, quant_config, params_dtype: torch.dtype, tp: int = 1):
        super().__init__(cfg, params_dtype, tp)
        self.model = GlmMoeDsaModel(cfg, quant_config, params_dtype, tp)

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None, run_piece=None) -> torch.Tensor:
        return self.model(input_ids, batch, kv_caches, index_caches, run_piece)   # [T, D] final-normed

    def piecewise(self):
        return self.model
