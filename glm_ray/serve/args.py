"""`ServeArgs`: the typed application arguments of `build_app` (serve config `args:`, CLI flags).

Strict: unknown keys are an error (a typo in a serve config must not be silently ignored), and every
value is checked against its field's type. `serve run glm_ray.serve.app:build_app tp=2` passes every
`key=value` as a string, so strings are parsed by the field's type (ints, floats, booleans as
true/false/1/0/yes/no/on/off, "none"/"null" for the optional ones); errors name the argument.

`api_key` falls back to the environment variable `GLM_RAY_API_KEY` (vLLM: `VLLM_API_KEY`). It is
carried by `to_dict()` (the Router and the ingress receive their args that way) but never shown by
`repr()` / `to_log_dict()`.
"""
from __future__ import annotations

import math
import os
import re
import types
import typing
from dataclasses import asdict, dataclass, fields

import torch

from glm_ray import envs
from glm_ray.model.tiny import resolve_model

API_KEY_ENV = envs.API_KEY.name

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")
_INT = re.compile(r"[+-]?\d+")

# allowed values of the string-valued choices (the engine resolves "auto")
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "bfloat16", "float16", "float32"),
    "load_format": ("auto", "dummy"),
    "kernel_backend": ("auto", "torch", "cuda", "aiter"),
}


@dataclass(frozen=True, repr=False)
class ServeArgs:
    model: str = "tiny"                    # HF directory, or "tiny" = the cached tiny GLM-5
    served_model_name: str | None = None   # default: the directory name ("glm5-tiny" for "tiny")
    tp: int = 1
    device: str = "auto"                   # "auto" | "cpu" | "cuda"
    dtype: str = "auto"
    load_format: str = "auto"              # "auto" | "dummy"
    kernel_backend: str = "auto"
    fp8_proj_gemm: bool = False            # also GLM_RAY_FP8_PROJ_GEMM=1
    fp8_proj_min_tokens: int = 512
    enforce_eager: bool = False            # no decode CUDA graphs
    async_scheduling: bool = False         # overlap step N+1's scheduling and launch with step N (TP=1)
    engine_in_worker: bool = True          # the engine loop runs in rank 0's actor (no Ray call per step)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None
    max_queued_requests: int = 1024        # engine waiting-queue bound; beyond it -> 503 + Retry-After
    ingress_replicas: int = 1
    router_cpus: float = 0.5
    accelerator_type: str | None = None    # e.g. "AMD-Instinct-MI355X-OAM", "H200": pins the GPU bundles
    api_key: str | None = None             # required as `Authorization: Bearer <key>` on /v1/*; env GLM_RAY_API_KEY
    trust_request_chat_template: bool = False  # accept a request-level `chat_template` (vLLM's flag)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServeArgs":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown glm-ray app argument(s) {unknown}; known: {sorted(known)}")
        hints = _field_types(cls)
        d = {k: _coerce(k, hints[k], v) for k, v in d.items()}
        if "fp8_proj_gemm" not in d and envs.FP8_PROJ_GEMM.get():
            d["fp8_proj_gemm"] = True
        if not d.get("api_key"):
            d["api_key"] = envs.API_KEY.get()
        args = cls(**d)
        args._validate()
        return args

    def _validate(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"glm-ray app argument {name}: must be {what}, got {getattr(self, name)!r}")
        for name, allowed in CHOICES.items():
            need(getattr(self, name) in allowed, name, f"one of {list(allowed)}")
        need(bool(self.model), "model", "a model directory or 'tiny'")
        need(self.tp >= 1, "tp", ">= 1")
        need(self.fp8_proj_min_tokens >= 0, "fp8_proj_min_tokens", ">= 0")
        need(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1 (or none)")
        need(self.block_size >= 1, "block_size", ">= 1")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0 (or none)")
        need(self.max_queued_requests >= 0, "max_queued_requests", ">= 0")
        need(self.ingress_replicas >= 1, "ingress_replicas", ">= 1")
        need(self.router_cpus >= 0, "router_cpus", ">= 0")

    def resolved_model(self) -> str:
        return resolve_model(self.model)

    def model_name(self) -> str:
        """The model id clients send (`"model"` of a request, `id` in /v1/models)."""
        if self.served_model_name:
            return self.served_model_name
        return "glm5-tiny" if self.model == "tiny" else os.path.basename(os.path.normpath(self.model))

    def uses_gpu(self) -> bool:
        if self.device == "auto":
            return torch.cuda.is_available()
        return self.device == "cuda"

    def to_dict(self) -> dict:
        """Every field, the API key included: what the Router and the ingress are built from. Do not log
        it; log `to_log_dict()`."""
        return asdict(self)

    def to_log_dict(self) -> dict:
        """`to_dict()` with the API key masked: safe for logs and banners."""
        d = asdict(self)
        if d["api_key"] is not None:
            d["api_key"] = "***"
        return d

    def __repr__(self) -> str:
        return "ServeArgs(" + ", ".join(f"{k}={v!r}" for k, v in self.to_log_dict().items()) + ")"


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _optional_inner(tp) -> tuple[bool, typing.Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _coerce(name: str, tp, value):
    """`value` as the field's type; strings (what `serve run key=value` passes) are parsed."""
    optional, base = _optional_inner(tp)

    def bad(what: str):
        return ValueError(f"glm-ray app argument {name}: expected {what}{' or none' if optional else ''}, "
                          f"got {value!r}")

    if value is None:
        if optional:
            return None
        raise bad(base.__name__)
    if optional and isinstance(value, str) and value.strip().lower() in _NONE:
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("a boolean (true/false)")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            return int(value.strip())
        raise bad("an integer")
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                raise bad("a number") from None
        else:
            raise bad("a number")
        if not math.isfinite(out):
            raise bad("a finite number")
        return out
    if base is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    raise TypeError(f"ServeArgs.{name}: unsupported field type {tp!r}")   # a new field of a new type
