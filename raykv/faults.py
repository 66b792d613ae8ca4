"""Fault injection: seeded, reproducible faults that users and tests can switch on.

Specs (repeatable ``--fault`` option, or the ``faults:`` config list):

- ``kill-worker:rate=P``         each step, each rank dies with probability P
- ``kill-worker:step=N:rank=R``  rank R dies at step N
- ``delay-acks:rank=R:steps=K``  rank R reports every completion K steps late
- ``drop-acks:rate=P``           each completion report is lost with probability P
- ``dup-acks:rate=P``            each completion report is delivered twice with probability P
- ``fail-copy:rate=P``           each copy job fails with probability P
- ``kill-scheduler:step=N``      the scheduler actor dies at step N (Ray engine; its replacement
                                 lives)

Any of them takes ``:seed=S``. Every rank draws from its own generator seeded by (seed, rank,
kind), so a run with the same faults fails the same way every time (``kill-worker:step`` and
``kill-scheduler`` draw nothing: the seed changes nothing there). A spec's ``rank`` must be a
rank of the run (below ``parallel.tensor_parallel_size``; the config checks that).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill-worker", "delay-acks", "drop-acks", "dup-acks", "fail-copy", "kill-scheduler")
_PARAMS = {
    "kill-worker": {"rate", "step", "rank", "seed"},
    "delay-acks": {"rank", "steps", "seed"},
    "drop-acks": {"rate", "seed", "rank"},
    "dup-acks": {"rate", "seed", "rank"},
    "fail-copy": {"rate", "seed", "rank"},
    "kill-scheduler": {"step", "seed"},  # seed: accepted like everywhere, nothing is drawn
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

    def applies_to(self, rank: int) -> bool:
        return self.kind != "kill-scheduler" and (self.rank is None or self.rank == rank)


def scheduler_dies_at(faults: list[Fault], step: int, incarnation: int) -> bool:
    """The scheduler actor dies after ``step`` (only the first one: a replacement lives)."""
    return incarnation == 0 and any(f.kind == "kill-scheduler" and f.step == step for f in faults)


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
            values[key] = float(raw) if key == "rate" else int(raw)
        except ValueError:
            raise FaultSpecError(f"fault {text!r}: {key}={raw!r} is not a number") from None
    rate = float(values.get("rate", 0.0))
    if not 0.0 <= rate <= 1.0:
        raise FaultSpecError(f"fault {text!r}: rate must be within [0, 1], got {rate}")
    if kind == "kill-worker" and ("rate" in values) == ("step" in values):
        raise FaultSpecError(f"fault {text!r}: kill-worker takes rate=P or step=N (with rank=R)")
    if kind == "kill-worker" and "step" in values and "rank" not in values:
        raise FaultSpecError(f"fault {text!r}: kill-worker:step=N needs rank=R")
    if kind == "delay-acks" and ("rank" not in values or "steps" not in values):
        raise FaultSpecError(f"fault {text!r}: delay-acks needs rank=R and steps=K")
    if kind == "kill-scheduler" and "step" not in values:
        raise FaultSpecError(f"fault {text!r}: kill-scheduler needs step=N")
    if kind in ("drop-acks", "dup-acks", "fail-copy") and "rate" not in values:
        raise FaultSpecError(f"fault {text!r}: {kind} needs rate=P")
    for key in ("rank", "step", "steps"):
        if key in values and int(values[key]) < 0:
            raise FaultSpecError(f"fault {text!r}: {key} must be >= 0")
    return Fault(
        kind,
        rate=rate,
        step=int(values["step"]) if "step" in values else None,
        rank=int(values["rank"]) if "rank" in values else None,
        steps=int(values.get("steps", 0)),
        seed=int(values.get("seed", 0)),
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
            (i, f) for i, f in enumerate(self.faults) if f.kind == kind and f.applies_to(self.rank)
        ]

    def dies_at(self, step: int) -> bool:
        for i, f in self._mine("kill-worker"):
            if f.step is not None:
                if f.step == step and self.incarnation == 0:
                    return True
            elif self._rng(i).random() < f.rate:
                return True
        return False

    def ack_delay(self) -> int:
        return max((f.steps for _, f in self._mine("delay-acks")), default=0)

    def drops(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("drop-acks"))

    def duplicates(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("dup-acks"))

    def copy_fails(self) -> bool:
        return any(self._rng(i).random() < f.rate for i, f in self._mine("fail-copy"))

    @property
    def active(self) -> bool:
        return any(f.applies_to(self.rank) for f in self.faults)
