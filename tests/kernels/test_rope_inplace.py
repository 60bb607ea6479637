"""The `rope_inplace` op: its torch reference (kernels/torch_ref/rope.py) against the layer code it replaced
(MLA: cat([q_nope, apply_rope(q_pe)]); the DSA indexer: cat([apply_rope(q[..., :r]), q[..., r:]])), and the
Triton kernel (kernels/cuda/rope.py) under TRITON_INTERPRET=1 against the reference: bit-exact in every
dtype (every rounding point of apply_rope — xs * c, then addcmul's one fp32 fma — is reproduced), interleaved
and half-split, rope last (MLA) and first (indexer), head counts that do not fill a tile, strided rows."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray.kernels.torch_ref.rope import rope_inplace  # noqa: E402
from glm_ray.layers.rotary import apply_rope  # noqa: E402
from tests.kernels.test_cache_write_ops import rope_cache  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _q(t, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g) * 3).to(dtype)                      # [T, H, D]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
def test_reference_is_the_layer_code(dtype, interleave):
    T, h, dn, dr = 5, 3, 192, 64
    rope = rope_cache(T, dr, dtype)
    q = _q(T, h, dn + dr, dtype)
    mla = torch.cat([q[..., :dn], apply_rope(q[..., dn:], rope, interleave)], -1)  # MLAAttention before the op
    x = q.clone()
    rope_inplace(x, rope.cos, rope.sin, interleave, dn)
    assert torch.equal(x, mla)
    qi = _q(T, 4, 128, dtype, seed=1)
    idx = torch.cat([apply_rope(qi[..., :dr], rope, interleave), qi[..., dr:]], -1)   # Indexer._rope before it
    y = qi.clone()
    rope_inplace(y, rope.cos, rope.sin, interleave, 0)
    assert torch.equal(y, idx)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("h,d,start,dr", [(32, 256, 192, 64), (5, 256, 192, 64), (32, 128, 0, 64), (3, 40, 8, 16),
                                          (3, 40, 4, 24)])   # 24: 12 pairs, not a power of two (masked lanes)
def test_triton_kernel_equals_reference(dtype, interleave, h, d, start, dr):
    from glm_ray.kernels.cuda.rope import rope_inplace as triton_rope  # noqa: PLC0415 (imports triton)
    T = 7
    rope = rope_cache(T, dr, dtype, seed=2)
    q = _q(T, h, d, dtype, seed=3)
    want, got = q.clone(), q.clone()
    rope_inplace(want, rope.cos, rope.sin, interleave, start)
    triton_rope(got, rope.cos, rope.sin, interleave, start)
    assert torch.equal(got, want)
    assert torch.equal(got[..., :start], q[..., :start]) and torch.equal(got[..., start + dr:], q[..., start + dr:])


def test_triton_kernel_on_strided_rows():
    """A [T, H, D] view whose token stride is wider than H * D (a slice of a larger buffer) and zero tokens."""
    from glm_ray.kernels.cuda.rope import rope_inplace as triton_rope  # noqa: PLC0415
    T, h, d = 6, 4, 96
    rope = rope_cache(T, 32, torch.bfloat16, seed=4)
    base = _q(T, h + 2, d, torch.bfloat16, seed=5)
    want, got = base.clone(), base.clone()
    rope_inplace(want[:, 1:h + 1], rope.cos, rope.sin, True, 64)
    triton_rope(got[:, 1:h + 1], rope.cos, rope.sin, True, 64)
    assert torch.equal(got, want)                                   # heads outside the view untouched
    empty = torch.zeros(0, h, d, dtype=torch.bfloat16)
    triton_rope(empty, rope.cos[:0], rope.sin[:0], True, 64)
