"""The shared tier as an engine in one process builds it: the store's master (``embedded``:
started here on loopback), this node's segment of the pool (a child process's), the ranks'
engines and the scheduler's index of the store.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from raykv.config import RaykvConfig
from raykv.config.shared import EMBEDDED, cluster_secret
from raykv.core.kv_events import MEDIUM_SHARED, EventLog
from raykv.engine.tier_namespace import chunk_identity, namespace
from raykv.offload.directory import Directory
from raykv.transfer.disk_files import ChunkFormat
from raykv.transfer.seal import new_secret
from raykv.transfer.segment_process import HeldSegment
from raykv.transfer.shared_master import EmbeddedMaster
from raykv.transfer.shared_store import (
    SharedStoreError,
    SharedUnavailable,
    StoreEndpoint,
    StoreIndex,
    chunks_in_segment,
)
from raykv.transfer.shared_store import object_bytes as store_object_bytes

if TYPE_CHECKING:  # torch's: the scheduler's process (plain Python) never imports it
    from raykv.transfer.checksums import RowChecksums
    from raykv.transfer.layout import KVLayout
    from raykv.transfer.shared import SharedTransferEngine

log = logging.getLogger(__name__)


def shared_enabled(cfg: RaykvConfig) -> bool:
    return cfg.offload.enabled and cfg.offload.shared.enabled


def write_back(cfg: RaykvConfig) -> bool:
    """The shared tier publishes chunks as they leave the CPU tier (``offload.shared.publish:
    back``), not as they reach it."""
    return shared_enabled(cfg) and cfg.offload.shared.publish == "back"


def object_bytes(cfg: RaykvConfig) -> int:
    """Bytes of one chunk in the store, every rank's part (headers and pages)."""
    return store_object_bytes(_chunk_format(cfg), cfg.parallel.tensor_parallel_size)


def _chunk_format(cfg: RaykvConfig) -> ChunkFormat:
    return ChunkFormat(cfg.page_bytes(), cfg.offload.blocks_per_chunk)


class SharedRuntime:
    """The store an engine in one process uses: its master (started where ``embedded``, with a
    secret of its own for the run), a segment of a child process's DRAM for the pool, and the
    scheduler's index of the store. ``endpoint``: where the ranks join."""

    def __init__(self, cfg: RaykvConfig) -> None:
        s = cfg.offload.shared
        self.master = EmbeddedMaster() if s.master == EMBEDDED else None
        self.holder: HeldSegment | None = None
        secret = new_secret() if self.master is not None else cluster_secret(s)
        try:
            address = self.master.start() if self.master is not None else s.master
            self.endpoint = StoreEndpoint.of(s, address, secret)
            if s.mount:
                self.holder = HeldSegment(self.endpoint, s.segment)
                self.holder.start()
            self.index = StoreIndex(
                self.endpoint, namespace(cfg), cfg.parallel.tensor_parallel_size
            )
        except SharedStoreError as exc:
            self.close()
            raise SharedUnavailable(f"offload.shared.master: {exc}") from exc
        if self.master is not None:
            log.info("shared tier: an embedded Mooncake master at %s", self.endpoint.master)

    def kill_master(self) -> None:
        """End the embedded master at once (``kill-shared-master``; an external one is not
        this engine's to kill)."""
        if self.master is not None:
            log.warning("fault: killing the shared tier's embedded master")
            self.master.kill()

    def kill_segment(self) -> None:
        """End the segment's process at once (``kill-store-actor``): what the pool held there
        is gone."""
        if self.holder is not None:
            log.warning("fault: killing the shared tier's segment process")
            self.holder.kill()

    def close(self) -> None:
        index = getattr(self, "index", None)
        if index is not None:
            index.close()
        if self.holder is not None:
            self.holder.stop()
            self.holder = None
        if self.master is not None:
            self.master.stop()


def shared_engine(
    cfg: RaykvConfig,
    rank: int,
    pool: Any,
    layout: KVLayout,
    sums: RowChecksums,
    endpoint: StoreEndpoint | None,
    incarnation: int = 0,
) -> SharedTransferEngine | None:
    """This rank's engine for the shared tier (None: no shared tier). A rank replacing a dead
    one starts without the store where it cannot join it (the store may be what failed)."""
    if not shared_enabled(cfg) or endpoint is None:
        return None
    from raykv.transfer.shared import SharedTransferEngine  # torch's: the rank's process only

    return SharedTransferEngine(
        endpoint,
        namespace(cfg),
        rank,
        pool,
        layout,
        sums=sums,
        required=incarnation == 0,
        identity=chunk_identity(cfg, rank),
    )


def shared_directory(cfg: RaykvConfig, events: EventLog) -> Directory | None:
    """The scheduler's index of what the store holds for this engine (None: no shared tier):
    what it published and what lookups found there, as many chunks as this node's segment
    holds (the store evicts on its own: a chunk gone is found out by its read, and recomputed).
    ConfigError naming ``offload.shared.segment`` when it holds no chunk."""
    if not shared_enabled(cfg):
        return None
    slots = chunks_in_segment(
        cfg.offload.shared.segment,
        _chunk_format(cfg),
        cfg.parallel.tensor_parallel_size,
        "offload.shared.segment",
    )
    return Directory(
        slots,
        "lru",
        max_tracker_size=cfg.offload.max_tracker_size,
        events=events,
        medium=MEDIUM_SHARED,
    )


def store_index_of(cfg: RaykvConfig, workers: object) -> StoreIndex | None:
    """The scheduler's index of the store, from the engine's workers (None: no shared tier,
    or workers that offer none: then the tier is never asked)."""
    if not shared_enabled(cfg):
        return None
    return getattr(workers, "store_index", None)
