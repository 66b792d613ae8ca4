"""Moves between the CPU tier and the shared tier (Mooncake Store): publishes, promotions, and the
parts to remove.

Both are jobs of the connector's job table, acked by every rank like loads and stores:

- **Publish.** Write-through (``offload.shared.publish: through``): a chunk the CPU tier has
  just stored is put into the store. Write-back (``back``): a chunk is put there as it leaves
  the CPU tier, given up by the disk tier's demotions or, without a disk tier, by this tier's
  own (a share of the CPU tier kept free, as the disk's demotions keep it). Either way every
  rank puts it from its own CPU-pool shard: its CPU slot is pinned (being read, still readable
  by a load; a leaving chunk's slot is freed only then) and its entry in this engine's index of
  the store being written until every rank has acked. A chunk the index already holds is not
  published again (another engine, or this one, put the same bytes under the same key).
- **Promotion.** A lookup that reaches chunks only the store holds has them read by every rank
  into fresh CPU slots (being written until every rank acked); the request waits and then
  loads them like any CPU hit. A promotion that finds a part missing (the store evicted it, or
  its node's segment is gone) or spoiled fails as corrupt: the chunk leaves the index (a
  spoiled part is removed from the store on every rank) and the request recomputes. The CPU
  slots of a promotion that failed are not reused for ``LATE_READ_HOLD_S``: a read the store's
  client gave up on may still land in them.

The index (a ``Directory`` of its own, LRU) holds what this engine published and what lookups
found in the store (``discover``: the store is asked once per admission for the chunks a
request's prompt has past the local tiers; a chunk counts only where every rank's part is
there). The store evicts on its own, so the index may name a chunk that is gone: the promotion
finds out, never serves other bytes. Moves that keep failing for no reason of their own (the
master unreachable) take the tier out of use for ``retry_steps`` steps, said once in the log;
a publish that found the pool full stops publishes for as long.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from raykv.connector.jobs import JobTable, TransferJobStatus
from raykv.connector.lower_moves import WAIT, LowerTierMoves
from raykv.connector.state import RequestOffloadState
from raykv.core.step import TIER_SHARED, ChunkKeys, TierMove
from raykv.offload.directory import Directory

PUBLISH, FETCH = "publish", "fetch"
MAX_PUBLISHING_SHARE = 0.25  # of the CPU tier's slots, at most pinned by publishes in flight
# Mooncake's client gives up on a transfer after 60 s and says it failed, but does not cancel
# it: its bytes may still land in the CPU slots of the promotion it failed. Those slots stay
# out of use for twice that, so no chunk stored there meanwhile is overwritten.
LATE_READ_HOLD_S = 120.0


class StoreIndex(Protocol):
    """What the scheduler asks the store (``transfer/shared_store.StoreIndex``)."""

    def present(self, keys: Sequence[int]) -> list[bool]: ...


@dataclass(slots=True)
class SharedMoveStats:
    """The shared tier's moves and lookups, counted in chunks (and jobs)."""

    publish_jobs: int = 0
    published: int = 0  # chunks every rank put into the store
    publishes_failed: int = 0
    not_published: int = 0  # chunks not published: too many publishes were in flight
    promotion_jobs: int = 0
    promoted: int = 0  # chunks read back into the CPU tier
    promotions_failed: int = 0
    gone: int = 0  # chunks a promotion found missing or spoiled (left the index)
    asked: int = 0  # chunks the store was asked about
    found: int = 0  # ... and found there (every rank's part)
    full_events: int = 0
    unavailable_events: int = 0


class SharedMoves(LowerTierMoves):
    """Plans the shared tier's moves and closes them when their jobs are final."""

    name = "shared"
    failed_read_hold_s = LATE_READ_HOLD_S

    def __init__(
        self,
        cpu: Directory,
        shared: Directory,
        jobs: JobTable,
        index: StoreIndex | None,
        check_sums: bool = False,
        retry_steps: int = 512,
        write_back: bool = False,
        reserve_slots: int = 0,
    ) -> None:
        """``index``: asks the store what it holds (None: only what this engine published);
        ``retry_steps``: steps the tier stays out of use after its moves kept failing;
        ``write_back``: publish chunks as they leave the CPU tier, not as they reach it;
        ``reserve_slots``: CPU slots kept free by giving up the coldest chunks, by this tier's
        write-back (``keeps_reserve``) or by the disk's demotions, which hand them to
        ``leaving``; publishes in flight may pin that many at least."""
        super().__init__(cpu, shared, retry_steps)
        self.shared = shared
        self.jobs = jobs
        self.index = index
        self.check_sums = check_sums
        self.write_back = write_back
        self.reserve_slots = reserve_slots
        self.keeps_reserve = write_back  # False: the disk tier's demotions keep it
        self.stats = SharedMoveStats()
        self._publishing = 0  # chunks whose publish is in flight (their CPU slots pinned)

    def writable(self) -> bool:
        return self.readable() and self.step >= self._paused_until

    # ---- lookups -----------------------------------------------------------------------------

    def discover(self, keys: Sequence[int], elsewhere: Container[int] = ()) -> None:
        """Ask the store about these chunks (those the index lacks and no other tier holds:
        ``elsewhere``, the disk tier) and take in the ones every rank's part is there for.
        Stops at the first chunk missing everywhere: a prefix is all a lookup can use."""
        if self.index is None or not self.readable():
            return
        unknown = [k for k in dict.fromkeys(keys) if k not in self.shared and k not in elsewhere]
        if not unknown:
            return
        self.stats.asked += len(unknown)
        try:
            present = self.index.present(unknown)
        except Exception as exc:  # the master unreachable: no more questions for a while (the
            # scheduler waits for each answer)
            self._pause(f"the store did not say what it holds ({exc})")
            return
        found: list[int] = []
        for key, there in zip(unknown, present, strict=True):
            if not there:
                break
            found.append(key)
        if not found:
            return
        plan = self.shared.prepare_store(found, admit_all=True)
        if plan is None or not plan.keys:
            return
        self.shared.complete_store(plan.keys, success=True)
        self.stats.found += len(plan.keys)

    # ---- publishes ---------------------------------------------------------------------------

    def publish(self, keys: Sequence[int]) -> None:
        """Write-through: these chunks were just stored in the CPU tier; put those the index
        lacks into the store."""
        if self.write_back or not self.writable():
            return
        cpu = self.cpu
        self._publish(
            [k for k in dict.fromkeys(keys) if k not in self.shared and cpu.is_readable(k)]
        )

    def leaving(self, victims: Sequence[int]) -> None:
        """Write-back: these CPU chunks are leaving the CPU tier (``Directory.start_leaving``,
        not yet finished); put those the index lacks into the store. A publish's read pin keeps
        its chunk's slot past ``finish_leaving`` until every rank has put it."""
        if not self.write_back or not self.writable():
            return
        self._publish([k for k in dict.fromkeys(victims) if k not in self.shared])

    def _room(self) -> int:
        """Chunks a publish may start now: publishes in flight pin at most
        ``MAX_PUBLISHING_SHARE`` of the CPU tier (a store slower than the stores would pin all
        of it), or write-back's reserve where that is more, and the index takes no more than
        its entries nobody writes or reads."""
        room = int(self.cpu.capacity * MAX_PUBLISHING_SHARE)
        if self.write_back:
            room = max(room, self.reserve_slots)
        return min(room - self._publishing, self.shared.capacity - self.shared.num_pinned)

    def _publish(self, fresh: list[int]) -> None:
        """Start publishing these readable CPU chunks, as many as there is room for (what is
        not published is counted, and its later loads come from the CPU tier or are
        recomputed)."""
        cpu = self.cpu
        room = self._room()
        if len(fresh) > room:
            self.stats.not_published += len(fresh) - max(0, room)
            fresh = fresh[: max(0, room)]
        if not fresh:
            return
        plan = self.shared.prepare_store(fresh, admit_all=True)
        if plan is None:  # not within the room: never expected, but counted if it happens
            self.stats.not_published += len(fresh)
            return
        if not plan.keys:
            return
        keys = list(plan.keys)
        slots = cpu.prepare_load(keys)  # pinned while the ranks read them
        job = self.jobs.create(None, keys, True, step=self.step, move=PUBLISH)
        self._moves.append(
            TierMove.of(job.job_id, False, keys, slots, self.check_sums, TIER_SHARED)
        )
        self._publishing += len(keys)
        self.stats.publish_jobs += 1

    def _keep_reserve(self) -> None:
        """Write-back without a disk tier taking demotions: give up the CPU tier's coldest
        chunks ahead of need, to keep ``reserve_slots`` free, no more than can be published
        now, publishing those the store lacks (their slots are freed when the publish ends;
        the others' at once). Nothing leaves early while the tier takes no publishes: the CPU
        tier then evicts as it does without a tier below."""
        cpu = self.cpu
        # no more than can be published: a chunk given up unpublished would be lost early
        want = min(self.reserve_slots - cpu.num_free - cpu.num_leaving, self._room())
        if want <= 0 or not self.writable():
            return
        victims = cpu.start_leaving(want)
        if victims:
            self.leaving(victims)
            cpu.finish_leaving(victims)

    # ---- promotions (from a lookup) ----------------------------------------------------------

    def promote(
        self,
        keys: Sequence[int],
        waiting: RequestOffloadState | None = None,
        keep: Sequence[int] = (),
    ) -> int | None:
        """Start reading these store-only chunks into CPU slots (the coldest chunks evicted to
        make room, as a store would; never one of ``keep``: what the request loads beside
        them): the job's id; ``WAIT`` while no room can be made (every other slot pinned);
        None when the CPU tier could never hold them beside ``keep``'s chunks there."""
        keys = list(dict.fromkeys(keys))
        cpu = self.cpu
        if len(keys) > cpu.room_beside(keep):
            return None
        plan = cpu.prepare_store(keys, admit_all=True, keep=keep)
        if plan is None:
            return WAIT
        if plan.keys != keys:  # a key turned up in the CPU tier: never promote over it
            cpu.complete_store(plan.keys, success=False)
            return None
        self.shared.prepare_load(keys)
        job = self.jobs.create(None, keys, False, step=self.step, move=FETCH)
        if waiting is not None:
            self._waiting[job.job_id] = waiting
        self._moves.append(
            TierMove.of(job.job_id, True, keys, plan.slots, self.check_sums, TIER_SHARED)
        )
        self.stats.promotion_jobs += 1
        return job.job_id

    # ---- the step's plan ---------------------------------------------------------------------

    def plan(self) -> tuple[list[TierMove], ChunkKeys]:
        """The moves started since the last plan (and, for write-back without a disk tier, the
        publishes that keep the CPU tier's reserve), and the keys whose parts leave the store."""
        if self.keeps_reserve:
            self._keep_reserve()
        moves, drops = self._take_moves()
        return moves, ChunkKeys.of(drops)

    def drop_parts(self, keys: Sequence[int]) -> None:
        """Have every rank remove its part of these chunks with the next plan."""
        self._drops.extend(keys)

    # ---- the ranks' acks ---------------------------------------------------------------------

    def finalize(
        self,
        job: TransferJobStatus,
        corrupt: bool,
        full: bool,
        unsettled: bool = False,
        bad: AbstractSet[int] = frozenset(),
    ) -> None:
        """Every rank reported this move (``corrupt``: some rank's part was missing or bad, or
        its CPU bytes changed, ``bad`` the keys it found so; ``full``: some rank found the pool
        full; ``unsettled``: some rank's read failed without being cancelled: the slots are
        held)."""
        ok = not job.failed
        self._count_outcome(ok or corrupt or full)
        if job.move == PUBLISH:
            self._publishing -= len(job.keys)
            self.cpu.complete_load(job.keys)
            self.shared.complete_store(job.keys, success=ok)
            if ok:
                self.stats.published += len(job.keys)
            else:
                self.stats.publishes_failed += len(job.keys)
            if full:
                self._on_full("publishes")
            return
        self._promotion_done(job, ok, hold=unsettled)
        if ok:
            self.stats.promoted += len(job.keys)
            return
        self.stats.promotions_failed += len(job.keys)
        # out of the index (a rank removed the parts it found spoiled; the other ranks' stay,
        # for the engines that read them whole)
        gone = self._gone(job, bad)
        if corrupt or bad:
            self.stats.gone += len(gone)
        self.shared.discard(gone)

    def abandon(self, job: TransferJobStatus, keep_cpu: bool) -> None:
        """A reset abandoned this move: nothing it was making becomes readable, and one not yet
        handed to the ranks never is (its CPU slots are free from now on)."""
        self._moves = [m for m in self._moves if m.job_id != job.job_id]
        if job.move == PUBLISH:
            self._publishing -= len(job.keys)
            self.shared.complete_store(job.keys, success=False)
            if keep_cpu:
                self.cpu.complete_load(job.keys)
        else:
            self._promotion_abandoned(job, keep_cpu)
