"""Pure-torch DSA lightning-indexer scoring + top-k of one `AttnGroup`: the references of the
`indexer_topk` (GLM-5: one key per token) and `indexer_kpool_topk` (GLM-5.3-Flash: pooled keys + tail)
kernel ops. The math (scores, pools, candidates, tail) is documented on the layers
(glm_ray/layers/indexer.py, glm_ray/layers/kpool_indexer.py); these are their selection loops, moved.

`indexer_topk` returns the selection as indices: int32 positions [B, Qmax, k] (k = min(topk, Kmax), -1
where a query has fewer than k causal keys), which attention reads as a page table of page size 1
(O(topk) work per query); `selection_mask` turns them into the bool mask [B, Qmax, Kmax] (selected AND
causal) the torch attention references apply (as it does a backend's bitmap, `SelectionBits`). `indexer_kpool_topk` (pools of tokens + a tail, a
variable count per query) still returns the mask. The per-head ReLU scores [B, q, Hi, n] fp32 are the big tensor (GLM-5: 32 heads x 8k keys = 1 MiB
per query row) and the gathered keys grow with the group's contexts: both are tiled — queries into
chunks, keys (pools) into chunks whose top-k are merged — so each tile stays within `max_bytes`. Loops
over tiles, not tokens; one tile in the common case.
"""
from __future__ import annotations

import torch

from glm_ray.forward_batch import AttnGroup
from glm_ray.kernels.torch_ref.topk import SelectionBits, unpack_bits

SCORE_BYTES = 256 * 2**20          # default tile bound (the indexer layers pass their own)


def indexer_topk(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, group: AttnGroup, topk: int, *,
                 max_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """I[s,t] = sum_h w[s,h] * relu(qi[s,h] . k[t] * di^-0.5); the `topk` best causal keys per query.

    qi [T, Hi, di] fp32 or bf16 (scored in fp32), w [T, Hi] fp32 (head weights incl. Hi^-0.5): rows of the whole step;
    key_cache [S, di] (roped, normalised keys at the flat slots). Returns indices [B, Qmax, k] int32:
    positions in the sequence, -1 for the picks that are not causal keys (fewer than k exist).
    """
    Q, W = qi[group.q_index].float(), w[group.q_index]                      # [B, Qmax, Hi, di], [B, Qmax, Hi]
    causal, kv_slots = group.causal, group.kv_slots
    B, Qmax, Kmax = causal.shape
    n_heads, head_dim = qi.shape[-2], qi.shape[-1]
    k = min(topk, Kmax)
    kc = max(k, min(Kmax, max_bytes // (B * head_dim * 4)))                 # keys per tile
    qc = max(1, max_bytes // (B * n_heads * kc * 4))                        # queries per tile
    out = torch.empty(B, Qmax, k, dtype=torch.int32, device=causal.device)
    for q0 in range(0, Qmax, qc):
        sl = slice(q0, q0 + qc)
        best_v = best_i = None
        for k0 in range(0, Kmax, kc):
            ks = slice(k0, k0 + kc)
            K = key_cache[kv_slots[:, ks]].float()                          # [B, n, di]
            s = torch.einsum("bqhd,bkd->bqhk", Q[:, sl], K).mul_(head_dim ** -0.5).relu_()   # [B, q, Hi, n]
            scores = torch.einsum("bqh,bqhk->bqk", W[:, sl], s)             # [B, q, n]
            scores.masked_fill_(~causal[:, sl, ks], float("-inf"))
            v, i = scores.topk(min(k, scores.shape[-1]), dim=-1)            # [B, q, <=k]
            i = i + k0
            if best_v is not None:                                          # merge with earlier tiles
                v, j = torch.cat([best_v, v], -1).topk(k, dim=-1)
                i = torch.cat([best_i, i], -1).gather(-1, j)
            best_v, best_i = v, i
        out[:, sl] = torch.where(best_v == float("-inf"), -1, best_i).to(torch.int32)
    return out


def selection_mask(group: AttnGroup, selection: torch.Tensor) -> torch.Tensor:
    """A selection as the bool mask [B, Qmax, Kmax] (selected AND causal) on the group's padded view:
    int32 indices [B, Qmax, k] (-1 = none) are scattered, a `SelectionBits` bitmap unpacked; a bool mask
    passes through."""
    causal = group.causal
    Kmax = causal.shape[-1]
    if isinstance(selection, SelectionBits):
        B, Qmax = causal.shape[:2]
        mask = torch.zeros(B * Qmax, Kmax, dtype=torch.bool, device=causal.device)      # [B*Qmax, Kmax]
        mask[group.packed] = unpack_bits(selection.bits, Kmax)
        return mask.view(B, Qmax, Kmax) & causal
    if selection.dtype == torch.bool:
        return selection
    idx = selection.long()
    mask = torch.zeros(*causal.shape[:2], Kmax + 1, dtype=torch.bool, device=causal.device)   # col Kmax: -1
    mask.scatter_(-1, torch.where(idx < 0, Kmax, idx.clamp(max=Kmax)), True)
    return mask[..., :Kmax] & causal


def pool_keys(rows: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pool keys [B, n, di] fp32 from the cache rows [B, n*kp, 2di] ([ki | gi]) of n whole pools:
    per channel, the softmax (over the pool's kp tokens) of gi + ape weights the keys ki."""
    B, di, kp = rows.shape[0], rows.shape[-1] // 2, kpool
    rows = rows.float().view(B, -1, kp, 2 * di)                             # [B, n, kp, 2di]
    keys, gates = rows[..., :di], rows[..., di:]
    prob = (gates + ape.float()).softmax(dim=2)                             # over the kp tokens
    return prob.mul_(keys).sum(dim=2)


def indexer_kpool_topk(qi: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, group: AttnGroup,
                       ape: torch.Tensor, *, kpool: int, pool_topk: int, tail: bool,
                       max_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """Pooled-key selection: the `pool_topk` best complete, causal-visible pools per query (scored like
    `indexer_topk` against the pool keys), expanded to their kpool tokens, plus (when `tail`) the
    query's incomplete pool.

    qi [T, Hi, di] fp32 or bf16 (scored in fp32), w [T, Hi] fp32: rows of the whole step; key_cache [S, 2di]
    rows [ki | gi]; ape [kpool, di] fp32. Pools tile every sequence from position 0. Returns mask [B, Qmax, Kmax] bool.
    """
    Q, W = qi[group.q_index].float(), w[group.q_index]                      # [B, Qmax, Hi, di], [B, Qmax, Hi]
    n_heads, head_dim = qi.shape[-2], qi.shape[-1]
    causal = group.causal
    B, Qmax, Kmax = causal.shape
    kp, P = kpool, Kmax // kpool                                            # complete pools in the longest context
    # pool p is a candidate iff its last token is causal-visible (key valid => pool complete)
    cand = causal[:, :, kp - 1::kp]                                         # [B, Qmax, P]
    k = min(pool_topk, P)
    picked = torch.zeros(B, Qmax, P + 1, dtype=torch.bool, device=causal.device)   # col P: discard
    if k > 0:
        pc = max(k, min(P, max_bytes // (B * kp * 2 * head_dim * 4)))      # pools per tile
        qc = max(1, max_bytes // (B * n_heads * pc * 4))                    # queries per tile
        best_v = torch.full((B, Qmax, k), float("-inf"), device=causal.device)
        best_i = torch.full((B, Qmax, k), P, dtype=torch.int64, device=causal.device)
        for p0 in range(0, P, pc):
            p1 = min(P, p0 + pc)
            pk = pool_keys(key_cache[group.kv_slots[:, p0 * kp:p1 * kp]], ape, kp)   # [B, n, di]
            for q0 in range(0, Qmax, qc):
                sl = slice(q0, q0 + qc)
                s = torch.einsum("bqhd,bpd->bqhp", Q[:, sl], pk).mul_(head_dim ** -0.5).relu_()
                scores = torch.einsum("bqh,bqhp->bqp", W[:, sl], s)           # [B, q, n]
                # masked_fill also clears NaN/inf of never-written cache rows (non-candidates)
                scores.masked_fill_(~cand[:, sl, p0:p1], float("-inf"))
                v = torch.cat([best_v[:, sl], scores], -1)
                i = torch.cat([best_i[:, sl], torch.arange(p0, p1, device=causal.device).expand_as(scores)], -1)
                v, j = v.topk(k, dim=-1)
                best_v[:, sl], best_i[:, sl] = v, i.gather(-1, j)
        # a -inf pick is no candidate (fewer than k exist): send it to the discard column
        picked.scatter_(-1, best_i.masked_fill(best_v == float("-inf"), P), True)
    keep = picked[..., :P]
    if tail:
        keep = keep | ~cand                                                 # the query's incomplete pool
    mask = torch.full_like(causal, tail)                                    # positions past the last full pool: tail
    mask[..., :P * kp] = keep.repeat_interleave(kp, dim=-1)
    return mask & causal
