"""`EngineHost`'s admission (`Admission.apply`) without Ray: adds and aborts reach the engine in a threaded actor in no fixed
order, so an abort that arrives before its add must drop the add (else a client that went away at once
would leave its request running to max_tokens)."""
from __future__ import annotations

import threading

from glm_ray.serve.engine_host import Admission, EngineHost


class _FakeEngine:
    def __init__(self):
        self.running: set[str] = set()

    def add_request(self, rid, ids, params, max_tokens=None):
        self.running.add(rid)

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
