"""Triton kernel for the MoE routing after the router GEMM (contract and torch reference:
kernels/torch_ref/routing.py): sigmoid, bias-corrected choice, grouped masking, top-k, renormalize and
scale in one launch instead of ~10 small torch launches per MoE layer.

One program handles BLOCK_T tokens; each token's E choices stay in registers as one row of a
[BLOCK_T, EP] tile (EP = E padded to a power of two). Every choice is packed with its column into one
int64 key, `ordered_int32(choice) << 32 | (EP - col)`, so a single max-reduction finds the largest
choice and, among equal ones, the LOWEST column. Top-k is K rounds of "max key, then drop that key":
ids come in descending choice order like `torch.topk`, ties go to the lowest index (torch.topk's tie
order is unspecified; tests use tie-free inputs). NaN choices order like torch (a +NaN above +inf).
Pad columns get the smallest key and are never picked (K <= E), so ids are distinct and in [0, E).
Grouped routing (n_group > 1): each group's top-2 keys give its score (top-2 choice sum, the same fp32
add as the reference); the topk_group groups of largest (score, lowest index) are kept by rank - a
[G, G] comparison, no sequential rounds - and the other groups' choices become -inf.
Weights are the un-biased sigmoids re-read at the chosen ids (same op on the same input, so the same
bits as the selection pass), renormalized with IEEE division and scaled.
Grid and constexprs depend on shapes and config only (CUDA-graph capturable, no host syncs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 512
MAX_TOP_K = 16
KEY_MIN = tl.constexpr(-9223372036854775808)                                  # int64 min: "no candidate"


@triton.jit
def _key(v, idx_code):
    """fp32 v, int32 idx_code in [1, 2^31) -> int64 key, ordered as (v, idx_code) (v totally ordered,
    -0 < +0, NaN by sign above +inf / below -inf)."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)                                    # monotone in v
    return (b.to(tl.int64) << 32) | idx_code.to(tl.int64)


@triton.jit
def _key_value(key):
    """Inverse of `_key` for the value part."""
    b = (key >> 32).to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=['T'])   # sizes that change per step: no recompiles (cuda/__init__)
def _moe_routing_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t, scale,
                        E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        N_GROUP: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                # [BT]
    row_ok = rows < T
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_t                      # [BT]
    col = tl.arange(0, EP)                                                    # [EP]
    valid = col < E
    x = tl.load(row_ptr[:, None] + col[None, :], mask=row_ok[:, None] & valid[None, :],
                other=0.0).to(tl.float32)                                     # [BT, EP]
    c = tl.sigmoid(x)                                                         # [BT, EP] scores
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + col, mask=valid, other=0.0).to(tl.float32)[None, :]   # choice

    if N_GROUP > 1:
        GS: tl.constexpr = E // N_GROUP
        gidx = tl.arange(0, GP)                                               # [GP]
        key = _key(c, EP - col[None, :])                                      # [BT, EP]
        gscore = tl.zeros([BLOCK_T, GP], dtype=tl.float32)                    # [BT, GP]
        for g in tl.static_range(N_GROUP):                                    # group score: sum of its top-2
            kg = tl.where(((col >= g * GS) & (col < (g + 1) * GS))[None, :], key, KEY_MIN)
            k1 = tl.max(kg, axis=1)                                           # [BT]
            k2 = tl.max(tl.where(kg == k1[:, None], KEY_MIN, kg), axis=1)     # [BT]
            gscore = tl.where(gidx[None, :] == g, (_key_value(k1) + _key_value(k2))[:, None], gscore)
        gkey = tl.where((gidx < N_GROUP)[None, :], _key(gscore, GP - gidx[None, :]), KEY_MIN)   # [BT, GP]
        rank = tl.sum((gkey[:, None, :] > gkey[:, :, None]).to(tl.int32), axis=2)             # [BT, GP]
        gkeep = (rank < TOPK_GROUP).to(tl.int32)                              # [BT, GP] topk_group ones
        ckeep = tl.zeros([BLOCK_T, EP], dtype=tl.int32)                       # [BT, EP]
        for g in tl.static_range(N_GROUP):
            keep_g = tl.max(tl.where(gidx[None, :] == g, gkeep, 0), axis=1)   # [BT]
            ing = ((col >= g * GS) & (col < (g + 1) * GS)).to(tl.int32)       # [EP]
            ckeep = ckeep | (ing[None, :] * keep_g[:, None])
        c = tl.where(ckeep != 0, c, float("-inf"))

    key = tl.where(valid[None, :], _key(c, EP - col[None, :]), KEY_MIN)       # [BT, EP]
    kcol = tl.arange(0, KP)                                                   # [KP]
    ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)                             # [BT, KP]
    for k in tl.static_range(K):                                              # one reduction per pick
        kmax = tl.max(key, axis=1)                                            # [BT]
        ids = tl.where(kcol[None, :] == k, (EP - kmax.to(tl.int32))[:, None], ids)
        key = tl.where(key == kmax[:, None], KEY_MIN, key)

    ok = row_ok[:, None] & (kcol[None, :] < K)                                # [BT, KP]
    w = tl.sigmoid(tl.load(row_ptr[:, None] + ids, mask=ok, other=0.0).to(tl.float32))   # [BT, KP] un-biased
    w = tl.where(ok, w, 0.0)
    if RENORM:
        tot = tl.sum(w, axis=1) + 1e-20                                       # [BT]
        w = tl.math.div_rn(w, tl.broadcast_to(tot[:, None], [BLOCK_T, KP]))
    w = w * scale
    out = rows[:, None] * K + kcol[None, :]                                   # [BT, KP]
    tl.store(w_ptr + out, w, mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)


def _block_t(T: int, ep: int) -> int:
    """Tokens per program: ~2K fp32 per tile, fewer for small batches (one program, less masked work)."""
    return max(1, min(2048 // ep, 32, triton.next_power_of_2(T)))


def moe_routing(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int,
                renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] (None = zeros) -> (weights [T, K] fp32, ids [T, K] int32)."""
    T, E = logits.shape
    assert E <= MAX_EXPERTS and 1 <= top_k <= min(E, MAX_TOP_K), (E, top_k)
    assert n_group >= 1 and E % n_group == 0 and 1 <= topk_group <= n_group, (E, n_group, topk_group)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return w, ids
    ep = max(2, triton.next_power_of_2(E))
    block = _block_t(T, ep)
    _moe_routing_kernel[(triton.cdiv(T, block),)](
        logits, bias.contiguous() if bias is not None else logits, w, ids, T, logits.stride(0), float(scale),
        E=E, EP=ep, K=top_k, KP=max(2, triton.next_power_of_2(top_k)),
        N_GROUP=n_group, GP=max(2, triton.next_power_of_2(n_group)), TOPK_GROUP=topk_group,
        HAS_BIAS=bias is not None, RENORM=bool(renormalize), BLOCK_T=block, num_warps=4)
    return w, ids
