"""What a tier's directory answers: a lookup's result, a store's plan, and its counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum


class LookupResult(IntEnum):
    """What a tier can do for one key right now."""

    MISS = 0
    HIT = 1
    HIT_PENDING = 2


MISS, HIT, HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


@dataclass(slots=True)
class StorePlan:
    """The outcome of ``prepare_store``: the keys to copy, their slots (same order), and the keys
    evicted to make room. An empty plan means nothing needs storing; it is not a failure."""

    keys: list[int]
    slots: list[int]
    evicted: list[int]


@dataclass(slots=True)
class DirectoryStats:
    """A snapshot of the directory's gauges and cumulative counters (counted in keys)."""

    capacity: int
    used: int
    ready_idle: int
    writing: int
    reading: int
    lookups: int
    hits: int
    hit_pending: int
    misses: int
    keys_offered: int
    keys_stored: int
    keys_deduped: int
    keys_filtered: int
    keys_not_admitted: int
    evictions: int
    allocation_failures: int
    store_failures: int
    loads: int
    policy: str
    leaving: int = 0  # given up to the tier below, still being copied there (or read)
    left: int = 0  # of the evictions, chunks given up to the tier below (``start_leaving``)
    held: int = 0  # slots of failed reads from the store, not reused until those cannot land

    @property
    def usage(self) -> float:
        return self.used / self.capacity

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
