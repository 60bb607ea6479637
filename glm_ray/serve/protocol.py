"""OpenAI-compatible wire types and the pure functions around them (no Ray, no FastAPI).

Request models accept what OpenAI's API and vLLM's extensions accept (sampling extras such as
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, ...) and
ignore unknown fields like OpenAI does. The numeric bounds are `engine.sampling_params.BOUNDS` (one
rule set for the HTTP API, its OpenAPI schema and the offline API); roles and content-part types are
closed sets. `parse_body` is the only way a body becomes a request: it rejects non-finite numbers
(`NaN`, `Infinity`), nesting deeper than `MAX_JSON_DEPTH`, and strings that are not valid Unicode
(lone surrogates) with a 400 before any model validation runs. `to_sampling_params` turns a request
into the engine's `SamplingParams`; every problem becomes an `APIError` that the ingress renders as
`{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Logprob rendering is serve/logprobs.py.
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from typing_extensions import Annotated

from glm_ray.engine.sampling_params import (
    BOUNDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
    is_valid_unicode,
)
from glm_ray.serve.parsers import ToolChoice

# Logprob values that JSON cannot carry (-inf, nan) are clamped to this, like vLLM.
MIN_LOGPROB = -9999.0
MAX_TOP_LOGPROBS = MAX_LOGPROBS
# Deepest JSON nesting a body may have (a chat request with tools needs ~10; JSON Schemas in tools a
# few more). Deeper bodies are rejected before they reach a recursive parser or validator.
MAX_JSON_DEPTH = 64
# Engine requests one HTTP request may fan out to (prompts x n).
MAX_CHOICES = 1024

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error shape."""

    def __init__(self, status_code: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _default_error_type(status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, param={self.param!r})"


def _default_error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status in (400, 413, 422):
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "internal_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_parameter") -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[str, int, None] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def format_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic/FastAPI error list -> (message, param). `param` is the top-level field."""
    parts = []
    param = None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc)
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    if len(errors) > 3:
        parts.append(f"(+{len(errors) - 3} more)")
    return "; ".join(parts) or "invalid request", param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def load_json(body: bytes | str) -> Any:
    """Raw body -> JSON value, or APIError(400): malformed JSON (incl. `NaN`/`Infinity` and invalid
    UTF-8), nesting deeper than MAX_JSON_DEPTH, or a string with a lone surrogate anywhere."""
    try:
        obj = json.loads(body, parse_constant=_reject_constant) if body else None
    except RecursionError:
        raise bad_request(f"The request body is nested deeper than {MAX_JSON_DEPTH} levels.",
                          code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise bad_request(f"Malformed JSON body: {msg}", code="invalid_json") from None
    check_json_tree(obj)
    return obj


def check_json_tree(obj: Any) -> None:
    """Walk a parsed body without recursion: depth bound and valid Unicode in every key and string."""
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not is_valid_unicode(v):
                raise bad_request("The request contains a string that is not valid Unicode (a lone UTF-16 "
                                  "surrogate such as \\ud800).", code="invalid_unicode")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"The request body is nested deeper than {MAX_JSON_DEPTH} levels.",
                              code="invalid_json")
        if isinstance(v, dict):
            stack.extend((k, depth) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        else:
            stack.extend((x, depth + 1) for x in v)


def parse_body(body: bytes | str, model: type[BaseModel]) -> Any:
    """Raw request body -> `model`, raising APIError(400) on malformed JSON or bad fields."""
    obj = load_json(body)
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return validate_model(obj, model)


def validate_model(obj: dict, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        msg, param = format_validation_errors(e.errors(include_url=False, include_input=False))
        if param == "prompt" and "constrained" in msg:      # one message for the union, not one per member
            msg = ("prompt must be a non-empty string, a non-empty list of strings, a non-empty list of token "
                   "ids, or a non-empty list of such lists")
        raise bad_request(msg, param=param) from None
    except RecursionError:     # pragma: no cover - depth is bounded by load_json
        raise bad_request("The request body is nested too deeply.", code="invalid_json") from None


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    # OpenAI ignores unknown fields; keep them (visible via `model_extra`) but never act on them.
    # Floats must be finite (1e999 parses as inf).
    # Strict types, as the schema says: `true` is not an integer, "yes" is not a boolean, 1.0 is not an int.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


def _integral(v: Any) -> Any:
    """JSON Schema's `integer` is a mathematical one: 817.0 is an integer (true and "817" are not: strict
    mode rejects those)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


JsonInt = Annotated[int, BeforeValidator(_integral)]


def Bounded(name: str) -> Any:  # noqa: N802 - a type factory, used in annotations
    """The type of a request field with the engine's bound for `name` (BOUNDS): the OpenAPI schema shows
    it as minimum/maximum."""
    bound = BOUNDS[name]
    if bound.integer:       # NOTE: the constraint before the validator, so the schema shows minimum/maximum
        return Annotated[int, Field(**bound.pydantic_kwargs()), BeforeValidator(_integral)]
    return Annotated[float, Field(**bound.pydantic_kwargs())]


TokenId = Bounded("stop_token_id")
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# Longest token list /detokenize takes (its output grows with it).
MAX_DETOKENIZE_TOKENS = 2**20
StopString = Annotated[str, Field(min_length=1)]


def _unsupported(value, info):
    """A field we accept only empty (its schema says so too): anything else is a 400 naming it."""
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


class ResponseFormatText(OpenAIBaseModel):
    type: Literal["text"]


class ResponseFormatJsonObject(OpenAIBaseModel):
    """Any JSON object (enforced while decoding: engine/structured.py)."""
    type: Literal["json_object"]


class JsonSchemaSpec(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")         # the JSON Schema the output must validate against
    strict: Optional[bool] = None                           # always enforced (the grammar is strict)


class ResponseFormatJsonSchema(OpenAIBaseModel):
    """A JSON value valid under `json_schema.schema` (enforced while decoding: engine/structured.py)."""
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema],
                           Field(discriminator="type")]


def structured_outputs(rf: Optional[ResponseFormat]) -> Optional[StructuredOutputsParams]:
    """`response_format` as the engine's StructuredOutputsParams (None for text). Whether the schema
    compiles is checked where the grammar library is loaded (the Router's validation: a 400 naming
    `response_format`)."""
    if isinstance(rf, ResponseFormatJsonObject):
        return StructuredOutputsParams(json_object=True)
    if isinstance(rf, ResponseFormatJsonSchema):
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    return None


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. `None` = "use the default"."""
    model: Optional[str] = None
    n: Optional[Bounded("n")] = 1
    temperature: Optional[Bounded("temperature")] = None
    top_p: Optional[Bounded("top_p")] = None
    top_k: Optional[Bounded("top_k")] = None
    min_p: Optional[Bounded("min_p")] = None
    seed: Optional[Bounded("seed")] = None
    max_tokens: Optional[Bounded("max_tokens")] = None
    min_tokens: Optional[Bounded("min_tokens")] = 0
    stop: Union[StopString, list[StopString], None] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Optional[bool] = False
    presence_penalty: Optional[Bounded("presence_penalty")] = None
    frequency_penalty: Optional[Bounded("frequency_penalty")] = None
    repetition_penalty: Optional[Bounded("repetition_penalty")] = None
    prompt_logprobs: Optional[Bounded("prompt_logprobs")] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Not supported (yet): the schema says so (no entries), and so do the 400s.
    logit_bias: Optional[dict[str, float]] = Field(None, json_schema_extra={"maxProperties": 0})
    response_format: Optional[ResponseFormat] = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v, info):
        return _unsupported(v, info)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[Bounded("max_tokens")] = 16   # OpenAI's and vLLM's default for completions
    echo: Optional[bool] = False
    logprobs: Optional[Bounded("logprobs")] = None
    suffix: Optional[str] = Field(None, json_schema_extra={"maxLength": 0})

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v, info):
        return _unsupported(v, info)

    best_of: Optional[JsonInt] = None
    add_special_tokens: Optional[bool] = True

    def prompt_list(self) -> list[Union[str, list[int]]]:
        """The prompt as a non-empty list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif len(p) == 0:
            items = []
        elif isinstance(p[0], int):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        for item in items:
            if len(item) == 0:
                raise bad_request("prompt must not be empty", param="prompt")
        return items


class ContentPart(OpenAIBaseModel):
    """A part of a message's content. The models served are text-only: text parts only (an image or
    audio part is a 400 naming the type, not a silently dropped input)."""
    type: Literal["text", "input_text"]
    text: str


Content = Union[str, Annotated[list[ContentPart], Field(min_length=1)]]


class _Message(OpenAIBaseModel):
    """Fields every chat message may carry; the role classes below say which content they need."""
    name: Optional[str] = None

    def text_content(self) -> str:
        c = getattr(self, "content", None)
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "\n".join(part.text for part in c)

    def to_template_dict(self) -> dict[str, Any]:
        """What the chat template sees: role + flattened text content + any other fields."""
        d = {k: v for k, v in self.model_dump().items() if v is not None}
        d["role"] = self.role
        d["content"] = self.text_content()
        return d


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class CalledFunction(OpenAIBaseModel):
    """The function a previous assistant turn called: OpenAI sends `arguments` as a JSON string holding an
    object; an object is accepted as well."""
    name: str = Field(min_length=1)
    arguments: Optional[Union[str, dict[str, Any]]] = None


class AssistantToolCall(OpenAIBaseModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_Message):
    """A previous model turn: content may be null (a turn that only called tools)."""
    role: Literal["assistant"]
    content: Optional[Content] = None
    tool_calls: Optional[list[AssistantToolCall]] = None
    reasoning_content: Optional[str] = None

    def to_template_dict(self) -> dict[str, Any]:
        """Tool calls' `arguments` as the objects chat templates iterate over (GLM-5's template renders each
        key/value pair): a string must hold a JSON object, else 400."""
        d = super().to_template_dict()
        if self.tool_calls:
            d["tool_calls"] = [_template_tool_call(i, tc) for i, tc in enumerate(self.tool_calls)]
        return d


def _template_tool_call(i: int, tc: AssistantToolCall) -> dict[str, Any]:
    d = tc.model_dump(exclude_none=True)
    args = tc.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise bad_request(f"messages: tool_calls[{i}].function.arguments must be a JSON object (as a string "
                              f"or an object)", param="messages")
    d["function"]["arguments"] = args or {}
    return d


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: Optional[str] = None


# One message, by its role (the OpenAPI schema shows one object per role, as OpenAI's own spec does).
ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]

# A function name the tool-call markup can carry: no (ASCII) whitespace, no `<` `>` (OpenAI's own rule,
# [a-zA-Z0-9_-]{1,64}, is stricter; MCP-style names with `.` or `:` are accepted).
FunctionName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^ \t\n\r\f\v<>]+$")]


class FunctionDefinition(OpenAIBaseModel):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None      # a JSON Schema of the arguments object
    strict: Optional[bool] = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: FunctionName


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoiceParam = Union[Literal["none", "auto", "required"], NamedToolChoice, None]


def template_tools(tools: Optional[list[ChatTool]]) -> Optional[list[dict[str, Any]]]:
    """The tools as the chat template renders them: what the client sent, field for field."""
    return [t.model_dump(exclude_unset=True) for t in tools] if tools else None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Bounded("max_tokens")] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Bounded("logprobs")] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: ToolChoiceParam = None           # default: "auto" with tools, else "none"
    parallel_tool_calls: Optional[bool] = None    # false: at most one tool call
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template: Optional[str] = None           # refused unless the server trusts request templates
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = False

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def tool_choice_spec(self) -> ToolChoice:
        """`tools` + `tool_choice` + `parallel_tool_calls`, checked (400s name the field)."""
        tools = self.tools or []
        names = [t.function.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise bad_request(f"tools: function names must be unique; {dup} appear more than once", param="tools")
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice):
            if tc.function.name not in names:
                raise bad_request(f"tool_choice names the function {tc.function.name!r}, which is not in tools",
                                  param="tool_choice")
            mode, allowed = "named", (tc.function.name,)
        else:
            mode, allowed = tc or ("auto" if tools else "none"), tuple(names)
            if mode == "required" and not tools:
                raise bad_request('tool_choice "required" needs tools', param="tool_choice")
        return ToolChoice(mode, {t.function.name: t.function.parameters for t in tools}, allowed,
                          parallel=self.parallel_tool_calls is not False)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    add_special_tokens: Optional[bool] = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatTool]] = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]


def parse_tokenize_body(body: bytes | str) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    obj = load_json(body)
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest
    return validate_model(obj, model)


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


# --------------------------------------------------------------------------------------------
# Request -> SamplingParams
# --------------------------------------------------------------------------------------------

# Request fields that may be defaulted from the model's generation_config.json (as vLLM does).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _pick(value, name: str, defaults: dict[str, Any] | None, fallback):
    if value is not None:
        return value
    if defaults and defaults.get(name) is not None:
        return defaults[name]
    return fallback


def requested_max_tokens(req: _SamplingRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def to_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest],
                       default_max_tokens: int | None,
                       defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Request -> SamplingParams (with `n` as requested; the ingress fans out to n=1 each).

    `default_max_tokens` is used when the request gives none (the ingress passes
    `max_model_len - prompt_len`, i.e. "until the context is full").
    `defaults` are the model's generation-config defaults for fields the request left unset.
    Raises APIError(400) naming the offending `param`.
    """
    is_chat = isinstance(req, ChatCompletionRequest)

    # Things SamplingParams does not model: reject clearly rather than silently ignore.
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}", param="n")
    if not is_chat:
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of is not supported (it must be unset or equal to n)", param="best_of")

    # Logprobs.
    if is_chat:
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                                  param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if not is_chat and req.echo and logprobs is not None:
        # Echoed prompt tokens carry logprobs too: ask the engine for them.
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)

    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        max_tokens = default_max_tokens

    top_k = _pick(req.top_k, "top_k", defaults, -1)
    if top_k == 0:
        top_k = -1
    stop = req.stop
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]

    kwargs = dict(
        n=n,
        temperature=float(_pick(req.temperature, "temperature", defaults, 1.0)),
        top_p=float(_pick(req.top_p, "top_p", defaults, 1.0)),
        top_k=int(top_k),
        min_p=float(_pick(req.min_p, "min_p", defaults, 0.0)),
        seed=req.seed,
        repetition_penalty=float(_pick(req.repetition_penalty, "repetition_penalty", defaults, 1.0)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        max_tokens=max_tokens,
        min_tokens=int(req.min_tokens or 0),
        stop=list(stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else bool(req.skip_special_tokens),
        structured_outputs=structured_outputs(req.response_format),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        param = getattr(e, "param", None)
        if param == "structured_outputs":
            param = "response_format"
        if is_chat and param == "max_tokens" and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        if is_chat and param == "logprobs":
            param = "top_logprobs"
        raise bad_request(str(e), param=param) from None
    except TypeError as e:
        raise bad_request(str(e)) from None


def check_prompt_fits(prompt_len: int, max_tokens: int | None, max_model_len: int,
                      param: str = "prompt") -> None:
    """400 when prompt + requested completion cannot fit in the context (vLLM's rule)."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the {'messages' if param == 'messages' else 'prompt'}.",
            param=param, code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"{'messages' if param == 'messages' else 'prompt'}, {max_tokens} for the "
            "completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens", code="context_length_exceeded")


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is out of range [0, {vocab_size})", param=param)


def load_generation_defaults(model_path: str) -> dict[str, Any]:
    """The sampling defaults from `generation_config.json` (what vLLM applies by default)."""
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: cfg[k] for k in GENERATION_DEFAULT_FIELDS if cfg.get(k) is not None}
