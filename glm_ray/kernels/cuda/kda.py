"""Triton kernel for the KDA decode step against the state cache (contract and torch reference:
`kda_decode` in kernels/torch_ref/kda.py): per (sequence, head, value tile) one program loads the
state tile at the sequence's slot (zero when fresh), applies the gated delta rule for one token with
L2-normalised q/k, writes the tile back in place and emits its output — one launch instead of the
gather / where / ~12 elementwise ops / index_copy of the torch form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, fresh_ptr, o_ptr,
                       H, DV, scale, eps, DK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    ck = tl.arange(0, DK)                                                     # [DK]
    cv = vt * BV + tl.arange(0, BV)                                           # [BV]
    vok = cv < DV
    row = b * H + h
    q = tl.load(q_ptr + row * DK + ck).to(tl.float32)
    k = tl.load(k_ptr + row * DK + ck).to(tl.float32)
    g = tl.load(g_ptr + row * DK + ck).to(tl.float32)
    v = tl.load(v_ptr + row * DV + cv, mask=vok, other=0.0).to(tl.float32)   # [BV]
    beta = tl.load(beta_ptr + row).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + eps)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    fresh = tl.load(fresh_ptr + b)
    sp = state_ptr + (slot * H + h) * DK * DV + ck[:, None] * DV + cv[None, :]   # [DK, BV]
    s = tl.load(sp, mask=vok[None, :], other=0.0)
    s = tl.where(fresh != 0, 0.0, s)
    s = s * tl.exp(g)[:, None]                                                # decay
    mem = tl.sum(s * k[:, None], 0)                                           # [BV]  kᵀS
    s = s + k[:, None] * (beta * (v - mem))[None, :]                          # delta rule
    o = tl.sum(s * q[:, None], 0)                                             # [BV]  qᵀS
    tl.store(sp, s, mask=vok[None, :])
    tl.store(o_ptr + row * DV + cv, o, mask=vok)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """q, k, g [B, H, dk]; v [B, H, dv]; beta [B, H]; state [S, H, dk, dv] fp32 (updated in place at
    `slots` [B], zeros where `fresh` [B]) -> o [B, H, dv] in q.dtype."""
    B, H, DK = k.shape
    DV = v.shape[-1]
    assert DK & (DK - 1) == 0 and state.dtype == torch.float32, "CudaKernels routes other shapes to the reference"
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(B, H, DV, dtype=torch.float32, device=q.device)
    BV = min(32, triton.next_power_of_2(DV))
    _kda_decode_kernel[(B, H, triton.cdiv(DV, BV))](
        q, k, v, g, beta, state, slots.contiguous(), fresh.to(torch.int8).contiguous(), o, H, DV, DK ** -0.5, 1e-6,
        DK=DK, BV=BV)
    return o.to(q.dtype)
