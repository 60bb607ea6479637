"""Quant methods on single layers (CPU, torch backend): per-layer decisions, load -> process -> apply vs
the references, the MoE contract (clamp, padding, gate layout), TP block rules, errors at construction."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from glm_ray import kernels
from glm_ray.config import ModelConfig
from glm_ray.kernels.torch_ref.fp8 import block_fp8_linear, dequant_block_fp8
from glm_ray.kernels.torch_ref.moe_quant import fused_moe_act_qdq, qdq_fp8_1x128
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4, mxfp4_linear, qdq_mxfp4
from glm_ray.kernels.torch_ref.quant_ops import MoEQuantLayout
from glm_ray.layer_contracts import GateMode, MoEContract
from glm_ray.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from glm_ray.layers.moe import FusedMoE, MoE
from glm_ray.model.base import _checkpoint_names
from glm_ray.model.tiny import bundled_config
from glm_ray.quant import Unquantized
from glm_ray.quant.config import UnsupportedQuantSchemeError, parse_quant_config
from glm_ray.quant.dispatch import SpecQuantConfig
from glm_ray.quant.fp8 import Fp8BlockLinearMethod, Fp8BlockMoEMethod
from glm_ray.quant.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
from glm_ray.quant.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod
from tests.quant.helpers import (
    expert_tensors,
    expert_weights,
    fp8_config,
    load_module,
    quantize_tensor,
    quark_config,
    routing,
)

E, H, I, T, K = 8, 256, 64, 12, 2
PFX = "model.layers.1.mlp.experts"
F32 = torch.float32


@pytest.fixture(autouse=True)
def torch_backend():
    kernels.init_backend("torch")
    yield
    kernels.init_backend("torch")


def _moe(qcfg, contract=MoEContract(), prefix=PFX, e=E, h=H, i=I, tp=1) -> FusedMoE:
    return FusedMoE(e, h, i, quant_config=qcfg, prefix=prefix, params_dtype=F32, contract=contract, tp=tp)


def _deq_experts(wg, wu, wd, fmt, **kw):
    """What the checkpoint holds, dequantized: w13 [E, 2I, H], w2 [E, H, I] (fp32)."""
    def dq(w):
        q, s = quantize_tensor(w, fmt, **kw)
        return dequant_block_fp8(q, s) if fmt == "fp8" else dequant_mxfp4(q, s)
    w13 = torch.stack([torch.cat([dq(wg[e]), dq(wu[e])]) for e in range(wg.shape[0])])
    w2 = torch.stack([dq(wd[e]) for e in range(wg.shape[0])])
    return w13, w2


# ---------------------------------------------------------------------------------------- decisions

def test_get_method_follows_the_config_per_layer():
    qc = fp8_config(ignored_layers=["lm_head", "model.layers.1.self_attn.kv_b_proj", "re:.*\\.eh_proj$"])
    mk = lambda cls, p, **kw: cls(128, 256, quant_config=qc, prefix=p, params_dtype=F32, **kw)   # noqa: E731
    assert isinstance(mk(ColumnParallelLinear, "model.layers.1.self_attn.q_b_proj").quant_method, Fp8BlockLinearMethod)
    # release-dependent: this config lists kv_b_proj -> bf16; another config may not
    assert isinstance(mk(ColumnParallelLinear, "model.layers.1.self_attn.kv_b_proj").quant_method,
                      UnquantizedLinearMethod)
    assert isinstance(mk(ReplicatedLinear, "model.layers.4.eh_proj").quant_method, UnquantizedLinearMethod)
    merged = MergedColumnParallelLinear(256, [128, 128], quant_config=qc, prefix="model.layers.0.mlp.gate_up_proj",
                                        params_dtype=F32)
    assert isinstance(merged.quant_method, Fp8BlockLinearMethod)
    assert qc.decisions["model.layers.0.mlp.gate_up_proj"].kind == "fp8_block"
    assert isinstance(_moe(qc).quant_method, Fp8BlockMoEMethod)
    # gate_up is decided from its checkpoint modules: ignoring only one of them is an error, naming the layer
    half = fp8_config(ignored_layers=["model.layers.0.mlp.gate_proj"])
    with pytest.raises(UnsupportedQuantSchemeError, match=r"model\.layers\.0\.mlp\.gate_up_proj"):
        MergedColumnParallelLinear(256, [128, 128], quant_config=half, prefix="model.layers.0.mlp.gate_up_proj",
                                   params_dtype=F32)

    qq = quark_config(exclude=["re:.*self_attn.*", "model.layers.1.mlp.shared_experts.gate_proj",
                               "model.layers.1.mlp.shared_experts.up_proj"], fp8_pattern="model.layers.4.*")
    assert isinstance(_moe(qq).quant_method, Mxfp4MoEMethod)
    mtp = _moe(qq, prefix="model.layers.4.mlp.experts")
    assert isinstance(mtp.quant_method, Fp8BlockMoEMethod)
    assert mtp.w13_weight_scale_inv.checkpoint_suffix == "weight_scale"          # Quark naming on disk
    excluded = ColumnParallelLinear(128, 256, quant_config=qq, prefix="model.layers.1.self_attn.q_b_proj",
                                    params_dtype=F32)
    assert isinstance(excluded.quant_method, UnquantizedLinearMethod)
    unq = MergedColumnParallelLinear(256, [64, 64], quant_config=qq, prefix="model.layers.1.mlp.shared_experts.gate_up_proj",
                                     params_dtype=F32)
    assert isinstance(unq.quant_method, UnquantizedLinearMethod)


def test_unsupported_scheme_fails_at_construction_naming_layer_and_scheme():
    pc = parse_quant_config({"quant_method": "quark", "global_quant_config": {
        "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False},
        "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": True}}})
    with pytest.raises(UnsupportedQuantSchemeError,
                       match=r"layer 'model\.layers\.2\.self_attn\.o_proj'.*fp8_e4m3/per_channel.*per_block"):
        RowParallelLinear(256, 256, quant_config=SpecQuantConfig(pc), prefix="model.layers.2.self_attn.o_proj",
                          params_dtype=F32)
    spec = parse_quant_config({"quant_method": "quark", "global_quant_config": {
        "weight": {"dtype": "int8", "qscheme": "per_channel", "is_dynamic": False}}})
    with pytest.raises(UnsupportedQuantSchemeError, match=r"'model\.layers\.1\.mlp\.experts'.*int8"):
        _moe(SpecQuantConfig(spec))
    with pytest.raises(UnsupportedQuantSchemeError, match=r"'model\.layers\.1\.mlp\.experts'.*multiples of 32"):
        _moe(quark_config(), h=240)


def test_tp_shards_must_be_whole_blocks():
    qc = fp8_config()
    with pytest.raises(UnsupportedQuantSchemeError, match=r"q_b_proj.*whole 128-row blocks"):
        ColumnParallelLinear(256, 384, quant_config=qc, prefix="model.layers.0.self_attn.q_b_proj",
                             params_dtype=F32, tp=2)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"o_proj.*whole 128-col blocks"):
        RowParallelLinear(384, 256, quant_config=qc, prefix="model.layers.0.self_attn.o_proj", params_dtype=F32, tp=2)
    ok = ColumnParallelLinear(256, 512, quant_config=qc, prefix="model.layers.0.self_attn.q_b_proj",
                              params_dtype=F32, tp=2)
    assert tuple(ok.weight_scale_inv.shape) == (2, 2) and tuple(ok.weight.shape) == (256, 256)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"experts.*whole 128-row blocks"):
        _moe(qc, i=128, tp=2)


# ---------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_linear_load_apply_dequant(ue8m0):
    g = torch.Generator().manual_seed(0)
    n, k = 200, 384                                            # N not a multiple of 128: partial last block row
    w = torch.randn(n, k, generator=g) / k ** 0.5
    q, s = quantize_tensor(w, "fp8", ue8m0=ue8m0)
    qc = fp8_config(**({"scale_fmt": "ue8m0"} if ue8m0 else {}))
    prefix = "model.layers.0.self_attn.q_b_proj"
    lin = ColumnParallelLinear(k, n, quant_config=qc, prefix=prefix, params_dtype=F32)
    assert lin.weight.dtype == torch.float8_e4m3fn and tuple(lin.weight_scale_inv.shape) == (2, 3)
    load_module(lin, prefix, {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s})
    x = torch.randn(5, k, generator=g)
    y = lin(x)
    torch.testing.assert_close(y, block_fp8_linear(x, q, s, act_ue8m0=ue8m0), rtol=0, atol=0)
    torch.testing.assert_close(lin.quant_method.dequantized_weight(lin), dequant_block_fp8(q, s), rtol=0, atol=0)
    # W8A8 vs the float layer: e4m3 weights (rel. rounding <= 2^-4) and activations (same) -> a few % of |y|
    ref = x @ w.T
    assert ((y - ref).norm() / ref.norm()).item() < 0.06


def test_fp8_merged_linear_with_partial_blocks_keeps_shard_scales():
    """Shared expert of the tiny model: gate/up of 64 rows each -> one scale row per shard, GEMM per shard."""
    g = torch.Generator().manual_seed(1)
    wg, wu = torch.randn(64, 256, generator=g) * 0.05, torch.randn(64, 256, generator=g) * 3.0   # very different scales
    (qg, sg), (qu, su) = quantize_tensor(wg, "fp8"), quantize_tensor(wu, "fp8")
    prefix = "model.layers.1.mlp.shared_experts.gate_up_proj"
    lin = MergedColumnParallelLinear(256, [64, 64], quant_config=fp8_config(), prefix=prefix, params_dtype=F32)
    assert tuple(lin.weight_scale_inv.shape) == (2, 2)
    base = "model.layers.1.mlp.shared_experts."
    load_module(lin, prefix, {base + "gate_proj.weight": qg, base + "gate_proj.weight_scale_inv": sg,
                              base + "up_proj.weight": qu, base + "up_proj.weight_scale_inv": su})
    x = torch.randn(3, 256, generator=g)
    ref = torch.cat([block_fp8_linear(x, qg, sg), block_fp8_linear(x, qu, su)], -1)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(lin.quant_method.dequantized_weight(lin),
                               torch.cat([dequant_block_fp8(qg, sg), dequant_block_fp8(qu, su)]), rtol=0, atol=0)


def test_mxfp4_dense_linear_for_quark_shared_experts():
    g = torch.Generator().manual_seed(2)
    wg, wu = torch.randn(64, 256, generator=g) * 0.1, torch.randn(64, 256, generator=g)
    (pg, sg), (pu, su) = quantize_tensor(wg, "mxfp4"), quantize_tensor(wu, "mxfp4")
    prefix = "model.layers.1.mlp.shared_experts.gate_up_proj"
    lin = MergedColumnParallelLinear(256, [64, 64], quant_config=quark_config(), prefix=prefix, params_dtype=F32)
    assert isinstance(lin.quant_method, Mxfp4LinearMethod) and lin.weight.dtype == torch.uint8
    base = "model.layers.1.mlp.shared_experts."
    load_module(lin, prefix, {base + "gate_proj.weight": pg, base + "gate_proj.weight_scale": sg,
                              base + "up_proj.weight": pu, base + "up_proj.weight_scale": su})
    x = torch.randn(3, 256, generator=g)
    ref = torch.cat([mxfp4_linear(x, pg, sg, act_mode="even"), mxfp4_linear(x, pu, su, act_mode="even")], -1)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"o_proj.*multiple of 32"):
        RowParallelLinear(96, 256, quant_config=quark_config(), prefix="model.layers.1.self_attn.o_proj",
                          params_dtype=F32, tp=2)


def _fp8_layers():
    """(name, layer, in features) of each linear method: unquantized, block FP8 (one GEMM; merged shards: a GEMM
    per shard), MXFP4 (its default `apply_into`)."""
    g = torch.Generator().manual_seed(7)
    out = []
    un = ColumnParallelLinear(128, 96, quant_config=Unquantized(), prefix="lm_head", params_dtype=F32)
    assert isinstance(un.quant_method, UnquantizedLinearMethod)
    un.weight.data.copy_(torch.randn(96, 128, generator=g))
    out.append(("unquantized", un, 128))
    prefix = "model.layers.0.self_attn.q_b_proj"
    lin = ColumnParallelLinear(384, 200, quant_config=fp8_config(), prefix=prefix, params_dtype=F32)
    q, s = quantize_tensor(torch.randn(200, 384, generator=g) / 20, "fp8")
    load_module(lin, prefix, {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s})
    out.append(("fp8", lin, 384))
    base = "model.layers.1.mlp.shared_experts."
    for name, qc, fmt, scale in (("fp8-merged", fp8_config(), "fp8", "weight_scale_inv"),
                                 ("mxfp4", quark_config(), "mxfp4", "weight_scale")):
        m = MergedColumnParallelLinear(256, [64, 64], quant_config=qc, prefix=base + "gate_up_proj", params_dtype=F32)
        (pg, sg), (pu, su) = (quantize_tensor(torch.randn(64, 256, generator=g) / 16, fmt) for _ in range(2))
        load_module(m, base + "gate_up_proj", {base + "gate_proj.weight": pg, base + f"gate_proj.{scale}": sg,
                                               base + "up_proj.weight": pu, base + f"up_proj.{scale}": su})
        out.append((name, m, 256))
    return out


def test_linear_writes_into_out():
    """`layer(x, out)` (`LinearMethod.apply_into`: the piecewise graphs' projections into their static carry)
    writes `out` — a row range of a larger buffer — returns it, equals `layer(x)` exactly and touches nothing
    else of the buffer."""
    for name, lin, k in _fp8_layers():
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
        want = lin(x)
        store = torch.full((9, want.shape[1]), float("nan"))
        got = lin(x, store[2:7])
        assert got.data_ptr() == store[2:7].data_ptr(), name
        torch.testing.assert_close(store[2:7], want, rtol=0, atol=0, msg=name)
        assert store[:2].isnan().all() and store[7:].isnan().all(), name


def test_quark_block_fp8_linear_reads_weight_scale_from_disk():
    qq = quark_config(fp8_pattern="model.layers.4.*")
    prefix = "model.layers.4.self_attn.q_b_proj"
    lin = ColumnParallelLinear(128, 256, quant_config=qq, prefix=prefix, params_dtype=F32)
    names = [n for n, _ in _checkpoint_names(f"{prefix}.weight_scale_inv", lin)]
    assert names == [f"{prefix}.weight_scale"]                  # runtime weight_scale_inv <- disk weight_scale
    q, s = quantize_tensor(torch.randn(256, 128), "fp8")
    load_module(lin, prefix, {f"{prefix}.weight": q, f"{prefix}.weight_scale": s})
    assert torch.equal(lin.weight_scale_inv, s)


def test_bf16_tensor_where_config_says_fp8_is_a_clear_error():
    from glm_ray.weights import WeightError
    prefix = "model.layers.0.self_attn.kv_b_proj"
    lin = ColumnParallelLinear(128, 256, quant_config=fp8_config(), prefix=prefix, params_dtype=F32)
    with pytest.raises(WeightError, match=r"kv_b_proj.*BF16.*ignored_layers"):
        load_module(lin, prefix, {f"{prefix}.weight": torch.randn(256, 128).bfloat16()}, strict=False, process=False)


# ---------------------------------------------------------------------------------------- MoE

def _fp8_moe(contract=MoEContract(), prefix=PFX, seed=0, gate_scale=1.0):
    wg, wu, wd = expert_weights(E, H, I, seed=seed, scale=gate_scale)
    layer = _moe(fp8_config(), contract, prefix)
    load_module(layer, prefix, expert_tensors(prefix, wg, wu, wd, "fp8", "weight_scale_inv"))
    return layer, (wg, wu, wd)


def _mx_moe(contract=MoEContract(), prefix=PFX, seed=0, gate_scale=1.0, mode="even"):
    wg, wu, wd = expert_weights(E, H, I, seed=seed, scale=gate_scale)
    layer = _moe(quark_config(scale_mode=mode), contract, prefix)
    load_module(layer, prefix, expert_tensors(prefix, wg, wu, wd, "mxfp4", "weight_scale", mode=mode))
    return layer, (wg, wu, wd)


def test_fp8_moe_matches_reference_with_per_half_scales():
    layer, (wg, wu, wd) = _fp8_moe()
    assert tuple(layer.w13_weight_scale_inv.shape) == (E, 2, 2)      # I=64: one block row per half
    x = torch.randn(T, H)
    tw, ids = routing(T, E, K)
    w13, w2 = _deq_experts(wg, wu, wd, "fp8")
    ref = fused_moe_act_qdq(x, w13, w2, tw, ids, act_qdq=qdq_fp8_1x128)
    torch.testing.assert_close(layer(x, tw, ids), ref, rtol=1e-5, atol=1e-6)


def test_mxfp4_moe_matches_reference():
    layer, (wg, wu, wd) = _mx_moe()
    assert layer.w13_weight.dtype == torch.uint8 and tuple(layer.w13_weight.shape) == (E, 2 * I, H // 2)
    assert tuple(layer.w2_weight_scale.shape) == (E, H, I // 32)
    x = torch.randn(T, H)
    tw, ids = routing(T, E, K)
    w13, w2 = _deq_experts(wg, wu, wd, "mxfp4")
    ref = fused_moe_act_qdq(x, w13, w2, tw, ids, act_qdq=lambda a: qdq_mxfp4(a, "even"))
    torch.testing.assert_close(layer(x, tw, ids), ref, rtol=1e-5, atol=1e-6)


def _spy(monkeypatch, field):
    calls = []
    real = getattr(kernels.ops(), field)

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(kernels, "_ACTIVE", dataclasses.replace(kernels.ops(), **{field: spy}))
    return calls


@pytest.mark.parametrize("mode", ["even", "round_up"])
def test_mxfp4_activation_mode_follows_scale_calculation_mode(monkeypatch, mode):
    layer, _ = _mx_moe(mode=mode)
    calls = _spy(monkeypatch, "fused_moe_mxfp4")
    layer(torch.randn(4, H), *routing(4, E, K))
    assert calls[0]["act_mode"] == mode


def test_clamp_is_applied_on_fp8_and_mxfp4_paths():
    """A config with swiglu_limit=10 and gate pre-activations far beyond it: the result equals the clamped
    reference and is far from the unclamped one, on both quantized paths (config -> MoE contract -> runner)."""
    hf = bundled_config()
    hf.update(swiglu_limit=10.0, n_routed_experts=E, hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K)
    cfg = ModelConfig.from_hf(hf, dtype="float32")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    for fmt, qc, scale_name in (("fp8", fp8_config(), "weight_scale_inv"),
                                ("mxfp4", quark_config(), "weight_scale")):      # shared experts MXFP4 too
        moe = MoE(cfg, quant_config=qc, prefix="model.layers.1.mlp", params_dtype=F32, tp=1)
        assert moe.experts.contract.swiglu_limit == 10.0
        wg, wu, wd = expert_weights(E, H, I, seed=4, scale=40.0)     # |gate|, |up| ~ 40 >> 10
        load_module(moe.experts, PFX, expert_tensors(PFX, wg, wu, wd, fmt, scale_name))
        tw, ids = routing(T, E, K, seed=5)
        w13, w2 = _deq_experts(wg, wu, wd, fmt)
        qdq = qdq_fp8_1x128 if fmt == "fp8" else (lambda a: qdq_mxfp4(a, "even"))
        h = qdq(x) @ w13[0].T                                           # expert 0's [gate | up] pre-activations
        assert h[:, :I].abs().max() > 10 * 3, "test needs |gate| well above the limit"
        got = moe.experts(x, tw, ids)
        clamped = fused_moe_act_qdq(x, w13, w2, tw, ids, act_qdq=qdq, swiglu_limit=10.0)
        unclamped = fused_moe_act_qdq(x, w13, w2, tw, ids, act_qdq=qdq, swiglu_limit=None)
        torch.testing.assert_close(got, clamped, rtol=1e-5, atol=1e-5)
        assert (got - unclamped).abs().max() > 0.5 * unclamped.abs().max(), fmt


def test_no_limit_means_no_clamp():
    layer, (wg, wu, wd) = _fp8_moe(gate_scale=40.0)
    assert layer.contract.swiglu_limit is None
    x, (tw, ids) = torch.randn(T, H), routing(T, E, K)
    w13, w2 = _deq_experts(wg, wu, wd, "fp8")
    torch.testing.assert_close(layer(x, tw, ids), fused_moe_act_qdq(x, w13, w2, tw, ids, act_qdq=qdq_fp8_1x128),
                               rtol=1e-5, atol=1e-5)


@pytest.fixture
def padded_backend():
    """The torch runners behind a layout that asks for padding (as aiter does): D += 128, I += 64 (fp8)
    and D += 32, I += 96 (mxfp4)."""
    pads = {"fp8_block": MoEQuantLayout(hidden_pad=128, intermediate_pad=64),
            "mxfp4": MoEQuantLayout(hidden_pad=32, intermediate_pad=96)}
    kernels.register("torch-padded")(lambda: dataclasses.replace(
        kernels._torch_ops(), name="torch-padded", moe_quant_layout=lambda kind, *a, **k: pads[kind]))
    kernels.init_backend("torch-padded")
    yield pads
    kernels._REGISTRY.pop("torch-padded", None)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_padding_is_recorded_forwarded_and_neutral(padded_backend, monkeypatch, fmt):
    make = _fp8_moe if fmt == "fp8" else _mx_moe
    contract = MoEContract(swiglu_limit=7.0)
    padded, _ = make(contract)
    want = padded_backend["fp8_block" if fmt == "fp8" else "mxfp4"]
    assert (padded.contract.hidden_pad, padded.contract.intermediate_pad) == (want.hidden_pad, want.intermediate_pad)
    assert padded.contract.swiglu_limit == 7.0 and padded.quant_runner == "torch-padded"
    packed = 2 if fmt == "mxfp4" else 1
    assert padded.w13_weight.shape[1] == 2 * (I + want.intermediate_pad)
    assert padded.w13_weight.shape[2] * packed == H + want.hidden_pad
    field = "fused_moe_block_fp8" if fmt == "fp8" else "fused_moe_mxfp4"
    calls = _spy(monkeypatch, field)
    x, (tw, ids) = torch.randn(T, H) * 3, routing(T, E, K)
    y_pad = padded(x, tw, ids)
    assert calls[0]["hidden_pad"] == want.hidden_pad and calls[0]["intermediate_pad"] == want.intermediate_pad
    assert calls[0]["gate_mode"] == "separated" and calls[0]["swiglu_limit"] == 7.0
    monkeypatch.undo()
    kernels.init_backend("torch")
    plain, _ = make(contract)
    assert plain.contract.hidden_pad == plain.contract.intermediate_pad == 0
    # zeros change only the fp32 summation order (GEMM blocking), which can flip an FP8/MXFP4 rounding of
    # the re-quantized stage-2 input by one step on a few elements: ~1e-5 here vs outputs of ~1
    torch.testing.assert_close(y_pad, plain(x, tw, ids), rtol=1e-3, atol=5e-5)


def test_interleaved_source_is_regrouped_for_mxfp4_and_refused_for_fp8():
    sep, _ = _mx_moe()
    il = _moe(quark_config(), MoEContract(gate_mode=GateMode.INTERLEAVED))
    from glm_ray.kernels.torch_ref.aiter_layout import interleave_gate_up_rows
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        src = getattr(sep, name).data
        getattr(il, name).data.copy_(interleave_gate_up_rows(src) if name.startswith("w13") else src)
    il.quant_method.process_weights_after_loading(il)
    assert il.contract.gate_mode == GateMode.SEPARATED
    x, (tw, ids) = torch.randn(T, H), routing(T, E, K)
    torch.testing.assert_close(il(x, tw, ids), sep(x, tw, ids), rtol=0, atol=0)
    with pytest.raises(UnsupportedQuantSchemeError, match=r"experts.*interleaved"):
        _moe(fp8_config(), MoEContract(gate_mode=GateMode.INTERLEAVED))


def test_weights_are_bound_to_the_runner_that_prepared_them():
    layer, _ = _fp8_moe()
    kernels.register("other")(lambda: dataclasses.replace(kernels._torch_ops(), name="other"))
    try:
        kernels.init_backend("other")
        with pytest.raises(RuntimeError, match=r"laid out for kernel backend 'torch'.*'other'"):
            layer(torch.randn(2, H), *routing(2, E, K))
    finally:
        kernels._REGISTRY.pop("other", None)


def test_unquantized_moe_unchanged_by_dispatch():
    spec = fp8_config(ignored_layers=["model.layers.1.mlp.experts"])
    assert isinstance(_moe(spec).quant_method, UnquantizedMoEMethod)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dummy_init_keeps_padding_zero(padded_backend, fmt):
    from glm_ray.model.loader import init_dummy_weights
    qc = fp8_config() if fmt == "fp8" else quark_config()
    layer = _moe(qc, MoEContract())

    class Model(torch.nn.Module):                               # init_dummy_weights ends with this hook
        def __init__(self):
            super().__init__()
            self.experts = layer

        def process_weights_after_loading(self):
            layer.quant_method.process_weights_after_loading(layer)
    init_dummy_weights(Model())
    for name, geom in layer.quant_geometry.items():
        t = getattr(layer, name).data
        mask = geom.pad_mask(t.shape, t.device).expand_as(t)
        raw = t.view(torch.uint8)
        pad_value = {"w13_weight_scale_inv": 1.0, "w2_weight_scale_inv": 1.0}.get(name)
        if pad_value is not None:
            assert bool((t[mask] == pad_value).all()), name
        else:
            want = 127 if name.endswith("_scale") else 0
            assert bool((raw[mask] == want).all()), name
        if name in ("w13_weight", "w2_weight"):
            assert bool((raw[~mask] != raw[~mask][0]).any()), name      # the real region got random values


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dummy_init_draws_big_tensors_in_bounded_slabs(monkeypatch, fmt):
    """A GLM-5 expert tensor drawn whole needs 4x its size in temporaries (the slice-6l model then overflows an
    80 GB card): the payload is drawn in slabs, every element is still drawn, and the scales are set."""
    from glm_ray.quant import runtime
    monkeypatch.setattr(runtime, "_DUMMY_SLAB_ELEMS", 1000)
    seen: list[int] = []
    real = torch.randn if fmt == "fp8" else torch.randint

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out.numel())
        return out
    monkeypatch.setattr(torch, "randn" if fmt == "fp8" else "randint", spy)
    w = torch.nn.Parameter(torch.zeros(6, 40, 64, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.uint8),
                           requires_grad=False)
    s = torch.nn.Parameter(torch.zeros(6, 1, 1, dtype=torch.float32 if fmt == "fp8" else torch.uint8),
                           requires_grad=False)
    (runtime.fp8_dummy_pair if fmt == "fp8" else runtime.mxfp4_dummy_pair)(w, s, 64)
    w.dummy_init(w, torch.Generator().manual_seed(0))
    assert sum(seen) == w.numel() and max(seen) <= 1000 and len(seen) > 1
    raw = w.data.view(torch.uint8).flatten()
    assert bool((raw.view(-1, 64) != 0).any(dim=1).all())      # no slab left undrawn (every 64-row drawn)
    if fmt == "fp8":
        x = w.data.float() * s.data                              # W ~ N(0, 1/fan_in)
        assert abs(x.std().item() * 64 ** 0.5 - 1.0) < 0.05 and bool((s.data == 64 ** -0.5 / 32).all())
