"""A stream consumer that fell behind takes the backlog as one delta (serve/router.py `_Stream.next`,
engine/outputs.py `merge_deltas`): the merged deltas carry exactly the tokens, text and logprobs of the
ones they replace, in order; an error delta or an exception is never merged into tokens (it comes
next, on its own), and nothing is merged past a finished delta."""
from __future__ import annotations

import asyncio

from glm_ray.engine.outputs import TokenDelta
from glm_ray.serve.router import _Stream


def _delta(i, **kw):
    return TokenDelta("r", [100 + i], new_text=f"t{i} ", new_logprobs=[{100 + i: -0.1 * i}], **kw)


def _drain(items):
    async def run():
        st = _Stream()
        for d in items:
            st.queue.put_nowait(d)
        out = []
        while True:
            d = await st.next()
            out.append(d)
            if isinstance(d, BaseException) or d.finished or d.finish_reason == "error":
                if st.queue.empty() and st.held is None:
                    return out
    return asyncio.run(run())


def test_backlog_merges_into_one_delta():
    first = TokenDelta("r", [100], new_text="t0 ", new_logprobs=[{100: 0.0}], num_prompt_tokens=7,
                       num_cached_tokens=4, prompt_logprobs=[None, {3: -1.0}], arrival_time=1.0,
                       first_scheduled_time=2.0)
    items = [first] + [_delta(i) for i in range(1, 5)] + [_delta(5, finished=True, finish_reason="length")]
    (d,) = _drain(items)
    assert d.new_token_ids == [100, 101, 102, 103, 104, 105]
    assert d.new_text == "".join(x.new_text for x in items)
    assert d.new_logprobs == [x.new_logprobs[0] for x in items]
    assert d.finished and d.finish_reason == "length"
    assert (d.num_prompt_tokens, d.num_cached_tokens, d.prompt_logprobs) == (7, 4, [None, {3: -1.0}])
    assert (d.arrival_time, d.first_scheduled_time) == (1.0, 2.0)


def test_error_and_exception_are_not_merged():
    err = TokenDelta("r", [], finished=True, finish_reason="error", error="boom", error_type="engine_error")
    out = _drain([_delta(0), _delta(1), err])
    assert [o.new_token_ids for o in out] == [[100, 101], []] and out[1] is err
    exc = RuntimeError("engine dead")
    out = _drain([_delta(0), _delta(1), exc])
    assert out[0].new_token_ids == [100, 101] and out[1] is exc


def test_no_logprobs_stays_none_and_one_delta_passes_through():
    d0 = TokenDelta("r", [1], new_text="a")
    (d,) = _drain([d0, TokenDelta("r", [2], new_text="b", finished=True, finish_reason="stop", stop_reason=2)])
    assert d.new_logprobs is None and d.new_token_ids == [1, 2] and d.stop_reason == 2
    single = TokenDelta("r", [3], finished=True, finish_reason="stop")
    assert _drain([single]) == [single]
