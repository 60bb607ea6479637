"""The Triton MLA prefill (`glm_ray.kernels.cuda.mla_prefill`, through the `cuda` backend's `mla_prefill`
op) on the GPU at the real head shapes (skipped without an NVIDIA GPU), bf16, block size 64:
GLM-5 / glm5-flash-31b MLA (r = 512, qk_nope 192 + rope 64, v 256) at h = 64 (GLM-5 TP1), 32
(glm5-flash-31b TP1) and 8 (GLM-5 TP8); GLM-5.3-Flash's NoPE MLA (qk_nope 256, rope 0, v 256) at
h = 64 and 8. Steps: one fresh 1k prompt; three sequences of different lengths, two over a cached
prefix (chunked prefill); dense and DSA-sparse (top-2048 of random causal scores, -1 padded), and the
key-chunked path (a small max_bytes).

Oracle: the torch reference `mla_prefill` in fp32 on the same bf16 q / cache, its kv_b the same bf16
GEMM cast up (the expanded K/V are the same bf16 values in both). Tolerance, per sequence: rel-norm
<= 1e-2 and max abs err <= 2e-2 * max|ref|. The kernel's only roundings beyond fp32 summation order
are the bf16 probabilities fed to the PV dot (2^-9 relative each, averaging out over the keys) and
the bf16 output (2^-9 relative per element): expected ~3e-3 rel-norm, ~1 bf16 ulp max — the bounds
leave ~3x margin and still catch a real bug (a wrong / missing key or a wrong causal offset moves the
result by > 5%). The op must not fall back to the reference (`fallbacks` stays empty).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray import kernels  # noqa: E402
from glm_ray.forward_batch import build_forward_batch  # noqa: E402
from glm_ray.kernels.torch_ref.attention import mla_prefill as ref_mla_prefill  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
R, BS, TOPK = 512, 64, 2048
GLM5 = dict(dn=192, dr=64, dv=256)           # glm5-full-754b / glm5-flash-31b
FLASH53 = dict(dn=256, dr=0, dv=256)         # glm53-flash-text-321b (NoPE)
STEPS = {"1x1k": ([1024], [1024]),
         "mixed": ([1000, 513, 64], [4000, 513, 8064])}   # 1000 new over 3000 cached, fresh, 64 over 8000


@pytest.fixture(scope="module")
def cuda_ops():
    ops = kernels.init_backend("cuda", "cuda")
    yield ops
    kernels.init_backend("torch")


def make_tables(context_lens, g) -> list[list[int]]:
    """Random disjoint block tables for sequences of these lengths (one spare block)."""
    need = [-(-c // BS) for c in context_lens]
    perm = torch.randperm(sum(need) + 1, generator=g, device=DEV).tolist()
    tables, at = [], 0
    for n in need:                                                           # test setup, per sequence
        tables.append(perm[at:at + n])
        at += n
    return tables


def make_step(query_lens, context_lens, h, dn, dr, dv, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    tables = make_tables(context_lens, g)
    need = [len(t) for t in tables]
    fb = build_forward_batch(query_lens, context_lens, tables, BS, DEV)
    T = sum(query_lens)
    q = torch.randn(T, h, dn + dr, generator=g, device=DEV).to(BF16)
    cache = torch.randn((sum(need) + 1) * BS, R + dr, generator=g, device=DEV).to(BF16)
    w = (torch.randn(h * (dn + dv), R, generator=g, device=DEV) * R ** -0.5).to(BF16)   # kv_b_proj weight
    return q, cache, w, fb.groups


def topk_selection(group, seed: int) -> torch.Tensor:
    """[B, Qmax, k] int32: each query's top-`TOPK` causal positions under random scores, -1 where it
    has fewer (what the DSA indexer returns)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    causal = group.causal                                                    # [B, Qmax, Kmax]
    scores = torch.rand(causal.shape, generator=g, device=DEV).masked_fill_(~causal, float("-inf"))
    v, i = scores.topk(min(TOPK, causal.shape[-1]), dim=-1)
    return torch.where(v == float("-inf"), -1, i).to(torch.int32)


def check(ops, q, cache, w, group, selection, dv, max_bytes=1 << 30, tiles=None):
    scale = q.shape[-1] ** -0.5
    kw = dict(kv_lora_rank=R, v_head_dim=dv, scale=scale, max_bytes=max_bytes)
    if tiles is None:                                                        # through the backend's op
        out = ops.mla_prefill(q, cache, group, selection, lambda x: F.linear(x, w), **kw)
        assert not ops.mla_prefill.__self__.fallbacks, dict(ops.mla_prefill.__self__.fallbacks)
    else:                                                                    # one way of walking sparse tiles
        from glm_ray.kernels.cuda.mla_prefill import mla_prefill_group  # noqa: PLC0415 (imports triton)
        out = mla_prefill_group(q, cache, group, selection, lambda x: F.linear(x, w), tiles=tiles, **kw)
    ref = ref_mla_prefill(q.float(), cache.float(), group, selection, lambda x: F.linear(x.to(BF16), w).float(),
                          kv_lora_rank=R, v_head_dim=dv, scale=scale)
    assert out.dtype == BF16 and out.shape == ref.shape
    o, r = out.float(), ref
    assert torch.isfinite(o).all()
    start = 0
    for n in group.query_lens.tolist():                                      # per sequence: nothing diluted
        d = o[start:start + n] - r[start:start + n]
        rel = float(d.norm() / r[start:start + n].norm())
        mx = float(d.abs().max() / r[start:start + n].abs().max())
        assert rel <= 1e-2 and mx <= 2e-2, (start, n, rel, mx)
        start += n


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("h,dims", [(64, GLM5), (32, GLM5), (8, GLM5), (64, FLASH53), (8, FLASH53)],
                         ids=["glm5-h64", "flash31b-h32", "glm5-h8", "glm53-h64", "glm53-h8"])
def test_dense(cuda_ops, step, h, dims):
    q, cache, w, groups = make_step(*STEPS[step], h, **dims, seed=h)
    for grp in groups:
        check(cuda_ops, q, cache, w, grp, None, dims["dv"])


@pytest.mark.parametrize("h", [64, 32, 8])
def test_sparse(cuda_ops, h):
    # contexts above index_topk: each query attends only to its top-2048 positions
    q, cache, w, groups = make_step(*STEPS["mixed"], h, **GLM5, seed=100 + h)
    for gi, grp in enumerate(groups):
        check(cuda_ops, q, cache, w, grp, topk_selection(grp, seed=gi), GLM5["dv"])


@pytest.mark.parametrize("skip", [False, True])
def test_sparse_tile_walks(skip):
    # every way the sparse kernel walks its key tiles (bench.attention --sparse-tiles times them) at h = 32
    from glm_ray.kernels.cuda.mla_prefill import SparseTiles  # noqa: PLC0415 (imports triton)
    q, cache, w, groups = make_step(*STEPS["mixed"], 32, **GLM5, seed=132)
    for gi, grp in enumerate(groups):
        check(None, q, cache, w, grp, topk_selection(grp, seed=gi), GLM5["dv"], tiles=SparseTiles(skip))


@pytest.mark.parametrize("sparse", [False, True])
def test_writes_into_out(cuda_ops, sparse):
    """`out=` (the group's rows of a piecewise graph's static "o" carry): the kernel writes that view directly
    and returns it, bit for bit what it writes into its own buffer, the rest of the carry untouched; with key
    chunks too (the online-softmax state across launches)."""
    q, cache, w, groups = make_step(*STEPS["mixed"], 32, **GLM5, seed=9)
    kw = dict(kv_lora_rank=R, v_head_dim=GLM5["dv"], scale=q.shape[-1] ** -0.5)
    for mb in (1 << 30, 64 << 20):
        for gi, grp in enumerate(groups):
            sel = topk_selection(grp, seed=gi) if sparse else None
            want = cuda_ops.mla_prefill(q, cache, grp, sel, lambda x: F.linear(x, w), max_bytes=mb, **kw)
            Tg = want.shape[0]
            store = torch.full((Tg + 6, 32, GLM5["dv"]), float("nan"), device=DEV, dtype=BF16)
            got = cuda_ops.mla_prefill(q, cache, grp, sel, lambda x: F.linear(x, w), max_bytes=mb,
                                       out=store[3:3 + Tg], **kw)
            assert got.data_ptr() == store[3].data_ptr()
            torch.testing.assert_close(store[3:3 + Tg], want, rtol=0, atol=0)
            assert store[:3].isnan().all() and store[3 + Tg:].isnan().all()
    assert not cuda_ops.mla_prefill.__self__.fallbacks


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("h,dims", [(32, GLM5), (64, FLASH53)], ids=["flash31b-h32", "glm53-h64"])
def test_tma_key_loads(h, dims, sparse):
    """GLM_RAY_CUDA_MLA_PREFILL_TMA: key tiles as TMA boxes == pointer tiles (the same MMAs on the same values; rows
    past a context are masked; bounded at two bf16 ulps in case the two layouts pick other MMA shapes — a wrong row
    or column is O(1) off), whole and in key chunks (descriptors per chunk); and within the reference's bound."""
    from glm_ray.kernels.cuda import mla_prefill as mp  # noqa: PLC0415 (imports triton)
    from glm_ray.kernels.cuda.tma import mla_key_descriptors  # noqa: PLC0415
    q, cache, w, groups = make_step(*STEPS["mixed"], h, **dims, seed=41 + h)
    kw = dict(kv_lora_rank=R, v_head_dim=dims["dv"], scale=q.shape[-1] ** -0.5)
    for mb in (1 << 30, 64 << 20):
        for gi, grp in enumerate(groups):
            sel = topk_selection(grp, seed=gi) if sparse else None
            ptr = mp.mla_prefill_group(q, cache, grp, sel, lambda x: F.linear(x, w), max_bytes=mb, **kw)
            tma = mp.mla_prefill_group(q, cache, grp, sel, lambda x: F.linear(x, w), max_bytes=mb,
                                       key_descriptors=mla_key_descriptors, **kw)
            torch.testing.assert_close(tma.float(), ptr.float(), rtol=2 ** -7, atol=2 ** -7)
            ref = ref_mla_prefill(q.float(), cache.float(), grp, sel, lambda x: F.linear(x.to(BF16), w).float(), **kw)
            assert float((tma.float() - ref).norm() / ref.norm()) <= 1e-2


@pytest.mark.parametrize("sparse", [False, True])
def test_launch_order_changes_nothing(sparse):
    """`head_group` (the programs' launch order: 4 heads' query tiles interleaved, the default at h = 32 / 64, vs
    head by head): the same programs in another order, so the output is bit for bit the same, whole and in key
    chunks."""
    from glm_ray.kernels.cuda import mla_prefill as mp  # noqa: PLC0415 (imports triton)
    q, cache, w, groups = make_step(*STEPS["mixed"], 32, **GLM5, seed=77)
    kw = dict(kv_lora_rank=R, v_head_dim=GLM5["dv"], scale=q.shape[-1] ** -0.5)
    for mb in (1 << 30, 64 << 20):
        for gi, grp in enumerate(groups):
            sel = topk_selection(grp, seed=gi) if sparse else None
            outs = [mp.mla_prefill_group(q, cache, grp, sel, lambda x: F.linear(x, w), max_bytes=mb, head_group=hg,
                                         **kw) for hg in (1, 4, None)]
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("sparse", [False, True])
def test_key_chunks(cuda_ops, sparse):
    # 64 MiB of expanded keys at h = 32: the 8k contexts take several chunks
    q, cache, w, groups = make_step(*STEPS["mixed"], 32, **GLM5, seed=7)
    for gi, grp in enumerate(groups):
        check(cuda_ops, q, cache, w, grp, topk_selection(grp, seed=gi) if sparse else None, GLM5["dv"],
              max_bytes=64 << 20)


@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_tail_equals_naive(cuda_ops, sparse):
    """GLM_RAY_ABSORB_PREFILL_TOKENS: a 128-token tail over 2,176 cached positions, as one-query rows of the decode
    group (W_UK folded into the query, the `mla_decode` kernel, W_UV unfolded), equals the same tail as a naive
    prefill group (the fp32 reference of `mla_prefill`), beside two decodes, dense and with per-token top-2048
    selections (the same positions in both layouts). Tolerance as `check`, per sequence."""
    h, dn, dr, dv = 32, GLM5["dn"], GLM5["dr"], GLM5["dv"]
    qlens, clens = [1, 1, 128], [1500, 3000, 2304]
    q, cache, w, naive_groups = make_step(qlens, clens, h, dn, dr, dv, seed=77)
    tables = make_tables(clens, torch.Generator(device=DEV).manual_seed(77))       # make_step's tables
    (absorbed,) = build_forward_batch(qlens, clens, tables, BS, DEV, absorb_tokens=256).groups
    assert absorbed.q_index.shape == (130, 1) and absorbed.row_span == (0, 130)
    tail = next(g for g in naive_groups if g.mla_mode == "naive")
    sel_abs = sel_naive = None
    if sparse:
        sel_abs = topk_selection(absorbed, seed=5)                                  # [130, 1, k]
        sel_naive = sel_abs[2:, 0][None]                                            # [1, 128, k]: the tail's rows
    scale = (dn + dr) ** -0.5
    wk = w.view(h, dn + dv, R)
    w_kc, w_vc = wk[:, :dn], wk[:, dn:].transpose(1, 2)                             # [h, dn, R], [h, R, dv]
    q_abs = torch.cat([torch.einsum("thd,hdr->thr", q[..., :dn].float(), w_kc.float()).to(BF16), q[..., dn:]], -1)
    o_lat = cuda_ops.mla_decode(q_abs, cache, absorbed, sel_abs, kv_lora_rank=R, scale=scale)   # [130, h, R]
    assert not cuda_ops.mla_decode.__self__.fallbacks, dict(cuda_ops.mla_decode.__self__.fallbacks)
    out = torch.einsum("thr,hrd->thd", o_lat.float(), w_vc.float())               # [130, h, dv]
    ref = ref_mla_prefill(q.float(), cache.float(), tail, sel_naive, lambda x: F.linear(x.to(BF16), w).float(),
                          kv_lora_rank=R, v_head_dim=dv, scale=scale)               # [128, h, dv]
    d = out[2:] - ref
    rel, mx = float(d.norm() / ref.norm()), float(d.abs().max() / ref.abs().max())
    assert rel <= 1e-2 and mx <= 2e-2, (rel, mx)

