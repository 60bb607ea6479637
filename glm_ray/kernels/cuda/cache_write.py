"""Triton kernels of the per-token KV-cache writes (contracts and torch references:
kernels/torch_ref/cache_write.py): norm + rope + cast + scatter of one token's cache row in ONE launch,
instead of ~10 small torch launches per write (slice, norm, rope's strided slices / cats / mul / addcmul,
cat, cast, index_copy_).

* `_mla_kv_write_kernel` (`mla_kv_write`): one program per token: RMSNorm of ckv[:, :r] (fp32 statistics,
  rounded to the activation dtype, times the weight, rounded to the promoted weight/activation dtype) and
  the rope of ckv[:, r:] in `apply_rope`'s output layout, stored at kv_cache[slot_mapping[t]].
* `_indexer_key_write_kernel` (`indexer_key_write`): one program per token: LayerNorm with bias (fp32
  statistics, two-pass variance, `gamma * (rstd * (x - mean)) + beta` as torch's CUDA kernel, rounded to the
  activation dtype), then rope on the first ROPE_DIM dims, stored at key_cache[slot_mapping[t]].

Rope (`apply_rope`, layers/rotary.py): out[i] = A[i] * cos[i] + B[i] * sin[i] with A the de-interleaved
input (interleave: evens then odds; else the input itself) and B = A with its halves swapped. Rounding points
as the reference: A * cos is rounded to the activation dtype (`xs * c`), then `addcmul` adds B * sin with one
fp32 fma (torch's CPU and CUDA addcmul both fuse it) and rounds to the activation dtype. A / B are gathered
straight from global memory (each program's row is in L1); the indexer re-derives the normalized values at
the gathered positions with the same elementwise expression, so they are the same bits as the normalized row.
Statistics: IEEE mean and 1 / sqrt (div_rn / sqrt_rn, like torch's CPU rms_norm; the kernel's sum order is
its own), so on inputs whose sums are exact the MLA row is bit-exact against the CPU reference.

Grid (T,) and every constexpr come from shapes / dtypes only (no host syncs, CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _rope_offsets(i, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Output position i in [0, 2*HALF) -> source positions of A[i] and B[i] (B = A, halves swapped)."""
    hi = (i >= HALF).to(tl.int32)
    j = i - hi * HALF                                                          # i mod HALF
    if INTERLEAVE:                                                             # (x1, x2) = evens, odds
        ia = 2 * j + hi
        ib = 2 * j + 1 - hi
    else:                                                                      # (x1, x2) = halves
        ia = i
        ib = j + (1 - hi) * HALF
    return ia, ib


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 x -> fp32 holding x rounded to DTYPE (round to nearest even, as torch's casts). bf16 is rounded
    with integer ops: the Triton interpreter truncates fp32 -> bf16 casts, the GPU rounds (same bits)."""
    if DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, b.to(tl.float32, bitcast=True))               # NaN stays NaN
    elif DTYPE == tl.float32:
        y = x
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _rstd(ssq, n: tl.constexpr, eps):
    """1 / sqrt(ssq / n + eps) with IEEE division and square root (torch's CPU rsqrt: correctly rounded,
    not the approximate rsqrt.approx of `tl.math.rsqrt`)."""
    var = tl.div_rn(ssq, tl.full([], n, tl.float32)) + eps
    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(var))


@triton.jit
def _rope_combine(a, b, c, s, X_DTYPE: tl.constexpr):
    """fp32 a, b (activation-dtype values), c, s -> addcmul(a * c, b, s) with apply_rope's roundings
    (fp32 holding an X_DTYPE value)."""
    ac = _round(a * c, X_DTYPE)                                                # xs * c
    return _round(tl.fma(b, s, ac), X_DTYPE)                                   # addcmul: one fp32 fma (as torch)


@triton.jit
def _mla_kv_write_kernel(ckv_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, eps,
                         stride_ckv, stride_cos, stride_sin, stride_cache,
                         R: tl.constexpr, BLOCK_R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr,
                         INTERLEAVE: tl.constexpr, X_DTYPE: tl.constexpr, C_DTYPE: tl.constexpr,
                         O_DTYPE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = ckv_ptr + t.to(tl.int64) * stride_ckv
    out = cache_ptr + slot * stride_cache
    # RMSNorm: weight * rms_norm(c.float()).to(dtype)
    offs = tl.arange(0, BLOCK_R)                                               # [BR]
    m = offs < R
    x = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)                  # [BR]
    rstd = _rstd(tl.sum(x * x, axis=0), R, eps)
    n = _round(x * rstd, X_DTYPE)                                              # [BR]
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    c = _round(w * n, C_DTYPE)                                                 # [BR]
    tl.store(out + offs, _round(c, O_DTYPE).to(O_DTYPE), mask=m)
    if DR > 0:
        i = tl.arange(0, BLOCK_DR)                                             # [BD]
        md = i < DR
        ia, ib = _rope_offsets(i, DR // 2, INTERLEAVE)
        a = tl.load(row + R + ia, mask=md, other=0.0).to(tl.float32)
        b = tl.load(row + R + ib, mask=md, other=0.0).to(tl.float32)
        cs = _round(tl.load(cos_ptr + t.to(tl.int64) * stride_cos + i, mask=md, other=0.0).to(tl.float32), X_DTYPE)
        sn = _round(tl.load(sin_ptr + t.to(tl.int64) * stride_sin + i, mask=md, other=0.0).to(tl.float32), X_DTYPE)
        k_pe = _rope_combine(a, b, cs, sn, X_DTYPE)                            # [BD]
        tl.store(out + R + i, _round(k_pe, O_DTYPE).to(O_DTYPE), mask=md)


@triton.jit
def _layer_norm_at(row, w_ptr, b_ptr, idx, mask, mean, rstd, X_DTYPE: tl.constexpr):
    """LayerNorm of the row's elements at positions idx (torch CUDA's expression), in the activation dtype,
    returned as fp32."""
    x = tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return _round(tl.fma(w, rstd * (x - mean), b), X_DTYPE)                    # torch CUDA's (contracted) form


@triton.jit
def _indexer_key_write_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, eps,
                              stride_k, stride_cos, stride_sin, stride_cache,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_DIM: tl.constexpr,
                              INTERLEAVE: tl.constexpr, X_DTYPE: tl.constexpr, O_DTYPE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = k_ptr + t.to(tl.int64) * stride_k
    i = tl.arange(0, BLOCK_D)                                                  # [BD]
    m = i < D
    x = tl.load(row + i, mask=m, other=0.0).to(tl.float32)
    mean = tl.div_rn(tl.sum(x, axis=0), tl.full([], D, tl.float32))
    xc = tl.where(m, x - mean, 0.0)
    rstd = _rstd(tl.sum(xc * xc, axis=0), D, eps)                              # biased variance, as torch
    if ROPE_DIM > 0:
        rope = i < ROPE_DIM
        ia, ib = _rope_offsets(i, ROPE_DIM // 2, INTERLEAVE)
        ia = tl.where(rope, ia, i)
        ib = tl.where(rope, ib, i)
        a = _layer_norm_at(row, w_ptr, b_ptr, ia, m, mean, rstd, X_DTYPE)     # [BD]
        b = _layer_norm_at(row, w_ptr, b_ptr, ib, m, mean, rstd, X_DTYPE)
        mr = m & rope
        cs = _round(tl.load(cos_ptr + t.to(tl.int64) * stride_cos + i, mask=mr, other=0.0).to(tl.float32), X_DTYPE)
        sn = _round(tl.load(sin_ptr + t.to(tl.int64) * stride_sin + i, mask=mr, other=0.0).to(tl.float32), X_DTYPE)
        y = tl.where(rope, _rope_combine(a, b, cs, sn, X_DTYPE), a)                # [BD]
    else:
        y = _layer_norm_at(row, w_ptr, b_ptr, i, m, mean, rstd, X_DTYPE)      # [BD]
    tl.store(cache_ptr + slot * stride_cache + i, _round(y, O_DTYPE).to(O_DTYPE), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_args(cos: torch.Tensor | None, sin: torch.Tensor | None, dim: int, dummy: torch.Tensor):
    if dim == 0:
        return dummy, dummy, 0, 0
    cos, sin = _rows(cos), _rows(sin)
    return cos, sin, cos.stride(0), sin.stride(0)


def mla_kv_write(ckv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, interleave: bool, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """ckv [T, r+dr], norm_weight [r], cos / sin [T, dr] (None when dr = 0), kv_cache [S, r+dr] (stride 1 on
    its last dim) written in place at rows slot_mapping [T]."""
    T, width = ckv.shape
    r = norm_weight.shape[0]
    dr = width - r
    assert kv_cache.shape[1] == width and kv_cache.stride(-1) == 1 and dr % 2 == 0
    if T == 0:
        return
    ckv = _rows(ckv)
    cos, sin, s_cos, s_sin = _rope_args(cos, sin, dr, ckv)
    c_dtype = torch.promote_types(norm_weight.dtype, ckv.dtype)
    _mla_kv_write_kernel[(T,)](
        ckv, norm_weight.contiguous(), cos, sin, kv_cache, slot_mapping, float(eps),
        ckv.stride(0), s_cos, s_sin, kv_cache.stride(0),
        R=r, BLOCK_R=triton.next_power_of_2(r), DR=dr, BLOCK_DR=triton.next_power_of_2(max(dr, 1)),
        INTERLEAVE=bool(interleave), X_DTYPE=_TL_DTYPES[ckv.dtype], C_DTYPE=_TL_DTYPES[c_dtype],
        O_DTYPE=_TL_DTYPES[kv_cache.dtype], num_warps=4)


def indexer_key_write(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                      cos: torch.Tensor | None, sin: torch.Tensor | None, rope_dim: int, interleave: bool,
                      key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, di], ln_weight / ln_bias [di], cos / sin [T, rope_dim] (None when rope_dim = 0), key_cache
    [S, di] (stride 1 on its last dim) written in place at rows slot_mapping [T]."""
    T, di = k.shape
    assert key_cache.shape[1] == di and key_cache.stride(-1) == 1 and rope_dim % 2 == 0 and rope_dim <= di
    if T == 0:
        return
    k = _rows(k)
    cos, sin, s_cos, s_sin = _rope_args(cos, sin, rope_dim, k)
    block = triton.next_power_of_2(di)
    _indexer_key_write_kernel[(T,)](
        k, ln_weight.contiguous(), ln_bias.contiguous(), cos, sin, key_cache, slot_mapping, float(eps),
        k.stride(0), s_cos, s_sin, key_cache.stride(0),
        D=di, BLOCK_D=block, ROPE_DIM=int(rope_dim), INTERLEAVE=bool(interleave), X_DTYPE=_TL_DTYPES[k.dtype],
        O_DTYPE=_TL_DTYPES[key_cache.dtype], num_warps=1 if block <= 256 else 4)
