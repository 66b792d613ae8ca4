"""How the engine reaches its ranks: the ``Workers`` it steps (in this process, or on Ray), the
handle of a step sent to them (``StepHandle``: replies now or later), and ``RankFailed``, which
a step raises when ranks died or went silent during it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from raykv.core.step import StepPlan, StepReport


class RankFailed(RuntimeError):
    """Ranks died (or stopped answering) during a step; ``reports`` are the others' replies."""

    def __init__(self, dead: list[int], reports: list[StepReport]) -> None:
        super().__init__(f"ranks {dead} failed")
        self.dead = dead
        self.reports = reports


class StepHandle(Protocol):
    """A step sent to the ranks: ``result`` waits for their replies (``RankFailed`` as
    ``execute`` raises it)."""

    def result(self) -> list[StepReport]: ...


@dataclass(slots=True)
class DoneStep:
    """A step that already ran (or failed) where it was sent."""

    reports: list[StepReport] = field(default_factory=list)
    failure: RankFailed | None = None

    def result(self) -> list[StepReport]:
        if self.failure is not None:
            raise self.failure
        return self.reports


@dataclass(slots=True)
class SentStep:
    """A step on its way: ``gather`` waits for the replies (what a worker group's ``submit``
    hands back when the replies come later)."""

    gather: Callable[[], list[StepReport]]

    def result(self) -> list[StepReport]:
        return self.gather()


def run_now(execute: Callable[[StepPlan], list[StepReport]], plan: StepPlan) -> DoneStep:
    """Run a step at once, its failure kept for ``result``."""
    try:
        return DoneStep(execute(plan))
    except RankFailed as failure:
        return DoneStep(failure=failure)


class Workers(Protocol):
    num_ranks: int

    def execute(self, plan: StepPlan) -> list[StepReport]: ...

    def submit(self, plan: StepPlan) -> StepHandle:
        """Send the plan and return without waiting for the replies."""
        ...

    def restart(self, ranks: list[int]) -> bool:
        """Replace the ranks; True when each new one found its CPU-pool shard intact."""
        ...

    def disk_index(self) -> list[tuple[str, list[int]]]:
        """Each rank's disk I/O mode and the keys in its disk-tier directory."""
        ...
