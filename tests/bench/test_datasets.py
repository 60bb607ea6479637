"""The benchmark workloads: sglang's length law (random dataset, fixed seed), the ShareGPT fixture read
and filtered by sglang's rules, generated-shared-prefix groups sharing an identical prefix."""
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from glm_ray.bench import datasets as D

SHAREGPT = Path(__file__).parent / "data" / "sharegpt_small.json"


@pytest.mark.parametrize("length, ratio, lo", [(32, 0.0, 1), (32, 0.5, 16), (100, 0.25, 25), (8, 0.99, 7),
                                               (1024, 1.0, 1024), (7, 0.1, 1)])
def test_random_lengths_follow_sglangs_law(length, ratio, lo):
    """sglang: uniform integers in [max(int(L * r), 1), L] for input and output lengths."""
    rows = D.random_rows(np.random.default_rng(1), 4000, input_len=length, output_len=length // 2 or 1,
                         range_ratio=ratio, vocab_size=1000)
    ins = [r.prompt_len for r in rows]
    outs = [r.output_len for r in rows]
    assert min(ins) == lo and max(ins) == length                      # 4000 draws reach both ends
    out_len = length // 2 or 1
    assert min(outs) == max(int(out_len * ratio), 1) and max(outs) == out_len
    if lo < length:                                                   # uniform: every value drawn, about evenly
        counts = np.bincount(ins, minlength=length + 1)[lo:]
        assert (counts > 0).all() and counts.max() < 3 * counts.min() + 20
    assert all(0 <= t < 1000 for r in rows[:50] for t in r.prompt_ids)


def test_random_rows_are_seeded_and_prefix_is_shared():
    a = D.random_rows(np.random.default_rng([1, 4, 0]), 8, input_len=32, output_len=8, range_ratio=0.0, vocab_size=500)
    b = D.random_rows(np.random.default_rng([1, 4, 0]), 8, input_len=32, output_len=8, range_ratio=0.0, vocab_size=500)
    c = D.random_rows(np.random.default_rng([2, 4, 0]), 8, input_len=32, output_len=8, range_ratio=0.0, vocab_size=500)
    assert a == b and a != c
    rows = D.random_rows(np.random.default_rng(0), 5, input_len=10, output_len=4, range_ratio=1.0,
                         vocab_size=500, prefix_len=6)
    assert {r.prompt_ids[:6] for r in rows} == {rows[0].prompt_ids[:6]} and {r.prompt_len for r in rows} == {16}
    assert len({r.prompt_ids[6:] for r in rows}) == 5


def test_generated_shared_prefix_groups_share_exactly_their_prefix():
    g, p, sys_len, q_len = 4, 5, 48, 8
    rows = D.shared_prefix_rows(np.random.default_rng(3), num_groups=g, prompts_per_group=p,
                                system_prompt_len=sys_len, question_len=q_len, output_len=6, vocab_size=1000)
    assert len(rows) == g * p and {r.prompt_len for r in rows} == {sys_len + q_len} and {r.output_len for r in rows} == {6}
    groups = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r.prompt_ids)
    assert sorted(groups) == list(range(g)) and all(len(v) == p for v in groups.values())
    prefixes = {k: {ids[:sys_len] for ids in v} for k, v in groups.items()}
    assert all(len(v) == 1 for v in prefixes.values())                   # one identical prefix per group
    assert len({next(iter(v)) for v in prefixes.values()}) == g          # and different across groups
    for v in groups.values():                                            # the group's common prefix ends there
        common = 0
        while all(ids[common] == v[0][common] for ids in v):
            common += 1
        assert common == sys_len
    assert [r.group for r in rows] != sorted(r.group for r in rows)      # shuffled, as sglang does


def test_generated_shared_prefix_range_ratio():
    rows = D.shared_prefix_rows(np.random.default_rng(0), num_groups=50, prompts_per_group=4, system_prompt_len=20,
                                question_len=10, output_len=8, vocab_size=1000, range_ratio=0.5)
    assert {r.output_len for r in rows} <= set(range(4, 9)) and len({r.output_len for r in rows}) > 1
    assert all(15 <= r.prompt_len <= 30 for r in rows)


def test_sharegpt_fixture_is_read_like_sglang():
    pairs = D.load_sharegpt(SHAREGPT)
    data = json.loads(SHAREGPT.read_text())
    assert len(data) == 12 and len(pairs) == 10                          # one-turn and empty entries dropped
    assert pairs[0] == ("What is the capital of France?",
                        "The capital of France is Paris, which is also its largest city.")
    assert pairs[1][0] == "Write a haiku about autumn leaves."            # the first two turns only
    assert ("How many legs does a spider have?", "A spider has eight legs.") in pairs   # the "conversation" key


def _word_tokenizer(seen):
    async def tokenize(texts, add_special_tokens):
        seen.extend(texts)
        return [([1] if add_special_tokens else []) + [len(w) for w in t.split()] for t in texts]
    return tokenize


def test_sharegpt_rows_filter_limit_and_lengths():
    pairs = D.load_sharegpt(SHAREGPT)
    seen = []
    rows = asyncio.run(D.sharegpt_rows(pairs, 100, np.random.default_rng(1), _word_tokenizer(seen), batch=4))
    # "Thanks!" -> "Welcome." has a 1-token output: pruned (sglang: prompt or output < 2 tokens)
    assert len(rows) == 9 and "Thanks!" not in {r.text for r in rows}
    for r in rows:
        reply = dict(pairs)[r.text]
        assert r.prompt_ids == tuple([1] + [len(w) for w in r.text.split()]) and r.output_len == len(reply.split())
    again = asyncio.run(D.sharegpt_rows(pairs, 100, np.random.default_rng(1), _word_tokenizer([])))
    assert [r.text for r in again] == [r.text for r in rows]              # seeded shuffle
    seen.clear()
    rows = asyncio.run(D.sharegpt_rows(pairs, 2, np.random.default_rng(1), _word_tokenizer(seen), batch=4))
    assert len(rows) == 2 and len(seen) == 8                              # stops after the batch that filled n
    rows = asyncio.run(D.sharegpt_rows(pairs, 100, np.random.default_rng(1), _word_tokenizer([]),
                                       fixed_output_len=6, context_len=12))
    assert rows and all(r.output_len == 6 and r.prompt_len + 6 <= 12 for r in rows)
    assert "Thanks!" in {r.text for r in rows}                            # a fixed output length keeps it
    with pytest.raises(D.DatasetError, match=">= 4"):
        asyncio.run(D.sharegpt_rows(pairs, 1, np.random.default_rng(1), _word_tokenizer([]), fixed_output_len=3))


@pytest.mark.parametrize("text, message", [("not json", "not JSON"), ('{"a": 1}', "JSON list"),
                                           ('[{"conversations": [{"value": "hi"}]}]', "at least two turns")])
def test_bad_sharegpt_files(tmp_path, text, message):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(D.DatasetError, match=message):
        D.load_sharegpt(p)
    with pytest.raises(D.DatasetError, match="cannot read"):
        D.load_sharegpt(tmp_path / "missing.json")
