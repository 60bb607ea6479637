"""Pure-torch reference kernels of Kimi Delta Attention (KDA), the linear-attention mixer of
GLM-5.3-Flash (`glm5_next`): the gated delta rule with a per-channel forget gate, in its chunked
(prefill) and one-token recurrent (decode) forms, plus the depthwise causal short convolution that
precedes it. All state math is fp32.

Per head, with q, k L2-normalised (q also scaled by dk^-0.5), log-decay g <= 0 (per key channel),
beta in (0, 1) and state S [dk, dv]:

    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - k_t^T S))^T          o_t = q_t^T S

Chunked form (chunk of C rows, state S0 at its start, G = inclusive cumsum of g inside the chunk):

    A[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s < t)
    U       = (I + A)^-1 (beta*v  -  beta*(k*exp(G)) S0)          (one unit-lower triangular solve)
    o       = (q*exp(G)) S0 + P U,   P[t, s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])  (s <= t)
    S_end   = exp(G_last) * S0 + (k*exp(G_last - G))^T U

Only S is sequential: A, P, the solve (W = (I + A)^-1 beta*k*exp(G), U0 = (I + A)^-1 beta*v) and the decayed
q / k terms depend on the chunk alone, so `chunk_terms` builds them for a batch of chunks at once and
`chunk_scan` carries S through them (U = U0 - W S, then o and S_end as above: four matmuls a chunk; the cuda
backend's `kda_chunk_scan` kernel has the same contract).

The decay-weighted scores A and P never form exp(+x): the chunk is split into sub-blocks; pairs in
different sub-blocks factor through the cumulative decay at the row block's start (both factors
<= 1), pairs inside one sub-block use the elementwise form. So any g <= 0 is safe in fp32.

Padding contract: trailing rows with k = v = 0, beta = 0, g = 0 leave the state exactly as after the
last real row (their outputs are meaningless and must be dropped by the caller).

The kernel ops' references run these against the per-sequence state caches (rows read at the
sequences' slots, zeros where fresh, written back in place): `causal_conv1d_cached` (op
`causal_conv1d`), `kda_chunked_cached` (op `kda_chunked`) and `kda_decode` (op `kda_decode`, the
recurrent form).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (FLA's l2norm; not max(norm, eps))."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


_SUB = 8   # sub-block rows: the transient memory is ~ rows * (sub + C/sub) * dk per chunk


def _intra_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, Gx: torch.Tensor,
                  sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted scores inside one chunk, X[t, s] = sum_c x_t[c] k_s[c] exp(G_t[c] - G_s[c]):
    (Akk strictly lower: s < t, with x = k; Pqk lower incl. the diagonal: s <= t, with x = q), zero above.

    q, k, G (inclusive cumsum), Gx = G - g (exclusive): [N, C, dk] -> two [N, C, C].
    """
    N, C, dk = k.shape
    nb = C // sub
    dev = k.device
    # pairs in different sub-blocks: factor through R_i = exclusive cumsum at the start of row block i
    R = Gx[:, ::sub]                                                          # [N, nb, dk]
    dec_t = torch.exp(G - R.repeat_interleave(sub, 1))                        # [N, C, dk]   exponent <= 0
    before = torch.arange(C, device=dev)[None, :] < (torch.arange(nb, device=dev) * sub)[:, None]  # [nb, C]
    kk = R[:, :, None, :] - G[:, None, :, :]                                  # [N, nb, C(s), dk]
    kk = kk.masked_fill_(~before[None, :, :, None], -math.inf).exp_().mul_(k[:, None])   # exponent <= 0
    kkT = kk.transpose(-1, -2)                                                # [N, nb, dk, C]
    A = ((k * dec_t).view(N, nb, sub, dk) @ kkT).reshape(N, C, C)             # zero on/above diag blocks
    P = ((q * dec_t).view(N, nb, sub, dk) @ kkT).reshape(N, C, C)
    del kk, kkT
    # pairs inside one sub-block: elementwise decay, masked before the exp
    tri = torch.ones(sub, sub, dtype=torch.bool, device=dev).tril()           # [sub(t), sub(s)] s <= t
    Gb, kb, qb = (x.view(N, nb, sub, dk) for x in (G, k, q))
    E = Gb[:, :, :, None] - Gb[:, :, None]                                    # [N, nb, t, s, dk]
    E = E.masked_fill_(~tri[:, :, None], -math.inf).exp_().mul_(kb[:, :, None])   # k_s exp(G_t - G_s)
    DA = torch.einsum("nbtsc,nbtc->nbts", E, kb) * tri.tril(-1)               # [N, nb, t, s] strict
    DP = torch.einsum("nbtsc,nbtc->nbts", E, qb)                              # [N, nb, t, s]
    for M, D in ((A, DA), (P, DP)):
        torch.diagonal(M.view(N, nb, sub, nb, sub), dim1=1, dim2=3).copy_(D.permute(0, 2, 3, 1))  # [N, t, s, nb]
    return A, P


@dataclass
class ChunkTerms:
    """What the sequential part of the chunked form needs per chunk, computed for many chunks at once
    (nothing here depends on the state). N = batch x heads, m chunks of C rows; fp32.

        U  = U0 - W S                 o = Qd S + P U              S <- decay * S + Kd^T U
    """
    W: torch.Tensor        # [N, m, C, dk]  (I + A)^-1 (beta * k * exp(G))
    U0: torch.Tensor       # [N, m, C, dv]  (I + A)^-1 (beta * v)
    Qd: torch.Tensor       # [N, m, C, dk]  q * exp(G)
    P: torch.Tensor        # [N, m, C, C]   decay-weighted q.k scores, s <= t
    Kd: torch.Tensor       # [N, m, C, dk]  k * exp(G_last - G)
    decay: torch.Tensor    # [N, m, dk]     exp(G_last)


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                sub: int) -> ChunkTerms:
    """q, k (normalised), g [N, m, C, dk]; v [N, m, C, dv]; beta [N, m, C, 1] -> the chunks' ChunkTerms: the
    intra-chunk scores and the one unit-lower triangular solve per chunk, batched over every chunk."""
    N, m, C, dk = k.shape
    dv = v.shape[-1]
    G = g.cumsum(2)                                                           # [N, m, C, dk] inclusive
    A, P = _intra_scores(q.reshape(N * m, C, dk), k.reshape(N * m, C, dk), G.reshape(N * m, C, dk),
                         (G - g).reshape(N * m, C, dk), sub)                  # [N*m, C, C] each
    bf = beta.reshape(N * m, C, 1)
    eG = torch.exp(G)                                                         # exponent <= 0
    rhs = torch.cat([bf * v.reshape(N * m, C, dv), bf * (k * eG).reshape(N * m, C, dk)], -1)   # [N*m, C, dv+dk]
    eye = torch.eye(C, dtype=torch.float32, device=k.device)
    sol = torch.linalg.solve_triangular(eye + bf * A, rhs, upper=False, unitriangular=True)
    Gl = G[:, :, -1:]                                                         # [N, m, 1, dk]
    return ChunkTerms(W=sol[..., dv:].reshape(N, m, C, dk), U0=sol[..., :dv].reshape(N, m, C, dv),
                      Qd=q * eG, P=P.reshape(N, m, C, C), Kd=k * torch.exp(Gl - G), decay=torch.exp(Gl[:, :, 0]))


def chunk_scan(t: ChunkTerms, S: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The sequential part over t's m chunks: state S [N, dk, dv] fp32 in, each chunk's output written to
    o [N, m, C, dv]; returns the state after the last chunk (the `kda_chunk_scan` kernel's reference)."""
    for i in range(t.W.shape[1]):
        U = t.U0[:, i] - t.W[:, i] @ S                                        # [N, C, dv]
        o[:, i] = t.Qd[:, i] @ S + t.P[:, i] @ U
        S = t.decay[:, i, :, None] * S + t.Kd[:, i].transpose(1, 2) @ U        # [N, dk, dv]
    return S


# chunks per batch of `chunk_terms`: their transients within this (GLM-5.3-Flash, 64 heads of 128 at TP1: ~72 MB a
# chunk per sequence, so 7 chunks a batch, ~19 batches for an 8k-token prompt; each batch one scan launch)
_TERMS_BYTES = 512 << 20


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, chunk_size: int = 64,
                scan: Callable[[ChunkTerms, torch.Tensor, torch.Tensor], torch.Tensor] = chunk_scan,
                max_bytes: int = _TERMS_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over a padded batch.

    q, k [B, L, H, dk] raw (L2-normalised here, q scaled by dk^-0.5); v [B, L, H, dv]; g [B, L, H, dk]
    log-decay (<= 0); beta [B, L, H]; initial_state [B, H, dk, dv] fp32 (None = zeros).
    Returns o [B, L, H, dv] in q.dtype and the final state [B, H, dk, dv] fp32.

    The chunks' state-free terms (`chunk_terms`) are computed for as many chunks at once as `max_bytes` of
    transients allow; `scan` (`chunk_scan`, or a backend's kernel with its contract) carries the state
    through them.
    """
    B, L, H, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    sub = math.gcd(C, _SUB)
    n = -(-L // C)
    pad = n * C - L

    def prep(x):                                                              # [B, L, H, *] -> [B*H, n, C, *]
        x = F.pad(x.float().transpose(1, 2), (0, 0, 0, pad))                  # [B, H, nC, *]
        return x.reshape(B * H, n, C, x.shape[-1])

    qf = prep(l2norm(q) * dk ** -0.5)                                         # [N, n, C, dk]
    kf = prep(l2norm(k))                                                      # [N, n, C, dk]
    vf = prep(v)                                                              # [N, n, C, dv]
    gf = prep(g)                                                              # [N, n, C, dk]
    bf = prep(beta[..., None])                                                # [N, n, C, 1]
    S = (torch.zeros(B * H, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
         else initial_state.float().reshape(B * H, dk, dv).clone())           # [N, dk, dv]
    o = torch.empty(B * H, n, C, dv, dtype=torch.float32, device=q.device)
    # bytes a chunk holds while its terms are built: the intra scores' [C/sub, C, dk] + [sub, sub, dk] decays per
    # row (x1.5 for their temporaries), its terms (W, U0, Qd, Kd, P), the solve's right-hand side and solution
    per_chunk = B * H * C * (3 * (sub + C // sub) * dk // 2 + 3 * dk + dv + C + 2 * (dk + dv) + 2 * dk) * 4
    step = max(1, min(n, max_bytes // per_chunk))
    for c0 in range(0, n, step):                                              # one pass at most contexts
        c1 = min(n, c0 + step)
        t = chunk_terms(qf[:, c0:c1], kf[:, c0:c1], vf[:, c0:c1], gf[:, c0:c1], bf[:, c0:c1], sub)
        S = scan(t, S, o[:, c0:c1])
    o = o.reshape(B, H, n * C, dv)[:, :, :L].transpose(1, 2)                  # [B, L, H, dv]
    return o.to(q.dtype), S.reshape(B, H, dk, dv)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA step per sequence (decode).

    q, k, g [B, H, dk]; v [B, H, dv]; beta [B, H]; state [B, H, dk, dv] fp32 (not modified).
    Returns o [B, H, dv] in q.dtype and the new state [B, H, dk, dv] fp32.
    """
    dk = k.shape[-1]
    qf = l2norm(q) * dk ** -0.5                                               # [B, H, dk]
    kf = l2norm(k)                                                            # [B, H, dk]
    S = state.float() * torch.exp(g.float())[..., None]                       # [B, H, dk, dv]
    mem = (kf[..., None] * S).sum(-2)                                         # [B, H, dv]
    delta = beta.float()[..., None] * (v.float() - mem)                       # [B, H, dv]
    S = S + kf[..., None] * delta[..., None, :]                               # [B, H, dk, dv]
    o = (qf[..., None] * S).sum(-2)                                           # [B, H, dv]
    return o.to(q.dtype), S


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over a padded batch, continuing from a per-sequence state.

    x [B, L, C] (rows >= lengths[b] are padding); conv_state [B, K-1, C] = the K-1 inputs preceding
    x[:, 0] (zeros for a fresh sequence); weight [C, K] (tap K-1 multiplies the current input);
    lengths [B] int. Returns y [B, L, C] in x.dtype (fp32 math; rows past lengths are garbage) and
    new_state [B, K-1, C] in x.dtype = the last K-1 inputs of [conv_state, x[b, :lengths[b]]].
    """
    B, L, C = x.shape
    K = weight.shape[-1]
    xs = torch.cat([conv_state.to(x.dtype), x], 1)                            # [B, K-1+L, C]
    y = F.conv1d(xs.float().transpose(1, 2), weight.float()[:, None, :], groups=C)   # [B, C, L]
    y = F.silu(y).transpose(1, 2).to(x.dtype).contiguous()                    # [B, L, C]
    idx = lengths.to(torch.int64)[:, None] + torch.arange(K - 1, device=x.device)    # [B, K-1] rows of xs
    new_state = xs.gather(1, idx[..., None].expand(B, K - 1, C))             # [B, K-1, C]
    return y, new_state


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The decode step against the state cache (the `kda_decode` kernel op's reference).

    q, k, g [B, H, dk]; v [B, H, dv]; beta [B, H]; state [S, H, dk, dv] fp32, rows `slots` [B] read
    (as zeros where `fresh` [B]) and overwritten in place with the new states. Returns o [B, H, dv].
    """
    s0 = torch.where(fresh[:, None, None, None], 0, state[slots])              # [B, H, dk, dv]
    o, s1 = kda_recurrent(q, k, v, g, beta, s0)
    state.index_copy_(0, slots, s1)
    return o


def causal_conv1d_cached(x: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor, conv_state: torch.Tensor,
                         slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d` against the conv-state cache (the `causal_conv1d` kernel op's reference).

    x [B, L, C] padded view (rows >= lengths[b] are padding); weight [C, K] fp32; lengths [B] int;
    conv_state [S, K-1, C], rows `slots` [B] read (as zeros where `fresh` [B]) and overwritten in place
    with the last K-1 inputs of each sequence. Returns y [B, L, C] in x.dtype (SiLU applied; rows past
    lengths are garbage).
    """
    cs0 = torch.where(fresh[:, None, None], 0, conv_state[slots])              # [B, K-1, C]
    y, cs1 = causal_conv1d(x, cs0, weight, lengths)
    conv_state.index_copy_(0, slots, cs1.to(conv_state.dtype))
    return y


def kda_chunked_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                       scan: Callable[[ChunkTerms, torch.Tensor, torch.Tensor], torch.Tensor] = chunk_scan
                       ) -> torch.Tensor:
    """`kda_chunked` against the state cache (the `kda_chunked` kernel op's reference).

    q, k, g [B, L, H, dk]; v [B, L, H, dv]; beta [B, L, H] (padding rows: k = v = g = beta = 0, the
    padding contract above); state [S, H, dk, dv] fp32, rows `slots` [B] read (as zeros
    where `fresh` [B]) and overwritten in place with the states after each sequence's last row.
    Returns o [B, L, H, dv] in q.dtype.
    """
    s0 = torch.where(fresh[:, None, None, None], 0, state[slots])              # [B, H, dk, dv]
    o, s1 = kda_chunked(q, k, v, g, beta, s0, scan=scan)                    # (a backend passes its scan kernel)
    state.index_copy_(0, slots, s1.to(state.dtype))
    return o
