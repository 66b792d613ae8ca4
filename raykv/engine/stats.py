"""One typed snapshot of an engine's counters: what the run report and the metrics both read.

Taking a snapshot copies the counters, so a reader can keep it while the engine steps on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from msgspec import structs

from raykv.connector.jobs import AckStats
from raykv.connector.shared_moves import SharedMoveStats
from raykv.connector.stats import ConnectorStats
from raykv.connector.tier_moves import DiskMoveStats
from raykv.core.step import TransferStats
from raykv.engine.step_output import SchedulerStats
from raykv.offload.directory import DirectoryStats

if TYPE_CHECKING:
    from raykv.engine.core import EngineCore


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters of one engine (the CPU-tier parts are None without offloading)."""

    steps: int
    idle_steps: int  # steps with no tokens scheduled (polling and acking only)
    rank_restarts: int  # ranks that died or went silent and were replaced
    tier_kept_restarts: int  # of those, restarts after which the CPU tier was kept
    finished: int
    prompt_tokens: int
    generated_tokens: int
    step_seconds: float  # the engine's steps, and the slowest rank's own work in them
    ranks_busy_seconds: float
    scheduler: SchedulerStats
    transfer: TransferStats  # summed over ranks
    per_rank: list[TransferStats] = field(default_factory=list)
    connector: ConnectorStats | None = None
    directory: DirectoryStats | None = None
    acks: AckStats | None = None
    jobs_in_flight: int = 0
    disk: DirectoryStats | None = None  # the disk tier (None: none)
    disk_moves: DiskMoveStats | None = None
    shared: DirectoryStats | None = None  # the shared tier's index of the store (None: none)
    shared_moves: SharedMoveStats | None = None
    disk_warm_chunks: int = 0  # chunks a warm start found in the disk tier's files
    disk_io: str | None = None  # direct (O_DIRECT) or buffered
    # which tier hits were worth loading (``offload.take_hits: faster``): hits passed over as
    # slower than recomputing, hits loaded anyway to keep measuring, the current estimates
    skipped_slower: dict[str, int] = field(default_factory=dict)
    probes: dict[str, int] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)
    ranks_model_seconds: float = 0.0  # of ranks_busy_seconds, the model's own
    busy_step_seconds: float = 0.0  # of step_seconds, the steps that computed tokens


def snapshot(engine: EngineCore) -> EngineStats:
    """The engine's counters now."""
    t = engine.totals
    c = engine.connector
    costs = c.costs if c is not None else None
    return EngineStats(
        steps=t.steps,
        idle_steps=t.idle_steps,
        rank_restarts=t.rank_restarts,
        tier_kept_restarts=t.tier_kept_restarts,
        finished=t.finished,
        prompt_tokens=t.prompt_tokens,
        generated_tokens=t.generated_tokens,
        step_seconds=t.step_seconds,
        ranks_busy_seconds=t.ranks_busy_seconds,
        ranks_model_seconds=t.ranks_model_seconds,
        busy_step_seconds=t.busy_step_seconds,
        scheduler=replace(engine.scheduler.stats),
        transfer=structs.replace(t.transfer),
        per_rank=[structs.replace(r) for r in t.per_rank],
        connector=replace(c.stats) if c is not None else None,
        directory=c.directory.stats() if c is not None else None,
        acks=replace(c.jobs.stats) if c is not None else None,
        jobs_in_flight=len(c.jobs) if c is not None else 0,
        disk=c.moves.disk.stats() if c is not None and c.moves is not None else None,
        disk_moves=replace(c.moves.stats) if c is not None and c.moves is not None else None,
        shared=c.shared_moves.shared.stats() if c and c.shared_moves is not None else None,
        shared_moves=replace(c.shared_moves.stats) if c and c.shared_moves is not None else None,
        disk_warm_chunks=engine.disk_start.taken,
        disk_io=engine.disk_start.io,
        skipped_slower=dict(costs.skipped_slower) if costs is not None else {},
        probes=dict(costs.probes) if costs is not None else {},
        costs=costs.summary() if costs is not None else {},
    )


def drain_books(engine: EngineCore) -> dict[str, int]:
    """What must all be 0 once a run has drained (DESIGN invariant 4), read now: jobs in the job
    table, GPU blocks fenced by unfinished stores, per-request connector states, CPU-tier slots
    being written or read, requests still waiting for a load, and GPU blocks not free. Empty
    without offloading (there are no such books)."""
    c = engine.connector
    if c is None:
        return {}
    d = c.directory.stats()
    k = c.moves.disk.stats() if c.moves is not None else None
    x = c.shared_moves.shared.stats() if c.shared_moves is not None else None
    pool = engine.pool
    return {
        "jobs": len(c.jobs),
        "fence": len(c.fence),
        "tracked": c.tracked(),
        "writing": d.writing,
        "reading": d.reading,
        "disk_writing": k.writing if k is not None else 0,
        "disk_reading": k.reading if k is not None else 0,
        "shared_writing": x.writing if x is not None else 0,
        "shared_reading": x.reading if x is not None else 0,
        "loading": len(engine.scheduler.loading),
        "gpu_blocks_leaked": pool.num_usable - pool.num_free,
    }
