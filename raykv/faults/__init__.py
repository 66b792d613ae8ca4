"""Fault injection: the specs (``specs.py``) and the wrappers that make a rank suffer them
(``wrappers.py`` around its transfer backend and its step, ``tiers.py`` around its disk and
shared-store engines)."""

from raykv.faults.specs import (
    DISK_KINDS,
    KINDS,
    SCHEDULER_KINDS,
    SHARED_KINDS,
    Fault,
    FaultSpecError,
    RankDied,
    RankFaults,
    SchedulerFault,
    parse_fault,
    scheduler_dies_at,
    scheduler_fails_at,
    strikes_at,
)
from raykv.faults.tiers import FaultyTier
from raykv.faults.wrappers import FaultyBackend, FaultyRank, Rank

__all__ = [
    "DISK_KINDS",
    "KINDS",
    "SCHEDULER_KINDS",
    "SHARED_KINDS",
    "Fault",
    "FaultSpecError",
    "FaultyBackend",
    "FaultyRank",
    "FaultyTier",
    "Rank",
    "RankDied",
    "RankFaults",
    "SchedulerFault",
    "parse_fault",
    "scheduler_dies_at",
    "scheduler_fails_at",
    "strikes_at",
]
