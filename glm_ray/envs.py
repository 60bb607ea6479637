"""Every `GLM_RAY_*` environment variable: its type, default and meaning, in one place.

Each is an `EnvVar`; code reads it with `.get()` (parsed and checked: a bad value is an error naming the
variable, never a silent default) where the component that uses it starts — worker start-up, kernel
backend resolution, the ingress's constructor — never per step. The Ray worker group forwards every
`GLM_RAY_*` variable of the Router's process to its rank actors, so a knob set where the app runs
reaches every rank. The README's "Environment variables" table is `table()`; a test keeps both in sync
and checks that no `GLM_RAY_` name is used in the package without being declared here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    v = raw.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE}")


def _positive_int(raw: str) -> int:
    v = int(raw)
    if v < 1:
        raise ValueError("expected an integer >= 1")
    return v


def _nonneg_int(raw: str) -> int:
    v = int(raw)
    if v < 0:
        raise ValueError("expected an integer >= 0")
    return v


def _positive_float(raw: str) -> float:
    v = float(raw)
    if not v > 0:
        raise ValueError("expected a number > 0")
    return v


def _nonneg_float(raw: str) -> float:
    v = float(raw)
    if not v >= 0:
        raise ValueError("expected a number >= 0")
    return v


def _names(raw: str) -> frozenset[str]:
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {options}")
        return raw
    return parse


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: Any
    help: str
    type_name: str = "str"

    def get(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


API_KEY: EnvVar[str | None] = EnvVar(
    "GLM_RAY_API_KEY", str, None, "API key required as `Authorization: Bearer <key>` on /v1/* "
    "(same as `--api-key` / the `api_key` app argument; vLLM: VLLM_API_KEY)")
FP8_PROJ_GEMM: EnvVar[bool] = EnvVar(
    "GLM_RAY_FP8_PROJ_GEMM", _bool, False, "turn on the prefill-only FP8 q_b_proj/o_proj GEMM "
    "(same as `--fp8-proj-gemm`)", "bool")
FP8_PROJ_FORCE: EnvVar[bool] = EnvVar(
    "GLM_RAY_FP8_PROJ_FORCE", _bool, False, "measurement only: take the FP8 projection path even where "
    "the backend has no fast FP8 GEMM (the emulated path)", "bool")
CACHE: EnvVar[Path] = EnvVar(
    "GLM_RAY_CACHE", Path, Path.home() / ".cache" / "glm-ray", "where `model=tiny` is written once",
    "path")
CPU_THREADS: EnvVar[int | None] = EnvVar(
    "GLM_RAY_CPU_THREADS", _positive_int, None, "torch threads per CPU rank (default: (cores - 1) / tp, "
    "leaving a core to the Router, ingress and proxy)", "int")
ORCHESTRATION: EnvVar[str] = EnvVar(
    "GLM_RAY_ORCHESTRATION", _choice("auto", "compiled", "actor"), "auto", "per-step calls to the TP "
    "ranks: Ray Compiled Graph (`auto` on GPUs) or plain actor calls (`auto` on CPU)")
TIME_COLLECTIVES: EnvVar[bool] = EnvVar(
    "GLM_RAY_TIME_COLLECTIVES", _bool, False, "measurement only: time every all-reduce/gather (adds "
    "syncs)", "bool")
STEP_TIMELINE: EnvVar[bool] = EnvVar(
    "GLM_RAY_STEP_TIMELINE", _bool, False, "measurement only: rank 0 marks each step's device work (CUDA "
    "events read after the step's own host wait) and reports its device time and the device's idle gap before it "
    "(worker/step_timeline.py; `bench.orchestration` sets it)", "bool")
TORCH_OPS: EnvVar[frozenset[str]] = EnvVar(
    "GLM_RAY_TORCH_OPS", _names, frozenset(), "comma-separated kernel ops sent to the torch reference on "
    "any backend (a kernel's A/B inside one deployment)", "names")
CUDA_FP8_GEMM: EnvVar[str] = EnvVar(
    "GLM_RAY_CUDA_FP8_GEMM", _choice("scaled_mm", "triton"), "scaled_mm", "cuda backend: block-FP8 "
    "GEMM implementation")
CUDA_FP8_SMALL_M: EnvVar[int] = EnvVar(
    "GLM_RAY_CUDA_FP8_SMALL_M", _nonneg_int, 64, "cuda backend: block-FP8 linears of at most this many rows (64 "
    "at most) run the fused Triton kernel with the activation quant inside (kernels/cuda/fp8_small_m.py); 0 = off "
    "(act quant + `_scaled_mm`). 64: with the H200-tuned tiles, glm5-flash-31b decode at batch 64 ran 18.1 vs "
    "18.5 ms of device time a step with 32 (one process)", "int")
CUDA_MOE_DECODE_PAIRS: EnvVar[int] = EnvVar(
    "GLM_RAY_CUDA_MOE_DECODE_PAIRS", _nonneg_int, 4, "cuda backend: MoE calls of at most this many (token, "
    "expert) pairs run the sort-free two-launch decode kernel (kernels/cuda/moe_decode.py); 0 = off (the "
    "grouped kernels). 4: one glm5-flash-31b token (H200, fp8: 30 vs 48 us; at 8-32 pairs the grouped "
    "kernels were as fast or faster)", "int")
CUDA_MOE_PREFILL_ROWS: EnvVar[int] = EnvVar(
    "GLM_RAY_CUDA_MOE_PREFILL_ROWS", _nonneg_int, 32, "cuda backend: block-FP8 MoE calls with at least this many "
    "(token, expert) pairs per expert on average (T*K/E) run the prefill kernels (kernels/cuda/moe_prefill.py: "
    "sorted pre-quantized activations, gate and up in one accumulator); 0 = off (the grouped kernels). 32: "
    "glm5-flash-31b from 512 tokens, GLM-5 from 1,024 (H200: 1.15-1.32x the grouped kernels at 2,048 and 8,192 "
    "tokens; below 2,048 not measured)", "int")
SIDE_STREAM_TOKENS: EnvVar[int] = EnvVar(
    "GLM_RAY_SIDE_STREAM_TOKENS", _nonneg_int, 64, "on a GPU, layers of at most this many tokens fork "
    "independent work onto a second stream (kernels/streams.py; a fork and a join inside the decode CUDA "
    "graph, as sglang's alt_stream): MoE shared experts beside the router and routed experts, MLA's cache "
    "writes (latent row, index keys) and, in decode steps that score, the indexer's queries + top-k beside the "
    "query path; the same results; 0 = off (H200, glm5-flash-31b served step B=1 1k: 5.82 -> 5.07 ms)", "int")
ABSORB_PREFILL_TOKENS: EnvVar[int] = EnvVar(
    "GLM_RAY_ABSORB_PREFILL_TOKENS", _nonneg_int, None, "a prefill chunk of at most this many tokens over a cached "
    "context at least as long (a prefix-cache hit's tail, a chunked prompt's later chunk) attends in the absorbed "
    "form as one-query rows of the step's decode group, instead of expanding its whole context with kv_b_proj in a "
    "prefill group of its own (forward_batch._attention_units); pure-attention models only; 0 = off; unset: the "
    "kernel backend's choice (cuda 256, torch and aiter 0)", "int")
CUDA_INDEXER_TOPK: EnvVar[str] = EnvVar(
    "GLM_RAY_CUDA_INDEXER_TOPK", _choice("triton", "torch"), "triton", "cuda backend: top-k of the DSA indexer's "
    "decode path: the multi-program Triton radix select (kernels/cuda/topk.py) or torch.topk")
CUDA_KDA_SCAN: EnvVar[str] = EnvVar(
    "GLM_RAY_CUDA_KDA_SCAN", _choice("triton", "torch"), "torch", "cuda backend: the sequential part of GLM-5.3-"
    "Flash's chunked KDA prefill (op kda_chunked): a Triton launch per batch of chunks that walks them with the "
    "state in registers (kernels/cuda/kda.py, interpreter-tested, not yet run on a GPU) or the torch reference's "
    "loop over 64-token chunks (~8 launches each)")
CUDA_MLA_PREFILL_TMA: EnvVar[bool] = EnvVar(
    "GLM_RAY_CUDA_MLA_PREFILL_TMA", _bool, True, "cuda backend, sm_90+: the MLA prefill kernel loads its key tiles "
    "(k_nope, v, k_pe) as TMA boxes through tensor descriptors instead of pointer tiles (kernels/cuda/mla_prefill.py; "
    "the pointer form holds 255 registers and spills ~1.1 KB a thread on sm_90a). H100, glm5-flash-31b shapes, h = 32: "
    "attention 564 -> 538 us a layer at 8 x 1k, 3,026 -> 2,632 us at 1 x 8k (DSA sparse); 0 = pointer tiles", "bool")
LOG_TRITON_COMPILES: EnvVar[bool] = EnvVar(
    "GLM_RAY_LOG_TRITON_COMPILES", _bool, False, "cuda backend: log every Triton JIT compile (kernel, "
    "seconds, specialization; kernels/cuda/compile_log.py): a compile inside a step stalls it for seconds", "bool")
KERNEL_WARMUP: EnvVar[str] = EnvVar(
    "GLM_RAY_KERNEL_WARMUP", _choice("auto", "on", "off"), "auto", "start-up: each rank runs up to five eager "
    "steps shaped like prefill / chunked prefill / a mixed step past index_topk / mid-size prompts so "
    "their kernels compile before the first request (worker/warmup.py); auto = on a GPU only", "auto|on|off")
def _late(raw: str) -> str:
    v = raw.lower()
    if v == "alternate":
        return v
    return "on" if _bool(v) else "off"


LATE_SCHEDULING: EnvVar[str] = EnvVar(
    "GLM_RAY_LATE_SCHEDULING", _late, "off", "serving on a GPU with async scheduling: schedule each step at the latest "
    "point that still queues it before the running step ends (that step's start + the least recent device time of "
    "its shape - the host's launch time - margins) or when a request arrives, instead of at the running step's start: "
    "a request arriving during step N joins N+1, not N+2 (engine/pacing.py). Off: vLLM's and sglang's schedule "
    "point. `alternate` (measurement): on and off in turns, one engine stats window each (GLM_RAY_LOG_STATS_INTERVAL_S), "
    "each line saying which: the A/B inside one server lifetime. Session 40 (H100s): no measured gain", "off|on|alternate")
STEP_TIMEOUT_S: EnvVar[float] = EnvVar(
    "GLM_RAY_STEP_TIMEOUT_S", _positive_float, 600.0, "serving: an engine step running longer than this "
    "fails the engine (its streams end with a 503, health fails, Serve replaces the replica): a rank "
    "stuck in a collective whose peer died would otherwise hang every stream", "float")
FAULT_INJECTION: EnvVar[str] = EnvVar(
    "GLM_RAY_FAULT_INJECTION", str, "", "reliability tests only: `KIND@TOKEN_ID,...` (KIND: exception, "
    "oom or sample) makes steps holding TOKEN_ID fail (worker/faults.py)", "spec")
TEST_FORCED_OUTPUT: EnvVar[bool] = EnvVar(
    "GLM_RAY_TEST_FORCED_OUTPUT", _bool, False, "tests only: the OpenAI endpoints honor a request's "
    "`forced_token_ids` (the sampler emits those tokens first; how served tests get a known output from a "
    "random model). Set where the server runs; ignored in requests otherwise", "bool")
GRAMMAR_THREADS: EnvVar[int | None] = EnvVar(
    "GLM_RAY_GRAMMAR_THREADS", _positive_int, None, "structured outputs: threads that fill a step's token "
    "bitmasks and compile grammars on the sampling rank (default: half the cores, at most 8)", "int")
GRAMMAR_CACHE_MB: EnvVar[int] = EnvVar(
    "GLM_RAY_GRAMMAR_CACHE_MB", _positive_int, 256, "structured outputs: memory for compiled grammars kept "
    "for reuse (least recently used evicted)", "int")
LOG_STATS_INTERVAL_S: EnvVar[float] = EnvVar(
    "GLM_RAY_LOG_STATS_INTERVAL_S", _nonneg_float, 10.0, "serving: seconds between the engine's stats lines "
    "in the log (throughput, gauges, decode and prefill/mixed step medians, the TTFT and ITL inside the engine; "
    "engine/stats_log.py; vLLM: VLLM_LOG_STATS_INTERVAL) and the ingress's TTFT split lines (where the time to "
    "first token goes: ingress, Router, engine; serve/ttft_split.py); 0 = off", "float")
LOG_LEVEL: EnvVar[str] = EnvVar(
    "GLM_RAY_LOG_LEVEL", _choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "log level of the `glm-ray` "
    "command")

ALL: tuple[EnvVar, ...] = (API_KEY, FP8_PROJ_GEMM, FP8_PROJ_FORCE, CACHE, CPU_THREADS, ORCHESTRATION,
                           TIME_COLLECTIVES, STEP_TIMELINE, TORCH_OPS, CUDA_FP8_GEMM, CUDA_FP8_SMALL_M,
                           CUDA_MOE_DECODE_PAIRS, CUDA_MOE_PREFILL_ROWS, SIDE_STREAM_TOKENS, ABSORB_PREFILL_TOKENS,
                           CUDA_INDEXER_TOPK, CUDA_KDA_SCAN, CUDA_MLA_PREFILL_TMA,
                           LOG_TRITON_COMPILES, KERNEL_WARMUP, LATE_SCHEDULING, STEP_TIMEOUT_S, FAULT_INJECTION,
                           TEST_FORCED_OUTPUT, GRAMMAR_THREADS, GRAMMAR_CACHE_MB, LOG_STATS_INTERVAL_S, LOG_LEVEL)


# Not forwarded to the rank actors: they do not use it, and Ray records an actor's runtime_env in its logs.
_NOT_FORWARDED = frozenset({API_KEY.name})


def forwarded() -> dict[str, str]:
    """The GLM_RAY_* variables set in this process that the worker group forwards to its ranks (all but
    the API key)."""
    return {k: v for k, v in os.environ.items() if k.startswith("GLM_RAY_") and k not in _NOT_FORWARDED}


def table() -> str:
    """The README's table of variables (markdown)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in ALL:
        default = "(none)" if v.default in (None, "", frozenset()) else f"`{v.default}`"
        if v is CACHE:
            default = "`~/.cache/glm-ray`"
        rows.append(f"| `{v.name}` | {v.type_name} | {default} | {v.help} |")
    return "\n".join(rows)
