"""Moves between the CPU tier and the disk tier: demotions, promotions, and the files to delete.

Both are jobs of the connector's job table, acked by every rank like loads and stores, and
belong to the tiers rather than to a request:

- **Demotion.** Each plan keeps a share of the CPU tier free (``offload.disk.reserve_fraction``)
  by giving up its coldest ready chunks (``Directory.start_leaving``). A chunk the disk tier
  already holds leaves at once; one the disk tier admits (its own policy and frequency filter)
  is written there by every rank from its own CPU-pool shard: its CPU slot stays pinned (being
  read, still readable by a load) and its disk entry being written until every rank has acked,
  then the slot is free and the disk copy readable. A chunk the disk tier refuses is dropped.
  Keeping room ahead means a store never waits for the disk; a store that finds no room anyway
  evicts from the CPU tier as it does without a disk (the report's ``cpu_evicted_undemoted``
  says how often the reserve fell short).
- **Promotion.** A lookup that reaches chunks only the disk tier holds has them read by every
  rank into fresh CPU slots (being written until every rank acked, the disk entries being read);
  the request waits (its lookup is deferred) and then loads them like any CPU hit. A promoted
  chunk stays on disk too, so its later eviction from the CPU tier writes nothing.

A move that fails leaves nothing readable that was not: a demotion's disk entry is dropped, a
promotion's CPU slots are freed. A source found corrupt (a file's checksums, or CPU bytes that
changed since their store) leaves its tier; a disk file any rank found bad is deleted on every
rank. A demotion that found the disk full stops demotions for ``retry_full_steps`` steps,
said once in the log; the run goes on with the CPU tier alone. (``lower_moves.py``: what the
disk's moves have in common with the shared tier's.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from raykv.connector.jobs import JobTable, TransferJobStatus
from raykv.connector.lower_moves import WAIT, LowerTierMoves
from raykv.connector.state import RequestOffloadState
from raykv.core.step import ChunkKeys, TierMove
from raykv.offload.directory import Directory

DEMOTE, PROMOTE = "demote", "promote"
MAX_MOVE_CHUNKS = 64  # chunks one demotion job writes at most


@dataclass(slots=True)
class DiskMoveStats:
    """The disk tier's moves, counted in chunks (and jobs)."""

    demotion_jobs: int = 0
    demoted: int = 0  # chunks written to disk and readable there
    demotions_failed: int = 0
    promotion_jobs: int = 0
    promoted: int = 0  # chunks read back into the CPU tier
    promotions_failed: int = 0
    corrupt: int = 0  # disk chunks found bad by a promotion (deleted)
    already_on_disk: int = 0  # CPU chunks given up that the disk tier already held
    not_admitted: int = 0  # CPU chunks given up that the disk tier refused (dropped)
    full_events: int = 0  # demotions that found the disk full
    unavailable_events: int = 0  # times the tier was taken out of use (its I/O kept failing)


class DiskMoves(LowerTierMoves):
    """Plans the disk tier's moves and closes them when their jobs are final."""

    name = "disk"

    def __init__(
        self,
        cpu: Directory,
        disk: Directory,
        jobs: JobTable,
        reserve_slots: int,
        check_sums: bool = False,
        retry_full_steps: int = 512,
    ) -> None:
        """``reserve_slots``: CPU slots kept free by demotions; ``check_sums``: moves check and
        carry the pool rows' checksums (``offload.verify``); ``retry_full_steps``: steps
        demotions stop after one found the disk full."""
        super().__init__(cpu, disk, retry_full_steps)
        self.disk = disk
        self.jobs = jobs
        self.reserve_slots = reserve_slots
        self.check_sums = check_sums
        self.stats = DiskMoveStats()
        self._room_wanted = 0  # free CPU slots a waiting promotion needs
        # told of the chunks leaving the CPU tier before they go (the shared tier's write-back)
        self.on_leaving: Callable[[list[int]], None] | None = None

    # ---- promotions (from a lookup) ------------------------------------------------------

    def promote(
        self,
        keys: Sequence[int],
        waiting: RequestOffloadState | None = None,
        keep: Sequence[int] = (),
    ) -> int | None:
        """Start reading these disk-only chunks into free CPU slots: the job's id; ``WAIT``
        when there are not enough free slots yet (the next plans demote to make them: a
        promotion evicts nothing that is not on disk already); None when the CPU tier could
        never hold them all at once beside ``keep``'s chunks there (what the request loads
        beside them). ``waiting``: the request that waits for them (if the promotion fails,
        it looks past the CPU tier no more). A promotion may take the slots the demotions
        keep free (the reserve): what it reads is on disk, so its chunks leave again without
        a write."""
        keys = list(dict.fromkeys(keys))
        if len(keys) > self.cpu.room_beside(keep):
            return None
        if len(keys) > self.cpu.num_free:
            self._room_wanted = max(self._room_wanted, len(keys))
            return WAIT
        plan = self.cpu.prepare_store(keys, admit_all=True)
        if plan is None:
            return None
        if plan.keys != keys:  # a key turned up in the CPU tier: never promote over it
            self.cpu.complete_store(plan.keys, success=False)
            return None
        slots = self.disk.prepare_load(keys)
        del slots  # a disk slot is only the tier's count of its room; files are named by key
        job = self.jobs.create(None, keys, False, step=self.step, move=PROMOTE)
        if waiting is not None:
            self._waiting[job.job_id] = waiting
        self._moves.append(TierMove.of(job.job_id, True, keys, plan.slots, self.check_sums))
        self.stats.promotion_jobs += 1
        return job.job_id

    def spill(self) -> None:
        """Have the next plan demote every chunk of the CPU tier nobody reads (a benchmark of
        the disk tier; a CPU tier handed to disk before a restart)."""
        self._room_wanted = self.cpu.capacity

    def drop_files(self, keys: Sequence[int]) -> None:
        """Have every rank delete these keys' files with the next plan (none of them is in the
        tier: a warm start's partial chunks, or those beyond its capacity)."""
        self._drops.extend(keys)

    # ---- the step's plan ---------------------------------------------------------------------

    def plan(self, step: int) -> tuple[list[TierMove], ChunkKeys]:
        """The moves to queue this step (demotions to keep room ahead, the promotions started
        since the last plan) and the disk keys whose files go."""
        self._demote(step)
        moves, drops = self._take_moves()
        return moves, ChunkKeys.of(drops)

    def writable(self, step: int) -> bool:
        """Demotions may write at ``step`` (the disk is neither full nor failing)."""
        return step >= max(self._paused_until, self._unavailable_until)

    def _demote(self, step: int) -> None:
        """Keep the reserve free, and the room waiting promotions need. While the tier takes
        no writes (full, or failing), only the room for promotions is made, from chunks already
        on disk or, failing those, by dropping the coldest."""
        cpu, disk = self.cpu, self.disk
        writable = self.writable(step)
        reserve = self.reserve_slots if writable else 0
        want = max(reserve, self._room_wanted) - cpu.num_free - cpu.num_leaving
        self._room_wanted = 0
        if want <= 0:
            return
        victims = cpu.start_leaving(want)
        if not victims:
            return
        if self.on_leaving is not None:
            self.on_leaving(victims)
        held = [k for k in victims if k in disk]
        if held:  # written before (or being written): the CPU copy can go now
            self.stats.already_on_disk += len(held)
            disk.touch(held)
            cpu.finish_leaving(held)
        rest = [k for k in victims if k not in disk]
        if not rest:
            return
        if not writable:
            self.stats.not_admitted += len(rest)
            cpu.finish_leaving(rest)
            return
        plan = disk.prepare_store(rest)
        admitted = plan.keys if plan is not None else []
        taken = set(admitted)
        refused = [k for k in rest if k not in taken]
        if refused:
            self.stats.not_admitted += len(refused)
            cpu.finish_leaving(refused)
        if plan is None or not admitted:
            return
        self._drops.extend(plan.evicted)
        # jobs of a bounded size: a rank flushing one (a reset) waits for that much I/O only,
        # and the acks of the first chunks do not wait for the last
        for i in range(0, len(admitted), MAX_MOVE_CHUNKS):
            part = admitted[i : i + MAX_MOVE_CHUNKS]
            job = self.jobs.create(None, part, True, step=step, move=DEMOTE)
            slots = [cpu.slot_of(k) for k in part]
            self._moves.append(TierMove.of(job.job_id, False, part, slots, self.check_sums))
            self.stats.demotion_jobs += 1

    # ---- the ranks' acks ---------------------------------------------------------------------

    def finalize(
        self,
        job: TransferJobStatus,
        corrupt: bool,
        full: bool,
        bad: AbstractSet[int] = frozenset(),
    ) -> None:
        """Every rank reported this move (``corrupt``: some rank found its source bad, ``bad``
        the keys it found so; ``full``: some rank found the disk full)."""
        ok = not job.failed
        self._count_outcome(ok or corrupt or full)
        if job.move == DEMOTE:
            self.disk.complete_store(job.keys, success=ok)
            self.cpu.finish_leaving(job.keys)
            if ok:
                self.stats.demoted += len(job.keys)
            else:
                self.stats.demotions_failed += len(job.keys)
                # a rank may have renamed its file into place before another failed
                self._drops.extend(job.keys)
            if full:
                self._on_full("demotions")
            return
        self._promotion_done(job, ok)
        if ok:
            self.stats.promoted += len(job.keys)
            return
        self.stats.promotions_failed += len(job.keys)
        gone = self._gone(job, bad)  # their files go on every rank
        if corrupt or bad:
            self.stats.corrupt += len(gone)
        self.disk.discard(gone)
        self._drops.extend(k for k in gone if k not in self.disk)

    def abandon(self, job: TransferJobStatus, keep_cpu: bool) -> None:
        """A reset abandoned this move (its ranks flush it next step; late acks are stale):
        nothing it was making becomes readable. ``keep_cpu``: the CPU tier keeps its contents
        (else it is being emptied, and its books with it)."""
        if job.move == DEMOTE:
            self.disk.complete_store(job.keys, success=False)
            self._drops.extend(job.keys)
            if keep_cpu:
                self.cpu.finish_leaving(job.keys)
        else:
            self._promotion_abandoned(job, keep_cpu)
