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

An embedded master that dies is started again on its port by its actor; the store actors mount
their segments on it again, and the engines' clients join it again (their tier paused
meanwhile).

Ranks and schedulers call :func:`join_shared_store` where they are built; it returns where their
own clients join (the master and this node's address). ``stop_shared_store`` ends the actors
(an embedded Ray instance ends them with itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.cluster.runtime import NAMESPACE
from raykv.config import RaykvConfig
from raykv.config.shared import EMBEDDED, cluster_secret
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
WATCH_S = 1.0  # how often the master's actor looks at its process, a store actor at the master


class SharedMaster:
    """An embedded ``mooncake_master`` for the cluster, on this actor's node (it dies with the
    actor's process), and the secret that seals its parts (made here, for as long as the actor
    lives: only the processes of this Ray cluster ask it). One that dies is started again on
    the same port within ``WATCH_S``, a new ``generation`` (it knows no object the old one
    held: reads of those fail and are recomputed, and the store actors mount their segments on
    it again)."""

    def __init__(self) -> None:
        from raykv.transfer.seal import new_secret
        from raykv.transfer.shared_master import EmbeddedMaster

        self._secret = new_secret()
        self.master = EmbeddedMaster(host=ray.util.get_node_ip_address())
        self.master.start()
        self._generation = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="raykv-master-watch").start()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            with self._lock:
                if self._stopping.is_set() or self.master.alive():
                    continue
                port = self.master.port
                self.master.stop()
                try:
                    self.master.start(port)
                except Exception as exc:  # the port taken meanwhile: tried again next time
                    log.warning("the shared tier's master did not start again: %s", exc)
                    continue
                self._generation += 1
                log.warning("the shared tier's master started again on port %d", port)

    def address(self) -> str:
        return self.master.address

    def joining(self) -> tuple[str, bytes]:
        """Where clients join, and the secret that seals the parts."""
        return self.master.address, self._secret

    def generation(self) -> int:
        """How many times it was started again."""
        return self._generation

    def kill(self) -> None:
        """End the master at once (``kill-shared-master``): the actor stays, and starts it
        again."""
        log.warning("fault: killing the shared tier's embedded master")
        with self._lock:
            self.master.kill()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self.master.stop()


class NodeStore:
    """This node's segment of the pool, mounted by the actor's process for as long as it lives
    (``watch``: mounted again each time the embedded master is started again)."""

    def __init__(self, endpoint: StoreEndpoint, segment_bytes: int, watch: bool) -> None:
        self.endpoint = endpoint
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._generation = _master_generation() if watch else 0
        self.holder: Any = _mount(endpoint, segment_bytes)
        if watch:
            threading.Thread(target=self._watch, daemon=True, name="raykv-store-watch").start()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            try:
                generation = _master_generation()
                if generation == self._generation:
                    continue
                with self._lock:
                    old, self.holder = self.holder, None
                    if old is not None:
                        old.close()
                    self.holder = _mount(self.endpoint, self.segment_bytes)
                    self._generation = generation
                log.warning("the shared tier's segment is mounted on the restarted master")
            except Exception as exc:  # the master not back yet: tried again next time
                log.debug("the shared tier's segment is not mounted again yet: %s", exc)

    def mounted(self) -> tuple[str, int]:
        """The master it is mounted on, and the bytes it gives."""
        return self.endpoint.master, self.segment_bytes

    def pid(self) -> int:
        return os.getpid()

    def healthy(self) -> bool:
        with self._lock:
            return self.holder is not None and self.holder.healthy()

    def close(self) -> None:
        """Unmount the segment (the master forgets what it held)."""
        with self._lock:
            holder, self.holder = self.holder, None
            if holder is not None:
                holder.close()


def _mount(endpoint: StoreEndpoint, segment_bytes: int) -> Any:
    from raykv.transfer.shared_store import SegmentHolder

    return SegmentHolder(endpoint, segment_bytes)


def _master_generation() -> int:
    master = ray.get_actor(MASTER_NAME, namespace=NAMESPACE)
    return ray.get(master.generation.remote(), timeout=JOIN_TIMEOUT_S)


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


def master_address(cfg: RaykvConfig) -> tuple[str, bytes]:
    """``offload.shared.master`` and the cluster's secret as this process has it, or the
    embedded master's address and secret (started where none runs)."""
    configured = cfg.offload.shared.master
    if configured != EMBEDDED:
        return configured, cluster_secret(cfg.offload.shared)
    # "DEFAULT": outside any placement group, so that it never goes with the replica (or run)
    # that happened to make it
    master = _named(SharedMaster, MASTER_NAME, scheduling_strategy="DEFAULT").remote()
    return ray.get(master.joining.remote(), timeout=JOIN_TIMEOUT_S)


def node_store(cfg: RaykvConfig, endpoint: StoreEndpoint, node_id: str) -> Any:
    """The store actor of ``node_id`` (made, mounting ``offload.shared.segment``, where none
    runs there), once its segment is mounted. One mounted on another master (an earlier run's)
    is replaced; one of another size is kept, and said."""
    s = cfg.offload.shared

    def made() -> Any:
        return _named(
            NodeStore,
            STORE_PREFIX + node_id,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_restarts=-1,
        ).remote(endpoint, s.segment, s.master == EMBEDDED)

    store = made()
    master, segment = ray.get(store.mounted.remote(), timeout=JOIN_TIMEOUT_S)
    if master != endpoint.master:
        log.warning("shared tier: the store actor of node %s served another master", node_id[:8])
        ray.kill(store, no_restart=True)
        store = made()
        master, segment = ray.get(store.mounted.remote(), timeout=JOIN_TIMEOUT_S)
    if segment != s.segment:
        log.warning(
            "shared tier: node %s gives the pool %d bytes (its store actor's), not "
            "offload.shared.segment (%d)",
            node_id[:8],
            segment,
            s.segment,
        )
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
        address, secret = master_address(cfg)
        endpoint = StoreEndpoint.of(s, address, secret, ray.util.get_node_ip_address())
        if with_segment and s.mount:
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
    """The last line of why an actor failed (its cause where Ray wraps one), without the
    exception's qualified type Ray's text puts before it."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    if not text:
        return type(cause).__name__
    return re.sub(
        r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Unavailable|Exception): ", "", text[-1]
    )


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
