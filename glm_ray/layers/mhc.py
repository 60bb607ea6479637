"""Manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): the residual stream is `n` streams
`[T, n, D]`; before each sublayer they are collapsed into its input, after it the output is expanded
back and mixed with a doubly-stochastic recombination of the input streams.

Per token, with `fn [(2+n)n, n·D]`, `base [(2+n)n]`, `scale [3]` (fp32; checkpoint names
`hc_{attn,ffn}_{fn,base,scale}` on the decoder layer):

    m    = rms(flat(streams)) @ fnᵀ                          (unweighted RMSNorm, fp32)
    pre  = sigmoid(m[:n]·s0 + b[:n]) + eps                   collapse weights   [T, n]
    post = 2·sigmoid(m[n:2n]·s1 + b[n:2n])                   expand weights     [T, n]
    comb = Sinkhorn(softmax(m[2n:]·s2 + b[2n:]) + eps)       mixing matrix      [T, n, n]
    input = Σ_i pre_i·stream_i ;  new_stream_j = post_j·y + Σ_i comb_ij·stream_i

Sinkhorn: one column normalisation, then (iters-1) × (row, column). The coefficients (sigmoids,
softmax, Sinkhorn) are the kernel op `mhc_coefficients` (a torch reference; one Triton launch on
the cuda backend); the projection and the collapse / expand are torch here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray import kernels
from glm_ray.weights import load_sharded, set_weight_attrs


class HyperConnection(nn.Module):
    """The weights of one mHC site (before attention, or before the FFN); owned by the decoder layer
    so that the checkpoint names `layers.N.hc_attn_fn` etc. map one to one."""

    def __init__(self, n: int, hidden_size: int, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int):
        super().__init__()
        self.n, self.rms_eps, self.hc_eps, self.iters = n, rms_eps, hc_eps, sinkhorn_iters
        w = (2 + n) * n
        # fp32 at runtime whatever the checkpoint dtype (the mixing math is fp32)
        self.fn = self._param(torch.empty(w, n * hidden_size))
        self.base = self._param(torch.zeros(w))
        self.scale = self._param(torch.ones(3))

    def _param(self, t: torch.Tensor) -> nn.Parameter:
        return set_weight_attrs(nn.Parameter(t.float(), requires_grad=False), weight_loader=self._load)

    @staticmethod
    def _load(param, ckpt, **_):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (sublayer input [T, D] in streams.dtype, post [T, n], comb [T, n, n] fp32)."""
        T, n, D = streams.shape
        flat = F.rms_norm(streams.reshape(T, n * D).float(), (n * D,), eps=self.rms_eps)   # [T, nD] unweighted
        m = flat @ self.fn.t()                                                  # [T, (2+n)n]
        pre, post, comb = kernels.ops().mhc_coefficients(m, self.base, self.scale, n, self.hc_eps, self.iters)
        x = (pre[..., None] * streams).sum(1).to(streams.dtype)                 # [T, D]
        return x, post, comb

    @staticmethod
    def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """y [T, D] sublayer output, streams [T, n, D] its input streams -> new streams [T, n, D]."""
        dt = streams.dtype
        return post.to(dt)[..., None] * y[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
