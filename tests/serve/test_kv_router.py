"""The KV-aware router's choices, from mirrors set by hand: Serve's replica and request objects
are stood in for by fakes (the choice needs only their ids and the request's token ids), and
the feed-following tasks are cancelled at once so nothing but the test changes the mirrors.
What the real feeds deliver is tested in test_kv_index.py and, end to end, test_replicas.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from raykv.core.step import SamplingSpec
from raykv.serve.kv_feed import Load
from raykv.serve.kv_index import KVLayout, PromptKeys, Snapshot
from raykv.serve.kv_router import KVAwareRouter
from raykv.serve.messages import EngineRequest

DEPLOYMENT = DeploymentID(name="raykv-engine", app_name="router-test")
LAYOUT = KVLayout(block_size=4, blocks_per_chunk=2)
WEIGHTS = {"cpu_hit_cost": 0.02, "decode_cost": 8.0, "imbalance": 2.0, "imbalance_tokens": 8}
PROMPT = list(range(100, 133))  # 33 tokens: 8 blocks, 4 chunks usable


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 64


@dataclass
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakePending:
    args: list[Any]
    metadata: FakeMetadata
    kwargs: dict[str, Any] = field(default_factory=dict)


def pending(request_id: str, token_ids: list[int]) -> FakePending:
    request = EngineRequest(request_id, token_ids, 4, SamplingSpec())
    return FakePending([request], FakeMetadata(request_id))


def hold(router: KVAwareRouter, replica: FakeReplica, gpu_blocks: int, cpu_chunks: int) -> None:
    keys = PromptKeys.of(PROMPT, LAYOUT)
    gpu = [k for block in keys.gpu[:gpu_blocks] for k in block]
    cpu = [k for chunk in keys.cpu[:cpu_chunks] for k in chunk]
    router.followed[replica.replica_id].kv.load(Snapshot(0, {"GPU": gpu, "CPU": cpu}))


def follow(router: KVAwareRouter, replicas: list[FakeReplica]) -> None:
    """What update_replicas sets, with the feed-following tasks cancelled at once, and each
    new replica's feed answered once: an idle replica (a load known to be empty)."""
    known = set(router.followed)
    router._replicas = {r.replica_id: r for r in replicas}
    router._sync_followed()
    for replica_id, followed in router.followed.items():
        followed.task.cancel()
        if replica_id not in known:
            followed.load = Load()


def scenario() -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(4, 2, [0], WEIGHTS)
        a, b, c = (FakeReplica(ReplicaID(n, DEPLOYMENT)) for n in "abc")
        follow(router, [a, b])
        out: dict[str, Any] = {}
        both = [a, b]
        out["nothing cached"] = await router.choose_replicas(both, pending("r0", PROMPT))
        hold(router, b, gpu_blocks=3, cpu_chunks=0)
        out["b's GPU"] = await router.choose_replicas(both, pending("r1", PROMPT))
        hold(router, a, gpu_blocks=0, cpu_chunks=4)
        out["a's CPU beats b's GPU"] = await router.choose_replicas(both, pending("r2", PROMPT))
        router.followed[a.replica_id].load = Load(prefill_tokens=15)
        out["a too busy"] = await router.choose_replicas(both, pending("r3", PROMPT))
        out["no prompt"] = await router.choose_replicas(both, None)
        router.followed[a.replica_id].load = Load()
        before = router._queue_of(a)
        await router.choose_replicas(both, pending("r4", PROMPT))  # a: its CPU tier holds it
        router.on_request_routed(pending("r4", PROMPT), a.replica_id, None)
        out["routed tokens"] = (before, router._queue_of(a))
        follow(router, [a, c])  # b gone, c new
        out["followed"] = {rid.unique_id for rid in router.followed}
        # no event yet, but a prompt just routed is expected where it went
        router.followed[a.replica_id].kv.load(Snapshot(0, {}))
        fresh = [a, c]
        other = list(range(500, 530))
        ranked = await router.choose_replicas(fresh, pending("r5", other))
        went = ranked[-1][0]  # the fallback rank takes it
        router.on_request_routed(pending("r5", other), went.replica_id, None)
        router.on_request_completed(went.replica_id, "r5")  # answered: no longer queued there
        follow_up = await router.choose_replicas(fresh, pending("r6", [*other, 7, 8, 9, 10]))
        out["expected"] = (went.replica_id.unique_id, ids(follow_up))
        return out

    return asyncio.run(run())


def ids(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_weighs_hits_by_medium_against_load_and_forgets_a_replica(ray_session):
    out = scenario()
    # nothing anywhere: power of two choices over both
    assert sorted(chain(*ids(out["nothing cached"]))) == ["a", "b"]
    # b's GPU holds 12 tokens: b first, a as the fallback rank
    assert ids(out["b's GPU"]) == [["b"], ["a"]]
    # a's CPU tier holds 32 tokens (4 chunks of 8): worth more than b's 12 on the GPU
    assert ids(out["a's CPU beats b's GPU"]) == [["a"], ["b"]]
    # a, still the cheapest (1.64 + 15 against 21), has 15 tokens queued: over twice b's queue
    # and 8 longer, so power of two choices instead, the less busy first
    assert ids(out["a too busy"]) == [["b"], ["a"]]
    assert sorted(chain(*ids(out["no prompt"]))) == ["a", "b"]
    # a request routed to a counts in a's queue at once: what it computes there (1 token)
    before, after = out["routed tokens"]
    assert before == 0 and after == 1
    assert out["followed"] == {"a", "c"}
    # the follow-up of a prompt routed a moment ago goes where that one went
    went, follow_up = out["expected"]
    assert follow_up[0] == [went]


def spill_scenario() -> dict[str, list[list[str]]]:
    """a's GPU holds 12 of the prompt's 33 tokens and b's 4; a's queue varies, b's is empty."""

    async def run() -> dict[str, list[list[str]]]:
        router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(4, 2, [0], {**WEIGHTS, "imbalance_tokens": 1000}, step_tokens=64)
        a, b = (FakeReplica(ReplicaID(n, DEPLOYMENT)) for n in "ab")
        follow(router, [a, b])
        hold(router, a, gpu_blocks=3, cpu_chunks=0)
        hold(router, b, gpu_blocks=1, cpu_chunks=0)
        out = {}
        for queued in (30, 60):
            router.followed[a.replica_id].load = Load(prefill_tokens=queued)
            ranked = await router.choose_replicas([a, b], pending(f"q{queued}", PROMPT))
            out[f"a queues {queued}"] = ids(ranked)
        return out

    return asyncio.run(run())


def test_a_queue_the_next_step_takes_beside_the_prompt_costs_nothing(ray_session):
    out = spill_scenario()
    # 30 queued + a's 21 to compute fit in a 64-token step: a costs 21, b 29 (nothing queued)
    assert out["a queues 30"] == [["a"], ["b"]]
    # 60 queued + 21 spill 17 tokens past the step: a costs 38, more than b's 29
    assert out["a queues 60"] == [["b"], ["a"]]


def test_issue28_3_a_replica_whose_load_is_unknown_counts_as_the_known_ones_mean(ray_session):
    async def run() -> tuple[float, float, float]:
        router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(4, 2, [0], WEIGHTS)
        a, b, c = (FakeReplica(ReplicaID(n, DEPLOYMENT)) for n in "abc")
        follow(router, [a, b, c])
        router.followed[b.replica_id].load = Load(prefill_tokens=100)
        router.followed[c.replica_id].load = Load(prefill_tokens=300)
        router.followed[a.replica_id].load = None  # its feed was lost: heard nothing since
        unknown = router._queue_of(a)
        for replica in (a, b, c):
            router.followed[replica.replica_id].load = None
        return unknown, router._queue_of(b), router._queue_of(c)

    unknown, b_none, c_none = asyncio.run(run())
    assert unknown == 200  # not the 0 of an idle replica, nor a load it last had
    assert b_none == c_none == 0  # nothing known anywhere: all alike


def announce(router: KVAwareRouter, replica: FakeReplica, medium: str, chunks: int) -> None:
    """The replica's feed announces the prompt's first ``chunks`` chunks stored in ``medium``
    (after an empty snapshot), as its engine's events would."""
    keys = PromptKeys.of(PROMPT, LAYOUT)
    if medium == "GPU":
        stored = [k for block in keys.gpu[: chunks * LAYOUT.blocks_per_chunk] for k in block]
    else:
        stored = [k for chunk in keys.cpu[:chunks] for k in chunk]
    kv = router.followed[replica.replica_id].kv
    kv.load(Snapshot(0, {}))
    assert kv.apply([(0, True, medium, tuple(stored))])


def disk_scenario() -> dict[str, list[list[list[str]]]]:
    """a holds the prompt's four chunks on disk; b the same on its GPU, c in its CPU tier; d
    holds nothing. Every load is equal (idle). Each pair is asked 16 times (ties go at random)."""

    async def run() -> dict[str, list[list[list[str]]]]:
        router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(4, 2, [0], {**WEIGHTS, "disk_hit_cost": 0.25})
        a, b, c, d = (FakeReplica(ReplicaID(n, DEPLOYMENT)) for n in "abcd")
        follow(router, [a, b, c, d])
        announce(router, a, "DISK", 4)
        announce(router, b, "GPU", 4)
        announce(router, c, "CPU", 4)
        out: dict[str, list[list[list[str]]]] = {}
        for name, pair in {"gpu": [a, b], "cpu": [c, a], "nothing": [d, a]}.items():
            out[name] = [
                ids(await router.choose_replicas(pair, pending(f"{name}{i}", PROMPT)))
                for i in range(16)
            ]
        return out

    return asyncio.run(run())


def test_a_gpu_or_cpu_holder_beats_a_disk_holder_and_a_disk_hit_beats_none(ray_session):
    out = disk_scenario()
    assert out["gpu"] == [[["b"], ["a"]]] * 16
    assert out["cpu"] == [[["c"], ["a"]]] * 16  # the disk's copy must be promoted first
    # a disk hit is reuse: the least cost decides (not power of two choices), and a's disk
    # beats computing the whole prompt on d
    assert out["nothing"] == [[["a"], ["d"]]] * 16
