"""The disk transfer engine: one rank's chunk files read into and written from its CPU-pool shard.

A demotion writes each of its chunks' CPU slots to the rank's file of the chunk's key; a
promotion reads each file into its CPU slot. The copies run in a pool of ``io_threads`` threads,
a job's chunks split into one run per thread (each chunk one large sequential
``pwritev``/``preadv`` of the whole file, header and pages, from or into the pool's own memory
where the alignment allows, through one aligned bounce buffer per thread where ``O_DIRECT``
needs it and the pool's rows are not aligned), and are reported by a non-blocking
:meth:`DiskTransferEngine.poll`, like the CPU engine's copies: the step never waits on the disk
but to flush a job the scheduler abandoned. A write goes over an evicted chunk's file where one
is free (``RankDirectory.recycle``) rather than making a new one. No Python loop touches the
bytes: the CRC-32 of each page (``transfer/crc.py``, which, like the reads and writes, releases
the GIL) is the only pass over them besides the I/O.

What can go wrong ends a job as failed, never as bytes from somewhere else: a file that is
missing, of the wrong size, another key's or whose checksums fail is *corrupt* (the rank deletes
it and reports the job in ``take_corrupt``: its key leaves the tier); a demotion whose CPU bytes
no longer match the checksum their store recorded (``offload.verify``) is corrupt too, and
writes nothing; a write that finds the disk full is reported in ``take_full``. File formats and
paths: :mod:`raykv.transfer.disk_files`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from raykv.config import ConfigError
from raykv.core.step import TierMove, TransferStats
from raykv.transfer.checksums import RowChecksums
from raykv.transfer.chunk_io import ChunkIO, DiskFull, SourceCorrupt
from raykv.transfer.chunk_jobs import WRITE_NICENESS, ChunkJobEngine, worse
from raykv.transfer.disk_files import (
    ANONYMOUS,
    ChunkFormat,
    ChunkIdentity,
    RankDirectory,
    claim_directory,
    probe_direct_io,
    reclaim_siblings,
)
from raykv.transfer.layout import KVLayout

log = logging.getLogger(__name__)

DIRECT_IO_MODES = ("auto", "on", "off")


class DiskUnavailable(ConfigError):
    """The disk tier cannot work where it was pointed (``offload.disk.*``): named in the
    message (a configuration problem: ``raykv`` exits 2)."""


class DiskTransferEngine(ChunkJobEngine):
    """Moves chunks between ``pool`` (this rank's CPU-pool shard, ``[num_slots, chunk elems]``)
    and the chunk files under ``root`` (or ``root.1``, ``root.2``... while other engines on the
    node hold it: ``disk_files.claim_directory``, waiting ``claim_wait_s`` for ``root`` first).

    ``direct_io``: ``on`` opens every file with ``O_DIRECT`` (``DiskUnavailable`` where the file
    system refuses it), ``off`` never, ``auto`` where the file system allows it (``io_mode``
    says which ran). ``fsync``: each file reaches the device before it is renamed into place
    (and the rename before the job is reported), so a power loss keeps every chunk reported
    stored; without it a crash of the machine (not of raykv) may lose recent chunks, never serve
    a torn one. ``sums``: the CPU pool's row checksums (``offload.verify``). ``max_free_files``:
    evicted chunks' files kept to be written over. ``identity``: what this rank's parts are
    (namespace, rank, TP size), written into every file and checked on every read.
    ``write_niceness``: how far below the process its writes run (``chunk_jobs``)."""

    name = "disk"

    def __init__(
        self,
        root: str,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        io_threads: int = 4,
        direct_io: str = "auto",
        fsync: bool = False,
        sums: RowChecksums | None = None,
        max_free_files: int = 256,
        claim_wait_s: float = 0.0,
        identity: ChunkIdentity = ANONYMOUS,
        write_niceness: int = WRITE_NICENESS,
    ) -> None:
        if direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {DIRECT_IO_MODES}, got {direct_io!r}")
        if io_threads <= 0:
            raise ValueError(f"io_threads must be positive, got {io_threads}")
        self._base = root
        try:
            # this engine's alone while it lives (another engine on the node takes the next)
            root, lock_fd = claim_directory(root, claim_wait_s)
            self.files = RankDirectory(root, max_free_files)
            self.files.lock_fd = lock_fd
            self.files.make()
        except OSError as exc:
            raise DiskUnavailable(f"offload.disk.path: cannot use {root!r}: {exc}") from exc
        direct = direct_io != "off" and probe_direct_io(root)
        if direct_io == "on" and not direct:
            raise DiskUnavailable(
                f"offload.disk.direct_io: on, but the file system of {root!r} refuses O_DIRECT "
                "(set auto or off)"
            )
        self.io_mode = "direct" if direct else "buffered"
        self.format = ChunkFormat(layout.page_bytes, layout.blocks_per_chunk, identity)
        self.layout = layout
        self.chunks = ChunkIO(self.files, self.format, pool, direct, fsync, sums)
        self._special_said = 0  # special files already in a report
        # promotions at the process's priority, demotions at the lowest unless the caller
        # writes through (``write_niceness``: inside vLLM, 10 levels down) (measured: a trace
        # whose CPU tier demoted 3 GB ran its requests without a tier hit 3% slower than
        # without the disk tier when they ran at the same priority; on the trace as whole
        # conversations, 100 requests and no tier hit, 3 runs each way pooled, TTFT p50 1.14x
        # and mean 1.05x with demotions 5 levels down, 1.01x and 1.02x at the lowest)
        super().__init__(io_threads, write_niceness)

    # ---------------------------------------------------------------- public API

    def index(self) -> list[int]:
        """The keys whose files this rank holds (stale temporary files swept on the way; the
        files of this rank's other directories that no live engine holds taken in)."""
        taken = reclaim_siblings(self._base, self.files)
        if taken:
            log.info("disk tier %s: %d files taken in from an earlier engine's", self._base, taken)
        keys, swept = self.files.scan()
        if swept:
            log.info(
                "disk tier %s: removed %d unfinished files of crashed writers",
                self.files.root,
                swept,
            )
        return keys

    def take_stats(self) -> TransferStats:
        special = self.files.special_files
        if special != self._special_said:
            self._add_stats(disk_special=special - self._special_said)
            self._special_said = special
        return super().take_stats()

    def drop(self, keys: list[int]) -> None:
        """Give up these keys' files now (evicted: kept to be written over by a later chunk;
        or found corrupt by another rank). No job of this rank still uses them: the directory
        evicts only chunks nobody reads or writes."""
        for key in keys:
            self.files.recycle(key)

    def _close(self) -> None:
        if self.files.lock_fd is not None:
            os.close(self.files.lock_fd)  # the directory is free for a successor

    def spoil(self, key: int) -> None:
        """Fault hook (``corrupt-disk``): flip one byte in the middle of ``key``'s pages, in
        its file, as a disk that flips would."""
        fmt = self.format
        with contextlib.suppress(FileNotFoundError), open(self.files.path(key), "r+b") as fh:
            at = fmt.header_bytes + fmt.data_bytes // 2
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x5A]))

    # ---------------------------------------------------------------- the I/O threads

    def _run(self, move: TierMove, run: list[tuple[int, int]]) -> str:
        task = self.chunks.read if move.promote else self.chunks.write
        worst = "ok"
        for key, slot in run:
            outcome = "ok"
            start = time.perf_counter()
            try:
                task(key, slot, move.check_sums)
            except SourceCorrupt:
                outcome = "corrupt"
                if move.promote:  # this file is bad; the job's others are not
                    self._bad(move.job_id, key)
            except DiskFull:
                outcome = "full"
            except Exception as exc:  # a failed chunk fails its job, never the engine
                outcome = "failed"
                why = f"{type(exc).__name__}: {exc}"
                log.warning("disk job %d: key %#x: %s", move.job_id, key, why)
            self._count(move.promote, outcome, time.perf_counter() - start)
            worst = worse(outcome, worst)
        return worst

    def _count(self, read: bool, outcome: str, seconds: float) -> None:
        nbytes = self.format.data_bytes
        if outcome == "corrupt" and read:
            self._add_stats(disk_corrupt=1)
        if outcome != "ok":
            return
        if read:
            self._add_stats(disk_read_chunks=1, disk_read_bytes=nbytes, disk_read_seconds=seconds)
        else:
            self._add_stats(
                disk_write_chunks=1, disk_write_bytes=nbytes, disk_write_seconds=seconds
            )
