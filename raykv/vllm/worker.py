"""The worker half of raykv inside vLLM: one per vLLM worker process (one per TP rank), it
moves its own shard of every chunk and nothing else.

Its CPU-pool shard is raykv's pool (``transfer/layout.py``), its copies raykv's CPU engine
(``transfer/cpu.py``) reading and writing vLLM's canonical per-layer views in place (a pool
page is the block's pages of every layer, one after the other), its disk files raykv's disk
engine's (``transfer/disk.py``: the same format, namespace, checksums and I/O threads). A job
vLLM submits may take two steps here: a store copies the pages into their slots and then writes
the slots the disk tier admitted to their files; a load first promotes the chunks only the disk
holds into their slots, then copies the pages out. vLLM hears of the job when both are done.

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

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from raykv.core.step import BlockCopy, TierMove, TransferSpec
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.disk import DiskTransferEngine
from raykv.vllm.failures import CPU_TIER, DISK_TIER, EVERY_TIER, BadKeys
from raykv.vllm.jobs import ChunkLoad, ChunkStore

log = logging.getLogger(__name__)

# how long ``wait`` lets a job take before it gives up on it (a disk that never answers)
WAIT_S = 60.0


@dataclass(slots=True)
class _Job:
    """One vLLM job in flight on this rank."""

    job_id: int
    spec: ChunkStore | ChunkLoad
    copy: BlockCopy
    is_store: bool
    stage: str  # "promote", "copy" or "write"
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True, frozen=True)
class JobRecord:
    """A finished job as this rank saw it: from vLLM's submit to the poll that found it done
    (the benchmark's load times, the spec's stats)."""

    is_store: bool
    ok: bool
    blocks: int  # GPU blocks it copied
    promoted: int  # chunks a load read from disk first
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


class RaykvOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on raykv's engines, for one rank."""

    def __init__(
        self,
        rank: int,
        copies: CpuTransferEngine,
        disk: DiskTransferEngine | None,
        bad_keys: BadKeys,
        blocks_per_chunk: int,
    ) -> None:
        self.rank = rank
        self.copies = copies
        self.disk = disk
        self.bad_keys = bad_keys
        self.blocks_per_chunk = blocks_per_chunk
        self.page_bytes = copies.layout.page_bytes
        self._jobs: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._failed_loads: list[int] = []
        self._reported_failures: list[int] = []
        self.records: deque[JobRecord] = deque(maxlen=1024)  # the latest finished jobs

    # ---- vLLM's calls ------------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, ChunkStore)
        if self.disk is not None and dst_spec.disk_drops:
            self.disk.drop(dst_spec.disk_drops)
        copy = block_copy(src_spec, dst_spec.slots, self.blocks_per_chunk)
        job = _Job(job_id, dst_spec, copy, is_store=True, stage="copy")
        self._jobs[job_id] = job
        self.copies.submit(TransferSpec(job_id, True, copy, check_sums=dst_spec.check_sums))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, ChunkLoad)
        copy = block_copy(dst_spec, src_spec.slots, self.blocks_per_chunk)
        job = _Job(job_id, src_spec, copy, is_store=False, stage="copy")
        self._jobs[job_id] = job
        if src_spec.refused:
            self._end(job, ok=False)
        elif src_spec.from_disk and self.disk is not None:
            job.stage = "promote"
            self.disk.submit(self._move(job_id, src_spec, src_spec.from_disk, promote=True))
        elif src_spec.from_disk:
            self._end(job, ok=False)  # no disk engine on this rank: never loads garbage
        else:
            self._copy_out(job)
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._jobs:
            # vLLM polls every step, and an idle engine steps in a tight Python loop that
            # keeps the GIL: the copy thread, which takes it back after each copy and checksum,
            # would wait out the interpreter's switch interval (5 ms) every time. Letting go
            # of it here lets the copy thread go on at once (measured: a 32-block load 277 ms
            # without this)
            time.sleep(0)
        self._advance()
        finished, self._finished = self._finished, []
        # every failed load is in this batch: _end lists it in both at once
        self._reported_failures.extend(self._failed_loads)
        self._failed_loads = []
        return finished

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
            elif self.disk is not None:
                self.disk.wait(0.01)
            self._advance()
            if time.monotonic() > deadline:
                stuck = sorted(
                    j for j in job_ids if j in self._jobs and self._jobs[j].stage != "write"
                )
                log.error(
                    "raykv rank %d: jobs %s unfinished after %.0f s", self.rank, stuck, WAIT_S
                )
                for job_id in stuck:
                    job = self._jobs[job_id]
                    if job.is_store:  # what it stored is not sure in any tier
                        self.bad_keys.append(self.rank, list(job.spec.keys), EVERY_TIER)
                    self._end(job, ok=False)
                break

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.copies.shutdown(wait=True)
        if self.disk is not None:
            with contextlib.suppress(Exception):
                self.disk.shutdown(wait=True)

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

    def _copy_out(self, job: _Job) -> None:
        job.stage = "copy"
        spec = job.spec
        self.copies.submit(TransferSpec(job.job_id, False, job.copy, check_sums=spec.check_sums))

    def _advance(self) -> None:
        """Move every job whose stage ended on to its next stage, or to the finished list."""
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
            elif job.is_store and job.spec.to_disk and self.disk is not None:
                job.stage = "write"
                self.disk.submit(self._move(job_id, job.spec, job.spec.to_disk, promote=False))
            else:
                self._end(job, ok=True)
        if self.disk is None:
            return
        moved, not_moved = self.disk.poll()
        bad = self.disk.take_bad_keys()
        self.disk.take_corrupt()
        self.disk.take_full()
        self.disk.take_unsettled()
        for job_id, ok in [(j, True) for j in moved] + [(j, False) for j in not_moved]:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job.stage == "write":
                if not ok:  # the CPU copy stands; the file does not
                    written = [job.spec.keys[i] for i in job.spec.to_disk]
                    self.bad_keys.append(self.rank, written, DISK_TIER)
                self._end(job, ok=True)
            elif job.stage == "promote":
                if ok:
                    self._copy_out(job)
                    continue
                promoted = [job.spec.keys[i] for i in job.spec.from_disk]
                # files that failed their checks leave the disk tier; a read that failed
                # otherwise (an I/O error) names none, and all of the job's files leave it
                sources = bad.get(job_id) or promoted
                self.bad_keys.append(self.rank, sources, EVERY_TIER)
                self.bad_keys.append(self.rank, [k for k in promoted if k not in sources], CPU_TIER)
                self._end(job, ok=False)

    def _end(self, job: _Job, ok: bool) -> None:
        self._jobs.pop(job.job_id, None)
        if not ok and not job.is_store:
            self._failed_loads.append(job.job_id)
        blocks = len(job.copy.gpu_blocks)
        seconds = time.perf_counter() - job.started
        promoted = 0 if job.is_store else len(job.spec.from_disk)
        self.records.append(JobRecord(job.is_store, ok, blocks, promoted, seconds))
        # vLLM's connector asserts success: a failure travels by take_failed_loads
        moved = blocks * self.page_bytes if ok else 0  # vLLM's byte counters: bytes moved
        self._finished.append(TransferResult(job.job_id, True, moved, seconds))
