"""`glm-ray quantize SRC DST --scheme fp8-block|quark-mxfp4-moe`: write a real-format quantized checkpoint.

Input: an HF GLM-5 directory with unquantized (bf16/fp32) safetensors (e.g. `glm-ray make-tiny`).
Output: the same directory layout (same shard files, index, tokenizer and other files copied) with
quantized tensors and a `quantization_config` in config.json, in the formats real releases use:

* `fp8-block` — DeepSeek-V3 / zai-org GLM block FP8 (quant_contracts.md §2.1): every quantizable
  linear `X.weight` becomes float8_e4m3fn `[N, K]` + `X.weight_scale_inv` fp32 `[ceil(N/128), ceil(K/128)]`
  (per-128x128-block amax/448; `ue8m0=True` rounds the scales up to powers of two and writes
  `scale_fmt: "ue8m0"`, the DeepSeek-V3.1 convention of fp32 power-of-two scales).
  Stays bf16 (model_arch.md §4.1, NeMo "GLM-5.3 keeps these in BF16"): norms, `mlp.gate` (router) and
  its `e_score_correction_bias`, `embed_tokens`, `lm_head`, `eh_proj`, `indexer.weights_proj`,
  `indexer.k_norm`, plus any module named in `keep_bf16` (e.g. `kv_b_proj`, which some GLM releases
  ship in bf16). Unquantized *linear* modules are listed in `ignored_layers` (sglang's key; transformers
  reads it as an alias of `modules_to_not_convert`) so both stacks build them as plain linears.
  config: `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "ignored_layers": [...]}`.
* `quark-mxfp4-moe` — the amd/GLM-5.3-Flash-Quark-MXFP4 layout (origin PR A; §3.6): routed and shared
  experts of the MoE layers (first_k_dense_replace .. L-1) in OCP MXFP4 (`weight` U8 `[N, K/2]` low nibble first, `weight_scale`
  U8 E8M0 `[N, K/32]`, Quark "even" scales, RNE elements); the MTP layer (index L) in block FP8 with
  Quark's naming (`weight_scale`, fp32) through a `layer_quant_config` pattern; everything else
  unquantized through `exclude` (exact names and `re:` regexes, as Quark exports). The global config
  is the MXFP4 W4A4 spec (dynamic MXFP4 activations, `scale_calculation_mode` as given).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm_ray.kernels.torch_ref.fp8 import quant_weight_block
from glm_ray.kernels.torch_ref.mxfp4 import canonical_scale_mode, quant_mxfp4
from glm_ray.model.tiny import write_tiny

logger = logging.getLogger(__name__)

SCHEMES = ("fp8-block", "quark-mxfp4-moe")
FP8_BLOCK = (128, 128)

# Linear modules that are block-FP8 in GLM FP8 releases (module name suffixes, matched at a "." boundary).
_FP8_LINEARS = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))$")
# Linear modules that exist in GLM but stay bf16 (listed as ignored/excluded so loaders build plain linears).
_BF16_LINEARS = re.compile(r"(^lm_head$|\.eh_proj$|\.mlp\.gate$|\.indexer\.weights_proj$)")
_EXPERT = re.compile(r"^(model\.(?:language_model\.)?layers\.(\d+))\.mlp\.(experts\.\d+|shared_experts)\."
                     r"(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def _module_of(tensor_name: str) -> str | None:
    return tensor_name[: -len(".weight")] if tensor_name.endswith(".weight") else None


def _matches_any(module: str, names) -> bool:
    return any(module == n or module.endswith("." + n) for n in names)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------

def fp8_quantization_config(ignored: list[str], ue8m0: bool = False) -> dict:
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
          "ignored_layers": sorted(ignored)}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    return qc


def _mx_spec(dynamic: bool, mode: str) -> dict:
    return {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32, "is_dynamic": dynamic,
            "symmetric": None, "round_method": "half_even", "scale_type": "float", "scale_format": "e8m0",
            "scale_calculation_mode": mode, "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver",
            "is_scale_quant": False, "zero_point_type": "int32", "block_size": None}


def _quark_fp8_block_layer() -> dict:
    return {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_block", "ch_axis": None, "group_size": None,
                       "block_size": list(FP8_BLOCK), "is_dynamic": False, "symmetric": True,
                       "round_method": "half_even", "scale_type": "float32", "scale_format": None,
                       "observer_cls": "PerBlock2DMinMaxObserver", "is_scale_quant": False},
            "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_group", "ch_axis": -1,
                              "group_size": FP8_BLOCK[1], "block_size": None, "is_dynamic": True, "symmetric": True,
                              "round_method": "half_even", "scale_type": "float32", "scale_format": None,
                              "observer_cls": "PerBlockMinMaxObserver", "is_scale_quant": False},
            "output_tensors": None, "bias": None, "target_device": None}


def quark_quantization_config(exclude: list[str], mtp_layer: int | None, *, prefix: str = "model.layers",
                              scale_mode: str = "even") -> dict:
    return {
        "quant_method": "quark",
        "global_quant_config": {"weight": _mx_spec(False, scale_mode), "input_tensors": _mx_spec(True, scale_mode),
                                "output_tensors": None, "bias": None, "target_device": None},
        "layer_type_quant_config": {},
        "layer_quant_config": ({} if mtp_layer is None else {f"{prefix}.{mtp_layer}.*": _quark_fp8_block_layer()}),
        "kv_cache_quant_config": {},
        "exclude": exclude,
        "algo_config": None,
        "softmax_quant_spec": None,
        "quant_mode": "eager_mode",
        "version": "0.13",
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


# --------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------

def _read_shards(src: Path) -> tuple[list[Path], dict | None]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            idx = json.load(f)
        return [src / n for n in sorted(set(idx["weight_map"].values()))], idx
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no safetensors shards")
    return files, None


class _Plan:
    """Which format each linear module gets (decided from names + config, before any tensor is read)."""

    def __init__(self, scheme: str, hf: dict, keep_bf16: tuple[str, ...]):
        self.scheme = scheme
        hf = hf.get("text_config") or hf                   # glm5_next nests the text model's config
        self.L = int(hf["num_hidden_layers"])
        self.first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
        mlp_types = hf.get("mlp_layer_types")
        self.sparse = {i for i in range(self.L)
                       if (mlp_types[i] == "sparse" if mlp_types else i >= self.first_dense)}
        self.keep_bf16 = tuple(keep_bf16)
        self.mtp = bool(int(hf.get("num_nextn_predict_layers", 0) or 0))
        # GLM-5.3-Flash KDA layers: their projections stay bf16 (no published FP8/MXFP4 recipe for them)
        self.kda = {i for i, t in enumerate(hf.get("layer_types") or []) if t == "linear_attention"}

    def is_kda(self, module: str) -> bool:
        m = _LAYER.match(module)
        return m is not None and int(m.group(1)) in self.kda and ".self_attn." in module

    def fmt(self, module: str) -> str:
        """'fp8' | 'mxfp4' | 'keep' for a module holding a 2-D `.weight`."""
        if not _FP8_LINEARS.search(module) or _matches_any(module, self.keep_bf16) or self.is_kda(module):
            return "keep"
        if self.scheme == "fp8-block":
            return "fp8"
        m = _LAYER.match(module)
        layer = int(m.group(1)) if m else -1
        if layer >= self.L:                                 # MTP layer(s): block FP8 (Quark naming)
            return "fp8"
        if _EXPERT.match(module) and layer in self.sparse:
            return "mxfp4"
        return "keep"


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str, *, ue8m0: bool = False,
                        keep_bf16: tuple[str, ...] | list[str] = (), scale_mode: str = "even") -> Path:
    """Quantize the HF checkpoint at `src` into `dst` (created; must not be `src`). Returns `dst`.

    scheme: "fp8-block" | "quark-mxfp4-moe". ue8m0: power-of-two FP8 scales (fp8-block only).
    keep_bf16: extra module names (exact or trailing, e.g. "kv_b_proj") kept unquantized and listed in
    the config's ignore/exclude list. scale_mode: MXFP4 E8M0 scale rounding ("even" = Quark default).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("quantize: DST must differ from SRC")
    scale_mode = canonical_scale_mode(scale_mode)
    with open(src / "config.json") as f:
        hf = json.load(f)
    if hf.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({hf['quantization_config'].get('quant_method')!r})")
    plan = _Plan(scheme, hf, tuple(keep_bf16))
    files, index = _read_shards(src)
    dst.mkdir(parents=True, exist_ok=True)

    weight_map: dict[str, str] = {}
    total = 0
    unquantized_linears: set[str] = set()
    lm_prefix = "model.layers"
    counts = {"fp8": 0, "mxfp4": 0, "keep": 0}
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                module = _module_of(name)
                if module and module.startswith("model.language_model."):
                    lm_prefix = "model.language_model.layers"
                fmt = plan.fmt(module) if (module and t.ndim == 2 and t.dtype.is_floating_point) else "keep"
                if module and t.ndim == 2 and fmt == "keep" and (_FP8_LINEARS.search(module)
                                                                 or _BF16_LINEARS.search(module) or plan.is_kda(module)):
                    unquantized_linears.add(module)
                counts[fmt] += 1 if module else 0
                if fmt == "fp8":
                    q, s = quant_weight_block(t, FP8_BLOCK, ue8m0=ue8m0 and scheme == "fp8-block")
                    out[name] = q
                    out[module + (".weight_scale_inv" if scheme == "fp8-block" else ".weight_scale")] = s
                elif fmt == "mxfp4":
                    p, s = quant_mxfp4(t.float(), scale_mode)
                    out[name], out[module + ".weight_scale"] = p, s
                else:
                    out[name] = t
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update({k: file.name for k in out})
        total += sum(v.numel() * v.element_size() for v in out.values())

    if index is not None or len(files) > 1:
        with open(dst / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    for p in src.iterdir():                             # tokenizer, generation config, ...
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, dst / p.name)

    if scheme == "fp8-block":
        qc = fp8_quantization_config(sorted(unquantized_linears), ue8m0=ue8m0)
    else:
        qc = quark_quantization_config(_quark_exclude(sorted(unquantized_linears), plan, lm_prefix),
                                       plan.L if plan.mtp else None,
                                       prefix=lm_prefix, scale_mode=scale_mode)
    hf["quantization_config"] = qc
    with open(dst / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
    logger.info("quantized %s -> %s (%s): %s", src, dst, scheme, counts)
    return dst


def _quark_exclude(unquantized: list[str], plan: _Plan, lm_prefix: str) -> list[str]:
    """Quark-style exclude list: regexes for module kinds that are bf16 everywhere, exact names for the
    rest (attention / dense MLP / shared experts of the non-MTP layers)."""
    by_regex = ["lm_head", r"re:.*\.mlp\.gate$", r"re:.*\.eh_proj$", r"re:.*\.indexer\.weights_proj$"]
    covered = re.compile(r"(^lm_head$|\.mlp\.gate$|\.eh_proj$|\.indexer\.weights_proj$)")
    exact = [m for m in unquantized if not covered.search(m)]
    return by_regex + exact


TINY_QUANT = {"fp8": "fp8-block", "mxfp4": "quark-mxfp4-moe"}


def make_tiny_quantized(out_dir: str | os.PathLike, quant: str, config: dict | None = None, seed: int = 0) -> Path:
    """`glm-ray make-tiny DIR --quant fp8|mxfp4`: write_tiny into a scratch dir next to DIR, quantize into DIR."""
    if quant not in TINY_QUANT:
        raise ValueError(f"--quant must be one of {sorted(TINY_QUANT)}, got {quant!r}")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.bf16.") as tmp:
        write_tiny(tmp, config, seed=seed)
        return quantize_checkpoint(tmp, out, TINY_QUANT[quant])


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def cmd_quantize(a) -> int:
    out = quantize_checkpoint(a.src, a.dst, a.scheme, ue8m0=a.ue8m0, keep_bf16=tuple(a.keep_bf16 or ()),
                              scale_mode=a.scale_mode)
    print(f"wrote {out}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """`glm-ray quantize SRC DST --scheme fp8-block|quark-mxfp4-moe [--ue8m0] [--keep-bf16 NAME ...]`."""
    p = subparsers.add_parser("quantize", help="write a block-FP8 or Quark-MXFP4-MoE copy of an unquantized checkpoint")
    p.add_argument("src", help="unquantized HF checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--ue8m0", action="store_true", help="fp8-block: power-of-two (UE8M0) block scales")
    p.add_argument("--keep-bf16", action="append", metavar="MODULE",
                   help="keep this module unquantized (exact or trailing name, e.g. kv_b_proj); repeatable")
    p.add_argument("--scale-mode", default="even", choices=["even", "round_up", "round_down", "ceil"],
                   help="quark-mxfp4-moe: E8M0 scale rounding of weights and declared for activations")
    p.set_defaults(func=cmd_quantize)
    return p
