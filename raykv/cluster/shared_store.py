"""The shared tier on a Ray cluster: the store's master and one store actor per node.

The pool's memory must outlive any engine: a replica that dies, restarts or is scaled down
loses nothing of it. So it belongs to named, detached actors in raykv's Ray namespace, made by
whichever engine first needs them and found by the rest:

- ``raykv-shared-master``: an embedded ``mooncake_master`` (``offload.shared.master:
  embedded``), on the node that first asked for it, listening on that node's address. A master
  at ``host:port`` is the operator's and is only joined.
- ``raykv-shared-store-<node id>``: the node's segment of the pool (``offload.shared.segment``
  bytes of its DRAM), mounted by the actor's own process. Ray restarts one that dies with a
  fresh, empty segment: what the old one held is gone (hits on it fail their reads and are
  recomputed), and the pool has its memory again.

Ranks and schedulers call :func:`join_shared_store` where they are built; it returns where their
own clients join (the master and this node's address). ``stop_shared_store`` ends the actors
(an embedded Ray instance ends them with itself).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.cluster.runtime import NAMESPACE
from raykv.config import RaykvConfig
from raykv.config.shared import EMBEDDED
from raykv.engine.tier_namespace import namespace
from raykv.transfer.shared_store import (
    SharedStoreError,
    SharedUnavailable,
    StoreEndpoint,
    StoreIndex,
)

log = logging.getLogger(__name__)

MASTER_NAME = "raykv-shared-master"
STORE_PREFIX = "raykv-shared-store-"
JOIN_TIMEOUT_S = 60.0  # an actor's start: a master's, or a segment's mount


class SharedMaster:
    """An embedded ``mooncake_master`` for the cluster, on this actor's node (it dies with the
    actor's process)."""

    def __init__(self) -> None:
        from raykv.transfer.shared_master import EmbeddedMaster

        self.master = EmbeddedMaster(host=ray.util.get_node_ip_address())
        self.master.start()

    def address(self) -> str:
        return self.master.address

    def kill(self) -> None:
        """End the master at once (``kill-shared-master``): the actor stays, without it."""
        log.warning("fault: killing the shared tier's embedded master")
        self.master.kill()

    def stop(self) -> None:
        self.master.stop()


class NodeStore:
    """This node's segment of the pool, mounted by the actor's process for as long as it lives."""

    def __init__(self, endpoint: StoreEndpoint, segment_bytes: int) -> None:
        from raykv.transfer.shared_store import SegmentHolder

        self.holder: Any = SegmentHolder(endpoint, segment_bytes)
        self.segment_bytes = segment_bytes

    def segment(self) -> int:
        """Bytes of DRAM it gives the pool."""
        return self.segment_bytes

    def healthy(self) -> bool:
        return self.holder is not None and self.holder.healthy()

    def close(self) -> None:
        """Unmount the segment (the master forgets what it held)."""
        holder, self.holder = self.holder, None
        if holder is not None:
            holder.close()


def _named(cls: type, name: str, **options: Any) -> Any:
    """The named, detached actor in raykv's namespace: found where it exists, made otherwise
    (two engines asking at once get the same one)."""
    return ray.remote(cls).options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        **options,
    )


def master_address(cfg: RaykvConfig) -> str:
    """``offload.shared.master``, or the embedded master's address (started where none runs)."""
    configured = cfg.offload.shared.master
    if configured != EMBEDDED:
        return configured
    # the master itself is cheap to lose and to restart, but a new one knows no object the old
    # one held: it is not restarted behind the engines' backs (they pause the tier and retry)
    master = _named(SharedMaster, MASTER_NAME).remote()
    return ray.get(master.address.remote(), timeout=JOIN_TIMEOUT_S)


def node_store(cfg: RaykvConfig, endpoint: StoreEndpoint, node_id: str) -> Any:
    """The store actor of ``node_id`` (made, mounting ``offload.shared.segment``, where none
    runs there), once its segment is mounted."""
    store = _named(
        NodeStore,
        STORE_PREFIX + node_id,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_restarts=-1,
    ).remote(endpoint, cfg.offload.shared.segment)
    ray.get(store.segment.remote(), timeout=JOIN_TIMEOUT_S)
    return store


def join_shared_store(cfg: RaykvConfig, with_segment: bool = True) -> StoreEndpoint | None:
    """Where this process's clients join the store (None: no shared tier): the master (the
    embedded one started where none runs) and this node's address; with ``with_segment``, once
    this node's store actor has mounted its segment. ``SharedUnavailable`` naming
    ``offload.shared.master`` when the store cannot be joined."""
    if not (cfg.offload.enabled and cfg.offload.shared.enabled):
        return None
    s = cfg.offload.shared
    try:
        endpoint = StoreEndpoint(
            master_address(cfg),
            host=ray.util.get_node_ip_address(),
            protocol=s.protocol,
            devices=s.devices,
            timeout_s=s.timeout_s,
        )
        if with_segment:
            node_store(cfg, endpoint, ray.get_runtime_context().get_node_id())
    except (SharedStoreError, ray.exceptions.RayError) as exc:
        raise SharedUnavailable(f"offload.shared.master: {_reason(exc)}") from exc
    return endpoint


def scheduler_index(cfg: RaykvConfig) -> StoreIndex | None:
    """The scheduler's client of the store (None: no shared tier): it asks which of a
    request's chunks every rank's part is there for, and gives no segment of its own."""
    endpoint = join_shared_store(cfg, with_segment=False)
    if endpoint is None:
        return None
    try:
        return StoreIndex(endpoint, namespace(cfg), cfg.parallel.tensor_parallel_size)
    except SharedStoreError as exc:
        raise SharedUnavailable(f"offload.shared.master: {exc}") from exc


def _reason(exc: BaseException) -> str:
    """The first line of why an actor failed (its cause where Ray wraps one)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__


def kill_node_store(node_id: str) -> bool:
    """Kill the store actor of ``node_id`` (``kill-store-actor``): its segment and what it held
    are gone; Ray restarts it with an empty one. False where none runs there."""
    try:
        store = ray.get_actor(STORE_PREFIX + node_id, namespace=NAMESPACE)
    except ValueError:
        return False
    log.warning("fault: killing the shared tier's store actor on node %s", node_id[:8])
    ray.kill(store, no_restart=False)
    return True


def kill_master() -> bool:
    """End the embedded master (``kill-shared-master``); False where none runs."""
    try:
        master = ray.get_actor(MASTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.get(master.kill.remote(), timeout=JOIN_TIMEOUT_S)
    return True


def stop_shared_store() -> None:
    """End every store actor (their segments unmounted where the master answers) and the
    embedded master."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") != NAMESPACE or not actor["name"].startswith(STORE_PREFIX):
            continue
        with contextlib.suppress(Exception):
            store = ray.get_actor(actor["name"], namespace=NAMESPACE)
            with contextlib.suppress(Exception):
                ray.get(store.close.remote(), timeout=15)
            ray.kill(store, no_restart=True)
    with contextlib.suppress(Exception):
        master = ray.get_actor(MASTER_NAME, namespace=NAMESPACE)
        with contextlib.suppress(Exception):
            ray.get(master.stop.remote(), timeout=15)
        ray.kill(master, no_restart=True)
