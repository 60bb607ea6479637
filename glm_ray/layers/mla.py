"""Multi-head latent attention (MLA) with the DSA indexer, over a paged latent KV cache.

Per token and layer the cache holds [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]: the normalized
latent and the roped shared key — identical on every TP rank — written by the `mla_kv_write` kernel op
(kv_a_layernorm + rope + cast + scatter in one). Two equivalent forms:

- naive (prefill): expand the context latents with kv_b_proj into per-head K/V and run MHA;
- absorbed (decode): fold W_UK into the query and W_UV into the output, attend in latent space
  as MQA with one KV head of dim r+dr (value = c).

Attention runs once per `AttnGroup` of the batch (decode group: absorbed; prefill group: naive, under
mla_mode "auto") as a kernel op: `mla_decode` (latent attention; the W_UK / W_UV folds are here) and
`mla_prefill` (given kv_b_proj to expand the latents). Sparse attention (DSA) is a selection from the
indexer, one per group: None (dense causal, while every context fits in index_topk), the top-k key
positions [B, Qmax, k] int32 (GLM-5's indexer: attention reads only those latents) or a boolean mask
(GLM-5.3-Flash's k-pool indexer); "shared" layers (IndexShare) reuse the previous full layer's selections.
At decode sizes (<= GLM_RAY_SIDE_STREAM_TOKENS tokens on a GPU) the cache writes — and in a decode step that
scores, the indexer's queries and top-k — run on a side stream beside the query path and join before
`project` returns (kernels/streams.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm_ray import envs, kernels
from glm_ray.config import ModelConfig
from glm_ray.forward_batch import AttnGroup, ForwardBatch
from glm_ray.kernels.streams import forked, join, side_stream_for
from glm_ray.layers.indexer import Indexer
from glm_ray.layers.kpool_indexer import KPoolIndexer
from glm_ray.layers.linear import ColumnParallelLinear, MergedReplicatedLinear, ReplicatedLinear, RowParallelLinear
from glm_ray.layers.norm import RMSNorm
from glm_ray.layers.rotary import RopeCache


@dataclass
class MLAQuery:
    """What crosses from an MLA layer's projections to its attention (a piecewise-graph boundary)."""
    q: torch.Tensor                                   # [T, h, dn+dr]: [q_nope | roped q_pe]
    index_q: tuple[torch.Tensor, torch.Tensor] | None = None   # the indexer's (qi [T, Hi, di] wq_b's dtype, w [T, Hi] fp32)
    # a decode step's DSA selections per group, already made on the side stream (None: `attend` selects)
    selections: tuple[torch.Tensor | None, ...] | None = None

# Bound on the transient gathered / expanded context of one attention call, passed to the kernel ops
# as `max_bytes`; above it the torch reference processes the context in key chunks (online softmax).
_ATTN_BYTES = 1 << 30


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_idx: int, full_indexer: bool | None, quant_config,
                 prefix: str, params_dtype: torch.dtype, tp: int):
        super().__init__()
        H = cfg.num_attention_heads
        if H % tp:
            raise ValueError(f"num_attention_heads {H} is not divisible by tp={tp}")
        self.h = H // tp                                                        # heads on this rank
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        self.layer_idx = layer_idx
        self.side_stream_tokens = envs.SIDE_STREAM_TOKENS.get()                # decode: cache writes on a side stream
        qk = self.dn + self.dr
        common = dict(quant_config=quant_config, params_dtype=params_dtype)
        self.rq = cfg.q_lora_rank
        # q_a_proj and kv_a_proj_with_mqa read the same x: one GEMM (and one activation quant) for both, as
        # vLLM / sglang fuse them, when the checkpoint quantizes them alike; else two linears
        self.fused_qkv_a = bool(self.rq) and quant_config.can_fuse([f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"])
        if self.fused_qkv_a:
            self.fused_qkv_a_proj = MergedReplicatedLinear(cfg.hidden_size, [self.rq, self.r + self.dr],
                                                           prefix=f"{prefix}.fused_qkv_a_proj", **common)
        elif self.rq:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, self.rq, prefix=f"{prefix}.q_a_proj", **common)
        if self.rq:
            self.q_a_layernorm = RMSNorm(self.rq, cfg.rms_norm_eps, params_dtype)
            self.q_b_proj = ColumnParallelLinear(self.rq, H * qk, prefix=f"{prefix}.q_b_proj", tp=tp, **common)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, H * qk, prefix=f"{prefix}.q_proj", tp=tp, **common)
        if not self.fused_qkv_a:
            self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.r + self.dr,
                                                       prefix=f"{prefix}.kv_a_proj_with_mqa", **common)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps, params_dtype)
        self.kv_b_proj = ColumnParallelLinear(self.r, H * (self.dn + self.dv), prefix=f"{prefix}.kv_b_proj",
                                              tp=tp, **common)
        self.o_proj = RowParallelLinear(H * self.dv, cfg.hidden_size, prefix=f"{prefix}.o_proj", tp=tp, **common)
        # full_indexer: True -> own indexer; False -> IndexShare (reuse previous mask); None -> no DSA
        self.uses_dsa = full_indexer is not None
        indexer_cls = KPoolIndexer if cfg.index_kpool else Indexer             # GLM-5.3-Flash pools its keys
        self.indexer = (indexer_cls(cfg, quant_config=quant_config, prefix=f"{prefix}.indexer", params_dtype=params_dtype)
                        if full_indexer else None)
        self.w_kc: torch.Tensor | None = None                                   # [h, dn, r]
        self.w_vc: torch.Tensor | None = None                                   # [h, r, dv]

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into the absorbed per-head W_UK / W_UV (after its quant method ran)."""
        w = self.kv_b_proj.quant_method.dequantized_weight(self.kv_b_proj) \
            if hasattr(self.kv_b_proj.quant_method, "dequantized_weight") else self.kv_b_proj.weight
        w = w.view(self.h, self.dn + self.dv, self.r)                           # rows grouped per head
        self.w_kc = w[:, :self.dn, :].contiguous()                              # [h, dn, r]
        self.w_vc = w[:, self.dn:, :].transpose(1, 2).contiguous()              # [h, r, dv]

    # ---- the three parts of forward: projections | attention | output projection. A piecewise CUDA
    # graph (worker/piecewise_graph.py) captures `project` and `o_proj` and runs `attend` eagerly.
    def scores(self, batch: ForwardBatch) -> bool:
        """Whether this layer's indexer scores in this step: some group's context exceeds index_topk
        (below it the selection is dense causal)."""
        return self.indexer is not None and any(g.max_context_len > self.indexer.topk for g in batch.groups)

    def project(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache | None, kv_cache: torch.Tensor,
                index_cache: torch.Tensor | None, index_queries: bool,
                out: dict[str, torch.Tensor] | None = None) -> MLAQuery:
        """x [T, D] (normed) -> the queries; writes the step's cache rows (latent + k_pe, index keys).
        Reads only `batch.slot_mapping`. `index_queries`: compute the indexer's queries too (needed when
        `scores(batch)`). `out`: buffers "q" / "iq" / "iw" the results are written into (a piecewise
        graph's static carry; no copy after)."""
        out = out or {}
        T = x.shape[0]
        if self.fused_qkv_a:
            qa, ckv = self.fused_qkv_a_proj(x).split([self.rq, self.r + self.dr], -1)   # [T, rq], [T, r+dr] views
        else:
            qa = self.q_a_proj(x) if self.rq else None                          # [T, rq]
            ckv = self.kv_a_proj_with_mqa(x)                                    # [T, r+dr]
        side = side_stream_for(x, self.side_stream_tokens)                     # decode: cache writes beside q
        if side is not None:
            with forked(side):
                self._write_caches(x, ckv, batch, rope, kv_cache, index_cache)
        else:
            self._write_caches(x, ckv, batch, rope, kv_cache, index_cache)
        q_resid = self.q_a_layernorm(qa) if self.rq else None                  # [T, rq]
        iq = sels = None
        # a decode step that scores: the indexer (queries, scores, top-k) on the side stream too, after the
        # key write, beside the query path (both read q_resid)
        # (not under a piecewise graph's static carry `out`: its pieces carry tensors only)
        early = (side is not None and self.indexer is not None and index_queries and not out
                 and all(g.mla_mode == "absorbed" and g.q_index.shape[1] == 1 for g in batch.groups))
        if early:
            with forked(side):                                                  # after q_resid, too
                iq = self.indexer.queries(x, q_resid, rope, out.get("iq"), out.get("iw"))   # [T, Hi, di], [T, Hi]
                sels = tuple(self.indexer.select(g, iq, index_cache) if g.max_context_len > self.indexer.topk
                             else None for g in batch.groups)
        # the projection writes the static carry's buffer itself (no [T, h, dn+dr] copy after it)
        q_dst = out["q"].view(T, -1) if "q" in out else None                   # [T, h*(dn+dr)]
        q = self.q_b_proj(q_resid, q_dst) if self.rq else self.q_proj(x, q_dst)
        q = q.view(T, self.h, self.dn + self.dr)                                # [T, h, dn+dr]
        if self.dr:                                                             # rope of q_pe, in place
            kernels.ops().rope_inplace(q, rope.cos, rope.sin, self.interleave, self.dn)
        if self.indexer is not None and index_queries and not early:
            iq = self.indexer.queries(x, q_resid, rope, out.get("iq"), out.get("iw"))   # [T, Hi, di], [T, Hi]
        if side is not None:
            join(side)                                                          # caches written, selections made
        return MLAQuery(q, iq, sels)

    def _write_caches(self, x: torch.Tensor, ckv: torch.Tensor, batch: ForwardBatch, rope: RopeCache | None,
                      kv_cache: torch.Tensor, index_cache: torch.Tensor | None) -> None:
        """The step's cache rows: [kv_a_layernorm(c) | rope(k_pe)] at slot_mapping (one `mla_kv_write` op)
        and the indexer's keys."""
        cos, sin = (rope.cos, rope.sin) if self.dr else (None, None)           # [T, dr] each
        kernels.ops().mla_kv_write(ckv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin,
                                   self.interleave, kv_cache, batch.slot_mapping)
        if self.indexer is not None:
            self.indexer.write_keys(x, batch, rope, index_cache)

    def attend(self, query: MLAQuery, batch: ForwardBatch, kv_cache: torch.Tensor, index_cache: torch.Tensor | None,
               prev_mask: tuple[torch.Tensor | None, ...] | None, out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
        """Attention of every group of the step -> (o [T, h, dv] (written into `out` when given),
        the DSA selections per group for IndexShare layers, or None)."""
        q = query.q                                                             # [T, h, dn+dr]
        T = q.shape[0]
        whole = len(batch.groups) == 1 and batch.groups[0].row_span == (0, T)  # one group, rows in order
        o = out if (out is not None or whole) else q.new_empty(T, self.h, self.dv)   # [T, h, dv]
        selections = []
        for gi, g in enumerate(batch.groups):                                   # decode groups, prefill buckets
            sel = None                                                          # None: dense causal
            if query.selections is not None:                                    # made beside the query path
                sel = query.selections[gi]
            elif self.indexer is not None:
                # while every context fits in index_topk, selection = dense causal (no scoring)
                if g.max_context_len > self.indexer.topk:
                    if query.index_q is None:
                        raise RuntimeError("the indexer scores this step but project() skipped its queries")
                    sel = self.indexer.select(g, query.index_q, index_cache)   # [B, Qmax, k|Kmax]
            elif self.uses_dsa and prev_mask is not None:
                sel = prev_mask[gi]
            selections.append(sel)
            attend = self._naive if g.mla_mode == "naive" else self._absorbed
            # a group owning a span of the step's rows writes its rows of `o` (a piecewise graph's static carry)
            # itself: no copy of [Tg, h, dv] after each attention (128 MiB a layer at 8k glm5-flash-31b tokens)
            dst = o[g.row_span[0]:g.row_span[1]] if o is not None and g.row_span is not None else None
            og = attend(q, kv_cache, sel, g, dst)                               # [Tg, h, dv]
            if o is None:                                                       # the whole step: no copy
                o = og
            elif dst is not None:
                if og.data_ptr() != dst.data_ptr():                             # (an op that returned its own)
                    dst.copy_(og)
            else:
                o.index_copy_(0, g.token_index, og)
        return o, (tuple(selections) if self.uses_dsa else None)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache | None,
                kv_cache: torch.Tensor, index_cache: torch.Tensor | None,
                prev_mask: tuple[torch.Tensor | None, ...] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
        """x [T, D] -> (o_proj output [T, D], selections)."""
        query = self.project(x, batch, rope, kv_cache, index_cache, self.scores(batch))
        o, selections = self.attend(query, batch, kv_cache, index_cache, prev_mask)
        return self.o_proj(o.reshape(x.shape[0], self.h * self.dv)), selections

    def _naive(self, q, kv_cache, selection, group: AttnGroup, out=None):
        """Expand the context latents to per-head K/V with kv_b_proj and run MHA (prefill): the
        `mla_prefill` kernel op, writing `out` [Tg, h, dv] when given."""
        return kernels.ops().mla_prefill(q, kv_cache, group, selection, self.kv_b_proj,
                                         kv_lora_rank=self.r, v_head_dim=self.dv, scale=self.scale,
                                         max_bytes=_ATTN_BYTES, out=out)        # [Tg, h, dv]

    def _absorbed(self, q, kv_cache, selection, group: AttnGroup, out=None):
        """Fold W_UK into the query, attend in latent space against the one shared latent KV head
        (MQA: the `mla_decode` kernel op), unfold W_UV from the output (decode) into `out` [Tg, h, dv] when
        given."""
        q_abs = q.new_empty(q.shape[0], self.h, self.r + self.dr)               # [T, h, r+dr]
        # a decode group beside a prefill chunk owns a span of the step's rows: fold only those (the op reads
        # only the group's rows; a 2048-token chunk's rows would cost a [h, 2k, dn] x [h, dn, r] bmm per layer)
        a, b = group.row_span if group.row_span is not None and group.q_index.shape[1] == 1 else (0, q.shape[0])
        q_nope, q_pe = q[a:b, :, :self.dn], q[a:b, :, self.dn:]                 # [Tg, h, dn], [Tg, h, dr]
        # W_UK folded straight into the first r dims (cuBLAS writes the strided rows), q_pe copied beside:
        # one small copy instead of a cat of the whole [Tg, h, r+dr]
        torch.bmm(q_nope.transpose(0, 1), self.w_kc.to(q_nope.dtype), out=q_abs[a:b, :, :self.r].transpose(0, 1))
        q_abs[a:b, :, self.r:] = q_pe
        o_lat = kernels.ops().mla_decode(q_abs, kv_cache, group, selection,
                                         kv_lora_rank=self.r, scale=self.scale, max_bytes=_ATTN_BYTES)   # [Tg, h, r]
        o = out if out is not None else o_lat.new_empty(o_lat.shape[0], self.h, self.dv)   # [Tg, h, dv]: o_proj
        torch.bmm(o_lat.transpose(0, 1), self.w_vc.to(o_lat.dtype), out=o.transpose(0, 1))   # reads it as a view
        return o
