"""One TP rank: device, TP group, kernel backend, model + weights, KV-cache tensors, model runner.

Used in-process (`executor.LocalExecutor`, TP=1) or inside a Ray actor (one per GPU; see worker_group.py).
Start-up stages are named methods so failures say where they happened.
"""
from __future__ import annotations

import logging

import torch

from glm_ray import envs, kernels
from glm_ray.config import EngineConfig, ModelConfig
from glm_ray.distributed.parallel_state import enable_collective_timing, init_tensor_parallel
from glm_ray.engine.contract import ModelRunnerOutput, SchedulerOutput
from glm_ray.model import MODEL_CLASSES
from glm_ray.model.loader import init_dummy_weights, load_weights
from glm_ray.quant import get_quant_config
from glm_ray.quant.fp8_proj import Fp8ProjOverlay
from glm_ray.worker.cache import num_blocks_for_budget, state_bytes
from glm_ray.worker.model_runner import (
    ModelRunner,
    graph_max_context,
    graph_reserve_bytes,
    graphs_enabled,
    piecewise_max_tokens,
    profile_activation_bytes,
)

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: EngineConfig, rank: int = 0, init_method: str | None = None):
        self.cfg = cfg
        self.rank = rank
        self.tp = cfg.parallel.tensor_parallel_size
        self.init_method = init_method
        self.runner: ModelRunner | None = None

    # ---- start-up stages ----------------------------------------------------------------------
    def init_device(self) -> None:
        dev = self.cfg.resolved_device()
        if dev == "cuda":
            # NOTE: Ray masks CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES per actor -> our GPU is cuda:0
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        init_tensor_parallel(self.rank, self.tp, self.init_method or "", self.device.type)
        if envs.TIME_COLLECTIVES.get():      # measurement runs only
            enable_collective_timing(self.device.type)
        kernels.init_backend(self.cfg.kernel_backend, self.device.type)
        torch.manual_seed(self.cfg.seed)

    def load_model(self) -> dict:
        dtype = self.cfg.dtype
        if dtype == "auto" and self.device.type == "cpu":
            dtype = "float32"   # NOTE: CPU matmuls are faster in fp32 than bf16 (tiny decode: 4.8 vs 6.6 ms/step)
        self.model_cfg = ModelConfig.from_pretrained(self.cfg.model, dtype)
        cls = MODEL_CLASSES[self.model_cfg.architecture]
        quant = get_quant_config(self.model_cfg)
        if self.cfg.fp8_proj_gemm:
            quant = Fp8ProjOverlay(quant, self.cfg.fp8_proj_min_tokens,
                                   mla_layers=set(self.model_cfg.attention_layers()),
                                   force=envs.FP8_PROJ_FORCE.get())
        with torch.device(self.device):
            self.model = cls(self.model_cfg, quant, self.model_cfg.dtype, tp=self.tp).eval()
        if self.cfg.load_format == "dummy":
            init_dummy_weights(self.model, seed=self.cfg.seed)
        else:
            load_weights(self.model, self.cfg.model, progress=self.rank == 0)
        n = sum(p.numel() for p in self.model.parameters())
        logger.info("rank %d: %s loaded, %s params on this rank", self.rank, self.model_cfg.architecture, f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M")
        return {"params": n}

    def determine_num_blocks(self) -> int:
        cc = self.cfg.cache
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            act = profile_activation_bytes(self.cfg, self.model_cfg, self.model, self.device)
            free, total = torch.cuda.mem_get_info()
            used = total - free                                   # weights + CUDA context + NCCL buffers
            budget = int(total * cc.gpu_memory_utilization - used - act)
            if graphs_enabled(self.cfg, self.device):              # the decode graphs' pool
                max_ctx = graph_max_context(self.cfg, self.model_cfg, self.cfg.scheduler.max_model_len
                                            or self.model_cfg.max_position_embeddings)
                graphs = graph_reserve_bytes(self.cfg, self.model_cfg, self.model, self.device, max_ctx)
                logger.info("rank %d: %.2f GiB kept for the decode CUDA graphs", self.rank, graphs / 2**30)
                budget -= graphs
            if piecewise_max_tokens(self.cfg, self.model, self.device):
                # the piecewise graphs' pool keeps a prefill step's activations outside attention; the
                # eager attentions between the pieces still need theirs: one more step's worth, bounded above
                logger.info("rank %d: %.2f GiB kept for the piecewise prefill graphs", self.rank, act / 2**30)
                budget -= act
            logger.info("rank %d: memory %.1f GiB used after load, %.2f GiB peak activations "
                        "(max_num_batched_tokens step) -> KV budget %.1f GiB", self.rank, used / 2**30,
                        act / 2**30, budget / 2**30)
            if budget <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache: {used / 2**30:.1f} GiB used after "
                                   f"loading, {act / 2**30:.1f} GiB of activations at max_num_batched_tokens="
                                   f"{self.cfg.scheduler.max_num_batched_tokens}, gpu_memory_utilization="
                                   f"{cc.gpu_memory_utilization} of {total / 2**30:.1f} GiB")
        else:
            budget = cc.cpu_kv_cache_bytes
        # the recurrent states of hybrid models (one per running sequence) come out of the same budget
        states = state_bytes(self.model_cfg, self.model_cfg.dtype, self.cfg.scheduler.max_num_seqs, self.tp)
        if states:
            logger.info("rank %d: recurrent states %.1f MiB (%d sequences)", self.rank, states / 2**20,
                        self.cfg.scheduler.max_num_seqs)
        return num_blocks_for_budget(budget - states, self.model_cfg, self.model_cfg.dtype, cc.block_size)

    def init_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.cfg, self.model_cfg, self.model, self.device, num_blocks)

    # ---- per step -----------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute(step)

    def launch(self, step: SchedulerOutput):
        """Async scheduling: the step's forward and sampling launched, tokens not read back (`collect`)."""
        return self.runner.launch(step)

    def collect(self, pending) -> ModelRunnerOutput | None:
        return self.runner.collect(pending)

    def ping(self) -> int:
        return self.rank
