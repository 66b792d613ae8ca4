"""The run report's ``tiers``: per offload tier, what it served and what it moved.

``cpu``: hits (tokens loaded from the CPU tier), bytes and GB/s of the ranks' copies each way
(stores into it, loads out of it), evictions, hits passed over as slower than recomputing
(``skipped_slower``) and loaded anyway to keep measuring (``probes``), capacity and use.
``disk``: the same for the disk tier, its bytes and GB/s those of the I/O threads (reads are
promotions into the CPU tier, writes demotions out of it), the chunks moved and the moves that
failed, files found corrupt, names of chunks that were no regular file, the times the disk was full,
what a warm start found, and whether the I/O ran with ``O_DIRECT``. ``later_than_recompute``:
requests whose hit from that tier gave a first token later than the scheduler predicted recomputing
would have.
"""

from __future__ import annotations

from typing import Any

from raykv.engine.stats import EngineStats


def _rate(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def tier_report(
    stats: EngineStats, later_than_recompute: dict[str, int]
) -> dict[str, dict[str, Any]] | None:
    """The ``tiers`` part of a run report (None without offloading)."""
    d = stats.directory
    if d is None:
        return None
    t, s = stats.transfer, stats.scheduler
    skipped, probes = stats.skipped_slower, stats.probes
    tiers: dict[str, dict[str, Any]] = {
        "cpu": {
            "hit_tokens": s.cpu_hit_tokens,
            "load_bytes": t.load_bytes,
            "load_gbps": _rate(t.load_bytes, t.load_seconds),
            "store_bytes": t.store_bytes,
            "store_gbps": _rate(t.store_bytes, t.store_seconds),
            "evictions": d.evictions,
            "skipped_slower": skipped.get("cpu", 0),
            "probes": probes.get("cpu", 0),
            "later_than_recompute": later_than_recompute.get("cpu", 0),
            "capacity_chunks": d.capacity,
            "used_chunks": d.used,
            # slots of failed reads from the store, out of use while those may still land
            "held_chunks": d.held,
        }
    }
    if stats.shared is not None and stats.shared_moves is not None:
        tiers["shared"] = _shared_tier(stats, later_than_recompute)
    k, m = stats.disk, stats.disk_moves
    if k is None or m is None:
        return tiers
    tiers["disk"] = {
        "hit_tokens": s.disk_hit_tokens,
        "read_bytes": t.disk_read_bytes,
        "read_gbps": _rate(t.disk_read_bytes, t.disk_read_seconds),
        "write_bytes": t.disk_write_bytes,
        "write_gbps": _rate(t.disk_write_bytes, t.disk_write_seconds),
        "promotions": m.promotion_jobs,
        "promoted_chunks": m.promoted,
        "promotions_failed": m.promotions_failed,
        "demotions": m.demotion_jobs,
        "demoted_chunks": m.demoted,
        "demotions_failed": m.demotions_failed,
        "corrupt": m.corrupt,
        # names of chunks that were no regular file of this user's (a FIFO, a link, a
        # directory, another user's file), taken away
        "special_files": t.disk_special,
        "full_events": m.full_events,
        "unavailable_events": m.unavailable_events,
        "evictions": k.evictions,
        "skipped_slower": skipped.get("disk", 0),
        "probes": probes.get("disk", 0),
        "later_than_recompute": later_than_recompute.get("disk", 0),
        "capacity_chunks": k.capacity,
        "used_chunks": k.used,
        "warm_start_chunks": stats.disk_warm_chunks,
        # CPU chunks given up that the disk already held, that it refused, and that stores
        # evicted without a demotion (the reserve fell short)
        "already_on_disk": m.already_on_disk,
        "not_admitted": m.not_admitted,
        "cpu_evicted_undemoted": d.evictions - d.left,
        "io": stats.disk_io or "unknown",
    }
    return tiers


def _shared_tier(stats: EngineStats, later_than_recompute: dict[str, int]) -> dict[str, Any]:
    """The shared tier's part of the report: hits, bytes each way, moves, what lookups found."""
    t, s, m, k = stats.transfer, stats.scheduler, stats.shared_moves, stats.shared
    assert m is not None and k is not None
    return {
        "hit_tokens": s.shared_hit_tokens,
        "read_bytes": t.shared_read_bytes,
        "read_gbps": _rate(t.shared_read_bytes, t.shared_read_seconds),
        "write_bytes": t.shared_write_bytes,
        "write_gbps": _rate(t.shared_write_bytes, t.shared_write_seconds),
        "publishes": m.publish_jobs,
        "published_chunks": m.published,
        "publishes_failed": m.publishes_failed,
        "promotions": m.promotion_jobs,
        "promoted_chunks": m.promoted,
        "promotions_failed": m.promotions_failed,
        "gone": m.gone,  # chunks a promotion found missing or spoiled
        "corrupt_parts": t.shared_corrupt,
        "asked_chunks": m.asked,
        "found_chunks": m.found,
        "full_events": m.full_events,
        "unavailable_events": m.unavailable_events,
        "skipped_slower": stats.skipped_slower.get("shared", 0),
        "probes": stats.probes.get("shared", 0),
        "later_than_recompute": later_than_recompute.get("shared", 0),
        "index_chunks": k.used,
    }
