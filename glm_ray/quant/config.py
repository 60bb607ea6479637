"""Typed, frozen view of an HF `quantization_config` and the per-layer scheme decision.

Two checkpoint families (quant_contracts.md §2.1, §3.6; origin PR A):

* `quant_method: "fp8"` (DeepSeek-V3 / zai-org GLM block FP8): e4m3 weights in 128x128 blocks with
  fp32 `weight_scale_inv`, dynamic 1x128 FP8 activations, optional `scale_fmt: "ue8m0"`
  (power-of-two scales); `ignored_layers` / `modules_to_not_convert` stay unquantized.
* `quant_method: "quark"` (AMD Quark, e.g. amd/GLM-5.3-Flash-Quark-MXFP4): per-layer specs.
  global = MXFP4 W4A4 (experts of layers 3-44), `layer_quant_config` fnmatch patterns (MTP layer 45
  = block FP8, scale stored as `weight_scale`), `layer_type_quant_config` by module class name,
  `exclude` = exact names or `re:` regexes (re.match) — glob entries are also accepted (fnmatch).

`parse_quant_config(hf_config_or_qc)` returns a `QuantSpec`; `spec.scheme_for(prefix, kind)` returns
the `QuantScheme` for one layer, or raises `UnsupportedQuantSchemeError` naming the prefix and the
scheme. Prefixes are checkpoint module names; `model.language_model.layers.N` and `model.layers.N`
are treated as the same name on both sides (VLM wrapper of GLM-5.3-Flash).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch

from glm_ray.kernels.torch_ref.mxfp4 import canonical_scale_mode

LayerKind = Literal["linear", "moe"]
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class QuantConfigError(ValueError):
    """The quantization_config itself is malformed."""


class UnsupportedQuantSchemeError(NotImplementedError):
    """A layer's scheme is well-formed but has no implementation here."""

    def __init__(self, prefix: str, scheme: str, reason: str = ""):
        self.prefix, self.scheme, self.reason = prefix, scheme, reason
        msg = f"layer {prefix!r}: unsupported quantization scheme {scheme}"
        super().__init__(msg + (f" ({reason})" if reason else ""))


@dataclass(frozen=True)
class QuantScheme:
    """How one layer's weights are stored and how its activations are quantized.

    kind: "unquantized" | "fp8_block" | "mxfp4".
    block: weight scale block (N, K): (128, 128) for fp8_block, (1, 32) for mxfp4, None otherwise.
    ue8m0: weight scales are powers of two (fp8 `scale_fmt: ue8m0`, Quark fp8 scale_type e8m0).
    act: "none" | "fp8_1x128" (dynamic per-token-group e4m3) | "mxfp4_1x32" (dynamic MXFP4).
    act_group_size: activation group (128 / 32), None when act == "none".
    act_ue8m0: fp8 activation scales are rounded up to powers of two.
    scale_calculation_mode / act_scale_calculation_mode: MX E8M0 scale modes (weights as calibrated,
      activations at runtime), "even" | "round_up" | "round_down" | "ceil"; None for non-MX.
    round_method: element rounding of the MX spec ("half_even"), None for non-MX.
    checkpoint_scale_name: scale tensor suffix on disk ("weight_scale_inv" | "weight_scale");
    runtime_scale_name: suffix the runtime parameter uses ("weight_scale_inv" for fp8_block).
    source: which config rule decided (for logs; not part of equality).
    """

    kind: Literal["unquantized", "fp8_block", "mxfp4"] = "unquantized"
    block: tuple[int, int] | None = None
    ue8m0: bool = False
    act: Literal["none", "fp8_1x128", "mxfp4_1x32"] = "none"
    act_group_size: int | None = None
    act_ue8m0: bool = False
    scale_calculation_mode: str | None = None
    act_scale_calculation_mode: str | None = None
    round_method: str | None = None
    checkpoint_scale_name: str | None = None
    runtime_scale_name: str | None = None
    source: str = field(default="", compare=False)

    @property
    def is_quantized(self) -> bool:
        return self.kind != "unquantized"

    def with_source(self, source: str) -> "QuantScheme":
        return replace(self, source=source)


UNQUANTIZED = QuantScheme()


def fp8_block_scheme(block: Sequence[int] = (128, 128), *, ue8m0: bool = False,
                     checkpoint_scale_name: str = "weight_scale_inv", source: str = "") -> QuantScheme:
    return QuantScheme(kind="fp8_block", block=(int(block[0]), int(block[1])), ue8m0=ue8m0, act="fp8_1x128",
                       act_group_size=int(block[1]), act_ue8m0=ue8m0, checkpoint_scale_name=checkpoint_scale_name,
                       runtime_scale_name="weight_scale_inv", source=source)


def mxfp4_scheme(*, scale_calculation_mode: str = "even", act_scale_calculation_mode: str = "even",
                 round_method: str = "half_even", source: str = "") -> QuantScheme:
    return QuantScheme(kind="mxfp4", block=(1, 32), ue8m0=True, act="mxfp4_1x32", act_group_size=32,
                       scale_calculation_mode=scale_calculation_mode,
                       act_scale_calculation_mode=act_scale_calculation_mode, round_method=round_method,
                       checkpoint_scale_name="weight_scale", runtime_scale_name="weight_scale", source=source)


# --------------------------------------------------------------------------------------------
# Name matching
# --------------------------------------------------------------------------------------------

_LM = "model.language_model."


def name_variants(name: str) -> tuple[str, ...]:
    """`model.language_model.X` <-> `model.X` (GLM-5.3-Flash VLM wrapper); the name itself first."""
    out = [name]
    if name.startswith(_LM):
        out.append("model." + name[len(_LM):])
    elif name.startswith("model."):
        out.append(_LM + name[len("model."):])
    return tuple(out)


def _is_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def exclude_entry_matches(entry: str, name: str) -> bool:
    """Quark/SGLang exclude semantics: `re:<regex>` -> re.match; glob -> fnmatch; else exact."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if _is_glob(entry):
        return fnmatch.fnmatchcase(name, entry)
    return entry == name


def hf_ignore_entry_matches(entry: str, name: str) -> bool:
    """FP8 `ignored_layers` / `modules_to_not_convert` semantics (transformers `should_convert_module`
    + SGLang): `re:` regex; glob; exact; a parent module (prefix at a `.` boundary); or a suffix at a
    `.` boundary (`lm_head`, `mlp.gate` but not `mlp.gate_proj`)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if _is_glob(entry):
        return fnmatch.fnmatchcase(name, entry)
    return name == entry or name.startswith(entry + ".") or name.endswith("." + entry)


def _any_variant(pred, entries: Iterable[str], name: str) -> bool:
    variants = name_variants(name)
    return any(pred(e, v) for e in entries for v in variants)


def _expert_indices(prefix: str, entries: Iterable[str], num_experts: int | None) -> list[int]:
    """Experts to inspect for a fused `...experts` prefix: all of them when the count is known, else
    expert 0 plus every index that an explicit config entry names."""
    if num_experts is not None:
        return list(range(num_experts))
    found = {0}
    for v in name_variants(prefix):
        rx = re.compile(re.escape(v) + r"\.(\d+)(?:\.|$)")
        for e in entries:
            m = rx.match(e[3:] if e.startswith("re:") else e)
            if m:
                found.add(int(m.group(1)))
    return sorted(found)


def expert_module_names(prefix: str, indices: Iterable[int]) -> list[str]:
    return [f"{prefix}.{i}.{p}" for i in indices for p in EXPERT_PROJS]


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------

class QuantSpec:
    """Base of parsed configs. `scheme_for` is the one per-layer decision."""

    method: str = "none"

    def scheme_for(self, prefix: str, kind: LayerKind = "linear", *, num_experts: int | None = None,
                   shard_prefixes: Sequence[str] | None = None) -> QuantScheme:
        """Scheme for the module at checkpoint `prefix`.

        kind "linear": a dense linear; `shard_prefixes` lists the checkpoint modules concatenated
          into it (e.g. q_a_proj + kv_a_proj_with_mqa) — they must all agree.
        kind "moe": the routed experts at `prefix` (`...mlp.experts`); per-expert checkpoint modules
          `prefix.{e}.{gate,up,down}_proj` are consulted too (`num_experts` = how many to check).
        """
        _check_kind(kind)
        shards = tuple(shard_prefixes) if shard_prefixes else ()
        key = (prefix, kind, num_experts, shards)
        cache = getattr(self, "_cache", None)
        if cache is not None and key in cache:
            return cache[key]
        scheme = self._resolve(prefix, kind, num_experts, shards)
        if cache is not None:
            cache[key] = scheme
        return scheme

    def _resolve(self, prefix: str, kind: str, num_experts: int | None, shards: tuple[str, ...]) -> QuantScheme:
        raise NotImplementedError

    def runtime_tensor_name(self, name: str, *, num_experts: int | None = None) -> str:
        """Checkpoint tensor name -> runtime parameter name: Quark block-FP8 layers store the dequant
        multiplier as `X.weight_scale`, the runtime (and `fp8` checkpoints) call it `X.weight_scale_inv`.
        Everything else is returned unchanged."""
        return name


@dataclass(frozen=True)
class NoQuantSpec(QuantSpec):
    method: str = "none"

    def _resolve(self, prefix, kind, num_experts, shards) -> QuantScheme:
        return UNQUANTIZED.with_source("no quantization_config")


def _check_kind(kind: str) -> None:
    if kind not in ("linear", "moe"):
        raise ValueError(f"layer kind must be 'linear' or 'moe', got {kind!r}")


@dataclass(frozen=True)
class Fp8BlockSpec(QuantSpec):
    """`quant_method: "fp8"`."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] | None = (128, 128)
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    scale_fmt: str | None = None
    ignored_layers: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def ue8m0(self) -> bool:
        return (self.scale_fmt or "").lower() == "ue8m0"

    def _ignored(self, name: str) -> bool:
        return _any_variant(hf_ignore_entry_matches, self.ignored_layers, name)

    def _quantized_scheme(self, prefix: str) -> QuantScheme:
        desc = (f"fp8(fmt={self.fmt}, weight_block_size={self.weight_block_size}, "
                f"activation_scheme={self.activation_scheme}, scale_fmt={self.scale_fmt})")
        if self.fmt not in ("e4m3", "e4m3fn", "float8_e4m3fn"):
            raise UnsupportedQuantSchemeError(prefix, desc, "only e4m3 FP8 is supported")
        if self.weight_block_size is None:
            raise UnsupportedQuantSchemeError(prefix, desc, "per-tensor FP8 (no weight_block_size) is not supported")
        if self.activation_scheme != "dynamic":
            raise UnsupportedQuantSchemeError(prefix, desc, "block FP8 requires activation_scheme='dynamic'")
        if self.scale_fmt not in (None, "ue8m0"):
            raise UnsupportedQuantSchemeError(prefix, desc, f"unknown scale_fmt {self.scale_fmt!r}")
        return fp8_block_scheme(self.weight_block_size, ue8m0=self.ue8m0, source="fp8")

    def _resolve(self, prefix, kind, num_experts, shards) -> QuantScheme:
        names = list(shards) if shards else [prefix]
        flags = [self._ignored(n) for n in names]
        if kind == "moe" and not flags[0]:
            subs = expert_module_names(prefix, _expert_indices(prefix, self.ignored_layers, num_experts))
            sub_flags = [self._ignored(n) for n in subs]
            if all(sub_flags):
                flags = [True]
            elif any(sub_flags):
                raise UnsupportedQuantSchemeError(
                    prefix, "fp8 with partially ignored experts",
                    "some but not all per-expert modules are in ignored_layers")
        if all(flags):
            return UNQUANTIZED.with_source("fp8.ignored_layers")
        if any(flags):
            raise UnsupportedQuantSchemeError(
                prefix, "fp8 with mixed ignored/quantized shards",
                f"shards {names} disagree on ignored_layers")
        return self._quantized_scheme(prefix)


@dataclass(frozen=True)
class QuarkTensorSpec:
    """One Quark `QuantizationSpec` (weight / input_tensors / output_tensors / bias)."""

    dtype: str
    qscheme: str | None = None
    is_dynamic: bool | None = None
    group_size: int | None = None
    block_size: tuple[int, ...] | None = None
    ch_axis: int | None = None
    symmetric: bool | None = None
    scale_format: str | None = None
    scale_type: str | None = None
    scale_calculation_mode: str | None = None
    round_method: str | None = None
    mx_element_dtype: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "QuarkTensorSpec | None":
        if d is None:
            return None
        if not isinstance(d, Mapping) or "dtype" not in d:
            raise QuantConfigError(f"Quark tensor spec must be a mapping with 'dtype', got {d!r}")
        bs = d.get("block_size")
        return cls(dtype=str(d["dtype"]).lower(), qscheme=d.get("qscheme"), is_dynamic=d.get("is_dynamic"),
                   group_size=d.get("group_size"), block_size=tuple(int(v) for v in bs) if bs else None,
                   ch_axis=d.get("ch_axis"), symmetric=d.get("symmetric"), scale_format=d.get("scale_format"),
                   scale_type=d.get("scale_type"), scale_calculation_mode=d.get("scale_calculation_mode"),
                   round_method=d.get("round_method"), mx_element_dtype=d.get("mx_element_dtype"))

    def describe(self) -> str:
        parts = [self.dtype, self.qscheme or "-"]
        if self.group_size:
            parts.append(f"g{self.group_size}")
        if self.block_size:
            parts.append("b" + "x".join(map(str, self.block_size)))
        parts.append("dynamic" if self.is_dynamic else "static")
        return "/".join(parts)

    @property
    def is_fp4(self) -> bool:
        return self.dtype == "fp4" or (self.dtype == "mx" and (self.mx_element_dtype or "").lower() == "fp4")

    @property
    def is_fp8_e4m3(self) -> bool:
        return self.dtype in ("fp8_e4m3", "fp8_e4m3fn", "float8_e4m3fn")


@dataclass(frozen=True)
class QuarkLayerConfig:
    weight: QuarkTensorSpec | None = None
    input_tensors: QuarkTensorSpec | None = None
    output_tensors: QuarkTensorSpec | None = None
    bias: QuarkTensorSpec | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "QuarkLayerConfig | None":
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise QuantConfigError(f"Quark layer config must be a mapping, got {type(d).__name__}")

        def one(key):
            v = d.get(key)
            if isinstance(v, list):              # Quark allows a list of specs (e.g. double quant)
                if len(v) != 1:
                    raise QuantConfigError(f"Quark {key}: lists of {len(v)} specs are not supported")
                v = v[0]
            return QuarkTensorSpec.from_dict(v)

        return cls(weight=one("weight"), input_tensors=one("input_tensors"),
                   output_tensors=one("output_tensors"), bias=one("bias"))

    def describe(self) -> str:
        f = lambda t: t.describe() if t is not None else "none"   # noqa: E731
        return (f"quark(weight={f(self.weight)}, input={f(self.input_tensors)}, "
                f"output={f(self.output_tensors)}, bias={f(self.bias)})")

    def to_scheme(self, prefix: str) -> QuantScheme:
        """Classify into a supported scheme or raise `UnsupportedQuantSchemeError`."""
        w, a = self.weight, self.input_tensors
        if w is None and a is None and self.output_tensors is None and self.bias is None:
            return UNQUANTIZED
        desc = self.describe()
        if self.output_tensors is not None or self.bias is not None:
            raise UnsupportedQuantSchemeError(prefix, desc, "output/bias quantization is not supported")
        if w is None:
            raise UnsupportedQuantSchemeError(prefix, desc, "activation-only quantization is not supported")
        if w.is_fp4:
            ok_w = (w.qscheme == "per_group" and w.group_size == 32 and not w.is_dynamic
                    and (w.scale_format or "e8m0") == "e8m0")
            if not ok_w:
                raise UnsupportedQuantSchemeError(prefix, desc, "MXFP4 weights must be static per_group g32 e8m0")
            if a is None:
                raise UnsupportedQuantSchemeError(prefix, desc, "MXFP4 weight-only (W4A16) is not supported")
            if not (a.is_fp4 and a.qscheme == "per_group" and a.group_size == 32 and a.is_dynamic
                    and (a.scale_format or "e8m0") == "e8m0"):
                raise UnsupportedQuantSchemeError(prefix, desc, "MXFP4 weights need dynamic MXFP4 (1x32) activations")
            try:
                wm = canonical_scale_mode(w.scale_calculation_mode or "even")
                am = canonical_scale_mode(a.scale_calculation_mode or "even")
            except ValueError as e:
                raise UnsupportedQuantSchemeError(prefix, desc, str(e)) from None
            rm = w.round_method or "half_even"
            if rm != "half_even":
                raise UnsupportedQuantSchemeError(prefix, desc, f"MXFP4 round_method {rm!r} (only half_even)")
            return mxfp4_scheme(scale_calculation_mode=wm, act_scale_calculation_mode=am, round_method=rm)
        if w.is_fp8_e4m3:
            if not (w.qscheme == "per_block" and w.block_size is not None and len(w.block_size) == 2
                    and not w.is_dynamic):
                raise UnsupportedQuantSchemeError(prefix, desc, "FP8 weights must be static per_block with a 2-D block")
            if a is None:
                raise UnsupportedQuantSchemeError(prefix, desc, "block-FP8 weight-only (W8A16) is not supported")
            if not (a.is_fp8_e4m3 and a.is_dynamic and a.qscheme == "per_group"
                    and a.group_size in (None, w.block_size[1])):
                raise UnsupportedQuantSchemeError(
                    prefix, desc, f"block-FP8 weights need dynamic per_group {w.block_size[1]} FP8 activations")
            ue8m0 = "e8m0" in str(w.scale_type or "").lower() or (w.scale_format or "").lower() == "e8m0"
            return fp8_block_scheme(w.block_size, ue8m0=ue8m0, checkpoint_scale_name="weight_scale")
        raise UnsupportedQuantSchemeError(prefix, desc, f"weight dtype {w.dtype!r}")


@dataclass(frozen=True)
class QuarkSpec(QuantSpec):
    """`quant_method: "quark"`. Resolution order for one module (SGLang `_find_matched_config`):
    exclude -> layer_quant_config (fnmatch, first match in file order; for experts also per-expert
    names) -> layer_type_quant_config[module type] -> global_quant_config."""

    method: str = "quark"
    global_quant_config: QuarkLayerConfig | None = None
    layer_quant_config: tuple[tuple[str, QuarkLayerConfig | None], ...] = ()
    layer_type_quant_config: tuple[tuple[str, QuarkLayerConfig | None], ...] = ()
    exclude: tuple[str, ...] = ()
    module_type: str = "Linear"   # key looked up in layer_type_quant_config (checkpoint modules are Linear)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    # -- exclusion ------------------------------------------------------------------------
    def _excluded(self, name: str) -> bool:
        return _any_variant(exclude_entry_matches, self.exclude, name)

    def _excluded_moe(self, prefix: str, num_experts: int | None) -> bool:
        if self._excluded(prefix):
            return True
        subs = expert_module_names(prefix, _expert_indices(prefix, self.exclude, num_experts))
        flags = [self._excluded(n) for n in subs]
        if all(flags):
            return True
        if any(flags):
            bad = [n for n, f in zip(subs, flags) if f][:3]
            raise UnsupportedQuantSchemeError(prefix, "quark with partially excluded experts",
                                              f"e.g. {bad} excluded while other experts are quantized")
        return False

    # -- config lookup ----------------------------------------------------------------------
    def _pattern_config(self, name: str) -> tuple[str, QuarkLayerConfig | None] | None:
        variants = name_variants(name)
        for pattern, cfg in self.layer_quant_config:
            if any(fnmatch.fnmatchcase(v, pattern) for v in variants):
                return pattern, cfg
        return None

    def _config_for(self, prefix: str, kind: str, num_experts: int | None) -> tuple[str, QuarkLayerConfig | None]:
        hit = self._pattern_config(prefix)
        if hit is not None:
            return f"quark.layer_quant_config[{hit[0]!r}]", hit[1]
        if kind == "moe":
            subs = expert_module_names(
                prefix, _expert_indices(prefix, [p for p, _ in self.layer_quant_config], num_experts))
            hits = [self._pattern_config(n) for n in subs]
            if any(h is not None for h in hits):
                cfgs = {h[1] for h in hits if h is not None}
                if any(h is None for h in hits) or len(cfgs) != 1:
                    raise UnsupportedQuantSchemeError(
                        prefix, "quark with per-expert layer_quant_config that differs between experts",
                        "all experts (and gate/up/down) of one layer must share one scheme")
                return f"quark.layer_quant_config[{hits[0][0]!r}] (per-expert)", hits[0][1]
        for tname, cfg in self.layer_type_quant_config:
            if tname == self.module_type:
                return f"quark.layer_type_quant_config[{tname!r}]", cfg
        return "quark.global_quant_config", self.global_quant_config

    def _resolve(self, prefix, kind, num_experts, shards) -> QuantScheme:
        if shards:
            shard_prefixes = shards
            schemes = [self.scheme_for(p, kind, num_experts=num_experts) for p in shard_prefixes]
            if any(s != schemes[0] for s in schemes[1:]):
                raise UnsupportedQuantSchemeError(
                    prefix, "quark with different schemes for fused shards",
                    ", ".join(f"{p}: {s.kind}" for p, s in zip(shard_prefixes, schemes)))
            return schemes[0]
        excluded = self._excluded_moe(prefix, num_experts) if kind == "moe" else self._excluded(prefix)
        if excluded:
            return UNQUANTIZED.with_source("quark.exclude")
        source, cfg = self._config_for(prefix, kind, num_experts)
        if cfg is None:
            return UNQUANTIZED.with_source(source)
        return cfg.to_scheme(prefix).with_source(source)

    def runtime_tensor_name(self, name: str, *, num_experts: int | None = None) -> str:
        suffix = ".weight_scale"
        if not name.endswith(suffix):
            return name
        module = name[: -len(suffix)]
        m = re.match(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$", module)
        if m:
            scheme = self.scheme_for(m.group(1), "moe", num_experts=num_experts)
        else:
            scheme = self.scheme_for(module, "linear")
        if scheme.kind == "fp8_block":
            return module + ".weight_scale_inv"
        return name


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

def _str_tuple(v: Any, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str) or not isinstance(v, Iterable):
        raise QuantConfigError(f"{key} must be a list of strings, got {v!r}")
    return tuple(str(x) for x in v)


def _parse_fp8(qc: Mapping[str, Any]) -> Fp8BlockSpec:
    wbs = qc.get("weight_block_size")
    if wbs is not None:
        if len(wbs) != 2 or any(int(b) <= 0 for b in wbs):
            raise QuantConfigError(f"fp8 weight_block_size must be two positive ints, got {wbs!r}")
        wbs = (int(wbs[0]), int(wbs[1]))
    ignored = _str_tuple(qc.get("ignored_layers"), "ignored_layers") + \
        _str_tuple(qc.get("modules_to_not_convert"), "modules_to_not_convert")
    return Fp8BlockSpec(weight_block_size=wbs, activation_scheme=str(qc.get("activation_scheme", "dynamic")),
                        fmt=str(qc.get("fmt", "e4m3")), scale_fmt=qc.get("scale_fmt"),
                        ignored_layers=tuple(dict.fromkeys(ignored)))


def _parse_quark(qc: Mapping[str, Any]) -> QuarkSpec:
    def table(key):
        v = qc.get(key) or {}
        if not isinstance(v, Mapping):
            raise QuantConfigError(f"quark {key} must be a mapping, got {type(v).__name__}")
        return tuple((str(k), QuarkLayerConfig.from_dict(c)) for k, c in v.items())

    return QuarkSpec(global_quant_config=QuarkLayerConfig.from_dict(qc.get("global_quant_config")),
                     layer_quant_config=table("layer_quant_config"),
                     layer_type_quant_config=table("layer_type_quant_config"),
                     exclude=_str_tuple(qc.get("exclude"), "exclude"))


def parse_quant_config(cfg: Mapping[str, Any] | Any | None) -> QuantSpec:
    """Parse an HF config (dict / PretrainedConfig with `quantization_config`) or the
    `quantization_config` mapping itself. None / absent -> `NoQuantSpec`."""
    if cfg is None:
        return NoQuantSpec()
    if not isinstance(cfg, Mapping):
        qc = getattr(cfg, "quantization_config", None)
        if qc is not None and not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        return parse_quant_config(qc) if qc is not None else NoQuantSpec()
    if "quant_method" not in cfg:
        if "quantization_config" in cfg:
            return parse_quant_config(cfg["quantization_config"])
        if any(k in cfg for k in ("model_type", "architectures", "hidden_size")):
            return NoQuantSpec()
        raise QuantConfigError(f"quantization_config has no quant_method: keys {sorted(cfg)}")
    method = str(cfg["quant_method"]).lower()
    if method == "fp8":
        return _parse_fp8(cfg)
    if method == "quark":
        return _parse_quark(cfg)
    raise QuantConfigError(f"unsupported quant_method {cfg['quant_method']!r} (supported: 'fp8', 'quark')")


# --------------------------------------------------------------------------------------------
# Fused / concatenated block-FP8 shards
# --------------------------------------------------------------------------------------------

def concat_block_fp8_shards(weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                            block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse block-FP8 linears along N (e.g. q_a_proj then kv_a_proj_with_mqa).

    weights[i] `[N_i, K]`, scales[i] `[ceil(N_i/bn), ceil(K/bk)]` -> (`[sum N_i, K]`,
    `[sum ceil(N_i/bn), ceil(K/bk)]`), shards in the given order. Scale rows line up with weight
    blocks only if every shard but the last has N_i % bn == 0; otherwise ValueError (requantize).
    """
    if len(weights) != len(scales) or not weights:
        raise ValueError("concat_block_fp8_shards: need matching, non-empty weight and scale lists")
    bn, bk = block
    k = weights[0].shape[-1]
    for i, (w, s) in enumerate(zip(weights, scales)):
        n = w.shape[-2]
        if w.shape[-1] != k:
            raise ValueError(f"shard {i}: K {w.shape[-1]} != {k}")
        if tuple(s.shape[-2:]) != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"shard {i}: scale shape {tuple(s.shape)} does not match weight {tuple(w.shape)} / {block}")
        if i < len(weights) - 1 and n % bn:
            raise ValueError(f"shard {i}: N={n} is not a multiple of {bn}; scale blocks would straddle shards")
    return torch.cat(list(weights), -2), torch.cat(list(scales), -2)
