"""The rank actor: one ``RankWorker`` per tensor-parallel rank.

It wraps the one-process engine's ``LocalWorker`` unchanged (KV shard, CPU pool shard, transfer
engine, model shard, connector worker half). A replacement rank takes over its predecessor's
CPU-pool shard once the predecessor's process is gone (:func:`spawn_rank_worker` passes it the
predecessor's file and process).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raykv.config import RaykvConfig
from raykv.core.step import StepPlan, StepReport
from raykv.faults import RankDied
from raykv.transfer.pool_files import hold, owner_of, process_id, successor_path, sweep_stale

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
        import torch  # noqa: F401  (pay the import here, not in the first step)

        from raykv.engine.workers import LocalWorker

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
        self.worker = LocalWorker(
            self.cfg, rank, num_slots, incarnation=incarnation, pool_path=pool_path
        )

    def ready(self) -> RankInfo:
        """Answers once the rank is built."""
        w = self.worker
        return RankInfo(process_id(), self.pool_path if w.shared else None, w.pool_attached)

    def execute(self, plan: StepPlan) -> StepReport:
        return self.worker.execute(plan)

    def execute_blob(self, blob: bytes) -> bytes:
        """``execute`` over pickled bytes: the scheduler pickles a step's plan once for every
        rank, which costs a fraction of Ray serializing the dataclasses anew for each call."""
        try:
            report = self.worker.execute(pickle.loads(blob))
        except RankDied:
            os._exit(1)  # an injected death is a real one: the process goes, memory and all
        return pickle.dumps(report, protocol=5)

    def verify_cpu_tier(self, items: list[Any]) -> tuple[int, int]:
        return self.worker.verify_cpu_tier(items)

    def echo(self, payload: Any) -> int:
        """A bare round trip (the yardstick of ``raykv bench step --engine ray``)."""
        return 0

    def shutdown(self) -> None:
        self.worker.shutdown()
        if self._lease is not None:
            os.close(self._lease)
            self._lease = None


def spawn_rank_worker(
    cfg_json: dict[str, Any],
    rank: int,
    incarnation: int,
    pg: Any,
    pool_path: str | None = None,
    predecessor: tuple[int, int | None] | None = None,
) -> Any:
    """A ``RankWorker`` actor for ``rank`` in bundle ``rank`` of the placement group."""
    cfg = RaykvConfig.model_validate(cfg_json)
    cuda = cfg.parallel.device == "cuda"
    options: dict[str, Any] = {"num_cpus": 0 if cuda else 1, "num_gpus": 1 if cuda else 0}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank
        )
    return (
        ray.remote(RankWorker)
        .options(**options)
        .remote(cfg_json, rank, cfg.cpu_slots(), incarnation, pool_path, predecessor)
    )
