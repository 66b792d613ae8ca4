"""The disk tier as the engine builds it: its directory, its size in chunks, and a warm start
from the files an earlier run left.

At start every rank lists the chunk files of its directory of the namespace
(``LocalWorker.disk_index``; stale temporary files of crashed writers are swept on the way). A
chunk is served only where every rank holds its part: those are taken into the directory as
ready (as many as its capacity holds, the newest files where there are more: a tier restarted
with a smaller capacity), and the files of the others (a part some rank lacks, or beyond the
capacity) are deleted on every rank by the first step. The capacity must fit the file
system: at most its free space plus what this namespace's files already take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raykv.config import ConfigError, RaykvConfig
from raykv.config.disk import free_bytes
from raykv.core.kv_events import MEDIUM_DISK, EventLog
from raykv.engine.ranks import Workers
from raykv.offload.directory import Directory
from raykv.transfer.disk_files import ChunkFormat

log = logging.getLogger(__name__)


def file_bytes(cfg: RaykvConfig) -> int:
    """Bytes of one chunk's file on one rank (header, pages, padding)."""
    return ChunkFormat(cfg.page_bytes(), cfg.offload.blocks_per_chunk).file_bytes


def disk_slots(cfg: RaykvConfig) -> int:
    """Chunks the disk tier holds: its capacity over one chunk's files on every rank."""
    per_chunk = file_bytes(cfg) * cfg.parallel.tensor_parallel_size
    return cfg.offload.disk.capacity // per_chunk


def disk_directory(cfg: RaykvConfig, events: EventLog) -> Directory | None:
    """The disk tier's directory (None: no disk tier); ConfigError naming
    ``offload.disk.capacity`` when it holds no chunk."""
    o = cfg.offload
    if not (o.enabled and o.disk.enabled):
        return None
    slots = disk_slots(cfg)
    if slots < 1:
        raise ConfigError(
            f"offload.disk.capacity ({o.disk.capacity}) is smaller than one chunk's files "
            f"({file_bytes(cfg) * cfg.parallel.tensor_parallel_size} bytes on all ranks)"
        )
    return Directory(
        slots,
        o.disk.policy,
        store_threshold=o.disk.store_threshold,
        max_tracker_size=o.max_tracker_size,
        events=events,
        medium=MEDIUM_DISK,
    )


def reserve_slots(cfg: RaykvConfig) -> int:
    """CPU slots the disk tier's demotions keep free: ``offload.disk.reserve_fraction`` of the
    CPU tier, and at least what two steps can fill (a demotion takes a step or more to land,
    and the stores of those steps find room meanwhile), at most half the tier."""
    slots = cfg.cpu_slots()
    tokens_per_chunk = cfg.cache.block_size * cfg.offload.blocks_per_chunk
    per_step = -(-cfg.engine.max_num_batched_tokens // tokens_per_chunk) * len(cfg.cache.groups)
    wanted = max(int(slots * cfg.offload.disk.reserve_fraction), 2 * per_step)
    return max(1, min(wanted, slots // 2))


@dataclass(slots=True)
class WarmStart:
    """What a warm start found: the chunks taken in, the keys whose files must go (on every
    rank), and how the ranks do their I/O (``direct``, ``buffered`` or ``mixed``)."""

    taken: int = 0
    drop: list[int] = field(default_factory=list)
    io: str | None = None


def warm_start(cfg: RaykvConfig, disk: Directory, workers: Workers) -> WarmStart:
    """Take in what the ranks' directories hold: the chunks every rank has, up to the tier's
    capacity."""
    index = workers.disk_index()
    modes = {mode for mode, _ in index}
    io = modes.pop() if len(modes) == 1 else "mixed"
    per_rank = [set(keys) for _, keys in index]
    if not per_rank:
        return WarmStart()
    everywhere = set.intersection(*per_rank)
    anywhere = set.union(*per_rank)
    check_room(cfg, len(anywhere))
    # rank 0's order (oldest file first): past the capacity, the oldest go
    taken = disk.adopt([k for k in index[0][1] if k in everywhere])
    drop = sorted(anywhere - set(taken))
    if taken or drop:
        log.info(
            "disk tier: %d chunks found and served (warm restart), %d partial or beyond the "
            "capacity deleted",
            len(taken),
            len(drop),
        )
    return WarmStart(len(taken), drop, io)


def check_room(cfg: RaykvConfig, chunks_found: int) -> None:
    """ConfigError naming ``offload.disk.capacity`` when the file system under
    ``offload.disk.path`` (as this process sees it) cannot hold it: free space plus what the
    namespace's files found there take."""
    d = cfg.offload.disk
    assert d.path is not None
    held = chunks_found * file_bytes(cfg) * cfg.parallel.tensor_parallel_size
    room = free_bytes(d.path) + held
    if d.capacity > room:
        raise ConfigError(
            f"offload.disk.capacity ({d.capacity / 2**30:,.2f} GiB) is more than the file system "
            f"of offload.disk.path {d.path!r} can give: {room / 2**30:,.2f} GiB (free space "
            "plus this namespace's files); lower it or free space"
        )
