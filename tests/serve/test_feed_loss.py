"""A replica's KV feed actor killed mid-run (issue 28, finding 3), on real actors: the replica's
pusher makes a new feed under the same name and starts it from a snapshot; a router that
followed the dead one logs the loss, counts the replica's load as unknown (not the last load it
heard) until the new feed answers, and then mirrors the replica again. The router's Serve
replica and deployment objects are stood in for by the fakes of ``test_kv_router``; the feeds,
the pusher and the router's following task are the real ones."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

pytest.importorskip("ray.serve")

import ray
from ray.serve._private.common import DeploymentHandleSource, ReplicaID

from raykv.serve.kv_feed import FeedPusher, Load, feed_name, start_feed
from raykv.serve.kv_index import Snapshot
from raykv.serve.kv_router import KVAwareRouter
from tests.serve.test_kv_router import DEPLOYMENT, WEIGHTS, FakeReplica

WAIT_S = 60.0


class FakeEngine:
    """What a replica's ``_collect_kv`` reads, set by the test: its keys and its load."""

    def __init__(self, gpu: list[int], load: Load) -> None:
        self.gpu = gpu
        self.load = load
        self.lock = threading.Lock()

    def collect(self, whole: bool) -> tuple[list | Snapshot, Load]:
        with self.lock:
            load = Load(self.load.prefill_tokens, self.load.decoding)
            # one event announced them (a new feed's readers, at 0, then see a snapshot)
            return (Snapshot(1, {"GPU": list(self.gpu)}) if whole else []), load


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def namespace() -> str:
    return ray.get_runtime_context().namespace


def test_issue28_3_a_killed_feed_is_recreated_and_starts_from_a_snapshot(ray_session) -> None:
    name = feed_name("feed-loss-test", "pusher")
    engine = FakeEngine([11, 12, 13], Load(7, 1))

    def create():
        return start_feed(name, namespace())

    pusher = FeedPusher(create(), engine.collect, recreate=create)
    try:
        first = ray.get_actor(name, namespace())
        until(lambda: ray.get(first.since.remote(-1, -1, 0.0), timeout=30)[1].version > 0, "push")
        ray.kill(first, no_restart=True)
        until(lambda: pusher.recreated == 1, "the pusher to replace the feed")
        second = ray.get_actor(name, namespace())
        assert second._actor_id != first._actor_id

        def snapshot_arrived() -> bool:
            what, _ = ray.get(second.since.remote(-1, -1, 0.0), timeout=30)
            return isinstance(what, Snapshot) and what.held.get("GPU") == [11, 12, 13]

        until(snapshot_arrived, "the new feed's snapshot")
        _, load = ray.get(second.since.remote(-1, -1, 0.0), timeout=30)
        assert (load.prefill_tokens, load.decoding) == (7, 1)
    finally:
        pusher.stop()
        if pusher.feed is not None:
            ray.kill(pusher.feed)


def test_issue28_3_a_router_counts_a_lost_feeds_load_as_unknown_and_follows_the_new_one(
    ray_session, caplog
) -> None:
    a, b = (FakeReplica(ReplicaID(n, DEPLOYMENT)) for n in ("lost-a", "lost-b"))
    engines = {"a": FakeEngine([101, 102], Load(5000, 3)), "b": FakeEngine([], Load(10, 0))}

    def new_feed(which: str):
        replica = a if which == "a" else b
        return start_feed(feed_name(DEPLOYMENT.app_name, replica.replica_id.unique_id), namespace())

    pushers = {w: FeedPusher(new_feed(w), engines[w].collect) for w in "ab"}  # no recreation

    async def run() -> dict[str, object]:
        router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(4, 2, [0], WEIGHTS)
        router._replicas = {r.replica_id: r for r in (a, b)}
        router._sync_followed()
        followed = router.followed[a.replica_id]
        out: dict[str, object] = {}

        async def wait(condition, what: str) -> None:
            deadline = time.monotonic() + WAIT_S
            while not condition():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        other = router.followed[b.replica_id]
        await wait(
            lambda: followed.load is not None and followed.load.prefill_tokens == 5000,
            "a's load",
        )
        await wait(lambda: other.load is not None and other.load.prefill_tokens == 10, "b's load")
        out["busy queue"] = router._queue_of(a)
        out["mirror before"] = set(followed.kv.gpu)
        ray.kill(pushers["a"].feed, no_restart=True)
        await wait(lambda: followed.load is None, "the loss to be noticed")
        out["queue while unknown"] = router._queue_of(a)
        out["queue of b"] = router._queue_of(b)
        out["mirror while unknown"] = set(followed.kv.gpu)
        # the replica's pusher makes its next feed (as ``FeedPusher`` does by itself)
        pushers["a"].stop()
        with engines["a"].lock:
            engines["a"].load = Load(20, 0)
        pushers["a"] = FeedPusher(new_feed("a"), engines["a"].collect)
        await wait(lambda: followed.load is not None, "the new feed to answer")
        await wait(lambda: followed.kv.synced and bool(followed.kv.gpu), "the new snapshot")
        out["queue after"] = router._queue_of(a)
        out["mirror after"] = set(followed.kv.gpu)
        for f in router.followed.values():
            f.task.cancel()
        return out

    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            out = asyncio.run(run())
    finally:
        for pusher in pushers.values():
            pusher.stop()
            if pusher.feed is not None:
                ray.kill(pusher.feed)
    decode_cost = WEIGHTS["decode_cost"]
    assert out["busy queue"] == 5000 + 3 * decode_cost and out["mirror before"]
    # while unknown: what the known replicas have (b's), not the 5000 it last heard
    assert out["queue while unknown"] == out["queue of b"] == 10
    assert out["mirror while unknown"] == set()
    assert out["queue after"] == 20 and out["mirror after"]
    logged = [r.getMessage() for r in caplog.records]
    assert any("lost the KV feed of replica lost-a" in m for m in logged), logged
    assert any("KV feed of replica lost-a answers again" in m for m in logged), logged
