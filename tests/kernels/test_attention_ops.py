"""The attention kernel ops of the torch backend (`kernels.ops()`: mla_prefill, mla_decode, indexer_topk,
indexer_kpool_topk) on small random inputs, against independent formulations written per sequence and
per query: plain softmax attention over the expanded K/V for both MLA forms (so absorbed == naive on
the same latents), the key-chunked online-softmax path == the one-shot path, and brute-force top-k
selections (positive scores: no ties) for both indexers, tiled or not."""
from __future__ import annotations

import pytest
import torch

from glm_ray import kernels
from glm_ray.forward_batch import build_forward_batch
from glm_ray.kernels.torch_ref.indexer import selection_mask

BS = 4                                                   # block size
# (query_lens, context_lens): decodes, a continued chunk, fresh prompts -> decode + prefill groups
STEP = ([1, 1, 6, 9, 1], [23, 5, 17, 9, 40])


@pytest.fixture(autouse=True)
def torch_backend():
    ops = kernels.init_backend("torch")
    yield ops


def _step(query_lens, context_lens, mla_mode="auto"):
    """A step over interleaved block tables; per row of T: (sequence, position); per sequence: slots."""
    B = len(query_lens)
    nb = [-(-c // BS) for c in context_lens]
    tables = [[i + B * j for j in range(n)] for i, n in enumerate(nb)]
    batch = build_forward_batch(query_lens, context_lens, tables, BS, torch.device("cpu"), mla_mode=mla_mode)
    rows = [(i, c - q + j) for i, (q, c) in enumerate(zip(query_lens, context_lens)) for j in range(q)]
    slots = [torch.tensor([t[p // BS] * BS + p % BS for p in range(c)]) for t, c in zip(tables, context_lens)]
    return batch, rows, slots, B * max(nb) * BS


def _selection_table(context_lens, seed):
    """Per sequence a random causal selection [ctx, ctx] that keeps the diagonal (no empty row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in context_lens:
        s = (torch.rand(c, c, generator=g) < 0.5).tril()
        s.diagonal().fill_(True)
        out.append(s)
    return out


def _group_selection(group, rows, table):
    sel = torch.zeros_like(group.causal)
    for b, j in group.q_valid.nonzero().tolist():
        seq, pos = rows[int(group.q_index[b, j])]
        sel[b, j, :pos + 1] = table[seq][pos, :pos + 1]
    return sel & group.causal


def _mla_inputs(dr, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h, dn, dv, r = 3, 8, 6, 16
    batch, rows, slots, S = _step(*STEP)
    T = len(rows)
    q_nope = torch.randn(T, h, dn, generator=g, dtype=dtype)
    q_pe = torch.randn(T, h, dr, generator=g, dtype=dtype)
    cache = torch.randn(S, r + dr, generator=g, dtype=dtype)
    w = torch.randn(h * (dn + dv), r, generator=g, dtype=dtype) * r ** -0.5       # kv_b_proj weight
    return dict(h=h, dn=dn, dv=dv, r=r, dr=dr, batch=batch, rows=rows, slots=slots, q_nope=q_nope, q_pe=q_pe,
                cache=cache, w=w, scale=(dn + dr) ** -0.5)


def _mla_loop(m, table=None):
    """Independent formulation: per row, softmax attention over its expanded context (per head)."""
    h, dn, dv, r = m["h"], m["dn"], m["dv"], m["r"]
    out = torch.empty(len(m["rows"]), h, dv, dtype=m["cache"].dtype)
    for t, (seq, pos) in enumerate(m["rows"]):
        c = m["cache"][m["slots"][seq][:pos + 1]]                                  # [n, r+dr]
        kv = (c[:, :r] @ m["w"].T).view(-1, h, dn + dv)                            # [n, h, dn+dv]
        k = torch.cat([kv[..., :dn], c[:, None, r:].expand(-1, h, m["dr"])], -1)  # [n, h, dn+dr]
        q = torch.cat([m["q_nope"][t], m["q_pe"][t]], -1)                          # [h, dn+dr]
        s = torch.einsum("hd,nhd->hn", q, k) * m["scale"]
        if table is not None:
            s = s.masked_fill(~table[seq][pos, :pos + 1], float("-inf"))
        out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), kv[..., dn:])
    return out


def _mla_ops(m, form, selections=None, max_bytes=1 << 30):
    """The layer's use of the ops (glm_ray/layers/mla.py), every group in `form`."""
    ops = kernels.ops()
    h, dn, dv, r = m["h"], m["dn"], m["dv"], m["r"]
    w_kc = m["w"].view(h, dn + dv, r)[:, :dn]                                      # [h, dn, r]
    w_vc = m["w"].view(h, dn + dv, r)[:, dn:].transpose(1, 2)                      # [h, r, dv]
    out = torch.empty(len(m["rows"]), h, dv, dtype=m["cache"].dtype)
    for gi, g in enumerate(m["batch"].groups):
        sel = None if selections is None else selections[gi]
        if form == "naive":
            o = ops.mla_prefill(torch.cat([m["q_nope"], m["q_pe"]], -1), m["cache"], g, sel,
                                lambda c: c @ m["w"].T, kv_lora_rank=r, v_head_dim=dv, scale=m["scale"],
                                max_bytes=max_bytes)
        else:
            q_lat = torch.bmm(m["q_nope"].transpose(0, 1), w_kc).transpose(0, 1)     # [T, h, r]
            o_lat = ops.mla_decode(torch.cat([q_lat, m["q_pe"]], -1), m["cache"], g, sel, kv_lora_rank=r,
                                   scale=m["scale"], max_bytes=max_bytes)
            assert o_lat.shape == (g.token_index.shape[0], h, r)
            o = torch.bmm(o_lat.transpose(0, 1), w_vc).transpose(0, 1)
        assert o.shape == (g.token_index.shape[0], h, dv)
        out.index_copy_(0, g.token_index, o)
    return out


@pytest.mark.parametrize("dr", [4, 0], ids=["rope", "nope"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "selection"])
@pytest.mark.parametrize("max_bytes", [1 << 30, 1], ids=["one-shot", "key-chunks"])
@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_mla_ops_match_per_row_attention(form, max_bytes, sparse, dr):
    m = _mla_inputs(dr)
    assert {g.mla_mode for g in m["batch"].groups} == {"naive", "absorbed"}   # both kinds of group
    table = _selection_table(STEP[1], seed=1) if sparse else None
    sels = [_group_selection(g, m["rows"], table) for g in m["batch"].groups] if sparse else None
    # the key-chunked path accumulates in fp32 (the one-shot path stays in the fp64 of these inputs)
    tol = {} if max_bytes > 1 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_mla_ops(m, form, sels, max_bytes), _mla_loop(m, table), **tol)


def test_mla_decode_equals_mla_prefill_on_the_same_latents():
    """The absorbed form (W_UK folded into the query, W_UV into the output) is the naive form."""
    m = _mla_inputs(4, seed=3)
    torch.testing.assert_close(_mla_ops(m, "absorbed"), _mla_ops(m, "naive"))


def test_selection_none_is_dense_causal():
    m = _mla_inputs(4, seed=4)
    causal = [g.causal for g in m["batch"].groups]
    for form in ("naive", "absorbed"):
        assert torch.equal(_mla_ops(m, form, causal), _mla_ops(m, form, None))


# --------------------------------------------------------------------------------------- indexers

def _index_inputs(cache_dim, seed):
    """Positive queries, weights and keys: every score is > 0 and ties have probability 0."""
    g = torch.Generator().manual_seed(seed)
    Hi, di = 4, 8
    batch, rows, slots, S = _step(*STEP)
    T = len(rows)
    qi = torch.rand(T, Hi, di, generator=g)
    w = torch.rand(T, Hi, generator=g) + 0.1
    cache = torch.rand(S, cache_dim, generator=g)
    return batch, rows, slots, qi, w, cache


def _score(qi_t, w_t, keys):
    """sum_h w[h] * relu(qi[h] . k * di^-0.5) for keys [n, di] -> [n]."""
    return ((qi_t @ keys.T) * qi_t.shape[-1] ** -0.5).relu().mul(w_t[:, None]).sum(0)


@pytest.mark.parametrize("max_bytes", [256 << 20, 1], ids=["one-tile", "tiled"])
@pytest.mark.parametrize("topk", [5, 64])
def test_indexer_topk_is_the_brute_force_top_k(topk, max_bytes):
    batch, rows, slots, qi, w, cache = _index_inputs(8, seed=5)
    for g in batch.groups:
        idx = kernels.ops().indexer_topk(qi, w, cache, g, topk, max_bytes=max_bytes)
        K = g.causal.shape[-1]
        assert idx.shape == (*g.causal.shape[:2], min(topk, K)) and idx.dtype == torch.int32
        for b, j in g.q_valid.nonzero().tolist():
            t = int(g.q_index[b, j])
            seq, pos = rows[t]
            s = _score(qi[t], w[t], cache[slots[seq][:pos + 1]])                      # [pos+1]
            want = set(s.topk(min(topk, pos + 1)).indices.tolist())
            got = idx[b, j].tolist()
            assert set(got) - {-1} == want and got.count(-1) == idx.shape[-1] - len(want), (t, seq, pos)
            assert len(set(got) - {-1}) == len(want)                                 # no duplicate picks
        # the mask the attention references apply: exactly the picked causal keys
        mask = selection_mask(g, idx)
        for b, j in g.q_valid.nonzero().tolist():
            want = torch.zeros(K, dtype=torch.bool)
            want[[i for i in idx[b, j].tolist() if i >= 0]] = True
            assert torch.equal(mask[b, j], want & g.causal[b, j])
        assert not mask[~g.q_valid].any()


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_attention_reads_index_selection_exactly_as_its_mask(form):
    """DSA as indices == DSA as the bool mask, bit for bit, in both MLA forms (the reference applies
    indices as their mask; the GPU kernel reads them as a page table)."""
    m = _mla_inputs(4, seed=6)
    g0 = torch.Generator().manual_seed(7)
    sels_idx, sels_mask = [], []
    for g in m["batch"].groups:
        B, Q, K = g.causal.shape
        k = max(1, K // 3)
        idx = torch.stack([torch.randperm(K, generator=g0)[:k] for _ in range(B * Q)]).view(B, Q, k)
        idx = torch.where(torch.rand(B, Q, k, generator=g0) < 0.2, -1, idx).to(torch.int32)   # padding
        sels_idx.append(idx)
        mask = torch.zeros(B, Q, K, dtype=torch.bool)                               # built independently
        for b in range(B):
            for q in range(Q):
                for i in idx[b, q].tolist():
                    if i >= 0:
                        mask[b, q, i] = True
        sels_mask.append(mask & g.causal)
    assert torch.equal(_mla_ops(m, form, sels_idx), _mla_ops(m, form, sels_mask))


def _kpool_expected(qi_t, w_t, rows_seq, ape, pos, kp, pool_topk, tail, K):
    """One query at `pos`: the best complete pools (last token <= pos), their tokens, plus the tail."""
    di = ape.shape[-1]
    n_cand = (pos + 1) // kp
    want = torch.zeros(K, dtype=torch.bool)
    if n_cand:
        r = rows_seq[:n_cand * kp].view(n_cand, kp, 2 * di)
        prob = (r[..., di:] + ape).softmax(1)
        keys = (prob * r[..., :di]).sum(1)                                             # [n_cand, di]
        for p in _score(qi_t, w_t, keys).topk(min(pool_topk, n_cand)).indices.tolist():
            want[p * kp:(p + 1) * kp] = True
    if tail:
        want[n_cand * kp:pos + 1] = True
    return want


@pytest.mark.parametrize("max_bytes", [256 << 20, 1], ids=["one-tile", "tiled"])
@pytest.mark.parametrize("tail", [True, False])
def test_indexer_kpool_topk_is_the_brute_force_pool_selection(tail, max_bytes):
    kp, pool_topk, di = 4, 2, 8
    batch, rows, slots, qi, w, cache = _index_inputs(2 * di, seed=6)
    ape = torch.randn(kp, di, generator=torch.Generator().manual_seed(7))
    for g in batch.groups:
        sel = kernels.ops().indexer_kpool_topk(qi, w, cache, g, ape, kpool=kp, pool_topk=pool_topk, tail=tail,
                                               max_bytes=max_bytes)
        assert sel.shape == g.causal.shape and not (sel & ~g.causal).any()
        for b, j in g.q_valid.nonzero().tolist():
            t = int(g.q_index[b, j])
            seq, pos = rows[t]
            want = _kpool_expected(qi[t], w[t], cache[slots[seq]], ape, pos, kp, pool_topk, tail, g.causal.shape[-1])
            assert torch.equal(sel[b, j], want), (t, seq, pos)
