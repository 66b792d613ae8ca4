"""The actors: one ``RankWorker`` per tensor-parallel rank, one ``EngineServer`` (scheduler).

They wrap the one-process engine's objects unchanged: a worker is a ``LocalWorker`` (KV shard,
CPU pool shard, transfer engine, model shard, connector worker half); the server is an
``EngineCore`` whose worker group fans each step's plan out to the rank actors, one call per rank
per step, and gathers the replies.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raykv.config import RaykvConfig
from raykv.core.step import StepPlan, StepReport
from raykv.engine.core import RankFailed
from raykv.faults import RankDied, parse_fault, scheduler_dies_at
from raykv.transfer.pool_files import hold, owner_of, process_id, successor_path, sweep_stale

# The status ``take_finished`` (and so ``RaykvClient.stream``) gives a request that was refused.
REJECTED = "rejected"

# A replacement rank waits this long for its killed predecessor's process to exit before it maps
# the predecessor's CPU-pool shard; after that it takes a fresh one.
PREDECESSOR_EXIT_S = 20.0


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


class RayWorkerGroup:
    """The ranks, as the engine sees them: ``execute`` sends the plan to every rank actor and
    gathers the replies, one call per rank per step.

    The plan travels as one pickled blob (protocol 5) passed by value to every rank: measured on
    2 cores with ~1.5 KB plans, that costs 1.3-1.4x a bare round trip of the same bytes, where
    letting Ray serialize the dataclasses per call costs 2x and ``ray.put`` once then passing the
    reference 3.6x (an object-store round trip per step)."""

    def __init__(
        self,
        workers: list[Any],
        step_timeout_s: float | None = None,
        spawn: Callable[[int, int, RankInfo], tuple[Any, RankInfo]] | None = None,
    ) -> None:
        self.workers = workers
        self.step_timeout_s = step_timeout_s
        # (rank, incarnation, the predecessor's info) -> (a new ready RankWorker, its info)
        self.spawn = spawn
        self.incarnations = [0] * len(workers)
        self.infos: list[RankInfo] = (
            ray.get([w.ready.remote() for w in workers], timeout=READY_TIMEOUT_S)
            if spawn is not None
            else []
        )

    @property
    def num_ranks(self) -> int:
        return len(self.workers)

    def execute(self, plan: StepPlan) -> list[StepReport]:
        """One call per rank; a rank whose actor died, or that does not answer within the step
        timeout, is reported dead in ``RankFailed`` (with the others' replies)."""
        blob = pickle.dumps(plan, protocol=5)
        refs = [w.execute_blob.remote(blob) for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout_s)
        done = set(ready)
        reports, dead = [], []
        for rank, ref in enumerate(refs):
            if ref not in done:
                dead.append(rank)  # silent past the timeout: treated as dead, and replaced
                continue
            try:
                reports.append(pickle.loads(ray.get(ref)))
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                dead.append(rank)
        if dead:
            raise RankFailed(dead, reports)
        return reports

    def restart(self, ranks: list[int]) -> bool:
        """Replace the ranks; True when every new rank attached its predecessor's CPU-pool shard
        (it does once the predecessor's process has exited, which a killed one does within
        moments; one that lingers past ``PREDECESSOR_EXIT_S`` leaves its successor a fresh
        shard, and the CPU tier is emptied)."""
        if self.spawn is None:
            raise RuntimeError(f"ranks {ranks} died and this worker group cannot replace them")
        intact = True
        for rank in ranks:
            with contextlib.suppress(Exception):
                ray.kill(self.workers[rank], no_restart=True)
            self.incarnations[rank] += 1
            handle, info = self.spawn(rank, self.incarnations[rank], self.infos[rank])
            self.workers[rank], self.infos[rank] = handle, info
            intact &= info.attached
        return intact


class EngineServer:
    """The scheduler actor: engine core, connector scheduler half and directory.

    ``run`` drives a workload to the end; ``submit`` + ``start`` run a loop thread that serves
    requests as they come, and ``take_finished`` streams their outputs. The actor is threaded
    (created with ``max_concurrency``), so ``progress`` and ``take_*`` answer while a run goes on.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        workers: list[Any],
        verify: bool | None = None,
        check_invariants: bool = False,
        offload: bool | None = None,
        placement: Any = None,
        incarnation: int = 0,
    ) -> None:
        """``incarnation``: how many schedulers died before this one (a ``kill-scheduler``
        fault kills only the first)."""
        from raykv.engine.core import EngineCore
        from raykv.engine.run import Driver
        from raykv.metrics import EngineMetrics

        self.cfg = RaykvConfig.model_validate(cfg)
        self._cfg_json = cfg
        self._placement = placement
        self._incarnation = incarnation
        self._faults = [parse_fault(f) for f in self.cfg.faults]
        self.group = RayWorkerGroup(workers, self.cfg.parallel.step_timeout_s, self._spawn)
        self.engine = EngineCore(self.cfg, self.group, verify=verify, offload=offload)
        self.driver = Driver(self.engine, check_invariants=check_invariants)
        self.metrics = EngineMetrics(self.engine)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._loop: threading.Thread | None = None
        self._stop = False
        self._error: str | None = None
        self._rejected_taken = 0  # how many of the driver's refusals take_finished handed out

    # ---- batch runs -----------------------------------------------------------------------

    def run(self, specs: list[Any]) -> dict[str, Any]:
        """Run these requests to the end (every job acked) and return the report."""
        with self._lock:
            self.driver.submit(specs)
        while True:
            with self._lock:
                if not self.driver.has_work():
                    break
                self._step()
                self.driver.take_finished()  # a batch run reports outputs in its digest only
        return self.report()

    def _step(self) -> None:
        self.driver.step()
        self.metrics.update()
        if scheduler_dies_at(self._faults, self.engine.totals.steps, self._incarnation):
            os._exit(1)  # an injected death is a real one: the process goes, state and all

    def progress(self) -> dict[str, Any]:
        from raykv.engine.run import progress_of

        return {**progress_of(self.driver), "error": self._error}

    def report(self) -> dict[str, Any]:
        with self._lock:
            report = self.driver.report()
        report["engine"] = "ray"
        return report

    # ---- serving ----------------------------------------------------------------------------

    def submit(self, specs: list[Any]) -> int:
        with self._wake:
            self.driver.submit(specs)
            self._wake.notify_all()
            return self.driver.submitted

    def start(self) -> None:
        """Serve submitted requests from a loop thread until ``stop``."""
        if self._loop is None:
            self._loop = threading.Thread(target=self._serve, name="raykv-engine", daemon=True)
            self._loop.start()

    def _serve(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self.driver.has_work():
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        return
                    self._step()
        except Exception as exc:  # surfaced through progress(); the actor stays up to report it
            self._error = f"{type(exc).__name__}: {exc}"

    def take_finished(self) -> list[tuple[str, list[int], str, str | None]]:
        """Requests finished or refused since the last call: (request id, tokens, status,
        reason). A refused request (bad token id, too long, an id the engine still holds) has
        status ``rejected``, no tokens and the engine's error as its reason; None otherwise."""
        with self._lock:
            out: list[tuple[str, list[int], str, str | None]] = [
                (r.req_id, list(r.output), r.status.value, None)
                for r in self.driver.take_finished()
            ]
            refused = self.driver.rejected[self._rejected_taken :]
            self._rejected_taken += len(refused)
            out += [(r["request"], [], REJECTED, r["error"]) for r in refused]
            return out

    def take_events(self) -> list[Any]:
        """KV events (BlockStored / BlockRemoved, with sequence numbers) since the last call."""
        with self._lock:
            c = self.engine.connector
            return c.directory.take_events() if c is not None else []

    def idle(self) -> bool:
        with self._lock:
            return not self.driver.has_work()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._loop is not None:
            self._loop.join(timeout=30)

    def ping(self) -> float:
        return time.time()

    def books(self) -> dict[str, int]:
        """What must be empty once a run has drained: jobs, fence, request states, busy slots."""
        with self._lock:
            c = self.engine.connector
            if c is None:
                return {}
            d = c.directory.stats()
            return {
                "jobs": len(c.jobs),
                "fence": len(c.fence),
                "tracked": c.tracked(),
                "writing": d.writing,
                "reading": d.reading,
                "free_gpu_blocks": self.engine.pool.num_free,
                "usable_gpu_blocks": self.engine.pool.num_usable,
            }

    def verify_cpu_tier(self) -> tuple[int, int]:
        """Every rank's CPU-pool shard against what each readable chunk must hold: (blocks
        checked, mismatches). The directory must never serve a key whose bytes are gone."""
        with self._lock:
            items = self.engine.cpu_tier_contents()
            refs = [w.verify_cpu_tier.remote(items) for w in self.group.workers]
            results = ray.get(refs, timeout=READY_TIMEOUT_S)
        return sum(r[0] for r in results), sum(r[1] for r in results)

    def workers(self) -> list[Any]:
        """The rank actors now serving (replaced ones included)."""
        return list(self.group.workers)

    def _spawn(self, rank: int, incarnation: int, before: RankInfo) -> tuple[Any, RankInfo]:
        handle = spawn_rank_worker(
            self._cfg_json, rank, incarnation, self._placement, before.pool_path, before.process
        )
        return handle, ray.get(handle.ready.remote(), timeout=READY_TIMEOUT_S)


READY_TIMEOUT_S = 300.0  # torch import and KV allocation on every rank, on a busy machine


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
