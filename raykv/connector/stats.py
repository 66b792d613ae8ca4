"""The connector's counters (scheduler half), read by the run report and the metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ConnectorStats:
    lookups: int = 0
    deferred_lookups: int = 0
    load_jobs: int = 0
    load_blocks: int = 0
    store_jobs: int = 0
    store_blocks: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    corrupt_loads: int = 0  # failed loads whose chunk was corrupt (dropped from the tier)
    allocation_failures: int = 0
    flushes_reuse: int = 0
    flushes_preemption: int = 0
    flushes_reset: int = 0
    flushes_timeout: int = 0  # re-ack requests for jobs unacked too long
    deferral_timeouts: int = 0  # requests that stopped waiting and recomputed
    promotions_waited: int = 0  # lookups that started a promotion from disk and waited for it
