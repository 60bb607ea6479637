"""The engine loop beside rank 0's GPU: `EngineHost` is rank 0 of a TP group (a `RankActor`) that also
owns the `EngineCore` and runs its step loop on a thread of its own process — no Ray call per step.

The Router talks to it asynchronously: `add` / `abort` calls in (queued, applied between steps), one
message per step out (`outputs`, a Ray streaming generator yielding `StepBatch`: the step's token
deltas, the requests whose admission failed, the scheduler gauges). At TP > 1 rank 0's executor hands
each step's `SchedulerOutput` to ranks 1..N-1 over torch.distributed (`worker/step_channel.py`); those
ranks run `RankActor.follow`. A failing step fails its requests (the engine goes on); an executor
failure (a lost rank, a transport timeout) ends the loop: `outputs` raises, `health` raises, Serve
replaces the replica.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import ray

from glm_ray import envs
from glm_ray.engine.engine_core import EngineCore, summarize_steps
from glm_ray.engine.errors import StepTimeoutError
from glm_ray.engine.outputs import TokenDelta
from glm_ray.engine.pacing import StepPacer, next_step_key
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.stats_log import StatsLogger
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.worker.executor import LocalExecutor
from glm_ray.worker.worker_group import RankActor

logger = logging.getLogger(__name__)

_IDLE_TICK_S = 4.0        # an idle loop still publishes gauges this often (Ray drops stale gauges)


@dataclass
class StepBatch:
    """One step's worth of output for the Router (plain data: it crosses a process)."""
    deltas: list[TokenDelta] = field(default_factory=list)
    rejected: dict[str, BaseException] = field(default_factory=dict)   # admission failures, by request id
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_preempted: int = 0
    prefix_queries: int = 0            # cumulative prompt tokens looked up in / found in the prefix cache
    prefix_hits: int = 0

    @property
    def gauges(self) -> tuple[int, int, float]:
        return self.running, self.waiting, self.kv_usage


def engine_gauges(engine: EngineCore) -> tuple[int, int, float]:
    """What a StepBatch of `engine` now would carry as its gauges (running, waiting, KV usage)."""
    return len(engine.scheduler.running), len(engine.scheduler.waiting), engine.kv.usage()


def step_batch(engine: EngineCore, deltas: list[TokenDelta], rejected: dict[str, BaseException]) -> StepBatch:
    """The StepBatch of the step `engine` just ran (or of an idle tick)."""
    s = engine.last_stats
    return StepBatch(deltas=deltas, rejected=rejected, running=len(engine.scheduler.running),
                     waiting=len(engine.scheduler.waiting), kv_usage=engine.kv.usage(),
                     num_prefill_tokens=s.num_prefill_tokens, num_decode_seqs=s.num_decode_seqs,
                     num_preempted=s.num_preempted, prefix_queries=engine.kv.prefix_queries,
                     prefix_hits=engine.kv.prefix_hits)


def engine_stats(engine: EngineCore, orchestration: str) -> dict:
    """The Router's `stats()` answer: gauges, the last step's split, recent decode-step medians."""
    e, s = engine, engine.last_stats
    return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting), "kv_usage": e.kv.usage(),
            "num_preemptions": e.num_preemptions, "kv_capacity_tokens": e.kv.capacity_tokens,
            "prefix_cache": {"enabled": e.kv.enable_prefix_caching, "queries": e.kv.prefix_queries,
                             "hits": e.kv.prefix_hits, "cached_blocks": e.kv.num_cached_blocks},
            "max_model_len": e.max_model_len,
            "last_step": {"schedule_s": s.schedule_s, "execute_s": s.execute_s, "update_s": s.update_s,
                          "worker": s.worker_timings, "num_tokens": s.num_tokens},
            "decode_steps": summarize_steps(list(e.step_history)), "orchestration": orchestration}


class Admission:
    """Adds and aborts queued from any thread, applied to the engine between steps. Calls into a
    threaded actor are not ordered, so an abort may arrive before its add: it is remembered (a minute)
    and the add is dropped. A request's engine arrival time is when its add came here, so the wait for
    the loop's next scheduling point counts as the engine's queue time (the TTFT split's "queued"), not
    as the hop to the engine ("add")."""

    def __init__(self):
        self._lock = threading.Lock()
        self._adds: list[tuple[str, list[int], SamplingParams, int, float]] = []
        self._aborts: list[str] = []
        self.orphans: dict[str, float] = {}                # early aborts -> when they came

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        t = time.monotonic()
        with self._lock:
            self._adds.append((request_id, prompt_token_ids, params, max_tokens, t))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def pending(self) -> bool:
        return bool(self._adds or self._aborts)

    def has_adds(self) -> bool:
        return bool(self._adds)

    @property
    def num_adds(self) -> int:
        return len(self._adds)

    def apply(self, engine: EngineCore) -> dict[str, BaseException]:
        """Apply what is queued; returns the adds the engine refused, by request id."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        now = time.monotonic()
        orphans = self.orphans = {r: t for r, t in self.orphans.items() if now - t < 60}
        early = set(aborts)
        rejected: dict[str, BaseException] = {}
        for rid, ids, params, max_tokens, t in adds:
            if rid in early or orphans.pop(rid, None) is not None:
                early.discard(rid)
                continue
            try:
                engine.add_request(rid, ids, params, max_tokens=max_tokens, arrival_time=t)
            except Exception as e:  # noqa: BLE001 - it ends this request's stream, with its own status
                rejected[rid] = e
        for rid in aborts:
            if not engine.abort(rid) and rid in early:     # neither running nor added yet: its add may follow
                orphans[rid] = now
        return rejected


class EngineHost(RankActor):
    """Rank 0 + the engine. Construct through `RayWorkerGroup(..., rank0_cls=EngineHostActor)`; then
    `start(num_blocks, tokenizer_path)` once every rank has its cache."""

    def start(self, num_blocks: int, tokenizer_path: str | None) -> dict:
        tp = self.cfg.parallel.tensor_parallel_size
        if tp > 1:
            from glm_ray.worker.step_channel import BroadcastExecutor, StepChannel  # noqa: PLC0415 - TP>1 only
            executor = BroadcastExecutor(self.worker, StepChannel())
        else:
            executor = LocalExecutor(self.cfg, worker=self.worker, num_blocks=num_blocks)
        self.engine = EngineCore(self.cfg, executor, load_tokenizer(tokenizer_path) if tokenizer_path else None)
        self.admission = Admission()
        self.stats_log = StatsLogger(self.engine, envs.LOG_STATS_INTERVAL_S.get())
        on_gpu = getattr(getattr(self.worker, "device", None), "type", "cpu") == "cuda"
        late = envs.LATE_SCHEDULING.get()
        self.pacer = StepPacer() if late != "off" and self.engine.async_scheduling and on_gpu else None
        if self.pacer is not None:
            self.pacer.alternate = late == "alternate"
            self.stats_log.pacer = self.pacer
            logger.info("late scheduling%s: each step is scheduled as late as the running one allows (engine/pacing.py)",
                        " in alternate stats windows" if self.pacer.alternate else "")
        self._wake = threading.Event()
        self._out: queue.Queue = queue.Queue()
        self._dead: BaseException | None = None
        self._step_started: float | None = None                            # monotonic start of the running step
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.model_cfg.vocab_size,
                "node_id": ray.get_runtime_context().get_node_id(),
                "num_blocks": num_blocks}

    # ---- calls from the Router --------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.admission.add(request_id, prompt_token_ids, params, max_tokens)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.admission.abort(request_id)
        self._wake.set()

    def outputs(self):
        """Streaming generator: one `StepBatch` per engine step (and per idle tick) until the loop ends;
        raises the loop's exception when the engine died."""
        while True:
            item = self._out.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return
            yield item

    def health(self) -> None:
        """Raises when the loop ended; while the engine idles, also probes the other ranks with an empty
        step (at most every 5 s; BroadcastExecutor serializes it with the loop's steps), so a lost rank
        shows before the next request rather than with it."""
        if self._dead is not None:
            raise RuntimeError(f"the engine loop ended: {type(self._dead).__name__}: {self._dead}")
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop thread is gone")
        now = time.monotonic()
        started, limit = self._step_started, envs.STEP_TIMEOUT_S.get()
        if started is not None and now - started > limit:
            raise StepTimeoutError(f"an engine step has been running for {now - started:.0f} s (> "
                                   f"{envs.STEP_TIMEOUT_S.name}={limit:g}): a rank is likely stuck")
        if not self.engine.has_unfinished() and now - getattr(self, "_probed", 0.0) > 5:
            self.engine.executor.check_health()
            self._probed = now

    def stats(self) -> dict:
        out = engine_stats(self.engine, "engine_in_rank0")
        if getattr(self, "pacer", None) is not None:
            out["pacing"] = self.pacer.stats()
        return out

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ---- the loop (its own thread) ------------------------------------------------------------
    def _loop(self) -> None:
        last, shown = time.monotonic(), None          # when the last StepBatch went out, and its gauges
        pacer = getattr(self, "pacer", None)
        launched_behind = False                       # was the step in flight launched behind a running one?
        try:
            while not getattr(self, "_stopping", False):
                if pacer is not None:
                    self._pace(pacer)
                self._wake.clear()                        # an add from here on sets it again
                t0 = time.perf_counter()
                rejected = self.admission.apply(self.engine)
                apply_s = time.perf_counter() - t0
                if not self.engine.has_unfinished():
                    # at once when the gauges moved (e.g. the aborts of disconnected clients), else a tick
                    if rejected or engine_gauges(self.engine) != shown or time.monotonic() - last > _IDLE_TICK_S:
                        batch = step_batch(self.engine, [], rejected)
                        self._out.put(batch)
                        last, shown = time.monotonic(), batch.gauges
                    self.stats_log.maybe_log()              # the last busy window, once its interval is over
                    if not self.admission.pending():
                        self._wake.wait(timeout=_IDLE_TICK_S)
                    continue
                self._step_started = time.monotonic()
                if pacer is not None:
                    n0, behind = self.engine.num_steps, self.engine.inflight_started is not None
                deltas = self.engine.step()
                self._step_started = None
                if pacer is not None:
                    launched = self.engine.inflight_shape
                    if launched is not None:
                        pacer.observe_host(launched, apply_s + self.engine.last_launch_s)
                    if self.engine.num_steps > n0:             # the step collected now was launched last time:
                        s, w = self.engine.last_stats, self.engine.last_stats.worker_timings
                        # its gap counts if it was queued behind a running step (not after an idle engine)
                        pacer.observe_device(s.shape, w.get("device"), w.get("gap") if launched_behind else None)
                    launched_behind = behind
                batch = step_batch(self.engine, deltas, rejected)
                self._out.put(batch)
                last, shown = time.monotonic(), batch.gauges
                self.stats_log.on_step(deltas)
                self.stats_log.maybe_log()
        except BaseException as e:  # noqa: BLE001 - an executor failure: the engine is dead
            logger.exception("engine loop failed")
            self._dead = e
            self._out.put(e)
            return
        self.engine.executor.shutdown()           # TP > 1: the followers leave their loops
        self._out.put(None)

    def _pace(self, pacer: StepPacer) -> None:
        """Late scheduling: before scheduling the next step, wait while the running one has time left
        (`StepPacer.deadline`) unless a request is waiting to be added; an add or abort ends the wait."""
        if not pacer.active:
            return
        deadline = pacer.deadline(self.engine.inflight_started, self.engine.inflight_shape,
                                  next_step_key(self.engine.scheduler))
        if deadline is None or self.admission.has_adds():
            return
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        pacer.paced += 1
        t0 = time.perf_counter()
        if self._wake.wait(timeout=left):
            pacer.joined += self.admission.has_adds()
        pacer.waited_s += time.perf_counter() - t0


EngineHostActor = ray.remote(EngineHost)
