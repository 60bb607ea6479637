"""Per-request sampling parameters: the one typed object every layer above the model agrees on.

Owned here: field names and defaults (vLLM's, so users can carry their habits over) and the bounds of
every field (`BOUNDS`). The bounds are the single rule set: `SamplingParams.validate` enforces them
(so the offline API fails fast), and the OpenAI request models in serve/protocol.py derive their
pydantic constraints — and so the published OpenAPI schema — from the same table. What needs the
model (token ids within the vocabulary, the context length) is checked by
`EngineCore.validate_request`.

Validation raises `ValueError` with a message fit for an HTTP 400 and `.param` naming the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

INT32_MAX = 2**31 - 1
# Seeds: vLLM's range, a signed 64-bit integer. `torch.Generator.manual_seed` accepts it, and the
# per-choice seeds of a request with n > 1 wrap around inside it (`choice_seed`).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 128                      # choices per prompt (each one is an engine request)
MAX_LOGPROBS = 20                # top-k logprobs per token (OpenAI's and vLLM's limit)
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class Bound:
    """Allowed range of one numeric field. Floats must also be finite."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False        # lo < x instead of lo <= x
    integer: bool = False

    def check(self, x) -> str | None:
        """None if `x` is allowed, else what is wrong (a message fragment)."""
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return f"must be {'an integer' if self.integer else 'a number'}, got {type(x).__name__}"
        if self.integer and not isinstance(x, int):
            return f"must be an integer, got {x!r}"
        if isinstance(x, float) and not math.isfinite(x):
            return f"must be a finite number, got {x}"
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}, got {x}"
        if self.hi is not None and x > self.hi:
            return f"must be <= {_num(self.hi)}, got {x}"
        return None

    def pydantic_kwargs(self) -> dict:
        """The same rule as `pydantic.Field` keyword arguments (request models, OpenAPI schema)."""
        kw: dict = {}
        if self.lo is not None:
            kw["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            kw["le"] = self.hi
        return kw


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Field -> allowed range. Wire-level aliases (top_k 0 = disabled, max_completion_tokens, top_logprobs)
# are mapped by the protocol layer before they reach SamplingParams.
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N, integer=True),
    "temperature": Bound(0.0, None),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, INT32_MAX, integer=True),          # -1 (and 0 on the wire) = disabled
    "min_p": Bound(0.0, 1.0),
    "seed": Bound(SEED_MIN, SEED_MAX, integer=True),
    "repetition_penalty": Bound(0.0, None, lo_open=True),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "max_tokens": Bound(1, INT32_MAX, integer=True),
    "min_tokens": Bound(0, INT32_MAX, integer=True),
    "logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "stop_token_id": Bound(0, INT32_MAX, integer=True),   # each element of stop_token_ids
}


def invalid(param: str, msg: str) -> ValueError:
    err = ValueError(msg)
    err.param = param  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, enforced while sampling (engine/structured.py): exactly one
    of the fields. vLLM's names: `json` (a JSON Schema, as a dict or JSON text), `json_object` (any
    JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect of
    GBNF), `structural_tag` (an xgrammar structural tag as JSON text; the GLM tool-call grammar of
    `serve.tool_grammar`). `reasoning_end`: the output opens inside a reasoning block that this marker
    closes (GLM with thinking on: "</think>"); the format then applies after it, and before it any text
    without the marker. Only the shape is checked here; whether the value compiles is `structured.check`
    (the engine's request validation)."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):      # JSON text: hashable, and the cache key of its compiled grammar
            object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The field that is set (`validate` checks that exactly one is)."""
        return next((k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                     if getattr(self, k) is not None), "json_object")

    @property
    def key(self) -> tuple[str, str, str]:
        """(kind, its value as text, reasoning_end or ""): what a compiled grammar is cached under."""
        v = getattr(self, self.kind)
        return self.kind, (json.dumps(list(v), ensure_ascii=False) if self.kind == "choice"
                           else "" if self.kind == "json_object" else v), self.reasoning_end or ""

    def validate(self) -> None:
        p = "structured_outputs"
        set_ = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object is True else []
        if self.json_object not in (True, False):
            raise invalid(p, "structured_outputs.json_object must be a boolean")
        if len(set_) != 1:
            raise invalid(p, f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {set_ or 'none'}")
        kind = set_[0]
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise invalid(p, "structured_outputs.choice must be a non-empty list of non-empty strings")
        elif kind != "json_object" and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise invalid(p, f"structured_outputs.{kind} must be a non-empty string")
        if kind != "json_object" and not all(map(is_valid_unicode, self.choice or (getattr(self, kind),))):
            raise invalid(p, f"structured_outputs.{kind} must be valid Unicode (no lone surrogates)")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end
                                               or not is_valid_unicode(self.reasoning_end)):
            raise invalid(p, "structured_outputs.reasoning_end must be a non-empty string")


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice `i` of a request with `seed` (seed + i, wrapped into the int64 range)."""
    if seed is None:
        return None
    return (seed + i - SEED_MIN) % 2**64 + SEED_MIN


@dataclass
class SamplingParams:
    n: int = 1                                  # choices per prompt (fanned out into n requests)
    temperature: float = 1.0                    # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1                             # -1 -> disabled
    min_p: float = 0.0
    seed: int | None = None                     # per-request generator: same seed -> same tokens
    repetition_penalty: float = 1.0             # HF/vLLM style: divides positive logits, multiplies negative
    presence_penalty: float = 0.0               # OpenAI style, over generated tokens
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16                 # None -> until the context is full
    min_tokens: int = 0                         # EOS / stop ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None                 # top-k logprobs per generated token (0 = only the sampled)
    prompt_logprobs: int | None = None          # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # the output must match this grammar
    # Tests only: emit these token ids, in order, instead of sampling (then sample as usual). The OpenAI
    # layer sets it only when the server runs with GLM_RAY_TEST_FORCED_OUTPUT=1 (a client cannot).
    forced_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.forced_token_ids = list(self.forced_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        for name, bound in BOUNDS.items():
            if name == "stop_token_id":
                continue
            value = getattr(self, name)
            if value is None and name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
                continue
            problem = bound.check(value)
            if problem:
                raise invalid(name, f"{name} {problem}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise invalid("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid("stop_token_ids", f"stop_token_ids has {len(self.stop_token_ids)} entries; "
                          f"at most {MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            problem = BOUNDS["stop_token_id"].check(t)
            if problem:
                raise invalid("stop_token_ids", f"stop_token_ids entries {problem}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise invalid("stop", "stop strings must be non-empty strings")
            if not is_valid_unicode(s):
                raise invalid("stop", "stop strings must be valid Unicode (no lone surrogates)")
        for t in self.forced_token_ids:
            problem = BOUNDS["stop_token_id"].check(t)
            if problem:
                raise invalid("forced_token_ids", f"forced_token_ids entries {problem}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise invalid("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
            if self.min_tokens:
                # the grammar decides where the output may end: EOS is allowed exactly when it is complete
                raise invalid("min_tokens", "min_tokens cannot be combined with structured outputs (the grammar "
                                            "decides where the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def is_valid_unicode(s: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (JSON's "\\ud800" escapes), which no
    tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
