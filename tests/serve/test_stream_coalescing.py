"""A stream consumer that fell behind takes the backlog as one delta (serve/router.py `_Stream.next`,
engine/outputs.py `merge_deltas`): the merged deltas carry exactly the tokens, text and logprobs of the
ones they replace, in order; an error delta or an exception is never merged into tokens (it comes
next, on its own), and nothing is merged past a finished delta. The same in the ingress (serve/fanout.py
`coalesce`, per sub-request of an n > 1 request), and the Router's optional stream-batching interval."""
from __future__ import annotations

import asyncio

from glm_ray.engine.outputs import TokenDelta
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.serve.fanout import Fanout, SubRequest, coalesce
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


def test_stream_batching_interval_merges_what_arrives_within_it():
    """With an interval, the first token goes at once; later ones wait out the interval and come merged."""
    async def run():
        st = _Stream()
        st.queue.put_nowait(_delta(0))
        first = await st.next(0.05)
        async def produce():
            for i in range(1, 5):
                await asyncio.sleep(0.005)
                st.queue.put_nowait(_delta(i, finished=i == 4, finish_reason="length" if i == 4 else None))
        task = asyncio.create_task(produce())
        second = await st.next(0.05)
        await task
        return first, second
    first, second = asyncio.run(run())
    assert first.new_token_ids == [100]
    assert second.new_token_ids == [101, 102, 103, 104] and second.finished


def _sub(i):
    return SubRequest(index=i, prompt_idx=0, rid=f"r{i}", prompt_ids=[1], params=SamplingParams())


def test_ingress_coalesce_per_sub_request_in_order():
    a, b = _sub(0), _sub(1)
    err = RuntimeError("router failed")
    items = [(a, _delta(0), None), (b, _delta(10), None), (a, _delta(1), None), (b, None, err),
             (a, _delta(2, finished=True, finish_reason="stop"), None)]
    out = coalesce(items)
    assert [(s.index, d.new_token_ids if d else None, e) for s, d, e in out] == \
        [(0, [100, 101, 102], None), (1, [110], None), (1, None, err)]
    assert out[0][1].finished and out[0][1].finish_reason == "stop"
    # an error delta splits a sub's run: what follows it is not merged into what came before
    bad = TokenDelta("r", [], finished=True, finish_reason="error", error="x")
    out = coalesce([(a, _delta(0), None), (a, bad, None), (a, _delta(1), None)])
    assert [o[1].new_token_ids for o in out] == [[100], [], [101]]


def test_fanout_consumer_that_fell_behind_gets_one_chunk():
    """Fanout.items(): deltas queued while the consumer was busy come out merged; counts stay right."""
    async def run():
        fan = Fanout(router=None, subs=[_sub(0)], abort=lambda rid: None)
        s = fan.subs[0]
        for i in range(3):
            fan.queue.put_nowait((s, _delta(i), None))
        got = []
        async for item in fan.items():
            got.append(item)
            if len(got) == 1:
                for i in range(3, 6):
                    fan.queue.put_nowait((s, _delta(i, finished=i == 5, finish_reason="length" if i == 5 else None),
                                          None))
        return got
    got = asyncio.run(run())
    assert [d.new_token_ids for _, d, _ in got] == [[100, 101, 102], [103, 104, 105]]
