"""`build_forward_batch` splits a step into a decode group (absorbed MLA) and a prefill group (naive
MLA), each padded only to its own lengths; together the groups cover every packed token once."""
from __future__ import annotations

import torch

from glm_ray.forward_batch import build_forward_batch, contiguous_block_tables


def _tables(context_lens, bs):
    return contiguous_block_tables(context_lens, bs)


def test_mixed_step_splits_into_decode_and_prefill_groups():
    bs = 16
    qlens = [1, 700, 1, 1, 5]                       # decodes interleaved with two prefill chunks
    clens = [40, 700, 90, 17, 300]
    b = build_forward_batch(qlens, clens, _tables(clens, bs), bs, torch.device("cpu"))
    dec, pre = b.groups
    assert (dec.mla_mode, pre.mla_mode) == ("absorbed", "naive")
    assert dec.q_index.shape == (3, 1) and dec.max_context_len == 90
    assert pre.q_index.shape == (2, 700) and pre.max_context_len == 700
    # the decode rows of T are the three 1-token sequences, the prefill rows the rest, each exactly once
    starts = [0, 1, 701, 702, 703]
    assert sorted(dec.token_index.tolist()) == [starts[0], starts[2], starts[3]]
    assert sorted(torch.cat([dec.token_index, pre.token_index]).tolist()) == list(range(sum(qlens)))
    # a decode token sees its whole context; the prefill chunk of seq 4 starts at position 295
    row = dec.token_index.tolist().index(starts[2])
    assert dec.causal[row, 0].sum() == 90 and pre.causal[1, 0].sum() == 296
    assert b.positions[starts[4]] == 295 and b.positions[starts[2]] == 89
    # padding shrinks from [5, 700, 700] (one view for the step) to [3, 1, 90] + [2, 700, 700]
    assert dec.causal.numel() + pre.causal.numel() < 0.41 * 5 * 700 * 700


def test_forced_mode_and_single_group():
    bs = 4
    b = build_forward_batch([1, 1], [5, 9], _tables([5, 9], bs), bs, torch.device("cpu"), mla_mode="naive")
    (g,) = b.groups
    assert g.mla_mode == "naive" and g.q_index.shape == (2, 1)
    b = build_forward_batch([3, 1], [3, 9], _tables([3, 9], bs), bs, torch.device("cpu"), mla_mode="absorbed")
    assert [g.mla_mode for g in b.groups] == ["absorbed", "absorbed"]
    # slot of position p of a sequence = block_table[p // bs] * bs + p % bs
    tables = _tables([3, 9], bs)
    assert b.slot_mapping.tolist() == [tables[0][0] * bs + p for p in range(3)] + [tables[1][2] * bs + 0]


def test_prefill_groups_bound_padding():
    bs = 16
    qlens = [8000] + [3] * 60 + [1] * 3
    clens = [8000] + [3] * 60 + [500] * 3
    b = build_forward_batch(qlens, clens, _tables(clens, bs), bs, torch.device("cpu"))
    dec, *pre = b.groups
    assert dec.q_index.shape == (3, 1)
    assert sorted(torch.cat([g.token_index for g in b.groups]).tolist()) == list(range(sum(qlens)))
    for g in pre:
        real_q = int(g.q_valid.sum())
        real_k = sum(clens[i] for i in range(len(qlens)) if qlens[i] > 1 and starts_of(qlens)[i] in set(g.q_index[:, 0].tolist()))
        assert g.q_valid.numel() <= 2 * real_q and g.kv_slots.numel() <= 2 * real_k
    padded = sum(g.q_valid.numel() for g in b.groups)
    assert padded <= 2 * sum(qlens)                   # one [61, 8000] view would be 61x


def starts_of(qlens):
    out, s = [], 0
    for q in qlens:
        out.append(s)
        s += q
    return out


def test_decode_groups_bound_context_padding():
    """63 short decodes next to one 4000-token context: not one [64, 4000] view."""
    bs = 16
    qlens = [1] * 64
    clens = [4000] + [30 + i for i in range(63)]
    b = build_forward_batch(qlens, clens, _tables(clens, bs), bs, torch.device("cpu"))
    assert all(g.mla_mode == "absorbed" for g in b.groups) and len(b.groups) >= 2
    assert sorted(torch.cat([g.token_index for g in b.groups]).tolist()) == list(range(64))
    assert sum(g.kv_slots.numel() for g in b.groups) <= 2 * sum(clens)
    # homogeneous decodes stay one group
    b = build_forward_batch([1] * 8, [500 + i for i in range(8)], _tables([500 + i for i in range(8)], bs), bs,
                            torch.device("cpu"))
    assert len(b.groups) == 1


def test_rows_of_slices_a_row_span_and_gathers_otherwise():
    from dataclasses import replace
    b = build_forward_batch([1, 2, 1, 1], [5, 2, 9, 3], [[0, 1], [6], [2, 3, 4], [5]], 4, torch.device("cpu"))
    g = b.groups[0]                                         # the decodes, rows 0, 3, 4: around a prompt's rows
    x = torch.arange(5 * 2.0).view(5, 2)
    assert g.row_span is None and g.q_index[:, 0].tolist() == [0, 3, 4]
    assert torch.equal(g.rows_of(x), x[[0, 3, 4]])
    span = replace(g, q_index=torch.arange(3)[:, None], row_span=(0, 3))
    assert torch.equal(span.rows_of(x), x[:3]) and span.rows_of(x).data_ptr() == x.data_ptr()   # a view


def _oracle(qlens, clens, tables, bs):
    """Per token, in plain Python: (position, slot) of every packed row; per sequence its rows of T."""
    pos, slot, rows, t = [], [], [], 0
    for q, c, tab in zip(qlens, clens, tables):
        rows.append(list(range(t, t + q)))
        t += q
        for p in range(c - q, c):
            pos.append(p)
            slot.append(tab[p // bs] * bs + p % bs)
    return pos, slot, rows


def test_batch_matches_a_per_token_oracle():
    """Random mixed steps (decodes, fresh prompts, chunks after a cached prefix, scattered block tables):
    every field equals a per-token Python construction; dtypes as the kernels read them."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        bs = [4, 16, 64][trial % 3]
        B = int(torch.randint(1, 12, (1,), generator=g))
        qlens, clens = [], []
        for _ in range(B):
            kind = int(torch.randint(0, 3, (1,), generator=g))
            q = 1 if kind == 0 else int(torch.randint(2, 300, (1,), generator=g))
            cached = 0 if kind == 1 else int(torch.randint(0, 500, (1,), generator=g))
            qlens.append(q)
            clens.append(cached + q if kind != 0 else max(cached, 1))
        nblk = [-(-c // bs) + int(torch.randint(0, 3, (1,), generator=g)) for c in clens]   # spare blocks too
        perm = torch.randperm(sum(nblk), generator=g).tolist()
        tables, k = [], 0
        for n in nblk:
            tables.append(perm[k:k + n])
            k += n
        slots = torch.randperm(64, generator=g)[:B].tolist()
        b = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"), state_slots=slots)
        pos, slot, rows = _oracle(qlens, clens, tables, bs)
        assert b.positions.tolist() == pos and b.slot_mapping.tolist() == slot
        assert b.positions.dtype == b.slot_mapping.dtype == torch.int64
        assert b.max_context_len == max(clens)
        seen = []
        for grp in b.groups:
            seqs = [rows.index([r for r in rows if r and r[0] == int(grp.q_index[i, 0])][0])
                    for i in range(grp.num_seqs)]
            assert grp.token_index.tolist() == [r for s in seqs for r in rows[s]]
            assert grp.query_lens.tolist() == [qlens[s] for s in seqs]
            assert grp.context_lens.tolist() == [clens[s] for s in seqs]
            assert grp.state_slots.tolist() == [slots[s] for s in seqs]
            assert grp.state_fresh.tolist() == [clens[s] == qlens[s] for s in seqs]
            assert grp.max_context_len == max(clens[s] for s in seqs)
            for i, s in enumerate(seqs):
                assert grp.block_table[i, :len(tables[s])].tolist() == tables[s]
                assert not grp.block_table[i, len(tables[s]):].any()
                assert grp.q_valid[i].tolist() == [j < qlens[s] for j in range(grp.q_valid.shape[1])]
            assert torch.equal(grp.q_index.flatten()[grp.packed], grp.token_index)
            assert (grp.q_index[~grp.q_valid] == 0).all()
            assert [grp.token_index.dtype, grp.q_index.dtype, grp.packed.dtype, grp.q_valid.dtype,
                    grp.block_table.dtype, grp.context_lens.dtype, grp.query_lens.dtype] == \
                [torch.int64, torch.int64, torch.int64, torch.bool, torch.int32, torch.int32, torch.int32]
            span = grp.row_span
            ti = grp.token_index.tolist()
            assert span == ((ti[0], ti[-1] + 1) if ti == list(range(ti[0], ti[0] + len(ti))) else None)
            seen += ti
        assert sorted(seen) == list(range(sum(qlens)))


def test_stage_packs_every_array_into_one_buffer():
    """`stage`: one host buffer (so one copy to a device), each array viewed back with its dtype and
    shape, empty arrays included."""
    import numpy as np

    from glm_ray.staging import ALIGN, stage
    arrays = [np.arange(5, dtype=np.int64), np.array([[True, False, True]]), np.arange(7, dtype=np.int32) - 3,
              np.zeros((2, 0), dtype=np.int64), np.array([2**40, -1], dtype=np.int64)]
    out = stage(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype and (t.numpy() == a).all()
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    base = out[0].untyped_storage().data_ptr()                   # (a device buffer's base is allocator-aligned)
    assert all((t.data_ptr() - base) % ALIGN == 0 for t in out if t.numel())


def test_short_chunks_over_a_cached_context_become_one_query_rows():
    """GLM_RAY_ABSORB_PREFILL_TOKENS: a chunk of <= absorb_tokens tokens over at least as many cached ones joins
    the decode group, one row per token, each row's context its own causal prefix through its sequence's block
    table; a fresh prompt and a longer chunk stay naive prefill groups; forced modes never absorb."""
    bs = 16
    qlens = [1, 6, 40, 5, 300]                      # decode | tail over 90 cached | fresh | tail of 5 over 3 | long
    clens = [33, 96, 40, 8, 700]
    tables = _tables(clens, bs)
    b = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"), absorb_tokens=256)
    dec, *pre = b.groups
    assert dec.mla_mode == "absorbed" and dec.q_index.shape == (7, 1)            # the decode + 6 rows of seq 1
    assert sorted(dec.token_index.tolist()) == [0, 1, 2, 3, 4, 5, 6]
    assert [g.mla_mode for g in pre] == ["naive"] * len(pre)
    assert sorted(torch.cat([g.token_index for g in b.groups]).tolist()) == list(range(sum(qlens)))
    assert sorted(q for g in pre for q in g.query_lens.tolist()) == [5, 40, 300]   # 5 new over 3 cached: naive
    ctx = dict(zip(dec.token_index.tolist(), dec.context_lens.tolist()))
    assert ctx == {0: 33, 1: 91, 2: 92, 3: 93, 4: 94, 5: 95, 6: 96}              # token i of the tail: 90 + i + 1
    for row, t in enumerate(dec.token_index.tolist()):
        want = tables[0] if t == 0 else tables[1]
        assert dec.block_table[row, :len(want)].tolist() == want
        assert int(dec.causal[row, 0].sum()) == ctx[t]                         # attends to its causal prefix
        assert int(b.positions[t]) == ctx[t] - 1
    # the same rows without absorbing: one decode + two prefill buckets' worth of the same tokens
    plain = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"))
    assert plain.groups[0].q_index.shape == (1, 1)
    assert torch.equal(plain.slot_mapping, b.slot_mapping) and torch.equal(plain.positions, b.positions)
    forced = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"), mla_mode="naive", absorb_tokens=256)
    assert forced.groups[0].q_index.shape == (1, 1)


def test_a_cached_tail_beside_decodes_is_one_slice_of_the_step():
    """Decodes then a cached request's tail (the scheduler's order): the absorbed group's rows are T[0:B+q] in
    order, so its per-row gathers and scatters are slices (`row_span`)."""
    bs = 16
    qlens, clens = [1, 1, 1, 8], [120, 110, 105, 100]
    b = build_forward_batch(qlens, clens, _tables(clens, bs), bs, torch.device("cpu"), absorb_tokens=256)
    (g,) = b.groups
    assert g.row_span == (0, 11) and g.token_index.tolist() == list(range(11))
    assert g.context_lens.tolist() == [120, 110, 105] + list(range(93, 101))


def test_absorbed_rows_keep_the_index_scores_bounded(monkeypatch):
    """Absorbed rows score their whole contexts in the decode indexer ([rows, max context] fp32): chunks join the
    decode group only while that stays within ABSORB_SCORE_BYTES; the rest stay naive prefill chunks."""
    import glm_ray.forward_batch as fb
    bs = 16
    qlens, clens = [1, 100, 100, 100], [400, 1000, 1000, 1000]
    monkeypatch.setattr(fb, "ABSORB_SCORE_BYTES", 201 * 1000 * 4)            # the decode + two tails fit
    b = build_forward_batch(qlens, clens, _tables(clens, bs), bs, torch.device("cpu"), absorb_tokens=256)
    dec, *pre = b.groups
    assert dec.q_index.shape == (201, 1) and [g.query_lens.tolist() for g in pre] == [[100]]
    assert sorted(torch.cat([g.token_index for g in b.groups]).tolist()) == list(range(301))
