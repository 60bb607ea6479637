"""The one-launch MoE alignment on the GPU == the torch-ops `layout.moe_align` at decode sizes of
glm5-flash-31b (64 experts, top-4) and GLM-5 (256 experts, top-8), and inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from glm_ray.kernels.cuda import layout as L

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


def _ids(t, e, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("e,k", [(64, 4), (256, 8)])
@pytest.mark.parametrize("t", [1, 8, 64, 256])
@pytest.mark.parametrize("bm", [16, 64])
def test_equals_torch_ops(t, e, k, bm):
    from glm_ray.kernels.cuda.moe_align import moe_align_triton
    ids = _ids(t, e, k, seed=t * e + bm)
    ref, got = L.moe_align(ids, e, bm), moe_align_triton(ids, e, bm)
    assert torch.equal(got.sorted_ids, ref.sorted_ids) and torch.equal(got.expert_ids, ref.expert_ids)
    assert torch.equal(got.num_post_pad.long(), ref.num_post_pad.long())


def test_graph_replay_follows_new_ids():
    from glm_ray.kernels.cuda.moe_align import moe_align_triton
    ids = _ids(32, 64, 4, seed=0)
    moe_align_triton(ids, 64, 16)                                           # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        al = moe_align_triton(ids, 64, 16)
    ids.copy_(_ids(32, 64, 4, seed=1))
    g.replay()
    ref = L.moe_align(ids, 64, 16)
    assert torch.equal(al.sorted_ids, ref.sorted_ids) and torch.equal(al.expert_ids, ref.expert_ids)
