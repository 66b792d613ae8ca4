"""Prometheus metrics through Ray's own metrics API, named in the style of vLLM's offloading
metrics (``vllm:kv_offload_*`` there, ``raykv_kv_offload_*`` here: Ray no longer accepts ``:``).

The scheduler actor calls ``update`` after every step; it turns the engine's stats snapshot (the
same one the run report is built from) into increments, so the metrics cost a few dict
operations per step whatever is cached.

One convention for the transfer metrics: **counters are totals over all ranks** (``bytes``,
``seconds`` and ``flush_seconds`` add up what every rank copied or waited), and **histograms
observe one rank's one step** (``transfer_size_bytes`` and ``transfer_time_seconds`` get one
observation per rank per step in which that rank copied: its own bytes and its own seconds).
So a histogram's observations add up to the matching counter and its ``_count`` counts
rank-steps (Ray 2.60's exporter rebuilds a histogram's ``_sum`` from bucket midpoints, so read
totals from the counters).
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from raykv.engine.stats import snapshot

_SIZE_BUCKETS = [2**k for k in range(12, 31, 2)]  # 4 KiB .. 1 GiB per step and rank
_DELAY_BUCKETS = [1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0]
_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
_P = "raykv_kv_offload_"


def _makers(labels: dict[str, str]) -> tuple[Any, Any, Any]:
    """Counter, Gauge and Histogram constructors whose metrics also carry ``labels``."""

    def labelled(metric: Any) -> Any:
        if labels:
            metric.set_default_tags(labels)
        return metric

    def counter(name: str, doc: str, keys: tuple[str, ...] = ()) -> Counter:
        return labelled(Counter(name, doc, (*keys, *labels)))

    def gauge(name: str, doc: str, keys: tuple[str, ...] = ()) -> Gauge:
        return labelled(Gauge(name, doc, (*keys, *labels)))

    def histogram(
        name: str, doc: str, boundaries: list[float], keys: tuple[str, ...] = ()
    ) -> Histogram:
        return labelled(Histogram(name, doc, boundaries, (*keys, *labels)))

    return counter, gauge, histogram


class EngineMetrics:
    """The metrics of one engine (one scheduler actor)."""

    def __init__(self, engine: Any, labels: dict[str, str] | None = None) -> None:
        """``labels``: tags every metric of this engine carries (a Serve replica's id, so
        each replica's series stay apart)."""
        self.engine = engine
        counter, gauge, histogram = _makers(labels or {})
        engine.latency.export = True
        d = ("direction",)
        self.bytes = counter(_P + "bytes", "Bytes copied by all ranks, by direction.", d)
        self.seconds = counter(
            _P + "seconds", "Seconds all ranks spent copying (summed), by direction.", d
        )
        self.size = histogram(
            _P + "transfer_size_bytes",
            "Bytes one rank copied in one step (one observation per rank and step).",
            _SIZE_BUCKETS,
            d,
        )
        self.time = histogram(
            _P + "transfer_time_seconds",
            "Seconds one rank spent copying in one step (one observation per rank and step).",
            _DELAY_BUCKETS,
            d,
        )
        self.flush_seconds = counter(
            _P + "flush_seconds", "Seconds all ranks spent in flushes (summed)."
        )
        self.flushes = counter(_P + "flushes", "Jobs flushed, by cause.", ("cause",))
        self.allocation_failures = counter(
            _P + "allocation_failure", "Stores the CPU tier could not make room for."
        )
        self.jobs = gauge(_P + "jobs_in_flight", "Transfer jobs not yet acked by every rank.")
        self.usage = gauge(_P + "cpu_cache_usage_perc", "CPU slots in use, by state.", ("state",))
        self.hits = counter(_P + "hit_tokens", "Prompt tokens found, by tier.", ("tier",))
        self.misses = counter(_P + "miss_tokens", "Prompt tokens computed, not found.")
        self.lookups = counter(_P + "lookups", "CPU-tier key lookups, by result.", ("result",))
        self.evictions = counter(_P + "evictions", "Chunks evicted from the CPU tier.")
        self.acks = counter(_P + "acks", "Rank reports, by kind.", ("kind",))
        self.deferred = counter(_P + "deferred_lookups", "Lookups told to wait for transfers.")
        self.lookup_delay = histogram(
            _P + "lookup_sync_delay_seconds", "Seconds one lookup took.", _DELAY_BUCKETS
        )
        self.deferred_delay = histogram(
            _P + "lookup_async_delay_seconds",
            "Seconds from a request's first deferred lookup to the one that answered.",
            _DELAY_BUCKETS,
        )
        # request latency and prefill by source, named as vLLM names its own (``vllm:...``)
        self.ttft = histogram(
            "raykv_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "raykv_inter_token_latency_seconds",
            "Seconds between a request's consecutive tokens.",
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("raykv_prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("raykv_generation_tokens", "Tokens generated.")
        self.prefill = counter(
            "raykv_prefill_tokens",
            "Prefill tokens each admission needed, by source (computed, gpu_cache, cpu_tier, "
            "disk_tier).",
            ("source",),
        )
        # the tiers beyond the GPU: the disk's own I/O, its moves, and the hits not worth it
        self.disk_bytes = counter(
            _P + "disk_bytes", "Bytes the disk tier's I/O threads moved, by direction.", d
        )
        self.disk_seconds = counter(
            _P + "disk_seconds", "Seconds of the disk tier's I/O (summed), by direction.", d
        )
        self.moves = counter(
            _P + "tier_moves", "Chunks moved between the CPU and disk tiers, by kind.", ("kind",)
        )
        self.skipped = counter(
            _P + "skipped_slower_hits",
            "Tier hits recomputed because loading them was predicted slower, by tier.",
            ("tier",),
        )
        self.disk_usage = gauge(_P + "disk_cache_usage_perc", "Disk-tier chunks held, percent.")
        self._last: dict[str, float] = {}

    def _delta(self, name: str, value: float) -> float:
        prev = self._last.get(name, 0.0)
        self._last[name] = value
        return value - prev

    def _inc(self, metric: Counter, name: str, value: float, tags: dict | None = None) -> None:
        delta = self._delta(name, value)
        if delta > 0:
            metric.inc(delta, tags=tags)

    def update(self) -> None:
        """Export what changed since the last call (the scheduler actor calls it every step)."""
        stats = snapshot(self.engine)
        t = stats.transfer
        for direction in ("store", "load"):
            tags = {"direction": direction}
            nbytes, secs = direction + "_bytes", direction + "_seconds"
            self._inc(self.bytes, nbytes, getattr(t, nbytes), tags)
            self._inc(self.seconds, secs, getattr(t, secs), tags)
            for rank, mine in enumerate(stats.per_rank):
                step_bytes = self._delta(f"{nbytes}/{rank}", getattr(mine, nbytes))
                step_secs = self._delta(f"{secs}/{rank}", getattr(mine, secs))
                if step_bytes > 0:
                    self.size.observe(step_bytes, tags=tags)
                if step_secs > 0:
                    self.time.observe(step_secs, tags=tags)
        self._inc(self.flush_seconds, "flush_s", t.flush_seconds)
        s = stats.scheduler
        self._inc(self.hits, "hit_gpu", s.gpu_hit_tokens, {"tier": "gpu"})
        self._inc(self.hits, "hit_cpu", s.cpu_hit_tokens, {"tier": "cpu"})
        self._inc(self.hits, "hit_disk", s.disk_hit_tokens, {"tier": "disk"})
        computed = s.admitted_tokens - s.gpu_hit_tokens - s.cpu_hit_tokens - s.disk_hit_tokens
        self._inc(self.misses, "miss", computed)
        for source, value in (
            ("computed", computed),
            ("gpu_cache", s.gpu_hit_tokens),
            ("cpu_tier", s.cpu_hit_tokens),
            ("disk_tier", s.disk_hit_tokens),
        ):
            self._inc(self.prefill, "prefill_" + source, value, {"source": source})
        self._inc(self.prompt_tokens, "prompt", stats.prompt_tokens)
        self._inc(self.generation_tokens, "generated", stats.generated_tokens)
        ttft, itl = self.engine.latency.take_new()
        for seconds in ttft:
            self.ttft.observe(seconds)
        for seconds in itl:
            self.itl.observe(seconds)
        cs, d, a = stats.connector, stats.directory, stats.acks
        if cs is None or d is None or a is None:
            return
        for cause in ("reuse", "preemption", "reset"):
            self._inc(self.flushes, "f_" + cause, getattr(cs, "flushes_" + cause), {"cause": cause})
        self._inc(self.allocation_failures, "alloc_fail", cs.allocation_failures)
        self._inc(self.deferred, "deferred", cs.deferred_lookups)
        sync, deferred = self.engine.connector.take_delays()
        for seconds in sync:
            self.lookup_delay.observe(seconds)
        for seconds in deferred:
            self.deferred_delay.observe(seconds)
        self.jobs.set(stats.jobs_in_flight)
        cap = max(d.capacity, 1)
        for state, value in (
            ("used", d.used),
            ("writing", d.writing),
            ("reading", d.reading),
        ):
            self.usage.set(100.0 * value / cap, tags={"state": state})
        self._inc(self.lookups, "l_hit", d.hits, {"result": "hit"})
        self._inc(self.lookups, "l_pending", d.hit_pending, {"result": "hit_pending"})
        self._inc(self.lookups, "l_miss", d.misses, {"result": "miss"})
        self._inc(self.evictions, "evictions", d.evictions)
        for kind in ("acks", "unknown", "stale", "duplicate"):
            self._inc(self.acks, "a_" + kind, getattr(a, kind), {"kind": kind})
        self._update_tiers(stats)

    def _update_tiers(self, stats: Any) -> None:
        for tier, n in stats.skipped_slower.items():
            self._inc(self.skipped, "skip_" + tier, n, {"tier": tier})
        k, m, t = stats.disk, stats.disk_moves, stats.transfer
        if k is None or m is None:
            return
        for direction, nbytes, secs in (
            ("read", t.disk_read_bytes, t.disk_read_seconds),
            ("write", t.disk_write_bytes, t.disk_write_seconds),
        ):
            self._inc(self.disk_bytes, "disk_b_" + direction, nbytes, {"direction": direction})
            self._inc(self.disk_seconds, "disk_s_" + direction, secs, {"direction": direction})
        for kind, n in (
            ("promoted", m.promoted),
            ("demoted", m.demoted),
            ("promotion_failed", m.promotions_failed),
            ("demotion_failed", m.demotions_failed),
            ("corrupt", m.corrupt),
        ):
            self._inc(self.moves, "move_" + kind, n, {"kind": kind})
        self.disk_usage.set(100.0 * k.used / max(k.capacity, 1))
