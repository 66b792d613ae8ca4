"""The worker half of raykv inside vLLM: one per vLLM worker process (one per TP rank), it
moves its own shard of every chunk and nothing else.

Its CPU-pool shard is raykv's pool (``transfer/layout.py``), its copies raykv's CPU engine
(``transfer/cpu.py``) on vLLM's CPU platform, or its CUDA engine (``transfer/cuda.py``: a
pinned pool, streams ordered after the compute stream, events) on a GPU, reading and writing
vLLM's canonical per-layer views (a pool page is the block's pages of every layer, one after
the other: on a GPU assembled on the device first), its disk files raykv's disk
engine's (``transfer/disk.py``: the same format, namespace, checksums and I/O threads), its
parts in the shared tier raykv's shared engine's (``transfer/shared.py``: Mooncake Store,
sealed). A job vLLM submits may take two steps here: a store copies the pages into their slots,
then writes the slots the disk tier admitted to their files and puts those the shared tier
admitted into the store (both at once); a load first promotes the chunks only the disk or the
store holds into their slots, then copies the pages out. vLLM hears of the job when all of it
is done.

Its disk and shared engines are built under the namespace the engine's processes agree on
(``namespace.py``): at start, and again after each reset of the connector, the worker posts
what its rank runs (``WorkerTiers``, the spec's), and builds the engines once the manager has
composed the namespace. A store that was under way at a reset writes nothing to the new
namespace's tiers.

A load that fails (a chunk whose checksum fails, a file missing or forged, no room for a
promotion) is reported done to vLLM, whose 0.32 connector cannot take a failure, and named to
``failures.report_failed_loads``, which tells vLLM's scheduler to recompute the request; the
chunks at fault are named to the manager through ``failures.BadKeys``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from raykv.core.step import BlockCopy, TierMove, TransferSpec
from raykv.transfer.chunk_jobs import ChunkJobEngine
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.populate import PagePopulator
from raykv.vllm.failures import CPU_TIER, DISK_TIER, EVERY_TIER, HELD_SLOT, SHARED_TIER, BadKeys
from raykv.vllm.jobs import ChunkLoad, ChunkStore
from raykv.vllm.shared import stop_embedded

log = logging.getLogger(__name__)

# how long ``wait`` lets a job take before it gives up on it (a disk that never answers)
WAIT_S = 60.0
# polls closer together than this come from vLLM's loop with nothing to compute (a request
# waiting for its load); such a poll waits up to IDLE_WAIT_S for a disk or store job to end
IDLE_POLL_S = 0.001
IDLE_WAIT_S = 0.02


@dataclass(slots=True)
class _Job:
    """One vLLM job in flight on this rank."""

    job_id: int
    spec: ChunkStore | ChunkLoad
    copy: BlockCopy
    is_store: bool
    stage: str  # "promote", "copy" or "write"
    waiting: set[str] = field(default_factory=set)  # lower tiers whose part of the stage runs
    failed: list[str] = field(default_factory=list)  # lower tiers whose part of it failed
    bad: list[int] = field(default_factory=list)  # chunks a promotion found bad at the source
    held: list[int] = field(default_factory=list)  # chunks whose reads may still land
    epoch: int = 0  # the manager's namespace epoch when it made the job
    started: float = field(default_factory=time.perf_counter)

    def positions(self, tier: str) -> list[int]:
        """Which of the job's chunks ``tier`` (disk or shared) moves in this job."""
        spec = self.spec
        if isinstance(spec, ChunkStore):
            return spec.to_disk if tier == "disk" else spec.to_shared
        return spec.from_disk if tier == "disk" else spec.from_shared


@dataclass(slots=True, frozen=True)
class JobRecord:
    """A finished job as this rank saw it: from vLLM's submit to the poll that found it done
    (the benchmark's load times, the spec's stats)."""

    is_store: bool
    ok: bool
    blocks: int  # GPU blocks it copied
    promoted: int  # chunks a load read from disk or the store first
    seconds: float


def page_pieces_of(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """The byte views a block's page is made of, in order: one per distinct tensor of the
    (single) KV-cache group, each cut to the page size its layers use."""
    if len(kv_caches.group_data_refs) != 1:
        raise ValueError(
            "raykv inside vLLM serves models with one KV-cache group (full attention); this "
            f"model has {len(kv_caches.group_data_refs)}"
        )
    pieces: list[torch.Tensor] = []
    seen: set[int] = set()
    for ref in kv_caches.group_data_refs[0]:
        if ref.tensor_idx in seen:  # layers that share a tensor share its bytes
            continue
        seen.add(ref.tensor_idx)
        tensor = kv_caches.tensors[ref.tensor_idx].tensor
        pieces.append(tensor.view(torch.uint8)[:, : ref.page_size_bytes])
    return pieces


def block_copy(spec: GPULoadStoreSpec, slots: list[int], blocks_per_chunk: int) -> BlockCopy:
    """Which slot and position each GPU block of a job is: the job's blocks run in order from
    position ``block_indices[0] % blocks_per_chunk`` of its first chunk."""
    skip = int(spec.block_indices[0]) % blocks_per_chunk if len(spec.block_indices) else 0
    gpu = [int(b) for b in spec.block_ids]
    positions = range(skip, skip + len(gpu))
    return BlockCopy(
        gpu_blocks=gpu,
        cpu_slots=[slots[p // blocks_per_chunk] for p in positions],
        sub_blocks=[p % blocks_per_chunk for p in positions],
    )


class LowerTiers(Protocol):
    """Where a worker's engines of the tiers below the CPU tier come from (the spec's
    ``WorkerTiers``)."""

    def epoch(self) -> int: ...
    def post(self, epoch: int) -> None: ...
    def build(self, epoch: int) -> dict[str, ChunkJobEngine] | None: ...
    def ready(self, epoch: int, lower: dict[str, ChunkJobEngine]) -> None: ...


class RaykvOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on raykv's engines, for one rank."""

    def __init__(
        self,
        rank: int,
        copies: CpuTransferEngine | CudaTransferEngine,
        bad_keys: BadKeys,
        blocks_per_chunk: int,
        populator: PagePopulator | None = None,
        tiers: LowerTiers | None = None,
    ) -> None:
        """``populator``: the thread faulting the CPU pool's pages in, stopped at shutdown;
        ``tiers``: where the engines of the tiers under the CPU tier come from (``disk``,
        ``shared``; None: the CPU tier alone)."""
        self.rank = rank
        self.copies = copies
        self.tiers = tiers
        self.lower: dict[str, ChunkJobEngine] = {}  # by tier, under the namespace of _built
        self._posted = self._built = -1  # the epochs this rank posted for and built under
        self.bad_keys = bad_keys
        self.blocks_per_chunk = blocks_per_chunk
        self.populator = populator
        self.page_bytes = copies.layout.page_bytes
        self._jobs: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._failed_loads: list[int] = []
        self._reported_failures: list[int] = []
        self.records: deque[JobRecord] = deque(maxlen=1024)  # the latest finished jobs
        self._last_poll = 0.0  # when the last get_finished returned
        self._sync_tiers()  # what this rank runs, posted at once: the manager waits for it

    # ---- the namespace -----------------------------------------------------------------------

    def _sync_tiers(self) -> None:
        """Follow the manager's epoch: post what this rank runs for a new one (its engines of
        the epoch before retired first), and build the engines once its namespace is there."""
        tiers = self.tiers
        if tiers is None:
            return
        epoch = tiers.epoch()
        try:
            if epoch != self._posted:
                self._retire_lower()
                self._posted = epoch  # once: a post that fails is said, not tried each step
                tiers.post(epoch)
            if self._built != epoch:
                lower = tiers.build(epoch)
                if lower is None:
                    return
                self.lower, self._built = lower, epoch
                if lower:
                    tiers.ready(epoch, lower)
        except Exception as exc:  # the tiers below stay out of use; the CPU tier serves on
            log.error(
                "raykv rank %d: the disk and shared tiers stay out of use (namespace epoch "
                "%d): %s: %s",
                self.rank,
                epoch,
                type(exc).__name__,
                exc,
            )
            self._built = epoch

    def _retire_lower(self) -> None:
        """Let the lower tiers' jobs end (bounded), then shut their engines down: a job of
        theirs that is left ends as failed, and no later stage of a job submitted before
        reaches the engines of the next namespace."""
        deadline = time.monotonic() + WAIT_S
        while any(job.waiting for job in self._jobs.values()) and time.monotonic() < deadline:
            for engine in self.lower.values():
                engine.wait(0.01)
            self._advance()
        for job in [job for job in self._jobs.values() if job.waiting]:
            self._give_up(job)
        for engine in self.lower.values():
            with contextlib.suppress(Exception):
                engine.shutdown(wait=True)
        self.lower, self._built = {}, -1

    # ---- vLLM's calls ------------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, ChunkStore)
        self._sync_tiers()
        disk = self.lower.get("disk")
        if disk is not None and dst_spec.disk_drops:
            disk.drop(dst_spec.disk_drops)  # type: ignore[attr-defined]
        copy = block_copy(src_spec, dst_spec.slots, self.blocks_per_chunk)
        job = _Job(job_id, dst_spec, copy, is_store=True, stage="copy", epoch=dst_spec.epoch)
        self._jobs[job_id] = job
        self.copies.submit(TransferSpec(job_id, True, copy, check_sums=dst_spec.check_sums))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, ChunkLoad)
        self._sync_tiers()
        copy = block_copy(dst_spec, src_spec.slots, self.blocks_per_chunk)
        job = _Job(job_id, src_spec, copy, is_store=False, stage="copy", epoch=src_spec.epoch)
        self._jobs[job_id] = job
        sources = [tier for tier in ("disk", "shared") if job.positions(tier)]
        other_namespace = bool(sources) and job.epoch != self._built
        if src_spec.refused or other_namespace or any(t not in self.lower for t in sources):
            # no room, no such tier on this rank, or its tiers are another namespace's now:
            # never garbage
            self._end(job, ok=False)
        elif sources:
            job.stage = "promote"
            self._submit_lower(job, sources, promote=True)
        else:
            self._copy_out(job)
        return True

    def get_finished(self) -> list[TransferResult]:
        self._sync_tiers()
        if self._promoting() and time.perf_counter() - self._last_poll < IDLE_POLL_S:
            # vLLM has nothing to compute but a request waiting for its load, and spins on
            # this poll, taking a core and the GIL from the threads reading the disk or the
            # store (the store's TCP transport wants both cores on two: measured, a 2,048-token
            # load from it 180-240 ms with a bare yield here, 125-160 ms with this wait). Not
            # for writes: nothing waits on them, and a request arriving would
            self._wait_lower(IDLE_WAIT_S)
        elif self._jobs and (self.copies.threaded or self._lower_busy()):
            # vLLM polls every step, and an idle engine steps in a tight Python loop that
            # keeps the GIL: a thread of raykv's (copies, disk reads and writes, the store's
            # client), which takes it back after each copy, read or checksum, would wait out
            # the interpreter's switch interval (5 ms) every time. Letting go of it here lets
            # the thread go on at once (measured: a 32-block load 277 ms without this)
            time.sleep(0)
        self._advance()
        finished, self._finished = self._finished, []
        # every failed load is in this batch: _end lists it in both at once
        self._reported_failures.extend(self._failed_loads)
        self._failed_loads = []
        self._last_poll = time.perf_counter()
        return finished

    def _wait_lower(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a job of the lower tiers to end (any that runs)."""
        busy = [engine for engine in self.lower.values() if engine.in_flight()]
        for engine in busy:
            engine.wait(timeout_s / len(busy))

    def _lower_busy(self) -> bool:
        return any(job.waiting for job in self._jobs.values())

    def _promoting(self) -> bool:
        """A load's chunks are being read from the disk or the store (a request waits)."""
        return any(job.waiting and job.stage == "promote" for job in self._jobs.values())

    def take_failed_loads(self) -> list[int]:
        """Loads that failed, reported done to vLLM since the last call."""
        out, self._reported_failures = self._reported_failures, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        deadline = time.monotonic() + WAIT_S
        # vLLM waits to reuse the jobs' GPU blocks: done once no copy of theirs may still run
        # (a store's write to disk reads its CPU slot, never the GPU blocks)
        while any(j in self._jobs and self._jobs[j].stage != "write" for j in job_ids):
            copying = [j for j in job_ids if j in self._jobs and self._jobs[j].stage == "copy"]
            if copying:
                self.copies.flush(copying)
            else:
                for engine in self.lower.values():
                    engine.wait(0.01 / len(self.lower))
                if not self.lower:
                    time.sleep(0.001)
            self._advance()
            if time.monotonic() > deadline:
                stuck = sorted(
                    j for j in job_ids if j in self._jobs and self._jobs[j].stage != "write"
                )
                log.error(
                    "raykv rank %d: jobs %s unfinished after %.0f s", self.rank, stuck, WAIT_S
                )
                for job_id in stuck:
                    self._give_up(self._jobs[job_id])
                break

    def _give_up(self, job: _Job) -> None:
        """End a job that did not finish in time, as failed."""
        if job.is_store:  # what it stored is not sure in any tier
            self.bad_keys.append(self.rank, list(job.spec.keys), EVERY_TIER)
            self._end(job, ok=False)
        elif job.stage == "promote":  # its reads run on: their slots are held
            job.held.extend(job.spec.keys[i] for t in job.waiting for i in job.positions(t))
            self._fail_promotion(job)
        else:
            self._end(job, ok=False)

    def shutdown(self) -> None:
        if self.populator is not None:
            self.populator.stop()
        with contextlib.suppress(Exception):
            self.copies.shutdown(wait=True)
        for engine in self.lower.values():
            with contextlib.suppress(Exception):
                engine.shutdown(wait=True)
        stop_embedded(self.bad_keys.directory)  # where this process started the master

    # ---- the stages of a job -----------------------------------------------------------------

    def _move(
        self, job_id: int, spec: ChunkStore | ChunkLoad, positions: list[int], promote: bool
    ) -> TierMove:
        keys = [spec.keys[i] for i in positions]
        slots = [spec.slots[i] for i in positions]
        # with verify, a promotion records the checksums it verified for the load that follows
        # and a write checks the slot against its store's; without, neither (a checksum left
        # by a promotion would fail a later store's write of the same slot)
        return TierMove.of(job_id, promote, keys, slots, check=spec.check_sums)

    def _submit_lower(self, job: _Job, tiers: list[str], promote: bool) -> None:
        job.waiting.update(tiers)
        for tier in tiers:
            move = self._move(job.job_id, job.spec, job.positions(tier), promote=promote)
            self.lower[tier].submit(move)

    def _copy_out(self, job: _Job) -> None:
        job.stage = "copy"
        spec = job.spec
        self.copies.submit(TransferSpec(job.job_id, False, job.copy, check_sums=spec.check_sums))

    def _advance(self) -> None:
        """Move every job whose stage ended on to its next stage, or to the finished list.
        Without a copy thread, the copies this call queued (a promotion that ended) run in it
        too, so that a load is never a step late."""
        queued = self._advance_once()
        while queued and not self.copies.threaded:
            queued = self._advance_once()

    def _advance_once(self) -> bool:
        """One pass of :meth:`_advance`: whether it queued a copy."""
        queued = False
        completed, failed = self.copies.poll()
        corrupt = set(self.copies.take_corrupt())
        for job_id, ok in [(j, True) for j in completed] + [(j, False) for j in failed]:
            job = self._jobs.get(job_id)
            if job is None or job.stage != "copy":
                continue
            if not ok:
                # a corrupt CPU chunk leaves the CPU tier; a store that failed leaves every
                # tier it was going to (its file is never written); a load that failed
                # otherwise says nothing about the chunks
                if job.is_store:
                    self.bad_keys.append(self.rank, list(job.spec.keys), EVERY_TIER)
                elif job_id in corrupt:
                    self.bad_keys.append(self.rank, list(job.spec.keys), CPU_TIER)
                self._end(job, ok=False)
            elif (
                job.is_store
                and job.epoch == self._built  # never into the tiers of a later namespace
                and (writes := [t for t in self.lower if job.positions(t)])
            ):
                job.stage = "write"
                self._submit_lower(job, writes, promote=False)
            else:
                self._end(job, ok=True)
        for tier, engine in self.lower.items():
            moved, not_moved = engine.poll()
            bad = engine.take_bad_keys()
            engine.take_corrupt()
            engine.take_full()
            unsettled = set(engine.take_unsettled())
            for job_id, ok in [(j, True) for j in moved] + [(j, False) for j in not_moved]:
                job = self._jobs.get(job_id)
                if job is None or tier not in job.waiting:
                    continue
                job.waiting.discard(tier)
                if not ok:
                    job.failed.append(tier)
                    if job.stage == "promote":
                        read = [job.spec.keys[i] for i in job.positions(tier)]
                        if job_id in unsettled:
                            # not delivered, not cancelled: the source may be sound, and the
                            # bytes may land in the slots yet
                            job.held.extend(read)
                        else:
                            # files or parts that failed their checks leave every tier; a read
                            # that failed otherwise (an I/O error) names none, and all of this
                            # tier's chunks of the job leave it
                            job.bad.extend(bad.get(job_id) or read)
                if not job.waiting:
                    queued |= self._lower_done(job)
        return queued

    def _lower_done(self, job: _Job) -> bool:
        """Every lower tier's part of the job's stage ended: whether its copy was queued."""
        keys = job.spec.keys
        if job.stage == "write":
            # the CPU copy stands; the file or the parts that failed do not
            for tier in job.failed:
                written = [keys[i] for i in job.positions(tier)]
                self.bad_keys.append(
                    self.rank, written, DISK_TIER if tier == "disk" else SHARED_TIER
                )
            self._end(job, ok=True)
        elif not job.failed:
            self._copy_out(job)
            return True
        else:
            self._fail_promotion(job)
        return False

    def _fail_promotion(self, job: _Job) -> None:
        """Name a failed promotion's chunks to the manager, and fail its load."""
        keys = job.spec.keys
        promoted = [keys[i] for t in ("disk", "shared") for i in job.positions(t)]
        sources, held = set(job.bad), set(job.held)
        self.bad_keys.append(self.rank, [k for k in promoted if k in sources], EVERY_TIER)
        self.bad_keys.append(self.rank, [k for k in promoted if k in held], HELD_SLOT)
        # the other promotions' slots hold what may be half of a chunk
        rest = [k for k in promoted if k not in sources and k not in held]
        self.bad_keys.append(self.rank, rest, CPU_TIER)
        self._end(job, ok=False)

    def _end(self, job: _Job, ok: bool) -> None:
        self._jobs.pop(job.job_id, None)
        if not ok and not job.is_store:
            self._failed_loads.append(job.job_id)
        blocks = len(job.copy.gpu_blocks)
        seconds = time.perf_counter() - job.started
        promoted = 0 if job.is_store else len(job.spec.from_disk) + len(job.spec.from_shared)
        self.records.append(JobRecord(job.is_store, ok, blocks, promoted, seconds))
        # vLLM's connector asserts success: a failure travels by take_failed_loads
        moved = blocks * self.page_bytes if ok else 0  # vLLM's byte counters: bytes moved
        self._finished.append(TransferResult(job.job_id, True, moved, seconds))
