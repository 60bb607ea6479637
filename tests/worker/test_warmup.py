"""Start-up kernel warm-up (worker/warmup.py), forced on for the CPU: the three eager steps run — a
prompt past index_topk, a chunk after it, a mixed step with that sequence decoding — on the first cache
blocks and state rows, and leave nothing behind: the engine's outputs afterwards equal a cold engine's
(greedy tokens and logprobs, GLM-5 with its DSA indexer and GLM-5.3-Flash with its recurrent KDA state)."""
import pytest

from glm_ray import LLM, SamplingParams
from glm_ray.worker import warmup
from tests import flash_tiny


def test_plan_covers_the_eager_paths():
    plan = warmup.warmup_plan(index_topk=64, block_size=16, max_len=4096, num_blocks=100)
    (q1, c1, t1), (q2, c2, t2), (q3, c3, t3), (q4, c4, t4), (q5, c5, t5) = plan
    assert q1 == c1 == [80] and c1[0] > 64                             # a fresh prompt past index_topk
    assert q2 == [16] and c2 == [96] and t2 == t1                      # a chunk after a cached prefix
    assert q3 == [1, 16] and c3 == [97, 16] and t3[0] == t1[0]         # decode past index_topk + a prompt
    assert len(t1[0]) * 16 >= 97 and not set(t3[0]) & set(t3[1])        # its blocks hold it; B's are its own
    assert q4 == c4 == [128] and q5 == c5 == [256]                     # mid-size prompts (8, 16 blocks)
    a, b, c = set(t1[0]), set(t3[1]), set(t5[0])                       # sequences A, B, C: own blocks
    assert not (a & b or a & c or b & c) and set(t4[0]) <= c and len(c) * 16 >= 256 and max(c) < 100
    assert len(warmup.warmup_plan(64, 16, 4096, num_blocks=12)) == 3    # no room for the mid-size prompts
    assert warmup.warmup_plan(64, 16, 4096, num_blocks=5) == []        # cache too small: skipped
    assert warmup.warmup_plan(None, 16, 4096, 100)[0][0] == [32]       # no indexer: two blocks


def test_absorbed_chunks_warm_both_forms_and_the_wide_grid():
    plan = warmup.warmup_plan(index_topk=64, block_size=16, max_len=4096, num_blocks=100)
    assert warmup.warmup_steps(plan, 0, 16, 4096, 100) == [(s, 0) for s in plan]
    steps = warmup.warmup_steps(plan, 256, 16, 4096, 100)
    assert [a for _, a in steps] == [256, 256, 0, 256, 256, 256, 256]
    assert steps[1][0] == steps[2][0] == plan[1]                         # the one-block chunk, absorbed and naive
    (q, c, t), _ = steps[3]
    assert q == [80] and c == [160] and t == [list(range(10))]          # 80 rows (all of A's prompt) over 80 cached
    assert len(warmup.warmup_steps(plan, 256, 16, 100, 100)) == 6        # max_len too short for the wide chunk


def _outputs(path, monkeypatch, mode):
    monkeypatch.setenv("GLM_RAY_KERNEL_WARMUP", mode)
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 90 + 5 for i in range(n)]} for n in (5, 30, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, logprobs=2), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("model", ["glm5", "glm53"])
def test_warm_up_leaves_outputs_unchanged(model, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GLM_RAY_ABSORB_PREFILL_TOKENS", "256")            # as the cuda backend
    if model == "glm53":
        if not flash_tiny.available():
            pytest.skip("transformers without glm5_next")
        path = flash_tiny.write_flash_tiny(tmp_path / "glm53")
    else:
        path = tiny_dir
    ran = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    cold = _outputs(path, monkeypatch, "off")
    assert ran == []
    warm = _outputs(path, monkeypatch, "on")
    # the five planned steps ran; where short chunks are absorbed (GLM-5), the cached-prefix chunk in both MLA
    # forms and a wide absorbed chunk too
    assert ran == [7 if model == "glm5" else 5]
    for (ta, la), (tb, lb) in zip(cold, warm):
        assert ta == tb
        for x, y in zip(la, lb):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-5
