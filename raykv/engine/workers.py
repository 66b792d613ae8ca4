"""An in-process worker group: every tensor-parallel rank in this process, one after another.

Each rank owns its shard of the KV cache (its KV heads of every block), its shard of the CPU
pool, a transfer engine (and with a disk tier its directory of chunk files and a disk engine),
the model's shard, the connector's worker half and the rank runner that orders a step; the
configured faults are wrapped around the transfer engines and the rank here, once. The Ray
deployment wraps exactly these objects in actors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raykv.config import RaykvConfig
from raykv.connector.worker import ConnectorWorker
from raykv.core.step import BlockContent, StepPlan, StepReport
from raykv.engine.disk_tier import disk_slots
from raykv.engine.rank_runner import ModelBackend, RankRunner
from raykv.engine.ranks import RankFailed, StepHandle, run_now
from raykv.engine.shared_tier import SharedRuntime, shared_enabled, shared_engine
from raykv.engine.tier_namespace import chunk_identity, describe, disk_rank_root
from raykv.faults import (
    FaultyBackend,
    FaultyRank,
    FaultyTier,
    Rank,
    RankDied,
    RankFaults,
    parse_fault,
    strikes_at,
)
from raykv.model.synthetic import SyntheticModel
from raykv.transfer.checksums import RowChecksums
from raykv.transfer.disk import DiskTransferEngine
from raykv.transfer.layout import KVLayout
from raykv.transfer.pool_files import PoolFiles, remove_generations, sweep_stale
from raykv.transfer.populate import populate_in_background
from raykv.transfer.rank import build_rank
from raykv.transfer.shared_store import StoreEndpoint

# a rank replacing a dead one waits this long for its predecessor's process to let go of the
# disk tier's directory (a killed process can run on for a moment)
PREDECESSOR_EXIT_S = 20.0

ExecDelay = Callable[[int], int]  # job id -> steps its copy stays pending (unthreaded engines)


AllReduce = Callable[[Any], Any]  # sums a tensor over the ranks' TP group


def real_model(
    cfg: RaykvConfig, rank: int, device: Any, all_reduce: AllReduce | None = None
) -> ModelBackend:
    """This rank's shard of the checkpoint at ``model.path``. At TP > 1 the shards compute
    together through ``all_reduce``, which only ranks in processes of their own have (the Ray
    deployment): one process runs a real model at TP 1."""
    from raykv.model.backend import LlmModel
    from raykv.model.checkpoint import resolve

    tp = cfg.parallel.tensor_parallel_size
    if tp != 1 and all_reduce is None:
        raise ValueError(
            f"parallel.tensor_parallel_size {tp}: a real model's ranks need processes of their "
            "own (--engine ray); the one-process engine runs it at 1"
        )
    assert cfg.model.path is not None
    return LlmModel(
        resolve(cfg.model.path),
        cfg.cache.block_size,
        cfg.model.dtype,
        device,
        rank=rank,
        tp_size=tp,
        all_reduce=all_reduce,
        cache_dir=cfg.model.cache_dir,
    )


def make_layout(cfg: RaykvConfig, num_slots: int) -> KVLayout:
    return KVLayout(
        num_gpu_blocks=cfg.cache.num_gpu_blocks,
        block_size=cfg.cache.block_size,
        num_groups=len(cfg.cache.groups),
        layers_per_group=cfg.layers_per_group,
        kv_heads=cfg.kv_heads_per_rank,
        head_dim=cfg.model.head_dim,
        dtype=cfg.model.dtype,
        blocks_per_chunk=cfg.offload.blocks_per_chunk,
        num_slots=max(1, num_slots),
    )


def disk_engine(
    cfg: RaykvConfig,
    rank: int,
    pool: Any,
    layout: KVLayout,
    sums: RowChecksums,
    incarnation: int = 0,
    predecessor_gone: bool = False,
) -> DiskTransferEngine | None:
    """This rank's disk engine over its directory of the namespace (None: no disk tier).
    ``predecessor_gone``: a dead predecessor has let go of what it held (one in this process,
    whose ``die`` returned), so its directory is not waited for."""
    d = cfg.offload.disk
    if not (cfg.offload.enabled and d.enabled):
        return None
    if rank == 0:
        describe(cfg)
    return DiskTransferEngine(
        disk_rank_root(cfg, rank),
        pool,
        layout,
        io_threads=d.io_threads,
        direct_io=d.direct_io,
        fsync=d.fsync,
        sums=sums,
        # evicted files kept to be written over: a full tier evicts one for each it writes
        max_free_files=max(64, disk_slots(cfg) // 16),
        # a rank replacing a dead one takes its directory once its process has exited
        claim_wait_s=PREDECESSOR_EXIT_S if incarnation and not predecessor_gone else 0.0,
        identity=chunk_identity(cfg, rank),
    )


class LocalWorker:
    """One rank, in this process."""

    def __init__(
        self,
        cfg: RaykvConfig,
        rank: int,
        num_slots: int,
        exec_delay: ExecDelay | None = None,
        threaded: bool = True,
        incarnation: int = 0,
        pool_path: str | None = None,
        all_reduce: AllReduce | None = None,
        store: StoreEndpoint | None = None,
        predecessor_gone: bool = False,
    ) -> None:
        """``predecessor_gone``: a dead predecessor in this process has let go of what it held
        (its directory is not waited for). ``pool_path``: keep the CPU-pool shard in that
        shared-memory file (attached if a dead
        predecessor left it). ``all_reduce``: a real model's collective over the TP group.
        ``store``: where the shared tier's store is (None: no shared tier)."""
        self.rank = rank
        self.layout = make_layout(cfg, num_slots)
        self.faults = RankFaults(rank, [parse_fault(f) for f in cfg.faults], incarnation)
        res = build_rank(
            self.layout,
            rank,
            cfg.parallel.device,
            threaded=threaded and cfg.copy_thread(),
            exec_delay=exec_delay,
            pool_path=pool_path,
        )
        self.kv, self.pool, self.engine = res.kv, res.pool, res.engine
        # the synthetic model checks any run's bytes (a real model's rank runs beside it)
        tp = cfg.parallel.tensor_parallel_size
        self.model = SyntheticModel(self.layout, rank, tp, device=self.kv.device)
        self.shared = res.shared
        if pool_path is not None:
            remove_generations(pool_path, keep=True)
        self.pool_attached = res.pool_attached
        backend = FaultyBackend(self.engine, self.faults) if self.faults.active else self.engine
        kv, model = self.kv, self.model
        verify = lambda block, content: model.verify(kv, block, content)  # noqa: E731
        step_model: ModelBackend = model
        if cfg.model.path is not None:
            step_model, verify = real_model(cfg, rank, kv.device, all_reduce), None
        self.disk = disk_engine(
            cfg, rank, self.pool, self.layout, self.engine.checksums, incarnation, predecessor_gone
        )
        if self.disk is not None and incarnation > 0:
            self.disk.index()  # sweeps the temporary files a predecessor died writing
        disk = self.disk
        if disk is not None and self.faults.tier_active("disk"):
            disk = FaultyTier(disk, self.faults, "disk")
        self.store = shared_engine(
            cfg, rank, self.pool, self.layout, self.engine.checksums, store, incarnation
        )
        store_engine = self.store
        if store_engine is not None and self.faults.tier_active("shared"):
            store_engine = FaultyTier(store_engine, self.faults, "shared")
        self.connector = ConnectorWorker(rank, backend, verify, disk, store_engine)
        self.runner: Rank = RankRunner(rank, self.connector, step_model, kv, cfg.cache.block_size)
        if self.faults.active:
            self.runner = FaultyRank(self.runner, self.faults)
        # a private pool's pages faulted in now, in the background, not by each slot's first
        # store, promotion or disk read (as the vLLM adapter's); last, so the memory it checks
        # has the model's weights out of it. A shard in shared memory had its pages allocated
        # and zeroed when its file was made
        self.populator = (
            populate_in_background(self.pool, cfg.parallel.tensor_parallel_size)
            if self.shared is None
            else None
        )

    def execute(self, plan: StepPlan) -> StepReport:
        return self.runner.execute(plan)

    def disk_index(self) -> tuple[str, list[int]]:
        """How this rank's disk engine does its I/O (``direct`` or ``buffered``) and the keys
        whose files its directory holds (``("", [])``: no disk tier)."""
        if self.disk is None:
            return "", []
        return self.disk.io_mode, self.disk.index()

    def held_jobs(self) -> list[int]:
        """Jobs whose completion this rank has not reported yet (late acks)."""
        return self.runner.held_jobs() if isinstance(self.runner, FaultyRank) else []

    def verify_cpu_tier(self, items: list[tuple[int, int, BlockContent]]) -> tuple[int, int]:
        """Compare this rank's CPU-pool shard with what each listed block must hold; returns
        (blocks checked, mismatches)."""
        bad = sum(
            not self.model.verify_row(self.pool, self.layout, slot, sub, content)
            for slot, sub, content in items
        )
        return len(items), bad

    def die(self) -> bool:
        """What a crash leaves behind, in one process: queued copies dropped, the copy under
        way finished, the pool file kept. Whether the pool is safe to take over: False where a
        tier's I/O thread was left behind in a system call (a bounded wait: a read it finishes
        later would still land in the pool's slot, under its checksum)."""
        if self.populator is not None:
            self.populator.stop()  # it holds the pool: the replacement's memory is counted
        self.engine.shutdown(wait=False)
        stuck = 0
        if self.disk is not None:
            stuck += self.disk.shutdown(wait=False)
        if self.store is not None:
            stuck += self.store.shutdown(wait=False)
        if self.shared is not None:
            self.shared.unpin()
        return stuck == 0

    def shutdown(self) -> None:
        if self.populator is not None:
            self.populator.stop()
        self.engine.shutdown()
        if self.disk is not None:
            self.disk.shutdown()
        if self.store is not None:
            self.store.shutdown()
        if self.shared is not None:
            self.shared.unpin()
            remove_generations(self.shared.path)


class LocalWorkerGroup:
    """Every rank in this process; ``execute`` runs a plan on each and gathers the reports."""

    def __init__(
        self,
        cfg: RaykvConfig,
        num_slots: int,
        exec_delays: dict[int, ExecDelay] | None = None,
        threaded: bool = True,
    ) -> None:
        """``exec_delays`` (per rank) keep copies really pending for a number of steps; with
        ``threaded=False`` copies run only at each step's poll, so a seeded test reproduces the
        same interleaving every time. Late, lost and duplicated acks are faults
        (``cfg.faults``)."""
        self._cfg, self._num_slots, self._threaded = cfg, num_slots, threaded
        self._execs = exec_delays or {}
        self._faults = [parse_fault(f) for f in cfg.faults]
        self.incarnations = [0] * cfg.parallel.tensor_parallel_size
        self._pool_generations = [0] * cfg.parallel.tensor_parallel_size  # each rank's shard file
        self.pool_files: PoolFiles | None = None
        if cfg.offload.enabled and cfg.offload.shared_pool:
            sweep_stale(cfg.offload.shared_pool_dir)
            self.pool_files = PoolFiles.new(cfg.offload.shared_pool_dir)
            # also when a test drops the group without shutdown, or the interpreter exits
            weakref.finalize(self, self.pool_files.remove)
        # the shared tier's store: its master, this process's segment, the scheduler's index
        self.shared_runtime = SharedRuntime(cfg) if shared_enabled(cfg) else None
        self.store_index = self.shared_runtime.index if self.shared_runtime else None
        self.workers: list[LocalWorker] = []
        try:
            for rank in range(cfg.parallel.tensor_parallel_size):
                self.workers.append(self._make(rank))
        except BaseException:
            for made in self.workers:  # their threads, clients and directory locks
                made.shutdown()
            if self.shared_runtime is not None:
                self.shared_runtime.close()
            raise
        # async scheduling with copy threads: the ranks run a step on a thread of their own
        # while the engine plans the next (the model and copies release the GIL)
        self._step_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="raykv-step")
            if threaded and cfg.engine.async_scheduling
            else None
        )

    def _make(self, rank: int, fresh_pool: bool = False) -> LocalWorker:
        pool_path = None
        if self.pool_files is not None:
            if fresh_pool:
                self._pool_generations[rank] = self.incarnations[rank]
            pool_path = self.pool_files.path(rank, self._pool_generations[rank])
        return LocalWorker(
            self._cfg,
            rank,
            self._num_slots,
            self._execs.get(rank),
            self._threaded,
            self.incarnations[rank],
            pool_path,
            store=self.shared_runtime.endpoint if self.shared_runtime is not None else None,
            predecessor_gone=True,  # in this process: its die() has returned
        )

    @property
    def num_ranks(self) -> int:
        return len(self.workers)

    def execute(self, plan: StepPlan) -> list[StepReport]:
        """Every rank runs the plan; a rank that dies is reported in ``RankFailed`` with the
        replies of the others (they ran the step, as real ranks would have)."""
        runtime = self.shared_runtime
        if runtime is not None and strikes_at(self._faults, "kill-shared-master", plan.step):
            runtime.kill_master()
        if runtime is not None and strikes_at(self._faults, "kill-store-actor", plan.step):
            runtime.kill_segment()
        reports, dead = [], []
        for w in self.workers:
            try:
                reports.append(w.execute(plan))
            except RankDied:
                dead.append(w.rank)
        if dead:
            raise RankFailed(dead, reports)
        return reports

    def submit(self, plan: StepPlan) -> StepHandle:
        """Run the plan on the step thread (async scheduling), else at once."""
        if self._step_thread is None:
            return run_now(self.execute, plan)
        return self._step_thread.submit(self.execute, plan)  # a Future: ``result`` waits

    def restart(self, ranks: list[int]) -> bool:
        """Replace dead ranks with fresh ones (empty KV shard). Returns whether every new rank
        found its predecessor's CPU-pool shard (shared memory); otherwise the shard is empty."""
        intact = True
        for rank in ranks:
            reusable = self.workers[rank].die()
            self.incarnations[rank] += 1
            # a pool a left-behind thread may still write into is not taken over: the
            # replacement starts a fresh one (a generation of its own), the CPU tier empty
            self.workers[rank] = self._make(rank, fresh_pool=not reusable)
            intact &= self.workers[rank].pool_attached
        return intact

    def disk_index(self) -> list[tuple[str, list[int]]]:
        """Each rank's disk-tier I/O and keys (``LocalWorker.disk_index``)."""
        return [w.disk_index() for w in self.workers]

    def verify_cpu_tier(self, items: list[tuple[int, int, BlockContent]]) -> tuple[int, int]:
        """Every rank's CPU-pool shard against ``EngineCore.cpu_tier_contents()``."""
        results = [w.verify_cpu_tier(items) for w in self.workers]
        return sum(r[0] for r in results), sum(r[1] for r in results)

    def for_each(self, fn: Callable[[LocalWorker], None]) -> None:
        for w in self.workers:
            fn(w)

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown()
        for w in self.workers:
            w.shutdown()
        if self.shared_runtime is not None:
            self.shared_runtime.close()
            self.shared_runtime = None
        if self.pool_files is not None:
            self.pool_files.remove()

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
