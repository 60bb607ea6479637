"""`ServeArgs`: the typed application arguments of `build_app` (serve config `args:`, CLI flags).

Unknown keys are an error (a typo in a serve config must not be silently ignored).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ServeArgs:
    model: str = "tiny"                    # HF directory, or "tiny" = the cached tiny GLM-5
    served_model_name: str | None = None   # default: the directory name
    tp: int = 1
    device: str = "auto"                   # "auto" | "cpu" | "cuda"
    dtype: str = "auto"
    load_format: str = "auto"              # "auto" | "dummy"
    kernel_backend: str = "auto"
    fp8_proj_gemm: bool = False            # also GLM_RAY_FP8_PROJ_GEMM=1
    fp8_proj_min_tokens: int = 512
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

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServeArgs":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown glm-ray app argument(s) {unknown}; known: {sorted(known)}")
        if "fp8_proj_gemm" not in d and _env_flag("GLM_RAY_FP8_PROJ_GEMM"):
            d["fp8_proj_gemm"] = True
        args = cls(**d)
        if args.tp < 1:
            raise ValueError(f"tp must be >= 1, got {args.tp}")
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        if args.fp8_proj_min_tokens < 0:
            raise ValueError(f"fp8_proj_min_tokens must be >= 0, got {args.fp8_proj_min_tokens}")
        return args

    def resolved_model(self) -> str:
        from glm_ray.model.tiny import resolve_model
        return resolve_model(self.model)

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "glm5-tiny" if self.model == "tiny" else os.path.basename(os.path.normpath(self.model))

    def uses_gpu(self) -> bool:
        if self.device == "auto":
            import torch
            return torch.cuda.is_available()
        return self.device == "cuda"

    def to_dict(self) -> dict:
        return asdict(self)
