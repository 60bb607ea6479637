"""Block-FP8 methods (quant_contracts.md §2, §4): DeepSeek-V3 / zai-org GLM `quant_method: "fp8"` and
Quark per-layer block-FP8 entries (the MTP layer of amd/GLM-5.3-Flash-Quark-MXFP4).

Linear: `weight` float8_e4m3fn `[N, K]` + `weight_scale_inv` fp32 `[ceil(N/bn), ceil(K/bk)]` (the
dequant multiplier, despite the name; Quark names it `weight_scale` on disk — same tensor). Activations
are quantized dynamically per 1 x bk token group inside `kernels.ops().block_fp8_linear`, with
power-of-two scales when the checkpoint declares UE8M0 (`scale_fmt: "ue8m0"`).

Fused linears (gate_up_proj = gate_proj ; up_proj) keep each shard's own scale rows: the scale param
has `sum(ceil(N_i/bn))` rows. When every shard is a whole number of blocks that is the ordinary layout;
otherwise (tiny test shapes) `apply` runs one block-FP8 GEMM per shard, so no block straddles shards.

MoE: `w13_weight` e4m3 `[E, 2I', D']`, `w13_weight_scale_inv` `[E, 2*ceil(I'/bn), ceil(D'/bk)]` (gate
blocks then up blocks), `w2_weight` `[E, D', I']`, `w2_weight_scale_inv` `[E, ceil(D'/bn), ceil(I'/bk)]`,
where D' / I' include the padding the selected runner asked for (recorded on `layer.contract`).

TP: every per-rank shard must be whole blocks (GLM: I=2048 -> 256 per rank at TP8); otherwise model
construction fails naming the layer.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from glm_ray.kernels.torch_ref.aiter_layout import unshuffle_weight
from glm_ray.kernels.torch_ref.fp8 import FP8_DTYPE, dequant_block_fp8
from glm_ray.layer_contracts import GateMode
from glm_ray.quant.base import LinearMethod, MoEMethod
from glm_ray.quant.config import QuantScheme, UnsupportedQuantSchemeError
from glm_ray.quant.runtime import (
    MoEParamGeometry,
    bind_runner,
    cdiv,
    describe,
    fill_padding,
    fp8_dummy_pair,
    moe_param_loader,
    owned_ops,
    quantized_loader,
    set_checkpoint_suffix,
)
from glm_ray.weights import set_weight_attrs

SCALE_CKPT_DTYPES = frozenset({"F32", "BF16", "F8_E8M0"})   # fp32 (DeepSeek), bf16, e8m0 bytes (DSv4 style)
FP8_CKPT_DTYPES = frozenset({"F8_E4M3"})


class Fp8BlockLinearMethod(LinearMethod):
    def __init__(self, scheme: QuantScheme):
        if scheme.kind != "fp8_block" or scheme.block is None:
            raise ValueError(f"Fp8BlockLinearMethod needs an fp8_block scheme, got {scheme}")
        self.scheme = scheme
        self.block = scheme.block

    # ---- weights ----------------------------------------------------------------------------
    def create_weights(self, layer, in_features, out_features, params_dtype):
        bn, bk = self.block
        prefix = getattr(layer, "prefix", "?")
        tp = getattr(layer, "tp", 1)
        sizes = [s // tp for s in getattr(layer, "output_sizes", None) or []] or [out_features]
        role = getattr(layer, "tp_dim_role", None)
        if tp > 1 and role == "output" and any(s % bn for s in sizes):
            raise UnsupportedQuantSchemeError(prefix, "fp8_block " + describe(self.scheme),
                                              f"per-rank output rows {sizes} at tp={tp} are not whole {bn}-row blocks")
        if tp > 1 and role == "input" and in_features % bk:
            raise UnsupportedQuantSchemeError(prefix, "fp8_block " + describe(self.scheme),
                                              f"per-rank input {in_features} at tp={tp} is not whole {bk}-col blocks")
        srows = [cdiv(s, bn) for s in sizes]
        loader_w = quantized_loader(layer.weight_loader, prefix, self.scheme, "F8_E4M3 + a block scale")
        # NOTE: the scale is registered first so that init_dummy_weights' generic float init of it runs
        # before the weight's dummy_init, which (re)fills the pair consistently.
        scale = nn.Parameter(torch.empty(sum(srows), cdiv(in_features, bk), dtype=torch.float32), requires_grad=False)
        layer.register_parameter("weight_scale_inv", set_weight_attrs(
            scale, output_dim=0, input_dim=1, weight_loader=layer.weight_loader, ckpt_dtypes=SCALE_CKPT_DTYPES))
        set_checkpoint_suffix(scale, "weight_scale_inv", self.scheme.checkpoint_scale_name)
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(
            w, output_dim=0, input_dim=1, weight_loader=loader_w, ckpt_dtypes=FP8_CKPT_DTYPES))
        fp8_dummy_pair(w, scale, in_features)
        w.shard_units, scale.shard_units = sizes, srows        # merged layers: each shard's rows / blocks
        aligned = len(sizes) == 1 or all(s % bn == 0 for s in sizes[:-1])
        layer.fp8_shards = None if aligned else list(zip(sizes, srows))   # [(rows, scale rows)] per shard
        layer.fp8_out_dtype = params_dtype
        bind_runner(layer)

    def process_weights_after_loading(self, layer):
        ops = owned_ops(layer)
        if layer.fp8_shards is None:
            w, s, meta = ops.block_fp8_linear_prepare(layer.weight.data, layer.weight_scale_inv.data, self.block)
            layer.weight.data, layer.weight_scale_inv.data = w, s
            layer.weight.is_shuffled = bool(meta.get("preshuffled", False))
            layer.fp8_parts = None
            layer.fp8_meta = dict(meta)
            return
        parts, r0, s0 = [], 0, 0
        for rows, srows in layer.fp8_shards:
            parts.append(ops.block_fp8_linear_prepare(layer.weight.data[r0:r0 + rows],
                                                      layer.weight_scale_inv.data[s0:s0 + srows], self.block))
            r0, s0 = r0 + rows, s0 + srows
        layer.fp8_parts = parts
        layer.fp8_meta = {}

    # ---- math -------------------------------------------------------------------------------
    def apply(self, layer, x):
        return self._gemm(layer, x)

    def apply_into(self, layer, x, out):
        return self._gemm(layer, x, out)

    def _gemm(self, layer, x, out=None):
        """x [T, K] -> [T, N]: one block-FP8 GEMM (written into `out` when given, by the op where its kernel takes
        an output buffer), or a GEMM per merged shard, concatenated (then copied into `out`)."""
        ops = owned_ops(layer)
        kw = dict(act_ue8m0=self.scheme.act_ue8m0)
        if getattr(layer, "fp8_parts", None) is None:
            y = ops.block_fp8_linear(x, layer.weight, layer.weight_scale_inv, self.block, out=out,
                                     **kw, **getattr(layer, "fp8_meta", {}))
        else:
            y = torch.cat([ops.block_fp8_linear(x, w, s, self.block, **kw, **meta) for w, s, meta in layer.fp8_parts],
                          dim=-1)
        return y if out is None or y.data_ptr() == out.data_ptr() else out.copy_(y)

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The dense weight `[N, K]` in the layer's dtype (MLA absorbs kv_b_proj from it)."""
        w, s = layer.weight.data, layer.weight_scale_inv.data
        if getattr(layer, "fp8_meta", {}).get("preshuffled"):
            w = unshuffle_weight(w)
        dt = getattr(layer, "fp8_out_dtype", torch.float32)
        if layer.fp8_shards is None:
            return dequant_block_fp8(w, s, self.block, dtype=dt)
        out, r0, s0 = [], 0, 0
        for rows, srows in layer.fp8_shards:
            out.append(dequant_block_fp8(w[r0:r0 + rows], s[s0:s0 + srows], self.block, dtype=dt))
            r0, s0 = r0 + rows, s0 + srows
        return torch.cat(out, 0)


class Fp8BlockMoEMethod(MoEMethod):
    kind = "fp8_block"

    def __init__(self, scheme: QuantScheme):
        if scheme.kind != "fp8_block" or scheme.block is None:
            raise ValueError(f"Fp8BlockMoEMethod needs an fp8_block scheme, got {scheme}")
        self.scheme = scheme
        self.block = scheme.block

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        bn, bk = self.block
        prefix, c = layer.prefix, layer.contract
        desc = "fp8_block " + describe(self.scheme)
        if c.gate_mode != GateMode.SEPARATED:
            raise UnsupportedQuantSchemeError(
                prefix, desc, f"gate_mode {c.gate_mode.value}: interleaved gate/up rows cannot be regrouped into "
                f"separated halves without re-quantizing ({bn}-row scale blocks would mix gate and up rows)")
        if layer.tp > 1 and intermediate_size % bn:
            raise UnsupportedQuantSchemeError(prefix, desc, f"per-rank moe_intermediate_size {intermediate_size} at "
                                                            f"tp={layer.tp} is not whole {bn}-row blocks")
        ops = bind_runner(layer)
        d0, i0 = hidden_size + c.hidden_pad, intermediate_size + c.intermediate_pad
        lay = ops.moe_quant_layout(self.kind, num_experts, d0, i0, self.block)
        if lay.unsupported:
            raise UnsupportedQuantSchemeError(prefix, desc, f"kernel backend {ops.name!r}: {lay.unsupported}")
        hp, ip = c.hidden_pad + lay.hidden_pad, c.intermediate_pad + lay.intermediate_pad
        layer.contract = replace(c, hidden_pad=hp, intermediate_pad=ip)
        D, I, E = hidden_size + hp, intermediate_size + ip, num_experts
        H, Ir = hidden_size, intermediate_size
        geo = {
            "w13_weight": MoEParamGeometry("w13", Ir, I, H, D),
            "w13_weight_scale_inv": MoEParamGeometry("w13", cdiv(Ir, bn), cdiv(I, bn), cdiv(H, bk), cdiv(D, bk)),
            "w2_weight": MoEParamGeometry("w2", H, D, Ir, I),
            "w2_weight_scale_inv": MoEParamGeometry("w2", cdiv(H, bn), cdiv(D, bn), cdiv(Ir, bk), cdiv(I, bk)),
        }
        layer.quant_geometry = geo
        shard_dims = {"w13": 0, "w2": 1}
        shapes = {"w13_weight": (E, 2 * I, D), "w13_weight_scale_inv": (E, 2 * cdiv(I, bn), cdiv(D, bk)),
                  "w2_weight": (E, D, I), "w2_weight_scale_inv": (E, cdiv(D, bn), cdiv(I, bk))}
        # scales first (see Fp8BlockLinearMethod.create_weights on dummy init order)
        for name in ("w13_weight_scale_inv", "w2_weight_scale_inv", "w13_weight", "w2_weight"):
            is_scale = name.endswith("scale_inv")
            t = torch.ones(shapes[name], dtype=torch.float32) if is_scale else torch.zeros(shapes[name], dtype=FP8_DTYPE)
            p = nn.Parameter(t, requires_grad=False)
            base = moe_param_loader(layer, geo[name], shard_dims)
            loader = base if is_scale else quantized_loader(base, prefix, self.scheme, "F8_E4M3 + a block scale")
            set_weight_attrs(p, output_dim=1, input_dim=2, weight_loader=loader,
                             ckpt_dtypes=SCALE_CKPT_DTYPES if is_scale else FP8_CKPT_DTYPES)
            if is_scale:
                set_checkpoint_suffix(p, "weight_scale_inv", self.scheme.checkpoint_scale_name)
            layer.register_parameter(name, p)

        def zero_pads():
            for n, g in geo.items():
                fill_padding(getattr(layer, n), g, 1.0 if n.endswith("scale_inv") else 0.0)
        fp8_dummy_pair(layer.w13_weight, layer.w13_weight_scale_inv, H, on_done=zero_pads)
        fp8_dummy_pair(layer.w2_weight, layer.w2_weight_scale_inv, Ir, on_done=zero_pads)

    def process_weights_after_loading(self, layer):
        ops = owned_ops(layer)
        w13, s13, w2, s2, meta = ops.moe_quant_prepare(self.kind, layer.w13_weight.data, layer.w13_weight_scale_inv.data,
                                                       layer.w2_weight.data, layer.w2_weight_scale_inv.data)
        _replace_params(layer, w13_weight=w13, w13_weight_scale_inv=s13, w2_weight=w2, w2_weight_scale_inv=s2)
        layer.moe_runner_meta = dict(meta)

    def apply(self, layer, x, topk_weights, topk_ids):
        ops = owned_ops(layer)
        c = layer.contract
        return ops.fused_moe_block_fp8(
            x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
            topk_weights, topk_ids, block=self.block, act_ue8m0=self.scheme.act_ue8m0, swiglu_limit=c.swiglu_limit,
            gate_mode=c.gate_mode.value, hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad,
            **getattr(layer, "moe_runner_meta", {}))


def _replace_params(layer: nn.Module, **tensors: torch.Tensor) -> None:
    """Swap params for the runtime tensors a runner's prepare returned (dtype/layout may change);
    tensor attributes a runner set (aiter's `is_shuffled`) are carried onto the new Parameter."""
    for name, t in tensors.items():
        old = getattr(layer, name)
        if t is old.data:
            continue
        p = nn.Parameter(t, requires_grad=False)
        for attr in ("is_shuffled",):
            if hasattr(t, attr):
                setattr(p, attr, getattr(t, attr))
        for attr, v in vars(old).items():
            if not attr.startswith("_") and not hasattr(p, attr):
                setattr(p, attr, v)
        setattr(layer, name, p)
