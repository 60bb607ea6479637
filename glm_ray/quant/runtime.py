"""Helpers shared by the quantized methods: runner ownership, loaders, padding, dummy init.

Runner ownership (origin PR A: "preshuffle requires an owned runner"): a quantized layer records, at
construction, the name of the kernel backend whose runner it will call (`layer.quant_runner`). Only
that runner's `*_prepare` op may re-lay-out the weights (preshuffle, scale shuffles), and `apply`
refuses to run them through any other backend — a preshuffled weight fed to a plain kernel is
silently wrong, so this is an error, not a fallback.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from glm_ray import kernels
from glm_ray.distributed.parallel_state import tp_rank
from glm_ray.quant.config import QuantScheme
from glm_ray.weights import FLOAT_DTYPES, CheckpointTensor, WeightError, load_sharded


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def describe(scheme: QuantScheme) -> str:
    """One-line scheme description for error messages."""
    parts = [scheme.kind]
    if scheme.block:
        parts.append("block=%dx%d" % scheme.block)
    if scheme.ue8m0:
        parts.append("ue8m0")
    if scheme.act != "none":
        parts.append(f"act={scheme.act}")
    if scheme.act_scale_calculation_mode:
        parts.append(f"act_scale_mode={scheme.act_scale_calculation_mode}")
    if scheme.checkpoint_scale_name:
        parts.append(f"scale={scheme.checkpoint_scale_name}")
    if scheme.source:
        parts.append(f"from {scheme.source}")
    return "(" + ", ".join(parts) + ")"


def bind_runner(layer: nn.Module) -> kernels.KernelOps:
    """Record the active backend as this layer's runner (at construction) and return its ops."""
    ops = kernels.ops()
    layer.quant_runner = ops.name
    return ops


def owned_ops(layer: nn.Module) -> kernels.KernelOps:
    """The active backend, which must be the runner the layer's weights were prepared for."""
    ops = kernels.ops()
    owner = getattr(layer, "quant_runner", None)
    if owner is not None and ops.name != owner:
        raise RuntimeError(f"{getattr(layer, 'prefix', type(layer).__name__)}: weights were laid out for kernel "
                           f"backend {owner!r} but the active backend is {ops.name!r} "
                           "(init the backend before building the model)")
    return ops


def quantized_loader(base: Callable, prefix: str, scheme: QuantScheme, expect: str) -> Callable:
    """Wrap a weight_loader so that a checkpoint tensor that is *not* quantized where the config says it
    is (release-dependent FP8-ness, e.g. kv_b_proj kept bf16) fails with a message saying what to do."""

    @functools.wraps(base)
    def load(param, ckpt: CheckpointTensor, *args, **kwargs):
        if ckpt.dtype in FLOAT_DTYPES and ckpt.dtype not in getattr(param, "ckpt_dtypes", ()):
            raise WeightError(
                f"tensor {ckpt.name!r} in {ckpt.file} is {ckpt.dtype}, but quantization_config makes layer "
                f"{prefix!r} {scheme.kind} {describe(scheme)} and expects {expect}. This checkpoint keeps the "
                "module unquantized: it must be listed in quantization_config.ignored_layers / "
                "modules_to_not_convert (fp8) or exclude (quark)")
        return base(param, ckpt, *args, **kwargs)
    return load


def set_checkpoint_suffix(param: nn.Parameter, runtime: str, on_disk: str | None) -> None:
    """Quark block-FP8 layers store the runtime `weight_scale_inv` as `weight_scale` on disk; the model's
    checkpoint name map reads this attribute (glm_moe_dsa._checkpoint_names)."""
    if on_disk and on_disk != runtime:
        param.checkpoint_suffix = on_disk


# --------------------------------------------------------------------------------------------
# MoE params with padding
# --------------------------------------------------------------------------------------------

class MoEParamGeometry:
    """Where the checkpoint's (per-expert, per-rank) tensor sits inside a padded MoE param.

    For w13-like params (`which="w13"`): dest `[2 * half_pad, cols_pad]`, the gate half at rows
    `[0, half)`, the up half at `[half_pad, half_pad + half)`; for w2: dest `[rows_pad, cols_pad]`, the
    tensor at `[:rows, :cols]`. Units are the param's own (elements, packed bytes or scale blocks)."""

    def __init__(self, which: str, rows: int, rows_pad: int, cols: int, cols_pad: int):
        self.which, self.rows, self.rows_pad, self.cols, self.cols_pad = which, rows, rows_pad, cols, cols_pad

    @property
    def padded(self) -> bool:
        return self.rows != self.rows_pad or self.cols != self.cols_pad

    def real_view(self, dest: torch.Tensor, shard_id: str) -> torch.Tensor:
        """dest: one expert's `[R, C]` slice -> the view the checkpoint tensor (or its TP slice) fills."""
        if self.which == "w13":
            off = 0 if shard_id == "w1" else self.rows_pad
            return dest[off:off + self.rows, :self.cols]
        return dest[:self.rows, :self.cols]

    def pad_mask(self, shape: torch.Size, device) -> torch.Tensor:
        """bool `[R, C]`: True on padding."""
        m = torch.ones(shape[-2:], dtype=torch.bool, device=device)
        if self.which == "w13":
            m[:self.rows, :self.cols] = False
            m[self.rows_pad:self.rows_pad + self.rows, :self.cols] = False
        else:
            m[:self.rows, :self.cols] = False
        return m


def moe_loader(layer, geom: MoEParamGeometry, shard_dim_of: dict[str, int]) -> Callable:
    """weight_loader(param, ckpt, shard_id, expert_id) for a padded MoE param.

    shard_dim_of: {"w13": dim, "w2": dim} — the per-expert dim that TP splits (w13: rows, w2: cols).
    Without padding the layer's own FusedMoE.weight_loader is used instead (see `moe_param_loader`)."""

    def load(param, ckpt: CheckpointTensor, shard_id: str, expert_id: int) -> None:
        dest = geom.real_view(param.data[expert_id], shard_id)
        view = nn.Parameter(dest, requires_grad=False)
        view.ckpt_dtypes = getattr(param, "ckpt_dtypes", None) or frozenset({"F32", "BF16", "F16"})
        dim = shard_dim_of["w13" if shard_id in ("w1", "w3") else "w2"]
        load_sharded(view, ckpt, shard_dim=dim if layer.tp > 1 else None, rank=tp_rank(), tp=layer.tp)
    return load


def moe_param_loader(layer, geom: MoEParamGeometry, shard_dim_of: dict[str, int]) -> Callable:
    return moe_loader(layer, geom, shard_dim_of) if geom.padded else layer.weight_loader


def fill_padding(param: torch.Tensor, geom: MoEParamGeometry, value) -> None:
    if geom.padded:
        t = param.data
        raw = t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t   # fp8: no masked_fill
        fill = torch.tensor(value, dtype=t.dtype).view(torch.uint8).item() if raw is not t else value
        raw.masked_fill_(geom.pad_mask(t.shape, t.device), fill)


# --------------------------------------------------------------------------------------------
# dummy init (load_format="dummy")
# --------------------------------------------------------------------------------------------

# dummy payloads are drawn a slab of leading-dim rows at a time: a GLM-5 expert tensor ([256, 4096, 6144] e4m3,
# 6 GiB) drawn whole in fp32 would need four times its size again in temporaries (25 GiB each) on the GPU
_DUMMY_SLAB_ELEMS = 1 << 26


def _slabs(t: torch.Tensor):
    """Views of t covering it along its leading dims, each of at most ~_DUMMY_SLAB_ELEMS elements (t itself when
    small)."""
    if t.dim() == 0 or t.numel() <= _DUMMY_SLAB_ELEMS:
        yield t
        return
    row = t[0].numel()
    if row > _DUMMY_SLAB_ELEMS:                                                 # one row is too big: split it
        for i in range(t.shape[0]):
            yield from _slabs(t[i])
        return
    step = _DUMMY_SLAB_ELEMS // row
    for i in range(0, t.shape[0], step):
        yield t[i:i + step]


def fp8_dummy_pair(weight: nn.Parameter, scale: nn.Parameter, fan_in: int, *, on_done=None) -> None:
    """Give an e4m3 weight and its fp32 block scales a `dummy_init(param, gen)` that yields W ~ N(0, 1/fan_in).

    Both params get the same initializer: it fills the pair (the loader may visit either first)."""
    amp = 32.0

    @torch.no_grad()
    def init(_p, gen):
        for w in _slabs(weight.data):                                           # bounded fp32 temporaries
            q = torch.randn(w.shape, generator=gen, device=w.device).mul_(amp).clamp_(-448.0, 448.0)
            w.copy_(q)
        scale.data.fill_(fan_in ** -0.5 / amp)
        if on_done is not None:
            on_done()
    weight.dummy_init = init
    scale.dummy_init = init


def mxfp4_dummy_pair(weight: nn.Parameter, scale: nn.Parameter, fan_in: int, *, on_done=None) -> None:
    """Random E2M1 codes (values ~ +-[0, 6], rms ~ 2.6) with e8m0 scales giving W rms ~ 1/sqrt(fan_in)."""
    exp = round(torch.log2(torch.tensor(fan_in ** -0.5 / 2.6)).item())

    @torch.no_grad()
    def init(_p, gen):
        for w in _slabs(weight.data):                                           # bounded int32 temporaries
            w.copy_(torch.randint(0, 256, w.shape, generator=gen, device=w.device, dtype=torch.int32))
        scale.data.fill_(127 + exp)
        if on_done is not None:
            on_done()
    weight.dummy_init = init
    scale.dummy_init = init
