"""Device-resident penalty histories (worker/penalties.py) against the host-list reference (`_penalize`,
itself held to the per-row formula in test_sampler.py): table by table over random steps, and whole
engine runs (preemption, n > 1, chunked prefill, async scheduling) with the runner's tables vs the
reference. Also: a penalized or min_tokens step under async scheduling no longer waits for the previous
step's tokens."""
from __future__ import annotations

import random

import torch

from glm_ray import LLM, SamplingParams
from glm_ray.worker import model_runner
from glm_ray.worker.penalties import PenaltyState
from glm_ray.worker.sampler import SamplingRow, _penalize, sample

V = 40


def test_tables_follow_the_host_lists_over_random_steps():
    """Requests join, sample (their tokens recorded on the device), get preempted (rows kept) and finish
    (rows reused by later ones, more requests than the first capacity): every step's penalized logits
    equal the reference computed from the host lists."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    state = PenaltyState(V, torch.device("cpu"))
    live: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
    n_made = 0
    for _ in range(60):
        while len(live) < rng.randint(1, 12):
            n_made += 1
            p = SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.7]), presence_penalty=rng.choice([0, .5]),
                               frequency_penalty=rng.choice([0, .25, -.2]))
            prompt = [rng.randrange(V) for _ in range(rng.randint(0, 9))]
            out = [rng.randrange(V) for _ in range(rng.randint(0, 3))]     # e.g. resumed after a preemption
            live[f"r{n_made}"] = (p, prompt, out)
        for rid in [r for r in live if rng.random() < 0.15]:
            del live[rid]
            state.release(rid)
        ids = [r for r in live if rng.random() < 0.8]                    # the others: not sampling this step
        rng.shuffle(ids)
        pen = [i for i, r in enumerate(ids) if live[r][0].needs_penalties]
        if not pen:
            continue
        logits = torch.randn(len(ids), V, generator=g)
        rows = [SamplingRow(live[r][0], None, live[r][1], live[r][2], (1,)) for r in ids]
        batch = state.batch(pen, [ids[i] for i in pen], [live[ids[i]][0] for i in pen],
                            [(live[ids[i]][1], live[ids[i]][2]) for i in pen])
        assert torch.equal(batch.apply(logits), _penalize(logits, rows))
        tokens = torch.randint(0, V, (len(ids),), generator=g)
        batch.record(tokens)
        for i, r in enumerate(ids):
            live[r][2].append(int(tokens[i]))
    assert n_made > state.capacity                                       # rows were reused


def test_sample_records_the_tokens_it_returns():
    """`sample` with a PenaltyBatch: the same tokens as with the host lists, and the sampled token (forced
    ones included) is counted for the next step."""
    state = PenaltyState(V, torch.device("cpu"))
    p = SamplingParams(temperature=0, frequency_penalty=2.0, forced_token_ids=[3])
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5] = 1.0, 0.5
    for step, want in enumerate([3, 5]):           # step 0 forced to 3; step 1: 3 is penalized below 5
        rows = [SamplingRow(p, None, [], [3] * step, (1,), step)]
        batch = state.batch([0], ["a"], [p], [([], [3] * step)])
        tok, _ = sample(logits, rows, None, batch)
        assert int(tok[0]) == want and int(sample(logits, rows)[0][0]) == want
    assert state.counts[state.row_of["a"]].tolist() == [1.0 if t in (3, 5) else 0.0 for t in range(V)]


def _generate(path, params, prompts, *, reference: bool, monkeypatch, **kw):
    """An engine run; `reference`: the runner samples with the host lists (no PenaltyBatch)."""
    with monkeypatch.context() as m:
        if reference:
            m.setattr(model_runner, "sample", lambda logits, rows, bitmask, penalties: sample(logits, rows, bitmask))
        llm = LLM(path, dtype="float32", **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], llm


def test_engine_tables_equal_host_lists(oracle_dir, monkeypatch):
    """Greedy and seeded penalized requests, n = 2, min_tokens, chunked prefill and preemptions, sync and
    async: the same tokens with the device tables as with the host-list reference."""
    from glm_ray.config import ModelConfig
    from glm_ray.worker.cache import kv_bytes_per_token
    prompts = [torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 23, 3, 40, 11, 17)]
    params = [SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.9, seed=5, frequency_penalty=0.8, n=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, presence_penalty=1.2, frequency_penalty=0.4, min_tokens=8),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=28, temperature=0.7, seed=9, repetition_penalty=0.8,
                             frequency_penalty=-0.5, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, frequency_penalty=1.0, ignore_eos=True)]
    per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(oracle_dir, "float32"), torch.float32)
    kw = dict(kv_cache_memory_bytes=per_tok * 16 * 9, max_num_batched_tokens=13)
    ref, _ = _generate(oracle_dir, params, prompts, reference=True, monkeypatch=monkeypatch, async_scheduling=False,
                       **kw)
    for async_scheduling in (False, True):
        got, llm = _generate(oracle_dir, params, prompts, reference=False, monkeypatch=monkeypatch,
                             async_scheduling=async_scheduling, **kw)
        assert got == ref, async_scheduling
        assert llm.engine.num_preemptions > 0
        runner = llm.engine.executor.worker.runner
        # rows live as long as the runner's request state (the last finish reaches it with a next step)
        assert runner.penalties.row_of and set(runner.penalties.row_of) <= set(runner.requests)
        assert len(runner.penalties.row_of) < 5


def test_penalized_step_does_not_wait_for_the_previous_one(oracle_dir):
    """Async scheduling: launching a step whose rows use penalties and min_tokens leaves the previous
    launch uncollected (they used to collect it first, to read the host's outputs)."""
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, async_scheduling=True)
    eng = llm.engine
    runner = eng.executor.worker.runner
    eng.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.4,
                                                             presence_penalty=0.3, min_tokens=10))
    launch, collect = runner.launch, runner.collect
    inside: list[bool] = []                                              # per collect: from inside a launch?
    depth = [0]

    def launch_spy(step):
        depth[0] += 1
        try:
            return launch(step)
        finally:
            depth[0] -= 1

    def collect_spy(pending):
        inside.append(depth[0] > 0)
        return collect(pending)
    runner.launch, runner.collect = launch_spy, collect_spy
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert len(inside) >= 12 and not any(inside)
    assert sum(len(d.new_token_ids) for d in outs) == 12
