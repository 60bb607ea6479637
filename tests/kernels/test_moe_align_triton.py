"""The one-launch MoE alignment (kernels/cuda/moe_align.py) under TRITON_INTERPRET equals the torch-ops
reference `layout.moe_align` element for element (both are stable), over skewed and uniform routings,
expert counts that are not powers of two, and pair counts spanning several chunks."""
from __future__ import annotations

import pytest
import torch

from glm_ray.kernels.cuda import layout as L

moe_align_mod = pytest.importorskip("glm_ray.kernels.cuda.moe_align")


def _ids(t, e, k, seed, skew):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) + skew * torch.linspace(0, 1, e)        # skew: hot experts
    return logits.topk(k, dim=-1).indices.to(torch.int32)                          # [T, K] distinct per row


@pytest.mark.parametrize("t,e,k,bm,skew", [(1, 64, 4, 16, 0.0), (7, 256, 8, 16, 0.0), (33, 8, 2, 32, 0.0),
                                           (200, 16, 4, 64, 3.0), (64, 64, 4, 16, 5.0), (50, 4, 4, 16, 0.0),
                                           (3, 48, 6, 32, 0.0), (500, 160, 8, 64, 1.0)])
def test_equals_torch_ops(t, e, k, bm, skew):
    ids = _ids(t, e, k, seed=t + e, skew=skew)
    ref = L.moe_align(ids, e, bm)
    got = moe_align_mod.moe_align_triton(ids, e, bm)
    assert got.max_blocks == ref.max_blocks and got.block_m == ref.block_m
    assert torch.equal(got.num_post_pad.long(), ref.num_post_pad.long())
    assert torch.equal(got.sorted_ids, ref.sorted_ids)
    assert torch.equal(got.expert_ids, ref.expert_ids)


def test_auto_keeps_torch_ops_above_the_bound():
    ids = _ids(moe_align_mod.MAX_PAIRS // 4 + 1, 64, 4, seed=1, skew=0.0)
    ref = L.moe_align(ids, 64, 16)
    got = moe_align_mod.moe_align_auto(ids, 64, 16)
    assert torch.equal(got.sorted_ids, ref.sorted_ids)
