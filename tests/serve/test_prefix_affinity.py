"""Prefix-affinity routing without a cluster: the prefix index (glm_ray/serve/prefix_index.py) against a
brute-force model of the same records, the routing decision against hand-set queue lengths, and the Serve
request router (glm_ray/serve/affinity_router.py) driven through Serve's own routing machinery
(`RequestRouter._choose_replica_for_request`: routing tasks, queue-length cache and probes) with fake
replicas. The live two-replica test is tests/serve/test_affinity_served.py."""
from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict

import pytest

from glm_ray.serve.prefix_index import (
    IMBALANCED,
    NO_MATCH,
    PREFIX,
    SHORT_MATCH,
    AffinityConfig,
    PrefixIndex,
    decide,
)

BS = 4


def blocks(ids, bs=BS):
    return [tuple(ids[i:i + bs]) for i in range(0, len(ids) - bs + 1, bs)]


# ---- the index --------------------------------------------------------------------------------------

def test_block_names_are_chained_over_full_blocks():
    ix = PrefixIndex(BS, 100)
    a = ix.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2                                            # the partial ninth token has no block
    assert ix.block_hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a         # a prefix's names are the same
    assert ix.block_hashes([1, 2, 3, 4]) == a[:1]
    b = ix.block_hashes([9, 9, 9, 9, 5, 6, 7, 8])
    assert b[0] != a[0] and b[1] != a[1]                          # same block tokens, other parent: other name
    assert ix.block_hashes([1, 2, 3]) == []


def test_longest_match_and_its_holders():
    ix = PrefixIndex(BS, 100)
    p = list(range(100, 124))                                     # 6 blocks
    ix.insert(ix.block_hashes(p[:12]), "A")                       # A: 3 blocks of p
    ix.insert(ix.block_hashes(p[:8] + [7] * 12), "B")             # B: 2 blocks of p, then its own
    ix.insert(ix.block_hashes([5] * 24), "C")                     # C: nothing of p
    assert ix.match(ix.block_hashes(p), ["A", "B", "C"]) == (3, {"A"})
    assert ix.match(ix.block_hashes(p), ["B", "C"]) == (2, {"B"})     # only among the candidates given
    assert ix.match(ix.block_hashes(p[:8] + [0] * 4), ["A", "B", "C"]) == (2, {"A", "B"})   # a tie: both
    assert ix.match(ix.block_hashes([0] * 8), ["A", "B", "C"]) == (0, set())
    assert ix.match(ix.block_hashes(p), []) == (0, set())


def test_eviction_takes_the_least_recent_tail_first():
    ix = PrefixIndex(BS, 4)                                       # 4 blocks per replica
    p, q = list(range(12)), list(range(50, 62))                   # 3 blocks each
    ix.insert(ix.block_hashes(p), "A")
    ix.insert(ix.block_hashes(p), "B")
    ix.insert(ix.block_hashes(q), "A")                            # A: 6 > 4: p's two deepest blocks go
    assert ix.num_blocks("A") == 4
    assert ix.match(ix.block_hashes(p), ["A"]) == (1, {"A"})      # p's head stays (touched after its tail)
    assert ix.match(ix.block_hashes(q), ["A"]) == (3, {"A"})
    assert ix.match(ix.block_hashes(p), ["B"]) == (3, {"B"})      # another replica's record is its own
    ix.insert(ix.block_hashes(list(range(200, 240))), "A")        # a prompt longer than the bound
    assert ix.num_blocks("A") == 4
    assert ix.match(ix.block_hashes(list(range(200, 240))), ["A"]) == (4, {"A"})   # its head is what stays


def test_touching_a_prefix_protects_it():
    ix = PrefixIndex(BS, 4)
    p, q, r = list(range(8)), list(range(50, 58)), list(range(90, 98))
    ix.insert(ix.block_hashes(p), "A")
    ix.insert(ix.block_hashes(q), "A")
    ix.insert(ix.block_hashes(p), "A")                            # p used again: q is now the oldest
    ix.insert(ix.block_hashes(r), "A")
    assert ix.match(ix.block_hashes(p), ["A"])[0] == 2
    assert ix.match(ix.block_hashes(q), ["A"])[0] == 0
    assert ix.match(ix.block_hashes(r), ["A"])[0] == 2


def test_removed_replicas_are_forgotten():
    ix = PrefixIndex(BS, 100)
    p = list(range(16))
    for r in ("A", "B", "C"):
        ix.insert(ix.block_hashes(p), r)
    ix.remove("B")
    assert ix.match(ix.block_hashes(p), ["A", "B", "C"]) == (4, {"A", "C"})
    ix.retain(["C"])
    assert ix.replicas() == ["C"] and ix.match(ix.block_hashes(p), ["A", "B", "C"]) == (4, {"C"})
    ix.remove("C")
    assert ix.total_entries() == 0 and not ix._holders           # nothing left behind


class NaiveRecords:
    """The same records, kept the obvious way: per replica an LRU of block-aligned token prefixes (as tuples
    of blocks), matched by comparing tokens. The oracle of the randomized test below."""

    def __init__(self, cap):
        self.cap, self.lru = cap, {}

    def insert(self, ids, replica):
        lru = self.lru.setdefault(replica, OrderedDict())
        bl = blocks(ids)
        for k in range(len(bl), 0, -1):                           # deepest first, as documented
            lru.pop(tuple(bl[:k]), None)
            lru[tuple(bl[:k])] = None
        while len(lru) > self.cap:
            lru.popitem(last=False)

    def match(self, ids, replicas):
        bl, best, holders = blocks(ids), 0, set()
        for r in replicas:
            n = 0
            while n < len(bl) and tuple(bl[:n + 1]) in self.lru.get(r, ()):
                n += 1
            if n > best:
                best, holders = n, {r}
            elif n == best and n > 0:
                holders.add(r)
        return best, holders


def test_matches_a_brute_force_model_of_the_records():
    rng = random.Random(7)
    ix, naive = PrefixIndex(BS, 12), NaiveRecords(12)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    replicas = ["A", "B", "C"]
    for step in range(600):
        ids = rng.choice(stems)[:rng.randrange(0, 30)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.5:
            r = rng.choice(replicas)
            ix.insert(ix.block_hashes(ids), r)
            naive.insert(ids, r)
        elif rng.random() < 0.05:
            r = rng.choice(replicas)
            ix.remove(r)
            naive.lru.pop(r, None)
        cands = rng.sample(replicas, rng.randrange(1, 4))
        assert ix.match(ix.block_hashes(ids), cands) == naive.match(ids, cands), step
        assert all(ix.num_blocks(r) <= 12 for r in replicas)


# ---- the decision -----------------------------------------------------------------------------------

def _index_with(prompts: dict[str, list[int]]) -> PrefixIndex:
    ix = PrefixIndex(BS, 1000)
    for r, ids in prompts.items():
        ix.insert(ix.block_hashes(ids), r)
    return ix


P = list(range(1000, 1040))                                       # 40 tokens, 10 blocks


def test_the_prefix_holder_wins_within_the_imbalance_bound():
    ix = _index_with({"A": P})
    cfg = AffinityConfig(block_size=BS, max_imbalance=8)
    prompt = P + [1, 2, 3]
    d = decide(ix, ix.block_hashes(prompt), len(prompt), {"A": 8, "B": 0}, cfg)
    assert (d.replica, d.reason, d.matched_tokens) == ("A", PREFIX, 40)
    d = decide(ix, ix.block_hashes(prompt), len(prompt), {"A": 9, "B": 0}, cfg)
    assert (d.replica, d.reason) == ("B", IMBALANCED)             # one request too many: by load


def test_among_holders_of_the_longest_prefix_the_least_loaded():
    ix = _index_with({"A": P, "B": P, "C": P[:8]})
    d = decide(ix, ix.block_hashes(P), len(P), {"A": 5, "B": 2, "C": 0}, AffinityConfig(block_size=BS))
    assert (d.replica, d.reason) == ("B", PREFIX)                 # C holds less of the prompt


def test_a_short_match_routes_by_load():
    ix = _index_with({"A": P[:4]})
    prompt = P[:4] + list(range(60))                              # 4 of 64 tokens = 0.0625 < 0.1
    d = decide(ix, ix.block_hashes(prompt), len(prompt), {"A": 0, "B": 0}, AffinityConfig(block_size=BS))
    assert d.reason == SHORT_MATCH and d.matched_tokens == 4
    assert d.replica == "B"                                       # equal loads: fewer blocks remembered
    d = decide(ix, ix.block_hashes(prompt), len(prompt), {"A": 0, "B": 0},
               AffinityConfig(block_size=BS, min_match_ratio=0.05))
    assert (d.replica, d.reason) == ("A", PREFIX)


def test_no_match_goes_to_the_less_loaded_then_to_the_smaller_record():
    ix = _index_with({"A": P, "B": P[:8]})
    other = list(range(5000, 5040))
    cfg = AffinityConfig(block_size=BS)
    assert decide(ix, ix.block_hashes(other), 40, {"A": 0, "B": 1}, cfg).replica == "A"
    d = decide(ix, ix.block_hashes(other), 40, {"A": 1, "B": 1}, cfg)
    assert (d.replica, d.reason, d.matched_tokens) == ("B", NO_MATCH, 0)
    assert decide(ix, ix.block_hashes(other), 40, {"A": 0, "B": None}, cfg).replica == "A"   # unknown last


def test_prefix_matching_off_routes_by_load_only():
    ix = _index_with({"A": P})
    d = decide(ix, ix.block_hashes(P), len(P), {"A": 1, "B": 0}, AffinityConfig(block_size=BS, prefix_matching=False))
    assert (d.replica, d.reason) == ("B", NO_MATCH)


def test_the_fallback_is_power_of_two_choices():
    """Four replicas with queues 0..3: two are sampled and the shorter queue wins, so the longest queue never
    wins and the shortest wins whenever it is sampled (1/2 of the draws)."""
    ix, rng = PrefixIndex(BS, 100), random.Random(3)
    loads = {"A": 0, "B": 1, "C": 2, "D": 3}
    won = Counter(decide(ix, [], 8, loads, AffinityConfig(block_size=BS), rng).replica for _ in range(3000))
    assert won["D"] == 0
    assert abs(won["A"] / 3000 - 1 / 2) < 0.04 and abs(won["B"] / 3000 - 1 / 3) < 0.04   # B: sampled without A


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(min_match_ratio=1.5), dict(max_imbalance=-1),
                                dict(block_size=16, max_tokens_per_replica=8)])
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        AffinityConfig(**kw)


# ---- the Serve request router, through Serve's routing machinery ---------------------------------------

class FakeReplica:
    """What a request router reads of a `RunningReplica`; the queue length answers Serve's probe."""

    def __init__(self, name, queue_len=0):
        from ray.serve._private.common import DeploymentID
        from ray.serve.request_router import ReplicaID
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="Router", app_name="t"))
        self.queue_len = queue_len
        self.max_ongoing_requests = 100
        self.node_id, self.availability_zone, self.multiplexed_model_ids = None, None, set()
        self.routing_stats, self.is_cross_language = {}, False

    async def get_queue_len(self, *, deadline_s):
        return self.queue_len


def _router(**kw):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from glm_ray.serve.affinity_router import PrefixAffinityRouter
    r = PrefixAffinityRouter(deployment_id=DeploymentID(name="Router", app_name="t"),
                             handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
    r.initialize_state(block_size=BS, **kw)
    return r


def _request(method, *args, internal_id=None):
    import uuid

    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest
    return PendingRequest(args=list(args), kwargs={},
                          metadata=RequestMetadata(request_id=str(uuid.uuid4()),
                                                   internal_request_id=internal_id or uuid.uuid4().hex,
                                                   call_method=method))


async def _route(router, method, *args):
    """Where Serve sends the call, and tell the router it was accepted there (what Serve does next)."""
    pr = _request(method, *args)
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), 10)
    router.on_send_request(replica.replica_id)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica


def test_conversations_stick_to_their_replica_and_aborts_follow():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = _router(max_imbalance=4)
        router.update_replicas([a, b])
        first = {}
        for i in range(6):                                         # six conversations, turn 1
            prompt = [i] * 8 + list(range(100, 140))
            first[i] = (await _route(router, "generate", f"c{i}", prompt, None)).replica_id
        assert set(first.values()) == {a.replica_id, b.replica_id}  # equal loads: spread by record size
        for i in range(6):                                         # turn 2: turn 1's prompt + answer + question
            prompt = [i] * 8 + list(range(100, 140)) + [7] * 20
            assert (await _route(router, "generate", f"c{i}-2", prompt, None)).replica_id == first[i]
            assert (await _route(router, "abort", f"c{i}")).replica_id == first[i]     # abort follows generate
        assert router.decisions[PREFIX] == 6
        return router
    asyncio.run(main())


def test_an_overloaded_holder_is_passed_over_and_queue_lengths_are_probed():
    async def main():
        a, b = FakeReplica("a", queue_len=0), FakeReplica("b", queue_len=0)
        router = _router(max_imbalance=2)
        router.update_replicas([a, b])
        prompt = list(range(40))
        home = (await _route(router, "generate", "r0", prompt, None))
        other = b if home is a else a
        router.replica_queue_len_cache.invalidate_key(home.replica_id)   # stale cache: probed
        router.replica_queue_len_cache.invalidate_key(other.replica_id)
        home.queue_len = 3
        assert (await _route(router, "generate", "r1", prompt, None)) is other
        assert router.decisions[IMBALANCED] == 1
        # the prefix is now recorded on both; the less loaded holder takes the next one
        router.replica_queue_len_cache.update(home.replica_id, 0)
        router.replica_queue_len_cache.update(other.replica_id, 1)
        assert (await _route(router, "generate", "r2", prompt, None)) is home
    asyncio.run(main())


def test_a_refused_choice_records_the_replica_that_took_it():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = _router()
        router.update_replicas([a, b])
        prompt = list(range(40))
        pr = _request("generate", "r0", prompt, None)
        ranks = await router.choose_replicas([a, b], pr)
        chosen, rest = ranks[0][0], ranks[1]
        assert [r.replica_id for r in rest] == [r.replica_id for r in (a, b) if r is not chosen]
        took = rest[0]
        router.on_request_routed(pr, took.replica_id, None)           # Serve fell to the second rank
        assert router.index.match(router.index.block_hashes(prompt), [took.replica_id])[0] == 10
        assert (await _route(router, "abort", "r0")) is took
    asyncio.run(main())


def test_sub_requests_of_one_http_request_are_each_routed():
    """The calls one HTTP request makes (n > 1, several prompts) carry the same `internal_request_id` (Serve
    takes it from the ingress's request context) and are routed concurrently: each gets its own replica,
    and each one's placement is what its own decision chose (found by the fuzz test: with Serve's lookup
    by internal id the second sub-request was never routed)."""
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = _router()
        router.update_replicas([a, b])
        shared = "http-request-1"
        prompts = {f"sub{i}": [i] * 8 + list(range(200, 232)) for i in range(6)}
        prs = {rid: _request("generate", rid, p, None, internal_id=shared) for rid, p in prompts.items()}
        got = await asyncio.wait_for(asyncio.gather(*(router._choose_replica_for_request(pr) for pr in prs.values())),
                                     10)
        for (rid, pr), replica in zip(prs.items(), got):
            router.on_send_request(replica.replica_id)
            router.on_request_routed(pr, replica.replica_id, None)
            assert router._placed[rid] == replica.replica_id            # its own decision's replica
        # and each prompt's prefix now points at the replica its sub-request went to
        for (rid, p), replica in zip(prompts.items(), got):
            assert (await _route(router, "generate", rid + "-again", p + [5] * 8, None)) is replica
    asyncio.run(main())


def test_replicas_that_leave_are_forgotten_and_other_calls_spread():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = _router()
        router.update_replicas([a, b])
        prompt = list(range(40))
        home = await _route(router, "generate", "r0", prompt, None)
        other = b if home is a else a
        assert router.index.replicas() == [home.replica_id]
        router.update_replicas([other])
        assert router.index.replicas() == [] and router.index.total_entries() == 0
        assert (await _route(router, "generate", "r1", prompt, None)) is other
        assert (await _route(router, "abort", "r0")) is other          # its replica is gone: anywhere
        router.update_replicas([a, b])
        seen = Counter()
        for _ in range(40):                                            # not generate/abort: two random
            pr = _request("check_engine")
            seen[(await asyncio.wait_for(router._choose_replica_for_request(pr), 10)).replica_id] += 1
        assert set(seen) == {a.replica_id, b.replica_id}
    asyncio.run(main())


# ---- configuration ----------------------------------------------------------------------------------

def test_router_deployment_carries_the_request_router():
    from glm_ray.serve.affinity_router import PrefixAffinityRouter
    from glm_ray.serve.args import ServeArgs
    from glm_ray.serve.router import router_deployment
    dep = router_deployment(ServeArgs.from_dict({"router_replicas": 3, "block_size": 32,
                                                 "prefix_affinity_min_match": 0.25,
                                                 "prefix_affinity_max_imbalance": 5,
                                                 "prefix_affinity_max_tokens": "64Ki"}))
    rc = dep._deployment_config.request_router_config
    assert dep.num_replicas == 3
    assert rc.get_request_router_class() is PrefixAffinityRouter
    assert rc.request_router_kwargs == dict(block_size=32, min_match_ratio=0.25, max_imbalance=5,
                                            max_tokens_per_replica=65536, prefix_matching=True)
    AffinityConfig(**rc.request_router_kwargs)                       # what initialize_state builds
    off = router_deployment(ServeArgs.from_dict({"enable_prefix_caching": False}))
    assert off._deployment_config.request_router_config.request_router_kwargs["prefix_matching"] is False
    default = router_deployment(ServeArgs.from_dict({"request_router": "power_of_two"}))
    assert default.num_replicas == 1
    assert default._deployment_config.request_router_config.get_request_router_class().__name__ == \
        "PowerOfTwoChoicesRequestRouter"


@pytest.mark.parametrize("args,name", [
    ({"router_replicas": 0}, "router_replicas"), ({"request_router": "random"}, "request_router"),
    ({"prefix_affinity_min_match": 1.5}, "prefix_affinity_min_match"),
    ({"prefix_affinity_max_imbalance": -1}, "prefix_affinity_max_imbalance"),
    ({"prefix_affinity_max_tokens": 8}, "prefix_affinity_max_tokens"),
])
def test_bad_routing_arguments_name_themselves(args, name):
    from glm_ray.serve.args import ServeArgs
    with pytest.raises(ValueError, match=rf"argument {name}\b"):
        ServeArgs.from_dict(args)


def test_routing_flags():
    from glm_ray import cli
    from glm_ray.serve.args import ServeArgs
    a = cli.build_parser().parse_args(["serve", "--router-replicas", "2", "--request-router", "power_of_two",
                                       "--prefix-affinity-max-tokens", "2Mi", "--prefix-affinity-min-match", "0.5"])
    sa = ServeArgs.from_dict(cli.serve_app_args(a))
    assert (sa.router_replicas, sa.request_router, sa.prefix_affinity_max_tokens, sa.prefix_affinity_min_match) == \
        (2, "power_of_two", 2 * 2**20, 0.5)
    d = ServeArgs.from_dict({})
    assert (d.router_replicas, d.request_router) == (1, "prefix_affinity")
