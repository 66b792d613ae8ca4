"""Fault specs: seeded, reproducible faults that users and tests can switch on.

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
- ``fail-disk:rate=P``           each disk-tier job (a demotion or a promotion) fails with
                                 probability P, as a read or write that got EIO
- ``corrupt-disk:rate=P``        each chunk file a demotion wrote has a byte flipped, after it
                                 landed, with probability P (its promotion finds the checksum
                                 wrong: the file is deleted, the request recomputes)
- ``slow-disk:ms=N``             every disk-tier job takes at least N ms
- ``full-disk``                  every demotion finds the disk full (ENOSPC), after the first
                                 ``:after=N`` chunks (0 by default): the tier stops admitting
- ``kill-shared-master:step=N``  the shared tier's embedded Mooncake master is killed at step N:
                                 publishes and promotions fail, requests recompute, the tier is
                                 out of use for ``offload.shared.retry_steps`` at a time
- ``fail-shared:rate=P``, ``corrupt-shared:rate=P``, ``slow-shared:ms=N``,
  ``full-shared:after=N``        the disk's four, for each rank's shared-tier jobs (a part put
                                 spoiled is found by the CRC-32s of a promotion; a full pool fails
                                 publishes and pauses them)
- ``lose-shared:rate=P``         each chunk a rank published has that rank's part removed from the
                                 store once it landed, with probability P (a part missing for
                                 one rank: a promotion of it fails, the request recomputes)
- ``kill-store-actor:step=N``    the shared tier's segment on the scheduler's node is killed at
                                 step N (its store actor on Ray, restarted empty; the segment's
                                 process in one process): what it held is gone, reads of it
                                 fail, requests recompute

Any of them takes ``:seed=S``, and those of a rank ``:incarnation=I``: only that instance of the
rank suffers it (0 is the first; each replacement after a death counts one up). Every rank draws
from its own generator seeded by (seed, rank, kind), so a run with the same faults fails the same
way every time (``kill-worker:step`` and ``kill-scheduler`` draw nothing: the seed changes
nothing there). A spec's ``rank`` must be a
rank of the run (below ``parallel.tensor_parallel_size``; the config checks that).

The faults act at three seams, wrapped around a rank once where it is built
(``faults/wrappers.py``, ``faults/tiers.py``): ``FaultyBackend`` around its transfer backend
(failed copies), ``FaultyTier`` around its disk and shared-store engines and ``FaultyRank``
around its step (deaths; lost, duplicated and late reports). The production classes carry no
fault hooks of their own but for those that spoil or remove bytes where they live
(``corrupt_rows``, ``spoil``, ``lose``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


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
    "fail-disk",
    "corrupt-disk",
    "slow-disk",
    "full-disk",
    "kill-shared-master",
    "kill-store-actor",
    "fail-shared",
    "corrupt-shared",
    "lose-shared",
    "slow-shared",
    "full-shared",
)
# faults of the scheduler (or of what the engine runs beside it), not of a rank
SCHEDULER_KINDS = ("kill-scheduler", "fail-scheduler", "kill-shared-master", "kill-store-actor")
# faults of a rank's engine for a tier below the CPU tier
DISK_KINDS = ("fail-disk", "corrupt-disk", "slow-disk", "full-disk")
SHARED_KINDS = ("fail-shared", "corrupt-shared", "lose-shared", "slow-shared", "full-shared")
TIER_KINDS = {"disk": DISK_KINDS, "shared": SHARED_KINDS}
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
    "fail-disk": {"rate", "seed", "rank", "incarnation"},
    "corrupt-disk": {"rate", "seed", "rank", "incarnation"},
    "slow-disk": {"ms", "rank", "seed", "incarnation"},
    "full-disk": {"after", "rank", "seed", "incarnation"},
    "kill-shared-master": {"step", "seed"},
    "kill-store-actor": {"step", "seed"},
    "fail-shared": {"rate", "seed", "rank", "incarnation"},
    "corrupt-shared": {"rate", "seed", "rank", "incarnation"},
    "lose-shared": {"rate", "seed", "rank", "incarnation"},
    "slow-shared": {"ms", "rank", "seed", "incarnation"},
    "full-shared": {"after", "rank", "seed", "incarnation"},
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
    ms: float = 0.0  # slow-disk: the least time a disk job takes
    after: int = 0  # full-disk: chunks written before the disk is full

    def applies_to(self, rank: int, incarnation: int = 0) -> bool:
        return (
            self.kind not in SCHEDULER_KINDS
            and (self.rank is None or self.rank == rank)
            and (self.incarnation is None or self.incarnation == incarnation)
        )


def scheduler_dies_at(faults: list[Fault], step: int, incarnation: int) -> bool:
    """The scheduler actor dies after ``step`` (only the first one: a replacement lives)."""
    return incarnation == 0 and any(f.kind == "kill-scheduler" and f.step == step for f in faults)


def strikes_at(faults: list[Fault], kind: str, step: int) -> bool:
    """A fault of ``kind`` that strikes at ``step`` (``kill-shared-master``,
    ``kill-store-actor``: what the engine runs beside the scheduler)."""
    return any(f.kind == kind and f.step == step for f in faults)


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
            values[key] = float(raw) if key in ("rate", "seconds", "ms") else int(raw)
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
    rated = (
        "drop-acks",
        "dup-acks",
        "fail-copy",
        "corrupt-cpu",
        "fail-disk",
        "corrupt-disk",
        "fail-shared",
        "corrupt-shared",
        "lose-shared",
    )
    if kind in rated and "rate" not in values:
        raise FaultSpecError(f"fault {text!r}: {kind} needs rate=P")
    if kind in ("slow-disk", "slow-shared") and "ms" not in values:
        raise FaultSpecError(f"fault {text!r}: {kind} needs ms=N")
    for key in ("rank", "step", "steps", "incarnation", "seconds", "ms", "after"):
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
        ms=float(values.get("ms", 0.0)),
        after=int(values.get("after", 0)),
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

    # a tier below the CPU tier (``disk`` or ``shared``): ``fail-<tier>`` and the like

    def _drawn(self, kind: str) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine(kind))

    def tier_fails(self, tier: str) -> bool:
        return self._drawn(f"fail-{tier}")

    def tier_corrupts(self, tier: str) -> bool:
        return self._drawn(f"corrupt-{tier}")

    def tier_loses(self, tier: str) -> bool:
        """This rank's copy of a written chunk goes missing (``lose-shared``)."""
        return self._drawn(f"lose-{tier}")

    def tier_delay_s(self, tier: str) -> float:
        """The least seconds a job of the tier takes (``slow-<tier>``)."""
        return max((f.ms for _, f in self._mine(f"slow-{tier}")), default=0.0) / 1000.0

    def tier_room(self, tier: str) -> int | None:
        """Chunks the tier takes before it is full (``full-<tier>``); None: no limit."""
        limits = [f.after for _, f in self._mine(f"full-{tier}")]
        return min(limits) if limits else None

    def tier_active(self, tier: str) -> bool:
        """Any fault of this tier applies to this rank."""
        return any(
            f.kind in TIER_KINDS[tier] and f.applies_to(self.rank, self.incarnation)
            for f in self.faults
        )

    @property
    def active(self) -> bool:
        return any(f.applies_to(self.rank, self.incarnation) for f in self.faults)
