"""Multi-head latent attention (MLA) with the DSA indexer, over a paged latent KV cache.

Per token and layer the cache holds [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]: the normalized
latent and the roped shared key — identical on every TP rank. Two equivalent forms:

- naive (prefill): expand the context latents with kv_b_proj into per-head K/V and run MHA;
- absorbed (decode): fold W_UK into the query and W_UV into the output, attend in latent space
  as MQA with one KV head of dim r+dr (value = c).

Attention runs once per `AttnGroup` of the batch (decode group: absorbed; prefill group: naive, under
mla_mode "auto"). Sparse attention (DSA) is a boolean mask from the indexer ANDed with the causal
mask, one per group; "shared" layers (IndexShare) reuse the previous full layer's masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from glm_ray.config import ModelConfig
from glm_ray.layers.indexer import Indexer
from glm_ray.layers.kpool_indexer import KPoolIndexer
from glm_ray.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from glm_ray.layers.norm import RMSNorm
from glm_ray.layers.rotary import RopeCache, apply_rope
from glm_ray.forward_batch import AttnGroup, ForwardBatch


_CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Bound on the transient gathered / expanded context of one attention call; above it the context is
# processed in key chunks (`_online_softmax`).
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
        qk = self.dn + self.dr
        common = dict(quant_config=quant_config, params_dtype=params_dtype)
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, prefix=f"{prefix}.q_a_proj", **common)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, params_dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * qk, prefix=f"{prefix}.q_b_proj", tp=tp, **common)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, H * qk, prefix=f"{prefix}.q_proj", tp=tp, **common)
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

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeCache | None,
                kv_cache: torch.Tensor, index_cache: torch.Tensor | None,
                prev_mask: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        T = x.shape[0]
        if hasattr(self, "q_a_proj"):
            q_resid = self.q_a_layernorm(self.q_a_proj(x))                      # [T, rq]
            q = self.q_b_proj(q_resid)
        else:
            q_resid, q = None, self.q_proj(x)
        q = q.view(T, self.h, self.dn + self.dr)                                # [T, h, dn+dr]
        q_nope, q_pe = q[..., :self.dn], self._rope(q[..., self.dn:], rope)
        ckv = self.kv_a_proj_with_mqa(x)                                        # [T, r+dr]
        c = self.kv_a_layernorm(ckv[:, :self.r])                                # [T, r]
        k_pe = self._rope(ckv[:, None, self.r:], rope)[:, 0]                    # [T, dr]
        kv_cache.index_copy_(0, batch.slot_mapping, torch.cat([c, k_pe], -1).to(kv_cache.dtype))
        if self.indexer is not None:
            self.indexer.write_keys(x, batch, rope, index_cache)

        o = q_nope.new_empty(T, self.h, self.dv)                                # [T, h, dv]
        masks = []
        iq = None                                                               # index queries, when needed
        for gi, g in enumerate(batch.groups):                                   # decode groups, prefill buckets
            mask = g.causal                                                     # [B, Qmax, Kmax]
            if self.indexer is not None:
                # while every context fits in index_topk, selection = dense causal (no scoring)
                if g.max_context_len > self.indexer.topk:
                    iq = iq if iq is not None else self.indexer.queries(x, q_resid, rope)
                    mask = self.indexer.select(g, iq, index_cache)
            elif self.uses_dsa and prev_mask is not None:
                mask = prev_mask[gi]
            masks.append(mask)
            attend = self._naive if g.mla_mode == "naive" else self._absorbed
            o.index_copy_(0, g.token_index, attend(q_nope, q_pe, kv_cache, mask, g))   # [Tg, h, dv] rows
        return self.o_proj(o.reshape(T, self.h * self.dv)), (tuple(masks) if self.uses_dsa else None)

    def _rope(self, x: torch.Tensor, rope: RopeCache | None) -> torch.Tensor:
        return x if self.dr == 0 else apply_rope(x, rope, self.interleave)     # NoPE (GLM-5.3-Flash): dr = 0

    def _sdpa(self, q, k, v, mask, **kw):
        # q [B, Hq, Q, d], k/v [B, Hq|1, Kmax, d], mask [B, 1, Q, Kmax] bool
        # NOTE: padded query rows have an all-False mask; let them see everything (their output is dropped)
        m = mask | ~mask.any(-1, keepdim=True)
        if q.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=self.scale, **kw)
        # NOTE: cuDNN SDPA builds a new graph for every new (Qmax, Kmax) — i.e. every decode step
        # (~14 ms host time each, measured on H200). Masked attention goes to mem-efficient/math.
        with sdpa_kernel(_CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=self.scale, **kw)

    def _naive(self, q_nope, q_pe, kv_cache, mask, batch: AttnGroup):
        """Expand the context latents to per-head K/V with kv_b_proj and run MHA (prefill)."""
        B, K = batch.kv_slots.shape
        q = torch.cat([q_nope, q_pe], -1)[batch.q_index]                        # [B, Qmax, h, dn+dr]

        def expand(c):                                                          # [B, n, r+dr] -> K, V
            n = c.shape[1]
            kv = self.kv_b_proj(c[..., :self.r].reshape(B * n, self.r)).view(B, n, self.h, self.dn + self.dv)
            k = torch.cat([kv[..., :self.dn], c[..., None, self.r:].expand(B, n, self.h, self.dr)], -1)
            return k, kv[..., self.dn:]                                         # [B, n, h, dn+dr], [B, n, h, dv]

        per_key = B * self.h * (2 * self.dn + self.dr + self.dv) * kv_cache.element_size()
        if K * per_key > _ATTN_BYTES:                                           # long cached context
            o = self._online_softmax(q, lambda k0, k1: expand(kv_cache[batch.kv_slots[:, k0:k1]]), mask, K,
                                     per_key + B * self.h * self.dv * 4)
        else:
            k, v = expand(kv_cache[batch.kv_slots])                             # [B, K, h, *]
            o = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None]).transpose(1, 2)
        return o[batch.q_valid]                                                 # [Tg, h, dv]

    def _absorbed(self, q_nope, q_pe, kv_cache, mask, batch: AttnGroup):
        """Fold W_UK into the query, attend in latent space against the one shared latent KV head
        (MQA), unfold W_UV from the output (decode)."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_kc.to(q_nope.dtype)).transpose(0, 1)   # [T, h, r]
        q = torch.cat([q_lat, q_pe], -1)[batch.q_index]                         # [B, Qmax, h, r+dr]
        B, Qm, h, D = q.shape
        K = batch.kv_slots.shape[1]
        per_key = B * (D * kv_cache.element_size() + Qm * h * 2)                # gathered latents + bf16 bias
        if K * per_key > _ATTN_BYTES:                                           # many long contexts
            def latents(k0, k1):
                c = kv_cache[batch.kv_slots[:, k0:k1]]                          # [B, n, r+dr] shared by heads
                return c, c[..., :self.r]
            o_lat = self._online_softmax(q, latents, mask, K, B * D * (kv_cache.element_size() + 4))
        else:
            # NOTE: fold the heads into query rows ([B, 1, Qmax*h, D] against [B, 1, Kmax, D]) instead
            # of enable_gqa, which the math backend serves by copying K/V per head ([B, h, Kmax, r+dr]:
            # 5.9 GiB at 64 decodes x 1.1k context on the H200).
            kv = kv_cache[batch.kv_slots][:, None]                              # [B, 1, Kmax, r+dr]
            m = mask[:, :, None, :].expand(B, Qm, h, K).reshape(B, 1, Qm * h, K)   # [B, 1, Qmax*h, Kmax]
            o_lat = self._sdpa(q.reshape(B, 1, Qm * h, D), kv, kv[..., :self.r], m).reshape(B, Qm, h, self.r)
        o_lat = o_lat[batch.q_valid]                                            # [Tg, h, r]
        return torch.bmm(o_lat.transpose(0, 1), self.w_vc.to(o_lat.dtype)).transpose(0, 1)     # [Tg, h, dv]

    def _online_softmax(self, q, kv_chunk, mask, K: int, bytes_per_key: int) -> torch.Tensor:
        """Attention over key chunks with an online softmax (fp32 running max / sum / output), so the
        gathered (and, for naive MLA, expanded) context and the chunk's scores stay within
        `_ATTN_BYTES`: GLM-5 naive MLA at TP1 expands ~90 KB per context token (11.8 GB at 128k).
        A loop over key chunks, not tokens; taken only when the one-shot form would exceed the bound.

        q [B, Qm, H, D]; kv_chunk(k0, k1) -> K [B, n, H, D] and V [B, n, H, Dv] per head, or
        [B, n, D] / [B, n, Dv] shared by all heads (MQA); mask [B, Qm, K] -> [B, Qm, H, Dv] (q.dtype).
        """
        B, Qm, H, _ = q.shape
        kc = max(16, _ATTN_BYTES // (bytes_per_key + B * Qm * H * 4 * 3))     # + fp32 scores / probs
        m = q.new_full((B, Qm, H), float("-inf"), dtype=torch.float32)         # running max
        l = q.new_zeros((B, Qm, H), dtype=torch.float32)                        # running sum
        acc = None                                                              # running output
        for k0 in range(0, K, kc):
            k, v = kv_chunk(k0, k0 + kc)
            n = k.shape[1]
            shared = k.dim() == 3
            s = torch.einsum("bqhd,bkd->bqhk" if shared else "bqhd,bkhd->bqhk", q, k).float().mul_(self.scale)
            s.masked_fill_(~mask[:, :, None, k0:k0 + n], float("-inf"))         # [B, Qm, H, n]
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)                # rows with nothing seen yet
            p = torch.exp(s - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            pv = torch.einsum("bqhk,bkd->bqhd" if shared else "bqhk,bkhd->bqhd", p, v.float())
            acc = pv if acc is None else acc * corr[..., None] + pv
            m = m_new
        return (acc / l.clamp_min(1e-30)[..., None]).to(q.dtype)
