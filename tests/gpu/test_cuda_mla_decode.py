"""The Triton paged MLA decode (`glm_ray.kernels.cuda.mla_decode.mla_decode_paged`) on the GPU at the
real shapes (skipped without an NVIDIA GPU): r = 512, dr = 64, h = 64 (GLM-5, TP1), 32
(glm5-flash-31b, TP1) and 16 (GLM-5, TP4), block sizes 16 and 64, bf16.

Oracle: `mla_decode_reference` (fp32 math on the same bf16 q / cache). Tolerance, per sequence:
rel-norm <= 1e-2 and max abs err <= 2e-2 * max|ref|. The kernel's only roundings beyond fp32
summation order are the bf16 probabilities fed to the PV dot (2^-9 relative each, averaging out over
the keys) and the bf16 output (2^-9 relative per element): expected ~3e-3 rel-norm and ~1 bf16 ulp
(0.4% of an element, i.e. < 1% of max|ref|) — the bounds leave ~3x margin and still catch any real
bug (a wrong / missing key, a bad split merge or a wrong scale moves the result by > 5%).

Plus a CUDA-graph test: captured with static buffers, replayed after context_lens / block_table /
indices changed in place, equal to eager.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.kernels.cuda.mla_decode import mla_decode_paged, mla_decode_reference  # noqa: E402

DEV = "cuda"
R, DR = 512, 64
D = R + DR
SCALE = 192 ** -0.5                  # GLM-5's qk_nope + qk_rope head dim (the absorbed form keeps its scale)
BF16 = torch.bfloat16


def make_case(h: int, block_size: int, ctxs: list[int], *, capacity: int | None = None, seed: int = 0):
    """bf16 q [B, h, D], kv_cache [S, D], shuffled block_table [B, nb] int32 (nb from `capacity`, default
    the longest context; unused entries point at other blocks), context_lens [B] int32."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    B = len(ctxs)
    nb = -(-(capacity or max(ctxs)) // block_size)
    num_blocks = B * nb + 1
    block_table = torch.randperm(num_blocks, generator=g, device=DEV)[:B * nb].view(B, nb).int()
    kv_cache = torch.randn(num_blocks * block_size, D, generator=g, device=DEV).to(BF16)
    q = (torch.randn(B, h, D, generator=g, device=DEV) * 2).to(BF16)      # spread scores a little
    return q, kv_cache, block_table, torch.tensor(ctxs, dtype=torch.int32, device=DEV)


def make_indices(ctxs: list[int], K: int, *, seed: int = 1) -> torch.Tensor:
    """[B, K] int32 DSA-like selection: min(ctx, K - K // 8) distinct positions of each context, in random
    order, the rest -1 scattered among them."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = torch.full((len(ctxs), K), -1, dtype=torch.int32, device=DEV)
    for b, n in enumerate(ctxs):                                              # test setup, per sequence
        k = min(n, K - K // 8)
        sel = torch.randperm(n, generator=g, device=DEV)[:k].int()
        out[b, torch.randperm(K, generator=g, device=DEV)[:k]] = sel
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == BF16 and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    for b in range(o.shape[0]):                                               # per sequence: nothing diluted
        rel = float((o[b] - r[b]).norm() / r[b].norm())
        mx = float((o[b] - r[b]).abs().max() / r[b].abs().max())
        assert rel <= 1e-2 and mx <= 2e-2, (b, rel, mx)


def run_both(q, kv, bt, cl, block_size, indices=None, **kw):
    out = mla_decode_paged(q, kv, bt, cl, block_size, kv_lora_rank=R, scale=SCALE, indices=indices, **kw)
    ref = mla_decode_reference(q, kv, bt, cl, block_size, kv_lora_rank=R, scale=SCALE, indices=indices)
    assert_close(out, ref.float())
    return out


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("h", [16, 32, 64])
def test_dense(h, block_size):
    g = torch.Generator().manual_seed(h + block_size)
    # B = 1 (many splits), B = 8 (every length incl. 1; a CUDA-graph capacity past the longest),
    # B = 64 (short mixed lengths, few splits)
    run_both(*make_case(h, block_size, [8192]), block_size)
    run_both(*make_case(h, block_size, [1, 17, 1000, 8192, 5, 4096, 999, 64], capacity=9000, seed=1), block_size)
    ctx64 = torch.randint(1, 1025, (64,), generator=g).tolist()
    run_both(*make_case(h, block_size, ctx64, seed=2), block_size)
    if block_size == 16:
        run_both(*make_case(h, block_size, [17, 1000, 1], seed=3), block_size, num_splits=1)   # direct path


@pytest.mark.parametrize("h", [16, 32, 64])
def test_sparse(h):
    # K = 2048 DSA indices into 8k / 32k contexts (plus a short one with mostly -1), block_size 64
    run_both(*make_case(h, 64, [32768], seed=4), 64, make_indices([32768], 2048, seed=5))
    ctxs = [8192, 32768, 1000, 8192, 3000, 32768, 2048, 17]
    run_both(*make_case(h, 64, ctxs, seed=6), 64, make_indices(ctxs, 2048, seed=7))
    ctx64 = [8192] * 32 + [1500] * 32
    run_both(*make_case(h, 16, ctx64, seed=8), 16, make_indices(ctx64, 2048, seed=9))


@pytest.mark.parametrize("h", [32, 64])
def test_decode_group_wider_than_the_sms(h):
    """A mixed step's eager decode group holding an absorbed prefix-cache tail: 16 decoding rows + 128 one-query
    rows of one sequence at consecutive positions past a 2048-token prefix (144 head tiles > 132 SMs: the default
    takes 2 splits); the default, one split and four splits all equal the reference."""
    from glm_ray.kernels.cuda.mla_decode import default_num_splits  # noqa: PLC0415 (imports triton)
    ctxs = [1100 + 37 * i for i in range(16)] + [2049 + i for i in range(128)]
    q, kv, bt, cl = make_case(h, 64, ctxs, seed=12)
    assert default_num_splits(len(ctxs), h, D, bt.shape[1] * 64) == 2
    auto = run_both(q, kv, bt, cl, 64)
    one = run_both(q, kv, bt, cl, 64, num_splits=1)
    four = run_both(q, kv, bt, cl, 64, num_splits=4)
    assert float((auto.float() - one.float()).norm() / one.float().norm()) <= 1e-2
    assert float((four.float() - one.float()).norm() / one.float().norm()) <= 1e-2


def test_cuda_graph_replay():
    h, bs, K = 32, 16, 2048
    ctx_a = [8192, 17, 1, 3000, 1000, 64, 5000, 2]
    ctx_b = [10, 9000, 4000, 1, 2222, 8191, 33, 7000]
    q, kv, bt, cl = make_case(h, bs, ctx_a, capacity=9216, seed=10)
    idx = make_indices(ctx_a, K, seed=11)

    def call(sparse):
        return mla_decode_paged(q, kv, bt, cl, bs, kv_lora_rank=R, scale=SCALE, indices=idx if sparse else None)

    for sparse in (False, True):
        call(sparse)                                                          # compile outside the capture
    torch.cuda.synchronize()
    graphs, outs = [], []
    for sparse in (False, True):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            outs.append(call(sparse))
        graphs.append(gr)
    # new values in the same buffers: lengths, a reshuffled table, a new selection, new queries
    _, _, bt2, cl2 = make_case(h, bs, ctx_b, capacity=9216, seed=12)
    cl.copy_(cl2)
    bt.copy_(bt2)
    idx.copy_(make_indices(ctx_b, K, seed=13))
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF16))
    for sparse, gr, out in zip((False, True), graphs, outs):
        gr.replay()
        torch.cuda.synchronize()
        eager = call(sparse)
        assert torch.equal(out, eager), sparse                                # same kernels, same split plan
        ref = mla_decode_reference(q, kv, bt, cl, bs, kv_lora_rank=R, scale=SCALE, indices=idx if sparse else None)
        assert_close(out, ref)
