"""The Triton absorbed MLA over runs of one sequence's rows (`glm_ray.kernels.cuda.mla_rows`) under
TRITON_INTERPRET=1 on CPU, against `mla_decode_reference` (fp32, per row), and on a group built by
`build_forward_batch` (a cached chunk's tail absorbed beside decodes) against the engine's torch reference.

Tiny shapes: r = 32, dr = 16, h = 4 / 5 (a 16-head tile: 4 rows per program) and 12 (2 rows per program); runs
of 1-9 rows beside single rows, shuffled block tables whose unused entries point at other runs' blocks; DSA
indices with K above the contexts (every multi-row tile walks its context under its rows' bitmaps), K well below
them (row-by-row index walks), and split counts with empty splits. fp32 inputs: rel err <= 1e-5.
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
from glm_ray.kernels.cuda import mla_decode as md  # noqa: E402
from glm_ray.kernels.cuda import mla_rows as mr  # noqa: E402
from glm_ray.kernels.torch_ref import attention  # noqa: E402

R, DR = 32, 16
D = R + DR
SCALE = D ** -0.5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_runs(h: int, block_size: int, runs: list[tuple[int, int]], *, seed: int = 0):
    """runs: (cached prefix, rows) per sequence; row i of a run has context prefix + i + 1. Returns q [B, h, D]
    (row-strided), kv_cache, block_table [B, nb] (a run's rows share their sequence's table), context_lens [B],
    run_first [B], run_lens."""
    g = torch.Generator().manual_seed(seed)
    S = len(runs)
    nb = max(-(-(p + n) // block_size) for p, n in runs) + 1
    perm = torch.randperm(S * nb + 2, generator=g)[:S * nb].view(S, nb).int()
    tables, ctx, first = [], [], []
    for s, (p, n) in enumerate(runs):                                          # test setup, per sequence
        used = -(-(p + n) // block_size)
        t = torch.cat([perm[s, :used], perm[(s + 1) % S, :nb - used]])         # unused entries: another's blocks
        tables += [t] * n
        ctx += [p + i + 1 for i in range(n)]
        first += [len(first)] * n
    kv_cache = torch.randn((S * nb + 2) * block_size, D, generator=g)
    B = len(ctx)
    q = torch.randn(B, h, D + 8, generator=g)[..., :D]                         # row stride D + 8
    return (q, kv_cache, torch.stack(tables), torch.tensor(ctx, dtype=torch.int32),
            torch.tensor(first, dtype=torch.int32), tuple(n for _, n in runs))


def make_indices(ctx: torch.Tensor, K: int, *, seed: int = 1) -> torch.Tensor:
    """[B, K] int32: about 3/4 of each row's positions (at most K), unsorted, -1 elsewhere at random places."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((ctx.shape[0], K), -1, dtype=torch.int32)
    for b, n in enumerate(ctx.tolist()):                                       # test setup, per row
        k = max(1, min(K, (3 * n + 3) // 4))
        out[b, torch.randperm(K, generator=g)[:k]] = torch.randperm(n, generator=g)[:k].int()
    return out


def check(case, block_size, indices=None, **kw):
    q, kv, bt, cl, first, lens = case
    out = mr.mla_decode_runs(q, kv, bt, cl, block_size, first, lens, int(cl.max()), kv_lora_rank=R, scale=SCALE,
                             indices=indices, **kw)
    ref = md.mla_decode_reference(q, kv, bt, cl, block_size, kv_lora_rank=R, scale=SCALE, indices=indices)
    assert out.shape == ref.shape
    errs = [rel_err(out[b], ref[b]) for b in range(q.shape[0])]
    assert max(errs) <= 1e-5, errs


RUNS = [(20, 9), (0, 1), (5, 3), (40, 1), (11, 6)]    # runs of 9 / 3 / 6 rows beside single decode rows


@pytest.mark.parametrize("h", [4, 12])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_dense_runs(h, block_size, splits):
    """No DSA: each row attends to its own causal context; tiles of 4 (h = 4) or 2 (h = 12) rows, the last of a
    run partial; 3 splits leave some splits of the short rows empty."""
    assert mr.rows_per_tile(h, D) == (4 if h <= 16 else 2)
    check(make_runs(h, block_size, RUNS), block_size, num_splits=splits)


@pytest.mark.parametrize("K", [64, 8])
@pytest.mark.parametrize("splits", [None, 2])
def test_sparse_runs(K, splits):
    """DSA picks: K = 64 >= every context/2 (multi-row tiles walk their context under the bitmaps; single rows
    walk their indices), K = 8 (contexts past 2K: every tile walks its rows' index lists in turn)."""
    case = make_runs(5, 4, RUNS, seed=3)
    check(case, 4, make_indices(case[3], K), num_splits=splits)


def test_index_bits():
    idx = torch.tensor([[3, -1, 0, 33, 31], [-1, -1, -1, -1, -1], [64, 2, 2, 5, 70]], dtype=torch.int32)
    bits = mr.index_bits(idx, 3)                                               # positions < 96
    want = torch.zeros(3, 96, dtype=torch.bool)
    for b, row in enumerate(idx.tolist()):
        for p in row:
            if 0 <= p < 96:
                want[b, p] = True
    got = ((bits[:, :, None] >> torch.arange(32)) & 1).bool().view(3, 96)
    assert torch.equal(got, want)


def test_group_runs_from_forward_batch():
    """A step with a cached chunk's 5-token tail absorbed beside two decodes: the group's run metadata, and the
    kernel on the group == the engine's torch reference."""
    bs = 4
    query_lens, context_lens = [1, 5, 1], [9, 17, 3]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7], [8]]
    fb = build_forward_batch(query_lens, context_lens, tables, bs, "cpu", absorb_tokens=8)
    (group,) = fb.groups
    assert group.mla_mode == "absorbed" and sorted(group.run_lens) == [1, 1, 5]
    first, cl = group.run_first.tolist(), group.context_lens.tolist()
    assert len(set(first)) == 3 and all(first[i] <= i and cl[i] == cl[first[i]] + i - first[i] for i in range(7))
    assert [cl[i] for i in range(7) if first.count(first[i]) == 5] == [13, 14, 15, 16, 17]   # the tail's contexts
    g = torch.Generator().manual_seed(7)
    h = 4
    q = torch.randn(fb.num_tokens, h, D, generator=g)                          # [T, h, D]
    kv = torch.randn(9 * bs, D, generator=g)
    out = mr.mla_decode_runs(group.rows_of(q), kv, group.block_table, group.context_lens, bs, group.run_first,
                             group.run_lens, group.max_context_len, kv_lora_rank=R, scale=SCALE)
    ref = attention.mla_decode(q, kv, group, None, kv_lora_rank=R, scale=SCALE)
    ref = ref if ref.shape[0] == group.num_seqs else group.rows_of(ref)
    assert rel_err(out, ref) <= 1e-5


def test_decode_only_groups_have_no_runs():
    fb = build_forward_batch([1, 1, 1], [5, 9, 2], [[0, 1], [2, 3, 4], [5]], 4, "cpu", absorb_tokens=8)
    assert all(g.run_first is None and g.run_lens is None for g in fb.groups)


@pytest.mark.parametrize("sparse", [False, True])
def test_bench_tails_case(sparse):
    """`bench.attention --mode tails`' case (GLM-5's r = 512, dr = 64; a small prefix, K = 2048 picks of contexts
    below it): its run metadata is what the kernel expects, and both kernels agree with the oracle on it."""
    from glm_ray.bench import attention as ba
    q, kv, bt, cl, first, lens, idx = ba._tails_case(4, 2, 5, 40, 2, 16, sparse, torch.Generator().manual_seed(0),
                                                     dev="cpu")
    q, kv = q.float(), kv.float()
    assert lens == (5, 5, 1, 1) and first.tolist() == [0] * 5 + [5] * 5 + [10, 11]
    assert cl.tolist() == [41, 42, 43, 44, 45] * 2 + [45, 45]
    args = (q, kv, bt, cl, 16)
    kw = dict(kv_lora_rank=ba.R, scale=0.1, indices=idx)
    ref = md.mla_decode_reference(*args, **kw)
    assert rel_err(md.mla_decode_paged(*args, **kw), ref) <= 1e-5
    assert rel_err(mr.mla_decode_runs(*args, first, lens, 45, **kw), ref) <= 1e-5
