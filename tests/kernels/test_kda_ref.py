"""KDA torch reference kernels (glm_ray/kernels/torch_ref/kda.py) vs transformers' glm5_next functions
(the independent oracle): chunked and recurrent delta rule, state carry, the padding contract, and the
causal short conv (fresh and continuing from a state, varlen)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_ray.kernels.torch_ref.kda import causal_conv1d, kda_chunked, kda_recurrent, l2norm
from tests import flash_tiny

hf = flash_tiny.import_oracle("transformers.models.glm5_next.modeling_glm5_next")

H, DK, DV = 3, 16, 8


def _inputs(B, L, seed, lower_bound=-5.0):
    g = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g)
    q, k, v = r(B, L, H, DK), r(B, L, H, DK), r(B, L, H, DV)
    raw = r(B, L, H, DK)
    gate = lower_bound * torch.sigmoid(raw) if lower_bound is not None else -F.softplus(raw)   # <= 0
    beta = torch.sigmoid(r(B, L, H))
    s0 = 0.5 * r(B, H, DK, DV)
    return q, k, v, gate, beta, s0


def _hf_chunk(q, k, v, g, beta, s0):
    return hf.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)


def _hf_rec(q, k, v, g, beta, s0):
    return hf.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)


def test_l2norm_matches_fla():
    x = torch.randn(4, 7, 16)
    torch.testing.assert_close(l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))


@pytest.mark.parametrize("L", [1, 50, 64, 130])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_matches_transformers(L, lower_bound):
    q, k, v, g, beta, s0 = _inputs(2, L, seed=L, lower_bound=lower_bound)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    assert o.shape == (2, L, H, DV) and s.shape == (2, H, DK, DV) and s.dtype == torch.float32
    o_c, s_c = _hf_chunk(q, k, v, g, beta, s0)
    o_r, s_r = _hf_rec(q, k, v, g, beta, s0)
    for o_ref, s_ref in ((o_c, s_c), (o_r, s_r)):
        torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


def test_chunked_strong_decay_is_finite():
    """Decays of -5 per channel and token span e^-320 in one chunk: no exp(+x) overflow."""
    q, k, v, _, beta, s0 = _inputs(1, 128, seed=3)
    g = torch.full((1, 128, H, DK), -5.0)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    o_r, s_r = _hf_rec(q, k, v, g, beta, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_r, rtol=1e-4, atol=1e-5)


def test_no_initial_state_and_small_chunks():
    q, k, v, g, beta, _ = _inputs(2, 40, seed=5)
    o_r, s_r = _hf_rec(q, k, v, g, beta, None)
    for cs in (64, 16, 8):
        o, s = kda_chunked(q, k, v, g, beta, None, chunk_size=cs)
        torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_r, rtol=1e-4, atol=1e-5)


def test_state_carried_over_two_calls():
    q, k, v, g, beta, s0 = _inputs(2, 150, seed=7)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    cut = 70
    o1, s1 = kda_chunked(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    o2, s2 = kda_chunked(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s2, s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_real", [1, 37, 64, 100])
def test_padding_rows_leave_state_untouched(n_real):
    """Trailing rows with k = v = beta = g = 0 (any q): final state == state after the last real row."""
    L = 130
    q, k, v, g, beta, s0 = _inputs(1, L, seed=n_real)
    o_ref, s_ref = kda_chunked(q[:, :n_real], k[:, :n_real], v[:, :n_real], g[:, :n_real], beta[:, :n_real], s0)
    pad = torch.arange(L) >= n_real
    k, v, g = (t.masked_fill(pad[None, :, None, None], 0) for t in (k, v, g))
    beta = beta.masked_fill(pad[None, :, None], 0)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(o[:, :n_real], o_ref, rtol=1e-5, atol=1e-6)


def test_recurrent_step_matches_transformers():
    q, k, v, g, beta, s0 = _inputs(4, 1, seed=11)
    o, s = kda_recurrent(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    o_r, s_r = _hf_rec(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_r[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_r, rtol=1e-5, atol=1e-6)
    # and a chunked prefill followed by recurrent steps == one chunked call over everything
    q, k, v, g, beta, s0 = _inputs(2, 60, seed=12)
    o_all, s_all = kda_chunked(q, k, v, g, beta, s0)
    o_p, s = kda_chunked(q[:, :57], k[:, :57], v[:, :57], g[:, :57], beta[:, :57], s0)
    for t in range(57, 60):
        o_t, s = kda_recurrent(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        torch.testing.assert_close(o_t, o_all[:, t], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_all, rtol=1e-4, atol=1e-5)


# ---- causal short conv -----------------------------------------------------------------------------
C, K = 12, 4


def test_conv_fresh_varlen_matches_causal_conv1d_fn():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 2, 5])
    x = torch.randn(3, 9, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    y, st = causal_conv1d(x, torch.zeros(3, K - 1, C), w, lengths)
    for b, n in enumerate(lengths.tolist()):
        ref = hf.causal_conv1d_fn(x[b:b + 1, :n].transpose(1, 2), w, activation="silu")[0].T   # [n, C]
        torch.testing.assert_close(y[b, :n], ref, rtol=1e-5, atol=1e-6)
        full = torch.cat([torch.zeros(K - 1, C), x[b, :n]])                  # last K-1 real inputs
        torch.testing.assert_close(st[b], full[-(K - 1):], rtol=0, atol=0)


def test_conv_continues_like_causal_conv1d_update():
    gen = torch.Generator().manual_seed(1)
    B = 3
    x = torch.randn(B, 6, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    state = torch.randn(B, K - 1, C, generator=gen)
    # decode: one token per sequence
    y, st = causal_conv1d(x[:, :1], state, w, torch.ones(B, dtype=torch.long))
    hf_state = state.transpose(1, 2).clone()                                  # [B, C, K-1]
    ref = hf.causal_conv1d_update(x[:, :1].transpose(1, 2), hf_state, w, activation="silu")
    torch.testing.assert_close(y, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st, hf_state.transpose(1, 2), rtol=0, atol=0)
    # a multi-token chunk continuing from the state == transformers' update over the same tokens
    lengths = torch.tensor([6, 3, 1])
    y, st = causal_conv1d(x, state, w, lengths)
    for b, n in enumerate(lengths.tolist()):
        hs = state[b:b + 1].transpose(1, 2).clone()
        ref = hf.causal_conv1d_update(x[b:b + 1, :n].transpose(1, 2), hs, w, activation="silu")
        torch.testing.assert_close(y[b, :n], ref[0].T, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st[b], hs[0].T, rtol=0, atol=0)


def test_conv_bf16_input_fp32_math():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, C, generator=gen).bfloat16()
    w = torch.randn(C, K, generator=gen)
    y, st = causal_conv1d(x, torch.zeros(2, K - 1, C, dtype=torch.bfloat16), w, torch.tensor([5, 5]))
    assert y.dtype == torch.bfloat16 and st.dtype == torch.bfloat16
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
