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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from raykv.config import ConfigError
from raykv.core.step import TierMove, TransferStats
from raykv.transfer.checksums import RowChecksums
from raykv.transfer.chunk_io import ChunkIO, DiskFull, SourceCorrupt
from raykv.transfer.disk_files import (
    ChunkFormat,
    RankDirectory,
    claim_directory,
    probe_direct_io,
)
from raykv.transfer.layout import KVLayout

log = logging.getLogger(__name__)

DIRECT_IO_MODES = ("auto", "on", "off")


class DiskUnavailable(ConfigError):
    """The disk tier cannot work where it was pointed (``offload.disk.*``): named in the
    message (a configuration problem: ``raykv`` exits 2)."""


@dataclass(slots=True)
class _Job:
    move: TierMove
    left: int
    outcome: str = "ok"  # ok | failed | corrupt | full (the worst of its chunks)
    done: threading.Event = field(default_factory=threading.Event)


_RANK = {"ok": 0, "failed": 1, "full": 2, "corrupt": 3}


class DiskTransferEngine:
    """Moves chunks between ``pool`` (this rank's CPU-pool shard, ``[num_slots, chunk elems]``)
    and the chunk files under ``root`` (or ``root.1``, ``root.2``... while other engines on the
    node hold it: ``disk_files.claim_directory``, waiting ``claim_wait_s`` for ``root`` first).

    ``direct_io``: ``on`` opens every file with ``O_DIRECT`` (``DiskUnavailable`` where the file
    system refuses it), ``off`` never, ``auto`` where the file system allows it (``io_mode``
    says which ran). ``fsync``: each file reaches the device before it is renamed into place
    (and the rename before the job is reported), so a power loss keeps every chunk reported
    stored; without it a crash of the machine (not of raykv) may lose recent chunks, never serve
    a torn one. ``sums``: the CPU pool's row checksums (``offload.verify``). ``max_free_files``:
    evicted chunks' files kept to be written over."""

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
    ) -> None:
        if direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {DIRECT_IO_MODES}, got {direct_io!r}")
        if io_threads <= 0:
            raise ValueError(f"io_threads must be positive, got {io_threads}")
        try:
            # this engine's alone while it lives (another engine on the node takes the next)
            root, self._lock_fd = claim_directory(root, claim_wait_s)
            self.files = RankDirectory(root, max_free_files)
            self.files.make()
        except OSError as exc:
            raise DiskUnavailable(f"offload.disk.path: cannot use {root!r}: {exc}") from exc
        self.io_threads = io_threads
        direct = direct_io != "off" and probe_direct_io(root)
        if direct_io == "on" and not direct:
            raise DiskUnavailable(
                f"offload.disk.direct_io: on, but the file system of {root!r} refuses O_DIRECT "
                "(set auto or off)"
            )
        self.io_mode = "direct" if direct else "buffered"
        self.format = ChunkFormat(layout.page_bytes, layout.blocks_per_chunk)
        self.layout = layout
        self.chunks = ChunkIO(self.files, self.format, pool, direct, fsync, sums)
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._completed: list[int] = []
        self._failed: list[int] = []
        self._corrupt: list[int] = []
        self._full: list[int] = []
        self._stats = TransferStats()
        # promotions at the process's priority (a request waits for them); demotions, which
        # nobody waits for, a few nice levels below, so that their checksums and system calls
        # yield the cores to the model (measured: a trace whose CPU tier demoted 3 GB ran its
        # requests without a tier hit 3% slower than without the disk tier)
        self._reads = ThreadPoolExecutor(io_threads, thread_name_prefix="raykv-disk-read")
        self._writes = ThreadPoolExecutor(
            io_threads, thread_name_prefix="raykv-disk-write", initializer=_lower_priority
        )
        self._closed = False

    # ---------------------------------------------------------------- public API

    def index(self) -> list[int]:
        """The keys whose files this rank holds (stale temporary files swept on the way)."""
        keys, swept = self.files.scan()
        if swept:
            log.info(
                "disk tier %s: removed %d unfinished files of crashed writers",
                self.files.root,
                swept,
            )
        return keys

    def submit(self, move: TierMove) -> None:
        """Queue one job's chunks on the I/O threads."""
        keys = move.chunks.unpack()
        if len(keys) != len(move.cpu_slots):
            raise ValueError(
                f"tier move {move.job_id}: {len(keys)} keys, {len(move.cpu_slots)} slots"
            )
        job = _Job(move, len(keys))
        with self._cond:
            if self._closed:
                raise RuntimeError("DiskTransferEngine is shut down")
            if move.job_id in self._jobs:
                raise ValueError(f"job {move.job_id} is already queued")
            self._jobs[move.job_id] = job
        if not keys:
            self._finish(job)
            return
        # one run of chunks per thread: a future, a callback and a lock per chunk cost tens of
        # microseconds each, a chunk's I/O not much more at 64 KiB
        pairs = list(zip(keys, move.cpu_slots, strict=True))
        runs = min(self.io_threads, len(pairs))
        job.left = runs
        for i in range(runs):
            run = pairs[i::runs]
            pool = self._reads if move.promote else self._writes
            future: Future[str] = pool.submit(self._run, move, run)
            future.add_done_callback(lambda f, job=job: self._run_done(job, f))

    def drop(self, keys: list[int]) -> None:
        """Give up these keys' files now (evicted: kept to be written over by a later chunk;
        or found corrupt by another rank). No job of this rank still uses them: the directory
        evicts only chunks nobody reads or writes."""
        for key in keys:
            self.files.recycle(key)

    def poll(self) -> tuple[list[int], list[int]]:
        """``(completed, failed)`` job ids finished since the last poll; never blocks."""
        with self._cond:
            completed, self._completed = self._completed, []
            failed, self._failed = self._failed, []
        return completed, failed

    def take_corrupt(self) -> list[int]:
        """Failed jobs whose source was bad (the key leaves the tier it was read from)."""
        with self._cond:
            out, self._corrupt = self._corrupt, []
        return out

    def take_full(self) -> list[int]:
        """Failed demotions that found the disk full."""
        with self._cond:
            out, self._full = self._full, []
        return out

    def take_stats(self) -> TransferStats:
        with self._cond:
            stats, self._stats = self._stats, TransferStats()
        return stats

    def wait(self, timeout_s: float) -> None:
        """Block until a job finishes or ``timeout_s`` passes (at once when none is queued)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._completed or self._failed or not self._jobs or self._closed,
                timeout_s,
            )

    def flush(self, job_ids: list[int]) -> None:
        """Block until every listed job still queued has finished (unknown ids are ignored)."""
        with self._cond:
            jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        for job in jobs:
            job.done.wait()

    def pending_slots(self) -> tuple[set[int], set[int]]:
        """CPU slots that unfinished demotions read, and that unfinished promotions write."""
        reads: set[int] = set()
        writes: set[int] = set()
        with self._cond:
            for job in self._jobs.values():
                (writes if job.move.promote else reads).update(job.move.cpu_slots)
        return reads, writes

    def in_flight(self) -> int:
        with self._cond:
            return len(self._jobs)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the I/O threads; ``wait``: finish every queued chunk first (else queued chunks
        are dropped and their jobs never reported: what a crash leaves). Either way it returns
        once no thread touches the pool or a file any more."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._reads.shutdown(wait=True, cancel_futures=not wait)
        self._writes.shutdown(wait=True, cancel_futures=not wait)
        os.close(self._lock_fd)  # the directory is free for a successor

    def corrupt_file(self, key: int) -> None:
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
        """One thread's share of a job, chunk by chunk; the worst outcome (every chunk is
        tried: a bad one does not keep the others from being read or written)."""
        task = self.chunks.read if move.promote else self.chunks.write
        worst = "ok"
        for key, slot in run:
            outcome = "ok"
            start = time.perf_counter()
            try:
                task(key, slot, move.check_sums)
            except SourceCorrupt:
                outcome = "corrupt"
            except DiskFull:
                outcome = "full"
            except Exception as exc:  # a failed chunk fails its job, never the engine
                outcome = "failed"
                why = f"{type(exc).__name__}: {exc}"
                log.warning("disk job %d: key %#x: %s", move.job_id, key, why)
            self._count(move.promote, outcome, time.perf_counter() - start)
            if _RANK[outcome] > _RANK[worst]:
                worst = outcome
        return worst

    def _count(self, read: bool, outcome: str, seconds: float) -> None:
        nbytes = self.format.data_bytes
        with self._cond:
            s = self._stats
            if outcome == "corrupt" and read:
                s.disk_corrupt += 1
            if outcome != "ok":
                return
            if read:
                s.disk_read_chunks += 1
                s.disk_read_bytes += nbytes
                s.disk_read_seconds += seconds
            else:
                s.disk_write_chunks += 1
                s.disk_write_bytes += nbytes
                s.disk_write_seconds += seconds

    def _run_done(self, job: _Job, future: Future[str]) -> None:
        if future.cancelled():
            return  # shut down without waiting: the job is never reported
        exc = future.exception()
        outcome = "failed" if exc is not None else future.result()
        with self._cond:
            if _RANK[outcome] > _RANK[job.outcome]:
                job.outcome = outcome
            job.left -= 1
            last = job.left == 0
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        job_id = job.move.job_id
        with self._cond:
            del self._jobs[job_id]
            if job.outcome == "ok":
                self._completed.append(job_id)
            else:
                self._failed.append(job_id)
                if job.outcome == "corrupt":
                    self._corrupt.append(job_id)
                elif job.outcome == "full":
                    self._full.append(job_id)
            self._cond.notify_all()
        job.done.set()


WRITE_NICENESS = 5  # how far below the process's priority a demotion's thread runs


def _lower_priority() -> None:
    """Run this thread (Linux schedules threads one by one) ``WRITE_NICENESS`` levels below."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITE_NICENESS)
