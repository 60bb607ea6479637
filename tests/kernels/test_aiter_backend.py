"""The "aiter" backend wiring, on CPU, against a fake `aiter` (tests/kernels/fake_aiter.py) that implements
the documented signatures: it un-shuffles what it is given with the documented permutations and runs the
torch references with the contract it was handed. Checked: lazy import, argument order, tensor layouts
(bpreshuffled weights, column-major x_scale, e8m0-shuffled scales, fp4x2 / e8m0 views), every forwarded
MoE field (quant_type, activation, gate_mode, swiglu_limit, hidden_pad, intermediate_pad, is_shuffled,
topk dtypes) and that the numbers equal the torch backend's. MLA decode: the page-size-1 page table
(int32 kv_indptr / kv_indices over the 4-D kv_buffer view, dense and DSA top-k with -1 padding, zero-padded
heads) against the torch reference; routing: biased_grouped_topk's in-place outputs, re-sorted by score,
against the reference; and the fallbacks that never reach aiter."""
from __future__ import annotations

import sys

import pytest
import torch

from glm_ray import kernels
from glm_ray.kernels.torch_ref.aiter_layout import shuffle_weight as ref_shuffle
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear, dequant_block_fp8
from glm_ray.layer_contracts import MoEContract
from glm_ray.layers.linear import ColumnParallelLinear
from glm_ray.layers.moe import FusedMoE
from glm_ray.quant.config import UnsupportedQuantSchemeError
from tests.kernels import fake_aiter
from tests.quant.helpers import (
    expert_tensors,
    expert_weights,
    fp8_config,
    load_module,
    quantize_tensor,
    quark_config,
    routing,
)

BF16 = torch.bfloat16


@pytest.fixture
def aiter_backend(monkeypatch):
    fake_aiter.install(monkeypatch)
    ops = kernels.init_backend("aiter")
    fake_aiter.CALLS.clear()
    yield ops
    kernels.init_backend("torch")


def _calls(name):
    return [c for c in fake_aiter.CALLS if c[0] == name]


def test_aiter_is_imported_only_when_selected(monkeypatch):
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    kernels.init_backend("torch")
    import glm_ray.kernels.aiter  # noqa: F401  (the package itself must not import aiter)
    assert "aiter" not in sys.modules
    assert kernels.resolve_backend_name("auto", "cpu") == "torch"
    with pytest.raises(ModuleNotFoundError, match="aiter"):
        kernels.init_backend("aiter")          # not installed here: a clear import error, only when asked for


def test_backend_resolves_and_inherits(aiter_backend):
    ops = aiter_backend
    assert ops.name == "aiter"
    from glm_ray.kernels.torch_ref.kda import kda_chunked_cached
    assert ops.kda_chunked is kda_chunked_cached             # no kernel anywhere -> torch reference
    assert ops.fused_moe.__self__.__class__.__name__ == "CudaKernels"   # no aiter op -> Triton (test_triton_on_rocm)
    assert ops.fused_moe_block_fp8.__self__.__class__.__name__ == "AiterKernels"


# ---------------------------------------------------------------------------------------- dense

def _fp8_linear(n, k, prefix="model.layers.0.self_attn.q_b_proj", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_tensor(torch.randn(n, k, generator=g) / k ** 0.5, "fp8")
    lin = ColumnParallelLinear(k, n, quant_config=fp8_config(), prefix=prefix, params_dtype=BF16)
    load_module(lin, prefix, {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s})
    return lin, q, s


@pytest.mark.parametrize("m", [1, 7])
def test_dense_block_fp8_bpreshuffle_contract(aiter_backend, m):
    lin, q, s = _fp8_linear(256, 384)
    assert lin.fp8_meta == {"preshuffled": True}
    assert torch.equal(lin.weight.data.view(torch.uint8), ref_shuffle(q).view(torch.uint8))   # (16,16) layout
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(1)).to(BF16)
    fake_aiter.CALLS.clear()
    y = lin(x)
    (_, (xq, wq, xs, ws), kw), = _calls("gemm_a8w8_blockscale_bpreshuffle")
    assert xq.shape == (m, 384) and wq.shape == (256, 384)
    assert ws.data_ptr() == lin.weight_scale_inv.data_ptr() and wq.data_ptr() == lin.weight.data_ptr()
    assert xs.shape == (m, 3) and (m == 1 or xs.stride() == (1, m)) and kw["dtype"] == BF16
    (_, _, qkw), = _calls("hip_quant")
    assert qkw["quant_dtype"] == torch.float8_e4m3fn
    ref = block_fp8_linear(x, q, s)                          # torch backend on the plain weight
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(lin.quant_method.dequantized_weight(lin), dequant_block_fp8(q, s, dtype=BF16),
                               rtol=0, atol=0)                   # kv_b absorption un-shuffles


def test_dense_block_fp8_into_out(aiter_backend):
    """`layer(x, out)` on the aiter backend: the same CK call (it allocates its output), copied into `out`."""
    lin, q, s = _fp8_linear(256, 384)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(3)).to(BF16)
    want = lin(x)
    fake_aiter.CALLS.clear()
    store = torch.full((8, 256), float("nan"), dtype=BF16)
    assert lin(x, store[1:6]).data_ptr() == store[1].data_ptr()
    assert len(_calls("gemm_a8w8_blockscale_bpreshuffle")) == 1
    torch.testing.assert_close(store[1:6], want, rtol=0, atol=0)
    assert store[0].isnan().all() and store[6:].isnan().all()


def test_dense_shapes_aiter_cannot_run_use_the_reference(aiter_backend):
    lin, q, s = _fp8_linear(80, 256, prefix="model.layers.0.self_attn.kv_a_proj_with_mqa")   # N % 16 != 0
    assert lin.fp8_meta == {}
    x = torch.randn(3, 256).to(BF16)
    fake_aiter.CALLS.clear()
    torch.testing.assert_close(lin(x), block_fp8_linear(x, q, s), rtol=0, atol=0)
    assert not _calls("gemm_a8w8_blockscale_bpreshuffle") and not _calls("gemm_a8w8_blockscale")


def test_dense_plain_gemm_path(aiter_backend):
    """The non-preshuffled CK entry point: row-major x_scale, plain weight."""
    ops = aiter_backend
    g = torch.Generator().manual_seed(2)
    q, s = quantize_tensor(torch.randn(128, 256, generator=g), "fp8")
    x = torch.randn(4, 256, generator=g).to(BF16)
    y = ops.block_fp8_linear(x, q, s)
    (_, (_, wq, xs, _), _), = _calls("gemm_a8w8_blockscale")
    assert wq is q and xs.stride() == (2, 1)
    torch.testing.assert_close(y, block_fp8_linear(x, q, s), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- MoE

PFX = "model.layers.1.mlp.experts"


def _layer(qcfg, fmt, scale_name, E, H, I, contract, mode="even", gate_scale=1.0, seed=0):
    wg, wu, wd = expert_weights(E, H, I, seed=seed, scale=gate_scale)
    layer = FusedMoE(E, H, I, quant_config=qcfg, prefix=PFX, params_dtype=BF16, contract=contract)
    load_module(layer, PFX, expert_tensors(PFX, wg, wu, wd, fmt, scale_name, mode=mode) if fmt == "mxfp4"
                else expert_tensors(PFX, wg, wu, wd, fmt, scale_name))
    return layer


def _torch_run(make, *args):
    """Build the same layer under the torch backend and run it there (layers are bound to their runner)."""
    kernels.init_backend("torch")
    try:
        layer = make()
        return layer, layer(*args)
    finally:
        kernels.init_backend("aiter")


def test_fused_moe_block_fp8_contract(aiter_backend):
    E, H, I, T, K = 8, 256, 64, 10, 2
    contract = MoEContract(swiglu_limit=10.0)
    make = lambda: _layer(fp8_config(), "fp8", "weight_scale_inv", E, H, I, contract, gate_scale=40.0)  # noqa: E731
    layer = make()
    # aiter needs I % 128 == 0: the runner asked for 64 rows of padding, recorded on the layer's contract
    assert (layer.contract.hidden_pad, layer.contract.intermediate_pad) == (0, 64)
    assert layer.quant_runner == "aiter" and layer.w13_weight.is_shuffled and layer.w2_weight.is_shuffled
    assert tuple(layer.w13_weight.shape) == (E, 256, H) and tuple(layer.w13_weight_scale_inv.shape) == (E, 2, 2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(BF16)
    tw, ids = routing(T, E, K)
    fake_aiter.CALLS.clear()
    y = layer(x, tw, ids)
    (_, args, kw), = _calls("fused_moe")
    hs, w1, w2, topk_w, topk_ids = args                       # positional order of aiter.fused_moe
    assert hs.shape == (T, H) and w1 is layer.w13_weight and w2 is layer.w2_weight
    assert topk_w.dtype == torch.float32 and topk_ids.dtype == torch.int32
    assert kw["quant_type"] == fake_aiter.QuantType.per_128x128 and kw["activation"] == fake_aiter.ActivationType.Silu
    assert kw["gate_mode"] == "separated" and kw["swiglu_limit"] == 10.0
    assert kw["hidden_pad"] == 0 and kw["intermediate_pad"] == 64 and kw["dtype"] == BF16
    assert kw["w1_scale"] is layer.w13_weight_scale_inv and kw["w2_scale"] is layer.w2_weight_scale_inv
    twin, ref = _torch_run(make, x, tw, ids)
    assert twin.contract.intermediate_pad == 0
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    # the clamp really was forwarded: dropping it changes the answer
    fake_aiter.CALLS.clear()
    import dataclasses
    layer.contract = dataclasses.replace(layer.contract, swiglu_limit=None)
    assert (layer(x, tw, ids).float() - ref.float()).abs().max() > 0.2 * ref.float().abs().max()


def test_fused_moe_mxfp4_contract(aiter_backend):
    E, H, I, T, K = 8, 224, 64, 10, 2                           # H % 256 != 0 and I % 256 != 0 -> both padded
    contract = MoEContract(swiglu_limit=10.0)
    make = lambda: _layer(quark_config(scale_mode="round_up"), "mxfp4", "weight_scale", E, H, I, contract,  # noqa: E731
                          mode="round_up", gate_scale=40.0)
    layer = make()
    assert (layer.contract.hidden_pad, layer.contract.intermediate_pad) == (32, 192)
    assert layer.w13_weight.dtype == torch.float4_e2m1fn_x2 and layer.w13_weight.is_shuffled
    assert layer.w13_weight_scale.dtype == torch.float8_e8m0fnu
    assert tuple(layer.w13_weight.shape) == (E, 2 * 256, 256 // 2) and tuple(layer.w2_weight_scale.shape) == (E, 256, 8)
    assert [c[1][0] for c in _calls("e8m0_shuffle")] == [(E * 512, 8), (E * 256, 8)]   # 2-D views, no padding
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(BF16)
    tw, ids = routing(T, E, K)
    fake_aiter.CALLS.clear()
    y = layer(x, tw, ids)
    (_, (hs, w1, w2, _, topk_ids), kw), = _calls("fused_moe")
    assert hs.shape == (T, 256) and hs[:, H:].abs().max() == 0     # hidden_states carry the zero pad columns
    assert w1 is layer.w13_weight and w2 is layer.w2_weight and topk_ids.dtype == torch.int32
    assert kw["quant_type"] == fake_aiter.QuantType.per_1x32 and kw["gate_mode"] == "separated"
    assert kw["swiglu_limit"] == 10.0 and kw["hidden_pad"] == 32 and kw["intermediate_pad"] == 192
    assert kw["w1_scale"] is layer.w13_weight_scale and y.shape == (T, H)
    _, ref = _torch_run(make, x, tw, ids)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_mxfp4_even_checkpoint_warns_about_roundup(aiter_backend, caplog):
    layer = _layer(quark_config(), "mxfp4", "weight_scale", 8, 256, 256, MoEContract())
    with caplog.at_level("WARNING"):
        layer(torch.randn(3, 256).to(BF16), *routing(3, 8, 2))
    assert "RoundUp" in caplog.text


def test_fake_honours_gate_mode(aiter_backend):
    """Guard for the contract test itself: the fake would give a different answer for 'interleave'."""
    layer = _layer(fp8_config(), "fp8", "weight_scale_inv", 8, 256, 128, MoEContract())
    x = torch.randn(5, 256).to(BF16)
    tw, ids = routing(5, 8, 2)
    a = fake_aiter.fused_moe(x, layer.w13_weight, layer.w2_weight, tw, ids.int(), quant_type=fake_aiter.QuantType.per_128x128,
                             w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv, gate_mode="separated")
    b = fake_aiter.fused_moe(x, layer.w13_weight, layer.w2_weight, tw, ids.int(), quant_type=fake_aiter.QuantType.per_128x128,
                             w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv, gate_mode="interleave")
    assert (a.float() - b.float()).abs().max() > 0.1 * a.float().abs().max()


def test_unsupported_runner_fails_at_construction(aiter_backend):
    with pytest.raises(UnsupportedQuantSchemeError, match=r"'model\.layers\.1\.mlp\.experts'.*'aiter'.*128x128"):
        FusedMoE(8, 256, 128, quant_config=fp8_config(weight_block_size=[64, 128]), prefix=PFX, params_dtype=BF16,
                 contract=MoEContract())


def test_fake_layouts_are_inverses():
    g = torch.Generator().manual_seed(9)
    w = torch.randint(0, 256, (3, 64, 96), generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(fake_aiter._unshuffle(fake_aiter.shuffle_weight(w)), w)
    assert torch.equal(fake_aiter.shuffle_weight(w), ref_shuffle(w))          # matches glm_ray's own reference
    s = torch.randint(0, 256, (512, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(fake_aiter._e8m0_unshuffle(fake_aiter.e8m0_shuffle(s)), s)


# ---------------------------------------------------------------------------------------- MLA decode

R, DR, MLA_BS = 512, 64, 4                                # aiter's kernels: latent 512 + rope 64; block size 4
CTX = [5, 12, 1, 9]                                       # decode contexts (one group), block_size 4


def _decode_group(context_lens, seed=0):
    """One decode step over shuffled (non-contiguous) block tables -> (group, num_slots)."""
    from glm_ray.forward_batch import build_forward_batch
    g = torch.Generator().manual_seed(seed)
    nb = [-(-c // MLA_BS) for c in context_lens]
    perm = torch.randperm(sum(nb) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n])
        i += n
    batch = build_forward_batch([1] * len(context_lens), context_lens, tables, MLA_BS, torch.device("cpu"))
    (group,) = batch.groups
    assert group.mla_mode == "absorbed" and group.q_index.shape[1] == 1
    return group, len(perm) * MLA_BS


def _mla_decode_inputs(h, context_lens=CTX, seed=0):
    group, S = _decode_group(context_lens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(context_lens), h, R + DR, generator=g).to(BF16)
    cache = torch.randn(S, R + DR, generator=g).to(BF16)
    return q, cache, group


def _topk_positions(group, k, seed=0):
    """int32 [B, 1, k]: a random subset of each context's positions, -1 padded (at the end, and one
    row with -1 in the middle)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in group.context_lens.tolist():
        p = torch.randperm(c, generator=g)[:k].tolist()
        rows.append(p + [-1] * (k - len(p)))
    rows[0] = [rows[0][0], -1] + rows[0][1:-1]                 # a hole: -1 need not be a suffix
    return torch.tensor(rows, dtype=torch.int32)[:, None, :]


def _ref_mla_decode(q, cache, group, sel, scale):
    from glm_ray.kernels.torch_ref.attention import mla_decode
    return mla_decode(q, cache, group, sel, kv_lora_rank=R, scale=scale)


@pytest.mark.parametrize("h", [16, 20])                   # 20: zero-padded to aiter's 32-head kernel
@pytest.mark.parametrize("sparse", [False, True])
def test_mla_decode_matches_reference(aiter_backend, h, sparse):
    ops = aiter_backend
    q, cache, group = _mla_decode_inputs(h)
    sel = _topk_positions(group, 6) if sparse else None
    scale = 192 ** -0.5
    out = ops.mla_decode(q, cache, group, sel, kv_lora_rank=R, scale=scale)
    (_, (qk, kv, o, qo_indptr, kv_indptr, kv_indices, last), kw), = _calls("mla_decode_fwd")
    B = len(CTX)
    hp = 16 if h == 16 else 32
    assert qk.shape == (B, hp, R + DR) and o.shape == (B, hp, R) and kv.shape == (cache.shape[0], 1, 1, R + DR)
    assert kv.data_ptr() == cache.data_ptr() and kw["max_seqlen_q"] == 1 and kw["sm_scale"] == scale
    assert qo_indptr.tolist() == list(range(B + 1)) and last.tolist() == [1] * B
    counts = group.context_lens.tolist() if not sparse else [int((r >= 0).sum()) for r in sel[:, 0]]
    assert kv_indptr.diff().tolist() == counts                  # page size 1: one index per attended key
    ref = _ref_mla_decode(q, cache, group, sel, scale)
    assert out.shape == ref.shape == (B, h, R)
    # both compute in fp32 and round to bf16 once: ~1 bf16 ulp apart (values |o| < 4)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_mla_page_table_slots():
    from glm_ray.kernels.aiter.ops import mla_page_table
    group, _ = _decode_group(CTX)
    bt, bs = group.block_table.long(), MLA_BS
    indptr, idx = mla_page_table(group.block_table, group.context_lens, bs, None, max(CTX) + 3)
    assert indptr.dtype == idx.dtype == torch.int32 and idx.shape == (len(CTX) * (max(CTX) + 3),)
    for b, c in enumerate(group.context_lens.tolist()):        # dense: every position, in order
        want = [int(bt[b, p // bs]) * bs + p % bs for p in range(c)]
        assert idx[indptr[b]:indptr[b + 1]].tolist() == want
    sel = _topk_positions(group, 6)[:, 0]
    indptr, idx = mla_page_table(group.block_table, group.context_lens, bs, sel, 0)
    for b, row in enumerate(sel.tolist()):                     # sparse: the valid picks, in pick order
        want = [int(bt[b, p // bs]) * bs + p % bs for p in row if p >= 0]
        assert idx[indptr[b]:indptr[b + 1]].tolist() == want
    assert (idx[indptr[-1]:] == 0).all()


def test_mla_decode_graph_capacity(aiter_backend):
    """A CUDA-graph group (kv_capacity: static key width past every context) gives the same answer."""
    import dataclasses
    q, cache, group = _mla_decode_inputs(16)
    cap = dataclasses.replace(group, kv_capacity=group.block_table.shape[1] * MLA_BS + 8, _views=None)
    a = aiter_backend.mla_decode(q, cache, group, None, kv_lora_rank=R, scale=0.05)
    b = aiter_backend.mla_decode(q, cache, cap, None, kv_lora_rank=R, scale=0.05)
    (_, args_a, _), (_, args_b, _) = _calls("mla_decode_fwd")
    assert args_b[5].numel() == len(CTX) * cap.kv_capacity and torch.equal(args_a[4], args_b[4])
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mla_decode_fallbacks(aiter_backend):
    """Bool-mask selections, fp32 inputs and other latent widths go to the reference, without aiter."""
    ops = aiter_backend
    q, cache, group = _mla_decode_inputs(16)
    mask = group.causal.clone()
    mask[:, :, 1::2] = False
    mask[:, :, 0] = True
    for args, kw in [((q, cache, group, mask), dict(kv_lora_rank=R)),
                     ((q.float(), cache.float(), group, None), dict(kv_lora_rank=R)),
                     ((q[..., :R], cache[:, :R].contiguous(), group, None), dict(kv_lora_rank=R - DR))]:
        out = ops.mla_decode(*args, scale=0.05, **kw)
        ref = _ref_mla_decode(*args, 0.05) if kw["kv_lora_rank"] == R else None
        if ref is not None:
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not _calls("mla_decode_fwd")


def test_fake_mla_decode_rejects_wrong_contract():
    """The fake enforces the binding's contract: int64 indptr, a 2-D cache, a non-contiguous q all fail."""
    q, cache, group = _mla_decode_inputs(16)
    B = len(CTX)
    qk = q[:B].contiguous()
    o = torch.empty(B, 16, R, dtype=BF16)
    qo = torch.arange(B + 1, dtype=torch.int32)
    indptr = torch.arange(B + 1, dtype=torch.int32)
    idx = torch.zeros(B, dtype=torch.int32)
    last = torch.ones(B, dtype=torch.int32)
    kv = cache.view(-1, 1, 1, R + DR)
    fake_aiter.mla_decode_fwd(qk, kv, o, qo, indptr, idx, last, 1, sm_scale=0.1)     # the right call passes
    with pytest.raises(AssertionError, match="kv_indptr must be int32"):
        fake_aiter.mla_decode_fwd(qk, kv, o, qo, indptr.long(), idx, last, 1, sm_scale=0.1)
    with pytest.raises(AssertionError, match="kv_buffer must be"):
        fake_aiter.mla_decode_fwd(qk, cache, o, qo, indptr, idx, last, 1, sm_scale=0.1)
    with pytest.raises(AssertionError, match="contiguous"):
        fake_aiter.mla_decode_fwd(q.transpose(0, 1).contiguous().transpose(0, 1), kv, o, qo, indptr, idx, last, 1)


# ---------------------------------------------------------------------------------------- MoE routing

def _router_inputs(T, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * 2, torch.randn(E, generator=g) * 0.1


@pytest.mark.parametrize("E,top_k,n_group,topk_group,renorm,biased", [
    (64, 4, 1, 1, True, True),          # GLM-5 style: one group
    (64, 6, 1, 1, False, True),         # unnormalized: > 32 experts per group, the HIP kernel only
    (32, 4, 8, 3, True, True),          # DeepSeek style groups
    (16, 2, 1, 1, True, False),         # bias None: selection on the plain scores
])
def test_moe_routing_matches_reference(aiter_backend, E, top_k, n_group, topk_group, renorm, biased):
    from glm_ray.kernels.torch_ref.routing import moe_routing as ref_routing
    logits, bias = _router_inputs(7, E)
    bias = bias if biased else None
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renorm, scale=2.5)
    w, ids = aiter_backend.moe_routing(logits, bias, **kw)
    (_, (gating, b, tw, tid), ckw), = _calls("biased_grouped_topk")
    assert gating.dtype == b.dtype == torch.float32 and ckw["num_expert_group"] == n_group
    assert ckw["need_renorm"] is renorm and ckw["routed_scaling_factor"] == 2.5
    assert not torch.equal(tid, ids)                           # the fake's id order was re-sorted by score
    rw, rids = ref_routing(logits, bias, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)


def test_moe_routing_fallbacks(aiter_backend):
    from glm_ray.kernels.torch_ref.routing import moe_routing as ref_routing
    logits, bias = _router_inputs(5, 32)
    for kw in [dict(top_k=4, n_group=4, topk_group=2, renormalize=True, scale=1.0),     # n_group 4
               dict(top_k=4, n_group=1, topk_group=1, renormalize=False, scale=1.0)]:   # fused-gate may run
        w, ids = aiter_backend.moe_routing(logits, bias, **kw)
        rw, rids = ref_routing(logits, bias, **kw)
        assert torch.equal(ids, rids) and torch.equal(w, rw)
    assert not _calls("biased_grouped_topk")
