"""The decode-graph path on the CPU: the static buffers, batch padding (scratch block and state row),
capacity buckets and the dense/sparse DSA choice of `worker/cuda_graph.py`, run without capture, must
decode exactly what the eager path decodes — same greedy tokens, logprobs equal to fp32 round-off —
while requests of different lengths join and finish and contexts cross index_topk. (Capture and replay
themselves are GPU tests: tests/gpu/test_cuda_graphs.py.)"""
from __future__ import annotations

import pytest
import torch

from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.llm import LLM
from glm_ray.worker import model_runner
from glm_ray.worker.cuda_graph import batch_buckets, context_buckets


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(200) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200]
    assert context_buckets(131072, 2048) == [2048, 8192, 32768, 131072]
    assert context_buckets(1000, 2048) == [1000]


def _run(path, prompts, graphs: bool, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(model_runner, "graphs_enabled", lambda cfg, device: graphs)
        llm = LLM(path, dtype="float32", max_num_seqs=6, **kw)
        assert (llm.engine.executor.worker.runner.graphs is not None) == graphs
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True)
                                      for n in (14, 3, 9, 14, 6)], use_tqdm=False)
        steps = llm.engine.executor.worker.runner.num_graph_steps
        assert (steps >= 10) if graphs else (steps == 0)        # decodes took the static path
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("model", ["glm5", "glm53"])
def test_static_decode_path_equals_eager(model, oracle_dir, tmp_path_factory, monkeypatch):
    if model == "glm5":
        # index_topk 8: decodes cross it. 16 indexer heads: with 4, ReLU zeros make exact score ties
        # common, and top-k breaks ties by position within the padded row, whose width differs here
        path = oracle_dir
    else:
        from tests.flash_tiny import available, write_flash_tiny  # noqa: PLC0415
        if not available():
            pytest.skip("transformers without glm5_next")
        path = write_flash_tiny(tmp_path_factory.mktemp("g53") / "tiny")
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 200, (n,), generator=g).tolist()} for n in (3, 11, 5, 20, 7)]
    eager = _run(path, prompts, False, monkeypatch)
    static = _run(path, prompts, True, monkeypatch)
    for (te, le), (ts, ls) in zip(eager, static):
        assert te == ts
        for a, b in zip(le, ls):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t] - b[t]) < 1e-4
