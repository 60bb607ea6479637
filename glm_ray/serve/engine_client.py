"""Where the Router's engine runs, behind one interface: `LocalEngine` (the `EngineCore` in the Router's
process, one Ray call per step to the rank actors) or `RemoteEngine` (the engine loop inside rank 0's
actor, `serve/engine_host.py`: no Ray call per step; `engine_in_worker: true`).

Both validate requests synchronously (bad input fails fast, before a stream exists), take adds and
aborts without blocking, and drive `publish(StepBatch)` once per engine step from `run()`, which
returns only when the engine died (raising its cause).
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ray

from glm_ray import envs
from glm_ray.config import EngineConfig
from glm_ray.engine.engine_core import EngineCore, validate_request
from glm_ray.engine.errors import EngineOverloadedError, StepTimeoutError
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.stats_log import StatsLogger
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.serve.engine_host import Admission, EngineHostActor, StepBatch, engine_gauges, engine_stats, step_batch
from glm_ray.worker.worker_group import RayWorkerGroup

logger = logging.getLogger(__name__)


async def within_step_timeout(aw):
    """Await one engine step (or the next StepBatch) for at most GLM_RAY_STEP_TIMEOUT_S; past it raise
    StepTimeoutError, which the Router treats as a dead engine (streams end with a 503, health fails),
    instead of every stream hanging on a rank stuck in a collective."""
    limit = envs.STEP_TIMEOUT_S.get()
    try:
        return await asyncio.wait_for(aw, timeout=limit)
    except asyncio.TimeoutError:
        raise StepTimeoutError(f"no engine step finished within {limit:g} s ({envs.STEP_TIMEOUT_S.name}): "
                               "a rank is likely stuck") from None


class LocalEngine:
    """The engine in the Router's process; `engine.step()` on one dedicated thread, adds and aborts
    applied between steps on the event loop."""

    def __init__(self, cfg: EngineConfig, model_path: str, name_prefix: str | None):
        self.cfg = cfg
        self.executor = RayWorkerGroup(cfg, name_prefix=name_prefix)
        self.engine = EngineCore(cfg, self.executor, load_tokenizer(model_path))
        self.max_model_len, self.vocab_size = self.engine.max_model_len, self.engine.model_cfg.vocab_size
        self.same_clock = True          # the engine's timestamps are this process's monotonic clock
        self.admission = Admission()
        self.stats_log = StatsLogger(self.engine, envs.LOG_STATS_INTERVAL_S.get())
        self._wakeup = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._last_ok = time.monotonic()

    @property
    def orchestration(self) -> str:
        return self.executor.orchestration

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.engine.validate_request(prompt_token_ids, params)

    def check_capacity(self, in_flight: int) -> None:
        self.engine.check_capacity(pending=self.admission.num_adds)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.admission.add(request_id, prompt_token_ids, params, max_tokens)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self.admission.abort(request_id)
        self._wakeup.set()

    async def run(self, publish: Callable[[StepBatch], None]) -> None:
        loop = asyncio.get_running_loop()
        shown = None                                   # the gauges of the last StepBatch published

        def send(batch: StepBatch) -> None:
            nonlocal shown
            shown = batch.gauges
            publish(batch)

        while True:
            rejected = self.admission.apply(self.engine)
            # at once when the idle engine's gauges moved (e.g. the aborts of disconnected clients)
            if rejected or (not self.engine.has_unfinished() and engine_gauges(self.engine) != shown):
                send(step_batch(self.engine, [], rejected))
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                if self.admission.pending():
                    continue
                try:   # idle: wake up now and then so gauges are refreshed (Ray drops stale gauges)
                    await asyncio.wait_for(self._wakeup.wait(), timeout=4.0)
                except asyncio.TimeoutError:
                    send(step_batch(self.engine, [], {}))
                    self.stats_log.maybe_log()          # the last busy window, once its interval is over
                continue
            deltas = await within_step_timeout(loop.run_in_executor(self._thread, self.engine.step))   # raises: dead
            self._last_ok = time.monotonic()
            send(step_batch(self.engine, deltas, {}))
            self.stats_log.on_step(deltas)
            self.stats_log.maybe_log()

    async def health(self) -> None:
        if not self.engine.has_unfinished() and not self.admission.pending() and time.monotonic() - self._last_ok > 5:
            # idle: probe every rank with an empty step, on the engine thread
            await asyncio.get_running_loop().run_in_executor(self._thread, self.executor.check_health)
            self._last_ok = time.monotonic()

    async def stats(self) -> dict:
        return engine_stats(self.engine, self.orchestration)

    def shutdown(self) -> None:
        self.executor.shutdown()


class RemoteEngine:
    """The engine loop inside rank 0's actor (`EngineHost`): adds / aborts are fire-and-forget actor
    calls, the step outputs one streamed `StepBatch` per step."""

    orchestration = "engine_in_rank0"

    def __init__(self, cfg: EngineConfig, model_path: str, name_prefix: str | None):
        self.cfg = cfg
        self.group = RayWorkerGroup(cfg, name_prefix=name_prefix, rank0_cls=EngineHostActor)
        self.host = self.group.actors[0]
        info = ray.get(self.host.start.remote(self.group.num_blocks, model_path))
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        # CLOCK_MONOTONIC is one clock per host: the engine's timestamps compare with ours on the same node
        self.same_clock = info.get("node_id") == ray.get_runtime_context().get_node_id()
        self.model_cfg = self.group.model_cfg

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def check_capacity(self, in_flight: int) -> None:
        """The queue-full rule on the Router's side: requests in flight (running + waiting + being
        added) against running + waiting capacity."""
        sc = self.cfg.scheduler
        if in_flight >= sc.max_waiting + sc.max_num_seqs:
            raise EngineOverloadedError("the engine queue is full; retry later", retry_after_s=1.0)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.host.add.remote(request_id, prompt_token_ids, params, max_tokens)

    def abort(self, request_id: str) -> None:
        self.host.abort.remote(request_id)

    async def run(self, publish: Callable[[StepBatch], None]) -> None:
        gen = self.host.outputs.options(num_returns="streaming").remote()
        while True:                 # the host publishes every step, and an idle tick every few seconds
            try:
                ref = await within_step_timeout(gen.__anext__())
            except StopAsyncIteration:
                break
            publish(await ref)                         # raises the engine's exception when it died
        raise RuntimeError("the engine loop stopped")

    async def health(self) -> None:
        await asyncio.wait_for(self.host.health.remote(), timeout=30)

    async def stats(self) -> dict:
        return await self.host.stats.remote()

    def shutdown(self) -> None:
        try:
            self.host.stop.remote()
        except Exception:  # noqa: BLE001 - best effort; the actors are killed next
            pass
        self.group.shutdown()
