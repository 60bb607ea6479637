"""Fan-out of one HTTP request into Router sub-requests (`n` x prompts), the merge of their
`TokenDelta` streams, and the SSE response that aborts whatever is unfinished however it ends.

`Fanout.prelude()` turns errors raised before any output into HTTP errors (400/503...); after that
they become in-stream errors. `close()` is idempotent and synchronous, safe in `finally` after a
cancellation: it cancels the pumps and aborts every unfinished sub-request on the Router.
"""
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi.responses import StreamingResponse

from glm_ray.engine.outputs import TokenDelta, carries_tokens, merge_deltas
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.serve.errors import map_exception
from glm_ray.serve.protocol import APIError


def delta_error(d: Optional[TokenDelta], err: Optional[BaseException]) -> Optional[APIError]:
    """What ends a sub-request in error: an exception from the Router, or an engine-side failure."""
    if err is not None:
        return map_exception(err)
    if d is not None and d.finish_reason == "error":
        return APIError(500, d.error or "the engine failed while generating", type="internal_error",
                        code="engine_error")
    return None


class EventStream(StreamingResponse):
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


@dataclass
class SubRequest:
    index: int                      # choice index in the response
    prompt_idx: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: Optional[str] = None
    gen: Any = None
    task: Optional[asyncio.Task] = None
    started: bool = False           # at least one delta received
    called_at: float = 0.0          # monotonic: when the Router call went out
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
    group_first: Optional["SubRequest"] = None   # the sub that computes prompt logprobs for this prompt

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


class Fanout:
    """Runs the sub-requests of one HTTP request and merges their streams.

    Items are `(sub, delta, error)`; exactly one terminal item per sub (finished delta, error,
    or `delta=None` when a stream ended without a finished delta).
    """

    def __init__(self, router, subs: list[SubRequest], abort: Callable[[str], None],
                 on_first: Optional[Callable[[SubRequest, TokenDelta], None]] = None):
        self.router = router
        self.on_first = on_first        # on_first(sub, delta): a sub-request's first delta arrived
        self.abort = abort              # abort(request_id): fire-and-forget abort on the Router
        self.subs = subs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._buffer: list = []
        self._remaining = len(subs)

    def start(self) -> None:
        handle = self.router.options(stream=True)
        for s in self.subs:
            s.called_at = time.monotonic()
            s.gen = handle.generate.remote(s.rid, s.prompt_ids, s.params)
            s.task = asyncio.get_running_loop().create_task(self._pump(s))

    async def _pump(self, s: SubRequest) -> None:
        try:
            async for d in s.gen:
                if not s.started and self.on_first is not None and carries_tokens(d):
                    self.on_first(s, d)
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
        """(sub, delta, error) in arrival order; what queued up while the consumer was busy (a slow
        client, a busy ingress) comes merged per sub-request, so a lagging stream renders one chunk for
        its backlog instead of one per token."""
        while self._remaining > 0:
            if not self._buffer:
                self._buffer.append(await self.queue.get())
            while not self.queue.empty():
                self._buffer.append(self.queue.get_nowait())
            if len(self._buffer) > 1:
                self._buffer = coalesce(self._buffer)
            item = self._buffer.pop(0)
            s, d, err = item
            if err is not None or d is None or d.finished:
                self._remaining -= 1
            yield item

    async def collect(self) -> None:
        """Drain every sub-request into its `SubRequest` (non-streaming responses); the first error
        is raised as an `APIError`; a stream that ended without a finished delta counts as aborted."""
        async for s, d, err in self.items():
            e = delta_error(d, err)
            if e is not None:
                raise e
            if d is None:
                s.finish_reason = s.finish_reason or "abort"
                continue
            s.absorb(d)

    async def deltas(self):
        """Streaming: yields `(sub, delta)` after absorbing each delta (a stream that ended without a
        finished delta yields a finished "abort" delta), or one `APIError` and stops."""
        async for s, d, err in self.items():
            e = delta_error(d, err)
            if e is not None:
                yield e
                return
            if d is None:
                d = TokenDelta(request_id=s.rid, new_token_ids=[], finished=True, finish_reason="abort")
            s.absorb(d)
            yield s, d

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
                self.abort(s.rid)


def coalesce(items: list[tuple]) -> list[tuple]:
    """Merge each sub-request's consecutive token deltas in `items` [(sub, delta, error)] into one
    (`merge_deltas`), keeping every sub's order: an error, an end of stream (delta None) or an error
    delta is never merged and nothing of that sub after it merges into what came before it."""
    out: list[tuple] = []
    open_at: dict[int, int] = {}                 # sub index -> position in `out` of its mergeable delta
    for s, d, err in items:
        ok = err is None and carries_tokens(d)
        j = open_at.get(s.index)
        if ok and j is not None:
            out[j] = (s, merge_deltas(out[j][1], d), None)
            if d.finished:
                del open_at[s.index]
            continue
        out.append((s, d, err))
        if ok and not d.finished:
            open_at[s.index] = len(out) - 1
        else:
            open_at.pop(s.index, None)
    return out


def pad_logprobs(lps: Optional[list], n: int) -> list:
    """Logprob dicts aligned with n tokens (None where the engine sent none)."""
    lps = list(lps or [])
    if len(lps) < n:
        lps += [None] * (n - len(lps))
    return lps[:n]


