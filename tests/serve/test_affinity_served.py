"""Two Router replicas behind the prefix-affinity request router, on the session's Ray cluster (the
"affinity" app of tests/conftest.py: two CPU replicas of the tiny model, each with its own engine and KV
cache): the second turn of a conversation lands on the replica that served its first turn.

Where a request ran is read from the replicas themselves, not from the router: each replica's engine host
actor (`glm-ray-worker:affinity:<replica>:rank0`) reports its prefix-cache counters, and requests run one
at a time, so the replica whose looked-up prompt tokens rose by the request's `prompt_tokens` served it.
Every conversation has its own system prompt, so a turn-2 prompt finds cached blocks only on its turn-1
replica: `usage.prompt_tokens_details.cached_tokens` > 0 is the engine's own confirmation, and it must
equal that replica's hit counter's rise."""
from __future__ import annotations

import random

import pytest
from openai import OpenAI

CONVERSATIONS = 4
BLOCK = 16                                   # the app's KV block size (ServeArgs default)


@pytest.fixture(scope="module")
def hosts(serve_cluster):
    """{replica id: its engine host actor} of the affinity app."""
    import ray
    ray.init(address=serve_cluster.gcs_address, log_to_driver=False)
    try:
        found = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            name = a["name"]
            if name.startswith("glm-ray-worker:affinity:") and name.endswith(":rank0"):
                found[name.split(":")[2]] = ray.get_actor(name, namespace=a["namespace"])
        assert len(found) == 2, f"expected the two Router replicas' engine hosts, got {sorted(found)}"
        yield found
    finally:
        ray.shutdown()


def _counters(hosts) -> dict[str, tuple[int, int]]:
    import ray
    stats = ray.get([h.stats.remote() for h in hosts.values()])
    return {r: (s["prefix_cache"]["queries"], s["prefix_cache"]["hits"]) for r, s in zip(hosts, stats)}


def _system_prompt(i: int) -> str:
    rng = random.Random(1000 + i)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda", "theta", "zeta"]
    return f"You are assistant number {i}. " + " ".join(rng.choice(words) for _ in range(60))


def test_second_turns_land_on_the_first_turns_replica(serve_cluster, hosts):
    app = serve_cluster.apps["affinity"]
    client = OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0, timeout=120)

    def chat(messages):
        before = _counters(hosts)
        r = client.chat.completions.create(model=app.model, messages=messages, max_tokens=8, temperature=0)
        after = _counters(hosts)
        moved = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in hosts
                 if after[k] != before[k]}
        assert len(moved) == 1, f"one request, one replica: {moved}"
        (replica, (queried, hit)), = moved.items()
        usage = r.usage
        assert queried == usage.prompt_tokens, (queried, usage)
        assert hit == usage.prompt_tokens_details.cached_tokens, (hit, usage)
        msg = r.choices[0].message
        return replica, usage, (msg.content or getattr(msg, "reasoning_content", None) or "ok")

    convs = []
    for i in range(CONVERSATIONS):                        # every first turn, then every second turn
        messages = [{"role": "system", "content": _system_prompt(i)},
                    {"role": "user", "content": f"Question {i}: what comes next?"}]
        replica, usage, answer = chat(messages)
        assert usage.prompt_tokens_details.cached_tokens == 0        # a new prefix: nothing cached anywhere
        convs.append((messages, replica, usage, answer))
    first = [c[1] for c in convs]
    assert set(first) == set(hosts), f"new conversations should spread over both replicas: {first}"

    for i, (messages, replica, usage1, answer) in enumerate(convs):
        turn2 = messages + [{"role": "assistant", "content": answer},
                            {"role": "user", "content": f"And after that, {i}?"}]
        replica2, usage2, _ = chat(turn2)
        assert replica2 == replica, f"conversation {i}: turn 1 on {replica}, turn 2 on {replica2}"
        cached = usage2.prompt_tokens_details.cached_tokens
        # turn 2 repeats turn 1's prompt but for its last token (<think> becomes </think> + the answer):
        # every whole block of it is reused
        assert usage1.prompt_tokens - BLOCK <= cached < usage2.prompt_tokens, (usage1, usage2)
