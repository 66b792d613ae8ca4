"""The connector's worker half: one per rank, it moves KV and nothing else.

The rank runner calls it around the model step: ``before_model`` flushes (finishes the listed
jobs now, submitting any of them that arrive in this very plan first), deletes the disk files
the plan drops and submits the loads (finishing those the model reads in this same step);
``after_model`` queues the stores and polls finished jobs without blocking; the moves between
the CPU tier and the disk tier are queued before the model, so that their I/O runs beside it.
Before the model writes a block, or a load is queued into one, the rank asks ``check_writable``:
no unfinished store on this rank may still read that block (the fence invariant, checked where
it matters), and no unfinished load may still write it. A store into a CPU slot, or a load out
of one, must find no unfinished move between the tiers still reading or writing that slot
(``check_slots``).

No torch here: the copy backend and the verifier of loaded blocks are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from raykv.core.step import (
    TIER_DISK,
    TIER_SHARED,
    BlockContent,
    ChunkKeys,
    TierMove,
    TransferPlan,
    TransferReport,
    TransferSpec,
    TransferStats,
)

# (GPU block, what it must hold) -> whether it does: the synthetic model's check of a load
BlockVerifier = Callable[[int, BlockContent], bool]

_REMEMBERED = 1 << 16  # reported jobs remembered for re-acking (bounded memory)
# An idle step (no model work) blocks until a copy or a promotion lands, this long at most for
# the copies and for each tier below, before polling: an idle engine waits on what its requests
# wait for instead of spinning through empty steps (in one process the spinning thread starved
# the copy thread of the GIL: 1-block loads took 32 steps), and a request that arrives
# meanwhile waits no longer than that. Where only writes run (demotions, publishes: nobody
# waits for them) it blocks a shorter while, so that an arrival is not held up behind them.
IDLE_WAIT_S = 0.01
WRITES_IDLE_WAIT_S = 0.002


class TransferBackend(Protocol):
    """What a rank's transfer engine (CPU or CUDA, possibly wrapped in a fault) offers."""

    def submit(self, spec: TransferSpec) -> None: ...
    def flush(self, job_ids: Iterable[int]) -> None: ...
    def poll(self) -> tuple[list[int], list[int]]: ...
    def wait(self, timeout_s: float) -> None: ...
    def pending_reads(self) -> set[int]: ...
    def pending_writes(self) -> set[int]: ...
    def take_stats(self) -> TransferStats: ...
    def take_corrupt(self) -> list[int]: ...


class DiskBackend(Protocol):
    """What a rank's engine for a tier below the CPU tier (the disk's, the shared store's,
    possibly wrapped in a fault) offers."""

    def submit(self, move: TierMove) -> None: ...
    def drop(self, keys: list[int]) -> None: ...
    def flush(self, job_ids: list[int]) -> None: ...
    def poll(self) -> tuple[list[int], list[int]]: ...
    def wait(self, timeout_s: float) -> None: ...
    def in_flight(self) -> int: ...
    def reading(self) -> bool: ...
    def pending_slots(self) -> tuple[set[int], set[int]]: ...
    def take_stats(self) -> TransferStats: ...
    def take_corrupt(self) -> list[int]: ...
    def take_full(self) -> list[int]: ...
    def take_unsettled(self) -> list[int]: ...
    def take_bad_keys(self) -> dict[int, list[int]]: ...


class FenceViolation(RuntimeError):
    """A rank was asked to write a GPU block that an unfinished store still reads, or to read or
    write one a load has not finished writing. Always a protocol bug."""


class ConnectorWorker:
    """The worker half for one rank."""

    def __init__(
        self,
        rank: int,
        backend: TransferBackend,
        verify: BlockVerifier | None = None,
        disk: DiskBackend | None = None,
        shared: DiskBackend | None = None,
    ) -> None:
        self.rank = rank
        self.backend = backend
        self.disk = disk
        self.shared = shared
        # the tiers below the CPU tier, by the number a move names them with
        self.lowers: dict[int, DiskBackend] = {
            tier: engine
            for tier, engine in ((TIER_DISK, disk), (TIER_SHARED, shared))
            if engine is not None
        }
        self.verify = verify
        self._verify: dict[int, TransferSpec] = {}  # loads to check once finished
        self._checked: dict[int, tuple[int, int]] = {}  # checked, not yet reported: (n, bad)
        self._reported: OrderedDict[int, bool] = OrderedDict()  # job -> ok, already reported
        self._unsettled: set[int] = set()  # of those, failed reads that may still land
        self._step = -1
        # moves of a tier this rank has no engine for (a replacement rank that could not join
        # the store): failed, reported by the next poll
        self._no_engine: list[int] = []

    # ---- around the model step ---------------------------------------------------------

    def before_model(self, step: int, plan: TransferPlan) -> None:
        """Flush, then submit the loads (each checked against the fence)."""
        self._step = step
        backend = self.backend
        flush = set(plan.flush)
        if plan.flush:
            # moves a reset abandoned may still use CPU slots this plan hands to new copies:
            # they end first, before anything of this plan is queued
            for lower in self.lowers.values():
                lower.flush(plan.flush)
        # a job flushed in the plan that creates it (a finished request's last store whose blocks
        # were handed out this step) must be submitted before it can be waited for
        early = [spec for spec in plan.stores if spec.job_id in flush]
        self.check_slots(early, "store into")
        for spec in early:
            backend.submit(spec)
        if plan.flush:
            backend.flush(plan.flush)
            # a flushed load is finished now, and its blocks may be handed to a new owner later
            # in this very step (its request was restarted): check its bytes before that, and
            # count the result once the poll says whether the copy succeeded
            self._check_loads(plan.flush)
        if self.disk is not None and plan.disk_drops:
            self.disk.drop(plan.disk_drops.unpack())
        if self.shared is not None and plan.shared_drops:
            self.shared.drop(plan.shared_drops.unpack())
        # queued now, so that their I/O runs beside this step's model: a promotion that lands
        # by the step's poll lets its request load in the very next step
        for move in plan.tier_moves:
            lower = self.lowers.get(move.tier)
            if lower is None:
                self._no_engine.append(move.job_id)
            else:
                lower.submit(move)
        self.check_slots(plan.loads, "load from")
        for spec in plan.loads:
            self.check_writable(spec.copy.gpu_blocks, "load into")
            backend.submit(spec)
            if spec.expect is not None and self.verify is not None:
                self._verify[spec.job_id] = spec
        # loads whose blocks this step's model reads land first (reported by the next poll)
        now = [spec.job_id for spec in plan.loads if spec.same_step]
        if now:
            backend.flush(now)
            self._check_loads(now)

    def after_model(self, plan: TransferPlan, idle: bool) -> TransferReport:
        """Queue the stores, poll, and report what ended (and what the plan asks again)."""
        backend = self.backend
        flush = set(plan.flush)
        self.check_slots([s for s in plan.stores if s.job_id not in flush], "store into")
        for spec in plan.stores:
            if spec.job_id not in flush:
                backend.submit(spec)
        if idle:
            backend.wait(IDLE_WAIT_S)
            for lower in self.lowers.values():
                if lower.in_flight():
                    lower.wait(IDLE_WAIT_S if lower.reading() else WRITES_IDLE_WAIT_S)
        completed, failed = backend.poll()
        stats = backend.take_stats()
        corrupt, full, unsettled = backend.take_corrupt(), [], []
        bad_keys: dict[int, ChunkKeys] = {}
        for lower in self.lowers.values():
            moved, not_moved = lower.poll()
            completed, failed = completed + moved, failed + not_moved
            stats.add(lower.take_stats())
            corrupt, full = corrupt + lower.take_corrupt(), full + lower.take_full()
            unsettled += lower.take_unsettled()
            bad_keys.update(
                (job_id, ChunkKeys.of(keys)) for job_id, keys in lower.take_bad_keys().items()
            )
        if self._no_engine:
            failed, self._no_engine = failed + self._no_engine, []
        self._verify_loads(completed, failed, stats)
        self._remember(completed, failed)
        self._unsettled.update(unsettled)
        # a job the scheduler has waited for too long: if this rank reported it already (and
        # the report was lost), it says so again; the scheduler counts a rank once per job
        for job_id in plan.reack:
            ok = self._reported.get(job_id)
            if ok is not None and job_id not in completed and job_id not in failed:
                (completed if ok else failed).append(job_id)
                if job_id in self._unsettled:  # said again, or its slots would be reused
                    unsettled.append(job_id)
        return TransferReport(completed, failed, stats, corrupt, full, unsettled, bad_keys)

    def check_writable(self, blocks: list[int], what: str = "write") -> None:
        """Raise unless no unfinished transfer on this rank uses ``blocks``."""
        if not blocks:
            return
        busy = self.backend.pending_reads() | self.backend.pending_writes()
        if busy and not busy.isdisjoint(blocks):
            bad = sorted(busy & set(blocks))
            raise FenceViolation(
                f"rank {self.rank} step {self._step}: asked to {what} GPU blocks {bad} "
                "that unfinished transfers still use"
            )

    def check_slots(self, specs: list[TransferSpec], what: str) -> None:
        """Raise if an unfinished move between the tiers still uses a CPU slot these copies
        use: a demotion reads its slots, a promotion writes them (a store into either, or a load
        out of a slot being promoted into, would race it)."""
        busy_lowers = [lower for lower in self.lowers.values() if lower.in_flight()]
        if not specs or not busy_lowers:
            return
        reads: set[int] = set()
        writes: set[int] = set()
        for lower in busy_lowers:
            r, w = lower.pending_slots()
            reads |= r
            writes |= w
        busy = (reads | writes) if what == "store into" else writes
        bad = busy.intersection(s for spec in specs for s in spec.copy.cpu_slots)
        if bad:
            raise FenceViolation(
                f"rank {self.rank} step {self._step}: asked to {what} CPU slots {sorted(bad)} "
                "that unfinished moves between the CPU tier and a tier below it still use"
            )

    def check_readable(self, blocks: Iterable[int]) -> None:
        """Raise if a load still writes any of ``blocks``."""
        loading = self.backend.pending_writes()
        if not loading:  # the usual case: ``blocks`` (maybe a generator) is never walked
            return
        bad = loading.intersection(blocks)
        if bad:
            raise FenceViolation(
                f"rank {self.rank}: reads blocks {sorted(bad)} a load still writes"
            )

    # ---- books ---------------------------------------------------------------------------

    def _remember(self, completed: list[int], failed: list[int]) -> None:
        reported = self._reported
        for ok, ids in ((True, completed), (False, failed)):
            for job_id in ids:
                reported[job_id] = ok
        while len(reported) > _REMEMBERED:
            self._unsettled.discard(reported.popitem(last=False)[0])

    def _check_loads(self, job_ids: Iterable[int]) -> None:
        """Compare finished loads' blocks with what they must hold; kept until the poll."""
        verify = self.verify
        if verify is None:
            return
        for job_id in job_ids:
            spec = self._verify.pop(job_id, None)
            if spec is not None and spec.expect is not None:
                bad = sum(
                    not verify(block, content)
                    for block, content in zip(spec.copy.gpu_blocks, spec.expect, strict=True)
                )
                self._checked[job_id] = (len(spec.expect), bad)

    def _verify_loads(self, completed: list[int], failed: list[int], stats: TransferStats) -> None:
        if self._verify:
            self._check_loads(j for j in completed if j in self._verify)
        if not self._checked:
            return
        for job_id in completed:
            result = self._checked.pop(job_id, None)
            if result is not None:
                stats.blocks_verified += result[0]
                stats.mismatches += result[1]
        for job_id in failed:  # a failed copy wrote nothing worth checking
            self._checked.pop(job_id, None)
