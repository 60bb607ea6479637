"""Torch reference of the per-token KV-cache writes: the MLA latent row and the DSA indexer key.

    mla_kv_write:      kv_cache[slot]  = [ RMSNorm(ckv[:, :r]) | rope(ckv[:, r:]) ]      (.to cache dtype)
    indexer_key_write: key_cache[slot] = rope_first_rope_dim(LayerNorm(k))              (.to cache dtype)

This is exactly the code `MLAAttention.forward` (layers/mla.py) and `Indexer.write_keys` (layers/indexer.py)
ran before the writes became kernel ops, so it is bit-identical to it (and the CPU path):
- RMSNorm = `weight * F.rms_norm(c.float()).to(c.dtype)` (fp32 statistics, cast back, then the weight:
  the result dtype is the promotion of weight and activation dtypes), as layers/norm.py's RMSNorm;
- LayerNorm = `F.layer_norm` in the input dtype with weight and bias (the indexer's k_norm);
- rope = `torch_ref/rope.py`, the function layers/rotary.py's `apply_rope` runs, with its de-interleaving
  output layout for interleave=True: the cached k_pe / key layout is the one attention and the indexer read.
cos / sin are the `RopeCache` layout ([T, dim]: cos = (c, c), sin = (-s, s)); they are unused (may be None)
when the rope width is 0 (NoPE, GLM-5.3-Flash).
About ten small launches per write in torch; the cuda backend runs each as one Triton launch
(kernels/cuda/cache_write.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from glm_ray.kernels.torch_ref.rope import rope


def mla_kv_write(ckv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, interleave: bool, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """ckv [T, r+dr] (kv_a_proj output), norm_weight [r], cos / sin [T, dr], kv_cache [S, r+dr] written in
    place at rows slot_mapping [T] int64."""
    r = norm_weight.shape[0]
    c = ckv[:, :r]                                                            # [T, r]
    c = norm_weight * F.rms_norm(c.float(), (r,), eps=eps).to(c.dtype)       # [T, r] (RMSNorm.forward)
    k_pe = ckv[:, None, r:]                                                   # [T, 1, dr]
    if k_pe.shape[-1]:                                                        # dr = 0: NoPE
        k_pe = rope(k_pe, cos, sin, interleave)
    kv_cache.index_copy_(0, slot_mapping, torch.cat([c, k_pe[:, 0]], -1).to(kv_cache.dtype))


def indexer_key_write(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                      cos: torch.Tensor | None, sin: torch.Tensor | None, rope_dim: int, interleave: bool,
                      key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, di] (wk output), ln_weight / ln_bias [di], cos / sin [T, rope_dim], key_cache [S, di] written
    in place at rows slot_mapping [T] int64 (rope on the FIRST rope_dim dims, the rest unchanged)."""
    ki = F.layer_norm(k, (k.shape[-1],), ln_weight, ln_bias, eps)            # [T, di] (LayerNorm.forward)
    if rope_dim:
        ki = torch.cat([rope(ki[..., :rope_dim], cos, sin, interleave),
                        ki[..., rope_dim:]], dim=-1)                          # [T, di]
    key_cache.index_copy_(0, slot_mapping, ki.to(key_cache.dtype))
