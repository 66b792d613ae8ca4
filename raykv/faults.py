"""Fault injection: seeded, reproducible faults that users and tests can switch on.

Specs (repeatable ``--fault`` option, or the ``faults:`` config list):

- ``kill-worker:rate=P``         each step, each rank dies with probability P
- ``kill-worker:step=N:rank=R``  rank R dies at step N
- ``delay-acks:rank=R:steps=K``  rank R reports every completion K steps late (with ``rate=P``,
                                 each completion with probability P, the others at once)
- ``drop-acks:rate=P``           each completion report is lost with probability P
- ``dup-acks:rate=P``            each completion report is delivered twice with probability P
- ``fail-copy:rate=P``           each copy job fails with probability P
- ``corrupt-cpu:rate=P``         each stored chunk has a byte flipped in the CPU pool, after
                                 its store landed, with probability P (``offload.verify``
                                 catches it at load time: the load fails, the chunk leaves the
                                 tier, the request recomputes)
- ``stall-worker:step=N:rank=R:seconds=S``  rank R hangs S seconds in step N, as a rank stuck
                                 in a copy or a collective would (its first incarnation; on Ray
                                 it is dead once ``parallel.step_timeout_s`` passes)
- ``kill-scheduler:step=N``      the scheduler actor dies at step N (Ray engine; its replacement
                                 lives)
- ``fail-scheduler:step=N``      the scheduler's step N raises, as a bug in the engine would
                                 (Ray engine: a serving loop ends, and a Serve replica reports
                                 itself unhealthy and is replaced; every instance reads the same
                                 config, so a replacement fails at its own step N again)

Any of them takes ``:seed=S``, and those of a rank ``:incarnation=I``: only that instance of the
rank suffers it (0 is the first; each replacement after a death counts one up). Every rank draws
from its own generator seeded by (seed, rank, kind), so a run with the same faults fails the same
way every time (``kill-worker:step`` and ``kill-scheduler`` draw nothing: the seed changes
nothing there). A spec's ``rank`` must be a
rank of the run (below ``parallel.tensor_parallel_size``; the config checks that).

The faults act at two seams, wrapped around a rank once where it is built: ``FaultyBackend``
around its transfer backend (failed copies) and ``FaultyRank`` around its step (deaths; lost,
duplicated and late reports). The production classes carry no fault hooks of their own.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raykv.core.step import StepPlan, StepReport, TransferSpec


class RankDied(RuntimeError):
    """This rank is gone (an injected fault; on Ray the actor process exits instead)."""


class SchedulerFault(RuntimeError):
    """The injected failure of a scheduler's step (``fail-scheduler``)."""


KINDS = (
    "kill-worker",
    "delay-acks",
    "drop-acks",
    "dup-acks",
    "fail-copy",
    "corrupt-cpu",
    "stall-worker",
    "kill-scheduler",
    "fail-scheduler",
)
# faults of the scheduler, not of a rank
SCHEDULER_KINDS = ("kill-scheduler", "fail-scheduler")
_PARAMS = {
    "kill-worker": {"rate", "step", "rank", "seed", "incarnation"},
    "delay-acks": {"rank", "steps", "rate", "seed", "incarnation"},
    "drop-acks": {"rate", "seed", "rank", "incarnation"},
    "dup-acks": {"rate", "seed", "rank", "incarnation"},
    "fail-copy": {"rate", "seed", "rank", "incarnation"},
    "corrupt-cpu": {"rate", "seed", "rank", "incarnation"},
    "stall-worker": {"step", "rank", "seconds", "seed"},
    "kill-scheduler": {"step", "seed"},  # seed: accepted like everywhere, nothing is drawn
    "fail-scheduler": {"step", "seed"},
}


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message quotes it."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rate: float = 0.0
    step: int | None = None
    rank: int | None = None
    steps: int = 0
    seed: int = 0
    incarnation: int | None = None  # only this instance of the rank (0: before any restart)
    seconds: float = 0.0  # stall-worker: how long the rank hangs

    def applies_to(self, rank: int, incarnation: int = 0) -> bool:
        return (
            self.kind not in SCHEDULER_KINDS
            and (self.rank is None or self.rank == rank)
            and (self.incarnation is None or self.incarnation == incarnation)
        )


def scheduler_dies_at(faults: list[Fault], step: int, incarnation: int) -> bool:
    """The scheduler actor dies after ``step`` (only the first one: a replacement lives)."""
    return incarnation == 0 and any(f.kind == "kill-scheduler" and f.step == step for f in faults)


def scheduler_fails_at(faults: list[Fault], step: int) -> bool:
    """The scheduler's step ``step`` raises (``fail-scheduler``)."""
    return any(f.kind == "fail-scheduler" and f.step == step for f in faults)


def parse_fault(text: str) -> Fault:
    """``kind:key=value:...`` -> Fault; errors quote the spec and name the part at fault."""
    kind, *parts = text.strip().split(":")
    if kind not in KINDS:
        raise FaultSpecError(f"fault {text!r}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    values: dict[str, float | int] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key not in _PARAMS[kind]:
            allowed = ", ".join(sorted(_PARAMS[kind]))
            raise FaultSpecError(f"fault {text!r}: bad parameter {part!r} (takes {allowed})")
        try:
            values[key] = float(raw) if key in ("rate", "seconds") else int(raw)
        except ValueError:
            raise FaultSpecError(f"fault {text!r}: {key}={raw!r} is not a number") from None
    rate = float(values.get("rate", 1.0 if kind == "delay-acks" else 0.0))
    if not 0.0 <= rate <= 1.0:
        raise FaultSpecError(f"fault {text!r}: rate must be within [0, 1], got {rate}")
    if kind == "kill-worker" and ("rate" in values) == ("step" in values):
        raise FaultSpecError(f"fault {text!r}: kill-worker takes rate=P or step=N (with rank=R)")
    if kind == "kill-worker" and "step" in values and "rank" not in values:
        raise FaultSpecError(f"fault {text!r}: kill-worker:step=N needs rank=R")
    if kind == "delay-acks" and ("rank" not in values or "steps" not in values):
        raise FaultSpecError(f"fault {text!r}: delay-acks needs rank=R and steps=K")
    if kind == "stall-worker" and not {"step", "rank", "seconds"} <= values.keys():
        raise FaultSpecError(f"fault {text!r}: stall-worker needs step=N, rank=R and seconds=S")
    if kind in SCHEDULER_KINDS and "step" not in values:
        raise FaultSpecError(f"fault {text!r}: {kind} needs step=N")
    if kind in ("drop-acks", "dup-acks", "fail-copy", "corrupt-cpu") and "rate" not in values:
        raise FaultSpecError(f"fault {text!r}: {kind} needs rate=P")
    for key in ("rank", "step", "steps", "incarnation", "seconds"):
        if key in values and values[key] < 0:
            raise FaultSpecError(f"fault {text!r}: {key} must be >= 0")
    return Fault(
        kind,
        rate=rate,
        step=int(values["step"]) if "step" in values else None,
        rank=int(values["rank"]) if "rank" in values else None,
        steps=int(values.get("steps", 0)),
        seed=int(values.get("seed", 0)),
        incarnation=int(values["incarnation"]) if "incarnation" in values else None,
        seconds=float(values.get("seconds", 0.0)),
    )


@dataclass(slots=True)
class RankFaults:
    """The faults one rank suffers, with its own reproducible random streams."""

    rank: int
    faults: list[Fault] = field(default_factory=list)
    incarnation: int = 0  # a restarted rank draws fresh numbers, not its predecessor's again
    _rngs: dict[int, random.Random] = field(default_factory=dict)

    def _rng(self, i: int) -> random.Random:
        rng = self._rngs.get(i)
        if rng is None:
            f = self.faults[i]
            rng = random.Random(f"{f.seed}/{self.rank}/{f.kind}/{i}/{self.incarnation}")
            self._rngs[i] = rng
        return rng

    def _mine(self, kind: str) -> list[tuple[int, Fault]]:
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if f.kind == kind and f.applies_to(self.rank, self.incarnation)
        ]

    def dies_at(self, step: int) -> bool:
        for i, f in self._mine("kill-worker"):
            if f.step is not None:
                if f.step == step and self.incarnation == 0:
                    return True
            elif self._rng(i).random() < f.rate:
                return True
        return False

    def stall_at(self, step: int) -> float:
        """Seconds this rank hangs in ``step`` (its first incarnation only)."""
        if self.incarnation != 0:
            return 0.0
        return sum(f.seconds for _, f in self._mine("stall-worker") if f.step == step)

    def ack_delay(self) -> int:
        """Steps to hold the report of one completion back (0: report it now)."""
        delay = 0
        for i, f in self._mine("delay-acks"):
            if f.rate >= 1.0 or self._rng(i).random() < f.rate:
                delay = max(delay, f.steps)
        return delay

    @property
    def delays_acks(self) -> bool:
        return bool(self._mine("delay-acks"))

    def drops(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("drop-acks"))

    def duplicates(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("dup-acks"))

    def copy_fails(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("fail-copy"))

    def corrupts(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("corrupt-cpu"))

    @property
    def active(self) -> bool:
        return any(f.applies_to(self.rank, self.incarnation) for f in self.faults)


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
