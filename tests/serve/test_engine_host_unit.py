"""`EngineHost`'s admission (`Admission.apply`) without Ray: adds and aborts reach the engine in a threaded actor in no fixed
order, so an abort that arrives before its add must drop the add (else a client that went away at once
would leave its request running to max_tokens)."""
from __future__ import annotations

import threading

from glm_ray.serve.engine_host import Admission, EngineHost


class _FakeEngine:
    def __init__(self):
        self.running: set[str] = set()
        self.arrivals: dict[str, float] = {}

    def add_request(self, rid, ids, params, max_tokens=None, arrival_time=None):
        self.running.add(rid)
        self.arrivals[rid] = arrival_time

    def abort(self, rid) -> bool:
        if rid in self.running:
            self.running.discard(rid)
            return True
        return False


def _host():
    h = EngineHost.__new__(EngineHost)                   # no rank, no model: only the queues
    h.engine, h.admission, h._wake = _FakeEngine(), Admission(), threading.Event()
    return h


def test_abort_before_add_drops_the_add():
    h = _host()
    h.abort("a")                                          # arrives first (another actor thread)
    h.admission.apply(h.engine)
    h.add("a", [1, 2], None, 4)
    h.add("b", [1, 2], None, 4)
    h.admission.apply(h.engine)
    assert h.engine.running == {"b"}


def test_abort_and_add_in_one_batch_and_after_running():
    h = _host()
    h.add("a", [1], None, 4)
    h.abort("a")
    h.add("c", [1], None, 4)
    h.admission.apply(h.engine)
    assert h.engine.running == {"c"} and not h.admission.orphans   # cancelled in the same batch: nothing remembered
    h.abort("c")
    h.admission.apply(h.engine)
    assert h.engine.running == set() and not h.admission.orphans


def test_arrival_is_when_the_add_came_not_when_the_loop_applied_it():
    """The wait for the loop's next scheduling point is the engine's queue time, not the hop to it."""
    import time
    h = _host()
    t0 = time.monotonic()
    h.add("a", [1], None, 4)
    t1 = time.monotonic()
    time.sleep(0.05)                                      # the loop is busy with a step
    h.admission.apply(h.engine)
    assert t0 <= h.engine.arrivals["a"] <= t1


def test_a_step_past_the_timeout_fails_health(monkeypatch):
    """A step stuck longer than GLM_RAY_STEP_TIMEOUT_S (a rank blocked in a collective whose peer died)
    makes health raise, so Serve replaces the replica instead of its streams hanging."""
    import time

    import pytest

    from glm_ray.engine.errors import StepTimeoutError
    monkeypatch.setenv("GLM_RAY_STEP_TIMEOUT_S", "5")
    h = _host()
    h._dead, h._thread = None, threading.Thread(target=time.sleep, args=(2,))
    h._thread.start()
    h.engine.has_unfinished = lambda: True
    h._step_started = time.monotonic() - 1.0              # a step running for 1 s: fine
    h.health()
    h._step_started = time.monotonic() - 6.0              # 6 s > 5 s
    with pytest.raises(StepTimeoutError, match="running for 6 s"):
        h.health()


def test_within_step_timeout_raises_on_a_stalled_stream(monkeypatch):
    """The Router's wait for the next StepBatch (or the in-Router engine's step) gives up after
    GLM_RAY_STEP_TIMEOUT_S: the engine is declared dead and every stream ends with an error."""
    import asyncio

    import pytest

    from glm_ray.engine.errors import StepTimeoutError
    from glm_ray.serve.engine_client import within_step_timeout
    monkeypatch.setenv("GLM_RAY_STEP_TIMEOUT_S", "0.2")

    async def stream(stall_after: int):
        for i in range(stall_after):
            yield i
        await asyncio.sleep(60)                           # a step that never ends
        yield -1

    async def drain():
        gen, got = stream(3), []
        while True:
            got.append(await within_step_timeout(gen.__anext__()))
    with pytest.raises(StepTimeoutError, match="no engine step finished within 0.2 s"):
        asyncio.run(drain())
