"""OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Per request: parse + validate (OpenAI error shape on every failure), apply the chat template,
tokenize, check the context length, fan out `n` (x prompts) sub-requests to the Router
deployment, merge their `TokenDelta` streams by choice index and render either one JSON response
or server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`). The engine already
detokenizes generated text and applies stop strings; the ingress only renders token strings for
logprobs. Whatever ends a request early (client disconnect, cancellation, an error in a sibling
sub-request) aborts every unfinished sub-request on the Router.

Router contract (glm_ray/serve/router.py):
  router.options(stream=True).generate.remote(request_id, prompt_token_ids, params) -> TokenDelta stream
  router.abort.remote(request_id); router.get_model_info.remote() -> dict; router.check_engine.remote()
"""
import asyncio
import contextvars
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm_ray.engine.errors import EngineError, EngineOverloadedError
from glm_ray.engine.outputs import TokenDelta
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.serve.detok import TokenStrings
from glm_ray.serve.protocol import (
    SSE_DONE, APIError, ChatChoiceLogprobs, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatCompletionStreamChoice, ChatCompletionStreamResponse,
    ChatResponseMessage, CompletionLogProbs, CompletionRequest, CompletionResponse,
    CompletionResponseChoice, CompletionResponseStreamChoice, CompletionStreamResponse,
    DeltaMessage, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeChatRequest,
    TokenizeResponse, UsageInfo, bad_request, chat_logprobs, check_prompt_fits, check_token_ids,
    completion_logprobs, format_prompt_logprobs, format_validation_errors, load_generation_defaults,
    parse_body, parse_tokenize_body, random_id, requested_max_tokens, sse, to_sampling_params,
)

logger = logging.getLogger("glm_ray.serve.ingress")

# Text longer than this is templated/tokenized off the event loop.
_OFFLOAD_CHARS = 4096
_ABORT_TIMEOUT_S = 30.0
_HEALTH_TIMEOUT_S = 10.0
# Keys a client must not smuggle into apply_chat_template through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize", "chat_template",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "documents"}

# Serve deployment options that suit a streaming front end (Serve's default of 5 concurrent
# requests per replica would queue the 6th stream at the proxy).
DEFAULT_INGRESS_OPTIONS: dict[str, Any] = {"max_ongoing_requests": 2048}

# --------------------------------------------------------------------------------------------
# Error mapping
# --------------------------------------------------------------------------------------------


def _exception_chain(exc: BaseException):
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (getattr(e, "cause", None), e.__cause__, e.__context__):
            if isinstance(nxt, BaseException):
                stack.append(nxt)


def map_exception(exc: BaseException) -> APIError:
    """Any exception (possibly wrapped by Ray) -> APIError with the right status."""
    chain = list(_exception_chain(exc))
    for e in chain:
        if isinstance(e, APIError):
            return e
    for e in chain:
        # Prefer the original (unwrapped) engine error: Ray's dual RayTaskError instances are
        # isinstance of the cause class but their message is the whole remote traceback.
        if isinstance(e, EngineError) and not _is_ray_wrapper(e):
            return _engine_error(e)
    for e in chain:
        if isinstance(e, EngineError):
            return _engine_error(e)
    try:
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
        from ray.exceptions import RayActorError
        for e in chain:
            if isinstance(e, BackPressureError):
                headers = {}
                if e.retry_after_s:
                    headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
                return APIError(e.status_code, e.message, type="server_overloaded",
                                code="server_overloaded", headers=headers)
            if isinstance(e, (DeploymentUnavailableError, RayActorError)):
                return APIError(503, "The engine is unavailable; retry later.",
                                type="service_unavailable", code="engine_unavailable")
    except ImportError:  # pragma: no cover
        pass
    msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return APIError(500, f"Internal server error: {msg}", type="internal_error", code="internal_error")


def _is_ray_wrapper(e: BaseException) -> bool:
    try:
        from ray.exceptions import RayTaskError
        return isinstance(e, RayTaskError)
    except ImportError:  # pragma: no cover
        return False


def _engine_error(e: EngineError) -> APIError:
    message = getattr(e, "message", None) or str(e)
    status = int(getattr(e, "status_code", 500) or 500)
    headers = {}
    if isinstance(e, EngineOverloadedError):
        retry = getattr(e, "retry_after_s", 1.0) or 1.0
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    return APIError(status, message, type=getattr(e, "error_type", None),
                    param=getattr(e, "param", None), code=getattr(e, "error_type", None),
                    headers=headers)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers or None)


# --------------------------------------------------------------------------------------------
# The FastAPI app and its exception handlers (every error leaves in OpenAI's shape)
# --------------------------------------------------------------------------------------------

app = FastAPI(title="glm-ray OpenAI-compatible API", docs_url="/docs", redoc_url=None)


@app.exception_handler(APIError)
async def _api_error_handler(request: Request, exc: APIError):
    return error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error_handler(request: Request, exc: RequestValidationError):
    msg, param = format_validation_errors(list(exc.errors()))
    return error_response(bad_request(msg, param=param))


@app.exception_handler(StarletteHTTPException)
async def _http_error_handler(request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(APIError(exc.status_code, str(exc.detail), code=code,
                                   headers=dict(exc.headers or {})))


@app.exception_handler(Exception)
async def _unhandled_error_handler(request: Request, exc: Exception):
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(map_exception(exc))


class _EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the response ends (even if never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# --------------------------------------------------------------------------------------------
# Fan-out of one HTTP request into router sub-requests
# --------------------------------------------------------------------------------------------


@dataclass
class _Sub:
    index: int                      # choice index in the response
    prompt_idx: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: Optional[str] = None
    gen: Any = None
    task: Optional[asyncio.Task] = None
    started: bool = False           # at least one delta received
    finished: bool = False          # the router reported finished (nothing to abort)
    # accumulation
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None
    emitted_chars: int = 0          # characters of text returned so far (for text_offset)
    sent_first: bool = False
    group_first: Optional["_Sub"] = None   # the sub that computes prompt logprobs for this prompt

    @property
    def prompt_lps(self) -> Optional[list]:
        src = self.group_first or self
        return src.prompt_logprobs

    def absorb(self, d: TokenDelta) -> None:
        self.text += d.new_text
        self.token_ids += d.new_token_ids
        if d.new_logprobs:
            self.logprobs += d.new_logprobs
        if d.num_prompt_tokens:
            self.num_prompt_tokens = d.num_prompt_tokens
        if d.num_cached_tokens:
            self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


class _Fanout:
    """Runs the sub-requests of one HTTP request and merges their streams.

    Items are `(sub, delta, error)`; exactly one terminal item per sub (finished delta, error,
    or `delta=None` when a stream ended without a finished delta).
    """

    def __init__(self, ingress: "OpenAIIngress", subs: list[_Sub]):
        self.ingress = ingress
        self.subs = subs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._buffer: list = []
        self._remaining = len(subs)

    def start(self) -> None:
        handle = self.ingress.router.options(stream=True)
        for s in self.subs:
            s.gen = handle.generate.remote(s.rid, s.prompt_ids, s.params)
            s.task = asyncio.get_running_loop().create_task(self._pump(s))

    async def _pump(self, s: _Sub) -> None:
        try:
            async for d in s.gen:
                s.started = True
                if d.finished:
                    s.finished = True
                self.queue.put_nowait((s, d, None))
                if d.finished:
                    return
            s.finished = True
            self.queue.put_nowait((s, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            s.finished = True       # the router side failed; nothing left to abort there
            self.queue.put_nowait((s, None, e))

    async def prelude(self) -> None:
        """Wait until every sub-request produced its first item; errors raised before any
        output become proper HTTP errors (400/503 ...) instead of in-stream errors."""
        waiting = {s.index for s in self.subs}
        while waiting:
            s, d, err = await self.queue.get()
            if err is not None and s.index in waiting:
                raise map_exception(err)
            if d is not None and d.prompt_logprobs is not None and s.prompt_logprobs is None:
                s.prompt_logprobs = d.prompt_logprobs   # siblings read it before their turn
            waiting.discard(s.index)
            self._buffer.append((s, d, err))

    async def items(self):
        while self._remaining > 0:
            if self._buffer:
                item = self._buffer.pop(0)
            else:
                item = await self.queue.get()
            s, d, err = item
            if err is not None or d is None or d.finished:
                self._remaining -= 1
            yield item

    def close(self) -> None:
        """Idempotent, synchronous (safe in `finally` after a cancellation)."""
        if self.closed:
            return
        self.closed = True
        for s in self.subs:
            if s.task is not None and not s.task.done():
                s.task.cancel()
            if s.gen is not None and not s.finished:
                if s.started:
                    try:
                        s.gen.cancel()
                    except Exception:  # noqa: BLE001
                        pass
                self.ingress._abort_in_background(s.rid)


def _pad(lps: Optional[list], n: int) -> list:
    """Logprob dicts aligned with n tokens (None where the engine sent none)."""
    lps = list(lps or [])
    if len(lps) < n:
        lps += [None] * (n - len(lps))
    return lps[:n]


async def _await(resp):
    return await resp


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
                 generation_config: str = "auto"):
        from glm_ray.engine.tokenizer import load_tokenizer

        self.router = router
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.chat_template = self._load_chat_template(chat_template)
        self.tok = TokenStrings(self.tokenizer)
        self.generation_defaults = load_generation_defaults(model_path) if generation_config == "auto" else {}
        if self.generation_defaults:
            logger.info("sampling defaults from generation_config.json: %s", self.generation_defaults)
        self._model_info: Optional[dict] = None
        self._background: set = set()
        self._created = int(time.time())

    def _load_chat_template(self, chat_template: Optional[str]) -> Optional[str]:
        if chat_template:
            if "{" not in chat_template:
                with open(chat_template) as f:
                    return f.read()
            return chat_template
        return getattr(self.tokenizer, "chat_template", None)

    # ---------------- helpers ----------------

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

    def _render_chat(self, req) -> list[int]:
        if not self.chat_template:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              param="continue_final_message")
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                  if k not in _RESERVED_TEMPLATE_KWARGS}
        messages = req.template_messages()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=req.tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=bool(req.add_generation_prompt),
                continue_final_message=bool(req.continue_final_message), **kwargs)
        except APIError:
            raise
        except Exception as e:  # jinja2 TemplateError, ValueError from the template, ...
            raise bad_request(f"Could not apply the chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))

    async def _chat_prompt_ids(self, req) -> list[int]:
        size = sum(len(m.text_content()) for m in req.messages)
        return await self._run_blocking(lambda: self._render_chat(req), size)

    async def _completion_prompts(self, req: CompletionRequest, vocab_size: int):
        out = []
        for p in req.prompt_list():
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
                   params: list[SamplingParams]) -> list[_Sub]:
        subs = []
        for p, ((text, ids), sp) in enumerate(zip(prompts, params)):
            first = None
            for i in range(sp.n):
                index = p * sp.n + i
                seed = None if sp.seed is None else sp.seed + i
                # Prompt logprobs are the same for every choice of a prompt: compute them once.
                plp = sp.prompt_logprobs if i == 0 else None
                sub = _Sub(index=index, prompt_idx=p, rid=f"{base_id}-{index}", prompt_ids=ids,
                           params=sp.clone(n=1, seed=seed, prompt_logprobs=plp), prompt_text=text,
                           group_first=first)
                first = first or sub
                subs.append(sub)
        return subs

    async def _start(self, subs: list[_Sub]) -> _Fanout:
        fan = _Fanout(self, subs)
        try:
            fan.start()
            await fan.prelude()
        except BaseException:
            fan.close()
            raise
        return fan

    def _usage(self, subs: list[_Sub], prompts_len: list[int]) -> UsageInfo:
        cached = {}
        for s in subs:
            cached[s.prompt_idx] = max(cached.get(s.prompt_idx, 0), s.num_cached_tokens)
        return UsageInfo.of(sum(prompts_len), sum(len(s.token_ids) for s in subs), sum(cached.values()))

    @staticmethod
    def _delta_error(s: _Sub, d: Optional[TokenDelta], err: Optional[BaseException]) -> Optional[APIError]:
        if err is not None:
            return map_exception(err)
        if d is not None and d.finish_reason == "error":
            return APIError(500, d.error or "the engine failed while generating", type="internal_error",
                            code="engine_error")
        return None

    # ---------------- endpoints: models, health, tokenizer ----------------

    def _model_card(self, info: dict) -> ModelCard:
        return ModelCard(id=self.served_model_name, created=self._created, root=self.model_path,
                         max_model_len=info.get("max_model_len"), vocab_size=info.get("vocab_size"))

    @app.get("/v1/models")
    async def list_models(self):
        try:
            info = await self._info()
            return JSONResponse(ModelList(data=[self._model_card(info)]).model_dump())
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str):
        try:
            self._check_model(model_id)
            info = await self._info()
            return JSONResponse(self._model_card(info).model_dump())
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))

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
        try:
            from importlib.metadata import version
            v = version("glm-ray")
        except Exception:  # noqa: BLE001
            v = "unknown"
        return JSONResponse({"version": v})

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        try:
            req = parse_tokenize_body(await request.body())
            self._check_model(req.model)
            info = await self._info()
            if isinstance(req, TokenizeChatRequest):
                ids = await self._chat_prompt_ids(req)
            else:
                ids = await self._run_blocking(
                    lambda: self.tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens)),
                    len(req.prompt))
            strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=int(info["max_model_len"]),
                                                 tokens=ids, token_strs=strs).model_dump())
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        try:
            req = parse_body(await request.body(), DetokenizeRequest)
            self._check_model(req.model)
            info = await self._info()
            vocab = max(int(info.get("vocab_size") or 0), len(self.tokenizer))
            check_token_ids(req.tokens, vocab, param="tokens")
            ids = [t for t in req.tokens if t < len(self.tokenizer)]   # padded vocab rows decode to ""
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))

    # ---------------- /v1/completions ----------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            req = parse_body(await request.body(), CompletionRequest)
            self._check_model(req.model)
            info = await self._info()
            max_model_len = int(info["max_model_len"])
            prompts = await self._completion_prompts(req, int(info.get("vocab_size") or 1 << 31))
            params = [self._params(req, len(ids), max_model_len, "prompt") for _, ids in prompts]
            base_id = random_id("cmpl")
            subs = self._make_subs(base_id, prompts, params)
            fan = await self._start(subs)
            prompt_lens = [len(ids) for _, ids in prompts]
            if req.stream:
                return _EventStream(self._completion_stream(req, base_id, fan, prompt_lens), fan.close)
            try:
                return await self._completion_full(req, base_id, fan, prompt_lens)
            finally:
                fan.close()
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, APIError):
                logger.warning("completion request failed: %r", e)
            return error_response(map_exception(e))

    def _echo_text(self, s: _Sub) -> str:
        if s.prompt_text is not None:
            return s.prompt_text
        return self.tokenizer.decode(s.prompt_ids, skip_special_tokens=False)

    def _echo_logprobs(self, s: _Sub, k: int) -> CompletionLogProbs:
        plps = s.prompt_lps if s.prompt_lps is not None else [None] * len(s.prompt_ids)
        return completion_logprobs(s.prompt_ids, list(plps), k, self.tok, 0)

    async def _completion_full(self, req: CompletionRequest, base_id: str, fan: _Fanout,
                               prompt_lens: list[int]) -> JSONResponse:
        async for s, d, err in fan.items():
            e = self._delta_error(s, d, err)
            if e is not None:
                raise e
            if d is None:
                s.finish_reason = s.finish_reason or "abort"
                continue
            s.absorb(d)
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
                gen_lps = completion_logprobs(s.token_ids, _pad(s.logprobs, len(s.token_ids)), k, self.tok,
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

    async def _completion_stream(self, req: CompletionRequest, base_id: str, fan: _Fanout,
                                 prompt_lens: list[int]):
        created = int(time.time())
        model = self.served_model_name
        try:
            async for s, d, err in fan.items():
                e = self._delta_error(s, d, err)
                if e is not None:
                    yield sse(e.to_dict())
                    break
                if d is None:
                    d = TokenDelta(request_id=s.rid, new_token_ids=[], finished=True, finish_reason="abort")
                s.absorb(d)
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
                    gen_lps = completion_logprobs(d.new_token_ids, _pad(d.new_logprobs, len(d.new_token_ids)),
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
    async def chat_completions(self, request: Request):
        try:
            req = parse_body(await request.body(), ChatCompletionRequest)
            self._check_model(req.model)
            info = await self._info()
            max_model_len = int(info["max_model_len"])
            ids = await self._chat_prompt_ids(req)
            sp = self._params(req, len(ids), max_model_len, "messages")
            base_id = random_id("chatcmpl")
            subs = self._make_subs(base_id, [(None, ids)], [sp])
            fan = await self._start(subs)
            if req.stream:
                return _EventStream(self._chat_stream(req, base_id, fan, [len(ids)]), fan.close)
            try:
                return await self._chat_full(req, base_id, fan, [len(ids)])
            finally:
                fan.close()
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, APIError):
                logger.warning("chat request failed: %r", e)
            return error_response(map_exception(e))

    async def _chat_full(self, req: ChatCompletionRequest, base_id: str, fan: _Fanout,
                         prompt_lens: list[int]) -> JSONResponse:
        async for s, d, err in fan.items():
            e = self._delta_error(s, d, err)
            if e is not None:
                raise e
            if d is None:
                s.finish_reason = s.finish_reason or "abort"
                continue
            s.absorb(d)
        choices = []
        for s in fan.subs:
            k = s.params.logprobs
            lps = None
            if k is not None:
                lps = ChatChoiceLogprobs(content=chat_logprobs(s.token_ids, _pad(s.logprobs, len(s.token_ids)),
                                                               k, self.tok))
            choices.append(ChatCompletionResponseChoice(
                index=s.index, message=ChatResponseMessage(content=s.text), logprobs=lps,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        plp = None
        if req.prompt_logprobs is not None and fan.subs:
            s0 = fan.subs[0]
            plp = format_prompt_logprobs(s0.prompt_ids, s0.prompt_logprobs, req.prompt_logprobs, self.tok)
        resp = ChatCompletionResponse(id=base_id, model=self.served_model_name, choices=choices,
                                      usage=self._usage(fan.subs, prompt_lens), prompt_logprobs=plp)
        return JSONResponse(resp.model_dump())

    async def _chat_stream(self, req: ChatCompletionRequest, base_id: str, fan: _Fanout,
                           prompt_lens: list[int]):
        created = int(time.time())
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
            async for s, d, err in fan.items():
                e = self._delta_error(s, d, err)
                if e is not None:
                    yield sse(e.to_dict())
                    break
                if d is None:
                    d = TokenDelta(request_id=s.rid, new_token_ids=[], finished=True, finish_reason="abort")
                s.absorb(d)
                k = s.params.logprobs
                lps = None
                if k is not None and d.new_token_ids:
                    lps = ChatChoiceLogprobs(content=chat_logprobs(
                        d.new_token_ids, _pad(d.new_logprobs, len(d.new_token_ids)), k, self.tok))
                plp = None
                if not plp_sent and s.prompt_lps is not None:
                    plp_sent = True
                    plp = format_prompt_logprobs(s.prompt_ids, s.prompt_lps, req.prompt_logprobs, self.tok)
                if not (d.new_text or d.finished or lps is not None or plp is not None):
                    continue
                delta = DeltaMessage(content=d.new_text) if d.new_text else DeltaMessage()
                yield chunk([ChatCompletionStreamChoice(
                    index=s.index, delta=delta, logprobs=lps,
                    finish_reason=d.finish_reason if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None)], plp=plp)
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
