"""`ServeArgs`: the typed application arguments of `build_app` (serve config `args:`) and the one list
of settings that `glm-ray serve` / `glm-ray generate` turn into command-line flags.

Each field carries a `Setting` (its `dataclasses.field` metadata): the help line, the flag name (vLLM's
`vllm serve` name where the concept is the same: `--tensor-parallel-size`/`-tp`, `--max-model-len`,
`--kv-cache-memory-bytes`, ...), older spellings kept as aliases (`--tp`), the allowed values, and
whether the setting is the engine's (`serve` and `generate`) or the app's (`serve` only). `add_flags`
builds the argparse arguments from that list and `values_from_flags` reads them back, so a new field
is a new flag with nothing else to edit. Booleans are `--flag` / `--no-flag` pairs
(argparse.BooleanOptionalAction, as vLLM's).

Strict: unknown keys are an error (a typo in a serve config must not be silently ignored), and every
value is checked against its field's type. `serve run glm_ray.serve.app:build_app tp=2` passes every
`key=value` as a string, so strings are parsed by the field's type (ints, floats, booleans as
true/false/1/0/yes/no/on/off, "none"/"null" for the optional ones); errors name the argument. The
command line parses with the same code. Sizes in tokens or bytes (`max_model_len`,
`max_num_batched_tokens`, `kv_cache_memory_bytes`) also take vLLM's human-readable forms: `32k` =
32000 and `32K` = 32768 (lower case decimal, upper case binary, decimals only with decimal suffixes),
plus the unambiguous IEC `Ki`/`Mi`/`Gi`/`Ti`.

`api_key` falls back to the environment variable `GLM_RAY_API_KEY` (vLLM: `VLLM_API_KEY`). It is
carried by `to_dict()` (the Router and the ingress receive their args that way) but never shown by
`repr()` / `to_log_dict()`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import asdict, dataclass, fields

import torch

from glm_ray import envs
from glm_ray.model.tiny import resolve_model
from glm_ray.serve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

API_KEY_ENV = envs.API_KEY.name

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")
_INT = re.compile(r"[+-]?\d+")
# vLLM's human-readable integers: lower case = powers of 1000 (decimals allowed), upper case = powers
# of 1024 (integers only); IEC Ki/Mi/Gi/Ti = powers of 1024, unambiguous
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|[kmgtKMGT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

#: `request_router` values: ours (serve/affinity_router.py) and Serve's default
REQUEST_ROUTERS = ("prefix_affinity", "power_of_two")

ENGINE = "engine"       # a setting of the engine: `glm-ray serve` and `glm-ray generate`
APP = "app"             # a setting of the served app only: `glm-ray serve`


@dataclass(frozen=True)
class Setting:
    """What the command line needs of one `ServeArgs` field (its `dataclasses.field` metadata)."""

    help: str
    scope: str = ENGINE
    flag: str | None = None                  # the flag; default: --<field name with dashes>
    aliases: tuple[str, ...] = ()            # other spellings of the same flag (vLLM's short ones, ours)
    false_aliases: tuple[str, ...] = ()      # booleans: old spellings that set the field to False
    choices: tuple[str, ...] | None = None
    value_aliases: tuple[tuple[str, str], ...] = ()   # vLLM's other names of a choice ("half" = float16)
    default_help: str | None = None          # the default as words (the optional fields' None)
    human_int: bool = False                  # also accepts 32k / 32K / 8Gi
    positional: bool = False                 # the model: `glm-ray serve MODEL`
    metavar: str | None = None


def setting(default, help: str, **kw) -> typing.Any:
    """A `ServeArgs` field with its `Setting`."""
    return dataclasses.field(default=default, metadata={"setting": Setting(help, **kw)})


@dataclass(frozen=True, repr=False)
class ServeArgs:
    model: str = setting(
        "tiny", "HF model directory, a bundled config name (with --load-format dummy), or tiny",
        positional=True, default_help="tiny: the cached tiny random GLM-5, written on first use")
    served_model_name: str | None = setting(
        None, "the model id clients send", scope=APP,
        default_help="the model directory's name; glm5-tiny for the tiny model")
    tp: int = setting(1, "tensor-parallel size: GPUs (ranks) per model instance",
                      flag="--tensor-parallel-size", aliases=("-tp", "--tp"), metavar="N")
    device: str = setting("auto", "auto = cuda when a GPU is visible (ROCm too), else cpu",
                          choices=("auto", "cpu", "cuda"))
    dtype: str = setting("auto", "weights and activations; auto = the checkpoint's dtype on GPU, float32 on CPU "
                                 "(vLLM's half and float mean float16 and float32)",
                         choices=("auto", "bfloat16", "float16", "float32"),
                         value_aliases=(("half", "float16"), ("float", "float32")))
    load_format: str = setting("auto", "auto = the checkpoint's safetensors (vLLM's safetensors means the same); "
                                       "dummy = random weights of the config's shapes (benchmarks without a "
                                       "checkpoint)",
                               choices=("auto", "dummy"), value_aliases=(("safetensors", "auto"),))
    kernel_backend: str = setting("auto", "auto = cuda on NVIDIA, aiter on ROCm (when installed), torch on CPU",
                                  choices=("auto", "torch", "cuda", "aiter"))
    fp8_proj_gemm: bool = setting(
        False, "prefill-only FP8 GEMM for MLA q_b_proj/o_proj (GLM_RAY_FP8_PROJ_GEMM=1 turns it on when the "
               "flag is not given)")
    fp8_proj_min_tokens: int = setting(
        512, "with --fp8-proj-gemm: forward batches of more than this many tokens take the FP8 GEMM (H200 "
             "step A/B, 2026-12-06: at GLM-5 shapes FP8 pays from 1,024 tokens (-2.2%) to 8,192 (-6.4%); at "
             "glm5-flash-31b's it costs +18-19% at 1-2k tokens and pays from 4,096, so use 4096 there)")
    enforce_eager: bool = setting(
        False, "run every step eagerly (no CUDA graphs; decode and piecewise prefill graphs are on by default "
               "on NVIDIA GPUs)")
    piecewise_cuda_graph_max_tokens: int | None = setting(
        None, "prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs (everything "
              "between attentions captured per token bucket; sglang's flag); 0 = off", human_int=True,
        default_help="max_num_batched_tokens")
    async_scheduling: bool | None = setting(
        None, "schedule and launch step N+1 before step N's tokens are read back (TP=1): the host's "
              "per-step work overlaps the GPU, outputs unchanged; --no-async-scheduling turns it off",
        default_help="on for TP=1 on a GPU, off on the CPU and at TP>1")
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt prefixes computed before (vLLM's automatic prefix caching; "
              "off for hybrid KDA models); --no-enable-prefix-caching turns it off")
    engine_in_worker: bool = setting(
        True, "run the engine's step loop inside rank 0's worker, beside its GPU (no Ray call per step); "
              "--no-engine-in-worker (or the older --engine-in-router) runs it in the Router, with a Ray "
              "call per step to the ranks", scope=APP, false_aliases=("--engine-in-router",))
    max_num_seqs: int = setting(64, "most requests running (batched) at once; more wait in the queue")
    schedule_policy: str = setting(
        "fcfs", "order of the waiting queue: fcfs = arrival order; lpm = the longest cached prefix first "
                "(sglang's; with prefix caching on: cache hits need only their tails computed and go before "
                "uncached prompts, which still take what is left of each step's budget)",
        choices=("fcfs", "lpm"))
    max_num_batched_tokens: int = setting(2048, "token budget of one engine step (prefill chunks + decodes)",
                                          human_int=True)
    max_model_len: int | None = setting(None, "context length (prompt + output) limit", human_int=True,
                                        default_help="the model's, capped by the KV-cache capacity")
    block_size: int = setting(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = setting(
        0.9, "share of GPU memory for weights + activations + KV cache (KV gets what is left)")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV-cache size per rank in bytes, e.g. 8Gi (vLLM's; overrides --gpu-memory-utilization)",
        human_int=True, default_help="what --gpu-memory-utilization leaves; on CPU 512 MiB")
    gpus_per_rank: float = setting(
        1.0, "GPU share each TP rank reserves (Ray's fractional num_gpus): 0.5 runs two TP1 replicas on one GPU; "
             "below 1 needs --kv-cache-memory-bytes (the memory-utilization sizing would count the other "
             "replica's memory) and tensor parallel size 1")
    kv_cache_memory_gb: float | None = setting(
        None, "the same in GiB, e.g. 0.25 (our older spelling; give one of the two)",
        default_help="see --kv-cache-memory-bytes")
    max_queued_requests: int = setting(
        1024, "waiting-queue bound of the engine; beyond it requests get 503 + Retry-After", scope=APP)
    ingress_replicas: int = setting(1, "replicas of the HTTP ingress deployment", scope=APP)
    stream_batching_interval_ms: float = setting(
        0.0, "after a stream's first token, send its tokens at most once per this many ms, merged (Ray Serve "
             "LLM's experimental stream_batching_interval_ms, default 50 there): fewer, larger chunks through "
             "the Router -> ingress -> proxy hops at high concurrency, for up to this much added latency per "
             "chunk; 0 = every step (a lagging stream still gets its backlog merged)", scope=APP)
    router_cpus: float = setting(0.5, "CPUs reserved for each Router replica", scope=APP)
    router_replicas: int = setting(
        1, "Router replicas: model instances, each with its own GPUs and KV cache (a serve config's Router "
           "deployment num_replicas / autoscaling_config overrides it)", scope=APP)
    request_router: str = setting(
        "prefix_affinity", "how the ingress picks a Router replica: prefix_affinity = the one holding the longest "
                           "prefix of the prompt that the ingress sent before (its KV blocks are likely cached "
                           "there), else the less loaded of two; power_of_two = Serve's default (the less loaded "
                           "of two random replicas)", scope=APP, choices=REQUEST_ROUTERS)
    prefix_affinity_min_match: float = setting(
        0.1, "prefix_affinity: route by load when the longest remembered prefix (whole KV blocks) covers less "
             "than this share of the prompt", scope=APP)
    prefix_affinity_max_imbalance: int = setting(
        32, "prefix_affinity: route by load when the prefix's replica has more than this many requests in "
            "flight beyond the least loaded one", scope=APP)
    prefix_affinity_max_tokens: int = setting(
        1 << 20, "prefix_affinity: prompt tokens remembered per Router replica, least recently used forgotten "
                 "first (about 340 bytes of the ingress's memory per block of --block-size tokens)", scope=APP,
        human_int=True)
    accelerator_type: str | None = setting(
        None, "Ray accelerator type the GPU bundles are pinned to, e.g. H200 or AMD-Instinct-MI355X-OAM",
        scope=APP, default_help="any")
    api_key: str | None = setting(
        None, "require `Authorization: Bearer <key>` on /v1/*", scope=APP,
        default_help=f"env {API_KEY_ENV}, else no key")
    trust_request_chat_template: bool = setting(
        False, "accept a `chat_template` in chat requests (refused when off)", scope=APP)
    tool_call_parser: str = setting(
        "auto", "parser of the model's tool-call markup into `tool_calls` (vLLM's flag and names): auto = from "
                "the model type (glm47 for GLM-5 / GLM-4.7, glm45 for GLM-4.5/4.6), none = the markup stays text",
        scope=APP, choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = setting(
        "auto", "parser of the thinking block into `reasoning_content` (vLLM's flag and names): auto = glm45 for "
                "GLM models, none = the thinking stays in `content`", scope=APP, choices=REASONING_PARSERS)

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
        need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
             "> 0 (or none)")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0 (or none)")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_bytes is None, "kv_cache_memory_gb",
             "none when kv_cache_memory_bytes is given (the same size in two units: give one)")
        need(0.0 < self.gpus_per_rank <= 1.0, "gpus_per_rank", "in (0, 1]")
        need(self.gpus_per_rank == 1.0 or self.tp == 1, "gpus_per_rank", "1 unless tp is 1 (two ranks of one TP "
             "group must not share a GPU)")
        need(self.gpus_per_rank == 1.0 or not self.uses_gpu() or self.kv_cache_bytes() is not None, "gpus_per_rank",
             "1 unless kv_cache_memory_bytes is given (on a shared GPU the memory-utilization sizing would count the "
             "other replica's memory)")
        need(self.max_queued_requests >= 0, "max_queued_requests", ">= 0")
        need(self.ingress_replicas >= 1, "ingress_replicas", ">= 1")
        need(0 <= self.stream_batching_interval_ms <= 10_000, "stream_batching_interval_ms", "in [0, 10000]")
        need(self.router_cpus >= 0, "router_cpus", ">= 0")
        need(self.router_replicas >= 1, "router_replicas", ">= 1")
        need(0.0 <= self.prefix_affinity_min_match <= 1.0, "prefix_affinity_min_match", "in [0, 1]")
        need(self.prefix_affinity_max_imbalance >= 0, "prefix_affinity_max_imbalance", ">= 0")
        need(self.prefix_affinity_max_tokens >= self.block_size, "prefix_affinity_max_tokens",
             ">= block_size (one KV block)")

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

    def kv_cache_bytes(self) -> int | None:
        """The explicit KV-cache budget per rank, from either spelling; None = derived by the engine."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return int(self.kv_cache_memory_gb * 2**30) if self.kv_cache_memory_gb else None

    def engine_kwargs(self) -> dict:
        """`make_engine_config` / `LLM` keyword arguments of the engine settings (the model aside). The
        serving queue bound (`max_waiting`) is the Router's to add."""
        return dict(tensor_parallel_size=self.tp, dtype=self.dtype, device=self.device,
                    load_format=self.load_format, kernel_backend=self.kernel_backend,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    max_model_len=self.max_model_len, block_size=self.block_size,
                    kv_cache_memory_bytes=self.kv_cache_bytes(), gpu_memory_utilization=self.gpu_memory_utilization,
                    fp8_proj_gemm=self.fp8_proj_gemm, fp8_proj_min_tokens=self.fp8_proj_min_tokens,
                    enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling,
                    enable_prefix_caching=self.enable_prefix_caching, gpus_per_rank=self.gpus_per_rank,
                    piecewise_graph_max_tokens=self.piecewise_cuda_graph_max_tokens,
                    schedule_policy=self.schedule_policy)

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


def settings(scopes: tuple[str, ...] = (ENGINE, APP)) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of `ServeArgs` with their `Setting`, in declaration order, of the given scopes."""
    return [(f, f.metadata["setting"]) for f in fields(ServeArgs) if f.metadata["setting"].scope in scopes]


#: allowed values of the string-valued choices (the engine resolves "auto")
CHOICES: dict[str, tuple[str, ...]] = {f.name: s.choices for f, s in settings() if s.choices}


def flag_name(f: dataclasses.Field, s: Setting) -> str:
    return s.flag or "--" + f.name.replace("_", "-")


def shown_default(f: dataclasses.Field, s: Setting) -> str:
    """The default as `--help` shows it."""
    return s.default_help if f.default is None or s.default_help else str(f.default)


class _Switch(argparse.BooleanOptionalAction):
    """--flag / --no-flag (argparse's pair), plus older spellings that mean --no-flag."""

    def __init__(self, option_strings, dest, false_aliases=(), **kw):
        super().__init__(option_strings, dest, **kw)
        self.false_aliases = tuple(false_aliases)
        self.option_strings = self.option_strings + list(self.false_aliases)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.false_aliases:
            setattr(namespace, self.dest, False)
        else:
            super().__call__(parser, namespace, values, option_string)


def _flag_type(name: str, tp):
    def parse(text: str):
        try:
            return _coerce(name, tp, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(_optional_inner(tp)[1], "__name__", "value")   # argparse's "invalid int value"
    return parse


_GROUP_TITLES = {
    ENGINE: "model and engine settings (ServeArgs: a serve config's `args:` spells them with _, e.g. tp: 8)",
    APP: "app settings (ServeArgs; `glm-ray serve` only)",
}


def add_flags(parser: argparse.ArgumentParser, scopes: tuple[str, ...]) -> list[argparse.Action]:
    """One argparse argument per `ServeArgs` field of `scopes` (an argument group per scope); returns
    them in field order.

    Every default is None ("not given": `ServeArgs` decides, environment fallbacks included); the help
    line shows the `ServeArgs` default."""
    hints = _field_types(ServeArgs)
    groups = {scope: parser.add_argument_group(_GROUP_TITLES[scope]) for scope in scopes}
    out = []
    for f, s in settings(scopes):
        group, parse = groups[s.scope], _flag_type(f.name, hints[f.name])
        help_text = f"{s.help} (default: {shown_default(f, s)})".replace("%", "%%")
        if s.positional:
            out.append(group.add_argument(f.name, nargs="?", default=None, type=parse, help=help_text))
            continue
        names = (flag_name(f, s), *s.aliases)
        if _optional_inner(hints[f.name])[1] is bool:
            out.append(group.add_argument(*names, dest=f.name, action=_Switch, false_aliases=s.false_aliases,
                                          default=None, help=help_text))
            continue
        metavar = s.metavar or names[0].lstrip("-").upper().replace("-", "_")
        if s.choices:
            metavar = "{" + ",".join(s.choices) + "}"
        out.append(group.add_argument(*names, dest=f.name, type=parse, default=None, choices=s.choices,
                                      metavar=metavar, help=help_text))
    return out


def values_from_flags(ns: argparse.Namespace, scopes: tuple[str, ...]) -> dict:
    """The settings given on the command line (what `add_flags` parsed), for `ServeArgs.from_dict`."""
    return {f.name: getattr(ns, f.name) for f, _ in settings(scopes) if getattr(ns, f.name, None) is not None}


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _optional_inner(tp) -> tuple[bool, typing.Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _human_int(text: str) -> int | None:
    """`32k` -> 32000, `32K` / `32Ki` -> 32768, `1.5g` -> 1500000000; None when `text` is not that form."""
    m = _HUMAN_INT.fullmatch(text)
    if m is None:
        return None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        return None                         # 1.5G: binary suffixes take integers (as vLLM's)
    return int(number) * _BINARY[suffix]


def _coerce(name: str, tp, value):
    """`value` as the field's type; strings (what `serve run key=value` and the command line pass) are
    parsed."""
    optional, base = _optional_inner(tp)
    s = ServeArgs.__dataclass_fields__[name].metadata.get("setting")

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
        if isinstance(value, str) and s is not None and s.human_int:
            out = _human_int(value.strip())
            if out is not None:
                return out
            raise bad("an integer (or 32k = 32000, 32K = 32Ki = 32768, 8Gi)")
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
            return dict(s.value_aliases).get(value, value) if s is not None else value
        raise bad("a string")
    raise TypeError(f"ServeArgs.{name}: unsupported field type {tp!r}")   # a new field of a new type
