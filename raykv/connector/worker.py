"""The connector's worker half: one per rank, turns each step's plan into copies.

Per step, in this order: flush (finish the listed jobs now, submitting any of them that arrive
in this very plan first), submit the loads, run the model step (write this step's KV, then read
the KV each sampling request attends to), queue the stores, and poll finished jobs without
blocking. Before the model writes a block, or a load is queued into one, the rank checks that no
unfinished store on it still reads that block: the fence invariant, checked where it matters.

No torch here: the copy backend, the model and the KV tensor are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from raykv.connector.plan import (
    BlockContent,
    StepPlan,
    StepReport,
    TransferSpec,
    TransferStats,
    WriteSpan,
)
from raykv.faults import RankFaults


class RankDied(RuntimeError):
    """This rank is gone (an injected fault; on Ray the actor process exits instead)."""


class FenceViolation(RuntimeError):
    """A rank was asked to write a GPU block that an unfinished store still reads, or to read or
    write one a load has not finished writing. Always a protocol bug."""


class TransferBackend(Protocol):
    def submit(self, spec: TransferSpec) -> None: ...
    def flush(self, job_ids: Iterable[int]) -> None: ...
    def poll(self) -> tuple[list[int], list[int]]: ...
    def wait(self, timeout_s: float) -> None: ...
    def pending_reads(self) -> set[int]: ...
    def pending_writes(self) -> set[int]: ...
    def take_stats(self) -> TransferStats: ...


class ModelBackend(Protocol):
    def write(self, kv: Any, span: WriteSpan) -> None: ...
    def checksum(self, kv: Any, blocks: list[int]) -> int: ...
    def verify(self, kv: Any, block: int, content: BlockContent) -> bool: ...


AckDelay = Callable[[int], int]  # job id -> steps to hold its report back (a test hook)
_REMEMBERED = 1 << 16  # reported jobs remembered for re-acking (bounded memory)
# An idle step (no model work) gives copies this long to land before polling. Without it an
# engine whose every request waits on loads spins through empty steps, and in one process the
# spinning thread starves the copy thread of the GIL: measured, 1-block loads then took 32
# steps and were only finished by the overdue-job flush.
IDLE_WAIT_S = 0.002


@dataclass(slots=True)
class _Held:
    release_step: int
    job_id: int
    ok: bool


class ConnectorWorker:
    """The worker half for one rank."""

    def __init__(
        self,
        rank: int,
        backend: TransferBackend,
        model: ModelBackend,
        kv: Any,
        ack_delay: AckDelay | None = None,
        faults: RankFaults | None = None,
    ) -> None:
        self.rank = rank
        self.backend = backend
        self.model = model
        self.kv = kv
        self.faults = faults if faults is not None and faults.active else None
        if ack_delay is None and self.faults is not None and self.faults.ack_delay():
            steps = self.faults.ack_delay()
            ack_delay = lambda job_id: steps  # noqa: E731 - a constant delay
        self.ack_delay = ack_delay
        self._held: list[_Held] = []
        self._verify: dict[int, TransferSpec] = {}  # loads to check once finished
        self._checked: dict[int, tuple[int, int]] = {}  # checked, not yet reported: (n, bad)
        self._reported: OrderedDict[int, bool] = OrderedDict()  # job -> ok, already reported
        self._step = -1

    def execute(self, plan: StepPlan) -> StepReport:
        self._step = plan.step
        if self.faults is not None and self.faults.dies_at(plan.step):
            raise RankDied(f"rank {self.rank} killed at step {plan.step} (injected fault)")
        backend = self.backend
        flush = set(plan.flush)
        # a job flushed in the plan that creates it (a finished request's last store whose blocks
        # were handed out this step) must be submitted before it can be waited for
        for spec in plan.stores:
            if spec.job_id in flush:
                backend.submit(spec)
        if plan.flush:
            backend.flush(plan.flush)
            # a flushed load is finished now, and its blocks may be handed to a new owner later
            # in this very step (its request was restarted): check its bytes before that, and
            # count the result once the poll says whether the copy succeeded
            self._check_loads(plan.flush)
        for spec in plan.loads:
            self._check(spec.copy.gpu_blocks, "load into")
            backend.submit(spec)
            if spec.expect is not None:
                self._verify[spec.job_id] = spec
        samples = self._model_step(plan)
        for spec in plan.stores:
            if spec.job_id not in flush:
                backend.submit(spec)
        if not plan.batch:
            backend.wait(IDLE_WAIT_S)
        completed, failed = backend.poll()
        stats = backend.take_stats()
        self._verify_loads(completed, failed, stats)
        completed, failed = self._release(completed, failed)
        self._remember(completed, failed)
        # a job the scheduler has waited for too long: if this rank reported it already (and
        # the report was lost), it says so again; the scheduler counts a rank once per job
        for job_id in plan.reack:
            ok = self._reported.get(job_id)
            if ok is not None and job_id not in completed and job_id not in failed:
                (completed if ok else failed).append(job_id)
        if self.faults is not None:
            completed, failed = self._ack_faults(completed), self._ack_faults(failed)
        return StepReport(self.rank, plan.step, completed, failed, samples, stats)

    def _remember(self, completed: list[int], failed: list[int]) -> None:
        reported = self._reported
        for ok, ids in ((True, completed), (False, failed)):
            for job_id in ids:
                reported[job_id] = ok
        while len(reported) > _REMEMBERED:
            reported.popitem(last=False)

    def _ack_faults(self, ids: list[int]) -> list[int]:
        """Injected message faults: a report lost, or delivered twice."""
        f = self.faults
        assert f is not None
        out: list[int] = []
        for job_id in ids:
            if f.drops():
                continue
            out.append(job_id)
            if f.duplicates():
                out.append(job_id)
        return out

    def _model_step(self, plan: StepPlan) -> list[int]:
        if not plan.batch:
            return []
        kv, model = self.kv, self.model
        writes = [b for entry in plan.batch for span in entry.writes for b in span.blocks]
        self._check(writes, "write")
        loading = self.backend.pending_writes()
        for entry in plan.batch:
            for span in entry.writes:
                model.write(kv, span)
        samples = []
        for entry in plan.batch:
            if loading and not loading.isdisjoint(entry.read_blocks):
                bad = sorted(loading & set(entry.read_blocks))
                raise FenceViolation(f"rank {self.rank}: reads blocks {bad} a load still writes")
            samples.append(model.checksum(kv, entry.read_blocks) if entry.read_blocks else 0)
        return samples

    def _check(self, blocks: list[int], what: str) -> None:
        if not blocks:
            return
        busy = self.backend.pending_reads() | self.backend.pending_writes()
        if busy and not busy.isdisjoint(blocks):
            bad = sorted(busy & set(blocks))
            raise FenceViolation(
                f"rank {self.rank} step {self._step}: asked to {what} GPU blocks {bad} "
                "that unfinished transfers still use"
            )

    def _check_loads(self, job_ids: Iterable[int]) -> None:
        """Compare finished loads' blocks with what they must hold; kept until the poll."""
        for job_id in job_ids:
            spec = self._verify.pop(job_id, None)
            if spec is not None and spec.expect is not None:
                bad = sum(
                    not self.model.verify(self.kv, block, content)
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

    def _release(self, completed: list[int], failed: list[int]) -> tuple[list[int], list[int]]:
        """Apply the ack-delay hook: completions may be reported steps after they happen."""
        if self.ack_delay is None and not self._held:
            return completed, failed
        step = self._step
        for ok, ids in ((True, completed), (False, failed)):
            for job_id in ids:
                delay = self.ack_delay(job_id) if self.ack_delay is not None else 0
                self._held.append(_Held(step + max(0, delay), job_id, ok))
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

    @property
    def held(self) -> int:
        """Completions not yet reported."""
        return len(self._held)
