"""Frozen configuration dataclasses: the HF config is normalized once, here, and nowhere else.

`ModelConfig.from_hf(dict)` reads a `config.json` (glm_moe_dsa / GLM-5 family, GLM-4.7-Flash's
glm4_moe_lite which is the same model without the indexer, and GLM-5.3-Flash's glm5_next, whose text
config is nested under `text_config` and whose vision tower is not served) and derives everything
layers need.
Engine knobs live in `CacheConfig`, `SchedulerConfig`, `ParallelConfig` and `EngineConfig`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glm_ray import envs

SUPPORTED_ARCHITECTURES = {
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Glm5NextForConditionalGeneration": "glm5_next",
}
_DSA_ARCHITECTURES = ("GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"                  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        """Multiplier on cos/sin (yarn's attention_factor; 1 for default rope)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)
        return self.get_mscale(self.factor)

    @property
    def softmax_mscale_sq(self) -> float:
        """DeepSeek yarn: softmax scale *= mscale(factor, mscale_all_dim)^2."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = self.get_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]            # "dense" | "sparse" per layer
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    # DSA indexer (None index_topk -> no indexer, e.g. GLM-4.7-Flash)
    index_topk: int | None
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]              # "full" | "shared" per layer ("none" without indexer)
    indexer_rope_interleave: bool
    swiglu_limit: float | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: torch.dtype
    quantization_config: dict | None = None
    # GLM-5.3-Flash (glm5_next): per-layer mixer, KDA linear attention, k-pool indexer, mHC
    layer_types: tuple[str, ...] = ()           # "attention" (MLA) | "linear_attention" (KDA) per layer
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = None
    index_kpool: int = 0                        # 0: per-token DSA keys (GLM-5); >0: pooled keys
    index_kpool_always_select_tail: bool = True
    hc_mult: int = 0                            # 0: plain residual; n: mHC with n residual streams
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer: the normalized latent c (r) and the roped shared key (dr)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def index_cache_dim(self) -> int:
        """Per token per full-indexer layer: the index key, and with k-pools its pool gate score."""
        return self.index_head_dim * (2 if self.index_kpool else 1)

    def attention_layers(self) -> list[int]:
        """Layers with an MLA latent cache (every layer, except the KDA layers of a hybrid model)."""
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    def linear_attention_layers(self) -> list[int]:
        """KDA layers: a fixed-size recurrent state per sequence instead of a KV cache."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale_sq

    def full_indexer_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype = "auto") -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected an HF model directory)")
        with open(cfg_path) as f:
            return cls.from_hf(json.load(f), dtype=dtype)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str | torch.dtype = "auto") -> "ModelConfig":
        hf = dict(hf)
        archs = hf.get("architectures") or []
        if not archs and hf.get("model_type") in ("glm5_next", "glm5_next_text"):
            archs = ["Glm5NextForConditionalGeneration"]                # a bare text config (bundled)
        arch = archs[0] if archs else None
        if isinstance(hf.get("text_config"), dict):                 # glm5_next: serve the text model
            top = hf
            hf = {**hf["text_config"], "architectures": archs}
            hf.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
            for k in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype", "quantization_config"):
                if hf.get(k) is None and top.get(k) is not None:
                    hf[k] = top[k]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type {hf.get('model_type')!r}); "
                f"glm-ray serves {sorted(SUPPORTED_ARCHITECTURES)}")
        L = hf["num_hidden_layers"]
        n_dense = min(hf.get("first_k_dense_replace", 0), L)
        mlp_types = tuple(hf.get("mlp_layer_types") or (["dense"] * n_dense + ["sparse"] * (L - n_dense)))
        if hf.get("n_routed_experts") is None and hf.get("num_experts") is not None:
            hf["n_routed_experts"] = hf["num_experts"]

        index_topk = hf.get("index_topk") if arch in _DSA_ARCHITECTURES else None
        layer_types = tuple(_layer_types(hf, L))
        indexer_types = tuple(_indexer_types(hf, L)) if index_topk is not None else ("none",) * L
        # a KDA layer has no indexer, whatever the per-layer list says
        indexer_types = tuple("none" if m == "linear_attention" else t for m, t in zip(layer_types, indexer_types))
        first = next((t for t in indexer_types if t != "none"), "full")
        if index_topk is not None and first != "full":
            raise ValueError("the first indexed layer must be 'full': a shared layer needs a previous full layer")
        hc_mult = (hf.get("hc_mult", 0) or 0) if arch == "Glm5NextForConditionalGeneration" else 0
        if arch == "Glm5NextForConditionalGeneration" and hf.get("mhc") is False:
            hc_mult = 0                                               # sglang's switch for checkpoints without mHC

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            model_type=hf.get("model_type", SUPPORTED_ARCHITECTURES[arch]),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=L,
            num_attention_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_routed_experts=hf["n_routed_experts"],
            n_shared_experts=hf.get("n_shared_experts", 0) or 0,
            num_experts_per_tok=hf["num_experts_per_tok"],
            n_group=hf.get("n_group", 1) or 1,
            topk_group=hf.get("topk_group", 1) or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            mlp_layer_types=mlp_types,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope=_rope(hf),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0) or 0,
            index_topk=index_topk,
            index_n_heads=hf.get("index_n_heads", 0) or 0,
            index_head_dim=hf.get("index_head_dim", 0) or 0,
            indexer_types=indexer_types,
            indexer_rope_interleave=bool(hf.get("indexer_rope_interleave", True)),
            swiglu_limit=hf.get("swiglu_limit"),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            dtype=_dtype(dtype, hf),
            quantization_config=hf.get("quantization_config"),
            layer_types=layer_types,
            linear_num_heads=hf.get("linear_num_heads", 0) or 0,
            linear_head_dim=hf.get("linear_head_dim", 0) or 0,
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4) or 4,
            linear_lower_bound=hf.get("linear_lower_bound"),
            index_kpool=(hf.get("index_kpool", 0) or 0) if arch == "Glm5NextForConditionalGeneration" else 0,
            index_kpool_always_select_tail=bool(hf.get("index_kpool_always_select_tail", True)),
            hc_mult=hc_mult,
            hc_eps=float(hf.get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
            hf=hf,
        )


def _layer_types(hf: dict, L: int) -> list[str]:
    """Token mixer per layer: "attention" (MLA) or "linear_attention" (KDA, glm5_next only)."""
    types = list(hf.get("layer_types") or ["attention"] * L)[:L]
    out = []
    for t in types:
        if t in ("full_attention", "indexed_attention", "attention"):
            out.append("attention")
        elif t == "linear_attention":
            out.append(t)
        else:
            raise ValueError(f"unsupported layer type {t!r} in layer_types")
    return out


def _indexer_types(hf: dict, L: int) -> list[str]:
    """Same precedence as transformers: explicit list, then the F/S pattern, then freq/offset."""
    if hf.get("indexer_types"):
        return list(hf["indexer_types"])[:L]
    pattern = hf.get("index_topk_pattern")
    if pattern:
        return [{"F": "full", "S": "shared"}[c] for c in pattern][:L]
    freq = max(hf.get("index_topk_freq", 1) or 1, 1)
    offset = hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]


def _rope(hf: dict) -> RopeConfig:
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ("default", "yarn"):
        raise ValueError(f"unsupported rope_type {rtype!r} (supported: default, yarn)")
    if rtype == "default":
        return RopeConfig(theta=float(theta))
    omax = rp.get("original_max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / omax
    return RopeConfig(
        theta=float(theta), rope_type="yarn", factor=float(factor),
        original_max_position_embeddings=omax,
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"),
        attention_factor=rp.get("attention_factor"), truncate=rp.get("truncate", True))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(dtype: str | torch.dtype, hf: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None   # explicit budget; None -> derived (below)
    gpu_memory_utilization: float = 0.90       # share of device memory for weights + KV (GPU only)
    cpu_kv_cache_bytes: int = 512 * 2**20      # default budget on CPU
    enable_prefix_caching: bool = True         # reuse computed KV blocks across requests (engine/kv_cache.py)

    def __post_init__(self):
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64                     # running requests per step
    max_num_batched_tokens: int = 2048         # token budget per step (chunked prefill splits above it)
    max_model_len: int | None = None           # None -> min(max_position_embeddings, KV capacity)
    max_waiting: int = 4096                    # beyond this the engine answers "overloaded"
    policy: str = "fcfs"                       # waiting-queue order: fcfs | lpm (longest cached prefix first)

    def __post_init__(self):
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {SCHEDULE_POLICIES}, got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # the GPU share each rank's actor (and its placement-group bundle) reserves: 0.5 lets two TP1 replicas
    # share one GPU (each then needs an explicit KV budget: the memory-utilization sizing sees the other's)
    gpus_per_rank: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.gpus_per_rank <= 1.0:
            raise ValueError(f"gpus_per_rank must be in (0, 1], got {self.gpus_per_rank}")
        if self.gpus_per_rank < 1.0 and self.tensor_parallel_size > 1:
            raise ValueError("gpus_per_rank < 1 needs tensor_parallel_size 1 (two ranks of one TP group must "
                             "not share a GPU)")


@dataclass(frozen=True)
class EngineConfig:
    model: str                                 # HF directory
    dtype: str = "auto"
    device: str = "auto"                       # "auto" | "cpu" | "cuda"
    load_format: str = "auto"                  # "auto" (safetensors) | "dummy" (random weights)
    kernel_backend: str = "auto"
    mla_mode: str = "auto"                     # "auto" (naive prefill, absorbed decode) | "naive" | "absorbed"
    fp8_proj_gemm: bool = False                # issue 5: prefill-only FP8 q_b/o_proj GEMM
    fp8_proj_min_tokens: int = 512
    enforce_eager: bool = False                # True: no CUDA graphs at all (vLLM's --enforce-eager)
    # prefill / mixed steps of up to this many tokens replay piecewise CUDA graphs (worker/piecewise_graph.py;
    # sglang's --piecewise-cuda-graph-max-tokens); None = max_num_batched_tokens, 0 = off
    piecewise_graph_max_tokens: int | None = None
    # schedule and launch step N+1 before reading step N's tokens back (vLLM's --async-scheduling); TP=1.
    # None = on where it pays: an in-process executor on a GPU (on the CPU the "device" is the host)
    async_scheduling: bool | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        if self.fp8_proj_min_tokens < 0:
            raise ValueError(f"fp8_proj_min_tokens must be >= 0, got {self.fp8_proj_min_tokens}")
        if self.piecewise_graph_max_tokens is not None and self.piecewise_graph_max_tokens < 0:
            raise ValueError(f"piecewise_graph_max_tokens must be >= 0, got {self.piecewise_graph_max_tokens}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine_config(model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", device: str = "auto",
                       load_format: str = "auto", kernel_backend: str = "auto", mla_mode: str = "auto",
                       max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                       block_size: int = 16, kv_cache_memory_bytes: int | None = None,
                       gpu_memory_utilization: float = 0.9, max_waiting: int = 4096, seed: int = 0,
                       fp8_proj_gemm: bool | None = None, fp8_proj_min_tokens: int = 512,
                       enforce_eager: bool = False, async_scheduling: bool | None = None,
                       enable_prefix_caching: bool = True, gpus_per_rank: float = 1.0,
                       piecewise_graph_max_tokens: int | None = None, schedule_policy: str = "fcfs") -> EngineConfig:
    if fp8_proj_gemm is None:       # the flag's third spelling: GLM_RAY_FP8_PROJ_GEMM=1
        fp8_proj_gemm = envs.FP8_PROJ_GEMM.get()
    return EngineConfig(
        model=model, dtype=dtype, device=device, load_format=load_format, kernel_backend=kernel_backend,
        mla_mode=mla_mode, seed=seed, fp8_proj_gemm=fp8_proj_gemm, fp8_proj_min_tokens=fp8_proj_min_tokens,
        enforce_eager=enforce_eager, async_scheduling=async_scheduling,
        piecewise_graph_max_tokens=piecewise_graph_max_tokens, cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                          gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, max_waiting=max_waiting, policy=schedule_policy),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, gpus_per_rank=gpus_per_rank))
