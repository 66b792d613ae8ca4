"""What the moves of every tier below the CPU tier have in common (the disk's in
``tier_moves.py``, the shared store's in ``shared_moves.py``): the moves and drops waiting for
the next plan, the requests waiting for a promotion, how a promotion ends, and when the tier
is out of use.

A promotion reads chunks of the lower tier into fresh CPU slots (being written there, being
read in the lower tier, until every rank acked). One that worked makes them readable CPU
chunks; one that failed frees the slots, and its request recomputes what the CPU tier does not
hold. Moves that fail for no reason of their own (not a corrupt source, not a full tier)
``FAILURES_TO_PAUSE`` times in a row take the tier out of use for ``retry_steps`` steps: no
moves, no lookups; said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from typing import Any

from raykv.connector.jobs import TransferJobStatus
from raykv.connector.state import RequestOffloadState
from raykv.core.step import TierMove
from raykv.offload.directory import Directory

log = logging.getLogger(__name__)

WAIT = -1  # ``promote``: not yet, room is being made
FAILURES_TO_PAUSE = 8  # moves failed in a row that take the tier out of use for a while


class LowerTierMoves:
    """The books of one lower tier's moves (``tier``: its directory; ``name``: how the log
    calls it; ``stats``: a subclass's counts, with ``unavailable_events`` and
    ``full_events``)."""

    name = "lower"
    stats: Any
    # seconds the CPU slots of a promotion whose reads may still land stay out of use
    failed_read_hold_s = 0.0

    def __init__(self, cpu: Directory, tier: Directory, retry_steps: int) -> None:
        self.cpu = cpu
        self.tier = tier
        self.retry_steps = retry_steps
        self.step = 0  # the step being scheduled: moves started now belong to it
        self._moves: list[TierMove] = []  # created since the last plan
        self._drops: list[int] = []  # keys whose copies in the tier go, since the last plan
        self._waiting: dict[int, RequestOffloadState] = {}  # promotion -> who waits for it
        self._failures = 0  # moves failed in a row (not for a corrupt source or a full tier)
        self._unavailable_until = -1  # no moves, no lookups until this step
        self._paused_until = -1  # writes stop until this step (the tier was full)
        self._said: set[str] = set()

    def readable(self) -> bool:
        """Lookups may reach the tier (not while its moves keep failing)."""
        return self.step >= self._unavailable_until

    def _take_moves(self) -> tuple[list[TierMove], list[int]]:
        moves, drops = self._moves, self._drops
        self._moves, self._drops = [], []
        return moves, drops

    # ---- promotions ----------------------------------------------------------------------

    def _promotion_done(self, job: TransferJobStatus, ok: bool, hold: bool = False) -> None:
        """Close a promotion every rank reported: its CPU slots readable (or freed: ``hold``,
        only after ``failed_read_hold_s``), its entries in the tier read; a request that
        waited for one that failed recomputes."""
        hold_s = self.failed_read_hold_s if hold and not ok else 0.0
        self.cpu.complete_store(job.keys, success=ok, hold_s=hold_s)
        self.tier.complete_load(job.keys)
        waiting = self._waiting.pop(job.job_id, None)
        if not ok and waiting is not None:
            waiting.disk_failed = True  # it recomputes what the CPU tier does not hold

    def _promotion_abandoned(self, job: TransferJobStatus, keep_cpu: bool) -> None:
        """A reset abandoned a promotion: nothing it was reading becomes readable. Its slots
        are held where its reads may land late (its outcome is never heard), even when the CPU
        tier is being emptied (held slots outlast the reset)."""
        self.tier.complete_load(job.keys)
        self._waiting.pop(job.job_id, None)
        if keep_cpu or self.failed_read_hold_s:
            self.cpu.complete_store(job.keys, success=False, hold_s=self.failed_read_hold_s)

    @staticmethod
    def _gone(job: TransferJobStatus, bad: AbstractSet[int]) -> list[int]:
        """The chunks of a failed promotion that leave the tier: those a rank found bad at
        their source, the job's others staying; where the ranks named none (a read error, or a
        report of the job said again without them), which is bad is not known: every one."""
        return [k for k in job.keys if k in bad] if bad else list(job.keys)

    # ---- out of use ------------------------------------------------------------------------

    def _count_outcome(self, worked: bool) -> None:
        """A move that failed for no reason of its own counts towards taking the tier out of
        use (``FAILURES_TO_PAUSE`` in a row)."""
        if worked:
            self._failures = 0
            return
        self._failures += 1
        if self._failures >= FAILURES_TO_PAUSE:
            self._pause(f"{FAILURES_TO_PAUSE} moves failed in a row")

    def _pause(self, why: str) -> None:
        """Out of use for ``retry_steps`` steps: no moves, no lookups."""
        self._failures = 0
        self._unavailable_until = self.step + self.retry_steps
        self.stats.unavailable_events += 1
        self._say(
            "failing",
            f"the {self.name} tier is out of use for {self.retry_steps} steps at a time ({why}); "
            "the run goes on without it meanwhile",
        )

    def _on_full(self, what_stops: str) -> None:
        """The tier is full: ``what_stops`` (its writes) stop for ``retry_steps`` steps."""
        self.stats.full_events += 1
        self._paused_until = self.step + self.retry_steps
        self._say(
            "full",
            f"the {self.name} tier is full: {what_stops} stop for {self.retry_steps} steps at a "
            "time, the run goes on meanwhile",
        )

    def _say(self, what: str, message: str) -> None:
        """Log ``message`` the first time ``what`` happens (once per run, not per step)."""
        if what not in self._said:
            self._said.add(what)
            log.warning(message)

    def check_invariants(self) -> None:
        self.tier.check_invariants()
