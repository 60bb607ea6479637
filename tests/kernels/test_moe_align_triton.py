"""The Triton MoE alignments (kernels/cuda/moe_align.py) under TRITON_INTERPRET equal the torch-ops
reference `layout.moe_align` element for element (all are stable): the one-launch kernel at decode sizes
and the three-launch chunked counting sort at prefill sizes (small chunks here, so that P spans many of
them), over skewed and uniform routings, idle experts, expert counts that are not powers of two."""
from __future__ import annotations

import pytest
import torch

from glm_ray.kernels.cuda import layout as L

moe_align_mod = pytest.importorskip("glm_ray.kernels.cuda.moe_align")


def _ids(t, e, k, seed, skew):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) + skew * torch.linspace(0, 1, e)        # skew: hot experts
    return logits.topk(k, dim=-1).indices.to(torch.int32)                          # [T, K] distinct per row


def _assert_same(got, ref):
    assert got.max_blocks == ref.max_blocks and got.block_m == ref.block_m
    assert torch.equal(got.num_post_pad.long(), ref.num_post_pad.long())
    assert torch.equal(got.sorted_ids, ref.sorted_ids)
    assert torch.equal(got.expert_ids, ref.expert_ids)


@pytest.mark.parametrize("t,e,k,bm,skew", [(1, 64, 4, 16, 0.0), (7, 256, 8, 16, 0.0), (33, 8, 2, 32, 0.0),
                                           (200, 16, 4, 64, 3.0), (64, 64, 4, 16, 5.0), (50, 4, 4, 16, 0.0),
                                           (3, 48, 6, 32, 0.0), (500, 160, 8, 64, 1.0)])
def test_equals_torch_ops(t, e, k, bm, skew):
    ids = _ids(t, e, k, seed=t + e, skew=skew)
    _assert_same(moe_align_mod.moe_align_triton(ids, e, bm), L.moe_align(ids, e, bm))


@pytest.mark.parametrize("t,e,k,bm,chunk,skew", [
    (16, 8, 4, 16, 64, 0.0),          # P == one chunk
    (1000, 8, 2, 16, 64, 0.0),        # P = 2000: 31 full chunks + a partial one
    (2048, 64, 4, 64, 256, 0.0),      # P = 8192: a multiple of the chunk
    (2049, 64, 4, 128, 256, 2.0),     # one pair past a chunk boundary
    (1025, 256, 8, 16, 128, 0.0),     # P = 8200, GLM-5 routing
    (777, 256, 8, 128, 512, 4.0),     # few tokens per expert: many idle experts
    (1111, 160, 6, 64, 128, 1.0),     # E not a power of two
    (300, 1024, 8, 16, 256, 0.0),     # E = MAX_EXPERTS
])
def test_chunked_equals_torch_ops(t, e, k, bm, chunk, skew):
    ids = _ids(t, e, k, seed=t * 7 + e, skew=skew)
    _assert_same(moe_align_mod.moe_align_chunked(ids, e, bm, chunk=chunk), L.moe_align(ids, e, bm))


@pytest.mark.parametrize("e,bm", [(8, 16), (64, 128), (256, 64)])
def test_chunked_all_pairs_on_one_expert(e, bm):
    ids = torch.full((1500, 3), e // 2 + 1, dtype=torch.int32)             # [T, K]: one hot expert
    ids[::7, 1] = e - 1                                                     # and a second, sparse one
    _assert_same(moe_align_mod.moe_align_chunked(ids, e, bm, chunk=128), L.moe_align(ids, e, bm))
    zeros = torch.zeros_like(ids)                                           # experts 1.. idle (clamped tail)
    _assert_same(moe_align_mod.moe_align_chunked(zeros, e, bm, chunk=128), L.moe_align(zeros, e, bm))


def test_chunked_takes_any_int_dtype_and_layout():
    ids = _ids(900, 64, 4, seed=3, skew=0.0)
    ids64 = ids.to(torch.int64).t().contiguous().t()                        # [T, K] int64, not contiguous
    _assert_same(moe_align_mod.moe_align_chunked(ids64, 64, 16, chunk=256), L.moe_align(ids, 64, 16))


def test_auto_picks_by_size(monkeypatch):
    calls = []
    for name in ("moe_align_triton", "moe_align_chunked"):
        fn = getattr(moe_align_mod, name)
        monkeypatch.setattr(moe_align_mod, name, lambda *a, _f=fn, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    small = _ids(moe_align_mod.ONE_LAUNCH_PAIRS // 4, 64, 4, seed=2, skew=0.0)
    big = _ids(moe_align_mod.ONE_LAUNCH_PAIRS // 4 + 1, 64, 4, seed=1, skew=0.0)
    _assert_same(moe_align_mod.moe_align_auto(small, 64, 16), L.moe_align(small, 64, 16))
    _assert_same(moe_align_mod.moe_align_auto(big, 64, 16), L.moe_align(big, 64, 16))
    assert calls == ["moe_align_triton", "moe_align_chunked"]
    too_many = _ids(4, moe_align_mod.MAX_EXPERTS + 1, 2, seed=0, skew=0.0)   # torch ops: no kernel fits
    _assert_same(moe_align_mod.moe_align_auto(too_many, moe_align_mod.MAX_EXPERTS + 1, 16),
                 L.moe_align(too_many, moe_align_mod.MAX_EXPERTS + 1, 16))
    assert len(calls) == 2
