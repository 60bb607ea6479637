"""Tensor parallelism over Ray: one actor per GPU (one CPU slot each on CPU), each holding a shard.

Placement: inside a Serve replica the actors go into the replica's placement group (bundle 0 is the
Router replica, bundles 1..N one device each, STRICT_PACK); outside Serve (offline `LLM` with TP>1)
the group reserves its own placement group. Ranks are ordered by bundle index; rank 0 publishes the
rendezvous address and every rank joins torch.distributed (NCCL on GPUs, gloo on CPU). Collectives
never go over Ray — Ray only carries the per-step `SchedulerOutput` in and rank 0's sampled tokens out.

Per-step orchestration: on GPUs a Ray Compiled Graph (one `execute` node per rank, compiled once;
~1.0 ms per step on H200 against ~2.4 ms for plain actor calls); on CPU plain actor calls (the graph's
channel polling competes with the model for cores). `GLM_RAY_ORCHESTRATION=compiled|actor` overrides;
plain calls are also the fallback where compiled graphs are unavailable.
"""
from __future__ import annotations

import logging
import os
import socket
import time

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from glm_ray import envs
from glm_ray.config import EngineConfig
from glm_ray.engine.contract import SchedulerOutput

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankActor:
    """Holds one `Worker` (one TP rank): the body of `WorkerActor` and of the engine host
    (serve/engine_host.py), which is rank 0 with the engine loop."""

    def __init__(self, cfg: EngineConfig, rank: int):
        logging.basicConfig(level=logging.INFO)
        self.cfg, self.rank = cfg, rank
        self.worker = None
        if cfg.resolved_device() == "cpu":
            # NOTE: leave one core to the Router / ingress / proxy processes: on 2 cores, 1 thread per rank
            # served tiny-model decode at C=4 with 14.4 ms ITL vs 23.6 ms with 2 threads (C=1 unchanged).
            n = envs.CPU_THREADS.get()
            torch.set_num_threads(n or max(1, ((os.cpu_count() or 2) - 1) // cfg.parallel.tensor_parallel_size))

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, _free_port()

    def init(self, init_method: str) -> None:
        from glm_ray.worker.worker import Worker  # noqa: PLC0415 - the model stack loads in the actor, not the Router
        self.worker = Worker(self.cfg, rank=self.rank, init_method=init_method)
        self.worker.init_device()

    def load_model(self) -> dict:
        return self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def execute(self, step: SchedulerOutput):
        if self.worker.device.type == "cuda":
            torch.cuda.set_device(self.worker.device)   # compiled graphs run us on a background thread
        return self.worker.execute(step)

    def ping(self) -> int:
        return self.rank

    def model_config(self):
        return self.worker.model_cfg

    def follow(self) -> None:
        """Ranks 1..N-1 when the engine loop lives in rank 0: run the steps rank 0 broadcasts over
        torch.distributed until it sends the stop (worker/step_channel.py)."""
        from glm_ray.worker.step_channel import StepChannel, follow  # noqa: PLC0415 - engine-host mode only
        if self.worker.device.type == "cuda":
            torch.cuda.set_device(self.worker.device)
        follow(self.worker, StepChannel())


WorkerActor = ray.remote(RankActor)


def merge_rank_outputs(outputs: list):
    """Rank 0's output, plus every request another rank reported as failed (ranks run the same
    forward, so a failing forward normally fails on all of them; rank 0 alone samples)."""
    out = outputs[0]
    for other in outputs[1:]:
        if other is not None and other.failed:
            for rid, failure in other.failed.items():
                out.failed.setdefault(rid, failure)
                out.sampled.pop(rid, None)
    return out


class RayWorkerGroup:
    def __init__(self, cfg: EngineConfig, placement: PlacementGroup | None = None, first_bundle: int | None = None,
                 name_prefix: str | None = None, rank0_cls=None):
        """rank0_cls: a Ray actor class (a `RankActor`) for rank 0 — the engine host, which then drives
        the other ranks itself (no compiled graph; ranks 1..N-1 run `follow`)."""
        self.cfg = cfg
        tp = cfg.parallel.tensor_parallel_size
        gpu = cfg.resolved_device() == "cuda"
        self._own_pg = None
        if placement is None:
            placement = ray.util.get_current_placement_group()
            if placement is not None:
                first_bundle = 1 if first_bundle is None else first_bundle   # bundle 0 = the Serve replica
        if placement is None:
            bundle = {"GPU": cfg.parallel.gpus_per_rank, "CPU": 1} if gpu else {"CPU": 1}
            self._own_pg = placement = placement_group([bundle] * tp, strategy="STRICT_PACK")
            ray.get(placement.ready(), timeout=600)
            first_bundle = 0
        env = {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TOKENIZERS_PARALLELISM": "false",
               **envs.forwarded()}   # our knobs reach every rank
        if not gpu:
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        opts = dict(num_gpus=cfg.parallel.gpus_per_rank if gpu else 0, num_cpus=0 if gpu else 1, runtime_env={"env_vars": env})
        def named(r):
            return {"name": f"{name_prefix}:rank{r}"} if name_prefix else {}
        if rank0_cls is not None:
            opts["max_concurrency"] = 8          # the host's calls run beside its loop; followers answer pings
        self.hosted = rank0_cls is not None
        self.actors = [
            (rank0_cls if (r == 0 and rank0_cls is not None) else WorkerActor).options(
                **opts, **named(r), scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=first_bundle + r)).remote(cfg, r)
            for r in range(tp)]
        t0 = time.perf_counter()
        ip, port = ray.get(self.actors[0].node_address.remote())
        init_method = f"tcp://{ip}:{port}"
        ray.get([a.init.remote(init_method) for a in self.actors])
        ray.get([a.load_model.remote() for a in self.actors])
        self.num_blocks = min(ray.get([a.determine_num_blocks.remote() for a in self.actors]))
        ray.get([a.init_cache.remote(self.num_blocks) for a in self.actors])
        self.model_cfg = ray.get(self.actors[0].model_config.remote())
        logger.info("worker group: %d rank(s) ready in %.1fs (rendezvous %s)", tp, time.perf_counter() - t0, init_method)
        self._dag = None
        # NOTE: compiled graphs poll their channels; on a CPU box that polling competes with the model's
        # threads (measured on 2 cores: 21.5 ms vs 12.3 ms per tiny decode step), so "auto" = compiled
        # on GPUs (1.0 vs 2.4 ms orchestration per step on H200) and plain actor calls on CPU.
        mode = envs.ORCHESTRATION.get()
        self._followers = []
        if self.hosted:                           # rank 0 drives the others over torch.distributed
            self._followers = [a.follow.remote() for a in self.actors[1:]]
        elif mode == "compiled" or (mode == "auto" and gpu):
            self._dag = self._compile()

    def _compile(self):
        try:
            from ray.dag import InputNode, MultiOutputNode  # noqa: PLC0415 - compiled graphs only; falls back
            with InputNode() as step:
                dag = MultiOutputNode([a.execute.bind(step) for a in self.actors])
            compiled = dag.experimental_compile(_submit_timeout=600)
            ray.get(compiled.execute(SchedulerOutput()))   # warm-up: an empty step
            logger.info("per-step orchestration: Ray Compiled Graph")
            return compiled
        except Exception as e:  # noqa: BLE001 - older Ray, unsupported platform: plain actor calls still work
            logger.warning("compiled graph unavailable (%s: %s); using plain actor calls", type(e).__name__, e)
            return None

    @property
    def orchestration(self) -> str:
        if self.hosted:
            return "engine_in_rank0"
        return "compiled_graph" if self._dag is not None else "actor_calls"

    def execute(self, step: SchedulerOutput):
        if self._dag is not None:
            return merge_rank_outputs(ray.get(self._dag.execute(step)))
        return merge_rank_outputs(ray.get([a.execute.remote(step) for a in self.actors]))

    def check_health(self) -> None:
        """Run an empty step on every rank; raises when any rank is gone.

        NOTE: callers serialize this with `execute` (the Router runs both on its engine thread):
        an actor inside a compiled graph must not take interleaved calls.
        """
        self.execute(SchedulerOutput())

    def shutdown(self) -> None:
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001 - best-effort teardown at shutdown; the actors are killed next
                pass
            self._dag = None
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None
