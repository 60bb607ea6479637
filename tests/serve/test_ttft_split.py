"""The ingress's TTFT split (serve/ttft_split.py): each part from its own process's clock, the four parts
summing to the total at the ingress, and the periodic line's medians."""
from glm_ray.engine.outputs import TokenDelta, merge_deltas
from glm_ray.serve.ttft_split import TTFTSplit, split


def test_parts_sum_to_the_total():
    # ingress: handler start 10.000, Router call 10.004, first delta 10.200 (its clock); the Router saw 0.180
    # from its generate() entry to the first delta, the engine 0.150 from arrival to the first token
    p = split(10.000, 10.004, 10.200, {"router": 0.180, "engine": 0.150, "queued": 0.010})
    assert abs(p["before"] - 0.004) < 1e-9 and abs(p["ingress"] - 0.016) < 1e-9
    assert abs(p["router"] - 0.030) < 1e-9 and abs(p["engine"] - 0.150) < 1e-9 and p["queued"] == 0.010
    assert abs(p["before"] + p["ingress"] + p["router"] + p["engine"] - p["total"]) < 1e-9


def test_without_inner_parts_the_router_side_is_one_hop():
    # a delta that carried no parts (e.g. an older Router): all of Router call -> first delta is the hop
    p = split(1.0, 1.5, 3.0, None)
    assert p["ingress"] == 1.5 and p["router"] == 0.0 and p["engine"] == 0.0 and p["total"] == 2.0


def test_line_once_per_interval_with_medians():
    t = [0.0]
    s = TTFTSplit(5.0, clock=lambda: t[0])
    rows = [split(0.0, 0.001 * k, 0.1 * k, {"router": 0.05 * k, "engine": 0.04 * k}) for k in (1, 2, 3)]
    t[0] = 1.0
    assert s.add(rows[0]) is None and s.add(rows[1]) is None      # inside the interval: collected
    t[0] = 6.0
    line = s.add(rows[2])
    assert line.startswith("ingress: TTFT split over 3 requests")
    assert "in the engine 80.0" in line and "total at the ingress 200.0" in line   # medians: k = 2
    assert s.add(rows[0]) is None                                                 # a new window
    assert TTFTSplit(0.0).add(rows[0]) is None                                    # 0 = off


def test_a_pending_window_is_logged_without_more_traffic():
    """The last window before a quiet period: `flush` (the started task's tick) logs it once its interval
    is over, and nothing when no row is pending."""
    import asyncio
    t = [0.0]
    s = TTFTSplit(5.0, clock=lambda: t[0])
    assert s.flush() is None
    t[0] = 1.0
    assert s.add(split(0.0, 0.001, 0.1, {"router": 0.05, "engine": 0.04})) is None
    assert s.flush() is None                                    # its interval is not over yet
    t[0] = 5.5
    assert s.flush().startswith("ingress: TTFT split over 1 requests")
    assert s.flush() is None                                    # logged once

    async def main():
        real = TTFTSplit(0.05)
        real.start()
        real.add(split(0.0, 0.001, 0.1, None))                 # inside its first window: pending
        pending = len(real._rows)
        await asyncio.sleep(0.2)                               # no further traffic
        return pending, len(real._rows)
    assert asyncio.run(main()) == (1, 0)


def test_parts_survive_a_merged_backlog():
    """A consumer that fell behind takes its first token merged with the next: the parts stay."""
    a = TokenDelta("r", [5], ttft_parts={"router": 0.2, "engine": 0.1})
    b = TokenDelta("r", [6])
    assert merge_deltas(a, b).ttft_parts == {"router": 0.2, "engine": 0.1}


def test_loop_lag_sees_a_blocked_loop():
    """A callback that holds the loop for 80 ms makes the 10 ms timer fire ~80 ms late."""
    import asyncio
    import time

    from glm_ray.serve.ttft_split import LoopLag

    async def main():
        lag = LoopLag(0.01)
        lag.start()
        await asyncio.sleep(0.05)
        idle = lag.take()
        time.sleep(0.08)                          # the loop is blocked
        await asyncio.sleep(0.03)
        return idle, max(lag.samples)

    idle, worst = asyncio.run(main())
    assert idle.startswith("p50 ") and worst > 0.05, (idle, worst)


def test_legs_when_the_engine_shares_the_routers_clock():
    """Engine on the Router's host: the Router <-> engine part comes split into the add's way in and the
    first token's way out."""
    p = split(0.0, 0.01, 0.31, {"router": 0.28, "engine": 0.15, "add": 0.09, "out": 0.04})
    assert abs(p["router"] - 0.13) < 1e-9 and (p["add"], p["out"]) == (0.09, 0.04)
    line = TTFTSplit.line([p, split(0.0, 0.01, 0.2, {"router": 0.1, "engine": 0.05})])   # one row without legs
    assert "Router <-> engine hops" in line and "(add 90.0, out 40.0)" in line


def test_router_stamps_the_first_delta_and_the_fanout_reports_it():
    """Router._publish puts its parts on a stream's first delta only (engine timestamps from the delta, the
    legs when the engine shares its clock); the ingress's Fanout hands that delta to on_first once."""
    import asyncio
    import time

    from glm_ray.serve.fanout import Fanout, SubRequest
    from glm_ray.serve.router import Router, _Stream

    class _Metrics:
        def on_first_token(self, *a): pass
        def on_tokens(self, *a): pass
        def on_request_finished(self, *a): pass
        def on_error(self, *a): pass

    class _Engine:
        same_clock = True

    r = Router.__new__(Router)
    r.metrics, r.engine = _Metrics(), _Engine()
    st = _Stream()
    r._streams = {"r": st}
    now = time.monotonic()
    first = TokenDelta("r", [5], arrival_time=now - 0.3, first_scheduled_time=now - 0.29, first_token_time=now - 0.1)
    r._publish([first])
    second = TokenDelta("r", [6], arrival_time=now - 0.3)
    r._publish([second])
    p = first.ttft_parts
    assert set(p) == {"router", "queued", "engine", "add", "out"} and second.ttft_parts is None
    assert abs(p["engine"] - 0.2) < 1e-6 and abs(p["queued"] - 0.01) < 1e-6 and p["out"] >= 0.1
    assert abs(p["router"] - (p["add"] + p["engine"] + p["out"])) < 1e-6     # one clock: the legs add up

    class _Handle:                                   # the Router handle: a stream of the two deltas
        def options(self, **kw): return self

        @property
        def generate(self): return self

        def remote(self, *a):
            async def gen():
                yield first
                yield TokenDelta("r", [6], finished=True, finish_reason="length")
            return gen()

    seen = []

    async def run():
        sub = SubRequest(index=0, prompt_idx=0, rid="r", prompt_ids=[1], params=None)
        fan = Fanout(_Handle(), [sub], abort=lambda rid: None, on_first=lambda s, d: seen.append((s.called_at, d)))
        fan.start()
        async for _ in fan.deltas():
            pass
    asyncio.run(run())
    assert len(seen) == 1 and seen[0][1] is first and seen[0][0] > 0


def test_body_part_of_before():
    """The body's read (Serve's proxy -> replica hand-over) is a part of "before", shown beside it."""
    p = split(10.000, 10.020, 10.200, {"router": 0.1, "engine": 0.05}, body_read=10.015)
    assert abs(p["body"] - 0.015) < 1e-9 and abs(p["before"] - 0.020) < 1e-9
    assert "body" not in split(10.0, 10.02, 10.2, None)
    rows = [split(0.0, 0.010 * k, 0.1 * k, None, body_read=0.004 * k) for k in (1, 2, 3)]
    line = TTFTSplit.line(rows)
    assert "before the Router call 20.0 (body 8.0) |" in line, line          # medians: k = 2
    assert "(body" not in TTFTSplit.line([split(0.0, 0.01, 0.1, None)])
