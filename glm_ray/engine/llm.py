"""Offline API in the shape vLLM users know:

    from glm_ray import LLM, SamplingParams
    llm = LLM("/path/to/model")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text
"""
from __future__ import annotations

import itertools
import logging

from tqdm import tqdm

from glm_ray.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from glm_ray.engine.engine_core import EngineCore
from glm_ray.engine.outputs import CompletionOutput, RequestOutput
from glm_ray.engine.sampling_params import SamplingParams, choice_seed
from glm_ray.engine.tokenizer import load_tokenizer  # re-exported: callers import it from here

logger = logging.getLogger(__name__)


def make_engine_config(model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", device: str = "auto",
                       load_format: str = "auto", kernel_backend: str = "auto", mla_mode: str = "auto",
                       max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                       block_size: int = 16, kv_cache_memory_bytes: int | None = None,
                       gpu_memory_utilization: float = 0.9, max_waiting: int = 4096, seed: int = 0,
                       fp8_proj_gemm: bool | None = None, fp8_proj_min_tokens: int = 512) -> EngineConfig:
    if fp8_proj_gemm is None:       # the flag's third spelling: GLM_RAY_FP8_PROJ_GEMM=1
        import os
        fp8_proj_gemm = os.environ.get("GLM_RAY_FP8_PROJ_GEMM", "").strip().lower() in ("1", "true", "yes", "on")
    return EngineConfig(
        model=model, dtype=dtype, device=device, load_format=load_format, kernel_backend=kernel_backend,
        mla_mode=mla_mode, seed=seed, fp8_proj_gemm=fp8_proj_gemm, fp8_proj_min_tokens=fp8_proj_min_tokens,
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                          gpu_memory_utilization=gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, max_waiting=max_waiting),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size))


def make_executor(cfg: EngineConfig, executor: str = "auto"):
    """"local" (in-process, TP=1) or "ray" (one worker actor per rank); "auto" = local iff TP=1."""
    if executor == "local" or (executor == "auto" and cfg.parallel.tensor_parallel_size == 1):
        from glm_ray.worker.worker import LocalExecutor
        return LocalExecutor(cfg)
    from glm_ray.worker.worker_group import RayWorkerGroup
    return RayWorkerGroup(cfg)


class LLM:
    def __init__(self, model: str | None = None, executor: str = "auto", **kwargs):
        from glm_ray.model.tiny import resolve_model
        model = resolve_model(model)
        self.config = make_engine_config(model, **kwargs)
        self.tokenizer = load_tokenizer(model)
        self.engine = EngineCore(self.config, make_executor(self.config, executor), self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def _to_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        return None, [int(t) for t in prompt]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []
        subs = []                      # (engine request id, prompt text, ids, params): validated before any is added
        for prompt, p in zip(prompts, params):
            text, ids = self._to_ids(prompt)
            rid = str(next(self._ids))
            out = RequestOutput(rid, text, ids)
            results[rid] = out
            order.append(rid)
            for i in range(p.n):
                sub = p.clone(n=1, seed=choice_seed(p.seed, i))
                self.engine.validate_request(ids, sub)     # a bad prompt fails the call before anything runs
                subs.append((f"{rid}-{i}", text, ids, sub))
                out.outputs.append(CompletionOutput(i, "", [], [] if p.logprobs is not None else None, None))
        added = []
        try:
            for sub_id, text, ids, sub in subs:
                self.engine.add_request(sub_id, ids, sub, text)
                added.append(sub_id)
        except BaseException:
            for sub_id in added:                   # leave the engine as it was: the LLM stays usable
                self.engine.abort(sub_id)
            raise
        total = sum(p.n for p in params)
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for d in self.engine.step():
                rid, i = d.request_id.rsplit("-", 1)
                if rid not in results:                 # pragma: no cover - not this call's request
                    continue
                res, co = results[rid], results[rid].outputs[int(i)]
                co.token_ids += d.new_token_ids
                co.text += d.new_text
                if co.logprobs is not None and d.new_logprobs:
                    co.logprobs += d.new_logprobs
                if d.prompt_logprobs is not None:
                    res.prompt_logprobs = d.prompt_logprobs
                if d.finished:
                    co.finish_reason, co.stop_reason = d.finish_reason, d.stop_reason
                    if d.finish_reason == "error":
                        logger.error("request %s failed: %s", d.request_id, d.error)
                    bar.update(1)
        bar.close()
        for r in results.values():
            r.finished = True
        return [results[r] for r in order]
