"""The faults of a tier below the CPU tier, wrapped around a rank's engine for it (the disk's or
the shared store's): jobs that fail (``fail-disk``, ``fail-shared``), chunks that go bad after
they landed (``corrupt-*``), a slow tier (``slow-*``), a full one (``full-*``) and, for the
store, a rank's part that goes missing (``lose-shared``)."""

from __future__ import annotations

import time
from typing import Any

from raykv.core.step import TierMove
from raykv.faults.specs import RankFaults


class FaultyTier:
    """A tier's engine (``connector.worker.DiskBackend``: ``tier`` is ``disk`` or ``shared``)
    that suffers this rank's faults of that tier.

    A failed job reads or writes nothing and is reported failed by the next poll, as one whose
    I/O got EIO (or whose store call failed); a full tier fails a write the same way and reports
    it in ``take_full``, as ENOSPC (a full pool); a corrupted chunk has a byte of its pages
    flipped once its write has landed, a lost one this rank's copy removed (``spoil``,
    ``lose``: the engine's own hooks); a slow tier reports each job no sooner than ``ms``
    after it was queued (a flush waits that long too)."""

    def __init__(self, inner: Any, faults: RankFaults, tier: str = "disk") -> None:
        self.inner = inner
        self.faults = faults
        self.tier = tier
        self._lost: dict[
            int, list[int]
        ] = {}  # write -> its keys, this rank's part lost once landed
        self._failed: list[int] = []  # failed by a fault, for the next poll
        self._full: list[int] = []
        self._corrupt: dict[int, list[int]] = {}  # demotion -> its keys, corrupted once landed
        self._due: dict[int, float] = {}  # job -> when it may be reported (slow-disk)
        self._held: list[tuple[int, bool]] = []  # finished, not yet due: (job, ok)
        self._reads: set[int] = set()  # promotions held back or in flight (slow-disk)
        self._room = faults.tier_room(tier)
        self._written = 0

    def submit(self, move: TierMove) -> None:
        f, tier = self.faults, self.tier
        if f.tier_fails(tier):
            self._failed.append(move.job_id)
            return
        if not move.promote and self._room is not None:
            if self._written + len(move.chunks) > self._room:
                self._failed.append(move.job_id)
                self._full.append(move.job_id)
                return
            self._written += len(move.chunks)
        self.inner.submit(move)
        delay = f.tier_delay_s(tier)
        if delay:
            self._due[move.job_id] = time.monotonic() + delay
            if move.promote:
                self._reads.add(move.job_id)
        if not move.promote and f.tier_corrupts(tier):
            self._corrupt[move.job_id] = move.chunks.unpack()
        if not move.promote and f.tier_loses(tier):
            self._lost[move.job_id] = move.chunks.unpack()

    def flush(self, job_ids: list[int]) -> None:
        failed = set(self._failed)
        self.inner.flush([j for j in job_ids if j not in failed])
        due = max((self._due.get(j, 0.0) for j in job_ids), default=0.0)
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def poll(self) -> tuple[list[int], list[int]]:
        completed, failed = self.inner.poll()
        for job_id in completed:  # landed: now its chunks go bad, or go
            for key in self._corrupt.pop(job_id, ()):
                self.inner.spoil(key)
            for key in self._lost.pop(job_id, ()):
                self.inner.lose(key)
        for job_id in failed:
            self._corrupt.pop(job_id, None)
            self._lost.pop(job_id, None)
        if self._due or self._held:
            completed, failed = self._hold(completed, failed)
        if self._failed:
            failed, self._failed = [*failed, *self._failed], []
        return completed, failed

    def _hold(self, completed: list[int], failed: list[int]) -> tuple[list[int], list[int]]:
        """Hold back what finished before its time; release what is due."""
        now = time.monotonic()
        self._held += [(j, True) for j in completed] + [(j, False) for j in failed]
        out_ok: list[int] = []
        out_failed: list[int] = []
        keep: list[tuple[int, bool]] = []
        for job_id, ok in self._held:
            if self._due.get(job_id, 0.0) > now:
                keep.append((job_id, ok))
                continue
            self._due.pop(job_id, None)
            self._reads.discard(job_id)
            (out_ok if ok else out_failed).append(job_id)
        self._held = keep
        return out_ok, out_failed

    def wait(self, timeout_s: float) -> None:
        if self._failed:
            return
        if self._held:  # as a slow disk would: nothing lands before the first is due
            due = min(self._due.get(job_id, 0.0) for job_id, _ in self._held)
            time.sleep(min(timeout_s, max(0.0, due - time.monotonic())))
            return
        self.inner.wait(timeout_s)

    def in_flight(self) -> int:
        return self.inner.in_flight() + len(self._held) + len(self._failed)

    def reading(self) -> bool:
        return bool(self._reads) or self.inner.reading()

    def take_full(self) -> list[int]:
        full, self._full = self._full, []
        return [*self.inner.take_full(), *full]

    def take_bad_keys(self) -> dict[int, list[int]]:
        return self.inner.take_bad_keys()

    def __getattr__(self, name: str) -> Any:
        # everything else (drop, pending slots, stats, index, shutdown) is the real engine's
        return getattr(self.inner, name)
