"""The Router deployment: one replica = one model instance = one TP group.

Owns what Serve needs of the engine — admission (validation, the queue-full rule), per-request streams,
aborts, health, metrics, the placement group — and an engine client (`serve/engine_client.py`): the
engine in this process (`LocalEngine`, one Ray call per step to the ranks) or inside rank 0's actor
(`RemoteEngine`, `engine_in_worker: true`: no Ray call per step). Either way `run()` publishes one
`StepBatch` per engine step, which the Router fans out to the request streams as `TokenDelta`s.
"""
from __future__ import annotations

import asyncio
import logging
import time

from ray import serve
from ray.serve.config import RequestRouterConfig

from glm_ray import envs
from glm_ray.config import make_engine_config
from glm_ray.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, request_failure
from glm_ray.engine.outputs import TokenDelta, carries_tokens, merge_deltas
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.serve import affinity_router
from glm_ray.serve.args import ServeArgs
from glm_ray.serve.engine_client import LocalEngine, RemoteEngine
from glm_ray.serve.engine_host import StepBatch
from glm_ray.serve.metrics import EngineMetrics
from glm_ray.serve.ttft_split import LoopLag
from glm_ray.serve.ttft_split import logger as split_logger

logger = logging.getLogger("glm_ray.serve.router")
# What clients see once a rank is lost (the cause goes to the log): Serve replaces the replica.
_DEAD_MESSAGE = "the engine stopped (a worker failed); the server is restarting it, retry shortly"


class _Stream:
    __slots__ = ("queue", "held", "arrival", "first", "last", "n", "sent_at")

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held: TokenDelta | BaseException | None = None    # taken from the queue, not merged: next
        self.arrival = time.monotonic()
        self.first = self.last = None
        self.n = 0
        self.sent_at: float | None = None                       # when `next` last returned

    async def next(self, interval_s: float = 0.0) -> TokenDelta | BaseException:
        """The next item. Tokens queued behind it (a consumer that fell behind) come merged into one
        delta; with `interval_s` > 0, after the first item it also waits until `interval_s` has passed
        since the last one it returned and merges what arrived meanwhile (stream batching)."""
        if self.held is not None:
            d, self.held = self.held, None
        else:
            d = await self.queue.get()
        if interval_s > 0 and self.sent_at is not None and _mergeable(d):
            wait = self.sent_at + interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        while _mergeable(d) and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if not carries_tokens(nxt):
                self.held = nxt
                break
            d = merge_deltas(d, nxt)
        self.sent_at = time.monotonic()
        return d


def _mergeable(d) -> bool:
    return carries_tokens(d) and not d.finished


class Router:
    def __init__(self, args: dict | ServeArgs):
        self.args = args if isinstance(args, ServeArgs) else ServeArgs.from_dict(args)
        self._batch_s = self.args.stream_batching_interval_ms / 1e3      # 0: every step
        a = self.args
        model = a.resolved_model()
        self.cfg = make_engine_config(model, max_waiting=a.max_queued_requests, **a.engine_kwargs())
        engine_cls = RemoteEngine if a.engine_in_worker else LocalEngine
        self.engine = engine_cls(self.cfg, model, _worker_name_prefix())
        self.model_path = model
        self.metrics = EngineMetrics(a.model_name(), a.fp8_proj_gemm, a.tp)
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._recent_aborts: dict[str, float] = {}    # aborts that arrived before their generate()
        self._closing = False
        self._loop_task = asyncio.get_event_loop().create_task(self._run())
        self._gauge_task = asyncio.get_event_loop().create_task(self.metrics.keep_gauges_fresh())
        self._lag_task = asyncio.get_event_loop().create_task(self._log_loop_lag())
        logger.info("Router ready: %s tp=%d fp8_proj=%s orchestration=%s", a.model_name(), a.tp, a.fp8_proj_gemm,
                    self.engine.orchestration)

    async def _log_loop_lag(self) -> None:
        """Every GLM_RAY_LOG_STATS_INTERVAL_S while streams are open: how late this loop's timers fire (the loop
        that fans each step's outputs out to the streams; serve/ttft_split.py)."""
        interval = envs.LOG_STATS_INTERVAL_S.get()
        if interval <= 0:
            return
        lag = LoopLag()
        lag.start()
        while True:
            await asyncio.sleep(interval)
            if self._streams:
                split_logger.info("router: event-loop lag %s, %d streams open", lag.take(), len(self._streams))
            else:
                lag.take()

    # ---- API used by the ingress --------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        if self._dead is not None:
            raise EngineDeadError(_DEAD_MESSAGE)
        if request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if self._recent_aborts.pop(request_id, None) is not None:
            return                     # the caller gave up before we even saw the request
        max_tokens = self.engine.validate(prompt_token_ids, params)
        try:
            self.engine.check_capacity(in_flight=len(self._streams))
        except EngineOverloadedError:
            self.metrics.on_error(EngineOverloadedError.error_type)
            raise
        stream = self._streams[request_id] = _Stream()
        self.engine.add(request_id, list(prompt_token_ids), params, max_tokens)
        finished = False
        try:
            while True:
                d = await stream.next(self._batch_s)
                if isinstance(d, BaseException):
                    raise d
                if d.finish_reason == "error":         # this request failed in a step; the engine goes on
                    finished = True
                    raise request_failure(d.error_type, d.error or "the request failed")
                yield d
                if d.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:   # caller went away (disconnect/cancel)
                self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            now = time.monotonic()
            self._recent_aborts = {k: t for k, t in self._recent_aborts.items() if now - t < 60}
            self._recent_aborts[request_id] = now
        self.engine.abort(request_id)

    async def get_model_info(self) -> dict:
        return {"model": self.args.model_name(), "model_path": self.model_path,
                "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "tp": self.args.tp, "fp8_proj": self.args.fp8_proj_gemm,
                "orchestration": self.engine.orchestration}

    async def check_engine(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(_DEAD_MESSAGE)

    async def check_health(self) -> None:
        """Serve health check: fails once a worker died or the loop crashed."""
        await self.check_engine()
        try:
            await self.engine.health()
        except Exception as e:
            self._fail(e)
            raise EngineDeadError(_DEAD_MESSAGE) from e

    async def stats(self) -> dict:
        return await self.engine.stats()

    # ---- the batching loop --------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self.engine.run(self._on_step)
        except Exception as e:  # noqa: BLE001 - the engine died; every stream ends, Serve replaces us
            if self._closing:
                return
            logger.exception("engine step failed")
            self._fail(e)

    def _on_step(self, batch: StepBatch) -> None:
        try:
            for rid, e in batch.rejected.items():
                st = self._streams.get(rid)
                if st is not None:
                    st.queue.put_nowait(e)
            self._publish(batch.deltas)
            self.metrics.on_step(batch.running, batch.waiting, batch.kv_usage, batch.num_prefill_tokens,
                                 batch.num_decode_seqs, batch.num_preempted, batch.prefix_queries, batch.prefix_hits)
        except Exception:  # noqa: BLE001 - metrics/queues must not stop the loop
            logger.exception("publishing a step's outputs failed")

    def _publish(self, deltas: list[TokenDelta]) -> None:
        now = time.monotonic()
        m = self.metrics
        itl = []
        for d in deltas:
            st = self._streams.get(d.request_id)
            if st is None:
                continue
            if d.finish_reason == "error":              # no token: not a TTFT/ITL sample
                m.on_error(d.error_type or "engine_error")
                st.queue.put_nowait(d)
                continue
            if st.first is None:
                st.first = now
                ttft_s = now - st.arrival
                queue_s = max((d.first_scheduled_time or d.arrival_time) - d.arrival_time, 0.0)
                m.on_first_token(ttft_s, queue_s)
                d.ttft_parts = {"router": ttft_s, "queued": queue_s}              # serve/ttft_split.py
                if d.first_token_time is not None:
                    d.ttft_parts["engine"] = d.first_token_time - d.arrival_time
                    if self.engine.same_clock:     # the two legs apart: the add's way in, the token's way out
                        d.ttft_parts["add"] = d.arrival_time - st.arrival
                        d.ttft_parts["out"] = now - d.first_token_time
            else:
                itl.append(now - st.last)
            st.last = now
            st.n += len(d.new_token_ids)
            if d.finished:
                tpot = (now - st.first) / (st.n - 1) if st.n > 1 else None
                m.on_request_finished(now - st.arrival, tpot, d.num_prompt_tokens, st.n, d.finish_reason)
            st.queue.put_nowait(d)
        m.on_tokens(itl)

    def _fail(self, e: BaseException) -> None:
        self._dead = e
        logger.error("the engine is dead: %s: %s", type(e).__name__, e)
        err = EngineDeadError(_DEAD_MESSAGE)
        for st in self._streams.values():
            st.queue.put_nowait(err)
        self.metrics.on_error("engine_dead")

    def __del__(self):
        self._closing = True
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def _worker_name_prefix() -> str | None:
    """`glm-ray-worker:<app>:<replica>` so operators (and tests) can find a replica's TP workers."""
    try:
        ctx = serve.get_replica_context()
        return f"glm-ray-worker:{ctx.app_name}:{ctx.replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


def router_deployment(args: ServeArgs):
    """`serve.deployment(Router)`: `router_replicas` replicas, each with the placement group of one TP group,
    behind the `request_router` the ingress routes with."""
    gpu = args.uses_gpu()
    device_bundle = {"GPU": args.gpus_per_rank, "CPU": 1} if gpu else {"CPU": 1}
    if args.accelerator_type:
        device_bundle[f"accelerator_type:{args.accelerator_type}"] = 0.001
    bundles = [{"CPU": args.router_cpus}] + [dict(device_bundle) for _ in range(args.tp)]
    routing = {}
    if args.request_router == "prefix_affinity":     # the ingress -> Router hop (serve/affinity_router.py)
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=affinity_router.IMPORT_PATH,
            request_router_kwargs=dict(block_size=args.block_size, min_match_ratio=args.prefix_affinity_min_match,
                                       max_imbalance=args.prefix_affinity_max_imbalance,
                                       max_tokens_per_replica=args.prefix_affinity_max_tokens,
                                       prefix_matching=args.enable_prefix_caching))
    return serve.deployment(
        Router, name="Router", num_replicas=args.router_replicas, max_ongoing_requests=100_000, **routing,
        ray_actor_options={"num_cpus": args.router_cpus},
        placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK",
        health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=600,
        graceful_shutdown_wait_loop_s=2)
