"""mHC hyper-connections (glm_ray/layers/mhc.py) vs transformers' Glm5NextTextHyperConnection and the
decoder layer's expand step, on random fp32 weights and streams."""
from __future__ import annotations

import torch

from glm_ray.layers.mhc import HyperConnection
from tests import flash_tiny

flash_tiny.import_oracle("transformers.models.glm5_next")


def test_collapse_and_expand_match_transformers():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection
    D, n, T = 64, 4, 11
    cfg = Glm5NextTextConfig(hidden_size=D, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5)
    ref = Glm5NextTextHyperConnection(cfg).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.fn.copy_(0.05 * torch.randn(ref.fn.shape, generator=g))
        ref.base.copy_(0.5 * torch.randn(ref.base.shape, generator=g))
        ref.scale.copy_(1.0 + 0.3 * torch.randn(3, generator=g))
    ours = HyperConnection(n, D, rms_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
    ours.load_state_dict({"fn": ref.fn, "base": ref.base, "scale": ref.scale})
    streams = torch.randn(T, n, D, generator=g)
    post_r, comb_r, x_r = ref(streams[None])                                  # batch 1
    x, post, comb = ours.collapse(streams)
    torch.testing.assert_close(x, x_r[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, post_r[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, comb_r[0], rtol=1e-5, atol=1e-5)
    # comb is doubly stochastic (up to hc_eps): columns sum to 1 after the last normalisation
    torch.testing.assert_close(comb.sum(-2), torch.ones(T, n), rtol=1e-4, atol=1e-4)
    # expand: what the transformers decoder layer does with (post, comb) and the sublayer output
    y = torch.randn(T, D, generator=g)
    want = post_r[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_r[0].transpose(-1, -2), streams)
    torch.testing.assert_close(HyperConnection.expand(y, streams, post, comb), want, rtol=1e-5, atol=1e-5)
