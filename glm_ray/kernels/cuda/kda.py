"""Triton kernels of KDA (GLM-5.3-Flash's linear attention); contracts and torch references in
kernels/torch_ref/kda.py.

* `kda_decode` (op `kda_decode`): per (sequence, head, value tile) one program loads the state tile at the
  sequence's slot (zero when fresh), applies the gated delta rule for one token with L2-normalised q/k, writes
  the tile back in place and emits its output — one launch instead of the gather / where / ~12 elementwise
  ops / index_copy of the torch form.
* `kda_chunk_scan` (the sequential part of op `kda_chunked`; reference `chunk_scan`): the chunks' state-free
  terms (`chunk_terms`: intra-chunk scores and triangular solves, batched torch over every chunk) are
  consumed by one program per (batch x head, value tile) that keeps its [dk, BV] state tile in registers
  and walks the chunks in order: U = U0 - W S, o = Qd S + P U, S <- decay * S + Kd^T U (four dots per
  chunk) — one launch per batch of chunks (kda_chunked's byte budget: ~19 for an 8k-token prompt at GLM-5.3-
  Flash's 64 heads) instead of ~8 torch launches per 64-token chunk. fp32 operands; the dots run as
  3xTF32 (`tf32x3`: tensor cores at about fp32 accuracy; the interpreter computes them in fp32).
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


@triton.jit
def _kda_scan_kernel(w_ptr, u0_ptr, qd_ptr, p_ptr, kd_ptr, dec_ptr, s_ptr, o_ptr, M, DV, o_sn, o_sm,
                     C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    nid = tl.program_id(0)                                                    # batch x head
    vt = tl.program_id(1)                                                     # value tile
    rc = tl.arange(0, C)
    rk = tl.arange(0, DK)
    cv = vt * BV + tl.arange(0, BV)
    vok = cv < DV
    sp = s_ptr + nid.to(tl.int64) * DK * DV + rk[:, None] * DV + cv[None, :]
    S = tl.load(sp, mask=vok[None, :], other=0.0)                             # [DK, BV] fp32
    for i in range(M):
        c = (nid * M + i).to(tl.int64)                                        # chunk row of the terms
        W = tl.load(w_ptr + c * C * DK + rc[:, None] * DK + rk[None, :])      # [C, DK]
        U = tl.load(u0_ptr + c * C * DV + rc[:, None] * DV + cv[None, :], mask=vok[None, :], other=0.0)
        U = U - tl.dot(W, S, input_precision=PREC)                            # [C, BV]
        Q = tl.load(qd_ptr + c * C * DK + rc[:, None] * DK + rk[None, :])     # [C, DK]
        Pm = tl.load(p_ptr + c * C * C + rc[:, None] * C + rc[None, :])       # [C, C]
        o = tl.dot(Q, S, input_precision=PREC) + tl.dot(Pm, U, input_precision=PREC)   # [C, BV]
        op = o_ptr + nid.to(tl.int64) * o_sn + i * o_sm + rc[:, None] * DV + cv[None, :]
        tl.store(op, o, mask=vok[None, :])
        K = tl.load(kd_ptr + c * C * DK + rc[:, None] * DK + rk[None, :])     # [C, DK]
        dec = tl.load(dec_ptr + c * DK + rk)                                  # [DK]
        S = dec[:, None] * S + tl.dot(tl.trans(K), U, input_precision=PREC)   # [DK, BV]
    tl.store(sp, S, mask=vok[None, :])


SCAN_BV = 32          # value columns per program: N x dv / 32 programs (64 heads x 4 at GLM-5.3-Flash, dv 128)
SCAN_WARPS = 8        # the four [C, dk] / [dk, BV] fp32 operands of a chunk in registers
SCAN_STAGES = 2       # the chunk loop's loads double-buffered: 152 KiB of shared memory at C 64, dk 128 (Triton's
                      # default 3 stages need 272 KiB, over the H100/H200's 227 KiB: OutOfResources on the GPU)


def kda_chunk_scan(t, S: torch.Tensor, o: torch.Tensor, precision: str = "tf32x3") -> torch.Tensor:
    """`chunk_scan`'s contract (kernels/torch_ref/kda.py): t a ChunkTerms of m chunks (W, Qd, Kd [N, m, C, dk];
    U0 [N, m, C, dv]; P [N, m, C, C]; decay [N, m, dk]); S [N, dk, dv] fp32 (updated in place and returned);
    o [N, m, C, dv] fp32, rows of dv contiguous (a chunk-range view of the caller's output is fine)."""
    N, M, C, DK = t.W.shape
    DV = t.U0.shape[-1]
    assert DK & (DK - 1) == 0 and C & (C - 1) == 0 and C >= 16 and DK >= 16, "CudaKernels routes other shapes away"
    assert o.stride(3) == 1 and o.stride(2) == DV and S.dtype == torch.float32
    w, u0, qd, p, kd, dec = (x.float().contiguous() for x in (t.W, t.U0, t.Qd, t.P, t.Kd, t.decay))
    S = S.contiguous()
    BV = min(SCAN_BV, max(16, triton.next_power_of_2(DV)))
    _kda_scan_kernel[(N, triton.cdiv(DV, BV))](w, u0, qd, p, kd, dec, S, o, M, DV, o.stride(0), o.stride(1),
                                               C=C, DK=DK, BV=BV, PREC=precision, num_warps=SCAN_WARPS,
                                               num_stages=SCAN_STAGES)
    return S
