"""A replica's KV feed: a small actor its replica creates and owns (it dies with the replica),
to which the replica pushes its KV events and load every few milliseconds, and from which any
number of routers pull what they missed.

Why an actor of its own: a router cannot call a Serve replica's methods directly (every call to
a replica is a routed request), and the replica's engine loop should not answer routers. The
feed is named after the replica's Serve id, so a router finds it from the replica it sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from raykv.serve.kv_index import EventRing, Snapshot, WireEvent

log = logging.getLogger(__name__)

# how often a replica pushes its events and load: a router's view of it lags by about this
PUSH_INTERVAL_S = 0.02
RING_CAPACITY = 4096
PUSH_TIMEOUT_S = 10.0
# an idle replica asks this often whether its feed lives (a dead one is replaced)
ALIVE_CHECK_S = 1.0


def feed_name(app_name: str, replica_unique_id: str) -> str:
    """The feed actor's name for one Serve replica."""
    return f"raykv-kv-feed:{app_name}:{replica_unique_id}"


@dataclass(slots=True)
class Load:
    """A replica's queue as a router weighs it: prompt tokens still to prefill and requests
    decoding. ``version`` counts the feed's updates (a router counts what it routed since the
    version it last saw)."""

    prefill_tokens: int = 0
    decoding: int = 0
    version: int = 0


class KVFeed:
    """The actor's body (made an async actor by ``start_feed``): readers long-poll ``since``,
    so an idle replica costs its routers nothing."""

    def __init__(self, capacity: int = RING_CAPACITY) -> None:
        self.ring = EventRing(capacity)
        self.load = Load()
        self._changed = asyncio.Event()

    def _update(self, load: Load) -> None:
        load.version = self.load.version + 1
        self.load = load
        self._changed.set()
        self._changed.clear()  # waiters already woken stay woken

    async def push(self, events: list[WireEvent], load: Load) -> bool:
        """False: the events do not follow on; the replica must ``reset``."""
        ok = self.ring.push(events)
        self._update(load)
        return ok

    async def alive(self) -> bool:
        """An idle replica's check that its feed still lives (wakes no reader)."""
        return True

    async def reset(self, snapshot: Snapshot, load: Load) -> None:
        self.ring.reset(snapshot)
        self._update(load)

    async def since(
        self, seq: int, version: int, wait_s: float
    ) -> tuple[list[WireEvent] | Snapshot, Load]:
        """What a reader at event ``seq`` and load ``version`` missed (events, or a snapshot),
        with the latest load; waits up to ``wait_s`` for something new first."""
        if seq == self.ring.next_seq and version == self.load.version:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        return self.ring.since(seq), self.load


class FeedPusher:
    """The replica's side: a thread that, every ``PUSH_INTERVAL_S``, takes the engine's new
    events and load (``collect``) and pushes them when anything changed; after a failed or
    refused push it sends a whole snapshot instead. A feed actor that died is replaced
    (``recreate``): the routers find the new one by its name and start from its snapshot."""

    def __init__(
        self,
        feed: Any,
        collect: Callable[[bool], tuple[list[WireEvent] | Snapshot, Load]],
        recreate: Callable[[], Any] | None = None,
    ) -> None:
        """``collect(whole)``: the events since the last call, or with ``whole`` the whole
        state (dropping the events that state includes), with the current load.
        ``recreate()``: a new feed actor under the same name (None: never replaced)."""
        self.feed = feed
        self._collect = collect
        self._recreate = recreate
        self.recreated = 0  # feeds that died and were replaced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-kv-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        whole = True  # the feed starts from the engine's state as it is now
        last: tuple[int, int] | None = None
        heard = time.monotonic()  # when the feed last answered
        while not self._stop.wait(PUSH_INTERVAL_S):
            try:
                if self.feed is None:  # the last one died: its name is free once Ray says so
                    self.feed = self._recreate() if self._recreate is not None else None
                    if self.feed is None:
                        continue
                    self.recreated += 1
                    log.warning("this replica's KV feed died; a new one took its name")
                    whole = True
                what, load = self._collect(whole)
                if isinstance(what, Snapshot):
                    ray.get(self.feed.reset.remote(what, load), timeout=PUSH_TIMEOUT_S)
                    whole = False
                elif what or (load.prefill_tokens, load.decoding) != last:
                    whole = not ray.get(self.feed.push.remote(what, load), timeout=PUSH_TIMEOUT_S)
                elif time.monotonic() - heard > ALIVE_CHECK_S:  # idle: is the feed still there?
                    ray.get(self.feed.alive.remote(), timeout=PUSH_TIMEOUT_S)
                else:
                    continue
                heard = time.monotonic()
                last = (load.prefill_tokens, load.decoding)
            except ray.exceptions.ActorDiedError:  # the feed is gone for good: replace it
                if self._stop.is_set():
                    return
                if self._recreate is not None:
                    self.feed = None
                whole = True
            except Exception:  # slow or unavailable for now: start again from a snapshot
                if self._stop.is_set():
                    return
                whole = True

    def stop(self) -> None:
        """End the thread (waiting for a push in flight at most ``PUSH_TIMEOUT_S``)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=PUSH_TIMEOUT_S + 1)

    def end(self) -> None:
        """End the thread and the feed actor: routers then count the replica's KV as empty
        and its load as unknown (its engine is gone, or going)."""
        self.stop()
        with contextlib.suppress(Exception):
            ray.kill(self.feed)


def start_feed(name: str, namespace: str, placement: Any = None) -> Any:
    """Create the named feed actor (owned by the caller, so it goes when the caller does), in
    bundle 0 of ``placement`` when given (beside its replica)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"name": name, "namespace": namespace, "num_cpus": 0}
    if placement is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement, placement_group_bundle_index=0
        )
    return ray.remote(KVFeed).options(**options).remote()


def replica_feed(
    replica: str,
    collect: Callable[[bool], tuple[list[WireEvent] | Snapshot, Load]],
    placement: Any = None,
) -> FeedPusher:
    """The KV feed of the Serve replica ``replica`` (this process), named for it so routers
    find it, and the pusher that feeds it from ``collect`` and makes a new one if it dies;
    the feed sits in bundle 0 of ``placement`` where given."""
    from ray import serve

    app_name = serve.get_replica_context().replica_id.deployment_id.app_name
    name = feed_name(app_name, replica)
    namespace = ray.get_runtime_context().namespace

    def create() -> Any:
        try:
            return start_feed(name, namespace, placement)
        except ValueError:  # the name is taken: a feed that lives after all, or the dead
            return ray.get_actor(name, namespace)  # one not yet released (its push fails)

    return FeedPusher(create(), collect, recreate=create)
