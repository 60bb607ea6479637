"""Executors: what runs the engine's steps on the model's ranks (the `engine.contract.Executor` protocol).

`LocalExecutor` holds the one rank in the calling process (TP=1: the offline LLM, tests, CPU);
`worker_group.RayWorkerGroup` holds one Ray actor per rank. `make_executor` picks one.
"""
from __future__ import annotations

from glm_ray.config import EngineConfig
from glm_ray.engine.contract import ModelRunnerOutput, SchedulerOutput
from glm_ray.worker.worker import Worker


class LocalExecutor:
    """TP=1 in the calling process (offline LLM, tests, the CPU default)."""

    def __init__(self, cfg: EngineConfig, worker: Worker | None = None, num_blocks: int | None = None):
        """Builds its Worker through every start-up stage, or takes one that has its cache already
        (`worker`, `num_blocks`: the engine host in rank 0's actor)."""
        if cfg.parallel.tensor_parallel_size != 1:
            raise ValueError("LocalExecutor runs TP=1 only; use the Ray worker group for tensor parallelism")
        if worker is None:
            worker = Worker(cfg)
            worker.init_device()
            worker.load_model()
            num_blocks = worker.determine_num_blocks()
            worker.init_cache(num_blocks)
        self.worker, self.num_blocks, self.model_cfg = worker, num_blocks, worker.model_cfg

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(step)

    # async scheduling (the engine launches step N+1 before it collects step N): in-process ranks only
    def launch(self, step: SchedulerOutput):
        return self.worker.launch(step)

    def collect(self, pending) -> ModelRunnerOutput:
        return self.worker.collect(pending)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def make_executor(cfg: EngineConfig, executor: str = "auto"):
    """"local" (in-process, TP=1) or "ray" (one worker actor per rank); "auto" = local iff TP=1."""
    if executor == "local" or (executor == "auto" and cfg.parallel.tensor_parallel_size == 1):
        return LocalExecutor(cfg)
    from glm_ray.worker.worker_group import RayWorkerGroup  # noqa: PLC0415 - deferred: ray, only for TP > 1
    return RayWorkerGroup(cfg)
