"""Transfer jobs and their acknowledgements.

A job is one request's transfer in one direction for one step, or one move between the CPU tier
and the disk tier (a demotion or a promotion, which belongs to the tiers, not to a request). It
is final only when every rank has reported it (success or failure): a rank that failed still
holds a claim on the job's CPU slots until every other rank is done with them too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raykv.core.request import Request


@dataclass(slots=True)
class TransferJobStatus:
    """One in-flight job, as the scheduler tracks it."""

    job_id: int
    # the one admission of a request this job belongs to (never just its id: ids come back);
    # None for a move between tiers
    request: Request | None
    pending_count: int  # ranks that have not reported yet
    keys: list[int]
    is_store: bool  # a move: True for a demotion (it stores into the disk tier)
    # GPU source blocks in the fence since the job was created (sliding-window groups, and every
    # block of a store built after its request finished)
    fenced_block_ids: list[int] = field(default_factory=list)
    # full-attention source blocks, protected by the running request; fenced when it finishes
    deferred_fence_block_ids: list[int] = field(default_factory=list)
    deferred_fenced: bool = False
    acked_ranks: int = 0  # bitmask: a rank counts at most once
    failed: bool = False
    created_step: int = 0
    move: str = ""  # "demote" or "promote" for a move between tiers; "" for a GPU job
    created_s: float = 0.0  # wall clock when planned (how long the tiers take, measured)

    @property
    def req_id(self) -> str:
        return self.request.req_id if self.request is not None else f"<{self.move}>"


@dataclass(slots=True)
class AckStats:
    acks: int = 0
    unknown: int = 0
    stale: int = 0
    duplicate: int = 0
    bad_rank: int = 0


# how old a move between the tiers must also be, in seconds, before its unacked ranks count as
# silent: the shared store's (``connector/shared_moves.py``) well past its own timeouts (seconds
# per operation), the disk's past a slow disk's I/O (an idle engine runs hundreds of steps a
# second: counted in steps alone, an 800 ms promotion declared its rank dead)
MOVE_AGE_S = {"publish": 60.0, "fetch": 60.0, "promote": 30.0, "demote": 30.0}


class JobTable:
    """Job ids from one counter; acks counted at most once per (job, rank).

    ``reset`` starts a new epoch: ids below the threshold belong to work from before the reset and
    their acks are counted as stale and ignored.
    """

    def __init__(self, num_ranks: int) -> None:
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        self.num_ranks = num_ranks
        self.jobs: dict[int, TransferJobStatus] = {}
        self.next_id = 0
        self.stale_below = 0
        self.stats = AckStats()

    def create(
        self,
        request: Request | None,
        keys: list[int],
        is_store: bool,
        fenced: list[int] | None = None,
        deferred: list[int] | None = None,
        step: int = 0,
        move: str = "",
    ) -> TransferJobStatus:
        job = TransferJobStatus(
            self.next_id, request, self.num_ranks, keys, is_store, fenced or [], deferred or []
        )
        job.created_step = step
        job.move = move
        job.created_s = time.perf_counter()
        self.jobs[job.job_id] = job
        self.next_id += 1
        return job

    def ack(self, job_id: int, rank: int, ok: bool = True) -> TransferJobStatus | None:
        """Count one rank's report; returns the job when this report made it final (it is then
        removed from the table)."""
        if not 0 <= rank < self.num_ranks:
            self.stats.bad_rank += 1
            return None
        job = self.jobs.get(job_id)
        if job is None:
            if job_id < self.stale_below:
                self.stats.stale += 1
            else:
                self.stats.unknown += 1
            return None
        bit = 1 << rank
        if job.acked_ranks & bit:
            self.stats.duplicate += 1
            return None
        self.stats.acks += 1
        job.acked_ranks |= bit
        job.failed |= not ok
        job.pending_count -= 1
        if job.pending_count:
            return None
        del self.jobs[job_id]
        return job

    def reset(self) -> list[TransferJobStatus]:
        """Forget every job (returning them) and start a new epoch."""
        jobs = list(self.jobs.values())
        self.jobs.clear()
        self.stale_below = self.next_id
        return jobs

    def silent_ranks(self, step: int, timeout_steps: int) -> list[int]:
        """Ranks that have not acked some job created ``timeout_steps`` or more steps ago. A
        move between the tiers counts only once it is also ``MOVE_AGE_S`` old: a rank that
        answers every step while its disk or the store takes its time (an unreachable master
        fails an operation after seconds; an idle engine's steps take milliseconds) is not
        dead."""
        silent = 0
        full = (1 << self.num_ranks) - 1
        now = time.perf_counter()
        for job in self.jobs.values():
            if step - job.created_step < timeout_steps:
                continue
            if job.move and now - job.created_s < MOVE_AGE_S.get(job.move, 0.0):
                continue
            silent |= full & ~job.acked_ranks
        return [r for r in range(self.num_ranks) if silent >> r & 1]

    def __len__(self) -> int:
        return len(self.jobs)
