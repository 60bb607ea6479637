"""OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Per request: parse + validate (OpenAI error shape on every failure), apply the chat template,
tokenize, check the context length, fan out `n` (x prompts) sub-requests to the Router
deployment, merge their `TokenDelta` streams by choice index and render either one JSON response
or server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`). The engine already
detokenizes generated text and applies stop strings; the ingress only renders token strings for
logprobs. Whatever ends a request early (client disconnect, cancellation, an error in a sibling
sub-request) aborts every unfinished sub-request on the Router.

Chat output passes through serve/parsers, one parser per choice (--reasoning-parser / --tool-call-parser,
"auto" from the checkpoint's model type): the thinking block becomes `reasoning_content`, tool-call markup
`tool_calls` (finish_reason "tool_calls"); streamed, each engine delta becomes the deltas that became
certain (reasoning, content, a call's name, its argument fragments), in order.

Bounds and access (issue: no request can take the server down): bodies larger than
`MAX_BODY_BYTES` are a 413 before they are parsed; `protocol.parse_body` rejects what no model
validator should see (depth, non-finite numbers, invalid Unicode); with an API key configured the
/v1/* endpoints need `Authorization: Bearer <key>`; a request-level `chat_template` is refused unless
the server trusts request templates (`trust_request_chat_template`), and templates render in
jinja2's sandbox (transformers' ImmutableSandboxedEnvironment). The published OpenAPI schema
(`/openapi.json`) is built by serve/openapi.py from the same request models.

Router contract (glm_ray/serve/router.py):
  router.options(stream=True).generate.remote(request_id, prompt_token_ids, params) -> TokenDelta stream
  router.abort.remote(request_id); router.get_model_info.remote() -> dict; router.check_engine.remote()
"""
import asyncio
import contextvars
import dataclasses
import functools
import importlib.metadata
import json
import logging
import os
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from glm_ray import envs
from glm_ray.engine.sampling_params import SamplingParams, choice_seed
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.serve.detok import TokenStrings
from glm_ray.serve.errors import error_response, for_client, install_error_handlers, map_exception, openai_errors
from glm_ray.serve.fanout import EventStream, Fanout, SubRequest, pad_logprobs
from glm_ray.serve.logprobs import chat_logprobs, completion_logprobs, format_prompt_logprobs
from glm_ray.serve.openapi import build_openapi
from glm_ray.serve.parsers import Content, Event, OutputParser, Reasoning, ToolCallStart, resolve_parsers
from glm_ray.serve.parsers.reasoning import ANSWER, MAYBE, THINKING, initial_state
from glm_ray.serve.parsers.reasoning import END as THINK_END
from glm_ray.serve.protocol import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    bad_request,
    check_prompt_fits,
    check_token_ids,
    load_generation_defaults,
    parse_body,
    parse_tokenize_body,
    requested_max_tokens,
    template_tools,
    to_sampling_params,
)
from glm_ray.serve.request_context import bearer_ok
from glm_ray.serve.responses import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
    random_id,
    sse,
)
from glm_ray.serve.tool_grammar import glm_tool_call_structured_outputs
from glm_ray.serve.ttft_split import Arrival, LoopLag, TTFTSplit
from glm_ray.serve.ttft_split import split as split_ttft

logger = logging.getLogger("glm_ray.serve.ingress")

# Text longer than this is templated/tokenized off the event loop.
_OFFLOAD_CHARS = 4096
_ABORT_TIMEOUT_S = 30.0
_HEALTH_TIMEOUT_S = 10.0
# Largest request body read (413 above it). A GLM-5 context of 200k tokens is ~1.5 MB as token ids.
MAX_BODY_BYTES = 16 * 2**20
# Keys a client must not smuggle into apply_chat_template through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize", "chat_template",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "documents"}

# Serve deployment options that suit a streaming front end (Serve's default of 5 concurrent
# requests per replica would queue the 6th stream at the proxy).
DEFAULT_INGRESS_OPTIONS: dict[str, Any] = {"max_ongoing_requests": 2048}


# --------------------------------------------------------------------------------------------
# The FastAPI app and its exception handlers (every error leaves in OpenAI's shape)
# --------------------------------------------------------------------------------------------

# NOTE: /openapi.json and /docs are endpoints of the ingress below (the schema is per deployment).
app = FastAPI(title="glm-ray OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
install_error_handlers(app)


async def _await(resp):
    return await resp


def _version() -> str:
    try:
        return importlib.metadata.version("glm-ray")
    except Exception:  # noqa: BLE001 - not installed (a source checkout on PYTHONPATH)
        return "unknown"


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, or APIError(413) as soon as it exceeds `limit` (by header or by bytes read)."""
    too_large = APIError(413, f"The request body is larger than {limit} bytes.", type="invalid_request_error",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def model_type(model_path: str) -> Optional[str]:
    """config.json's `model_type` (what --tool-call-parser / --reasoning-parser auto resolve from)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def stream_deltas(events: list[Event]) -> list[DeltaMessage]:
    """A choice's parser events -> stream deltas in order: consecutive reasoning / content merged; a
    tool call's first delta (id, type, name, arguments "") on its own, then its argument fragments."""
    out: list[DeltaMessage] = []
    last = None
    for e in events:
        if isinstance(e, Reasoning):
            if last == "reasoning":
                out[-1].reasoning_content += e.text
            else:
                out.append(DeltaMessage(reasoning_content=e.text))
        elif isinstance(e, Content):
            if last == "content":
                out[-1].content += e.text
            else:
                out.append(DeltaMessage(content=e.text))
        elif isinstance(e, ToolCallStart):
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=e.index, id=e.id, type="function", function=DeltaFunctionCall(name=e.name, arguments=""))]))
        elif last == "args" and out[-1].tool_calls[0].index == e.index:
            out[-1].tool_calls[0].function.arguments += e.fragment
        else:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=e.index,
                                                              function=DeltaFunctionCall(arguments=e.fragment))]))
        last = {Reasoning: "reasoning", Content: "content", ToolCallStart: "start"}.get(type(e), "args")
    return out


def chat_finish_reason(engine_reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI's "tool_calls" when the model stopped after calling tools (a cut-off output keeps "length")."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


# --------------------------------------------------------------------------------------------
# The ingress deployment class
# --------------------------------------------------------------------------------------------
# NOTE: `@serve.ingress(app)` pickles the FastAPI app (and so these methods, by value) while this
# module is still being imported: every module-level name the methods use must be defined above.


@serve.ingress(app)
class OpenAIIngress:
    """FastAPI ingress. Wrap with `serve.deployment(OpenAIIngress, **DEFAULT_INGRESS_OPTIONS)`
    and bind it to the Router handle: `.bind(router, model_path, served_model_name)`."""

    def __init__(self, router, model_path: str, served_model_name: str, *,
                 tokenizer_path: Optional[str] = None, chat_template: Optional[str] = None,
                 generation_config: str = "auto", api_key: Optional[str] = None,
                 trust_request_chat_template: bool = False, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto"):
        self.router = router
        self.api_key = api_key or envs.API_KEY.get()
        self.trust_request_chat_template = bool(trust_request_chat_template)
        self.tool_call_parser, self.reasoning_parser = resolve_parsers(tool_call_parser, reasoning_parser,
                                                                       model_type(model_path))
        logger.info("output parsers: tool calls %s, reasoning %s", self.tool_call_parser, self.reasoning_parser)
        # tests only (never set in production): requests may force their output tokens
        self.forced_output = envs.TEST_FORCED_OUTPUT.get()
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.chat_template = self._load_chat_template(chat_template)
        self.tok = TokenStrings(self.tokenizer)
        self.generation_defaults = load_generation_defaults(model_path) if generation_config == "auto" else {}
        if self.generation_defaults:
            logger.info("sampling defaults from generation_config.json: %s", self.generation_defaults)
        self._model_info: Optional[dict] = None
        self._openapi: Optional[dict] = None
        self._background: set = set()
        self._created = int(time.time())
        self._loop_lag = LoopLag()
        self._ttft = TTFTSplit(envs.LOG_STATS_INTERVAL_S.get(), lag=self._loop_lag)

    def _load_chat_template(self, chat_template: Optional[str]) -> Optional[str]:
        if chat_template:
            if "{" not in chat_template:
                with open(chat_template) as f:
                    return f.read()
            return chat_template
        return getattr(self.tokenizer, "chat_template", None)

    # ---------------- helpers ----------------

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the configured API key (no key configured: open)."""
        if self.api_key and not bearer_ok(request.headers.get("authorization"), self.api_key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _info(self) -> dict:
        if self._model_info is None:
            info = await self.router.get_model_info.remote()
            self._model_info = dict(info)
        return self._model_info

    def _check_model(self, name: Optional[str]) -> None:
        if name and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", type="invalid_request_error",
                           param="model", code="model_not_found")

    def _abort_in_background(self, rid: str) -> None:
        async def _abort():
            try:
                await asyncio.wait_for(_await(self.router.abort.remote(rid)), timeout=_ABORT_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001
                logger.warning("abort(%s) failed: %r", rid, e)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - no loop (interpreter shutdown)
            return
        # A fresh context: the abort must not be a child of the (possibly cancelled) request.
        task = loop.create_task(_abort(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run_blocking(self, fn, size: int):
        if size > _OFFLOAD_CHARS:
            return await asyncio.to_thread(fn)
        return fn()

    def _render_chat(self, req) -> tuple[list[int], str]:
        """The chat prompt: (token ids, the rendered text)."""
        template = self.chat_template
        if req.chat_template is not None:
            if not self.trust_request_chat_template:
                raise bad_request("A chat_template in the request is not accepted by this server (start it "
                                  "with --trust-request-chat-template to allow it).", param="chat_template")
            template = req.chat_template
        if not template:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              param="continue_final_message")
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                  if k not in _RESERVED_TEMPLATE_KWARGS}
        messages = req.template_messages()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=template_tools(req.tools), chat_template=template, tokenize=False,
                add_generation_prompt=bool(req.add_generation_prompt),
                continue_final_message=bool(req.continue_final_message), **kwargs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, SecurityError, the template's own errors
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise bad_request(f"Could not apply the chat template: {detail}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)), text

    async def _chat_prompt(self, req) -> tuple[list[int], str]:
        size = sum(len(m.text_content()) for m in req.messages)
        return await self._run_blocking(lambda: self._render_chat(req), size)

    def _forced_output(self, req, sp: SamplingParams, vocab_size: int) -> SamplingParams:
        """Tests only: a request's `forced_token_ids` (an extension field) become the output's first tokens,
        when the server runs with GLM_RAY_TEST_FORCED_OUTPUT=1; otherwise the field is ignored like any
        unknown one."""
        forced = (req.model_extra or {}).get("forced_token_ids")
        if not self.forced_output or forced is None:
            return sp
        if not isinstance(forced, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in forced):
            raise bad_request("forced_token_ids must be a list of token ids", param="forced_token_ids")
        check_token_ids(forced, vocab_size, param="forced_token_ids")
        return sp.clone(forced_token_ids=forced)

    def _constrain_chat(self, sp: SamplingParams, prompt_text: str, tool_choice) -> SamplingParams:
        """What decoding must produce in a chat turn: with `tool_choice` "required" or a named function, a
        GLM tool call whose arguments follow the tool's schema; with a `response_format`, the format — after
        the thinking block when the turn starts inside one (GLM-5's default), so thinking stays free text."""
        state = initial_state(prompt_text) if self.reasoning_parser != "none" else ANSWER
        so = sp.structured_outputs
        if tool_choice.constrained:
            if so is not None:
                raise bad_request("response_format cannot be combined with tool_choice 'required' or a named "
                                  "function", param="tool_choice")
            if sp.forced_token_ids:
                return sp              # tests only: the forced tool call is the output under test, unconstrained
            try:
                so = glm_tool_call_structured_outputs(
                    tool_choice.schemas, tool_choice.names, tool_choice.mode, tool_choice.parallel,
                    reasoning={THINKING: "enabled", MAYBE: "auto"}.get(state, "disabled"))
            except ValueError as e:
                raise bad_request(f"tool_choice cannot be enforced: {e}", param="tool_choice") from None
        elif so is not None and state == THINKING:
            so = dataclasses.replace(so, reasoning_end=THINK_END)
        return sp if so is sp.structured_outputs else sp.clone(structured_outputs=so)

    async def _completion_prompts(self, req: CompletionRequest, vocab_size: int):
        out = []
        prompts = req.prompt_list()
        if len(prompts) * (req.n or 1) > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={req.n} choices is more than {MAX_CHOICES} "
                              "completions in one request", param="prompt")
        for p in prompts:
            if isinstance(p, str):
                ids = await self._run_blocking(
                    lambda p=p: self.tokenizer.encode(p, add_special_tokens=bool(req.add_special_tokens)),
                    len(p))
                if not ids:
                    raise bad_request("prompt tokenizes to zero tokens", param="prompt")
                out.append((p, ids))
            else:
                check_token_ids(p, vocab_size, param="prompt")
                out.append((None, list(p)))
        return out

    def _params(self, req, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
        check_prompt_fits(prompt_len, None, max_model_len, param)
        sp = to_sampling_params(req, default_max_tokens=max_model_len - prompt_len,
                                defaults=self.generation_defaults)
        if requested_max_tokens(req) is not None:
            check_prompt_fits(prompt_len, sp.max_tokens, max_model_len, param)
        return sp

    def _make_subs(self, base_id: str, prompts: list[tuple[Optional[str], list[int]]],
                   params: list[SamplingParams]) -> list[SubRequest]:
        subs = []
        for p, ((text, ids), sp) in enumerate(zip(prompts, params)):
            first = None
            for i in range(sp.n):
                index = p * sp.n + i
                seed = choice_seed(sp.seed, i)
                # Prompt logprobs are the same for every choice of a prompt: compute them once.
                plp = sp.prompt_logprobs if i == 0 else None
                sub = SubRequest(index=index, prompt_idx=p, rid=f"{base_id}-{index}", prompt_ids=ids,
                           params=sp.clone(n=1, seed=seed, prompt_logprobs=plp), prompt_text=text,
                           group_first=first)
                first = first or sub
                subs.append(sub)
        return subs

    async def _parse(self, request: Request, model_cls, arrival: Arrival):
        """The shared prologue of the generation endpoints: body -> request model, model name checked,
        the engine's model info. Stamps `arrival.body_read` (the TTFT split's "body" part)."""
        body = await read_body(request)
        arrival.body_read = time.monotonic()
        req = parse_body(body, model_cls)
        self._check_model(req.model)
        return req, await self._info()

    async def _generate(self, req, base_id: str, prompts: list[tuple[Optional[str], list[int]]],
                        params: list[SamplingParams], render_stream, render_full, arrival: Arrival):
        """Fan the choices out to the Router, then answer with SSE (`stream: true`) or one JSON body;
        however the response ends, unfinished sub-requests are aborted."""
        fan = await self._start(self._make_subs(base_id, prompts, params), arrival)
        prompt_lens = [len(ids) for _, ids in prompts]
        if req.stream:
            return EventStream(render_stream(req, base_id, fan, prompt_lens), fan.close)
        try:
            return await render_full(req, base_id, fan, prompt_lens)
        finally:
            fan.close()

    async def _start(self, subs: list[SubRequest], arrival: Arrival) -> Fanout:
        if self._ttft.interval_s > 0:
            self._loop_lag.start()
            self._ttft.start()
        def on_first(s: SubRequest, d) -> None:     # the TTFT split line (serve/ttft_split.py)
            self._ttft.add(split_ttft(arrival.received, s.called_at, time.monotonic(), d.ttft_parts,
                                      body_read=arrival.body_read))
        fan = Fanout(self.router, subs, self._abort_in_background, on_first)
        try:
            fan.start()
            await fan.prelude()
        except BaseException:
            fan.close()
            raise
        return fan

    def _usage(self, subs: list[SubRequest], prompts_len: list[int]) -> UsageInfo:
        cached = {}
        for s in subs:
            cached[s.prompt_idx] = max(cached.get(s.prompt_idx, 0), s.num_cached_tokens)
        return UsageInfo.of(sum(prompts_len), sum(len(s.token_ids) for s in subs), sum(cached.values()))

    # ---------------- endpoints: models, health, tokenizer ----------------

    def _model_card(self, info: dict) -> ModelCard:
        return ModelCard(id=self.served_model_name, created=self._created, root=self.model_path,
                         max_model_len=info.get("max_model_len"), vocab_size=info.get("vocab_size"))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema(self, request: Request):
        if self._openapi is None:
            fastapi_app = getattr(self, "_asgi_app", None) or app
            try:
                info = await self._info()
            except Exception:  # noqa: BLE001 - the schema without the vocabulary bound
                info = {}
            self._openapi = build_openapi(fastapi_app.routes, title=fastapi_app.title, version=_version(),
                                          model_name=self.served_model_name, vocab_size=info.get("vocab_size"),
                                          auth=bool(self.api_key),
                                          request_chat_template=self.trust_request_chat_template)
        schema = dict(self._openapi)
        root = request.scope.get("root_path", "").rstrip("/")
        if root:
            schema["servers"] = [{"url": root}]
        return JSONResponse(schema)

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(openapi_url=root + "/openapi.json", title="glm-ray API")

    @app.get("/v1/models")
    @openai_errors(auth=True)
    async def list_models(self, request: Request):
        info = await self._info()
        return JSONResponse(ModelList(data=[self._model_card(info)]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    @openai_errors(auth=True)
    async def get_model(self, model_id: str, request: Request):
        self._check_model(model_id)
        info = await self._info()
        return JSONResponse(self._model_card(info).model_dump())

    @app.get("/health")
    async def health(self):
        try:
            await asyncio.wait_for(_await(self.router.check_engine.remote()), timeout=_HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            err = map_exception(e)
            msg = err.message if err.status_code != 500 else f"engine check failed: {err.message}"
            return error_response(APIError(503, msg, type="service_unavailable", code="engine_unhealthy"))
        return Response(status_code=200)

    @app.get("/version")
    async def version(self):
        return JSONResponse({"version": _version()})

    @app.post("/tokenize")
    @openai_errors()
    async def tokenize(self, request: Request):
        req = parse_tokenize_body(await read_body(request))
        self._check_model(req.model)
        info = await self._info()
        if isinstance(req, TokenizeChatRequest):
            ids, _ = await self._chat_prompt(req)
        else:
            ids = await self._run_blocking(
                lambda: self.tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens)),
                len(req.prompt))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=int(info["max_model_len"]),
                                             tokens=ids, token_strs=strs).model_dump())

    @app.post("/detokenize")
    @openai_errors()
    async def detokenize(self, request: Request):
        req = parse_body(await read_body(request), DetokenizeRequest)
        self._check_model(req.model)
        info = await self._info()
        vocab = max(int(info.get("vocab_size") or 0), len(self.tokenizer))
        check_token_ids(req.tokens, vocab, param="tokens")
        ids = [t for t in req.tokens if t < len(self.tokenizer)]   # padded vocab rows decode to ""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    # ---------------- /v1/completions ----------------

    @app.post("/v1/completions")
    @openai_errors("completion", auth=True)
    async def completions(self, request: Request):
        arrival = Arrival(time.monotonic())
        req, info = await self._parse(request, CompletionRequest, arrival)
        max_model_len = int(info["max_model_len"])
        prompts = await self._completion_prompts(req, int(info.get("vocab_size") or 1 << 31))
        params = [self._params(req, len(ids), max_model_len, "prompt") for _, ids in prompts]
        return await self._generate(req, random_id("cmpl"), prompts, params, self._completion_stream,
                                    self._completion_full, arrival)

    def _echo_text(self, s: SubRequest) -> str:
        if s.prompt_text is not None:
            return s.prompt_text
        return self.tokenizer.decode(s.prompt_ids, skip_special_tokens=False)

    def _echo_logprobs(self, s: SubRequest, k: int) -> CompletionLogProbs:
        plps = s.prompt_lps if s.prompt_lps is not None else [None] * len(s.prompt_ids)
        return completion_logprobs(s.prompt_ids, list(plps), k, self.tok, 0)

    async def _completion_full(self, req: CompletionRequest, base_id: str, fan: Fanout,
                               prompt_lens: list[int]) -> JSONResponse:
        await fan.collect()
        choices = []
        for s in fan.subs:
            k = s.params.logprobs
            text = s.text
            lps = None
            if req.echo:
                echo = self._echo_text(s)
                if k is not None:
                    lps = self._echo_logprobs(s, k)
                text = echo + text
            if k is not None:
                gen_lps = completion_logprobs(s.token_ids, pad_logprobs(s.logprobs, len(s.token_ids)), k, self.tok,
                                              initial_offset=len(text) - len(s.text))
                if lps is None:
                    lps = gen_lps
                else:
                    lps.extend(gen_lps)
            plp = None
            if req.prompt_logprobs is not None:
                plp = format_prompt_logprobs(s.prompt_ids, s.prompt_lps, req.prompt_logprobs, self.tok)
            choices.append(CompletionResponseChoice(index=s.index, text=text, logprobs=lps,
                                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                                    prompt_logprobs=plp))
        resp = CompletionResponse(id=base_id, model=self.served_model_name, choices=choices,
                                  usage=self._usage(fan.subs, prompt_lens))
        return JSONResponse(resp.model_dump())

    async def _completion_stream(self, req: CompletionRequest, base_id: str, fan: Fanout,
                                 prompt_lens: list[int]):
        created = int(time.time())
        model = self.served_model_name
        try:
            async for item in fan.deltas():
                if isinstance(item, APIError):
                    yield sse(for_client(item).to_dict())
                    break
                s, d = item
                k = s.params.logprobs
                text = ""
                lps = None
                plp = None
                if not s.sent_first:
                    s.sent_first = True
                    if req.echo:
                        text = self._echo_text(s)
                        if k is not None:
                            lps = self._echo_logprobs(s, k)
                    if req.prompt_logprobs is not None:
                        plp = format_prompt_logprobs(s.prompt_ids, s.prompt_lps, req.prompt_logprobs,
                                                     self.tok)
                text_offset = s.emitted_chars + len(text)
                text += d.new_text
                if k is not None and d.new_token_ids:
                    gen_lps = completion_logprobs(d.new_token_ids, pad_logprobs(d.new_logprobs, len(d.new_token_ids)),
                                                  k, self.tok, initial_offset=text_offset)
                    if lps is None:
                        lps = gen_lps
                    else:
                        lps.extend(gen_lps)
                if k is not None and lps is None and (text or d.finished):
                    lps = CompletionLogProbs()
                s.emitted_chars += len(text)
                if not (text or d.finished or lps is not None and lps.tokens):
                    continue
                chunk = CompletionStreamResponse(
                    id=base_id, created=created, model=model,
                    choices=[CompletionResponseStreamChoice(
                        index=s.index, text=text, logprobs=lps,
                        finish_reason=d.finish_reason if d.finished else None,
                        stop_reason=d.stop_reason if d.finished else None, prompt_logprobs=plp)])
                if req.continuous_usage:
                    chunk.usage = self._usage(fan.subs, prompt_lens)
                yield sse(chunk)
            else:
                if req.include_usage:
                    yield sse(CompletionStreamResponse(id=base_id, created=created, model=model, choices=[],
                                                       usage=self._usage(fan.subs, prompt_lens)))
            yield SSE_DONE
        finally:
            fan.close()

    # ---------------- /v1/chat/completions ----------------

    @app.post("/v1/chat/completions")
    @openai_errors("chat", auth=True)
    async def chat_completions(self, request: Request):
        arrival = Arrival(time.monotonic())
        req, info = await self._parse(request, ChatCompletionRequest, arrival)
        tool_choice = req.tool_choice_spec()
        ids, text = await self._chat_prompt(req)
        sp = self._params(req, len(ids), int(info["max_model_len"]), "messages")
        sp = self._forced_output(req, sp, int(info.get("vocab_size") or 1 << 31))
        sp = self._constrain_chat(sp, text, tool_choice)
        new_parser = functools.partial(OutputParser.create, self.reasoning_parser, self.tool_call_parser, text,
                                       tool_choice)
        return await self._generate(req, random_id("chatcmpl"), [(None, ids)], [sp],
                                    functools.partial(self._chat_stream, new_parser=new_parser),
                                    functools.partial(self._chat_full, new_parser=new_parser), arrival)

    async def _chat_full(self, req: ChatCompletionRequest, base_id: str, fan: Fanout,
                         prompt_lens: list[int], new_parser) -> JSONResponse:
        await fan.collect()
        choices = []
        for s in fan.subs:
            k = s.params.logprobs
            lps = None
            if k is not None:
                lps = ChatChoiceLogprobs(content=chat_logprobs(s.token_ids, pad_logprobs(s.logprobs, len(s.token_ids)),
                                                               k, self.tok))
            msg = new_parser().parse(s.text)
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in msg.tool_calls]
            content = None if not msg.content and (calls or msg.reasoning_content is not None) else msg.content
            choices.append(ChatCompletionResponseChoice(
                index=s.index, message=ChatResponseMessage(content=content, reasoning_content=msg.reasoning_content,
                                                           tool_calls=calls),
                logprobs=lps, finish_reason=chat_finish_reason(s.finish_reason, bool(calls)),
                stop_reason=s.stop_reason))
        plp = None
        if req.prompt_logprobs is not None and fan.subs:
            s0 = fan.subs[0]
            plp = format_prompt_logprobs(s0.prompt_ids, s0.prompt_logprobs, req.prompt_logprobs, self.tok)
        resp = ChatCompletionResponse(id=base_id, model=self.served_model_name, choices=choices,
                                      usage=self._usage(fan.subs, prompt_lens), prompt_logprobs=plp)
        return JSONResponse(resp.model_dump())

    async def _chat_stream(self, req: ChatCompletionRequest, base_id: str, fan: Fanout,
                           prompt_lens: list[int], new_parser):
        created = int(time.time())
        parsers = {s.index: new_parser() for s in fan.subs}
        model = self.served_model_name

        def chunk(choices, usage=None, plp=None) -> str:
            c = ChatCompletionStreamResponse(id=base_id, created=created, model=model, choices=choices,
                                             prompt_logprobs=plp)
            if usage is not None:
                c.usage = usage
            elif req.continuous_usage and choices:
                c.usage = self._usage(fan.subs, prompt_lens)
            return sse(c)

        try:
            for s in fan.subs:
                yield chunk([ChatCompletionStreamChoice(index=s.index,
                                                        delta=DeltaMessage(role="assistant", content=""))])
            plp_sent = req.prompt_logprobs is None
            async for item in fan.deltas():
                if isinstance(item, APIError):
                    yield sse(for_client(item).to_dict())
                    break
                s, d = item
                k = s.params.logprobs
                lps = None
                if k is not None and d.new_token_ids:
                    lps = ChatChoiceLogprobs(content=chat_logprobs(
                        d.new_token_ids, pad_logprobs(d.new_logprobs, len(d.new_token_ids)), k, self.tok))
                plp = None
                if not plp_sent and s.prompt_lps is not None:
                    plp_sent = True
                    plp = format_prompt_logprobs(s.prompt_ids, s.prompt_lps, req.prompt_logprobs, self.tok)
                parser = parsers[s.index]
                deltas = stream_deltas(parser.feed(d.new_text) + (parser.finish() if d.finished else []))
                if not (deltas or d.finished or lps is not None or plp is not None):
                    continue
                deltas = deltas or [DeltaMessage()]
                for j, delta in enumerate(deltas):
                    end = d.finished and j == len(deltas) - 1
                    yield chunk([ChatCompletionStreamChoice(
                        index=s.index, delta=delta, logprobs=lps if j == 0 else None,
                        finish_reason=chat_finish_reason(d.finish_reason, parser.called) if end else None,
                        stop_reason=d.stop_reason if end else None)], plp=plp if j == 0 else None)
            else:
                if req.include_usage:
                    yield chunk([], usage=self._usage(fan.subs, prompt_lens))
            yield SSE_DONE
        finally:
            fan.close()


def ingress_deployment(**options):
    """`serve.deployment(OpenAIIngress)` with streaming-friendly defaults; options override."""
    opts = dict(DEFAULT_INGRESS_OPTIONS)
    opts.update(options)
    return serve.deployment(OpenAIIngress, name=opts.pop("name", "OpenAIIngress"), **opts)
