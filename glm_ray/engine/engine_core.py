"""The engine loop: `step()` = schedule -> execute on the workers -> update requests.

Owns the scheduler, the KV block manager, per-request detokenizers and stop checks. Emits
`TokenDelta`s (the wire contract in outputs.py). Knows nothing about HTTP or Ray Serve; the Router
deployment and the offline `LLM` both drive it.

Failures: a request the workers report as failed in a step (`ModelRunnerOutput.failed`: its forward
or its sampling raised, or the device ran out of memory) and a request whose own update raises (a
detokenizer, a stop check) is finished with `finish_reason="error"` and an error delta; its KV
blocks and state slot are freed and every other request goes on. Only an exception out of
`executor.execute` itself (a lost rank, a broken transport) leaves `step()`: the engine is dead then.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from glm_ray.config import EngineConfig
from glm_ray.engine.contract import Executor, SchedulerOutput
from glm_ray.engine.detokenizer import IncrementalDetokenizer
from glm_ray.engine.errors import EngineOverloadedError, InvalidRequestError, StepOutOfMemoryError
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.outputs import TokenDelta
from glm_ray.engine.pacing import ShapeKey, shape_key
from glm_ray.engine.request import Request
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.scheduler import Scheduler
from glm_ray.engine.structured import check as check_structured_output

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What the last step did, for metrics and the orchestration-overhead measurement."""
    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_preempted: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0          # wall time of executor.execute (model + transport)
    update_s: float = 0.0
    worker_timings: dict = field(default_factory=dict)
    finished_at: float = 0.0        # time.monotonic() when its results were applied
    shape: ShapeKey | None = None   # engine.pacing.shape_key of the step

    @property
    def step_s(self) -> float:
        return self.schedule_s + self.execute_s + self.update_s

    @property
    def orchestration_s(self) -> float:
        """Time in `execute` not spent inside the workers (transport + Ray), 0 in-process."""
        w = self.worker_timings
        return max(0.0, self.execute_s - sum(w.get(k, 0.0) for k in ("prepare", "forward", "sample")))


def summarize_steps(steps, decode_only: bool = True) -> dict:
    """Medians over recent steps: step time, orchestration overhead and its share, host-side Python."""
    xs = [s for s in steps if (s.num_decode_seqs == s.num_tokens > 0) or (not decode_only and s.num_tokens)]
    if not xs:
        return {"steps": 0}
    def med(f):
        return statistics.median(f(s) for s in xs)
    step, orch = med(lambda s: s.step_s), med(lambda s: s.orchestration_s)
    return {"steps": len(xs), "step_ms": step * 1e3, "orchestration_ms": orch * 1e3,
            "orchestration_share": orch / step if step else 0.0,
            "schedule_update_ms": med(lambda s: s.schedule_s + s.update_s) * 1e3,
            "forward_ms": med(lambda s: s.worker_timings.get("forward", 0.0)) * 1e3,
            "collectives_ms": med(lambda s: s.worker_timings.get("collectives", 0.0)) * 1e3,
            "collectives_share": med(lambda s: s.worker_timings.get("collectives", 0.0) / s.step_s if s.step_s else 0.0),
            "batch": med(lambda s: s.num_decode_seqs),
            **_timeline(xs)}


def _timeline(steps) -> dict:
    """Medians of the device-side marks (GLM_RAY_STEP_TIMELINE): the step's device time, the device's
    idle gap before it, and the share of the step that gap is."""
    dev = [s.worker_timings["device"] for s in steps if "device" in s.worker_timings]
    if not dev:
        return {}
    out = {"device_ms": statistics.median(dev) * 1e3}
    gapped = [s for s in steps if "gap" in s.worker_timings]
    if gapped:
        out["gap_ms"] = statistics.median(s.worker_timings["gap"] for s in gapped) * 1e3
        out["gap_share"] = statistics.median(s.worker_timings["gap"] / s.step_s if s.step_s else 0.0 for s in gapped)
    return out


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """Raise InvalidRequestError if the request can never be served by a model of this vocabulary and
    context length; return its resolved max_tokens (what a Router validates before any engine call)."""
    try:
        params.validate()            # again: a SamplingParams that crossed a process was unpickled, not built
        if params.structured_outputs is not None:
            check_structured_output(params.structured_outputs)     # the grammar compiles (cached)
    except ValueError as e:
        raise InvalidRequestError(str(e), param=getattr(e, "param", None)) from None
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    V = vocab_size
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < V)]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})", param="prompt")
    bad = [t for t in params.stop_token_ids if not 0 <= t < V]
    if bad:
        raise InvalidRequestError(f"stop token id {bad[0]} is outside the vocabulary [0, {V})",
                                  param="stop_token_ids")
    P = len(prompt_token_ids)
    if P >= max_model_len:
        raise InvalidRequestError(f"the prompt has {P} tokens but the model's context length is "
                                  f"{max_model_len}; shorten the prompt", param="prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - P
    if P + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this request needs {P} prompt + {max_tokens} output tokens = {P + max_tokens}, more than the "
            f"context length {max_model_len}; reduce the prompt or max_tokens", param="max_tokens")
    return max_tokens


class EngineCore:
    def __init__(self, cfg: EngineConfig, executor: Executor, tokenizer=None):
        self.cfg = cfg
        self.executor = executor
        self.model_cfg = executor.model_cfg
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(executor.num_blocks, cfg.cache.block_size, self._prefix_caching(cfg))
        limit = min(self.model_cfg.max_position_embeddings, self.kv.capacity_tokens)
        if cfg.scheduler.max_model_len is not None:
            if cfg.scheduler.max_model_len > self.kv.capacity_tokens:
                raise ValueError(f"max_model_len {cfg.scheduler.max_model_len} exceeds the KV cache capacity "
                                 f"({self.kv.capacity_tokens} tokens); raise the KV memory budget")
            limit = min(limit, cfg.scheduler.max_model_len)
        self.max_model_len = limit
        self.scheduler = Scheduler(cfg.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.last_stats = StepStats()
        self.num_preemptions = 0
        self.step_history: deque[StepStats] = deque(maxlen=2048)
        self.eos = set(self.model_cfg.eos_token_ids)
        # async scheduling: step N+1 is scheduled and launched before step N's tokens are read back
        # (executors with launch/collect: the in-process one, and rank 0's BroadcastExecutor at TP > 1, whose
        # ranks then receive each step's sampled ids over the TP group)
        can_launch = hasattr(executor, "launch")
        if cfg.async_scheduling is None:          # auto: on for an in-process executor on a GPU, TP = 1
            worker = getattr(executor, "worker", None)
            self.async_scheduling = (can_launch and cfg.parallel.tensor_parallel_size == 1
                                     and getattr(getattr(worker, "device", None), "type", "cpu") != "cpu")
        else:
            self.async_scheduling = cfg.async_scheduling and can_launch
            if cfg.async_scheduling and not can_launch:
                logger.warning("async scheduling needs the engine beside rank 0 (an in-process executor, or "
                               "the engine loop in rank 0's actor at TP > 1); steps run synchronously")
        self.scheduler.async_mode = self.async_scheduling
        self.scheduler.max_model_len = self.max_model_len
        self._inflight: tuple[SchedulerOutput, object] | None = None      # launched, not collected
        self.inflight_started: float | None = None   # perf_counter() when the device began the in-flight step
        self.last_launch_s = 0.0                      # the last step() call's schedule + launch (async)
        self.num_steps = 0                            # steps whose results were applied
        logger.info("engine ready: %d KV blocks (%d tokens), max_model_len %d", self.kv.num_blocks,
                    self.kv.capacity_tokens, self.max_model_len)

    def _prefix_caching(self, cfg: EngineConfig) -> bool:
        """Prefix caching as configured, except for hybrid models: a KDA layer's recurrent state after a
        prefix is not a function of KV blocks, and this engine keeps no per-block state snapshots."""
        if not cfg.cache.enable_prefix_caching:
            return False
        if not self._can_cache_prefixes():
            logger.info("prefix caching is off for %s: its KDA layers' recurrent state cannot be restored "
                        "from cached KV blocks", self.model_cfg.model_type)
            return False
        return True

    def _can_cache_prefixes(self) -> bool:
        return not self.model_cfg.linear_attention_layers()

    # ---- requests -----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise InvalidRequestError if the request can never be served; return its resolved max_tokens.
        Reads only immutable state, so callers may use it while a step runs."""
        return validate_request(prompt_token_ids, params, self.model_cfg.vocab_size, self.max_model_len)

    def check_capacity(self, pending: int = 0) -> None:
        """The queue-full rule: raise EngineOverloadedError (a 503 + Retry-After) when the unfinished
        requests plus `pending` ones not yet added (the Router's) fill running + waiting capacity."""
        sc = self.cfg.scheduler
        if self.scheduler.num_unfinished + pending >= sc.max_waiting + sc.max_num_seqs:
            raise EngineOverloadedError("the engine queue is full; retry later", retry_after_s=1.0)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, *, max_tokens: int | None = None,
                    arrival_time: float | None = None) -> Request:
        """Queue a request. `max_tokens` is what `validate_request` returned for it; a caller that
        validated already (the Router, synchronously, so bad input fails fast) passes it, else this
        validates. `arrival_time` (time.monotonic()): when the request reached the engine's process, if
        it waited there for the loop to add it (`serve.engine_host.Admission`); default now."""
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if max_tokens is None:
            max_tokens = self.validate_request(prompt_token_ids, params)
        self.check_capacity()
        req = Request(request_id, list(prompt_token_ids), params, max_tokens=max_tokens, prompt=prompt)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        self.detoks[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                         params.include_stop_str_in_output, params.skip_special_tokens)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, "abort")
        self.detoks.pop(request_id, None)
        return True

    def set_async_scheduling(self, on: bool) -> bool:
        """Switch async scheduling between runs (in-process A/B); needs an idle engine. Returns the mode
        in effect (off where the executor cannot launch and collect separately)."""
        if self.has_unfinished():
            raise RuntimeError("switch async scheduling only while the engine is idle")
        self.async_scheduling = self.scheduler.async_mode = bool(on) and hasattr(self.executor, "launch")
        return self.async_scheduling

    def set_prefix_caching(self, on: bool) -> bool:
        """Switch prefix caching between runs (in-process A/B) and forget the unheld cached blocks; needs
        an idle engine. Returns the mode in effect (off for hybrid models, see `_prefix_caching`)."""
        if self.has_unfinished():
            raise RuntimeError("switch prefix caching only while the engine is idle")
        self.kv.reset_prefix_cache()
        self.kv.enable_prefix_caching = bool(on) and self._can_cache_prefixes()
        return self.kv.enable_prefix_caching

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        if self.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty and not sched.finished_req_ids:
            return []
        result = self.executor.execute(sched)
        t2 = time.perf_counter()
        deltas = self._update(sched, result)
        self._record(sched, result, schedule_s=t1 - t0, execute_s=t2 - t1, update_s=time.perf_counter() - t2)
        return deltas

    def _step_async(self) -> list[TokenDelta]:
        """Schedule and launch step N+1, then read step N's tokens back and apply them: the host's
        scheduling, input preparation and launches overlap step N on the device, and detokenization /
        stop checks of step N overlap step N+1."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if not sched.is_empty or sched.finished_req_ids:
            sched.share_tokens = True
            launched = (sched, self.executor.launch(sched))
        t2 = time.perf_counter()
        self.last_launch_s = t2 - t0
        prev, self._inflight = self._inflight, launched
        if prev is None:
            self.inflight_started = t2 if launched is not None else None
            return []
        psched, pending = prev
        result = self.executor.collect(pending)
        t3 = time.perf_counter()
        # N+1 was queued behind N, so the device began it when N's tokens came back (or at its launch)
        self.inflight_started = t3 if launched is not None else None
        deltas = self._update(psched, result)
        self._record(psched, result, schedule_s=t1 - t0, execute_s=t3 - t1, update_s=time.perf_counter() - t3)
        return deltas

    @property
    def inflight_shape(self) -> ShapeKey | None:
        """`pacing.shape_key` of the launched, not yet collected step (async scheduling), else None."""
        return shape_key(self._inflight[0]) if self._inflight is not None else None

    def _record(self, sched: SchedulerOutput, result, *, schedule_s: float, execute_s: float,
                update_s: float) -> None:
        """The stats of the step whose results were just applied (`last_stats`, `step_history`)."""
        self.num_preemptions += sched.num_preempted
        self.num_steps += 1
        self.last_stats = StepStats(
            num_tokens=sched.num_tokens,
            num_prefill_tokens=sum(len(s.token_ids) for s in sched.seqs if len(s.token_ids) > 1 or not s.sample),
            num_decode_seqs=sum(1 for s in sched.seqs if len(s.token_ids) == 1 and s.sample),
            num_preempted=sched.num_preempted, schedule_s=schedule_s, execute_s=execute_s, update_s=update_s,
            worker_timings=result.timings if result is not None else {}, finished_at=time.monotonic(),
            shape=shape_key(sched))
        self.step_history.append(self.last_stats)

    def _update(self, sched: SchedulerOutput, result) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        now = time.monotonic()
        failed = result.failed if result is not None else {}
        for s in sched.seqs:
            req = self.requests.get(s.req_id)
            if req is None or req.is_finished:
                continue
            failure = failed.get(s.req_id)
            if failure is not None:
                deltas.append(self._fail_request(req, failure.kind, failure.message))
                continue
            try:
                delta = self._update_one(req, s, result, now)
            except Exception as e:  # noqa: BLE001 - this request's bookkeeping failed, not the engine
                logger.exception("request %s failed while updating", req.request_id)
                delta = self._fail_request(req, "error", f"an internal error occurred ({type(e).__name__})")
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _fail_request(self, req: Request, kind: str, message: str) -> TokenDelta:
        """Finish `req` in error (its blocks and state slot freed); the delta carries the error."""
        self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)
        self.detoks.pop(req.request_id, None)
        error_type = StepOutOfMemoryError.error_type if kind == "oom" else "engine_error"
        return TokenDelta(request_id=req.request_id, new_token_ids=[], finished=True, finish_reason="error",
                          error=message, error_type=error_type, num_prompt_tokens=req.num_prompt_tokens,
                          arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time)

    def _update_one(self, req: Request, s, result, now: float) -> TokenDelta | None:
        """Apply one scheduled sequence's results to its request; the delta to emit, if any."""
        if not self.async_scheduling:
            req.num_computed_tokens += len(s.token_ids)        # (async: advanced when scheduled)
        elif s.sample:
            req.num_inflight -= 1
        self.kv.register(req, s.start_pos + len(s.token_ids))  # its blocks this step filled -> prefix cache
        plp = None
        if s.prompt_logprobs and s.req_id in result.prompt_logprobs:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            req.prompt_logprobs.extend(result.prompt_logprobs[s.req_id])
            if req.num_computed_tokens >= req.num_prompt_tokens:
                req.prompt_logprobs_done = True
                plp = req.prompt_logprobs
        if not s.sample:
            return None
        tok = result.sampled[s.req_id]
        req.output_token_ids.append(tok)
        lp = result.logprobs.get(s.req_id)
        if req.output_logprobs is not None and lp is not None:
            req.output_logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        finish, stop_reason = self._check_stop(req, tok)
        detok = self.detoks[req.request_id]
        delta = TokenDelta(
            request_id=req.request_id, new_token_ids=[tok], new_text=detok.take(finish is not None),
            new_logprobs=[lp] if lp is not None else None, finished=finish is not None,
            finish_reason=finish, stop_reason=stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            prompt_logprobs=plp if len(req.output_token_ids) == 1 else None,
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            first_token_time=now if len(req.output_token_ids) == 1 else None)
        if finish:
            self.scheduler.finish(req, finish, stop_reason)
            self.requests.pop(req.request_id, None)
            self.detoks.pop(req.request_id, None)
        return delta

    def _check_stop(self, req: Request, tok: int) -> tuple[str | None, int | str | None]:
        p = req.params
        n_out = len(req.output_token_ids)
        past_min = n_out >= p.min_tokens
        if past_min and not p.ignore_eos and tok in self.eos:
            return "stop", None
        if past_min and tok in p.stop_token_ids:
            return "stop", tok
        matched = self.detoks[req.request_id].append(tok, check_stop=past_min)
        if matched is not None and past_min:
            return "stop", matched
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None
