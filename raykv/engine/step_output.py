"""What the scheduler decides for one step (``SchedulerOutput``) and the counters it keeps
(``SchedulerStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.connector.scheduled import ScheduledRequest
from raykv.core.request import Request
from raykv.core.step import TransferPlan


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: the requests and their token counts, the requests preempted to
    make room, and the step's transfers."""

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    transfers: TransferPlan = field(default_factory=TransferPlan)
    started_loads: int = 0
    # the positions the step's tokens attend over, summed (what its prefill costs grow with)
    attention: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def attention_work(self) -> float:
        """The positions this step's tokens attend over, summed (read while the requests'
        computed counts are still those before the step)."""
        return sum(n * s.start + n * (n + 1) / 2 for s in self.scheduled for n in [s.num_tokens])


@dataclass(slots=True)
class SchedulerStats:
    preemptions: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    disk_hit_tokens: int = 0  # tier hits promoted from the disk tier (not in cpu_hit_tokens)
    recomputed_tokens: int = 0  # prompt tokens computed again after a preemption or failed load
    # tokens each admission had to provide, from a cache or by computing them (re-admissions after
    # a preemption, a failed load or a rank restart count again): what hits are a share of
    admitted_tokens: int = 0
    deferred: int = 0
