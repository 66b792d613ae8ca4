"""The tiers below the CPU tier as the connector sees them together: the disk tier's moves and
the shared tier's, one plan of both per step, each final move handed to the tier it belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from raykv.connector.jobs import JobTable, TransferJobStatus
from raykv.connector.shared_moves import FETCH, PUBLISH, SharedMoves, StoreIndex
from raykv.connector.tier_moves import DiskMoves
from raykv.core.step import ChunkKeys, TierMove, TransferPlan
from raykv.offload.directory import Directory


class LowerTiers:
    """The disk tier's moves and the shared tier's (either may be absent)."""

    def __init__(self, disk: DiskMoves | None, shared: SharedMoves | None) -> None:
        self.disk = disk
        self.shared = shared

    @classmethod
    def build(
        cls,
        cpu: Directory,
        jobs: JobTable,
        check_sums: bool,
        reserve: int,
        disk: tuple[Directory | None, int],
        shared: tuple[Directory | None, StoreIndex | None, int, bool],
    ) -> LowerTiers:
        """The tiers' moves over ``cpu``: ``reserve``, the CPU slots kept free ahead of need
        (by the disk's demotions, or by the shared tier's write-back without a disk); ``disk``
        is (its directory, steps it pauses when full), ``shared`` (its index of the store, the
        store's answers, steps it pauses after failures, write-back); a None directory: no
        such tier. With both, write-back publishes what the disk's demotions give up."""
        disk_dir, retry_full = disk
        shared_dir, index, retry, write_back = shared
        disk_moves = (
            None
            if disk_dir is None
            else DiskMoves(cpu, disk_dir, jobs, reserve, check_sums, retry_full)
        )
        shared_moves = (
            None
            if shared_dir is None
            else SharedMoves(
                cpu,
                shared_dir,
                jobs,
                index,
                check_sums,
                retry,
                write_back,
                reserve,
            )
        )
        if disk_moves is not None and shared_moves is not None and write_back:
            disk_moves.on_leaving = shared_moves.leaving
            shared_moves.keeps_reserve = False
        return cls(disk_moves, shared_moves)

    def __bool__(self) -> bool:
        return self.disk is not None or self.shared is not None

    def set_step(self, step: int) -> None:
        """Moves started from now on belong to ``step``."""
        if self.disk is not None:
            self.disk.step = step
        if self.shared is not None:
            self.shared.step = step

    def plan(self, step: int) -> tuple[list[TierMove], ChunkKeys, ChunkKeys]:
        """This step's moves of both tiers, the disk files to delete and the store parts to
        remove."""
        moves: list[TierMove] = []
        disk_drops = shared_drops = ChunkKeys()
        if self.disk is not None:
            moves, disk_drops = self.disk.plan(step)
        if self.shared is not None:
            if self.disk is not None and self.shared.write_back:
                # while the disk takes no demotions, write-back keeps the reserve itself
                self.shared.keeps_reserve = not self.disk.writable(step)
            published, shared_drops = self.shared.plan()
            moves = moves + published
        return moves, disk_drops, shared_drops

    def stored(self, keys: Sequence[int]) -> None:
        """A store into the CPU tier landed: the shared tier publishes its chunks (when it
        writes through)."""
        if self.shared is not None:
            self.shared.publish(keys)

    def finalize(
        self,
        job: TransferJobStatus,
        corrupt: bool,
        full: bool,
        unsettled: bool = False,
        bad: AbstractSet[int] = frozenset(),
    ) -> None:
        """Every rank reported this move: ``corrupt``, ``full``, ``unsettled`` (some rank's
        read failed but may still land) as the ranks said; ``bad``: the keys whose source some
        rank found bad."""
        if job.move in (PUBLISH, FETCH):
            assert self.shared is not None
            self.shared.finalize(job, corrupt, full, unsettled, bad)
        else:
            assert self.disk is not None
            self.disk.finalize(job, corrupt, full, bad)

    def abandon(self, job: TransferJobStatus, keep_cpu: bool) -> None:
        if job.move in (PUBLISH, FETCH):
            assert self.shared is not None
            self.shared.abandon(job, keep_cpu)
        else:
            assert self.disk is not None
            self.disk.abandon(job, keep_cpu)

    def carry_drops(self, plan: TransferPlan) -> None:
        """The drops of a plan that may not have run, in the next plan again (a drop done twice
        finds nothing the second time)."""
        if self.disk is not None and len(plan.disk_drops):
            self.disk.drop_files(plan.disk_drops.unpack())
        if self.shared is not None and len(plan.shared_drops):
            self.shared.drop_parts(plan.shared_drops.unpack())

    def check_invariants(self) -> None:
        if self.disk is not None:
            self.disk.check_invariants()
        if self.shared is not None:
            self.shared.check_invariants()
