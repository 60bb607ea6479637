"""MXFP4 W4A4 routed experts (quant_contracts.md §3, §4; Quark `QuarkW4A4MXFp4MoE` semantics), and the
dense MXFP4 linear (`QuarkW4A4MXFP4`) for Quark checkpoints that also quantize shared experts.

Params (per rank; D' / I' include the runner's padding, recorded on `layer.contract`):
  `w13_weight` uint8 `[E, 2I', D'/2]` (E2M1 codes, element 2j in the low nibble), `w13_weight_scale`
  uint8 `[E, 2I', D'/32]` (E8M0), `w2_weight` uint8 `[E, D', I'/2]`, `w2_weight_scale` uint8 `[E, D', I'/32]`.
On disk (Quark): `...experts.{e}.{gate,up,down}_proj.weight` (U8) and `.weight_scale` (U8).

Activations are quantized dynamically to MXFP4 with the E8M0 scale mode the checkpoint declares in
`input_tensors.scale_calculation_mode` (Quark default "even"); it is forwarded to the runner as
`act_mode`. (aiter's HIP MoE kernels use RoundUp regardless — the aiter backend logs this once.)

An INTERLEAVE gate/up source (rows g0, u0, g1, u1, ...) is regrouped into separated halves after
loading (row permutation of codes and scales: lossless); the runner always gets "separated".
TP: the per-rank intermediate size must be a multiple of 32 (one scale per 32 K elements of w2).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from glm_ray.kernels.torch_ref.aiter_layout import deinterleave_gate_up_rows
from glm_ray.kernels.torch_ref.mxfp4 import dequant_mxfp4
from glm_ray.layer_contracts import GateMode
from glm_ray.quant.base import LinearMethod, MoEMethod
from glm_ray.quant.config import QuantScheme, UnsupportedQuantSchemeError
from glm_ray.quant.fp8 import _replace_params
from glm_ray.quant.runtime import (
    MoEParamGeometry,
    bind_runner,
    describe,
    fill_padding,
    moe_param_loader,
    mxfp4_dummy_pair,
    owned_ops,
    quantized_loader,
)
from glm_ray.weights import set_weight_attrs

MX = 32
U8 = frozenset({"U8"})
E8M0_ONE = 127


class Mxfp4MoEMethod(MoEMethod):
    kind = "mxfp4"

    def __init__(self, scheme: QuantScheme):
        if scheme.kind != "mxfp4":
            raise ValueError(f"Mxfp4MoEMethod needs an mxfp4 scheme, got {scheme}")
        self.scheme = scheme
        self.act_mode = scheme.act_scale_calculation_mode or "even"

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        prefix, c = layer.prefix, layer.contract
        desc = "mxfp4 " + describe(self.scheme)
        if hidden_size % MX or intermediate_size % MX:
            raise UnsupportedQuantSchemeError(prefix, desc, f"hidden {hidden_size} and per-rank intermediate "
                                                            f"{intermediate_size} (tp={layer.tp}) must be multiples of {MX}")
        if c.hidden_pad % MX or c.intermediate_pad % MX:
            raise UnsupportedQuantSchemeError(prefix, desc, f"contract padding {c.hidden_pad}/{c.intermediate_pad} "
                                                            f"is not a multiple of {MX}")
        if c.gate_mode == GateMode.INTERLEAVED and (c.hidden_pad or c.intermediate_pad):
            raise UnsupportedQuantSchemeError(prefix, desc, "an interleaved gate/up source with preset padding")
        ops = bind_runner(layer)
        lay = ops.moe_quant_layout(self.kind, num_experts, hidden_size + c.hidden_pad,
                                   intermediate_size + c.intermediate_pad, (1, MX))
        if lay.unsupported:
            raise UnsupportedQuantSchemeError(prefix, desc, f"kernel backend {ops.name!r}: {lay.unsupported}")
        hp, ip = c.hidden_pad + lay.hidden_pad, c.intermediate_pad + lay.intermediate_pad
        layer.contract = replace(c, hidden_pad=hp, intermediate_pad=ip)
        E, H, Ir = num_experts, hidden_size, intermediate_size
        D, I = H + hp, Ir + ip
        geo = {
            "w13_weight": MoEParamGeometry("w13", Ir, I, H // 2, D // 2),
            "w13_weight_scale": MoEParamGeometry("w13", Ir, I, H // MX, D // MX),
            "w2_weight": MoEParamGeometry("w2", H, D, Ir // 2, I // 2),
            "w2_weight_scale": MoEParamGeometry("w2", H, D, Ir // MX, I // MX),
        }
        layer.quant_geometry = geo
        shapes = {"w13_weight": (E, 2 * I, D // 2), "w13_weight_scale": (E, 2 * I, D // MX),
                  "w2_weight": (E, D, I // 2), "w2_weight_scale": (E, D, I // MX)}
        for name, shape in shapes.items():
            is_scale = name.endswith("_scale")
            t = torch.full(shape, E8M0_ONE, dtype=torch.uint8) if is_scale else torch.zeros(shape, dtype=torch.uint8)
            p = nn.Parameter(t, requires_grad=False)
            base = moe_param_loader(layer, geo[name], {"w13": 0, "w2": 1})
            loader = base if is_scale else quantized_loader(base, prefix, self.scheme, "U8 packed E2M1 + U8 E8M0 scales")
            layer.register_parameter(name, set_weight_attrs(p, output_dim=1, input_dim=2, weight_loader=loader,
                                                            ckpt_dtypes=U8))

        def fix_pads():
            for n, g in geo.items():
                fill_padding(getattr(layer, n), g, E8M0_ONE if n.endswith("_scale") else 0)
        mxfp4_dummy_pair(layer.w13_weight, layer.w13_weight_scale, H, on_done=fix_pads)
        mxfp4_dummy_pair(layer.w2_weight, layer.w2_weight_scale, Ir, on_done=fix_pads)

    def process_weights_after_loading(self, layer):
        c = layer.contract
        if c.gate_mode == GateMode.INTERLEAVED:
            # rows as loaded alternate g0, u0, g1, u1, ... over the real 2I rows; runner padding rows (zero
            # codes) are regrouped first so they trail each half again
            self._pads_to_end(layer)
            layer.w13_weight.data = deinterleave_gate_up_rows(layer.w13_weight.data).contiguous()
            layer.w13_weight_scale.data = deinterleave_gate_up_rows(layer.w13_weight_scale.data).contiguous()
            layer.contract = replace(c, gate_mode=GateMode.SEPARATED)
        ops = owned_ops(layer)
        w13, s13, w2, s2, meta = ops.moe_quant_prepare(self.kind, layer.w13_weight.data, layer.w13_weight_scale.data,
                                                       layer.w2_weight.data, layer.w2_weight_scale.data)
        _replace_params(layer, w13_weight=w13, w13_weight_scale=s13, w2_weight=w2, w2_weight_scale=s2)
        layer.moe_runner_meta = dict(meta)

    @staticmethod
    def _pads_to_end(layer):
        """With runner padding, the interleaved real rows sit at [0, 2I) of w13 (as a fused source is
        loaded); move them so that de-interleaving yields [gate(I) ; pad ; up(I) ; pad]."""
        g = layer.quant_geometry["w13_weight"]
        if not g.padded:
            return
        for name in ("w13_weight", "w13_weight_scale"):
            t = getattr(layer, name).data
            real = t[:, :2 * g.rows].clone()                                 # interleaved g/u rows
            pad_rows = t.shape[1] // 2 - g.rows
            fill = 0 if name == "w13_weight" else E8M0_ONE
            pad = torch.full((t.shape[0], 2 * pad_rows, t.shape[2]), fill, dtype=t.dtype, device=t.device)
            # interleave the padding too: (real pairs..., pad pairs...) de-interleaves to [g ; pad], [u ; pad]
            t.copy_(torch.cat([real, pad], 1))

    def apply(self, layer, x, topk_weights, topk_ids):
        ops = owned_ops(layer)
        c = layer.contract
        return ops.fused_moe_mxfp4(
            x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale, topk_weights,
            topk_ids, act_mode=self.act_mode, swiglu_limit=c.swiglu_limit, gate_mode=c.gate_mode.value,
            hidden_pad=c.hidden_pad, intermediate_pad=c.intermediate_pad, **getattr(layer, "moe_runner_meta", {}))


class Mxfp4LinearMethod(LinearMethod):
    """Dense MXFP4 W4A4 linear (Quark checkpoints that quantize shared experts or dense projections).

    `weight` uint8 `[N, K/2]` (packed E2M1, low nibble first) + `weight_scale` uint8 `[N, K/32]` (E8M0),
    activations MXFP4-quantized with the declared `scale_calculation_mode`. Runs through
    `kernels.ops().mxfp4_linear` (torch reference on every backend for now). TP: a row-parallel shard
    of K must be a multiple of 32; column shards are whole rows (no constraint).
    """

    def __init__(self, scheme: QuantScheme):
        if scheme.kind != "mxfp4":
            raise ValueError(f"Mxfp4LinearMethod needs an mxfp4 scheme, got {scheme}")
        self.scheme = scheme
        self.act_mode = scheme.act_scale_calculation_mode or "even"

    def create_weights(self, layer, in_features, out_features, params_dtype):
        prefix = getattr(layer, "prefix", "?")
        if in_features % MX:
            raise UnsupportedQuantSchemeError(prefix, "mxfp4 " + describe(self.scheme),
                                              f"per-rank input {in_features} is not a multiple of {MX}")
        loader = quantized_loader(layer.weight_loader, prefix, self.scheme, "U8 packed E2M1 + U8 E8M0 scales")
        w = nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False)
        s = nn.Parameter(torch.full((out_features, in_features // MX), E8M0_ONE, dtype=torch.uint8),
                         requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1, weight_loader=loader,
                                                            ckpt_dtypes=U8))
        layer.register_parameter("weight_scale", set_weight_attrs(s, output_dim=0, input_dim=1,
                                                                  weight_loader=layer.weight_loader, ckpt_dtypes=U8))
        mxfp4_dummy_pair(w, s, in_features)
        bind_runner(layer)

    def apply(self, layer, x):
        return owned_ops(layer).mxfp4_linear(x, layer.weight, layer.weight_scale, act_mode=self.act_mode)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return dequant_mxfp4(layer.weight.data, layer.weight_scale.data, getattr(layer, "params_dtype", torch.float32))
