"""The Triton radix-select top-k (glm_ray/kernels/cuda/topk.py) on the GPU at the DSA indexer's decode
shapes (B = 1..64 rows of up to 131072 scores, k = 2048; also k = 64 / 512) against its torch reference
(kernels/torch_ref/topk.py: exact equality, both break ties by lowest position and list ascending
positions) and torch.topk (same picked-score multiset; same sets when the scores are distinct; -1
padding), under CUDA-graph capture + replay, and through `CudaKernels.indexer_topk` with no reference
fallback (skipped without CUDA).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]

from glm_ray.kernels.cuda import indexer as IK  # noqa: E402
from glm_ray.kernels.cuda.topk import programs_per_row, topk_positions  # noqa: E402
from glm_ray.kernels.torch_ref.topk import topk_positions as ref_topk  # noqa: E402
from tests.kernels.test_topk_triton import check_against_torch_topk  # noqa: E402

DEV = "cuda"
TOPK = 2048


def _lengths(B: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Full rows, < k, == k, k + 1, then random lengths in [1, n]."""
    fixed = [n, max(1, k // 3), k, k + 1, n - 1]
    lens = [min(v, n) for v in fixed][:B]
    if len(lens) < B:
        lens += torch.randint(1, n + 1, (B - len(lens),), generator=g).tolist()
    return torch.tensor(lens, dtype=torch.int32, device=DEV)


def _check(scores, lens, k, *, distinct):
    out = topk_positions(scores, lens, k)
    ref = ref_topk(scores, lens, k)
    assert out.shape == (scores.shape[0], k) and out.dtype == torch.int32
    if not torch.equal(out, ref):
        bad = (out != ref).any(-1).nonzero().flatten().tolist()
        raise AssertionError(f"kernel != reference in rows {bad[:8]} (S={programs_per_row(*scores.shape)})")
    check_against_torch_topk(out, scores, lens, k, distinct)


@pytest.mark.parametrize("n", [8192, 32768, 131072])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_topk_matches_reference_and_torch(B, n):
    g = torch.Generator(device=DEV).manual_seed(B * 7 + n)
    scores = torch.randn(B, n, generator=g, device=DEV) * 3
    lens = _lengths(B, n, TOPK, torch.Generator().manual_seed(B + n)) if B > 1 else \
        torch.tensor([n], dtype=torch.int32, device=DEV)
    _check(scores, lens, TOPK, distinct=True)
    if B == 1:                                                     # a single row at a partial context
        _check(scores, torch.tensor([n // 3 + 5], dtype=torch.int32, device=DEV), TOPK, distinct=True)


@pytest.mark.parametrize("k", [64, 512])
def test_smaller_k(k):
    g = torch.Generator(device=DEV).manual_seed(k)
    scores = torch.randn(8, 32768, generator=g, device=DEV)
    _check(scores, _lengths(8, 32768, k, torch.Generator().manual_seed(k)), k, distinct=True)


@pytest.mark.parametrize("n", [8192, 32768])
def test_ties_zeros_and_neg_inf(n):
    """Heavy exact ties (5 values), ReLU'd scores (half exact zeros: the tie cut at 0.0), all-equal rows,
    -inf inside the context (rows with fewer than k finite scores)."""
    g = torch.Generator(device=DEV).manual_seed(n)
    B = 8
    scores = torch.randint(0, 5, (B, n), generator=g, device=DEV).float()
    scores[1] = torch.randn(n, generator=g, device=DEV).relu()
    scores[2] = 0.5
    scores[3, :] = float("-inf")
    scores[3, ::17] = torch.randn(scores[3, ::17].shape, generator=g, device=DEV)   # n / 17 finite
    scores[4, 100:n - 100] = float("-inf")                                          # 200 finite
    scores[5] = -torch.randn(n, generator=g, device=DEV).relu()                     # negatives and -0.0/0.0
    lens = torch.tensor([n, n, n - 3, n, n, n, 3000, 1], dtype=torch.int32, device=DEV)
    _check(scores, lens, TOPK, distinct=False)


def test_cuda_graph_replay_matches_eager():
    """topk_positions captured once on static buffers; new scores and lengths replayed; same result as
    eager and as the reference."""
    B, n = 8, 32768
    scores = torch.randn(B, n, device=DEV)
    lens = torch.full((B,), n, dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        topk_positions(scores, lens, TOPK)                         # compile + warm the allocator
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_positions(scores, lens, TOPK)
    g = torch.Generator(device=DEV).manual_seed(3)
    for new_lens in ([n, 1, 2048, 2049, 9000, 32767, 100, 20000], [5, n, n, 4096, 2047, 64, 30000, 12345]):
        scores.copy_(torch.randn(B, n, generator=g, device=DEV))
        scores[2, ::3] = 1.0                                       # ties
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_positions(scores, lens, TOPK))
        assert torch.equal(out, ref_topk(scores, lens, TOPK))


def test_indexer_topk_through_cuda_kernels_no_fallback(monkeypatch):
    """`CudaKernels.indexer_topk` on decode groups built by `build_forward_batch` takes the Triton path
    (scores kernel + topk_positions) with no reference fallback, and equals `topk_positions` of the
    kernel's own scores, i.e. the reference selection of those scores."""
    from glm_ray.forward_batch import build_forward_batch
    from glm_ray.kernels.cuda import CudaKernels
    monkeypatch.setattr(IK, "TOPK_IMPL", "triton")
    ck = CudaKernels()
    if ck.tk is None:
        pytest.skip(ck.triton_error)
    hi, di, block_size = 32, 128, 64
    lens = [1, 2048, 2049, 8192, 5000, 100, 16384, 3]
    B = len(lens)
    nb = -(-max(lens) // block_size)
    g = torch.Generator(device=DEV).manual_seed(0)
    key_cache = torch.randn(B * nb * block_size, di, generator=g, device=DEV).to(torch.bfloat16)
    bt = torch.randperm(B * nb, generator=g, device=DEV).view(B, nb).to(torch.int32)    # [B, nb]
    qi = torch.randn(B, hi, di, generator=g, device=DEV)
    w = torch.randn(B, hi, generator=g, device=DEV) * hi ** -0.5
    tables = [bt[b, :-(-n // block_size)].tolist() for b, n in enumerate(lens)]
    fb = build_forward_batch([1] * B, lens, tables, block_size, torch.device(DEV))
    ck.fallbacks.clear()
    for group in fb.groups:
        sel = ck.indexer_topk(qi, w, key_cache, group, TOPK)       # [Bg, 1, k]
        rows = group.q_index[:, 0]
        kmax = group.kv_capacity or group.max_context_len
        scores = IK.indexer_decode_scores(qi[rows], w[rows], key_cache, group.block_table, group.context_lens,
                                          block_size, kmax)        # [Bg, kmax]
        assert torch.equal(sel[:, 0], ref_topk(scores, group.context_lens, min(TOPK, kmax)))
    assert not ck.fallbacks, f"reference fallbacks: {dict(ck.fallbacks)}"


# ---- topk_bits: the prefill selection as a bitmap ---------------------------------------------------

def _check_bits(scores, lens, k):
    from glm_ray.kernels.cuda.topk import topk_bits
    from glm_ray.kernels.torch_ref.topk import topk_bits as ref_bits
    out = topk_bits(scores, lens, k)
    ref = ref_bits(scores, lens, k)
    if not torch.equal(out, ref):
        bad = (out != ref).any(-1).nonzero().flatten().tolist()
        raise AssertionError(f"bits != reference in rows {bad[:8]}")


@pytest.mark.parametrize("n", [4096, 8192, 16384])
def test_topk_bits_prefill_rows(n):
    """A prefill group's rows (row i: causal length i + 1 over the whole width, k = 2048: rows below, at and
    above k) at the shapes the sparse MLA prefill meets (1 x 8k: 8192 rows of 8192), with exact ties."""
    g = torch.Generator(device=DEV).manual_seed(n)
    rows = min(n, 4096)
    scores = torch.randn(rows, n, generator=g, device=DEV).relu_() * 3          # half exact zeros: ties
    lens = torch.arange(n - rows + 1, n + 1, dtype=torch.int32, device=DEV)      # the group's last rows
    lens[:64] = torch.arange(2000, 2064, dtype=torch.int32, device=DEV)          # around k
    _check_bits(scores, lens, TOPK)


def test_topk_bits_ties_and_neg_inf():
    n = 8192
    g = torch.Generator(device=DEV).manual_seed(1)
    scores = torch.randint(0, 5, (8, n), generator=g, device=DEV).float()
    scores[2] = 0.5
    scores[3, :] = float("-inf")
    scores[3, ::17] = 1.0
    scores[4, 100:n - 100] = float("-inf")
    lens = torch.tensor([n, n, n - 3, n, n, 2049, 2048, 1], dtype=torch.int32, device=DEV)
    _check_bits(scores, lens, TOPK)
