"""The Triton paged MLA decode (`glm_ray.kernels.cuda.mla_decode`) under TRITON_INTERPRET=1 on CPU,
against its test-only oracle `mla_decode_reference`, and that oracle against the engine's torch
reference (`torch_ref.attention.mla_decode` on a group built by `build_forward_batch`).

Tiny shapes (h = 4 / 5 heads padded to a 16-head tile, r = 32, dr = 16, B = 3, contexts 1 / 7 / 33),
block sizes 1, 4, 16, 32 around BLOCK_N = 16, shuffled (non-contiguous) block tables whose unused
entries point at OTHER sequences' blocks (a read past a context would change the result), split
counts with empty splits, sparse indices unsorted with -1 padding (including whole -1 tiles and
whole -1 splits). fp32 inputs: the interpreter computes in fp32 like the oracle, so rel err <= 1e-5
(only summation order differs).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from glm_ray.forward_batch import build_forward_batch  # noqa: E402
from glm_ray.kernels.cuda import mla_decode as md  # noqa: E402
from glm_ray.kernels.torch_ref import attention  # noqa: E402

R, DR = 32, 16
D = R + DR
CTXS = [1, 7, 33]
SMALL = (16, 16, 4, 1)              # BLOCK_H, BLOCK_N, warps, stages: several key tiles at these contexts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_case(h: int, block_size: int, *, ctxs=CTXS, dtype=torch.float32, extra_blocks: int = 2, seed: int = 0):
    """q [B, h, D] (row-strided view), kv_cache [S, D], block_table [B, nb] int32, context_lens [B] int32.
    nb covers the longest context plus `extra_blocks` (a CUDA-graph capacity); every table entry, used
    or not, is a real block of the cache, and the unused ones belong to other sequences."""
    g = torch.Generator().manual_seed(seed)
    B = len(ctxs)
    nb = -(-max(ctxs) // block_size) + extra_blocks
    num_blocks = B * nb + 3
    perm = torch.randperm(num_blocks, generator=g)[:B * nb].view(B, nb)
    block_table = torch.empty(B, nb, dtype=torch.int32)
    for b, n in enumerate(ctxs):                                              # test setup, per sequence
        used = -(-n // block_size)
        block_table[b, :used] = perm[b, :used].int()
        block_table[b, used:] = perm[(b + 1) % B, :nb - used].int()           # another sequence's blocks
    kv_cache = torch.randn(num_blocks * block_size, D, generator=g).to(dtype)
    q_store = torch.randn(B, h, D + 8, generator=g).to(dtype)
    q = q_store[..., :D]                                                      # row stride D + 8
    context_lens = torch.tensor(ctxs, dtype=torch.int32)
    return q, kv_cache, block_table, context_lens


def make_indices(ctxs, K: int, *, front: bool = False, seed: int = 1) -> torch.Tensor:
    """[B, K] int32: a random subset (about 2/3, at least one) of each context's positions, unsorted,
    -1 elsewhere — interleaved at random, or all valid entries first when `front`."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(ctxs), K), -1, dtype=torch.int32)
    for b, n in enumerate(ctxs):                                              # test setup, per sequence
        k = max(1, min(K, (2 * n + 2) // 3))
        sel = torch.randperm(n, generator=g)[:k].int()
        where = torch.arange(k) if front else torch.randperm(K, generator=g)[:k]
        out[b, where] = sel
    return out


def check(q, kv_cache, block_table, context_lens, block_size, indices=None, *, tol=1e-5, **kw):
    scale = D ** -0.5
    out = md.mla_decode_paged(q, kv_cache, block_table, context_lens, block_size, kv_lora_rank=R, scale=scale,
                              indices=indices, **kw)
    ref = md.mla_decode_reference(q, kv_cache, block_table, context_lens, block_size, kv_lora_rank=R, scale=scale,
                                  indices=indices)
    assert out.shape == (q.shape[0], q.shape[1], R) and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all()
    for b in range(q.shape[0]):                                               # per-sequence error, not diluted
        assert rel_err(out[b], ref[b]) <= tol, (b, rel_err(out[b], ref[b]))
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_dense(block_size, num_splits):
    # BLOCK_N = 16: ctx 33 spans 3 tiles; 5 splits leave splits of the 1- and 7-token contexts empty
    q, kv, bt, cl = make_case(5, block_size)
    check(q, kv, bt, cl, block_size, num_splits=num_splits, config=SMALL)


@pytest.mark.parametrize("h", [4, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_dense_default_config(h, block_size):
    # the shipped table's config and split heuristic (BLOCK_N larger than every context here)
    q, kv, bt, cl = make_case(h, block_size, seed=h)
    check(q, kv, bt, cl, block_size)
    check(q, kv, bt, cl, block_size, num_splits=3)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse(block_size, num_splits):
    # K = 40 indices over 3 tiles of 16: -1 interleaved anywhere, unsorted positions
    q, kv, bt, cl = make_case(5, block_size, seed=2)
    check(q, kv, bt, cl, block_size, make_indices(CTXS, 40), num_splits=num_splits, config=SMALL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_whole_padding_tiles(num_splits):
    # valid indices first: the later tiles (num_splits=1) and later splits (3) hold only -1
    q, kv, bt, cl = make_case(4, 4, seed=3)
    check(q, kv, bt, cl, 4, make_indices(CTXS, 48, front=True, seed=4), num_splits=num_splits, config=SMALL)


def test_sparse_default_config():
    q, kv, bt, cl = make_case(4, 16, seed=5)
    check(q, kv, bt, cl, 16, make_indices(CTXS, 24, seed=6))


def test_head_strided_q_and_bf16():
    # q rows with a head stride of 2 rows (a view of every other head), then bf16 inputs: the
    # interpreter upcasts, so only the bf16 rounding of q / cache / output separates it from the oracle
    q, kv, bt, cl = make_case(8, 4, seed=7)
    check(q[:, ::2], kv, bt, cl, 4, num_splits=2, config=SMALL)
    out = check(q.bfloat16(), kv.bfloat16(), bt, cl, 4, num_splits=2, config=SMALL, tol=1e-2)
    assert out.dtype == torch.bfloat16


def test_values_not_shapes_drive_lengths():
    # same shapes, new context lengths / table / indices values: one launch config serves both
    q, kv, bt, cl = make_case(5, 4, seed=8)
    check(q, kv, bt, cl, 4, num_splits=3, config=SMALL)
    cl2 = torch.tensor([33, 2, 20], dtype=torch.int32)
    bt2 = bt.roll(1, dims=0).contiguous()                                      # still valid, other blocks
    check(q, kv, bt2, cl2, 4, num_splits=3, config=SMALL)
    check(q, kv, bt2, cl2, 4, make_indices([33, 2, 20], 40, seed=9), num_splits=3, config=SMALL)


def test_default_num_splits():
    # shapes only; one wave of 132 SMs (one program per SM), each split >= min_keys (64 at h <= 32, 4h above)
    # keys of the range, at most MAX_SPLITS
    assert md.default_num_splits(1, 64, 576, 32768) == md.MAX_SPLITS
    assert md.default_num_splits(1, 64, 576, 2048) == 2048 // 256
    assert md.default_num_splits(64, 64, 576, 32768) == 2                    # 64 tiles -> 132 // 64
    assert md.default_num_splits(64, 32, 576, 2048) == 2                     # the H200 sweep's best
    assert md.default_num_splits(32, 32, 576, 8192) == 4
    assert md.default_num_splits(8, 32, 576, 1024) == 16
    assert md.default_num_splits(1, 32, 576, 1024) == 16                     # 1024 // 64 keys
    assert md.default_num_splits(64, 16, 576, 1024) == 2
    assert md.default_num_splits(1, 16, 576, 16) == 1                         # never < 1
    assert md.default_num_splits(264, 32, 576, 8192) == 1                    # 2 whole waves: no split
    assert md.default_num_splits(100, 32, 576, 8192) == 1                     # > half the SMs: no split
    # more tiles than SMs (absorbed prefill tails in an eager decode group): the fewest waves per unit of work
    assert md.default_num_splits(144, 32, 576, 2304) == 2                     # 3 waves / 2 = 1.5 (1 split: 2)
    assert md.default_num_splits(192, 32, 576, 2304) == 2                     # 3 / 2 = 1.5
    assert md.default_num_splits(133, 32, 576, 2304) == 2
    assert md.default_num_splits(144, 32, 576, 512) == 2                      # >= 256 keys a split
    assert md.default_num_splits(144, 32, 576, 300) == 1
    assert md.default_num_splits(144, 64, 576, 2304) == 2                     # h = 64: one 64-head tile a row
    for tiles in range(133, 800):                                             # never more waves of work than 1 split
        s = md.default_num_splits(tiles, 32, 576, 8192)
        assert 1 <= s <= md.WIDE_MAX_SPLITS
        assert -(-tiles * s // md.NUM_SMS) / s <= -(-tiles // md.NUM_SMS)
    for B in (1, 8, 64):
        for h in (4, 16, 32, 64):
            for rng in (1, 100, 2048, 131072):
                s = md.default_num_splits(B, h, 576, rng)
                assert 1 <= s <= md.MAX_SPLITS


def _engine_reference(q, kv, bt, cl, block_size, indices, scale):
    """`torch_ref.attention.mla_decode` over the groups `build_forward_batch` makes for B decodes."""
    B = q.shape[0]
    ctxs = [int(c) for c in cl]
    tables = [bt[b, :-(-ctxs[b] // block_size)].tolist() for b in range(B)]
    fb = build_forward_batch([1] * B, ctxs, tables, block_size, torch.device("cpu"), mla_mode="absorbed")
    out = torch.empty(B, q.shape[1], R, dtype=q.dtype)
    for g in fb.groups:                                                       # decode buckets (by length)
        sel = None if indices is None else indices[g.token_index][:, None, :]  # [Bg, 1, K] int32
        out[g.token_index] = attention.mla_decode(q.contiguous(), kv, g, sel, kv_lora_rank=R, scale=scale)
    return out


@pytest.mark.parametrize("sparse", [False, True])
def test_oracle_matches_engine_reference(sparse):
    q, kv, bt, cl = make_case(4, 4, ctxs=[5, 33, 7], seed=10)
    idx = make_indices([5, 33, 7], 12, seed=11) if sparse else None
    scale = D ** -0.5
    ref = md.mla_decode_reference(q, kv, bt, cl, 4, kv_lora_rank=R, scale=scale, indices=idx)
    eng = _engine_reference(q, kv, bt, cl, 4, idx, scale)
    assert rel_err(ref, eng) <= 1e-5
