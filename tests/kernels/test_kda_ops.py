"""The KDA kernel ops of the torch backend (`kernels.ops()`: causal_conv1d, kda_chunked against the
state caches) and swiglu, against independent formulations: the short conv written tap by tap per
sequence, the chunked form vs the one-token recurrent form run row by row per sequence, both reading
the caches at the slots (zeros where fresh) and writing only those rows back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_ray import kernels
from glm_ray.kernels.torch_ref.kda import kda_recurrent
from tests.kernels.cases import kda_case

SLOTS = torch.tensor([3, 0, 5])
FRESH = torch.tensor([False, True, False])
LENGTHS = torch.tensor([7, 19, 1])                     # padded view of L = 19 rows


@pytest.fixture(autouse=True)
def torch_backend():
    yield kernels.init_backend("torch")


def test_causal_conv1d_against_the_state_cache():
    g = torch.Generator().manual_seed(0)
    B, L, C, K, S = 3, int(LENGTHS.max()), 12, 4, 6
    x = torch.randn(B, L, C, generator=g)
    w = torch.randn(C, K, generator=g)
    cache = torch.randn(S, K - 1, C, generator=g)
    before = cache.clone()
    y = kernels.ops().causal_conv1d(x, w, LENGTHS, cache, SLOTS, FRESH)
    assert y.shape == x.shape and y.dtype == x.dtype
    for b in range(B):
        n, s = int(LENGTHS[b]), int(SLOTS[b])
        prev = torch.zeros(K - 1, C) if FRESH[b] else before[s]
        xs = torch.cat([prev, x[b, :n]])                                       # [K-1+n, C]
        want = torch.stack([F.silu(sum(w[:, j] * xs[t + j] for j in range(K))) for t in range(n)])
        torch.testing.assert_close(y[b, :n], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache[s], xs[-(K - 1):])                    # the last K-1 inputs
    untouched = [i for i in range(S) if i not in SLOTS.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def test_kda_chunked_against_the_state_cache_is_the_recurrence():
    g = torch.Generator().manual_seed(1)
    B, L, H, dk, dv, S = 3, int(LENGTHS.max()), 2, 8, 6, 6
    valid = torch.arange(L)[None, :] < LENGTHS[:, None]                        # [B, L]
    keep = valid[..., None, None]
    q = torch.randn(B, L, H, dk, generator=g)
    k = torch.randn(B, L, H, dk, generator=g) * keep                            # padding contract: zeros
    v = torch.randn(B, L, H, dv, generator=g) * keep
    gate = -torch.rand(B, L, H, dk, generator=g) * keep                         # log-decay <= 0
    beta = torch.rand(B, L, H, generator=g) * valid[..., None]
    state = torch.randn(S, H, dk, dv, generator=g)
    before = state.clone()
    o = kernels.ops().kda_chunked(q, k, v, gate, beta, state, SLOTS, FRESH)
    assert o.shape == (B, L, H, dv)
    for b in range(B):
        s = int(SLOTS[b])
        st = torch.zeros(1, H, dk, dv) if FRESH[b] else before[s:s + 1]
        for t in range(int(LENGTHS[b])):
            ot, st = kda_recurrent(q[b:b + 1, t], k[b:b + 1, t], v[b:b + 1, t], gate[b:b + 1, t],
                                   beta[b:b + 1, t], st)
            torch.testing.assert_close(o[b, t], ot[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state[s], st[0], rtol=1e-4, atol=1e-5)
    untouched = [i for i in range(S) if i not in SLOTS.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("limit", [None, 0.5])
def test_swiglu(limit):
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(5, 16, generator=g) * 2, torch.randn(5, 16, generator=g) * 2
    want = F.silu(gate) * up if limit is None else F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    torch.testing.assert_close(kernels.ops().swiglu(gate, up, limit), want)


# ---- the chunked form's split: state-free terms batched over chunks, then the scan (torch and Triton) ----

def test_chunk_batches_do_not_change_the_result():
    """kda_chunked computes the chunks' terms for as many chunks at once as its byte budget allows: one chunk per
    batch (max_bytes=1) and all at once give the same outputs and state, and both equal the token recurrence."""
    from glm_ray.kernels.torch_ref.kda import kda_chunked, kda_recurrent
    q, k, v, g, beta, s0 = kda_case(2, 150, 3, 16, 8, 5)
    o_all, s_all = kda_chunked(q, k, v, g, beta, s0)
    o_one, s_one = kda_chunked(q, k, v, g, beta, s0, max_bytes=1)
    torch.testing.assert_close(o_one, o_all, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s_one, s_all, rtol=1e-6, atol=1e-6)
    S, outs = s0.clone(), []
    for t in range(q.shape[1]):
        o_t, S = kda_recurrent(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o_t)
    torch.testing.assert_close(o_all, torch.stack(outs, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_all, S, rtol=1e-4, atol=1e-5)
