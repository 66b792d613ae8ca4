"""``--router kv``: a Ray Serve request router that sends each request to the replica whose KV
already holds the most of its prompt, weighed against how busy that replica is.

Each router follows every replica's KV feed (``serve.kv_feed``): one long poll per replica
brings its events (or a snapshot after a gap) into a mirror of which keys its GPU prefix cache,
its CPU tier and its disk tier hold, and its load. For a request it hashes the prompt the way
the engine does (``serve.kv_index.PromptKeys``) and picks the replica of least cost
(``RouteWeights.cost``); when no replica holds anything of the prompt, or the least-cost one is
far busier than the least busy, it falls back to power of two choices. A replica that goes away
is forgotten at once (its mirror dropped, its feed no longer followed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)
from ray.util.metrics import Counter

from raykv.config import RouterWeightsConfig
from raykv.config.sections import SHARED_HIT_COST
from raykv.serve.kv_feed import PUSH_INTERVAL_S, Load, feed_name
from raykv.serve.kv_index import (
    Hit,
    KVLayout,
    PromptKeys,
    ReplicaKV,
    SharedView,
    Snapshot,
    prompt_hit,
)

logger = logging.getLogger("ray.serve")

# a long poll's wait at the feed, and how long past it a reply may take before the feed counts
# as gone
POLL_WAIT_S = 1.0
POLL_GRACE_S = 10.0
RETRY_S = 0.1
RETRY_MAX_S = 2.0
# a prompt just routed to a replica counts as in its GPU cache this long: its next turn (or a
# request of the same prefix) finds it there before the replica's events say so
EXPECTED_S = 2.0
MAX_CHOSEN = 100_000
# what a router routed counts in its view of a replica's load until it completes or this long:
# by then the replica's own count, pushed every PUSH_INTERVAL_S, has it
ROUTED_SETTLE_S = 3 * PUSH_INTERVAL_S


@dataclass(slots=True)
class RouteWeights:
    """The cost of sending a request to a replica, in prompt tokens to compute:

    ``computed + cpu_hit_cost * from_cpu + disk_hit_cost * from_disk + shared_hit_cost *
    from_shared + spilled_queue + decode_cost * decoding``

    A GPU hit costs nothing; a token from the disk tier is promoted into the CPU tier and then
    loaded, so it costs more than one from the CPU tier; one from the shared tier is read over the
    network into the CPU tier, then loaded: any replica can take it. ``spilled_queue`` is the part
    of the replica's queued prefill that does not fit beside this request's prompt and the decoding
    requests in the replica's next step (``step_tokens``, the engine's
    ``max_num_batched_tokens``): with chunked prefill a shorter queue is taken in the same step
    as this request and puts no step before its first token. When the least-cost replica's
    queue (``queue``) is more than ``imbalance`` times the least busy one's and longer by
    ``imbalance_tokens``, the request goes by power of two choices instead. The weights come
    from the config's ``serve.router_weights`` (``RouterWeightsConfig``, where their
    measurements are told); 0 ``step_tokens`` counts the whole queue."""

    cpu_hit_cost: float
    disk_hit_cost: float
    decode_cost: float
    imbalance: float
    imbalance_tokens: int
    step_tokens: int = 0
    shared_hit_cost: float = SHARED_HIT_COST

    def queue(self, load: Load, routed_tokens: int) -> float:
        """The replica's queued prefill and decoding, in tokens (what balancing compares)."""
        return load.prefill_tokens + routed_tokens + self.decode_cost * load.decoding

    def cost(self, hit: Hit, load: Load, routed_tokens: int) -> float:
        """The replica's cost for a prompt of ``hit`` there, beside its ``load`` and what this
        router sent it lately (``routed_tokens``, not yet in a pushed load)."""
        queued = load.prefill_tokens + routed_tokens
        room = self.step_tokens - load.decoding - hit.computed_tokens
        spilled = min(queued, max(0, queued - room)) if self.step_tokens else queued
        return (
            hit.computed_tokens
            + self.cpu_hit_cost * hit.cpu_tokens
            + self.disk_hit_cost * hit.disk_tokens
            + self.shared_hit_cost * hit.shared_tokens
            + spilled
            + self.decode_cost * load.decoding
        )


@dataclass(slots=True)
class _Followed:
    """What the router knows of one replica."""

    kv: ReplicaKV = field(default_factory=ReplicaKV)
    load: Load | None = None  # None: unknown (its feed has not answered, or was lost)
    # requests routed here, by internal id: (when, tokens to compute)
    routed: dict[str, tuple[float, int]] = field(default_factory=dict)
    expected: dict[int, float] = field(default_factory=dict)  # GPU key -> until when
    _expiries: deque[tuple[float, list[int]]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
    answered_once: bool = False  # its feed answered before (a later silence is a loss)

    def expect(self, keys: PromptKeys) -> None:
        until = time.monotonic() + EXPECTED_S
        for key in keys.published:
            self.expected[key] = until
        self._expiries.append((until, keys.published))

    def fresh_expected(self) -> dict[int, float]:
        """The expected keys not yet expired (oldest expectations dropped first)."""
        now = time.monotonic()
        expiries, expected = self._expiries, self.expected
        while expiries and expiries[0][0] < now:
            until, keys = expiries.popleft()
            for key in keys:
                if expected.get(key) == until:  # not expected again since
                    del expected[key]
        return expected

    def routed_tokens(self) -> int:
        since = time.monotonic() - ROUTED_SETTLE_S
        for request_id in [k for k, (when, _) in self.routed.items() if when <= since]:
            del self.routed[request_id]
        return sum(tokens for _, tokens in self.routed.values())


class KVAwareRouter(RequestRouter):
    """The router (Serve builds one per handle; ``initialize_state`` gets the engine's
    layout and the weights from ``RequestRouterConfig.request_router_kwargs``). No FIFO mixin:
    a replica chosen for one request's prompt must serve that request, not the queue's head."""

    def _warm_hashing(self) -> None:
        try:
            self.layout.hashes([], None)
        except Exception:
            logger.exception("the router cannot hash prompts as vLLM does; it routes by load")
            return
        self._hashing_ready.set()

    def initialize_state(
        self,
        block_size: int = 16,
        blocks_per_chunk: int = 1,
        groups: tuple[int, ...] = (0,),
        weights: dict[str, float] | None = None,
        step_tokens: int = 0,
        hasher: str = "raykv",
        hash_seed: str | None = None,
    ) -> None:
        self.layout = KVLayout(block_size, blocks_per_chunk, tuple(groups), hasher, hash_seed)
        # vLLM's hashing takes seconds to import: in a thread, requests going by power of two
        # choices until it is ready (never a first request waiting for an import)
        self._hashing_ready = threading.Event()
        if hasher == "raykv":
            self._hashing_ready.set()
        else:
            threading.Thread(target=self._warm_hashing, name="raykv-hashing", daemon=True).start()
        # a weight the caller leaves out (one written before it existed) keeps its default
        chosen = {**RouterWeightsConfig().model_dump(), **(weights or {})}
        self.weights = RouteWeights(**chosen, step_tokens=step_tokens)
        self.followed: dict[ReplicaID, _Followed] = {}
        # a request's replica and tokens to compute there, from choosing to the routed callback
        self._chosen: dict[str, tuple[ReplicaID, int, PromptKeys]] = {}
        self.decisions = Counter(
            "raykv_router_requests",
            "Requests the KV-aware router placed, by how: kv (least cost), pow2 (nothing "
            "cached anywhere, or too uneven a load), no_prompt (not a raykv request).",
            ("way",),
        )
        self.feed_losses = Counter(
            "raykv_router_feed_losses",
            "Replica KV feeds that stopped answering this router (their KV and load count as "
            "unknown until they answer again).",
        )

    # ---- following the replicas' feeds --------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._event_loop.call_soon_threadsafe(self._sync_followed)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._event_loop.call_soon_threadsafe(self._sync_followed)

    def _sync_followed(self) -> None:
        """Follow every current replica's feed; forget the others at once."""
        current = set(self._replicas)
        for replica_id in list(self.followed):
            if replica_id not in current:
                gone = self.followed.pop(replica_id)
                if gone.task is not None:
                    gone.task.cancel()
        for replica_id in current - set(self.followed):
            followed = _Followed()
            self.followed[replica_id] = followed
            followed.task = self._event_loop.create_task(self._follow(replica_id, followed))

    async def _follow(self, replica_id: ReplicaID, followed: _Followed) -> None:
        name = feed_name(self._deployment_id.app_name, replica_id.unique_id)
        namespace = ray.get_runtime_context().namespace
        feed = None
        heard = False  # the feed answered since it was (re)found
        retry = RETRY_S
        while self.followed.get(replica_id) is followed:
            try:
                if feed is None:
                    feed = await asyncio.to_thread(ray.get_actor, name, namespace)
                kv = followed.kv
                seq = kv.next_seq if kv.synced else -1
                version = followed.load.version if followed.load is not None else -1
                ref = feed.since.remote(seq, version, POLL_WAIT_S)
                what, load = await asyncio.wait_for(ref, POLL_WAIT_S + POLL_GRACE_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not up yet, or gone: unknown until it answers again
                if heard:
                    logger.warning(
                        "raykv router: lost the KV feed of replica %s (%s); its KV and load "
                        "count as unknown until it answers again",
                        replica_id.unique_id,
                        type(exc).__name__,
                    )
                    self.feed_losses.inc()
                heard = False
                feed = None
                followed.kv = ReplicaKV()
                followed.load = None
                await asyncio.sleep(retry)
                retry = min(2 * retry, RETRY_MAX_S)  # a replica still starting is not polled hard
                continue
            if self.followed.get(replica_id) is not followed:
                return
            if not heard and followed.answered_once:
                logger.info(
                    "raykv router: the KV feed of replica %s answers again", replica_id.unique_id
                )
            heard, retry = True, RETRY_S
            followed.answered_once = True
            if isinstance(what, Snapshot):
                if what.next_seq >= 0:  # < 0: the feed itself awaits its replica's snapshot
                    kv.load(what)
            else:
                kv.apply(what)  # a gap unsyncs the mirror: the next poll asks for a snapshot
            followed.load = load

    # ---- choosing ---------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        token_ids = _token_ids(pending_request)
        if token_ids is None:
            self.decisions.inc(tags={"way": "no_prompt"})
            return _pow2(candidate_replicas, self._queue_of)
        if not self._hashing_ready.is_set():
            self.decisions.inc(tags={"way": "pow2"})
            return _pow2(candidate_replicas, self._queue_of)
        keys = PromptKeys.of(token_ids, self.layout, _cache_salt(pending_request))
        scored = []
        typical = self._typical_load()
        shared = SharedView(f.kv for f in self.followed.values())
        for replica in candidate_replicas:
            followed = self.followed.get(replica.replica_id) or _Followed()
            hit = prompt_hit(keys, followed.kv, self.layout, followed.fresh_expected(), shared)
            load, routed = followed.load or typical, followed.routed_tokens()
            queue = self.weights.queue(load, routed)
            scored.append((self.weights.cost(hit, load, routed), queue, hit, replica))
        scored.sort(key=lambda s: (s[0], s[1], random.random()))
        _, best_queue, best_hit, best = scored[0]
        least_queue = min(s[1] for s in scored)
        reused = best_hit.reused_tokens
        too_busy = (
            best_queue > self.weights.imbalance * least_queue
            and best_queue - least_queue > self.weights.imbalance_tokens
        )
        if reused == 0 or too_busy:
            self.decisions.inc(tags={"way": "pow2"})
            ranked = _pow2(candidate_replicas, self._queue_of)
            chosen = ranked[0][0]
            self._remember(pending_request, chosen, keys.num_tokens, keys)
            return ranked
        self.decisions.inc(tags={"way": "kv"})
        self._remember(pending_request, best, best_hit.computed_tokens, keys)
        return [[s[3]] for s in scored]

    def _queue_of(self, replica: RunningReplica) -> float:
        followed = self.followed.get(replica.replica_id)
        if followed is None:
            return 0.0
        load = followed.load or self._typical_load()
        return self.weights.queue(load, followed.routed_tokens())

    def _typical_load(self) -> Load:
        """What a replica whose load is unknown counts as: the mean of the known ones (neither
        shunned for a load it had when its feed was lost, nor flooded as if idle)."""
        known = [f.load for f in self.followed.values() if f.load is not None]
        if not known:
            return Load()
        return Load(
            sum(k.prefill_tokens for k in known) // len(known),
            sum(k.decoding for k in known) // len(known),
        )

    def _remember(
        self,
        pending_request: PendingRequest | None,
        replica: RunningReplica,
        tokens: int,
        keys: PromptKeys,
    ) -> None:
        if pending_request is not None:
            if len(self._chosen) > MAX_CHOSEN:  # routings that never completed: drop them
                self._chosen.clear()
            request_id = pending_request.metadata.internal_request_id
            self._chosen[request_id] = (replica.replica_id, tokens, keys)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Count what the request will compute on the replica it went to, until the replica's
        own load has it, and expect its prompt in that replica's GPU cache."""
        request_id = pending_request.metadata.internal_request_id
        chosen = self._chosen.pop(request_id, None)
        followed = self.followed.get(replica_id)
        if followed is None or chosen is None:
            return
        meant_for, tokens, keys = chosen
        if meant_for != replica_id:  # a fallback rank took it: assume it computes it all
            tokens = keys.num_tokens
        followed.routed[request_id] = (time.monotonic(), tokens)
        followed.expect(keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request done is no longer in its replica's queue (even if no load said so yet)."""
        followed = self.followed.get(replica_id)
        if followed is not None:
            followed.routed.pop(internal_request_id, None)

    def __del__(self) -> None:
        for followed in getattr(self, "followed", {}).values():
            if followed.task is not None:
                with contextlib.suppress(Exception):
                    followed.task.cancel()


def _cache_salt(pending_request: PendingRequest | None) -> str | None:
    """The cache salt of the ``EngineRequest`` a pending request carries, if any."""
    if pending_request is None or not pending_request.args:
        return None
    salt = getattr(pending_request.args[0], "cache_salt", None)
    return salt if isinstance(salt, str) and salt else None


def _token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids, when the request is a raykv ``EngineRequest``."""
    if pending_request is None or not pending_request.args:
        return None
    token_ids = getattr(pending_request.args[0], "token_ids", None)
    return list(token_ids) if token_ids else None


def _pow2(candidates: list[RunningReplica], queue_of: Any) -> list[list[RunningReplica]]:
    """Two replicas at random, the less busy first (Serve's default, on the router's own view of
    their queues)."""
    if len(candidates) == 1:
        return [[candidates[0]]]
    pair = random.sample(candidates, 2)
    pair.sort(key=queue_of)
    return [[pair[0]], [pair[1]]]
