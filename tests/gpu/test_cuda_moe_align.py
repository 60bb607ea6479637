"""The Triton MoE alignments on the GPU == the torch-ops `layout.moe_align`: the one-launch kernel at
decode sizes and the three-launch chunked one at prefill sizes, of glm5-flash-31b (64 experts, top-4) and
GLM-5 (256 experts, top-8), and inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from glm_ray.kernels.cuda import layout as L

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


def _ids(t, e, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32)


def _assert_same(got, ref):
    assert got.max_blocks == ref.max_blocks
    assert torch.equal(got.sorted_ids, ref.sorted_ids) and torch.equal(got.expert_ids, ref.expert_ids)
    assert torch.equal(got.num_post_pad.long(), ref.num_post_pad.long())


@pytest.mark.parametrize("e,k", [(64, 4), (256, 8)])
@pytest.mark.parametrize("t", [1, 8, 64, 256])
@pytest.mark.parametrize("bm", [16, 64])
def test_equals_torch_ops(t, e, k, bm):
    from glm_ray.kernels.cuda.moe_align import moe_align_triton
    ids = _ids(t, e, k, seed=t * e + bm)
    _assert_same(moe_align_triton(ids, e, bm), L.moe_align(ids, e, bm))


@pytest.mark.parametrize("e,k", [(64, 4), (64, 8), (256, 4), (256, 8)])
@pytest.mark.parametrize("t", [2048, 8192, 1000])
@pytest.mark.parametrize("bm", [16, 64, 128])
def test_chunked_equals_torch_ops(t, e, k, bm):
    from glm_ray.kernels.cuda.moe_align import moe_align_auto, moe_align_chunked
    ids = _ids(t, e, k, seed=t * e + bm + k)
    ref = L.moe_align(ids, e, bm)
    _assert_same(moe_align_chunked(ids, e, bm), ref)
    _assert_same(moe_align_auto(ids, e, bm), ref)


@pytest.mark.parametrize("e", [64, 256])
def test_chunked_skewed(e):
    from glm_ray.kernels.cuda.moe_align import moe_align_chunked
    ids = _ids(4096, e, 4, seed=e)
    ids[: 3000] = 3                                                        # one hot expert, many idle ones
    _assert_same(moe_align_chunked(ids, e, 64), L.moe_align(ids, e, 64))


@pytest.mark.parametrize("t", [32, 4096])
def test_graph_replay_follows_new_ids(t):
    from glm_ray.kernels.cuda.moe_align import moe_align_auto
    ids = _ids(t, 64, 4, seed=0)
    moe_align_auto(ids, 64, 16)                                             # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        al = moe_align_auto(ids, 64, 16)
    ids.copy_(_ids(t, 64, 4, seed=1))
    g.replay()
    _assert_same(al, L.moe_align(ids, 64, 16))
