"""The shared tier's transfer engine: one rank's chunks published from its CPU-pool shard into
Mooncake Store and promoted from the store back into CPU slots, as jobs on I/O threads polled
like the disk engine's (``transfer/chunk_jobs.py``).

A publish (``TierMove`` with ``promote`` false) puts each chunk's part, ``<namespace>/<key>/
<rank>``, with its pages' CRC-32s (``transfer/shared_store.py``); a promotion reads each part
into its CPU slot and checks it. Outcomes, per job (the worst of its chunks):

- a publish that found the pool full is ``full`` (the tier stops publishing for a while); one
  whose CPU bytes no longer match the checksums their store recorded (``offload.verify``) is
  ``corrupt`` and puts nothing; any other refusal is ``failed``;
- a promotion of a part the store no longer has (evicted, or its node's segment gone) or whose
  bytes fail their checks is ``corrupt``: the chunk leaves the tier and its request recomputes
  (a spoiled part is removed from the store); one the store did not deliver is ``unsettled``
  (Mooncake's client gives up on a transfer without cancelling it: its bytes may still land in
  the slot), and one never asked of the store (no client, a master that refuses connections)
  is ``failed``.

A part a key already has in the store is never written again: a chunk's bytes are a function of
its key and namespace, so two engines publishing the same key at once put the same bytes.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from raykv.core.step import TierMove
from raykv.transfer.checksums import NO_CHECKSUM, RowChecksums
from raykv.transfer.chunk_jobs import WRITE_NICENESS, ChunkJobEngine, worse
from raykv.transfer.disk_files import ANONYMOUS, ChunkFormat, ChunkIdentity
from raykv.transfer.layout import KVLayout
from raykv.transfer.shared_store import (
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    SharedChunks,
    SharedStoreError,
    SharedUnavailable,
    StoreEndpoint,
    reachable,
)

log = logging.getLogger(__name__)

RECONNECT_S = 5.0  # how often an engine without its store tries to join it again
PROBE_S = 0.5  # how long a suspect master has to accept a connection


class SharedTransferEngine(ChunkJobEngine):
    """Moves chunks between ``pool`` (this rank's CPU-pool shard, ``[num_slots, chunk elems]``)
    and the store at ``endpoint``, under ``namespace`` as rank ``rank``. ``sums``: the CPU
    pool's row checksums (``offload.verify``): a publish checks the slot against them first, a
    promotion records the checksums it verified. ``required``: a store that cannot be joined
    is a configuration error (``SharedUnavailable``); else (a rank replacing a dead one, the
    store down meanwhile) the engine starts without it, fails its jobs, and joins the store
    again at most every ``RECONNECT_S`` seconds. ``identity``: what this rank's parts are
    (namespace, rank, TP size), in every part's sealed header. ``write_niceness``: how far
    below the process its publishes run (``chunk_jobs``)."""

    name = "shared"

    def __init__(
        self,
        endpoint: StoreEndpoint,
        namespace: str,
        rank: int,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        io_threads: int = 2,
        sums: RowChecksums | None = None,
        required: bool = True,
        identity: ChunkIdentity = ANONYMOUS,
        write_niceness: int = WRITE_NICENESS,
    ) -> None:
        self.format = ChunkFormat(layout.page_bytes, layout.blocks_per_chunk, identity)
        self.sums = sums
        if pool.dim() != 2 or pool.shape[1] * pool.element_size() != self.format.data_bytes:
            raise ValueError("the pool's rows are not one chunk each")
        self._join = lambda: SharedChunks(
            endpoint, namespace, rank, self.format, pool.data_ptr(), pool.shape[0]
        )
        self._joined_s = time.monotonic()
        self._join_lock = threading.Lock()
        self._suspect = False  # the last job failed for the store's sake
        self.chunks: SharedChunks | None = None
        try:
            self.chunks = self._join()
        except SharedStoreError as exc:
            if required:
                raise SharedUnavailable(f"offload.shared.master: {exc}") from exc
            log.warning("shared tier: rank %d starts without the store (%s)", rank, exc)
        super().__init__(io_threads, write_niceness)

    def _store(self) -> SharedChunks | None:
        """The store's client, joined again (at most every ``RECONNECT_S``) where it was not."""
        with self._join_lock:
            if self.chunks is None and time.monotonic() - self._joined_s >= RECONNECT_S:
                self._joined_s = time.monotonic()
                try:
                    self.chunks = self._join()
                except SharedStoreError as exc:
                    log.debug("shared tier: the store is still unreachable: %s", exc)
            return self.chunks

    def exists(self, keys: list[int]) -> list[bool]:
        """Whether this rank's part of each chunk is in the store (``SharedStoreError`` when
        the store cannot say)."""
        store = self._store()
        if store is None:
            raise SharedStoreError("the shared tier's store is unreachable")
        return store.exists(keys)

    def drop(self, keys: list[int]) -> None:
        """Remove this rank's parts of these chunks (another rank found theirs bad)."""
        store = self._store()
        try:
            if store is not None:
                store.remove(keys)
        except Exception as exc:  # an unreachable store keeps them: reads check every part
            log.warning("shared tier: removing %d parts failed: %s", len(keys), exc)

    def spoil(self, key: int) -> None:
        """Fault hook (``corrupt-shared``): flip a byte of this rank's part of ``key``."""
        if self.chunks is not None:
            self.chunks.spoil(key)

    def lose(self, key: int) -> None:
        """Fault hook (``lose-shared``): remove this rank's part of ``key`` from the store."""
        if self.chunks is not None:
            self.chunks.lose(key)

    def _close(self) -> None:
        if self.chunks is not None:
            self.chunks.close()

    # ---------------------------------------------------------------- the I/O threads

    def _rows(self, slot: int) -> list[int]:
        pages = self.format.pages
        return list(range(slot * pages, (slot + 1) * pages))

    def _run(self, move: TierMove, run: list[tuple[int, int]]) -> str:
        store = self._store()
        if store is None:
            return "failed"
        # after a failure, a master that refuses connections fails the job at once (the
        # store's own calls would wait seconds for their timeouts)
        if self._suspect and not reachable(store.master, PROBE_S):
            return "failed"
        start = time.perf_counter()
        try:
            worst, moved = (self._promote if move.promote else self._publish)(move, run)
        except Exception as exc:  # the store failed the call: the job fails, never the engine
            log.warning("shared job %d: %s: %s", move.job_id, type(exc).__name__, exc)
            self._suspect = store.failed = True
            return "unsettled" if move.promote else "failed"
        self._suspect = worst in ("failed", "unsettled")
        store.failed |= self._suspect
        seconds = time.perf_counter() - start
        nbytes = moved * self.format.data_bytes
        if move.promote:
            self._add_stats(
                shared_read_chunks=moved, shared_read_bytes=nbytes, shared_read_seconds=seconds
            )
        else:
            self._add_stats(
                shared_write_chunks=moved, shared_write_bytes=nbytes, shared_write_seconds=seconds
            )
        return worst

    def _promote(self, move: TierMove, run: list[tuple[int, int]]) -> tuple[str, int]:
        keys = [k for k, _ in run]
        slots = [s for _, s in run]
        crcs: list[list[int]] = []
        assert self.chunks is not None
        statuses = self.chunks.get(keys, slots, crcs)
        worst, moved, spoiled = "ok", 0, []
        for key, slot, status, sums in zip(keys, slots, statuses, crcs, strict=True):
            if status == "ok":
                moved += 1
                if move.check_sums and self.sums is not None:
                    self.sums.sums[self._rows(slot)] = torch.tensor(sums, dtype=torch.int64)
                continue
            # not delivered (its bytes may still come), gone from the store, or not this key's
            # intact part: the chunk leaves the tier
            worst = worse("unsettled" if status == "failed" else "corrupt", worst)
            if status != "failed":  # missing or spoiled: this chunk leaves the tier, no other
                self._bad(move.job_id, key)
            if status == "corrupt":
                spoiled.append(key)
        if spoiled:
            self._add_stats(shared_corrupt=len(spoiled))
            self.drop(spoiled)
        return worst, moved

    def _publish(self, move: TierMove, run: list[tuple[int, int]]) -> tuple[str, int]:
        worst = "ok"
        keys: list[int] = []
        slots: list[int] = []
        crcs: list[list[int]] = []
        assert self.chunks is not None
        for key, slot in run:
            sums = self.chunks.page_crcs(slot)
            if move.check_sums and self.sums is not None:
                recorded = self.sums.sums[self._rows(slot)].tolist()
                if any(r != NO_CHECKSUM and r != c for r, c in zip(recorded, sums, strict=True)):
                    worst = "corrupt"  # changed since its store: never published
                    continue
            keys.append(key)
            slots.append(slot)
            crcs.append(sums)
        codes = self.chunks.put(keys, slots, crcs) if keys else []
        moved = 0
        for code in codes:
            if code in (0, OBJECT_ALREADY_EXISTS):
                moved += 1
            else:
                worst = worse("full" if code == NO_AVAILABLE_HANDLE else "failed", worst)
        return worst, moved
