"""Test helpers: quant configs, checkpoint tensors for one layer, loading them through the real
weight loaders and checkpoint-name map (glm_moe_dsa._checkpoint_names), like load_weights does."""
from __future__ import annotations

import numpy as np
import torch

from glm_ray.kernels.torch_ref.fp8 import quant_weight_block
from glm_ray.kernels.torch_ref.mxfp4 import quant_mxfp4
from glm_ray.model.base import _checkpoint_names
from glm_ray.model.quantize import _quark_fp8_block_layer, quark_quantization_config
from glm_ray.quant.config import parse_quant_config
from glm_ray.quant.dispatch import SpecQuantConfig
from glm_ray.weights import CheckpointTensor

FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_config(**kw) -> SpecQuantConfig:
    return SpecQuantConfig(parse_quant_config({**FP8_QC, **kw}))


def quark_config(scale_mode: str = "even", exclude=(), fp8_pattern: str | None = None) -> SpecQuantConfig:
    qc = quark_quantization_config(list(exclude), None, scale_mode=scale_mode)
    if fp8_pattern:
        qc["layer_quant_config"] = {fp8_pattern: _quark_fp8_block_layer()}
    return SpecQuantConfig(parse_quant_config(qc))


def quantize_tensor(w: torch.Tensor, fmt: str, *, ue8m0: bool = False, mode: str = "even"):
    """float `[N, K]` -> (weight, scale) in checkpoint format: "fp8" (e4m3 + fp32 block scales) | "mxfp4"."""
    if fmt == "fp8":
        return quant_weight_block(w, (128, 128), ue8m0=ue8m0)
    if fmt == "mxfp4":
        return quant_mxfp4(w.float(), mode)
    raise ValueError(fmt)


def expert_tensors(prefix: str, wg, wu, wd, fmt: str, scale_name: str, **kw) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors for `prefix` (= `...mlp.experts`); wg/wu `[E, I, H]`, wd `[E, H, I]`."""
    out = {}
    for e in range(wg.shape[0]):
        for proj, w in (("gate_proj", wg[e]), ("up_proj", wu[e]), ("down_proj", wd[e])):
            q, s = quantize_tensor(w, fmt, **kw)
            out[f"{prefix}.{e}.{proj}.weight"] = q
            out[f"{prefix}.{e}.{proj}.{scale_name}"] = s
    return out


def load_module(module: torch.nn.Module, prefix: str, tensors: dict[str, torch.Tensor], *, strict: bool = True,
                process: bool = True) -> None:
    """Load checkpoint `tensors` into a layer built with `prefix`, through its params' weight loaders."""
    used = set()
    for pname, p in module.named_parameters():
        owner = module.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else module
        for ck, kw in _checkpoint_names(f"{prefix}.{pname}", owner):
            if ck not in tensors:
                if strict:
                    raise KeyError(f"missing {ck}")
                continue
            loader = getattr(p, "weight_loader", None) or owner.weight_loader
            loader(p, CheckpointTensor.from_tensor(ck, tensors[ck]), **kw)
            used.add(ck)
    if strict and set(tensors) - used:
        raise KeyError(f"unused {sorted(set(tensors) - used)[:3]}")
    if process:
        module.quant_method.process_weights_after_loading(module)


def routing(T: int, E: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def expert_weights(E: int, H: int, I: int, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(E, I, H, generator=g) * scale * H ** -0.5
    wu = torch.randn(E, I, H, generator=g) * scale * H ** -0.5
    wd = torch.randn(E, H, I, generator=g) * I ** -0.5
    return wg, wu, wd


PROMPT_LENGTHS = (5, 30, 57)


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def prompt_logprobs(path, **kw) -> np.ndarray:
    """Our engine's logprob of every prompt token after the first (89 positions), fp32 compute."""
    from glm_ray import LLM, SamplingParams
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, **kw)
    ps = prompts()
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return np.array([o.prompt_logprobs[i][p[i]] for o, p in zip(outs, ps) for i in range(1, len(p))])
