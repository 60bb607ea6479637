"""The Triton radix-select top-k (glm_ray/kernels/cuda/topk.py) under TRITON_INTERPRET=1 on CPU, on small
shapes, against its torch reference (kernels/torch_ref/topk.py) and torch.topk.

Both implement the same deterministic contract (ties: lowest position; ascending positions, -1 last),
so the kernel must equal the reference exactly. Against torch.topk (whose tie order is its own): (a) the
multiset of picked scores is the same, (b) with distinct scores the position sets are equal, (c) the -1
count is k - min(k, finite valid keys) and every pick is a valid position. Scores of valid keys are
finite or -inf (the indexer's mask value); NaN is outside the contract and not tested.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from glm_ray.kernels.cuda import topk as T  # noqa: E402
from glm_ray.kernels.torch_ref.topk import topk_bits as ref_bits  # noqa: E402
from glm_ray.kernels.torch_ref.topk import topk_positions as ref_topk  # noqa: E402
from glm_ray.kernels.torch_ref.topk import unpack_bits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def check_against_torch_topk(out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int,
                             distinct: bool) -> None:
    """(a) same multiset of picked scores as torch.topk over the masked rows, (b) same position sets when
    the scores are distinct, (c) -1 padding count and validity of the picks."""
    B, n = scores.shape
    assert out.shape == (B, k) and out.dtype == torch.int32
    valid = torch.arange(n, device=scores.device)[None, :] < lengths.long()[:, None]
    masked = scores.masked_fill(~valid, float("-inf"))                        # [B, n]
    kk = min(k, n)
    vals, idx = masked.topk(kk, dim=-1)                                        # [B, kk]
    fin = vals != float("-inf")
    n_fin = (masked != float("-inf")).sum(-1)                                  # [B]
    picked = out >= 0
    assert torch.equal(picked.sum(-1), torch.clamp(n_fin, max=k)), "pick count"
    assert bool((out[:, :kk][~picked[:, :kk]] == -1).all()) and bool((out[:, kk:] == -1).all())
    pos = out.long().clamp(min=0)
    assert bool(valid.gather(1, pos)[picked].all()), "picked a position past the row's length"
    got_vals = masked.gather(1, pos).masked_fill(~picked, float("-inf"))       # [B, k]
    assert bool((got_vals[picked] != float("-inf")).all()), "picked a -inf score"
    a = got_vals.sort(-1, descending=True).values[:, :kk]
    assert torch.equal(a, vals.masked_fill(~fin, float("-inf"))), "picked score multiset != torch.topk's"
    for b in range(B):                                                         # uniqueness of the picks
        row = out[b][out[b] >= 0]
        assert row.unique().numel() == row.numel()
    if distinct:
        for b in range(B):
            want = set(idx[b][fin[b]].tolist())
            assert set(out[b][out[b] >= 0].tolist()) == want


def run_case(scores, lengths, k, *, distinct, **kw):
    out = T.topk_positions(scores.to(DEV), lengths.to(DEV), k, **kw).cpu()
    ref = ref_topk(scores, lengths, k)
    assert torch.equal(out, ref), f"kernel != reference\n{out}\n{ref}"
    check_against_torch_topk(ref, scores, lengths, k, distinct)
    return out


def _lengths(B: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Row lengths covering < k, == k and > k (clamped to [1, n]), then random."""
    base = [max(1, k // 2), k, k + 1 + (n - k - 1) // 2 if n > k + 1 else n]
    lens = [min(max(v, 1), n) for v in base]
    while len(lens) < B:
        lens.append(int(torch.randint(1, n + 1, (1,), generator=g)))
    return torch.tensor(lens[:B], dtype=torch.int32)


@pytest.mark.parametrize("n", [64, 300, 1024])
@pytest.mark.parametrize("k", [8, 64, 512])
@pytest.mark.parametrize("B", [1, 3])
def test_distinct_scores_match_reference_and_torch_topk(B, n, k):
    """Continuous scores (no ties); several programs per row (chunk 64: up to 8 programs per row)."""
    g = torch.Generator().manual_seed(B * 10_000 + n * 10 + k)
    scores = torch.randn(B, n, generator=g) * 10
    lens = _lengths(B, n, k, g) if B == 3 else torch.tensor([max(1, min(n, k + 3))], dtype=torch.int32)
    run_case(scores, lens, k, distinct=True, chunk=64, target=8)


@pytest.mark.parametrize("chunk,target,ks", [(32, 14, (8, 256)), (64, 28, (150, 299)), (1024, 512, (1, 8, 100, 333))])
def test_ties_and_special_values(chunk, target, ks):
    """Rows full of exact ties (few distinct values), all-equal rows, +-0.0, -inf inside the context,
    negatives, and rows with fewer finite scores than k; 2, 4 and 1 programs per row (B = 7); the tie
    cut of the all-equal rows lands in the first, a middle and the last slice."""
    g = torch.Generator().manual_seed(chunk + target)
    B, n = 7, 300
    scores = torch.randint(-3, 4, (B, n), generator=g).float() * 0.25         # 7 values: heavy ties
    scores[1] = 1.5                                                            # all equal
    scores[2] = -scores[2].abs() * 0.0                                         # -0.0 and +0.0 only
    scores[3, 10:200] = float("-inf")                                          # -inf inside the context
    scores[4] = float("-inf")
    scores[4, ::37] = torch.arange(9, dtype=torch.float32)                     # 9 finite keys only
    scores[5] = -7.0                                                           # all equal, negative
    scores[5, 123] = -7.5
    lens = torch.tensor([300, 299, 257, 300, 300, 64, 1], dtype=torch.int32)
    for k in ks:
        run_case(scores, lens, k, distinct=False, chunk=chunk, target=target)


def test_random_ties_many_slices():
    """Random rows drawn from 3 values at lengths around k: the tie cut lands inside various slices."""
    g = torch.Generator().manual_seed(1)
    B, n, k = 4, 1024, 64
    scores = torch.randint(0, 3, (B, n), generator=g).float()
    lens = torch.tensor([1024, 65, 64, 500], dtype=torch.int32)
    run_case(scores, lens, k, distinct=False, chunk=32, target=24)


def test_wide_row_and_strided_scores():
    """A row view with a larger stride (a column slice of a wider buffer); k > n (take-all only)."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 700, generator=g)
    scores = wide[:, 50:450]                                                   # [3, 400], row stride 700
    lens = torch.tensor([400, 17, 399], dtype=torch.int32)
    run_case(scores, lens, 64, distinct=True, chunk=128, target=16)
    out = run_case(scores, lens, 512, distinct=True, chunk=128)               # k > n: every row takes all
    assert out[1, :17].tolist() == list(range(17)) and bool((out[1, 17:] == -1).all())


def test_programs_per_row_from_shapes():
    assert T.programs_per_row(1, 8192, 1024, 512) == 8
    assert T.programs_per_row(1, 131072, 1024, 512) == 128
    assert T.programs_per_row(64, 32768, 1024, 512) == 8
    assert T.programs_per_row(256, 131072, 1024, 512) == 2
    assert T.programs_per_row(3, 10, 1024, 512) == 1


# ---- topk_bits: the prefill form (one program per row, the picks as a bitmap) -----------------------

@pytest.fixture(params=[32, T.BITS_CHUNK, 1024], ids=lambda c: f"chunk{c}")
def bits_chunk(request, monkeypatch):
    """The kernel's chunk: 32 (many chunks a row: the passes' loops, candidate skipping, ties across chunks), the
    shipped one and 1024 (one chunk at most of these lengths)."""
    monkeypatch.setattr(T, "BITS_CHUNK", request.param)
    return request.param


def run_bits(scores, lens, k, words=None):
    out = T.topk_bits(scores.to(DEV), lens.to(DEV), k, words).cpu()
    ref = ref_bits(scores, lens, k, words)                                     # from the reference positions
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref), f"bits != reference in rows {(out != ref).any(-1).nonzero().flatten().tolist()}"
    # and the bitmap holds exactly the reference's positions
    picks = ref_topk(scores, lens, k)
    got = unpack_bits(out, out.shape[1] * 32)
    for b in range(scores.shape[0]):
        assert set(got[b].nonzero().flatten().tolist()) == set(picks[b][picks[b] >= 0].tolist())
    return out


@pytest.mark.parametrize("n", [40, 300, 1024])
@pytest.mark.parametrize("k", [8, 64, 512])
def test_bits_distinct_scores(n, k, bits_chunk):
    """Continuous scores at lengths below, at and above k; n not a multiple of 32 (a partial last word)."""
    g = torch.Generator().manual_seed(n * 10 + k)
    scores = torch.randn(3, n, generator=g) * 10
    run_bits(scores, _lengths(3, n, k, g), k)


@pytest.mark.parametrize("k", [1, 8, 100, 333])
def test_bits_ties_and_special_values(k, bits_chunk):
    """The radix-select cases of `test_ties_and_special_values` (exact ties, all-equal rows, +-0.0, -inf inside
    the context, fewer finite keys than k, length 1): the tie cut takes the lowest positions."""
    g = torch.Generator().manual_seed(k)
    B, n = 7, 300
    scores = torch.randint(-3, 4, (B, n), generator=g).float() * 0.25
    scores[1] = 1.5
    scores[2] = -scores[2].abs() * 0.0
    scores[3, 10:200] = float("-inf")
    scores[4] = float("-inf")
    scores[4, ::37] = torch.arange(9, dtype=torch.float32)
    scores[5] = -7.0
    scores[5, 123] = -7.5
    lens = torch.tensor([300, 299, 257, 300, 300, 64, 1], dtype=torch.int32)
    run_bits(scores, lens, k)


def test_bits_strided_rows_wider_words_and_out_view(bits_chunk):
    """Row views with a larger stride; more words than the row needs (the bitmap's width is the group's
    Kmax, wider than a chunk's scores never is, but zeros must land there); `out` a row slice of a buffer."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 700, generator=g)
    scores = wide[:, 50:450]                                                   # [4, 400], row stride 700
    lens = torch.tensor([400, 17, 399, 64], dtype=torch.int32)
    run_bits(scores, lens, 64, words=16)                                       # 512 positions of bits
    buf = torch.full((6, 13), 7, dtype=torch.int32)
    T.topk_bits(scores, lens, 64, 13, out=buf[1:5])
    assert torch.equal(buf[1:5], ref_bits(scores, lens, 64, 13))
    assert bool((buf[0] == 7).all()) and bool((buf[5] == 7).all())             # rows outside the view untouched
