"""The Triton DSA lightning-indexer decode kernel (glm_ray/kernels/cuda/indexer.py) under TRITON_INTERPRET=1
on CPU, on tiny shapes, against `indexer_decode_reference`; and that reference against the engine's
`indexer_topk` (torch_ref/indexer.py) on a decode group built by `build_forward_batch`.

Data: queries and keys get a +1 offset so almost every head's dot is positive (no all-ReLU'd, exactly
zero scores) and scores are continuous: ties have probability ~0, so selected SETS must match exactly
(the comparison still tolerates exact-score ties, whose order is undefined). Scores: the kernel's
bf16-split dots equal the fp32 dot up to summation order and the interpreter's dots are fp32 numpy, so
|kernel - reference| <= 1e-5 * max |score| of the row (the reference is fp64, rounded once).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from glm_ray.forward_batch import build_forward_batch  # noqa: E402
from glm_ray.kernels.cuda import indexer as K  # noqa: E402
from glm_ray.kernels.cuda.indexer import (  # noqa: E402
    indexer_decode_reference,
    indexer_decode_scores,
    indexer_decode_topk,
    select_topk,
)
from glm_ray.kernels.torch_ref.indexer import indexer_topk  # noqa: E402
from glm_ray.kernels.torch_ref.topk import SelectionBits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HI, DI = 4, 16
LENS = [1, 9, 40]
REL = 1e-5


def _case(lens, block_size, *, qi_dtype=torch.float32, key_dtype=torch.bfloat16, spare_blocks=1, seed=0):
    """Decode batch with non-contiguous block tables: a random permutation of the cache's blocks (plus
    `spare_blocks` unused ones per sequence, so kmax = nb * block_size exceeds the longest context)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    nb = -(-max(lens) // block_size) + spare_blocks
    n_blocks = B * nb + 3                                                      # a few blocks nobody owns
    key_cache = (torch.randn(n_blocks * block_size, DI, generator=g) + 1).to(key_dtype)
    bt = torch.randperm(n_blocks, generator=g)[:B * nb].view(B, nb).to(torch.int32)   # [B, nb]
    cl = torch.tensor(lens, dtype=torch.int32)
    qi = (torch.randn(B, HI, DI, generator=g) + 1).to(qi_dtype)
    w = torch.randn(B, HI, generator=g)
    return [t.to(DEV) for t in (qi, w, key_cache, bt, cl)] + [nb * block_size]


def _assert_same_sets(idx, ref_idx, ref_scores, lens, k, rel):
    """Per sequence: the same set of positions (-1 excluded; exactly k - min(k, ctx) of them -1), up to
    positions whose reference score ties the k-th best within rel * max."""
    for b, n in enumerate(lens):
        got = set(idx[b][idx[b] >= 0].tolist())
        want = set(ref_idx[b][ref_idx[b] >= 0].tolist())
        assert len(got) == len(want) == min(k, n), (b, got, want)
        assert int((idx[b] == -1).sum()) == idx.shape[-1] - min(k, n)
        diff = got ^ want
        if diff:
            row = ref_scores[b, :n]
            kth = ref_scores[b, ref_idx[b, min(k, n) - 1]]
            assert bool(((row[list(diff)] - kth).abs() <= rel * row.abs().max()).all()), (b, sorted(diff))


def _check(qi, w, key_cache, bt, cl, kmax, block_size, topk, rel=REL):
    lens = cl.tolist()
    scores = indexer_decode_scores(qi, w, key_cache, bt, cl, block_size, kmax)
    idx = indexer_decode_topk(qi, w, key_cache, bt, cl, block_size, topk, kmax)
    ref_idx, ref = indexer_decode_reference(qi, w, key_cache, bt, cl, block_size, topk, kmax=kmax)
    k = min(topk, kmax)
    assert scores.shape == ref.shape == (len(lens), kmax) and scores.dtype == torch.float32
    assert idx.shape == ref_idx.shape == (len(lens), k) and idx.dtype == ref_idx.dtype == torch.int32
    fin = ref.isfinite()
    assert torch.equal(scores.isfinite(), fin) and bool((scores[~fin] == float("-inf")).all())
    for b, n in enumerate(lens):
        assert bool(fin[b, :n].all()) and not bool(fin[b, n:].any())
        scale = ref[b, :n].abs().max()
        torch.testing.assert_close(scores[b, :n], ref[b, :n], rtol=0, atol=float(rel * scale))
    _assert_same_sets(idx, ref_idx, ref, lens, k, rel)
    # the reference is sorted by descending score; -1 only after every real pick
    v = ref.gather(1, ref_idx.clamp(min=0).long()).masked_fill(ref_idx < 0, float("-inf"))
    assert bool((v[:, :-1] >= v[:, 1:]).all())


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("topk", [8, 64])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_scores_and_topk_match_reference(monkeypatch, block_size, topk, impl):
    """topk 8 < two contexts; 64 > every context (the -1 picks); kmax = capacity > max context; both
    top-k paths."""
    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    qi, w, key_cache, bt, cl, kmax = _case(LENS, block_size, seed=block_size + topk)
    _check(qi, w, key_cache, bt, cl, kmax, block_size, topk)
    _check(qi, w, key_cache, bt, cl, max(LENS), block_size, topk)             # kmax = max context exactly


@pytest.mark.parametrize("block_n,tiles", [(16, 2), (32, 3)])
def test_tiling_variants(monkeypatch, block_n, tiles):
    """Several tiles per program (the unrolled tile loop; tails masked inside a program) and BLOCK_N
    smaller than the block size."""
    monkeypatch.setattr(K, "BLOCK_N", block_n)
    monkeypatch.setattr(K, "TILES", tiles)
    _check(*_case(LENS, 16, seed=block_n), 16, 8)
    _check(*_case(LENS, 4, seed=tiles), 4, 64)


@pytest.mark.parametrize("qi_dtype,key_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_other_dtypes(qi_dtype, key_dtype):
    """bf16 query (one bf16 part) and fp32 keys (the ieee fp32 dot)."""
    _check(*_case(LENS, 4, qi_dtype=qi_dtype, key_dtype=key_dtype, seed=3), 4, 8)


def test_strided_key_cache_and_noncontiguous_inputs():
    """key_cache rows strided (a column slice of a wider cache), qi / w / block_table views."""
    qi, w, key_cache, bt, cl, kmax = _case(LENS, 4, seed=5)
    wide = torch.randn(key_cache.shape[0], 3 * DI, device=DEV).to(key_cache.dtype)
    wide[:, DI:2 * DI] = key_cache
    kc_view = wide[:, DI:2 * DI]                                               # [S, di], row stride 3 di
    qi_t = qi.transpose(1, 2).contiguous().transpose(1, 2)                     # [B, Hi, di], non-contiguous
    bt_wide = torch.zeros(bt.shape[0], bt.shape[1] + 5, dtype=torch.int32, device=DEV)
    bt_wide[:, :bt.shape[1]] = bt
    s_view = indexer_decode_scores(qi_t, w, kc_view, bt_wide[:, :bt.shape[1]], cl, 4, kmax)
    s = indexer_decode_scores(qi, w, key_cache, bt, cl, 4, kmax)
    assert torch.equal(s_view, s)
    _check(qi_t, w, kc_view, bt_wide, cl, kmax, 4, 8)                          # nb larger than needed


def test_reference_matches_engine_indexer_topk():
    """`indexer_decode_reference` selects the same positions as the engine's `indexer_topk` (padded group
    view + causal mask) on a decode step built by `build_forward_batch` (query_lens all 1)."""
    block_size, topk = 4, 8
    lens = [1, 9, 40, 23]
    qi, w, key_cache, bt, cl, kmax = _case(lens, block_size, seed=11)
    tables = [bt[b, :-(-n // block_size)].tolist() for b, n in enumerate(lens)]
    fb = build_forward_batch([1] * len(lens), lens, tables, block_size, torch.device(DEV))
    ref_idx, ref = indexer_decode_reference(qi, w, key_cache, bt, cl, block_size, topk)
    seen = set()
    for group in fb.groups:                                                    # decode buckets
        sel = indexer_topk(qi, w, key_cache, group, topk)                      # [Bg, 1, k]; qi rows = sequences
        for r, seq in enumerate(group.q_index[:, 0].tolist()):
            got = set(sel[r, 0][sel[r, 0] >= 0].tolist())
            want = set(ref_idx[seq][ref_idx[seq] >= 0].tolist())
            assert got == want, (seq, got, want)
            seen.add(seq)
    assert seen == set(range(len(lens)))
    # and the kernel agrees with both
    _assert_same_sets(indexer_decode_topk(qi, w, key_cache, bt, cl, block_size, topk, kmax),
                      ref_idx, ref, lens, topk, REL)


@pytest.mark.parametrize("impl,chunk", [("triton", 16), ("triton", 4096), ("torch", 0)])
def test_select_topk_with_ties(monkeypatch, impl, chunk):
    """Top-k on rows full of exact ties (small integers, +-0.0, negatives, -inf inside and after the
    context). Triton radix select: exactly the positions above the k-th value plus the first (lowest)
    positions equal to it, ascending, then -1s; several chunks per row (chunk 16) and one (4096).
    torch.topk: the same multiset of picked values (its tie order is its own), -1 for the -inf picks."""
    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    monkeypatch.setattr(K, "TOPK_CHUNK", chunk or K.TOPK_CHUNK)
    g = torch.Generator().manual_seed(chunk)
    B, kmax = 6, 70
    scores = torch.randint(-3, 4, (B, kmax), generator=g).float()
    scores[1] = -scores[1].abs() * 0.0                                         # -0.0 and +0.0 only
    scores[2, 5:9] = float("-inf")                                             # -inf inside the context
    lens = torch.tensor([70, 50, 33, 8, 9, 1], dtype=torch.int32)
    scores = scores.masked_fill(torch.arange(kmax) >= lens[:, None].long(), float("-inf"))
    for k in (1, 8, 9, 40, 70):
        out = select_topk(scores.to(DEV), lens.to(DEV), k).cpu()               # [B, k]
        assert out.shape == (B, k) and out.dtype == torch.int32
        for b, n in enumerate(lens.tolist()):
            row = scores[b, :n]
            fin = int(row.isfinite().sum())
            order = sorted(range(n), key=lambda t: (-row[t].item(), t))       # value desc, then position
            want = sorted(t for t in order[:k] if row[t].item() != float("-inf"))
            got = out[b].tolist()
            assert len(want) == min(k, fin)
            if impl == "triton":
                assert got == want + [-1] * (k - len(want)), (k, b, got, want)
            else:
                picked = [t for t in got if t >= 0]
                assert len(picked) == len(want) and len(set(picked)) == len(picked) and max(picked, default=0) < n
                assert sorted(row[picked].tolist()) == sorted(row[want].tolist()), (k, b, got, want)


def _prefill_case(query_lens, context_lens, block_size, seed):
    """A prefill step (several queries per sequence, some with a cached prefix) built by
    `build_forward_batch`, qi / w as rows of the whole step, keys at every sequence's slots."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in context_lens]
    perm = torch.randperm(sum(nbs) + 3, generator=g).tolist()                 # non-contiguous tables
    tables, at = [], 0
    for nb in nbs:
        tables.append(perm[at:at + nb])
        at += nb
    key_cache = (torch.randn((sum(nbs) + 3) * block_size, DI, generator=g) + 1).to(torch.bfloat16).to(DEV)
    T = sum(query_lens)
    qi = (torch.randn(T, HI, DI, generator=g) + 1).to(DEV)
    w = torch.randn(T, HI, generator=g).to(DEV)
    fb = build_forward_batch(query_lens, context_lens, tables, block_size, torch.device(DEV))
    return qi, w, key_cache, fb


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("max_bytes", [1 << 30, 256])
def test_prefill_rows_match_engine_indexer_topk(monkeypatch, impl, max_bytes):
    """`indexer_prefill_topk` == the torch reference `indexer_topk` on the prefill groups of a step: fresh
    prompts and chunks after a cached prefix, contexts below and above topk, -1 for queries with fewer
    causal keys than topk and for padded query slots; one chunk of rows, and many (max_bytes 256)."""
    monkeypatch.setattr(K, "TOPK_IMPL", impl)
    qi, w, key_cache, fb = _prefill_case([7, 12, 5, 1], [7, 30, 21, 40], 4, seed=7)
    topk = 9
    seen = 0
    for group in fb.groups:
        ref = indexer_topk(qi, w, key_cache, group, topk)                     # [B, Qmax, k]
        got = K.indexer_prefill_topk(qi, w, key_cache, group, topk, max_bytes=max_bytes)
        assert got.shape == ref.shape and got.dtype == torch.int32
        Qmax = group.q_index.shape[1]
        first = (group.context_lens - group.query_lens).tolist()
        for b in range(group.num_seqs):
            for i in range(Qmax):
                g_, r_ = got[b, i], ref[b, i]
                if not bool(group.q_valid[b, i]):
                    assert bool((g_ == -1).all())
                    continue
                n = first[b] + i + 1                                          # causal keys of the query
                gs, rs = set(g_[g_ >= 0].tolist()), set(r_[r_ >= 0].tolist())
                assert gs == rs and len(gs) == min(topk, n) and max(gs) < n, (b, i, gs, rs)
                seen += 1
    assert seen == 7 + 12 + 5 + 1 and len(fb.groups) >= 2          # every query once (the decode group too)


@pytest.mark.parametrize("max_bytes", [1 << 30, 256])
def test_prefill_bits_are_the_picks_of_the_index_path(max_bytes):
    """`bits=True` (the naive-form prefill's selection, `SelectionBits`: one bitmap row per packed query,
    written by `topk_bits` from the same scores) holds exactly the positions the index path returns; one
    chunk of rows and many; words past a row's causal keys stay 0."""
    qi, w, key_cache, fb = _prefill_case([7, 12, 5, 1], [7, 30, 21, 40], 4, seed=7)
    topk = 9
    for group in fb.groups:
        idx = K.indexer_prefill_topk(qi, w, key_cache, group, topk, max_bytes=max_bytes)   # [B, Qmax, k]
        sel = K.indexer_prefill_topk(qi, w, key_cache, group, topk, max_bytes=max_bytes, bits=True)
        assert isinstance(sel, SelectionBits)
        want = SelectionBits.from_indices(idx, group).bits
        assert sel.bits.shape == want.shape and torch.equal(sel.bits, want)


@pytest.mark.parametrize("query_lens,context_lens", [([12], [30]), ([7, 12, 5], [7, 30, 21])],
                         ids=["one-sequence", "padded"])
def test_prefill_plan_is_shared_by_the_layers(query_lens, context_lens):
    """The group's row bookkeeping is built by the first call and reused: a second layer's queries on the
    same group (other qi / w, same metadata) still match the reference; one plan per (topk, rows)."""
    qi, w, key_cache, fb = _prefill_case(query_lens, context_lens, 4, seed=3)
    group = next(g for g in fb.groups if g.q_index.shape[1] > 1)
    g2 = torch.Generator().manual_seed(4)
    layers = [(qi, w), ((torch.randn(qi.shape, generator=g2) + 1).to(DEV), torch.randn(w.shape, generator=g2).to(DEV))]
    for lqi, lw in layers:
        ref = indexer_topk(lqi, lw, key_cache, group, 9)
        got = K.indexer_prefill_topk(lqi, lw, key_cache, group, 9, max_bytes=1 << 30)
        Qmax = group.q_index.shape[1]
        for b in range(group.num_seqs):
            for i in range(Qmax):
                g_, r_ = got[b, i], ref[b, i]
                assert set(g_[g_ >= 0].tolist()) == set(r_[r_ >= 0].tolist()), (b, i)
                if not bool(group.q_valid[b, i]):
                    assert bool((g_ == -1).all())
    key = ("indexer_prefill", 9, (1 << 30) // (group.max_context_len * 4))
    assert list(group._plans) == [key]
    assert group._plans[key].dense == (len(query_lens) == 1)


@pytest.mark.parametrize("query_lens,context_lens", [([150, 3, 70], [150, 40, 200]), ([65], [65])])
def test_prefill_tiles_score_like_one_row_per_query(monkeypatch, query_lens, context_lens):
    """The tiled prefill scores == the decode kernel run with one row per query (its sequence's table, its
    causal length): sequences of more rows than a tile (several tiles each, a partial last one), a chunk
    after a cached prefix, tiles whose keys lie wholly past their rows (-inf); fp32 summation order aside."""
    monkeypatch.setattr(K, "PREFILL_BLOCK_M", 32)
    monkeypatch.setattr(K, "PREFILL_BLOCK_N", 32)
    qi, w, key_cache, fb = _prefill_case(query_lens, context_lens, 8, seed=11)
    group = next(g for g in fb.groups if g.q_index.shape[1] > 1)
    ql, cl = group.query_lens.long(), group.context_lens.long()
    start = torch.cumsum(ql, 0) - ql
    q, ww = qi[group.token_index], w[group.token_index]
    kmax = group.max_context_len
    got = K.indexer_prefill_scores(q, ww, key_cache, group.block_table.contiguous(), start.to(torch.int32),
                                   ql.to(torch.int32), (cl - ql).to(torch.int32), kmax, group.block_size)
    seq = group.packed // group.q_index.shape[1]
    lens = ((cl - ql)[seq] + group.packed % group.q_index.shape[1] + 1).to(torch.int32)
    want = K.indexer_decode_scores(q, ww, key_cache, group.block_table[seq], lens, group.block_size, kmax)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_prefill_selection_form_policy(monkeypatch):
    """Which prefill groups the cuda indexer hands a bitmap (`ops.prefill_selection_bits`): naive-form groups with
    the radix top-k and Kmax <= BITS_MAX_KEYS; an absorbed group (its decode kernel reads indices), the torch
    top-k, a wider context or the switch off keep the index list."""
    from glm_ray.kernels.cuda import ops
    monkeypatch.setattr(K, "TOPK_IMPL", "triton")
    naive = build_forward_batch([12, 5], [30, 21], [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]], 4,
                                torch.device(DEV), mla_mode="naive").groups
    absorbed = build_forward_batch([12, 5], [30, 21], [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]], 4,
                                   torch.device(DEV), mla_mode="absorbed").groups
    assert all(ops.prefill_selection_bits(g) for g in naive)
    assert not any(ops.prefill_selection_bits(g) for g in absorbed)
    monkeypatch.setattr(K.radix_topk, "BITS_MAX_KEYS", 16)                     # Kmax 30 / 21 > 16
    assert not any(ops.prefill_selection_bits(g) for g in naive)
    monkeypatch.setattr(K.radix_topk, "BITS_MAX_KEYS", 16384)
    monkeypatch.setattr(ops, "PREFILL_BITS", False)
    assert not any(ops.prefill_selection_bits(g) for g in naive)
    monkeypatch.setattr(ops, "PREFILL_BITS", True)
    monkeypatch.setattr(K, "TOPK_IMPL", "torch")
    assert not any(ops.prefill_selection_bits(g) for g in naive)
