"""Pure-torch routed-expert MoE: sorted/grouped dispatch, no per-expert Python loop.

(token, slot) pairs are sorted by expert id, each expert's contiguous run is multiplied with one
`torch._grouped_mm` call (offsets = cumulative counts), and the results are scattered back with
`index_add_`. This is the CPU hot path and the oracle for the GPU MoE kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g) * u, or the clamped form silu(min(g, L)) * clamp(u, -L, L) when `limit` is set."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # x [N, K] sorted by group, w [E, K, M], offs [E] int32 cumulative ends -> [N, M]
    if x.dtype == torch.float32 and x.device.type == "cuda":
        # NOTE: CUDA grouped_mm is bf16-only; fp32 on GPU is a test configuration, go through bmm.
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        eid = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts, output_size=x.shape[0])
        return torch.bmm(x.unsqueeze(1), w[eid]).squeeze(1)
    return torch._grouped_mm(x, w, offs=offs)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, swiglu_limit: float | None = None,
              intermediate_pad: int = 0) -> torch.Tensor:
    """Routed experts.  x [T, D]; w13 [E, 2I, D] = [gate rows ; up rows] (separated halves);
    w2 [E, D, I]; topk_weights/ids [T, K] -> out [T, D] in x.dtype (accumulated in fp32).

    `intermediate_pad` trailing columns of each half are zero padding (results unchanged).
    """
    T, D = x.shape
    E, two_i, _ = w13.shape
    K = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)                                   # [T*K]
    order = torch.argsort(flat_ids, stable=True)                      # pairs sorted by expert
    token_of = order // K                                             # [T*K] source token per pair
    # NOTE: scatter_add, not bincount: CUDA bincount reads the max back to the host (a sync; no graphs)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat_ids.long(), torch.ones_like(flat_ids, dtype=torch.int64))   # [E]
    offs = torch.cumsum(counts, 0).to(torch.int32)                    # [E]
    xs = x.index_select(0, token_of)                                  # [T*K, D]
    h = _grouped_mm(xs, w13.transpose(1, 2), offs)                    # [T*K, 2I]
    inter = two_i // 2
    a = swiglu(h[:, :inter], h[:, inter:], swiglu_limit)              # [T*K, I]
    y = _grouped_mm(a, w2.transpose(1, 2), offs)                      # [T*K, D]
    w = topk_weights.reshape(-1)[order].to(torch.float32)             # [T*K]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y.float() * w[:, None])
    return out.to(x.dtype)


def fused_moe_naive(x, w13, w2, topk_weights, topk_ids, *, swiglu_limit=None, intermediate_pad=0):
    """Test oracle: per-(token, slot) gathered weights, written as plainly as possible."""
    inter = w13.shape[1] // 2
    wg = w13[topk_ids]                                                # [T, K, 2I, D]
    h = torch.einsum("td,tkid->tki", x.float(), wg.float())           # [T, K, 2I]
    a = swiglu(h[..., :inter], h[..., inter:], swiglu_limit)          # [T, K, I]
    y = torch.einsum("tki,tkdi->tkd", a, w2[topk_ids].float())        # [T, K, D]
    return (y * topk_weights[..., None].float()).sum(1).to(x.dtype)
