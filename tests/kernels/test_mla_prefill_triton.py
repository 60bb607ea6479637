"""The Triton MLA prefill (`glm_ray.kernels.cuda.mla_prefill`) under TRITON_INTERPRET=1 on CPU, against
the engine's torch reference `torch_ref.attention.mla_prefill` on the groups `build_forward_batch` makes
(the reference's padded views and masked SDPA / online softmax share no code with the kernel's packed
varlen path).

Tiny shapes: h = 3, r = 32, qk_nope 48 (split 32 + 16 like GLM-5's 192 = 128 + 64), rope 16, v 24
(padded to 32); a NoPE case (dr = 0, qk_nope 64: GLM-5.3-Flash); BLOCK_M = BLOCK_N = 16. Steps mix
fresh prompts and chunks over a cached prefix (chunked prefill: queries at ctx - ql + i), of different
lengths in one group, on shuffled block tables whose unused entries point at other sequences' blocks
(a read past a context changes the result), block sizes 1 / 4 / 16 / 32 around the 16-key tile, contexts
that end mid-block and mid-tile. Sparse: DSA indices [B, Qmax, k] with k below the contexts, unsorted,
-1 interleaved, a few non-causal positions (must be dropped: selection AND causal) and junk in the
padded query slots. Long-context path: a small `max_bytes` cuts the keys into several chunks whose
online-softmax state is carried between launches. fp32 inputs: the interpreter computes in fp32 like
the reference, so rel err <= 1e-5 per sequence (only the summation order differs).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # CPU-only: nothing can run compiled Triton here, so build every triton kernel interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from glm_ray import kernels  # noqa: E402
from glm_ray.forward_batch import build_forward_batch  # noqa: E402
from glm_ray.kernels.cuda import mla_prefill as mp  # noqa: E402
from glm_ray.kernels.torch_ref import attention  # noqa: E402
from glm_ray.kernels.torch_ref.topk import SelectionBits  # noqa: E402

H, R = 3, 32
SMALL = (16, 16, 4, 1)                 # BLOCK_M, BLOCK_N, warps, stages: several tiles at these lengths
BIG = 1 << 30


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_step(query_lens, context_lens, block_size, *, dn=48, dr=16, dv=24, mla_mode="auto", seed=0,
              dtype=torch.float32):
    """A step's tensors and groups: q [T, h, dn+dr] (a row-strided view), kv_cache [S, r+dr], the kv_b
    weight [h*(dn+dv), r]; block tables shuffled, each sequence's table padded with other sequences'
    blocks (build_forward_batch pads the rest with block 0, also another sequence's block)."""
    g = torch.Generator().manual_seed(seed)
    B = len(query_lens)
    need = [-(-c // block_size) for c in context_lens]
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for n in need:                                                           # test setup, per sequence
        tables.append(perm[at:at + n])
        at += n
    for b in range(B):
        tables[b] = tables[b] + tables[(b + 1) % B][:2]                      # unused entries: foreign blocks
    fb = build_forward_batch(list(query_lens), list(context_lens), tables, block_size, torch.device("cpu"),
                             mla_mode=mla_mode)
    T = sum(query_lens)
    q_store = torch.randn(T, H, dn + dr + 8, generator=g).to(dtype)
    q = q_store[..., :dn + dr]                                               # row stride dn + dr + 8
    kv_cache = torch.randn(total * block_size, R + dr, generator=g).to(dtype)
    w = (torch.randn(H * (dn + dv), R, generator=g) * R ** -0.5).to(dtype)
    return dict(q=q, kv_cache=kv_cache, w=w, groups=fb.groups, dn=dn, dr=dr, dv=dv)


def make_selection(group, k: int, *, seed: int = 1, noncausal: bool = True) -> torch.Tensor:
    """[B, Qmax, k] int32 per query: a random subset of its causal positions (always incl. at least
    one), unsorted, -1 interleaved, plus (noncausal) one future position of its context where there is
    one; padded query slots hold random positions (junk the kernel must ignore)."""
    g = torch.Generator().manual_seed(seed)
    B, qmax = group.q_index.shape
    ql, cl = group.query_lens.tolist(), group.context_lens.tolist()
    out = torch.randint(0, max(cl), (B, qmax, k), generator=g, dtype=torch.int32)   # junk in padded slots
    for b in range(B):                                                       # test setup, per query
        for i in range(ql[b]):
            pos = cl[b] - ql[b] + i
            n = int(torch.randint(1, min(k, pos + 1) + 1, (1,), generator=g))
            picks = torch.randperm(pos + 1, generator=g)[:n]
            if noncausal and pos + 1 < cl[b] and n < k:
                picks = torch.cat([picks, torch.randint(pos + 1, cl[b], (1,), generator=g)])
            row = torch.full((k,), -1, dtype=torch.int32)
            row[torch.randperm(k, generator=g)[:len(picks)]] = picks.int()
            out[b, i] = row
    return out


def run_group(s, group, selection, *, max_bytes=BIG, config=SMALL, tiles=mp.SparseTiles(), head_group=None):
    kv_b = lambda x: x @ s["w"].T                                            # noqa: E731 — the layer's kv_b_proj
    kw = dict(kv_lora_rank=R, v_head_dim=s["dv"], scale=(s["dn"] + s["dr"]) ** -0.5)
    out = mp.mla_prefill_group(s["q"], s["kv_cache"], group, selection, kv_b, max_bytes=max_bytes, config=config,
                               tiles=tiles, head_group=head_group, **kw)
    ref = attention.mla_prefill(s["q"], s["kv_cache"], group, selection, kv_b, **kw)
    return out, ref


def check(s, group, selection=None, *, tol=1e-5, **kw):
    out, ref = run_group(s, group, selection, **kw)
    Tg = group.token_index.shape[0]
    assert out.shape == (Tg, H, s["dv"]) and out.dtype == s["q"].dtype
    assert torch.isfinite(out.float()).all()
    start = 0
    for n in group.query_lens.tolist():                                      # per sequence: nothing diluted
        err = rel_err(out[start:start + n], ref[start:start + n])
        assert err <= tol, (start, n, err)
        start += n
    return out, ref


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_dense_fresh_prompts(block_size):
    # fresh prompts of different lengths in one group: 1 tile, 2 tiles + 1, a tile boundary, 5 rows
    s = make_step([17, 33, 16, 5], [17, 33, 16, 5], block_size)
    assert len(s["groups"]) == 1                                             # one group, reordered by length
    for g in s["groups"]:
        check(s, g)


@pytest.mark.parametrize("block_size", [4, 16])
def test_dense_chunked_prefill_over_a_cached_prefix(block_size):
    # chunks of 9 / 20 / 3 / 16 new tokens after prefixes of 30 / 7 / 45 / 16 (mid-block, mid-tile)
    s = make_step([9, 20, 3, 16], [39, 27, 48, 32], block_size, seed=1)
    assert len(s["groups"]) == 1
    for g in s["groups"]:
        check(s, g)


def test_dense_default_config_and_nope():
    # the shipped config table (BLOCK_M / BLOCK_N larger than every length here), and NoPE heads
    s = make_step([7, 20], [30, 20], 4, seed=2)
    for g in s["groups"]:
        check(s, g, config=None)
    s = make_step([7, 20], [30, 20], 4, dn=64, dr=0, dv=64, seed=3)          # GLM-5.3-Flash: dr = 0
    for g in s["groups"]:
        check(s, g)


# both ways the sparse kernel walks its tiles (branching around empty tiles or not)
TILES = [mp.SparseTiles(skip_empty=skip) for skip in (False, True)]


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_sparse_topk(block_size, tiles):
    # contexts above k = 12: every query row attends only to its picks (AND causal)
    s = make_step([21, 9, 40], [50, 9, 40], block_size, seed=4)
    for g in s["groups"]:
        check(s, g, make_selection(g, 12, seed=5), tiles=tiles)


@pytest.mark.parametrize("tiles", TILES, ids=str)
def test_sparse_wide_key_tiles(tiles):
    # BLOCK_N = 64: a row's bits for a tile are two whole words (BLOCK_N = 16 reads a part of one word);
    # contexts 70..150 end mid-word and mid-tile
    s = make_step([30, 70, 12], [150, 70, 97], 16, seed=12)
    for g in s["groups"]:
        check(s, g, make_selection(g, 24, seed=13), config=(16, 64, 4, 1), tiles=tiles)


@pytest.mark.parametrize("tiles", TILES, ids=str)
def test_sparse_nope_and_tile_skipping(tiles):
    # picks only among the first 3 positions (+ the diagonal's position 0 at most): every later key tile
    # is skipped by every query (skip_empty) or attended with nothing picked; NoPE dims
    s = make_step([24, 40], [56, 40], 16, dn=64, dr=0, dv=64, seed=6)
    for g in s["groups"]:
        B, qmax = g.q_index.shape
        sel = torch.full((B, qmax, 8), -1, dtype=torch.int32)
        sel[..., 0] = 0
        sel[..., 3] = 2
        sel[..., 5] = 1
        check(s, g, sel, tiles=tiles)


@pytest.mark.parametrize("sparse", [False, True])
def test_key_chunks_carry_the_softmax_state(sparse):
    # max_bytes fits 16 / 32 key positions: 2..4 chunks, sequences that end before the last chunk,
    # query tiles with no key in a chunk; the output must equal the one-chunk run
    s = make_step([12, 30, 5], [60, 30, 41], 4, seed=7)
    for g in s["groups"]:
        sel = make_selection(g, 10, seed=8) if sparse else None
        one, _ = check(s, g, sel)
        per_pos = g.num_seqs * ((R + s["dr"] + H * (s["dn"] + s["dv"])) * 4 + 8)
        for keys in (16, 32):
            assert mp.chunk_keys(g.num_seqs, H, s["dn"], s["dv"], R + s["dr"], 4, keys * per_pos, 16,
                                 g.max_context_len) == keys
            out, _ = check(s, g, sel, max_bytes=keys * per_pos)
            assert rel_err(out, one) <= 1e-5


@pytest.mark.parametrize("sparse", [False, True])
def test_launch_order_interleaving_heads_computes_every_tile_once(sparse):
    """head_group (module docstring, "Launch order"): the programs take their (query tile, head) in an order that
    interleaves the tiles of head_group heads — a permutation of the programs, so the output equals the head-by-head
    order bit for bit, with one key chunk and with several (the online-softmax state rows are per (token, head))."""
    s = make_step([12, 30, 5], [60, 30, 41], 4, seed=13)
    assert mp.default_head_group(H) == 1 and mp.default_head_group(32) == mp.HEAD_GROUP == 4
    assert mp.default_head_group(64) == 4 and mp.default_head_group(6) == 1
    for g in s["groups"]:
        sel = make_selection(g, 10, seed=14) if sparse else None
        per_pos = g.num_seqs * ((R + s["dr"] + H * (s["dn"] + s["dv"])) * 4 + 8)
        for max_bytes in (BIG, 16 * per_pos):
            head_by_head, ref = run_group(s, g, sel, max_bytes=max_bytes, head_group=1)
            interleaved, _ = run_group(s, g, sel, max_bytes=max_bytes, head_group=H)
            assert torch.equal(interleaved, head_by_head)
            assert rel_err(interleaved, ref) <= 1e-5
    with pytest.raises(AssertionError):
        run_group(s, s["groups"][0], None, head_group=2)                    # must divide h


@pytest.mark.parametrize("chunks", [False, True])
def test_sparse_bitmap_selection_equals_indices(chunks):
    """The cuda indexer's form (`SelectionBits`: the packed rows' bitmap, no index list) gives the kernel's
    output of the same picks as indices bit for bit, one key chunk or several; the reference reads the
    bitmap (`selection_mask`) to the same mask as the indices (their non-causal picks dropped either way)."""
    s = make_step([21, 9, 40], [50, 9, 40], 16, seed=4)
    for g in s["groups"]:
        idx = make_selection(g, 12, seed=5)                                  # [B, Qmax, k]
        sel = SelectionBits.from_indices(idx, g)
        per_pos = g.num_seqs * ((R + s["dr"] + H * (s["dn"] + s["dv"])) * 4 + 8)
        max_bytes = 16 * per_pos if chunks else BIG
        out_i, ref_i = run_group(s, g, idx, max_bytes=max_bytes)
        out_b, ref_b = check(s, g, sel, max_bytes=max_bytes)
        assert torch.equal(out_b, out_i)
        assert torch.equal(ref_b, ref_i)


def test_forced_naive_decode_group():
    # mla_mode "naive" sends one-token decodes through the prefill op too (Qmax = 1 groups)
    s = make_step([1, 1, 6], [23, 5, 17], 4, mla_mode="naive", seed=9)
    assert any(g.q_index.shape[1] == 1 for g in s["groups"])
    for g in s["groups"]:
        check(s, g)
        check(s, g, make_selection(g, 4, seed=10, noncausal=False))


def test_bf16_inputs():
    # bf16 q / cache / kv_b: the interpreter upcasts the dot operands; the reference computes in bf16
    s = make_step([17, 33], [40, 33], 4, seed=11, dtype=torch.bfloat16)
    for g in s["groups"]:
        out, _ = check(s, g, tol=2e-2)
        assert out.dtype == torch.bfloat16


def test_plan_tiles_and_chunks():
    # the device tile table covers every query tile once; surplus programs are marked -1
    s = make_step([17, 33, 16, 5], [40, 33, 16, 9], 4, seed=12)
    for g in s["groups"]:
        plan = mp.prefill_plan(g.block_table, g.context_lens, g.query_lens, g.token_index, g.block_size,
                               g.max_context_len, block_m=16, block_n=16, chunk=16)
        seqs, starts = plan.tile_seq.tolist(), plan.tile_start.tolist()
        want = sorted((b, m) for b, n in enumerate(g.query_lens.tolist()) for m in range(0, n, 16))
        assert sorted((b, m) for b, m in zip(seqs, starts) if b >= 0) == want
        assert plan.num_tiles >= len(want)
        assert [c.k0 for c in plan.chunks] == list(range(0, g.max_context_len, 16))
        for c in plan.chunks:                                                # packed slots of each chunk
            cl = g.context_lens.tolist()
            cu = c.cu_k.tolist()
            for b in range(g.num_seqs):
                n = max(0, min(cl[b], c.k1) - c.k0)
                want_slots = g.kv_slots[b, c.k0:c.k0 + n]
                assert torch.equal(c.slots[cu[b]:cu[b] + n], want_slots)


def test_cuda_backend_on_cpu_falls_back_with_a_reason():
    # the op is the cuda backend's own; on CPU it counts a fallback and returns the reference
    ops = kernels.init_backend("cuda", "cpu")
    try:
        k = ops.mla_prefill.__self__
        s = make_step([9, 5], [20, 5], 4, seed=13)
        g = s["groups"][0]
        kv_b = lambda x: x @ s["w"].T                                        # noqa: E731
        kw = dict(kv_lora_rank=R, v_head_dim=s["dv"], scale=0.1)
        out = ops.mla_prefill(s["q"], s["kv_cache"], g, None, kv_b, **kw)
        assert torch.equal(out, attention.mla_prefill(s["q"], s["kv_cache"], g, None, kv_b, **kw))
        assert [op for op, _ in k.fallbacks] == ["mla_prefill"]
    finally:
        kernels.init_backend("torch")


def test_writes_into_a_strided_out_view():
    """`out` (a group's rows of the step's attention output, here with padded head and value strides): the kernel
    writes it directly and returns it; the same values as its own buffer, rows around it untouched; the reference
    copies into `out` the same way."""
    s = make_step([9, 5, 12], [20, 5, 30], 4, seed=21)
    g = s["groups"][0]
    Tg, dv = g.token_index.shape[0], s["dv"]
    kv_b = lambda x: x @ s["w"].T                                            # noqa: E731
    kw = dict(kv_lora_rank=R, v_head_dim=dv, scale=0.1, max_bytes=BIG)
    own = mp.mla_prefill_group(s["q"], s["kv_cache"], g, None, kv_b, config=SMALL, **kw)
    for op, extra in ((mp.mla_prefill_group, dict(config=SMALL)), (attention.mla_prefill, {})):
        store = torch.full((Tg + 5, H + 1, dv + 8), float("nan"))            # [rows, heads, dv] with padding
        dst = store[2:2 + Tg, :H, :dv]                                       # row stride (H+1)(dv+8), head dv+8
        o = op(s["q"], s["kv_cache"], g, None, kv_b, out=dst, **kw, **extra)
        assert o.data_ptr() == dst.data_ptr() and o.shape == (Tg, H, dv)
        assert rel_err(dst, own) <= 1e-5
        assert store[:2].isnan().all() and store[2 + Tg:].isnan().all() and store[:, H:].isnan().all()
        assert store[:, :, dv:].isnan().all()


@pytest.mark.parametrize("case", ["dense", "chunked-prefix", "sparse", "key-chunks", "nope"])
def test_tma_key_loads_equal_pointer_tiles(case):
    """`key_tma` (GLM_RAY_CUDA_MLA_PREFILL_TMA): the key tiles load as TMA boxes through tensor descriptors — rows
    past a context and box columns past dn2 / dv read real neighbouring data (or zeros past the buffer) that the masks
    and the zero query columns must cancel. Bit for bit the pointer tiles' output, and within the reference's bound:
    dense, a chunk over a cached prefix, DSA-sparse, several key chunks, and the NoPE head (no rope part)."""
    dims = dict(dn=64, dr=0, dv=64) if case == "nope" else {}
    s = make_step([17, 9, 33, 5] if case != "chunked-prefix" else [9, 20, 3, 16],
                  [17, 30, 33, 5] if case != "chunked-prefix" else [39, 27, 48, 32], 4, seed=31, **dims)
    kv_b = lambda x: x @ s["w"].T                                            # noqa: E731
    g0 = s["groups"][0]
    per_pos = g0.num_seqs * ((R + s["dr"] + H * (s["dn"] + s["dv"])) * 4 + 8)
    max_bytes = 16 * per_pos if case == "key-chunks" else BIG                # 16 key positions a chunk: 3 chunks
    assert (mp.chunk_keys(g0.num_seqs, H, s["dn"], s["dv"], R + s["dr"], 4, max_bytes, 16, g0.max_context_len)
            < g0.max_context_len) == (case == "key-chunks")
    kw = dict(kv_lora_rank=R, v_head_dim=s["dv"], scale=0.1, config=SMALL, max_bytes=max_bytes)
    from glm_ray.kernels.cuda.tma import mla_key_descriptors
    made = []

    def descs(*a):
        made.append(1)
        return mla_key_descriptors(*a)
    for g in s["groups"]:
        sel = make_selection(g, 6, seed=2) if case == "sparse" else None
        ptr = mp.mla_prefill_group(s["q"], s["kv_cache"], g, sel, kv_b, **kw)
        made.clear()
        tma = mp.mla_prefill_group(s["q"], s["kv_cache"], g, sel, kv_b, key_descriptors=descs, **kw)
        keys = mp.chunk_keys(g.num_seqs, H, s["dn"], s["dv"], R + s["dr"], 4, max_bytes, 16, g.max_context_len)
        assert len(made) == -(-g.max_context_len // keys)                    # descriptors per key chunk: TMA ran
        assert torch.equal(tma, ptr)
        ref = attention.mla_prefill(s["q"], s["kv_cache"], g, sel, kv_b, kv_lora_rank=R, v_head_dim=s["dv"], scale=0.1)
        assert rel_err(tma, ref) <= 1e-5
