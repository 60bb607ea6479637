"""Offline API in the shape vLLM users know (above the engine: it builds the executor too):

    from glm_ray import LLM, SamplingParams
    llm = LLM("/path/to/model")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text
"""
from __future__ import annotations

import itertools
import logging

from tqdm import tqdm

from glm_ray.config import make_engine_config
from glm_ray.engine.engine_core import EngineCore
from glm_ray.engine.outputs import CompletionOutput, RequestOutput
from glm_ray.engine.sampling_params import SamplingParams, choice_seed
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.model.tiny import resolve_model
from glm_ray.worker.executor import make_executor

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, executor: str = "auto", **kwargs):
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
                max_tokens = self.engine.validate_request(ids, sub)   # a bad prompt fails the call before anything runs
                subs.append((f"{rid}-{i}", text, ids, sub, max_tokens))
                out.outputs.append(CompletionOutput(i, "", [], [] if p.logprobs is not None else None, None))
        added = []
        try:
            for sub_id, text, ids, sub, max_tokens in subs:
                self.engine.add_request(sub_id, ids, sub, text, max_tokens=max_tokens)
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
