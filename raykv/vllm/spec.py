"""``RaykvOffloadingSpec``: raykv's tiers as vLLM's offloading backend.

vLLM's ``OffloadingConnector`` builds it from ``kv_connector_extra_config``
(``{"spec_name": "RaykvOffloadingSpec", "spec_module_path": "raykv.vllm", "raykv": {...}}``) in
the scheduler process, where ``get_manager`` gives the tiers' directories, and in each worker
process, where ``get_worker`` gives that rank's engines. The disk and shared tiers' namespace is
agreed on at run time (``namespace.py``): each worker says what model and weights it runs, the
manager composes the namespace, and the workers build their engines of those tiers under it
(``WorkerTiers``), again after every reset of the connector.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from raykv.config import ConfigError
from raykv.config.base import whole_chunks
from raykv.config.sections import OffloadConfig
from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_SHARED, EventLog
from raykv.faults import FaultyBackend, FaultyTier, RankFaults
from raykv.offload.directory import Directory
from raykv.transfer.chunk_jobs import THROUGH_WRITE_NICENESS, ChunkJobEngine
from raykv.transfer.disk import DiskTransferEngine
from raykv.transfer.disk_files import ChunkFormat, RankDirectory
from raykv.transfer.layout import KVLayout
from raykv.transfer.rank import piece_copies
from raykv.transfer.shared_store import StoreEndpoint, chunks_in_segment
from raykv.vllm import metrics, namespace, shared, weights
from raykv.vllm.failures import BadKeys, report_failed_loads
from raykv.vllm.load_report import REPORTS_KEY, LoadReporter
from raykv.vllm.manager import RaykvOffloadingManager
from raykv.vllm.run_directory import engine_run_directory
from raykv.vllm.settings import INLINE, fault_settings, offload_settings
from raykv.vllm.worker import RaykvOffloadingWorker, page_pieces_of
from raykv.vllm.worth import LoadChoice

log = logging.getLogger(__name__)

T = TypeVar("T")

report_failed_loads()


def page_layout(page_bytes: int, num_blocks: int, blocks_per_chunk: int, slots: int) -> KVLayout:
    """A raykv layout whose page is ``page_bytes`` of a worker's block (vLLM's pages are
    opaque bytes to the tiers: only their size matters)."""
    # raykv's page holds a K and a V row per head: one "head" of half the page each
    for dtype, size in (("float32", 8), ("float16", 4)):
        if page_bytes % size == 0:
            return KVLayout(
                num_gpu_blocks=num_blocks,
                block_size=1,
                num_groups=1,
                layers_per_group=1,
                kv_heads=1,
                head_dim=page_bytes // size,
                dtype=dtype,
                blocks_per_chunk=blocks_per_chunk,
                num_slots=slots,
            )
    raise ValueError(f"a KV page of {page_bytes} bytes (not a multiple of 4) is not supported")


class RaykvOffloadingSpec(OffloadingSpec):
    """raykv's CPU tier and, under it, its disk tier and its shared tier (Mooncake Store), as
    a vLLM offloading spec."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings: OffloadConfig = offload_settings(self.extra_config)
        parallel = config.parallel
        self.rank, self.world_size = parallel.rank, max(1, parallel.world_size)
        self.faults = fault_settings(self.extra_config, self.world_size, self.settings)
        self.chunk_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_slots = self._cpu_slots()
        self.base = namespace.base_parts(config, self._device())
        self.run_directory = self._run_directory()
        self.bad_keys = BadKeys(self.run_directory, self.world_size)
        self.board = namespace.NamespaceBoard(self.run_directory, self.world_size)
        self.shared = shared.shared_settings(self.settings)
        self._manager: RaykvOffloadingManager | None = None
        self._worker: RaykvOffloadingWorker | None = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metrics.metric_definitions()

    # ---- sizes and places --------------------------------------------------------------------

    def _cpu_slots(self) -> int:
        settings = self.settings
        if settings.cpu_slots is not None:
            return settings.cpu_slots
        assert settings.cpu_bytes is not None
        chunk = self.chunk_bytes * self.world_size
        if chunk <= 0:
            return 1
        return whole_chunks(
            settings.cpu_bytes,
            chunk,
            f"{INLINE}.cpu_bytes",
            "one chunk of this model",
            f"{self.world_size} workers",
        )

    def _chunk_format(self) -> ChunkFormat:
        return ChunkFormat(self.config.worker_kv_bytes_per_block, self.blocks_per_chunk)

    def _shared_slots(self) -> int:
        """Chunks the shared tier's index holds: as many as ``segment`` holds of every rank's
        parts."""
        assert self.shared is not None
        return chunks_in_segment(
            self.shared.segment, self._chunk_format(), self.world_size, "raykv.shared.segment"
        )

    def store_endpoint(self) -> StoreEndpoint:
        """Where this process joins the shared tier's store, for one user (the manager or the
        worker: each lets go of an embedded master as it shuts down)."""
        assert self.shared is not None
        return shared.endpoint(self.shared, self.run_directory)

    @staticmethod
    def store_namespace(parts: dict[str, Any], where: StoreEndpoint) -> str:
        """The store's namespace of chunks under ``parts``, marked with the secret they are
        sealed with."""
        return shared.namespace_of(namespace.directory_name(parts), where)

    def _joined(self, build: Callable[[StoreEndpoint], T]) -> T:
        """``build`` on where this process joins the store, as one of its users; an embedded
        master is let go where it fails, and raykv's key names are vLLM's config's."""
        where = self.store_endpoint()
        try:
            return build(where)
        except ConfigError as exc:
            shared.stop_embedded(self.run_directory)
            raise type(exc)(shared.inside_vllm(str(exc))) from None
        except BaseException:
            shared.stop_embedded(self.run_directory)
            raise

    def _disk_slots(self) -> int:
        file_bytes = ChunkFormat(
            self.config.worker_kv_bytes_per_block, self.blocks_per_chunk
        ).file_bytes
        return whole_chunks(
            self.settings.disk.capacity,
            file_bytes * self.world_size,
            f"{INLINE}.disk.capacity",
            "one chunk's files of this model",
            f"{self.world_size} workers",
        )

    @staticmethod
    def _device() -> str:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "cpu")

    def _run_directory(self) -> str:
        # where the workers tell the manager of bad chunks: this user's, one per engine
        return engine_run_directory(self.config.engine_id)

    def disk_root(self, parts: dict[str, Any], rank: int) -> str:
        """Where ``rank`` keeps its disk files of the namespace ``parts``."""
        assert self.settings.disk.path is not None
        return os.path.join(
            self.settings.disk.path, namespace.directory_name(parts), f"rank-{rank}"
        )

    # ---- the halves --------------------------------------------------------------------------

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            settings = self.settings
            events = EventLog(settings.events and self.kv_events_config.enable_kv_cache_events)
            cpu = Directory(
                self.num_slots,
                settings.policy,
                store_threshold=settings.store_threshold,
                max_tracker_size=settings.max_tracker_size,
                events=events,
                medium=MEDIUM_CPU,
            )
            disk = None
            if settings.disk.enabled:
                disk = Directory(
                    self._disk_slots(),
                    settings.disk.policy,
                    store_threshold=settings.disk.store_threshold,
                    events=events,
                    medium=MEDIUM_DISK,
                )
            index = store = None
            if self.shared is not None:
                index = Directory(
                    self._shared_slots(),
                    "lru",
                    max_tracker_size=settings.max_tracker_size,
                    events=events,
                    medium=MEDIUM_SHARED,
                )
                settings_shared = self.shared
                # joined now, so that a store that cannot be had is said at start; its index
                # asks under the namespace once the workers have agreed on it
                store = self._joined(
                    lambda where: shared.StoreView(settings_shared, where, self.world_size)
                )
            self._manager = RaykvOffloadingManager(
                cpu,
                disk,
                self.bad_keys,
                settings.verify,
                shared=index,
                store=store,
                retry_steps=settings.shared.retry_steps,
                kill_master_at=[
                    f.step for f in self.faults if f.kind == "kill-shared-master" and f.step
                ],
                choice=(
                    LoadChoice(
                        self.tokens_per_block[0] * self.blocks_per_chunk, self.blocks_per_chunk
                    )
                    if settings.take_hits == "faster"
                    else None
                ),
                namespace=(
                    namespace.NamespaceAgreement(self.board, self.base, self._open_tiers)
                    if disk is not None or index is not None
                    else None
                ),
            )
            endpoint = self.extra_config.get(REPORTS_KEY)
            if endpoint:
                self._manager.reporter = LoadReporter(str(endpoint))
                self._manager.tokens_per_chunk = self.tokens_per_block[0] * self.blocks_per_chunk
        return self._manager

    def _open_tiers(
        self,
        parts: dict[str, Any],
        store: shared.StoreView | None,
        roots: list[str | None],
    ) -> list[int]:
        """The manager's tiers below the CPU tier under the namespace ``parts``: the keys whose
        files every rank holds in the directory its disk engine holds (``roots``; another
        engine on the node may hold the first), oldest first, as many of the newest as the
        tier's capacity holds (a warm start: names only, the workers check the bytes), the
        others' files deleted there (directories this engine's ranks hold: no store to the
        tier has been asked for yet); the store's index asked under it."""
        if store is not None:
            store.use_namespace(self.store_namespace(parts, store.where))
        if not self.settings.disk.enabled:
            return []
        namespace.describe(os.path.dirname(self.disk_root(parts, 0)), parts)
        ranks = [
            RankDirectory(root or self.disk_root(parts, rank)) for rank, root in enumerate(roots)
        ]
        listings = [directory.listing() for directory in ranks]
        everywhere = set.intersection(*(set(keys) for keys in listings))
        ordered = [k for k in listings[0] if k in everywhere]
        kept = ordered[max(0, len(ordered) - self._disk_slots()) :]
        taken = set(kept)
        for directory, keys in zip(ranks, listings, strict=True):
            for key in keys:
                if key not in taken:  # a part another rank lacks, or past the capacity
                    directory.remove(key)
        if kept or len(taken) < sum(map(len, listings)):
            log.info(
                "raykv: %d chunks found in the disk tier (warm start); the files of %d others "
                "(partial, or past the capacity) deleted",
                len(kept),
                len(set().union(*listings)) - len(kept),
            )
        return kept

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self._build_worker(kv_caches)
        return self._worker

    def _build_worker(self, kv_caches: CanonicalKVCaches) -> RaykvOffloadingWorker:
        pieces = page_pieces_of(kv_caches)
        page_bytes = sum(piece.shape[1] for piece in pieces)
        layout = page_layout(page_bytes, pieces[0].shape[0], self.blocks_per_chunk, self.num_slots)
        # vLLM's CPU platform binds its compute threads to every core it is given: a copy
        # thread beside them takes a core from the model in the middle of its parallel regions,
        # and the GIL from its Python between them (measured: no-reuse throughput 0.77-0.85x
        # with the thread). Without it the copies run in get_finished, between two forwards,
        # with every core (raykv's engine does the same with a real model on CPU ranks). On a
        # GPU the copies run on CUDA streams, ordered after the compute stream
        made = piece_copies(
            pieces, layout, threaded=bool(self.settings.copy_thread), sharers=self.world_size
        )
        pool, copies = made.pool, made.engine
        faults = RankFaults(self.rank, self.faults)
        wrapped = FaultyBackend(copies, faults) if faults.active else copies
        tiers = None
        if self.settings.disk.enabled or self.shared is not None:
            tiers = WorkerTiers(self, pool, layout, copies.checksums, faults)
        return RaykvOffloadingWorker(
            self.rank, wrapped, self.bad_keys, self.blocks_per_chunk, made.populator, tiers
        )

    def take_failed_loads(self) -> list[int]:
        """Failed loads of this rank's worker, for ``failures.report_failed_loads``."""
        return [] if self._worker is None else self._worker.take_failed_loads()


class WorkerTiers:
    """A worker's side of the namespace (``namespace.py``): what its rank runs, posted for each
    epoch, and its engines of the disk and shared tiers, built under the namespace the manager
    composed from every rank's post."""

    def __init__(
        self,
        spec: RaykvOffloadingSpec,
        pool: Any,
        layout: KVLayout,
        sums: Any,
        faults: RankFaults,
    ) -> None:
        from vllm.config import get_current_vllm_config_or_none

        self.spec = spec
        self.pool, self.layout, self.sums, self.faults = pool, layout, sums, faults
        # what runs: vLLM's resolved configuration, and the model its attention layers are in
        # (found again at each post: a reload may replace the modules)
        self._vllm_config = get_current_vllm_config_or_none()
        self._said_no_model = False
        # joined once, for every epoch's engine (each join counts a user of an embedded master)
        self._where: StoreEndpoint | None = None
        if spec.shared is not None:
            self._where = spec._joined(lambda where: where)

    def epoch(self) -> int:
        return self.spec.board.epoch()

    def post(self, epoch: int) -> None:
        """Post what this rank runs now, for ``epoch``."""
        spec = self.spec
        config = self._vllm_config
        model = None
        if config is not None:
            configuration = weights.model_configuration(config)
            model = weights.served_model(config.compilation_config.static_forward_context)
        else:
            configuration = {"name": spec.config.model.name, "dtype": spec.config.model.dtype}
        if model is not None:
            fingerprint = weights.weights_fingerprint(model)
        else:
            if not self._said_no_model:
                self._said_no_model = True
                log.warning(
                    "raykv: the model vLLM loaded was not found; the disk and shared tiers' "
                    "namespace takes the weight files under %s, and a weight update in memory "
                    "does not move it",
                    spec.config.model.name,
                )
            fingerprint = weights.files_fingerprint(spec.config.model.name)
        spec.board.post(epoch, spec.rank, configuration, fingerprint)

    def build(self, epoch: int) -> dict[str, ChunkJobEngine] | None:
        """This rank's engines under ``epoch``'s namespace (None: not composed yet; empty:
        they could not be built, said in the log)."""
        spec = self.spec
        parts = spec.board.namespace(epoch)
        if parts is None:
            return None
        lower: dict[str, ChunkJobEngine] = {}
        try:
            disk_settings = spec.settings.disk
            if disk_settings.enabled:
                lower["disk"] = disk = DiskTransferEngine(
                    spec.disk_root(parts, spec.rank),
                    self.pool,
                    self.layout,
                    io_threads=disk_settings.io_threads,
                    direct_io=disk_settings.direct_io,
                    fsync=disk_settings.fsync,
                    sums=self.sums,
                    identity=namespace.identity(parts, spec.rank),
                    write_niceness=THROUGH_WRITE_NICENESS,
                )
                disk.index()  # sweeps what a crashed writer left, takes in older directories
            if self._where is not None:
                from raykv.transfer.shared import SharedTransferEngine

                lower["shared"] = SharedTransferEngine(
                    self._where,
                    spec.store_namespace(parts, self._where),
                    spec.rank,
                    self.pool,
                    self.layout,
                    sums=self.sums,
                    identity=namespace.identity(parts, spec.rank),
                    write_niceness=THROUGH_WRITE_NICENESS,
                )
        except Exception as exc:  # the tiers stay out of use; the CPU tier serves on
            log.error(
                "raykv rank %d: the disk and shared tiers could not start: %s: %s",
                spec.rank,
                type(exc).__name__,
                exc,
            )
            for engine in lower.values():
                engine.shutdown(wait=False)
            return {}
        for tier in lower:
            if self.faults.tier_active(tier):
                lower[tier] = FaultyTier(lower[tier], self.faults, tier)
        return lower

    def ready(self, epoch: int, lower: dict[str, ChunkJobEngine]) -> None:
        disk = lower.get("disk")
        root = getattr(getattr(disk, "files", None), "root", None)  # a fault wrapper passes it
        self.spec.board.ready(epoch, self.spec.rank, root)
