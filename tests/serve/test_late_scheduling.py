"""Late scheduling (`GLM_RAY_LATE_SCHEDULING`, engine/pacing.py): the served loop schedules each step as late
as the running one allows, so a request that arrives during step k joins step k+1 instead of k+2.

The pacer's arithmetic is checked alone; the loop is `EngineHost._loop` itself (no Ray) over the tiny model
on CPU, whose executor is wrapped in a simulated device: a launch computes the step at once (the CPU) but the
step "runs" on one serial stream for a fixed time after the previous step ends, and its collect waits for that
end and reports the step's device time, as CUDA events would. The step a request first lands in is read from
that stream's log; the outputs are compared with the synchronous engine's."""
from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from glm_ray import LLM, SamplingParams
from glm_ray.engine.pacing import StepPacer, next_step_key, shape_key
from glm_ray.engine.stats_log import StatsLogger
from glm_ray.serve.engine_host import Admission, EngineHost

STEP_S = 0.15                  # the simulated device time of every non-empty step


def _sched(*qlens, sample=True):
    seqs = [SimpleNamespace(token_ids=[0] * q, sample=sample) for q in qlens]
    return SimpleNamespace(seqs=seqs, num_tokens=sum(qlens))


def test_shape_keys():
    assert shape_key(_sched(1)) == ("decode", 1)
    assert shape_key(_sched(1, 1, 1)) == ("decode", 4)
    assert shape_key(_sched(*[1] * 33)) == ("decode", 64)
    assert shape_key(_sched(1, 1, 100)) == ("mixed", 128)                # any row longer than one token
    assert shape_key(_sched(1, sample=False)) == ("mixed", 1)            # a one-token prefill chunk
    assert shape_key(_sched(2048)) == ("mixed", 2048)


def test_deadline_errs_early():
    p = StepPacer(margin_s=0.001, history=3)
    key, nxt = ("decode", 8), ("decode", 8)
    assert p.deadline(10.0, key, nxt) is None                            # no history: schedule now
    p.observe_device(key, 0.020)
    assert p.deadline(10.0, key, nxt) is None                            # no host time yet
    p.observe_host(key, 0.002)
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.020 - 0.002 - 0.001)
    for d in (0.018, 0.025, 0.030):                                      # the window keeps the last 3
        p.observe_device(key, d)
    p.observe_host(key, 0.004)
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.018 - 0.004 - 0.001)   # least device, most host
    p.observe_device(key, 0.040)                                         # 0.018 leaves the window
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.025 - 0.004 - 0.001)
    assert p.deadline(10.0, ("decode", 16), nxt) is None                 # another shape running: no history
    assert p.deadline(None, key, nxt) is None                            # nothing in flight
    p.observe_device(key, None)                                          # unmeasured steps are ignored
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.025 - 0.004 - 0.001)
    # host times by the next step's class: an eager mixed step's launch does not delay a decode's schedule point
    p.observe_host(("mixed", 256), 0.012)
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.025 - 0.004 - 0.001)
    assert p.deadline(10.0, key, ("mixed", 0)) == pytest.approx(10.0 + 0.025 - 0.012 - 0.001)
    assert p.deadline(10.0, key, ("decode", 32)) == pytest.approx(10.0 + 0.025 - 0.012 - 0.001)   # unseen: the most
    p.observe_device(key, None, gap_s=0.002)                             # the device idled 2 ms: wake earlier
    p.observe_device(key, None, gap_s=0.0)
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.025 - 0.004 - 0.001 - 0.002)
    p.observe_device(key, None, gap_s=3.0)                               # one long stall counts as 5 ms
    assert p.deadline(10.0, key, nxt) == pytest.approx(10.0 + 0.025 - 0.004 - 0.001 - 0.005)


def test_next_step_key():
    def req(num_tokens, computed, inflight=0):
        return SimpleNamespace(num_tokens=num_tokens, num_computed_tokens=computed, num_inflight=inflight)
    decoding = [req(30, 30, 1), req(12, 11), req(40, 40, 1)]            # next token in flight / known
    assert next_step_key(SimpleNamespace(waiting=[], running=decoding)) == ("decode", 4)
    assert next_step_key(SimpleNamespace(waiting=[req(9, 0)], running=decoding)) == ("mixed", 0)
    mid_prefill = decoding + [req(3000, 2048)]                           # a chunked prompt's second chunk
    assert next_step_key(SimpleNamespace(waiting=[], running=mid_prefill)) == ("mixed", 0)


class _SimDevice:
    """Wraps an in-process executor: steps run on one serial simulated stream of STEP_S each."""

    def __init__(self, executor):
        self.ex, self.free_at, self.prev_end = executor, 0.0, None
        self.log: list[tuple[float, float, set[str]]] = []          # (start, end, request ids) per step
        self._launch, self._collect = executor.launch, executor.collect
        executor.launch, executor.collect = self.launch, self.collect

    def launch(self, step):
        pending = self._launch(step)                                     # the CPU computes it here
        now = time.perf_counter()
        if step.is_empty:
            return pending, now, None, None
        start = max(now, self.free_at)
        gap = None if self.prev_end is None else start - self.prev_end     # the stream's idle time before it
        self.free_at = self.prev_end = end = start + STEP_S
        self.log.append((start, end, {s.req_id for s in step.seqs}))
        return pending, end, STEP_S, gap

    def collect(self, launched):
        pending, end, device_s, gap = launched
        time.sleep(max(0.0, end - time.perf_counter()))
        out = self._collect(pending)
        if out is not None and device_s is not None:
            out.timings["device"] = device_s
            if gap is not None:
                out.timings["gap"] = gap
        return out

    def first_step_of(self, rid: str) -> int:
        return next(i for i, (_, _, ids) in enumerate(self.log) if rid in ids)

    def step_at(self, t: float) -> int:
        return next(i for i, (s, e, _) in enumerate(self.log) if s <= t < e)


def _serve(tiny_dir, pacer: StepPacer | None):
    """Run A, then add B mid-step once A decodes; returns (B's first step - the step running at its add,
    both outputs, the simulated stream's idle gaps between A's decode steps, the pacer)."""
    llm = LLM(tiny_dir, dtype="float32", async_scheduling=True, kv_cache_memory_bytes=32 << 20)
    eng = llm.engine
    dev = _SimDevice(eng.executor)
    h = EngineHost.__new__(EngineHost)                                   # no rank actor: the loop alone
    h.engine, h.admission, h._wake, h._out = eng, Admission(), threading.Event(), queue.Queue()
    h.stats_log, h._dead, h._step_started, h.pacer = StatsLogger(eng, 0), None, None, pacer
    h.stats_log.pacer = pacer
    thread = threading.Thread(target=h._loop, daemon=True)
    thread.start()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    h.add("A", list(range(10, 30)), params, 12)
    b_at = None
    try:
        deadline = time.perf_counter() + 30
        while b_at is None and time.perf_counter() < deadline:      # a step past A's 3rd, 40 ms in
            now = time.perf_counter()
            running = [i for i, (s, e, _) in enumerate(dev.log) if s + 0.04 <= now < e - 0.09]
            if running and running[0] >= 3:
                b_at = now
                h.add("B", list(range(40, 57)), params, 12)
            time.sleep(0.002)
        outs: dict[str, list[int]] = {"A": [], "B": []}
        done = 0
        while done < 2:
            item = h._out.get(timeout=30)
            for d in item.deltas:
                outs[d.request_id].extend(d.new_token_ids)
                done += d.finished
    finally:
        h.stop()
        thread.join(timeout=10)
    lag = dev.first_step_of("B") - dev.step_at(b_at)
    a_steps = [(s, e) for s, e, ids in dev.log if ids == {"A"}][1:]      # A alone, decoding
    gaps = [s1 - e0 for (_, e0), (s1, _) in zip(a_steps, a_steps[1:])]
    if pacer is not None:                                                # the stats line counts the waits
        line = h.stats_log.line(list(eng.step_history), 1.0)
        mean = 1e3 * pacer.waited_s / pacer.paced
        want = f"late scheduling: {pacer.paced} waits of {mean:.1f} ms mean, {pacer.joined} ended by an arrival"
        assert want in line, line
        assert 0.03 < pacer.waited_s / pacer.paced < STEP_S, "each wait is a good part of a simulated step"
    return lag, outs, gaps, llm


def test_a_request_arriving_mid_step_joins_the_next_step(tiny_dir):
    paced = StepPacer(margin_s=0.03)                                     # CI's host: 30 ms of slack
    lag, outs, gaps, _ = _serve(tiny_dir, paced)
    assert lag == 1, "with late scheduling a request added during step k is first scheduled in step k+1"
    assert paced.paced >= 3 and paced.joined >= 1
    assert max(gaps) < 0.005, "each paced step was still queued before the running one ended"
    lag0, outs0, _, _ = _serve(tiny_dir, None)
    assert lag0 == 2, "without it, step k+1 was scheduled when step k began: the request waits for k+2"
    assert outs == outs0
    llm = LLM(tiny_dir, dtype="float32", async_scheduling=False, kv_cache_memory_bytes=32 << 20)
    ref = llm.generate([{"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": list(range(40, 57))}],
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outs["A"] == ref[0].outputs[0].token_ids and outs["B"] == ref[1].outputs[0].token_ids


def test_alternate_flips_the_pacer_each_stats_window(tiny_dir, monkeypatch):
    """GLM_RAY_LATE_SCHEDULING=alternate: the A/B inside one lifetime, a stats window each way, each line naming its
    mode; an inactive pacer leaves the schedule point where it was."""
    from glm_ray import envs
    for raw, want in (("1", "on"), ("true", "on"), ("0", "off"), ("alternate", "alternate"), ("ALTERNATE", "alternate")):
        monkeypatch.setenv("GLM_RAY_LATE_SCHEDULING", raw)
        assert envs.LATE_SCHEDULING.get() == want
    llm = LLM(tiny_dir, dtype="float32")
    eng = llm.engine
    t = [0.0]
    log = StatsLogger(eng, interval_s=1.0, clock=lambda: t[0])
    pacer = StepPacer()
    pacer.alternate = True
    log.pacer = pacer
    modes = []
    for w in range(4):
        eng.add_request(f"r{w}", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            log.on_step(eng.step())
        t[0] += 1.5
        modes.append(log.maybe_log().split("late scheduling ")[1].split(":")[0])
    assert modes == ["on", "off", "on", "off"]
    h = EngineHost.__new__(EngineHost)
    h.engine, h.admission, h._wake = eng, Admission(), threading.Event()
    pacer.observe_device(("decode", 1), 10.0)                            # a running step with 10 s left
    pacer.observe_host(("decode", 1), 0.001)
    eng.inflight_started, eng._inflight = time.perf_counter(), (_sched(1), None)
    pacer.active = True
    threading.Timer(0.2, h._wake.set).start()                            # an add's wake-up ends the wait
    t0 = time.perf_counter()
    h._pace(pacer)
    assert 0.15 < time.perf_counter() - t0 < 5 and pacer.paced == 1
    pacer.active = False                                                 # the other half of the A/B: no wait
    t0 = time.perf_counter()
    h._pace(pacer)
    assert time.perf_counter() - t0 < 0.05 and pacer.paced == 1
    eng._inflight = None
