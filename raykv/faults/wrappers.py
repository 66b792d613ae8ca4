"""The two seams where a rank's faults act: ``FaultyBackend`` around its transfer backend
(failed copies, corrupted pool rows) and ``FaultyRank`` around its step (deaths, stalls; lost,
duplicated and late reports)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from raykv.core.step import StepPlan, StepReport, TransferSpec
from raykv.faults.specs import RankDied, RankFaults


class FaultyBackend:
    """A transfer backend (``connector.worker.TransferBackend``) whose copies fail
    (``fail-copy``): a failed job copies nothing, holds no block, and is reported failed by the
    next poll, as a copy that failed on the device; and whose stored chunks go bad in the CPU
    pool after they landed (``corrupt-cpu``), as memory that flips."""

    def __init__(self, inner: Any, faults: RankFaults) -> None:
        self.inner = inner
        self.faults = faults
        self._failed: list[int] = []
        self._to_corrupt: dict[int, TransferSpec] = {}  # stores to corrupt once they land

    def submit(self, spec: TransferSpec) -> None:
        if self.faults.copy_fails():
            self._failed.append(spec.job_id)
        else:
            self.inner.submit(spec)
            if spec.is_store and self.faults.corrupts():
                self._to_corrupt[spec.job_id] = spec

    def flush(self, job_ids: Iterable[int]) -> None:
        failed = set(self._failed)
        self.inner.flush([j for j in job_ids if j not in failed])

    def poll(self) -> tuple[list[int], list[int]]:
        completed, failed = self.inner.poll()
        for job_id in completed:  # the store landed: now its bytes in the pool go bad
            spec = self._to_corrupt.pop(job_id, None)
            if spec is not None:
                self.inner.corrupt_rows(spec.copy)
        for job_id in failed:
            self._to_corrupt.pop(job_id, None)
        if self._failed:
            failed, self._failed = [*failed, *self._failed], []
        return completed, failed

    def wait(self, timeout_s: float) -> None:
        if not self._failed:
            self.inner.wait(timeout_s)

    def __getattr__(self, name: str) -> Any:
        # everything else (pending sets, stats, pause, shutdown) is the real engine's
        return getattr(self.inner, name)


class Rank(Protocol):
    def execute(self, plan: StepPlan) -> StepReport: ...


@dataclass(slots=True)
class _Held:
    release_step: int
    job_id: int
    ok: bool


class FaultyRank:
    """A rank that dies (``kill-worker``) or hangs (``stall-worker``), and whose reports are
    late (``delay-acks``), lost (``drop-acks``) or delivered twice (``dup-acks``). The rank
    itself ran the step: a lost report is a lost message, so the scheduler's re-ack request
    still finds the job reported."""

    def __init__(self, inner: Rank, faults: RankFaults) -> None:
        self.inner = inner
        self.faults = faults
        self._held: list[_Held] = []

    def execute(self, plan: StepPlan) -> StepReport:
        f = self.faults
        if f.dies_at(plan.step):
            raise RankDied(f"rank {f.rank} killed at step {plan.step} (injected fault)")
        stall = f.stall_at(plan.step)
        if stall:
            time.sleep(stall)
        report = self.inner.execute(plan)
        t = report.transfers
        completed, failed = self._release(plan, t.completed, t.failed)
        t.completed, t.failed = self._deliver(completed), self._deliver(failed)
        return report

    def _release(
        self, plan: StepPlan, completed: list[int], failed: list[int]
    ) -> tuple[list[int], list[int]]:
        """Hold completions back; what the scheduler asked again for (re-acks) is answered at
        once, like the lost reports it stands for."""
        if not self.faults.delays_acks and not self._held:
            return completed, failed
        step, asked = plan.step, set(plan.transfers.reack)
        if asked:  # answered now: a copy still held back would only arrive as a duplicate
            self._held = [h for h in self._held if h.job_id not in asked]
        for ok, ids in ((True, completed), (False, failed)):
            for job_id in ids:
                delay = 0 if job_id in asked else self.faults.ack_delay()
                self._held.append(_Held(step + delay, job_id, ok))
        out_ok: list[int] = []
        out_fail: list[int] = []
        keep: list[_Held] = []
        for held in self._held:
            if held.release_step <= step:
                (out_ok if held.ok else out_fail).append(held.job_id)
            else:
                keep.append(held)
        self._held = keep
        return out_ok, out_fail

    def _deliver(self, ids: list[int]) -> list[int]:
        f = self.faults
        out: list[int] = []
        for job_id in ids:
            if f.drops():
                continue
            out.append(job_id)
            if f.duplicates():
                out.append(job_id)
        return out

    def held_jobs(self) -> list[int]:
        """Jobs whose completion this rank has not reported yet."""
        return [h.job_id for h in self._held]
