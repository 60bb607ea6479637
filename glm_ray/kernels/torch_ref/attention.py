"""Pure-torch MLA attention of one `AttnGroup` over the paged latent cache: the references of the
`mla_prefill` (naive: expanded per-head K/V, MHA) and `mla_decode` (absorbed: latent MQA) kernel ops.

Cache row per token: [c (kv_lora_rank r) | k_pe (dr)]. A group is a padded per-sequence view: its
queries gather rows of the step's packed tokens (`q_index` [B, Qmax]), its keys gather flat cache
slots (`kv_slots` [B, Kmax]). The selection is `None` (dense causal: `group.causal`), DSA top-k
indices [B, Qmax, k] int32 (-1 padded; applied as their mask, `indexer.selection_mask`) or a bool mask
[B, Qmax, Kmax] (selection AND causal). Outputs come back packed in the group's `q_valid` order
([Tg, ...], i.e. `group.token_index` rows).

One masked SDPA call per group, or — when the one-shot form's transient memory (gathered, and for
the naive form expanded, context plus scores) would exceed `max_bytes` — a walk over key chunks with
an online softmax (`online_softmax`): GLM-5 naive MLA at TP1 expands ~90 KB per context token (11.8 GB
at 128k). A loop over key chunks, not tokens.

On a GPU, SDPA is pinned to the mem-efficient / math backends for masked attention: cuDNN SDPA builds
a new graph for every new (Qmax, Kmax) — i.e. every decode step (~14 ms host time each, measured on
H200). The pin is part of this reference because the reference is also the GPU path of every backend
that does not override these ops (torch on a GPU, aiter on ROCm, cuda today).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from glm_ray.forward_batch import AttnGroup
from glm_ray.kernels.torch_ref.indexer import selection_mask

_CUDA_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Default bound on the transient gathered / expanded context of one call (the MLA layer passes its own).
ATTN_BYTES = 1 << 30


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, Q, d], k/v [B, Hq|1, Kmax, d], mask [B, 1, Q, Kmax] bool -> [B, Hq, Q, dv]."""
    # NOTE: padded query rows have an all-False mask; let them see everything (their output is dropped)
    m = mask | ~mask.any(-1, keepdim=True)
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
    with sdpa_kernel(_CUDA_SDPA_BACKENDS):                                  # see the module docstring
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)


def mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, group: AttnGroup, selection: torch.Tensor | None,
                kv_b: Callable[[torch.Tensor], torch.Tensor], *, kv_lora_rank: int, v_head_dim: int, scale: float,
                max_bytes: int = ATTN_BYTES, out: torch.Tensor | None = None) -> torch.Tensor:
    """Naive (expanded) MLA of one group: the context latents are expanded to per-head K/V with `kv_b`
    and attended as MHA.

    q [T, h, dn+dr] (nope | roped) rows of the whole step; kv_cache [S, r+dr]; kv_b: latents [N, r] ->
    [N, h*(dn+dv)] (the layer's kv_b_proj, rows grouped per head: dn key dims then dv value dims).
    Returns o [Tg, h, dv] in q.dtype (copied into `out` [Tg, h, dv] when given, which is returned).
    """
    mask = group.causal if selection is None else selection_mask(group, selection)   # [B, Qmax, Kmax]
    r, dv = kv_lora_rank, v_head_dim
    B, K = group.kv_slots.shape
    h = q.shape[1]
    dr = kv_cache.shape[-1] - r
    dn = q.shape[-1] - dr
    qg = q[group.q_index]                                                   # [B, Qmax, h, dn+dr]

    def expand(c):                                                          # [B, n, r+dr] -> K, V
        n = c.shape[1]
        kv = kv_b(c[..., :r].reshape(B * n, r)).view(B, n, h, dn + dv)
        k = torch.cat([kv[..., :dn], c[..., None, r:].expand(B, n, h, dr)], -1)
        return k, kv[..., dn:]                                              # [B, n, h, dn+dr], [B, n, h, dv]

    per_key = B * h * (2 * dn + dr + dv) * kv_cache.element_size()
    if K * per_key > max_bytes:                                             # long cached context
        o = online_softmax(qg, lambda k0, k1: expand(kv_cache[group.kv_slots[:, k0:k1]]), mask, K,
                           per_key + B * h * dv * 4, scale=scale, max_bytes=max_bytes)
    else:
        k, v = expand(kv_cache[group.kv_slots])                             # [B, K, h, *]
        o = sdpa(qg.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scale).transpose(1, 2)
    o = o.flatten(0, 1)[group.packed]                                       # [Tg, h, dv]
    return o if out is None else out.copy_(o)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, group: AttnGroup, selection: torch.Tensor | None, *,
               kv_lora_rank: int, scale: float, max_bytes: int = ATTN_BYTES) -> torch.Tensor:
    """Absorbed MLA of one group: attention in latent space against the one shared latent KV head
    (MQA: key = the cache row [c | k_pe], value = c).

    q [T, h, r+dr] (W_UK-absorbed nope part | roped part) rows of the whole step; kv_cache [S, r+dr].
    Returns the latent output o_lat [Tg, h, r] in q.dtype (the caller unfolds W_UV).
    """
    mask = group.causal if selection is None else selection_mask(group, selection)   # [B, Qmax, Kmax]
    r = kv_lora_rank
    qg = q[group.q_index]                                                   # [B, Qmax, h, r+dr]
    B, Qm, h, D = qg.shape
    K = group.kv_slots.shape[1]
    per_key = B * (D * kv_cache.element_size() + Qm * h * 2)                # gathered latents + bf16 bias
    if K * per_key > max_bytes:                                             # many long contexts
        def latents(k0, k1):
            c = kv_cache[group.kv_slots[:, k0:k1]]                          # [B, n, r+dr] shared by heads
            return c, c[..., :r]
        o_lat = online_softmax(qg, latents, mask, K, B * D * (kv_cache.element_size() + 4), scale=scale,
                               max_bytes=max_bytes)
    else:
        # NOTE: fold the heads into query rows ([B, 1, Qmax*h, D] against [B, 1, Kmax, D]) instead
        # of enable_gqa, which the math backend serves by copying K/V per head ([B, h, Kmax, r+dr]:
        # 5.9 GiB at 64 decodes x 1.1k context on the H200).
        kv = kv_cache[group.kv_slots][:, None]                              # [B, 1, Kmax, r+dr]
        m = mask[:, :, None, :].expand(B, Qm, h, K).reshape(B, 1, Qm * h, K)   # [B, 1, Qmax*h, Kmax]
        o_lat = sdpa(qg.reshape(B, 1, Qm * h, D), kv, kv[..., :r], m, scale).reshape(B, Qm, h, r)
    return o_lat.flatten(0, 1)[group.packed]                                # [Tg, h, r]


def online_softmax(q: torch.Tensor, kv_chunk, mask: torch.Tensor, K: int, bytes_per_key: int, *, scale: float,
                   max_bytes: int = ATTN_BYTES) -> torch.Tensor:
    """Attention over key chunks with an online softmax (fp32 running max / sum / output), so the
    gathered (and, for naive MLA, expanded) context and the chunk's scores stay within `max_bytes`.

    q [B, Qm, H, D]; kv_chunk(k0, k1) -> K [B, n, H, D] and V [B, n, H, Dv] per head, or
    [B, n, D] / [B, n, Dv] shared by all heads (MQA); mask [B, Qm, K] -> [B, Qm, H, Dv] (q.dtype).
    """
    B, Qm, H, _ = q.shape
    kc = max(16, max_bytes // (bytes_per_key + B * Qm * H * 4 * 3))         # + fp32 scores / probs
    m = q.new_full((B, Qm, H), float("-inf"), dtype=torch.float32)         # running max
    l = q.new_zeros((B, Qm, H), dtype=torch.float32)                        # running sum
    acc = None                                                              # running output
    for k0 in range(0, K, kc):
        k, v = kv_chunk(k0, k0 + kc)
        n = k.shape[1]
        shared = k.dim() == 3
        s = torch.einsum("bqhd,bkd->bqhk" if shared else "bqhd,bkhd->bqhk", q, k).float().mul_(scale)
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
