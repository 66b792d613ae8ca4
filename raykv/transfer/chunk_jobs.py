"""Jobs of chunks between a rank's CPU-pool shard and a tier below it, run on I/O threads and
polled like the CPU engine's copies: the machinery the disk engine and the shared-store engine
have in common.

A job (a ``TierMove``: a promotion into CPU slots, or a demotion or publish out of them) is split
into one run of chunks per I/O thread; promotions run on threads at the process's priority (a
request waits for them), the rest below it, so that their checksums and system calls yield the
cores to the model (a core taken from one of the model's threads stalls the others at the end of
each parallel operation): at the lowest (nice 19) where nothing waits for them (raykv's engine
completes a store once its CPU copy has landed, and demotes and publishes after), 10 levels
down where a store's completion does (inside vLLM: at nice 19 they fell behind a busy model).

Each run reports its worst outcome, the job the worst of its runs: ``ok``, ``failed`` (an I/O
error: the tier may be failing), ``full`` (the tier had no room), ``corrupt`` (the source was
bad: the key leaves the tier it was read from) or ``unsettled`` (a read the tier gave up on
without cancelling it: its bytes may still land in its CPU slots, which must not be reused for a
while). A finished job is reported by the non-blocking :meth:`ChunkJobEngine.poll`; the step
never waits on the tier but to flush a job the scheduler abandoned.

The threads are daemon threads of the engine's own (``IOThreads``), and a shutdown waits for them
at most ``SHUTDOWN_WAIT_S``: a tier that hangs a system call (a file system that stops
answering) costs a rank its I/O threads, never its recovery or its process's exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raykv.core.step import TierMove, TransferStats

log = logging.getLogger(__name__)

# worse ones rank higher
OUTCOMES = {"ok": 0, "failed": 1, "full": 2, "corrupt": 3, "unsettled": 4}
# how far below the process's priority a write's thread runs (clamped at 19);
# RAYKV_WRITE_NICENESS, 0 to 19, overrides it (where the writes must land whatever the load)
WRITE_NICENESS = 19
# the same for writes a store's completion waits for (``write_niceness`` of an engine that
# writes through). Measured inside vLLM on 2 cores the model keeps busy (8 x 544-token batches,
# every block written to disk and put into the store, ~3% of a core's time): at nice 19 a
# write thread gets about 1.5% of a core beside a model's thread, the puts fell behind and
# the batch waited 0.35-0.5 s at its end for them (0.90x of vLLM alone); at 10 levels (about
# 10%) they keep up (0.955x and 0.971x in two paired runs); at 0 they took the model's cores
# (0.948x).
THROUGH_WRITE_NICENESS = 10
WRITE_NICENESS_VARIABLE = "RAYKV_WRITE_NICENESS"
SHUTDOWN_WAIT_S = 30.0  # the longest a shutdown waits for the I/O threads to finish


class IOThreads:
    """``count`` daemon threads (started with the first call) that run submitted calls in
    order. Unlike an executor's, they never hold up the process's exit, and ``stop`` never
    waits without a bound."""

    def __init__(
        self, count: int, name: str, initializer: Callable[[], None] | None = None
    ) -> None:
        self.count = count
        self.name = name
        self._initializer = initializer
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                    for i in range(self.count)
                ]
                for thread in self._threads:
                    thread.start()
        self._queue.put(call)

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            call = self._queue.get()
            if call is None:
                return
            call()

    def stop(self, cancel: bool) -> list[threading.Thread]:
        """Have the threads end once what is queued ran (``cancel``: dropped, never run); the
        threads, for ``join``."""
        if cancel:
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        return threads


def join(threads: list[threading.Thread], deadline: float) -> int:
    """Wait for ``threads`` until ``deadline`` (``time.monotonic``) at most: how many still
    run then."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)


def worse(a: str, b: str) -> str:
    """The worse of two outcomes."""
    return a if OUTCOMES[a] >= OUTCOMES[b] else b


@dataclass(slots=True)
class _Job:
    move: TierMove
    left: int
    outcome: str = "ok"  # the worst of its runs
    done: threading.Event = field(default_factory=threading.Event)


class ChunkJobEngine:
    """Runs ``TierMove`` jobs on ``io_threads`` threads each way, the writes' ``niceness``
    levels below the process (unless ``RAYKV_WRITE_NICENESS`` says); subclasses say how one run
    of chunks moves (``_run``) and what the tier is called in errors (``name``)."""

    name = "tier"

    def __init__(self, io_threads: int, niceness: int = WRITE_NICENESS) -> None:
        if io_threads <= 0:
            raise ValueError(f"io_threads must be positive, got {io_threads}")
        if not 0 <= niceness <= 19:  # never above the model's threads
            raise ValueError(f"niceness must be from 0 to 19, got {niceness}")
        self.io_threads = io_threads
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._completed: list[int] = []
        self._failed: list[int] = []
        self._corrupt: list[int] = []
        self._full: list[int] = []
        self._unsettled: list[int] = []
        self._bad_keys: dict[int, list[int]] = {}  # job -> keys whose source was bad
        self._stats = TransferStats()
        self._reads = IOThreads(io_threads, f"raykv-{self.name}-read")
        self.write_niceness = niceness  # asked for: the environment's wins where it says
        levels = write_niceness(niceness)  # read once, as the engine is built
        self._writes = IOThreads(
            io_threads, f"raykv-{self.name}-write", lambda: lower_priority(levels)
        )
        self._closed = False

    # ---------------------------------------------------------------- what subclasses do

    def _run(self, move: TierMove, run: list[tuple[int, int]]) -> str:
        """Move one run of ``(key, slot)`` chunks of ``move`` on this thread: the worst
        outcome (every chunk is tried: a bad one does not keep the others from moving)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release what the subclass holds, once no thread runs any more."""

    # ---------------------------------------------------------------- public API

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
                raise RuntimeError(f"the {self.name} engine is shut down")
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
        threads = self._reads if move.promote else self._writes
        for i in range(runs):
            threads.submit(lambda run=pairs[i::runs]: self._run_done(job, self._guarded(move, run)))

    def _guarded(self, move: TierMove, run: list[tuple[int, int]]) -> str:
        try:
            return self._run(move, run)
        except Exception as exc:  # a run that raised fails its job, never the thread
            log.warning("%s job %d: %s: %s", self.name, move.job_id, type(exc).__name__, exc)
            return "failed"

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
        """Failed writes that found the tier full."""
        with self._cond:
            out, self._full = self._full, []
        return out

    def take_unsettled(self) -> list[int]:
        """Failed reads whose bytes may still land in their CPU slots."""
        with self._cond:
            out, self._unsettled = self._unsettled, []
        return out

    def take_bad_keys(self) -> dict[int, list[int]]:
        """Per failed job, the keys whose source was bad (missing, or failing its checks)."""
        with self._cond:
            out, self._bad_keys = self._bad_keys, {}
        return out

    def _bad(self, job_id: int, key: int) -> None:
        """Record that ``key``'s source in job ``job_id`` is bad (from any thread)."""
        with self._cond:
            self._bad_keys.setdefault(job_id, []).append(key)

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
        """CPU slots that unfinished writes read, and that unfinished promotions write."""
        reads: set[int] = set()
        writes: set[int] = set()
        with self._cond:
            for job in self._jobs.values():
                (writes if job.move.promote else reads).update(job.move.cpu_slots)
        return reads, writes

    def in_flight(self) -> int:
        with self._cond:
            return len(self._jobs)

    def reading(self) -> bool:
        """A promotion runs (a request waits for it), not only writes."""
        with self._cond:
            return any(job.move.promote for job in self._jobs.values())

    def shutdown(self, wait: bool = True, timeout_s: float | None = None) -> int:
        """Stop the I/O threads; ``wait``: finish every queued chunk first (else queued chunks
        are dropped and their jobs never reported: what a crash leaves). Returns once no thread
        touches the pool or the tier any more, or after ``timeout_s`` with the threads still
        running a chunk left behind (``timeout_s``: ``SHUTDOWN_WAIT_S`` by default; a system
        call the tier never answers; said in the log,
        and what they hold is not released): how many were left. A left-behind read may still
        land in its CPU slot: the pool must not be reused (``LocalWorker.die``)."""
        with self._cond:
            if self._closed:
                return 0
            self._closed = True
            self._cond.notify_all()
        if timeout_s is None:
            timeout_s = SHUTDOWN_WAIT_S
        threads = self._reads.stop(not wait) + self._writes.stop(not wait)
        stuck = join(threads, time.monotonic() + timeout_s)
        if stuck:
            # what the threads hold stays held (a directory's lock, a store's client): a
            # successor takes another rather than one a left-behind write may still touch
            log.warning(
                "the %s tier: %d I/O threads still in a system call after %.0f s are left "
                "behind (their jobs are never reported)",
                self.name,
                stuck,
                timeout_s,
            )
        else:
            self._close()
        return stuck

    # ---------------------------------------------------------------- bookkeeping

    def _add_stats(self, **fields: float) -> None:
        """Add to this period's counters (from any thread)."""
        with self._cond:
            s = self._stats
            for name, value in fields.items():
                setattr(s, name, getattr(s, name) + value)

    def _run_done(self, job: _Job, outcome: str) -> None:
        with self._cond:
            job.outcome = worse(outcome, job.outcome)
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
                elif job.outcome == "unsettled":
                    self._unsettled.append(job_id)
            self._cond.notify_all()
        job.done.set()


def write_niceness(default: int = WRITE_NICENESS) -> int:
    """How many levels below the process's priority a write's thread runs: the environment's
    ``RAYKV_WRITE_NICENESS`` where it says, else ``default``."""
    given = os.environ.get(WRITE_NICENESS_VARIABLE)
    if given is None:
        return default
    try:
        levels = int(given)
    except ValueError:
        levels = -1
    if not 0 <= levels <= 19:
        log.warning(
            "%s=%r is not a number from 0 to 19: the writes run %d levels down",
            WRITE_NICENESS_VARIABLE,
            given,
            default,
        )
        return default
    return levels


def lower_priority(levels: int | None = None) -> None:
    """Run this thread (Linux schedules threads one by one) ``levels`` below the process's
    priority (None: ``write_niceness()``)."""
    if levels is None:
        levels = write_niceness()
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + levels)
