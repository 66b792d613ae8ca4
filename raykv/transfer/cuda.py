"""The CUDA transfer engine: page copies between the device KV cache and a pinned CPU pool on
CUDA streams, completion tracked with events.

Ordering, the part that silently corrupts KV when wrong:

- Every job's stream first waits on the compute stream as it is when the job is submitted. A
  store submitted after the model step therefore never reads a block before the kernels that
  write it retire (vLLM #31341), and a load never overwrites a block that an earlier step's
  kernels may still be reading (the write-after-read of #47282).
- Jobs of one direction run in submission order: each waits on the previous job's end event.
- ``poll`` reports jobs in submission order, stopping at the first whose end event is not done;
  ``flush`` synchronizes the listed jobs' end events (blocking the caller, never the device).

Copies per job, never a Python loop over blocks on the common paths: the (device row, host row)
pairs are sorted by host row and split into runs of consecutive host rows
(:func:`raykv.transfer.copy_plan.host_runs`). A run whose device rows are consecutive too is one
``copy_``; otherwise the device side is gathered (stores: ``index_select`` into a temporary) or
scattered (loads: ``index_copy_`` from a temporary) on the device at device bandwidth, around one
contiguous host<->device ``copy_``. Only a job whose host rows are scattered as well falls back to
one copy per run. Temporaries are allocated on the job's stream, so the caching allocator reuses
them only for work ordered after it.

Verify mode (a job's ``check_sums``, from ``offload.verify``) checks the pinned pool on the host,
as the CPU engine checks its pool (:mod:`raykv.transfer.checksums`): a store's rows lose their
checksum when it is issued and get the new one when ``poll`` sees its end event done (the bytes
have landed, and no load can read them before this rank reports the store); a load's source rows
are checked when it is issued, before any copy from them is queued, and a mismatch fails the job
as corrupt (``take_corrupt``). The CRCs run on the calling thread, at host memory speed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raykv.core.step import BlockCopy, TransferSpec, TransferStats
from raykv.transfer.base import TransferEngineBase
from raykv.transfer.checksums import RowChecksums, flip_copied_rows
from raykv.transfer.copy_plan import gather_pages, host_runs, piece_columns, scatter_pages
from raykv.transfer.layout import KVLayout, pool_rows

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 20  # device memory a job of pages in pieces stages at a time


@dataclass(slots=True)
class _CudaJob:
    spec: TransferSpec
    gpu_blocks: list[int]
    host_rows: list[int] = field(default_factory=list)  # pool rows, set when issued
    start: Any = None  # torch.cuda.Event
    end: Any = None
    keep: list[torch.Tensor] = field(default_factory=list)  # host tensors the copies read
    error: str | None = None

    @property
    def issued(self) -> bool:
        return self.end is not None or self.error is not None


class CudaTransferEngine(TransferEngineBase):
    """Copies pages between ``kv`` (``[num_gpu_blocks, page_elems]`` on a CUDA device) and
    ``pool`` (pinned, ``[num_slots, page_elems * blocks_per_chunk]``); same interface as
    :class:`raykv.transfer.cpu.CpuTransferEngine`."""

    def __init__(
        self,
        kv: torch.Tensor | Sequence[torch.Tensor],
        pool: torch.Tensor,
        layout: KVLayout,
        streams_per_direction: int = 2,
        sums: torch.Tensor | None = None,
    ) -> None:
        """``kv``: raykv's own cache (one tensor, a page per row), or the pieces a page is split
        into in someone else's cache (vLLM's canonical views: one byte view ``[num_gpu_blocks,
        piece bytes]`` per layer), whose bytes, in order, make a pool page. A job's pages are
        then assembled on the device (each piece's blocks gathered into its columns of a
        staging buffer) and cross to the host as whole pages, one ``copy_`` per run of
        consecutive pool rows; a load goes the other way. ``sums``: where the checksum of each
        pool page row lives (int64, -1: none), kept with a shared-memory pool so that a
        successor still checks what its predecessor stored; a private table without."""
        if pool.device.type != "cpu":
            raise ValueError(f"pool must be in host memory, got {pool.device}")
        self._pieces: list[tuple[torch.Tensor, int]] | None = None
        if isinstance(kv, torch.Tensor):
            if tuple(kv.shape) != (layout.num_gpu_blocks, layout.page_elems):
                raise ValueError(f"kv shape {tuple(kv.shape)} does not match the layout")
            device = kv.device
            self.kv: torch.Tensor | None = kv
        else:
            self._pieces = piece_columns(list(kv), layout)
            device = self._pieces[0][0].device
            self.kv = None
        if device.type != "cuda":
            raise ValueError(f"kv must be on a CUDA device, got {device}")
        self.layout = layout
        self.device = device
        self.pool = pool
        self.pinned = pool.is_pinned()  # unpinned pools still work, with staged (slower) DMA
        self._rows = pool_rows(pool, layout)
        self._byte_rows = self._rows.view(torch.uint8)
        self.checksums = RowChecksums(self._rows, sums)
        self._corrupt: list[int] = []
        self._streams = {
            d: [torch.cuda.Stream(device=self.device) for _ in range(streams_per_direction)]
            for d in (True, False)
        }
        self._turn = {True: 0, False: 0}
        self._last_end: dict[bool, Any] = {True: None, False: None}
        self._queue: deque[_CudaJob] = deque()  # submitted, not yet reported, FIFO
        self._held: list[_CudaJob] = []  # submitted while paused, not yet issued
        self._paused = False
        self._closed = False
        self._stats = TransferStats()

    # ---- the backend interface ------------------------------------------------------------

    @property
    def threaded(self) -> bool:
        """Copies go on without the caller (on the device's streams), as the CPU engine's
        with its thread."""
        return True

    def submit(self, spec: TransferSpec) -> None:
        if self._closed:
            raise RuntimeError("CudaTransferEngine is shut down")
        job = _CudaJob(spec, list(spec.copy.gpu_blocks))
        self._queue.append(job)
        if self._paused:
            self._held.append(job)
        else:
            self._issue(job)

    def poll(self) -> tuple[list[int], list[int]]:
        completed: list[int] = []
        failed: list[int] = []
        queue = self._queue
        while queue:
            job = queue[0]
            if not job.issued:
                break  # held while paused
            if job.error is None and not job.end.query():
                break
            queue.popleft()
            if job.error is None and job.spec.is_store and job.spec.check_sums:
                # the end event is done: the rows hold what the store wrote, and no load reads
                # them before this poll reports the store
                self.checksums.record(job.host_rows)
            self._account(job)
            (failed if job.error else completed).append(job.spec.job_id)
        return completed, failed

    def wait(self, timeout_s: float) -> None:
        """Block until the oldest issued job's copies finish or ``timeout_s`` passes (event
        queries with short sleeps: a blocking event wait has no timeout)."""
        if not self._queue or not self._queue[0].issued:
            return
        head = self._queue[0]
        deadline = time.perf_counter() + timeout_s
        while head.error is None and not head.end.query():
            if time.perf_counter() >= deadline:
                return
            time.sleep(5e-5)

    def flush(self, job_ids: Iterable[int]) -> None:
        wanted = set(job_ids)
        jobs = [j for j in self._queue if j.spec.job_id in wanted]
        if not jobs:
            return
        start = time.perf_counter()
        if any(not j.issued for j in jobs):
            # held jobs up to the last one needed are issued now, in order
            last = max(self._queue.index(j) for j in jobs)
            for job in list(self._queue)[: last + 1]:
                if not job.issued:
                    self._held.remove(job)
                    self._issue(job)
        for job in jobs:
            if job.end is not None:
                job.end.synchronize()
        self._stats.flushes += 1
        self._stats.flush_seconds += time.perf_counter() - start

    def pending_reads(self) -> set[int]:
        return self._pending(is_store=True)

    def pending_writes(self) -> set[int]:
        return self._pending(is_store=False)

    def take_stats(self) -> TransferStats:
        stats, self._stats = self._stats, TransferStats()
        return stats

    def take_corrupt(self) -> list[int]:
        """Loads failed since the last call because a source row's checksum no longer
        matched."""
        out, self._corrupt = self._corrupt, []
        return out

    # ---- test hooks -----------------------------------------------------------------------

    def pause(self) -> None:
        """Keep submitted jobs on the host, really not issued, until ``resume`` or a flush."""
        self._paused = True

    def resume(self) -> None:
        """Issue the held jobs, in order, and stop holding new ones."""
        self._paused = False
        for job in self._held:
            self._issue(job)
        self._held.clear()

    def corrupt_rows(self, copy: BlockCopy) -> None:
        """Fault hook (``corrupt-cpu``): flip one byte in every pool row ``copy`` wrote (host
        memory, after the store landed: the FaultyBackend calls it once a poll reported it)."""
        flip_copied_rows(self._rows, copy, self.layout.blocks_per_chunk)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the engine. ``wait``: issue held jobs and let everything finish; otherwise held
        jobs are dropped. Either way no copy touches the KV or the pool after this returns
        (copies already issued cannot be recalled, so they are waited for)."""
        if self._closed:
            return
        if wait:
            self.resume()
        else:
            held = set(map(id, self._held))
            self._queue = deque(j for j in self._queue if id(j) not in held)
            self._held.clear()
        for streams in self._streams.values():
            for stream in streams:
                stream.synchronize()
        self._closed = True

    # ---- internals ------------------------------------------------------------------------

    def _pending(self, is_store: bool) -> set[int]:
        out: set[int] = set()
        for job in self._queue:
            if job.spec.is_store != is_store or job.error is not None:
                continue
            if job.end is None or not job.end.query():
                out.update(job.gpu_blocks)
        return out

    def _issue(self, job: _CudaJob) -> None:
        spec = job.spec
        copy = spec.copy
        lay = self.layout
        try:
            n = len(copy.gpu_blocks)
            if not (len(copy.cpu_slots) == len(copy.sub_blocks) == n):
                raise ValueError("ragged block lists")
            dev = list(copy.gpu_blocks)
            host = [
                s * lay.blocks_per_chunk + b
                for s, b in zip(copy.cpu_slots, copy.sub_blocks, strict=True)
            ]
            if any(not 0 <= d < lay.num_gpu_blocks for d in dev):
                raise ValueError("GPU block out of range")
            if any(not 0 <= b < lay.blocks_per_chunk for b in copy.sub_blocks) or any(
                not 0 <= s < lay.num_slots for s in copy.cpu_slots
            ):
                raise ValueError("CPU slot or sub-block out of range")
        except ValueError as exc:
            job.error = str(exc)
            return
        job.host_rows = host
        if spec.check_sums and not self._checks_pass(job):
            return
        direction = spec.is_store
        streams = self._streams[direction]
        stream = streams[self._turn[direction] % len(streams)]
        self._turn[direction] += 1
        compute = torch.cuda.current_stream(self.device)
        # device-side ordering: after everything the model has been asked to do so far, and after
        # the previous job of this direction
        stream.wait_stream(compute)
        previous = self._last_end[direction]
        if previous is not None:
            stream.wait_event(previous)
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        order = sorted(range(n), key=host.__getitem__)
        host = [host[i] for i in order]
        dev = [dev[i] for i in order]
        with torch.cuda.stream(stream):
            job.start.record(stream)
            try:
                idx_host = torch.tensor(dev, dtype=torch.long)
                if self.pinned:
                    idx_host = idx_host.pin_memory()
                job.keep.append(idx_host)  # read by the async copy below until the job ends
                idx = idx_host.to(self.device, non_blocking=True)
                if self._pieces is not None:
                    self._copy_pieces(direction, host, idx)
                else:
                    self._copy_rows(direction, host, dev, idx)
            except RuntimeError as exc:  # the device's memory: the job fails, not the engine
                job.start = job.end = None
                job.error = f"{type(exc).__name__}: {exc}"
                log.warning("transfer job %d failed: %s", spec.job_id, job.error)
                # what was queued lands before the job is reported (a failed load's blocks are
                # recomputed, a failed store's rows reused); a device that fails this too has
                # failed the process's every job
                with contextlib.suppress(RuntimeError):
                    stream.synchronize()
                return
            job.end.record(stream)
        self._last_end[direction] = job.end

    def _copy_rows(
        self, is_store: bool, host: list[int], dev: list[int], index: torch.Tensor
    ) -> None:
        """A job's copies where a page is one row of ``kv`` (on the current stream)."""
        kv, rows = self.kv, self._rows
        assert kv is not None
        for lo, hi, dev_consecutive in host_runs(host, dev):
            h0, count = host[lo], hi - lo
            if dev_consecutive:
                d0 = dev[lo]
                if is_store:
                    rows[h0 : h0 + count].copy_(kv[d0 : d0 + count], non_blocking=True)
                else:
                    kv[d0 : d0 + count].copy_(rows[h0 : h0 + count], non_blocking=True)
            elif is_store:  # gather on the device, then one device-to-host copy
                staged = kv.index_select(0, index[lo:hi])
                rows[h0 : h0 + count].copy_(staged, non_blocking=True)
            else:  # one host-to-device copy, then scatter on the device
                staged = torch.empty(
                    (count, self.layout.page_elems), dtype=kv.dtype, device=self.device
                )
                staged.copy_(rows[h0 : h0 + count], non_blocking=True)
                kv.index_copy_(0, index[lo:hi], staged)

    def _copy_pieces(self, is_store: bool, host: list[int], index: torch.Tensor) -> None:
        """A job's copies where a page is pieces of several tensors (on the current stream):
        whole pages staged on the device, at most ``STAGE_BYTES`` of them at a time (vLLM
        leaves the device little beyond its own profile), and one host copy per run of pool
        rows. Each stage is freed before the next is taken, so the stream's allocator hands
        the next one the same memory, after the copies that used it."""
        assert self._pieces is not None
        rows = self._byte_rows
        page = self.layout.page_bytes
        step = max(1, STAGE_BYTES // page)
        for first in range(0, len(host), step):
            part = host[first : first + step]
            blocks = index[first : first + step]
            pages = torch.empty((len(part), page), dtype=torch.uint8, device=self.device)
            runs = host_runs(part, part)  # consecutive pool rows, whatever the blocks
            if is_store:
                gather_pages(self._pieces, blocks, pages)
                for lo, hi, _ in runs:
                    rows[part[lo] : part[lo] + hi - lo].copy_(pages[lo:hi], non_blocking=True)
            else:
                for lo, hi, _ in runs:
                    pages[lo:hi].copy_(rows[part[lo] : part[lo] + hi - lo], non_blocking=True)
                scatter_pages(self._pieces, blocks, pages)
            del pages

    def _checks_pass(self, job: _CudaJob) -> bool:
        """Verify mode, before anything is queued: a load's source rows must still hold what
        their stores recorded (else the job fails as corrupt, copying nothing); a store's rows
        vouch for nothing until it lands."""
        if job.spec.is_store:
            self.checksums.forget(job.host_rows)
            return True
        checked, bad = self.checksums.check(job.host_rows)
        self._stats.chunks_checked += checked
        self._stats.corrupt_detected += len(bad)
        if not bad:
            return True
        job.error = f"CPU-pool rows {bad} changed since they were stored"
        self._corrupt.append(job.spec.job_id)
        log.warning("transfer job %d failed: %s", job.spec.job_id, job.error)
        return False

    def _account(self, job: _CudaJob) -> None:
        ok = job.error is None
        seconds = job.start.elapsed_time(job.end) / 1000.0 if ok else 0.0
        n = len(job.gpu_blocks)
        self.count_job(self._stats, job.spec.is_store, n, self.layout.page_bytes, seconds, ok)
        job.keep.clear()
