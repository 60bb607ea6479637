"""Per-token KV-cache writes: the torch references (kernels/torch_ref/cache_write.py) against the layer code
they replaced, and the Triton kernels (kernels/cuda/cache_write.py) under TRITON_INTERPRET=1 against the
references (MLA latent row [RMSNorm(c) | rope(k_pe)], DSA indexer key rope_first(LayerNorm(k))).

Tolerances (kernel vs reference, `assert_rows_match`):
- bf16 / fp16: element-for-element equal except where the norm's fp32 statistics (the kernel's sum order
  and rsqrt vs torch's) land a value within a few fp32 ulps of a rounding midpoint of the activation dtype:
  then that value rounds the other way (one ulp), and a rope output built from it moves by about one ulp
  of the row's scale. So: at most 0.2% of the elements may differ, each by <= 2 eps(dtype) * max |row|.
  (Seen here: 0 for bf16, ~2e-5 of the elements for fp16 — 3 more mantissa bits, 8x the midpoint hits.)
  Every rope rounding point (xs * c, then addcmul's one fp32 fma) is reproduced exactly, so rope adds no error.
- fp32: the same statistics differences, unrounded: rtol = atol = 2e-6 (1-2 fp32 ulps).
- grid inputs (multiples of 1/8: the sum of squares is exact in any order) make the MLA row bit-exact in
  every dtype (IEEE mean and 1/sqrt like torch's CPU rms_norm). The indexer's LayerNorm is not: the kernel
  copies torch's CUDA expression w * (rstd * (x - mean)) + b (one fma), torch's CPU kernel rounds elsewhere.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_ray import kernels  # noqa: E402
from glm_ray.config import RopeConfig  # noqa: E402
from glm_ray.kernels.torch_ref import cache_write as ref  # noqa: E402
from glm_ray.layers.rotary import RopeCache, RotaryEmbedding, apply_rope  # noqa: E402

BLOCK_SIZE = 16
EPS = 1e-6


# ------------------------------------------------------------------------------------------ cases

def rope_cache(t: int, dim: int, dtype: torch.dtype, seed: int = 0) -> RopeCache:
    """cos / sin of t random positions (yarn frequencies, GLM-5 style), in the RopeCache layout."""
    rope = RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0)
    pos = torch.randint(0, 100_000, (t,), generator=torch.Generator().manual_seed(seed))
    return RotaryEmbedding(rope, dim)(pos, dtype)


def paged_slots(t: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """[T] int64 slots of t tokens scattered over a paged cache: each token at a random offset of a random
    block (distinct slots)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t]


def cache(num_blocks: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randn(num_blocks * BLOCK_SIZE, width, generator=g).to(dtype)      # [S, width] "old contents"


def mla_case(t, r, dr, dtype, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ckv = (torch.randn(t, r + dr, generator=g) * 3).to(dtype)                       # [T, r+dr]
    w = (torch.rand(r, generator=g) + 0.5).to(w_dtype or dtype)                    # [r]
    rope = rope_cache(t, dr, dtype, seed) if dr else None
    return ckv, w, rope


def indexer_case(t, di, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(t, di, generator=g) * 2 + 0.3).to(dtype)                      # [T, di]
    w = (torch.rand(di, generator=g) + 0.5).to(dtype)                              # [di]
    b = (torch.randn(di, generator=g) * 0.1).to(dtype)                             # [di]
    return k, w, b


def cos_sin(rope: RopeCache | None):
    return (rope.cos, rope.sin) if rope is not None else (None, None)


def assert_rows_match(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernel's cache `out` vs the reference's `want` (module docstring: why these tolerances)."""
    assert out.dtype == want.dtype and out.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
        return
    o, w = out.float(), want.float()
    diff = (o - w).abs()                                                            # [S, width]
    bound = 2 * torch.finfo(dtype).eps * w.abs().amax(-1, keepdim=True)            # [S, 1]
    assert bool((diff <= bound).all()), float((diff - bound).max())
    n_bad = int((diff > 0).sum())
    assert n_bad <= math.ceil(2e-3 * out.numel()), f"{n_bad} of {out.numel()} differ"


# ------------------------------------------------------------------------ reference == layer code

def _original_mla_write(ckv, norm_w, eps, rope, interleave, kv_cache, slots):
    """`MLAAttention.forward`'s latent write before it became the `mla_kv_write` op (frozen here)."""
    r = norm_w.shape[0]
    dr = ckv.shape[1] - r
    c = norm_w * F.rms_norm(ckv[:, :r].float(), (r,), eps=eps).to(ckv.dtype)     # kv_a_layernorm
    x = ckv[:, None, r:]
    k_pe = (x if dr == 0 else apply_rope(x, rope, interleave))[:, 0]
    kv_cache.index_copy_(0, slots, torch.cat([c, k_pe], -1).to(kv_cache.dtype))


def _original_indexer_write(k, w, b, eps, rope, rope_dim, interleave, key_cache, slots):
    """`Indexer.write_keys` after wk, before it became the `indexer_key_write` op (frozen here)."""
    ki = F.layer_norm(k, (k.shape[-1],), w, b, eps)
    if rope_dim:
        ki = torch.cat([apply_rope(ki[..., :rope_dim], rope, interleave), ki[..., rope_dim:]], dim=-1)
    key_cache.index_copy_(0, slots, ki.to(key_cache.dtype))


@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float32)])
@pytest.mark.parametrize("dr", [0, 64])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_reference_is_the_layer_code(dtype, w_dtype, dr, interleave):
    ckv, w, rope = mla_case(7, 512, dr, dtype, w_dtype)
    slots = paged_slots(7, 4)
    a, b = cache(4, 512 + dr, dtype), cache(4, 512 + dr, dtype)
    _original_mla_write(ckv, w, EPS, rope, interleave, a, slots)
    ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, b, slots)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope_dim", [0, 64])
@pytest.mark.parametrize("interleave", [True, False])
def test_indexer_reference_is_the_layer_code(dtype, rope_dim, interleave):
    k, w, b = indexer_case(7, 128, dtype)
    rope = rope_cache(7, rope_dim, dtype) if rope_dim else None
    slots = paged_slots(7, 4)
    x, y = cache(4, 128, dtype), cache(4, 128, dtype)
    _original_indexer_write(k, w, b, EPS, rope, rope_dim, interleave, x, slots)
    ref.indexer_key_write(k, w, b, EPS, *cos_sin(rope), rope_dim, interleave, y, slots)
    assert torch.equal(x, y)


def test_torch_table_holds_the_references():
    ops = kernels.init_backend("torch")
    assert ops.mla_kv_write is ref.mla_kv_write and ops.indexer_key_write is ref.indexer_key_write


def test_cuda_backend_falls_back_on_cpu():
    """CPU tensors through CudaKernels: the reference, bit for bit, and the fallback counted."""
    try:
        ops = kernels.init_backend("cuda", "cpu")
        impl = ops.mla_kv_write.__self__
        ckv, w, rope = mla_case(5, 512, 64, torch.bfloat16)
        slots = paged_slots(5, 2)
        a, b = cache(2, 576, torch.bfloat16), cache(2, 576, torch.bfloat16)
        ops.mla_kv_write(ckv, w, EPS, *cos_sin(rope), True, a, slots)
        ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), True, b, slots)
        assert torch.equal(a, b)
        k, lw, lb = indexer_case(5, 128, torch.bfloat16)
        x, y = cache(2, 128, torch.bfloat16), cache(2, 128, torch.bfloat16)
        ops.indexer_key_write(k, lw, lb, EPS, *cos_sin(rope), 64, False, x, slots)
        ref.indexer_key_write(k, lw, lb, EPS, *cos_sin(rope), 64, False, y, slots)
        assert torch.equal(x, y)
        assert {op for op, _ in impl.fallbacks} == {"mla_kv_write", "indexer_key_write"}
    finally:
        kernels.init_backend("torch")


# ------------------------------------------------------------------------ Triton kernels (interpreter)

triton_cw = pytest.importorskip("glm_ray.kernels.cuda.cache_write", reason="triton not importable")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("dr", [0, 64])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_kv_write_kernel(dtype, interleave, dr, t):
    ckv, w, rope = mla_case(t, 512, dr, dtype, seed=t)
    slots = paged_slots(t, 3, seed=t)
    want, out = cache(3, 512 + dr, dtype), cache(3, 512 + dr, dtype)
    ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, want, slots)
    triton_cw.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, out, slots)
    assert_rows_match(out, want, dtype)                                            # other rows untouched too


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_kv_write_kernel_odd_sizes_and_mixed_dtypes(interleave):
    """r, dr not powers of two (masked tiles), an fp32 norm weight on bf16 activations (the row is the
    fp32 promotion, rounded once into the cache), fp32 cos / sin, strided ckv rows."""
    t, r, dr = 5, 96, 6
    ckv_full, w, _ = mla_case(t, r + 10, dr, torch.bfloat16, w_dtype=torch.float32)
    ckv, w = ckv_full[:, : r + dr], w[:r]                                           # row stride r + dr + 10
    rope = rope_cache(t, dr, torch.float32)
    slots = paged_slots(t, 2)
    want, out = cache(2, r + dr, torch.bfloat16), cache(2, r + dr, torch.bfloat16)
    ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, want, slots)
    triton_cw.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, out, slots)
    assert_rows_match(out, want, torch.bfloat16)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("rope_dim", [0, 64])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_key_write_kernel(dtype, interleave, rope_dim, t):
    k, w, b = indexer_case(t, 128, dtype, seed=t)
    rope = rope_cache(t, rope_dim, dtype, seed=t) if rope_dim else None
    slots = paged_slots(t, 3, seed=t)
    want, out = cache(3, 128, dtype), cache(3, 128, dtype)
    ref.indexer_key_write(k, w, b, EPS, *cos_sin(rope), rope_dim, interleave, want, slots)
    triton_cw.indexer_key_write(k, w, b, EPS, *cos_sin(rope), rope_dim, interleave, out, slots)
    assert_rows_match(out, want, dtype)


@pytest.mark.parametrize("interleave", [True, False])
def test_indexer_key_write_kernel_odd_sizes(interleave):
    """di not a power of two, rope on a part of it."""
    t, di, rope_dim = 5, 40, 10
    k, w, b = indexer_case(t, di, torch.bfloat16)
    rope = rope_cache(t, rope_dim, torch.bfloat16)
    slots = paged_slots(t, 2)
    want, out = cache(2, di, torch.bfloat16), cache(2, di, torch.bfloat16)
    ref.indexer_key_write(k, w, b, EPS, *cos_sin(rope), rope_dim, interleave, want, slots)
    triton_cw.indexer_key_write(k, w, b, EPS, *cos_sin(rope), rope_dim, interleave, out, slots)
    assert_rows_match(out, want, torch.bfloat16)


def grid_input(t: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[t, width] multiples of 1/8 in [-2, 2]: every partial sum of squares is exact in fp32."""
    return (torch.randint(-16, 17, (t, width), generator=torch.Generator().manual_seed(seed)) / 8).to(dtype)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_kv_write_kernel_bit_exact_on_grid_inputs(dtype, interleave):
    t = 5
    ckv, (_, w, rope) = grid_input(t, 576, dtype), mla_case(t, 512, 64, dtype)
    slots = paged_slots(t, 3)
    want, out = cache(3, 576, dtype), cache(3, 576, dtype)
    ref.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, want, slots)
    triton_cw.mla_kv_write(ckv, w, EPS, *cos_sin(rope), interleave, out, slots)
    assert torch.equal(out, want)


def test_kernels_empty_batch():
    c = cache(1, 576, torch.bfloat16)
    before = c.clone()
    triton_cw.mla_kv_write(torch.zeros(0, 576, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16), EPS,
                           torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(0, 64, dtype=torch.bfloat16), True,
                           c, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(c, before)
