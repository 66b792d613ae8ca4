"""The CPU transfer engine: asynchronous page copies between the KV tensor and the CPU pool.

It stands in for the CUDA engine (streams + events) on machines without a GPU: jobs are queued by
:meth:`CpuTransferEngine.submit`, executed strictly in submission order by one background thread
(or by :meth:`~CpuTransferEngine.flush` itself, when the caller must not wait), and reported by a
non-blocking :meth:`~CpuTransferEngine.poll`.

Which torch calls copy a job (few bulk copies through a wide element view, bit-exact) is planned
in :mod:`raykv.transfer.copy_plan`; this module runs the plans.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from raykv.core.step import BlockCopy, TransferSpec, TransferStats
from raykv.transfer.base import TransferEngineBase
from raykv.transfer.checksums import RowChecksums, flip_copied_rows
from raykv.transfer.copy_plan import (
    check_range,
    page_pieces,
    plan_copies,
    run_copies,
    wide_dtype,
)
from raykv.transfer.layout import KVLayout, pool_rows

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    spec: TransferSpec
    gpu_blocks: list[int] = field(default_factory=list)


class ChunkCorrupt(RuntimeError):
    """A load's source bytes in the CPU pool differ from what was stored."""


class CpuTransferEngine(TransferEngineBase):
    """Copies pages between ``kv`` (``[num_gpu_blocks, page_elems]``) and ``pool``
    (``[num_slots, page_elems * blocks_per_chunk]``) on one background thread, in FIFO order.

    Thread safety: every public method may be called from any one thread (the worker's main
    thread); they synchronise with the copy thread through one condition variable. The caller
    must not write a GPU block that :meth:`pending_reads` or :meth:`pending_writes` contains —
    that is the fence, and it is the caller's to enforce (flush first).
    """

    def __init__(
        self,
        kv: torch.Tensor | Sequence[torch.Tensor],
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        threaded: bool = True,
        exec_delay: Callable[[int], int] | None = None,
        sums: torch.Tensor | None = None,
    ) -> None:
        """``kv``: raykv's own cache (one tensor, a page per row), or the pieces a page is split
        into in someone else's cache (vLLM's: one byte view ``[num_gpu_blocks, piece bytes]``
        per layer, all on one device), whose bytes, in order, make a pool page.

        ``threaded=False`` runs no copy thread: queued jobs are copied, in FIFO order, at the
        start of :meth:`poll` (or by :meth:`flush`). With ``exec_delay`` (job id -> polls to wait)
        a job stays queued, really uncopied, for that many polls, and holds back the jobs behind
        it. Together they make every interleaving of copies and steps reproducible for tests.
        ``sums``: where the checksum of each pool page row lives (int64, -1: none), kept with a
        shared-memory pool so that a successor still checks what its predecessor stored."""
        kv_dtype = kv.dtype if isinstance(kv, torch.Tensor) else layout.torch_dtype
        if kv_dtype != layout.torch_dtype or pool.dtype != layout.torch_dtype:
            raise ValueError(
                f"kv ({kv_dtype}) and pool ({pool.dtype}) must both be {layout.torch_dtype}"
            )
        if not pool.is_contiguous():
            raise ValueError("the pool must be contiguous")
        rows = pool_rows(pool, layout)
        self.layout = layout
        self.pool = pool
        if isinstance(kv, torch.Tensor):
            expected_kv = (layout.num_gpu_blocks, layout.page_elems)
            if tuple(kv.shape) != expected_kv:
                raise ValueError(
                    f"kv shape {tuple(kv.shape)} does not match the layout {expected_kv}"
                )
            if not kv.is_contiguous():
                raise ValueError("kv must be contiguous")
            self.kv = kv
            wide = wide_dtype(layout.page_bytes, kv, rows)
            self._kv_rows = kv.view(wide)
            self._pool_rows = rows.view(wide)
            self._pieces = [(self._kv_rows, self._pool_rows)]
        else:
            self.kv = None
            self._pieces = page_pieces(list(kv), rows, layout)
            self._pool_rows = rows.view(torch.uint8)

        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._active: _Job | None = None
        self._outstanding: set[int] = set()  # queued or executing job ids
        self._completed: list[int] = []
        self._failed: list[int] = []
        self._errors: dict[int, str] = {}
        self.checksums = RowChecksums(self._pool_rows, sums)
        self._corrupt: list[int] = []
        self._stats = TransferStats()
        self._paused = False
        self._closing = False  # no more submits
        self._closed = False  # copy thread must exit
        self._exec_delay = exec_delay
        self._wait_polls: dict[int, int] = {}  # job id -> polls left before it may run
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._run_thread, name="raykv-cpu-xfer", daemon=True
            )
            self._thread.start()

    # ---------------------------------------------------------------- public API

    @property
    def threaded(self) -> bool:
        """Whether a thread of the engine's own copies (otherwise :meth:`poll` and
        :meth:`flush` do, on the caller's thread)."""
        return self._thread is not None

    def submit(self, spec: TransferSpec) -> None:
        """Queue one job. A malformed job (mismatched lists, out-of-range block or slot) is not
        rejected here: it is reported as failed by :meth:`poll`, like a copy that fails."""
        job = _Job(spec, list(spec.copy.gpu_blocks))
        with self._cond:
            if self._closing:
                raise RuntimeError("CpuTransferEngine is shut down")
            if spec.job_id in self._outstanding:
                raise ValueError(f"job {spec.job_id} is already queued")
            self._queue.append(job)
            self._outstanding.add(spec.job_id)
            if self._exec_delay is not None:
                self._wait_polls[spec.job_id] = max(0, self._exec_delay(spec.job_id))
            self._cond.notify_all()

    def poll(self) -> tuple[list[int], list[int]]:
        """``(completed, failed)`` job ids finished since the last poll, in FIFO order.
        Never blocks on a copy (an unthreaded engine copies its due jobs here first)."""
        if self._thread is None:
            self._run_due()
        with self._cond:
            completed, self._completed = self._completed, []
            failed, self._failed = self._failed, []
        return completed, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some job finishes or ``timeout_s`` passes; returns at once when nothing
        is outstanding, a finished job awaits the next poll, or no thread copies (unthreaded or
        paused engines copy nothing while the caller waits)."""
        if self._thread is None:
            return
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._completed
                    or self._failed
                    or not self._outstanding
                    or self._paused
                    or self._closed
                ),
                timeout_s,
            )

    def flush(self, job_ids: Iterable[int]) -> None:
        """Block until every listed job still queued or executing has finished.

        Ids that are unknown or already finished are ignored. Jobs ahead of them run first (FIFO);
        when the copy thread is paused or busy elsewhere, this thread runs them itself. Flushed
        jobs are still reported by the next :meth:`poll`.
        """
        start = time.perf_counter()
        with self._cond:
            waiting = {j for j in job_ids if j in self._outstanding}
        if not waiting:
            return
        while True:
            with self._cond:
                waiting &= self._outstanding
                if not waiting:
                    break
                job = self._take_head()
                if job is None:
                    # the copy thread holds the head job; wait for it to finish
                    self._cond.wait()
                    continue
            self._execute(job)
        with self._cond:
            self._stats.flushes += 1
            self._stats.flush_seconds += time.perf_counter() - start

    def pause(self) -> None:
        """Test hook: the copy thread takes no new job until :meth:`resume` (a job it is already
        copying finishes). :meth:`flush` still runs the jobs it needs."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def pending_reads(self) -> set[int]:
        """GPU blocks that queued or executing stores have yet to read."""
        return self._pending(is_store=True)

    def pending_writes(self) -> set[int]:
        """GPU blocks that queued or executing loads have yet to write."""
        return self._pending(is_store=False)

    def take_stats(self) -> TransferStats:
        """Counters since the last call. Jobs, blocks and bytes count successful jobs; seconds
        count time spent copying; ``flushes`` counts flush calls that had to wait for a job."""
        with self._cond:
            stats, self._stats = self._stats, TransferStats()
        return stats

    def take_errors(self) -> dict[int, str]:
        """Why each job reported failed since the last call failed (job id -> message)."""
        with self._cond:
            errors, self._errors = self._errors, {}
        return errors

    def shutdown(self, wait: bool = True) -> None:
        """Stop the engine and join its thread. Idempotent.

        ``wait``: run every queued job first (even when paused); otherwise queued jobs are
        dropped and reported failed. Completions stay available to :meth:`poll`.
        """
        with self._cond:
            if self._closed:
                return
            self._closing = True
            if not wait:
                while self._queue:
                    job = self._queue.popleft()
                    self._outstanding.discard(job.spec.job_id)
                    self._failed.append(job.spec.job_id)
                    self._errors[job.spec.job_id] = "dropped at shutdown"
            pending = list(self._outstanding)
        self.flush(pending)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ---------------------------------------------------------------- internals

    def _pending(self, is_store: bool) -> set[int]:
        with self._cond:
            jobs = list(self._queue)
            if self._active is not None:
                jobs.append(self._active)
        blocks: set[int] = set()
        for job in jobs:
            if job.spec.is_store == is_store:
                blocks.update(job.gpu_blocks)
        return blocks

    def _take_head(self) -> _Job | None:
        """Claim the next job in FIFO order, or None if another thread is executing one (so
        two jobs never run at once and completions stay in submission order). Lock held."""
        if self._active is not None or not self._queue:
            return None
        self._active = self._queue.popleft()
        return self._active

    def _run_due(self) -> None:
        """Unthreaded engines: count one poll against every delay, then copy the jobs at the
        head of the queue whose delay has run out (unless paused)."""
        with self._cond:
            for job_id, left in self._wait_polls.items():
                self._wait_polls[job_id] = left - 1
        while True:
            with self._cond:
                if self._paused or not self._queue:
                    return
                head = self._queue[0].spec.job_id
                if self._wait_polls.get(head, 0) > 0:
                    return
                job = self._take_head()
            if job is None:
                return
            self._execute(job)

    def _run_thread(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (
                    self._paused or self._active is not None or not self._queue
                ):
                    self._cond.wait()
                if self._closed:
                    return
                job = self._take_head()
            if job is not None:
                self._execute(job)

    def _execute(self, job: _Job) -> None:
        """Run one claimed job and record its outcome; never raises."""
        spec = job.spec
        start = time.perf_counter()
        error: str | None = None
        try:
            self._copy(spec)
        except Exception as exc:  # a failed copy fails the job, never the engine
            error = f"{type(exc).__name__}: {exc}"
            log.warning("transfer job %d failed: %s", spec.job_id, error)
        elapsed = time.perf_counter() - start
        with self._cond:
            ok = error is None
            if ok:
                self._completed.append(spec.job_id)
            else:
                self._failed.append(spec.job_id)
                self._errors[spec.job_id] = error
            self.count_job(
                self._stats, spec.is_store, len(job.gpu_blocks), self.layout.page_bytes, elapsed, ok
            )
            self._active = None
            self._outstanding.discard(spec.job_id)
            self._wait_polls.pop(spec.job_id, None)
            self._cond.notify_all()

    def _copy(self, spec: TransferSpec) -> None:
        lay = self.layout
        copy = spec.copy
        gpu, slots, subs = list(copy.gpu_blocks), list(copy.cpu_slots), list(copy.sub_blocks)
        if not len(gpu) == len(slots) == len(subs):
            raise ValueError(
                f"BlockCopy lists differ in length: {len(gpu)} gpu_blocks, {len(slots)} "
                f"cpu_slots, {len(subs)} sub_blocks"
            )
        if not gpu:
            return
        # explicit bounds: a negative index would silently wrap in a slice copy, and a sub-block
        # past the chunk would land in the next slot
        check_range("gpu block", gpu, lay.num_gpu_blocks)
        check_range("cpu slot", slots, lay.num_slots)
        check_range("sub block", subs, lay.blocks_per_chunk)
        bpc = lay.blocks_per_chunk
        rows = slots if bpc == 1 else [s * bpc + b for s, b in zip(slots, subs, strict=True)]
        if spec.is_store:
            src, dst = gpu, rows
        else:
            src, dst = rows, gpu
            if spec.check_sums:
                self._check_rows(spec.job_id, rows)
        ops, index = plan_copies(src, dst)
        idx = torch.tensor(index, dtype=torch.long) if index else None
        for kv_piece, pool_piece in self._pieces:
            src_t, dst_t = (kv_piece, pool_piece) if spec.is_store else (pool_piece, kv_piece)
            run_copies(ops, idx, src_t, dst_t)
        if spec.is_store and spec.check_sums:  # what the rows hold now, for the loads
            self.checksums.record(rows)

    def _check_rows(self, job_id: int, rows: list[int]) -> None:
        """Raise ``ChunkCorrupt`` if a row's bytes no longer match its checksum."""
        checked, bad = self.checksums.check(rows)
        with self._cond:
            self._stats.chunks_checked += checked
            self._stats.corrupt_detected += len(bad)
            if bad:
                self._corrupt.append(job_id)
        if bad:
            raise ChunkCorrupt(f"CPU-pool rows {bad} changed since they were stored")

    def corrupt_rows(self, copy: BlockCopy) -> None:
        """Fault hook (``corrupt-cpu``): flip one byte in every pool row ``copy`` wrote."""
        flip_copied_rows(self._pool_rows, copy, self.layout.blocks_per_chunk)

    def take_corrupt(self) -> list[int]:
        with self._cond:
            out, self._corrupt = self._corrupt, []
        return out
