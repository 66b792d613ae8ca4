"""What the scheduler decides for one step (``SchedulerOutput``; with its plan, ``PlannedStep``)
and the counters the scheduler and the engine keep (``SchedulerStats``, ``EngineTotals``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.connector.scheduled import ScheduledRequest
from raykv.core.request import Request
from raykv.core.step import StepPlan, TransferPlan, TransferStats


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
    shared_hit_tokens: int = 0  # ... and from the shared tier (in neither)
    recomputed_tokens: int = 0  # prompt tokens computed again after a preemption or failed load
    # tokens each admission had to provide, from a cache or by computing them (re-admissions after
    # a preemption, a failed load or a rank restart count again): what hits are a share of
    admitted_tokens: int = 0
    deferred: int = 0


@dataclass(slots=True)
class PlannedStep:
    """A step planned. Planned ahead (async scheduling): ``pending``, its entries whose tokens
    wait for the step before's samples, and ``sampling``, its entries that sample (both empty
    one step at a time)."""

    sched: SchedulerOutput
    plan: StepPlan
    pending: list[int] = field(default_factory=list)
    sampling: frozenset[int] = frozenset()


@dataclass(slots=True)
class EngineTotals:
    """The engine's own counters (``engine/stats.py`` snapshots them with the others')."""

    steps: int = 0
    idle_steps: int = 0  # steps with no tokens scheduled (polling and acking only)
    rank_restarts: int = 0  # ranks that died or went silent and were replaced
    tier_kept_restarts: int = 0  # of those, restarts after which the CPU tier was kept
    transfer: TransferStats = field(default_factory=TransferStats)
    per_rank: list[TransferStats] = field(default_factory=list)  # transfer stats by rank
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # wall seconds of the steps here (plan, fan-out, update), and of the slowest rank's own
    # work in each (its copies and model): the difference is the control plane and scheduler
    step_seconds: float = 0.0
    ranks_busy_seconds: float = 0.0
    ranks_model_seconds: float = 0.0  # of the busiest rank's work, its model's
    busy_step_seconds: float = 0.0  # of step_seconds, the steps that computed tokens
    # async scheduling: tokens sampled for requests that had ended (EOS in the step before,
    # unknown when this one was planned) or were aborted while the step ran
    discarded_samples: int = 0
    # requests ended by a sample their rank could not draw (``RequestStatus.FINISHED_ERROR``)
    failed_requests: int = 0
