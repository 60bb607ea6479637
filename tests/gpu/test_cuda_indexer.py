"""The Triton DSA lightning-indexer decode kernel (glm_ray/kernels/cuda/indexer.py) on the GPU at
GLM-5 shapes (32 heads x 128, bf16 keys, top-2048) against `indexer_decode_reference` (skipped without
CUDA).

Tolerances:
* scores: |kernel - reference| <= 1e-4 * max |reference score| of the row. The reference accumulates
  in fp64 (exact up to one fp32 rounding); the kernel's bf16-split dots are the fp32 dot up to
  summation order (~2^-24 per product, accumulated over di = 128 and 32 heads: ~1e-6 of the max), so
  1e-4 leaves two orders of margin while still catching any TF32 (2^-11 per product) or bf16 slip.
* selections: the kernel's top-k set may differ from the reference's only among near-ties — positions
  whose reference score is within 1e-4 * max of the k-th best score — and only a few of them.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.cuda import indexer as K  # noqa: E402
from glm_ray.kernels.cuda.indexer import (  # noqa: E402
    indexer_decode_reference,
    indexer_decode_scores,
    indexer_decode_topk,
)

DEV = "cuda"
HI, DI, TOPK = 32, 128, 2048
CONTEXTS = [1, 100, 2048, 2049, 8192, 32768]
REL = 1e-4


def _case(lens, block_size, *, spare_blocks=1, qi_dtype=torch.float32, key_dtype=torch.bfloat16, seed=0):
    """Random decode batch; blocks scattered over the cache (permuted block ids), nb = blocks of the
    longest context + spare_blocks, so kmax = nb * block_size > max(lens) as under CUDA graphs."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    B = len(lens)
    nb = -(-max(lens) // block_size) + spare_blocks
    key_cache = torch.randn(B * nb * block_size, DI, generator=g, device=DEV).to(key_dtype)
    bt = torch.randperm(B * nb, generator=g, device=DEV).view(B, nb).to(torch.int32)     # [B, nb]
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qi = torch.randn(B, HI, DI, generator=g, device=DEV).to(qi_dtype)
    w = torch.randn(B, HI, generator=g, device=DEV) * HI ** -0.5
    return qi, w, key_cache, bt, cl, nb * block_size


def _check(qi, w, key_cache, bt, cl, kmax, block_size):
    scores = indexer_decode_scores(qi, w, key_cache, bt, cl, block_size, kmax)
    idx = indexer_decode_topk(qi, w, key_cache, bt, cl, block_size, TOPK, kmax)
    ref_idx, ref = indexer_decode_reference(qi, w, key_cache, bt, cl, block_size, TOPK, kmax=kmax)
    assert scores.shape == (len(cl), kmax) and idx.shape == (len(cl), min(TOPK, kmax)) and idx.dtype == torch.int32
    fin = ref.isfinite()
    assert torch.equal(scores.isfinite(), fin) and bool((scores[~fin] == float("-inf")).all())
    scale = ref.masked_fill(~fin, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)      # [B, 1]
    err = ((scores - ref).masked_fill(~fin, 0).abs() / scale).max().item()
    assert err <= REL, f"score error {err:.2e} of the row max"
    for b, n in enumerate(cl.tolist()):
        got = set(idx[b][idx[b] >= 0].tolist())
        want = set(ref_idx[b][ref_idx[b] >= 0].tolist())
        assert len(got) == len(want) == min(TOPK, n)
        assert int((idx[b] == -1).sum()) == min(TOPK, kmax) - min(TOPK, n)
        diff = got ^ want
        if diff:
            kth = ref[b, ref_idx[b, min(TOPK, n) - 1]].item()
            near = (ref[b, list(diff)] - kth).abs() <= REL * scale[b, 0]
            assert bool(near.all()), f"seq {b}: non-tie selection differences {sorted(diff)[:8]}"
            assert len(diff) <= 16, f"seq {b}: {len(diff)} near-tie differences"
    return err


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_indexer_decode_matches_reference(B, block_size):
    if B == 1:
        for n in CONTEXTS:                                     # every context alone
            _check(*_case([n], block_size, seed=n), block_size)
    else:
        lens = [CONTEXTS[i % len(CONTEXTS)] for i in range(B)]
        lens = [lens[i] for i in torch.randperm(B, generator=torch.Generator().manual_seed(B)).tolist()]
        _check(*_case(lens, block_size, seed=B), block_size)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_indexer_decode_topk_impls(monkeypatch, impl):
    """Both top-k paths (the radix-select kernel and torch.topk) on a mixed batch."""
    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    _check(*_case([2049, 1, 32768, 4096, 100, 2048, 2047, 10000], 64, seed=5), 64)


@pytest.mark.parametrize("qi_dtype,key_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_indexer_decode_other_dtypes(qi_dtype, key_dtype):
    """bf16 queries (one exact bf16 dot) and fp32 keys (the ieee fp32 dot)."""
    _check(*_case([1, 100, 2049, 8192], 64, qi_dtype=qi_dtype, key_dtype=key_dtype), 64)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_indexer_decode_cuda_graph_replay_matches_eager(monkeypatch, impl):
    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    block_size, nb, B = 64, 64, 8                              # capacity 4096 positions per sequence
    qi, w, key_cache, bt, cl, kmax = _case([4096] * B, block_size, spare_blocks=0)
    assert kmax == nb * block_size
    cl.copy_(torch.tensor([1, 100, 2048, 2049, 4096, 3000, 7, 64], dtype=torch.int32))

    def step():
        return (indexer_decode_scores(qi, w, key_cache, bt, cl, block_size, kmax),
                indexer_decode_topk(qi, w, key_cache, bt, cl, block_size, TOPK, kmax))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                                 # compile + warm the allocator
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_scores, out_idx = step()
    g = torch.Generator(device=DEV).manual_seed(7)
    for lens in ([4096, 1, 2049, 100, 3333, 2048, 17, 4000], [5, 4096, 4096, 1, 2500, 64, 65, 2047]):
        cl.copy_(torch.tensor(lens, dtype=torch.int32))        # new values in the captured buffers
        bt.copy_(torch.randperm(B * nb, generator=g, device=DEV).view(B, nb).to(torch.int32))
        qi.copy_(torch.randn(qi.shape, generator=g, device=DEV))
        graph.replay()
        eager_scores, eager_idx = step()
        assert torch.equal(out_scores, eager_scores)           # same kernel, same inputs: bitwise
        for b in range(B):
            assert set(out_idx[b].tolist()) == set(eager_idx[b].tolist())
        _check(qi, w, key_cache, bt, cl, kmax, block_size)


def _prefill_case(qlens, clens, *, seed, qi_dtype=torch.float32, bs=64):
    """A prefill step's indexer inputs on scattered blocks: (qi [T, HI, DI], w [T, HI], bf16 key_cache, the
    ForwardBatch, the generator — for further draws in the same sequence)."""
    from glm_ray.forward_batch import build_forward_batch
    g = torch.Generator(device=DEV).manual_seed(seed)
    nbs = [-(-n // bs) for n in clens]
    perm = torch.randperm(sum(nbs), generator=g, device=DEV).tolist()
    tables = [perm[sum(nbs[:i]):sum(nbs[:i + 1])] for i in range(len(nbs))]
    key_cache = torch.randn(sum(nbs) * bs, DI, generator=g, device=DEV).to(torch.bfloat16)
    qi = torch.randn(sum(qlens), HI, DI, generator=g, device=DEV).to(qi_dtype)
    w = torch.randn(sum(qlens), HI, generator=g, device=DEV) * HI ** -0.5
    return qi, w, key_cache, build_forward_batch(qlens, clens, tables, bs, torch.device(DEV)), g


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_indexer_prefill_matches_engine_reference(monkeypatch, impl):
    """Prefill groups (a row per query token, its causal length as the context): the same selections as
    the engine's torch reference `indexer_topk` on GLM-5 shapes, fresh prompts and chunks after a cached
    prefix, contexts below and above top-2048 (up to near-ties, as the decode tests)."""
    from glm_ray.kernels.torch_ref.indexer import indexer_topk

    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    torch.backends.cuda.matmul.allow_tf32 = False
    qlens = [300, 512, 1000]
    qi, w, key_cache, fb, _ = _prefill_case(qlens, [300, 2560, 4100], seed=3)
    checked = 0
    for group in fb.groups:
        ref = indexer_topk(qi, w, key_cache, group, TOPK).cpu()
        got = K.indexer_prefill_topk(qi, w, key_cache, group, TOPK, max_bytes=256 << 20).cpu()
        assert got.shape == ref.shape
        valid = group.q_valid.cpu()
        first = (group.context_lens - group.query_lens).tolist()
        for b in range(group.num_seqs):
            for i in torch.nonzero(valid[b]).flatten().tolist():
                n = first[b] + i + 1
                gs, rs = set(got[b, i][got[b, i] >= 0].tolist()), set(ref[b, i][ref[b, i] >= 0].tolist())
                assert len(gs) == len(rs) == min(TOPK, n) and max(gs) < n
                assert len(gs ^ rs) <= 8, (b, i, len(gs ^ rs))         # near-ties only (fp32 summation order)
                checked += 1
            assert bool((got[b][~valid[b]] == -1).all())
    assert checked == sum(qlens)


def test_prefill_bits_through_cuda_kernels_equal_the_index_path(monkeypatch):
    """`CudaKernels.indexer_topk` on a naive-form prefill group returns `SelectionBits` (written by
    `topk_bits`) holding exactly the index path's picks (`bits=False`: the radix top-k of the same scores),
    and `CudaKernels.mla_prefill` takes it with no reference fallback: its output equals the index path's
    bit for bit (GLM-5 shapes: contexts below and above top-2048, a chunk after a cached prefix)."""
    from glm_ray.kernels.cuda import CudaKernels
    from glm_ray.kernels.torch_ref.topk import SelectionBits

    monkeypatch.setattr(K, "TOPK_IMPL", "triton")
    ck = CudaKernels()
    if ck.tk is None:
        pytest.skip(ck.triton_error)
    qi, w, key_cache, fb, g = _prefill_case([300, 1000, 2500], [300, 4100, 2500], seed=5, qi_dtype=torch.bfloat16)
    T, S = qi.shape[0], key_cache.shape[0]
    h, r, dr, dn, dv = 8, 512, 64, 192, 256                                  # GLM-5 MLA dims, 8 heads
    q = torch.randn(T, h, dn + dr, generator=g, device=DEV).to(torch.bfloat16)
    kv_cache = torch.randn(S, r + dr, generator=g, device=DEV).to(torch.bfloat16)
    w_kv = (torch.randn(h * (dn + dv), r, generator=g, device=DEV) * r ** -0.5).to(torch.bfloat16)
    kv_b = lambda x: x @ w_kv.T                                               # noqa: E731
    ck.fallbacks.clear()
    sparse = 0
    for group in fb.groups:
        if group.q_index.shape[1] == 1 or group.max_context_len <= TOPK:
            continue
        sel = ck.indexer_topk(qi, w, key_cache, group, TOPK)
        assert isinstance(sel, SelectionBits)
        idx = K.indexer_prefill_topk(qi, w, key_cache, group, TOPK, max_bytes=256 << 20)   # [B, Qmax, k]
        assert torch.equal(sel.bits, SelectionBits.from_indices(idx, group).bits)
        kw = dict(kv_lora_rank=r, v_head_dim=dv, scale=(dn + dr) ** -0.5)
        assert torch.equal(ck.mla_prefill(q, kv_cache, group, sel, kv_b, **kw),
                           ck.mla_prefill(q, kv_cache, group, idx, kv_b, **kw))
        sparse += 1
    assert sparse >= 1
    assert not ck.fallbacks, f"reference fallbacks: {dict(ck.fallbacks)}"
