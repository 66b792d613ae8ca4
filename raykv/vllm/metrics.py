"""raykv's tiers in vLLM's Prometheus metrics: what each tier was asked, held, stored, loaded
and evicted, and the chunks found bad, beside vLLM's own offloading metrics (bytes and seconds
of every load and store, which vLLM takes from the workers' job results).

The manager reports through vLLM's ``get_stats`` (counters as increments since the last call,
gauges as snapshots); vLLM's logger turns them into the metrics ``metric_definitions`` names,
each labelled with the tier (``cpu``, ``disk``, ``shared``).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from raykv.offload.records import DirectoryStats

TIER = ("tier",)
# counter name -> (DirectoryStats field, what it counts)
COUNTERS = {
    "raykv:tier_lookups": ("lookups", "Chunks vLLM asked the tier for."),
    "raykv:tier_hits": ("hits", "Chunks the tier held, ready, when asked."),
    "raykv:tier_chunks_stored": ("keys_stored", "Chunks the tier began to store."),
    "raykv:tier_chunks_loaded": ("loads", "Chunks loads read from the tier."),
    "raykv:tier_evictions": ("evictions", "Chunks the tier's policy evicted."),
    "raykv:tier_store_failures": ("store_failures", "Stores into the tier that failed."),
}
BAD_CHUNKS = "raykv:bad_chunks"
REFUSED_LOADS = "raykv:refused_loads"
FOUND_IN_STORE = "raykv:shared_found"
SKIPPED_SLOWER = "raykv:skipped_slower"
# gauge name -> (DirectoryStats field, what it holds)
GAUGES = {
    "raykv:tier_chunks": ("used", "Chunks the tier holds or is writing."),
    "raykv:tier_capacity_chunks": ("capacity", "Chunks the tier has room for."),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics raykv's manager reports (``OffloadingSpec.build_metric_definitions``)."""
    found: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=text, labelnames=TIER)
        for name, (_, text) in COUNTERS.items()
    }
    found[BAD_CHUNKS] = OffloadingCounterMetadata(
        documentation="Chunks a worker found bad (checksum, forged or missing file); they leave "
        "the tier and their loads are recomputed.",
        labelnames=TIER,
    )
    found[REFUSED_LOADS] = OffloadingCounterMetadata(
        documentation="Loads refused (recomputed): no CPU room to promote their disk chunks, "
        "or a chunk left the disk tier after its lookup."
    )
    found[FOUND_IN_STORE] = OffloadingCounterMetadata(
        documentation="Chunks another engine published that lookups found in the shared tier's "
        "store."
    )
    found[SKIPPED_SLOWER] = OffloadingCounterMetadata(
        documentation="Tier hits recomputed because loading them was predicted slower "
        "(take_hits: faster), by the deepest tier the load would have read.",
        labelnames=TIER,
    )
    for name, (_, text) in GAUGES.items():
        found[name] = OffloadingGaugeMetadata(documentation=text, labelnames=TIER)
    return found


class TierMetrics:
    """The increments since the last report, from each tier's cumulative counters."""

    def __init__(self) -> None:
        self._last: dict[str, DirectoryStats] = {}
        self.bad: dict[str, int] = {}
        self.refused = 0
        self.found = 0
        self._skipped: dict[str, int] = {}

    def report(
        self, tiers: dict[str, DirectoryStats], skipped: dict[str, int] | None = None
    ) -> OffloadingConnectorStats:
        """The changes since the last report; ``skipped``: the choice's cumulative hits passed
        over as slower, by tier."""
        stats = OffloadingConnectorStats()
        for tier, total in (skipped or {}).items():
            change = total - self._skipped.get(tier, 0)
            if change > 0:
                stats.increase_counter(SKIPPED_SLOWER, change, (tier,))
            self._skipped[tier] = total
        for tier, now in tiers.items():
            before = self._last.get(tier)
            for name, (attribute, _) in COUNTERS.items():
                change = getattr(now, attribute) - (getattr(before, attribute) if before else 0)
                if change > 0:
                    stats.increase_counter(name, change, (tier,))
            for name, (attribute, _) in GAUGES.items():
                stats.set_gauge(name, getattr(now, attribute), (tier,))
            self._last[tier] = now
        for tier, count in self.bad.items():
            if count:
                stats.increase_counter(BAD_CHUNKS, count, (tier,))
        if self.refused:
            stats.increase_counter(REFUSED_LOADS, self.refused)
        if self.found:
            stats.increase_counter(FOUND_IN_STORE, self.found)
        self.bad, self.refused, self.found = {}, 0, 0
        return stats
