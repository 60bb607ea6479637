"""Model arguments beyond a checkpoint directory: bundled config names / config.json files with
dummy weights (full-size shapes without a checkpoint), and the synthetic tokenizer they get."""
from __future__ import annotations

import json

import pytest

from glm_ray import LLM, SamplingParams
from glm_ray.engine.tokenizer import synthetic_tokenizer
from glm_ray.model.tiny import resolve_model
from glm_ray.weights import WeightError


def test_bundled_config_with_dummy_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path))
    path = resolve_model("glm5-tiny")
    assert json.load(open(f"{path}/config.json"))["model_type"] == "glm_moe_dsa"
    llm = LLM("glm5-tiny", load_format="dummy", dtype="float32", kv_cache_memory_bytes=8 << 20)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert out.text.split() == [f"<{t}>" for t in out.token_ids]       # synthetic tokenizer: one token per id
    with pytest.raises(WeightError, match="--load-format dummy"):
        LLM("glm5-tiny", dtype="float32", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(FileNotFoundError, match="bundled config"):
        resolve_model("no-such-model")


def test_synthetic_tokenizer_round_trip():
    tok = synthetic_tokenizer(154880)
    ids = [0, 5, 154879, 77]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
