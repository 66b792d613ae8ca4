"""The rank actor: one ``RankWorker`` per tensor-parallel rank.

It wraps the one-process engine's ``LocalWorker`` unchanged (KV shard, CPU pool shard, transfer
engine, model shard, connector worker half). A replacement rank takes over its predecessor's
CPU-pool shard once the predecessor's process is gone (:func:`spawn_rank_worker` passes it the
predecessor's file and process). A real model's ranks at TP > 1 also form a process group
(:mod:`raykv.model.tp_group`): rank 0 serves the rendezvous, every rank joins, and a rank
whose collective fails exits, like any dead rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raykv.cluster import wire
from raykv.config import ConfigError, RaykvConfig
from raykv.core.step import StepPlan, StepReport
from raykv.faults import RankDied
from raykv.transfer.pool_files import (
    PoolFiles,
    hold,
    owner_of,
    process_id,
    successor_path,
    sweep_stale,
)

if TYPE_CHECKING:  # torch is imported by the rank actors only, not by the driver
    from raykv.model.tp_group import Rendezvous, RendezvousAddress, TPGroup
    from raykv.transfer.shared_store import StoreEndpoint

# A replacement rank waits this long for its killed predecessor's process to exit before it maps
# the predecessor's CPU-pool shard; after that it takes a fresh one.
PREDECESSOR_EXIT_S = 20.0

READY_TIMEOUT_S = 300.0  # torch import and KV allocation on every rank, on a busy machine


@dataclass(slots=True)
class RankInfo:
    """What a rank actor reports once built."""

    process: tuple[int, int | None]  # pid and pid namespace (``process_id()``)
    pool_path: str | None  # its CPU-pool shard's file (None: private memory)
    attached: bool  # the shard is its predecessor's, finished chunks intact
    # the configuration error that kept it from being built (one line naming the key), said as
    # an answer rather than raised: Ray prints an actor's failed creation as a traceback
    refused: str | None = None


def ranks_ready(workers: list[Any]) -> list[RankInfo]:
    """Each rank's ``RankInfo`` once built; ``ConfigError`` (one line naming the key) where a
    rank refused its configuration."""
    infos: list[RankInfo] = ray.get([w.ready.remote() for w in workers], timeout=READY_TIMEOUT_S)
    for info in infos:
        if info.refused is not None:
            raise ConfigError(info.refused)
    return infos


class RankWorker:
    """One rank. Created with ``ray.remote``; holds its shard of the KV cache and CPU pool."""

    def __init__(
        self,
        cfg: dict[str, Any],
        rank: int,
        num_slots: int,
        incarnation: int = 0,
        pool_path: str | None = None,
        predecessor: tuple[int, int | None] | None = None,
    ) -> None:
        """``pool_path``: the shared-memory file of this rank's CPU-pool shard. A replacement
        rank gets its predecessor's path and process: once that process is gone it maps the file
        and finds the finished chunks intact (see
        :func:`raykv.transfer.pool_files.successor_path`)."""
        # torch is imported here (by the devices module), not in the first step
        from raykv.engine.workers import LocalWorker
        from raykv.transfer.devices import use_cpu_threads

        if pool_path is not None and predecessor is not None:
            pool_path = successor_path(pool_path, predecessor, PREDECESSOR_EXIT_S)
        self.pool_path = pool_path
        self._lease: int | None = None
        if pool_path is not None:
            # this node's leftovers of crashed runs (the driver sweeps only its own host), then
            # hold this rank's shard so that no sweep elsewhere removes it while it lives
            sweep_stale(os.path.dirname(pool_path), keep_owner=owner_of(pool_path))
            self._lease = hold(pool_path)

        self.cfg = RaykvConfig.model_validate(cfg)
        self.rank = rank
        par = self.cfg.parallel
        if par.device == "cpu":  # TP ranks on one node share its cores instead of each taking all
            use_cpu_threads(rank_threads(par.cpu_threads_per_rank, par.tensor_parallel_size))
        self._last_reply: tuple[int, bytes] | None = None  # (step, encoded report)
        self._rendezvous: Rendezvous | None = None
        self._group: TPGroup | None = None
        in_group = needs_tp_group(self.cfg)
        self._refused: str | None = None
        try:
            self.worker = LocalWorker(
                self.cfg,
                rank,
                num_slots,
                incarnation=incarnation,
                pool_path=pool_path,
                all_reduce=self._all_reduce if in_group else None,
                store=_store_of(self.cfg, incarnation),
            )
        except ConfigError as exc:  # a key at fault where the rank runs (a disk path, ...)
            self._refused = str(exc)

    def _all_reduce(self, tensor: Any) -> Any:
        if self._group is None:
            raise RuntimeError(f"rank {self.rank} computed before joining its TP group")
        return self._group.all_reduce(tensor)

    def open_rendezvous(self) -> RendezvousAddress:
        """Serve the TP group's rendezvous (rank 0) on this node's address."""
        from raykv.model.tp_group import Rendezvous

        timeout = self.cfg.parallel.collective_timeout_s
        self._rendezvous = Rendezvous(ray.util.get_node_ip_address(), timeout)
        return self._rendezvous.address

    def join_group(self, address: RendezvousAddress) -> None:
        """Join the TP group; returns once every rank has joined."""
        from raykv.model.tp_group import TPGroup

        par = self.cfg.parallel
        self._group = TPGroup(
            address,
            self.rank,
            par.tensor_parallel_size,
            device=par.device,
            host=ray.util.get_node_ip_address(),
            timeout_s=par.collective_timeout_s,
        )

    def ready(self) -> RankInfo:
        """Answers once the rank is built (or refused its configuration)."""
        if self._refused is not None:
            return RankInfo(process_id(), None, False, self._refused)
        w = self.worker
        return RankInfo(process_id(), self.pool_path if w.shared else None, w.pool_attached)

    def execute(self, plan: StepPlan) -> StepReport:
        return self.worker.execute(plan)

    def execute_blob(self, blob: bytes) -> bytes:
        """``execute`` over encoded bytes (``cluster/wire.py``): the scheduler encodes a step's
        plan once for every rank, which costs a fraction of Ray serializing the dataclasses anew
        for each call. The same method is the compiled graph's node
        (``parallel.control_plane: graph``)."""
        plan = wire.decode_plan(blob)
        try:
            report = self.worker.execute(plan)
        except RankDied:
            # an injected death is a real one: the process goes, memory and all; so does a rank
            # whose TP group broke (a peer died mid-collective)
            os._exit(1)
        reply = wire.encode(report)
        self._last_reply = (plan.step, reply)
        return reply

    def reply_to(self, step: int) -> bytes | None:
        """This rank's reply to ``step`` if it has finished it (None: not yet, or never got
        it): how the compiled graph's failure path tells a survivor from a silent rank, and
        keeps the survivors' acks. Answers on the actor's main thread while the graph's thread
        computes."""
        last = self._last_reply
        return last[1] if last is not None and last[0] == step else None

    def verify_cpu_tier(self, items: list[Any]) -> tuple[int, int]:
        return self.worker.verify_cpu_tier(items)

    def disk_index(self) -> tuple[str, list[int]]:
        """This rank's disk I/O and the keys its disk-tier directory holds (a warm start)."""
        return self.worker.disk_index()

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
        self.worker.shutdown()
        if self._lease is not None:
            os.close(self._lease)
            self._lease = None


def _store_of(cfg: RaykvConfig, incarnation: int) -> StoreEndpoint | None:
    """Where this rank joins the shared tier (None: no shared tier), once its node's store
    actor has mounted the node's segment. A replacement rank starts without the store where it
    cannot join it (the store may be what failed); a first one fails, naming the master."""
    from raykv.cluster.shared_store import join_shared_store
    from raykv.transfer.shared_store import SharedUnavailable

    try:
        return join_shared_store(cfg)
    except SharedUnavailable:
        if incarnation == 0:
            raise
        return None


def needs_tp_group(cfg: RaykvConfig) -> bool:
    """A real model split over ranks computes through a process group; the synthetic model's
    ranks never talk to each other."""
    return cfg.model.path is not None and cfg.parallel.tensor_parallel_size > 1


def rank_threads(configured: int | None, tp_size: int) -> int:
    """torch threads per CPU rank: as configured, or this node's cores shared by the ranks."""
    return configured or max(1, (os.cpu_count() or 1) // tp_size)


def rank_bundle(cfg: RaykvConfig) -> dict[str, float]:
    """The placement-group bundle one rank needs: a GPU on CUDA, else a CPU (what
    ``spawn_rank_worker`` asks for)."""
    return {"GPU": 1.0} if cfg.parallel.device == "cuda" else {"CPU": 1.0}


def spawn_ranks(
    cfg_json: dict[str, Any], pg: Any, pool_files: PoolFiles | None, first_bundle: int = 0
) -> list[Any]:
    """A fresh ``RankWorker`` for every rank (incarnation 0), each with its shard file in
    ``pool_files`` when the CPU pool is shared."""
    cfg = RaykvConfig.model_validate(cfg_json)
    return [
        spawn_rank_worker(
            cfg_json, rank, 0, pg, pool_files.path(rank) if pool_files else None, None, first_bundle
        )
        for rank in range(cfg.parallel.tensor_parallel_size)
    ]


def spawn_rank_worker(
    cfg_json: dict[str, Any],
    rank: int,
    incarnation: int,
    pg: Any,
    pool_path: str | None = None,
    predecessor: tuple[int, int | None] | None = None,
    first_bundle: int = 0,
) -> Any:
    """A ``RankWorker`` actor for ``rank`` in bundle ``first_bundle + rank`` of the placement
    group (a Serve replica's own process takes bundle 0 of its group, its ranks the rest)."""
    cfg = RaykvConfig.model_validate(cfg_json)
    cuda = cfg.parallel.device == "cuda"
    options: dict[str, Any] = {"num_cpus": 0 if cuda else 1, "num_gpus": 1 if cuda else 0}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=first_bundle + rank
        )
    return (
        ray.remote(RankWorker)
        .options(**options)
        .remote(cfg_json, rank, cfg.cpu_slots(), incarnation, pool_path, predecessor)
    )
