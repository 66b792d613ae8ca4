"""The manager half of raykv inside vLLM (vLLM's scheduler process): which chunks each tier
holds, in which slot, and what a load or a store must do. It never touches a byte: the workers
move them, each its own shard, and ack each job to vLLM, which counts every rank's ack.

The tiers are raykv's own directories (``offload/directory.py``): the CPU tier's slots, with
its policy and frequency filter, and, under it, the disk tier's files. The disk tier is written
through: a chunk the CPU tier stores is written to its file in the same job (where the disk
tier admits it), so the CPU tier evicts without a copy and a later vLLM on the same path finds
every chunk (a warm restart). A chunk found only on disk is promoted into a CPU slot by the load
that needs it, in the same job.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from raykv.core.kv_events import MEDIUM_CPU, BlockStored
from raykv.offload.directory import HIT, HIT_PENDING, MISS, Directory
from raykv.vllm.failures import CPU_TIER, DISK_TIER, BadKeys
from raykv.vllm.jobs import ChunkLoad, ChunkStore
from raykv.vllm.keys import raykv_key
from raykv.vllm.metrics import TierMetrics

log = logging.getLogger(__name__)

_MEDIUM = {MEDIUM_CPU: Medium.CPU}  # anything else (the disk) is vLLM's STORAGE


class RaykvOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` on raykv's tier directories.

    Args:
        cpu: the CPU tier's directory (one slot: one chunk on every rank).
        disk: the disk tier's directory, or None without a disk tier.
        bad_keys: where the workers say which chunks they found bad.
        check_sums: loads check each CPU page's checksum (``offload.verify``).
    """

    def __init__(
        self,
        cpu: Directory,
        disk: Directory | None,
        bad_keys: BadKeys,
        check_sums: bool,
    ) -> None:
        self.cpu = cpu
        self.disk = disk
        self.bad_keys = bad_keys
        self.check_sums = check_sums
        # vLLM's key of every key a tier holds that this process saw (events and evictions
        # name vLLM's keys; chunks found on disk at start are known by raykv's key only)
        self._names: dict[int, OffloadKey] = {}
        # keys whose store writes their file too (until complete_store)
        self._writing_disk: set[int] = set()
        # what each request's load pinned and promoted (vLLM runs one load per request at a
        # time): complete_load undoes exactly that, whatever else happened to the keys since
        self._loads: dict[str, tuple[list[int], list[int]]] = {}
        # keys found bad that could not leave their tier yet (being written or read): kept
        # until they can, and a store or promotion of one completes as failed
        self._bad_cpu: set[int] = set()
        self._bad_disk: set[int] = set()
        self.metrics = TierMetrics()

    # ---- lookups and loads -------------------------------------------------------------------

    def _forget_bad(self) -> None:
        """Take the workers' new reports of bad chunks, then let go what can go."""
        counts = self.metrics.bad
        for tiers, key in self.bad_keys.take():
            for tier, pending, name, marker in (
                (self.cpu, self._bad_cpu, "cpu", DISK_TIER),
                (self.disk, self._bad_disk, "disk", CPU_TIER),
            ):
                if tiers == marker or tier is None:
                    continue
                # a chunk once readable, counted once: a store or promotion still writing
                # it is a failed store (counted as that), not a bad chunk
                if tier.is_readable(key) and key not in pending:
                    counts[name] = counts.get(name, 0) + 1
                pending.add(key)
        self._discard_bad()

    def _discard_bad(self) -> None:
        """Bad chunks nobody reads or writes any more leave their tier."""
        for tier, bad in ((self.cpu, self._bad_cpu), (self.disk, self._bad_disk)):
            if tier is None or not bad:
                continue
            tier.discard(bad)
            # what left (or was never there) is done with; the rest waits for its readers
            bad.intersection_update(k for k in bad if k in tier)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = raykv_key(key)
        # every tier counts the lookup (its frequency filter admits on asks, hits or not)
        found = self.cpu.lookup(k)
        if found == MISS and self.disk is not None:
            found = self.disk.lookup(k)
        if found == HIT:
            return LookupResult.HIT
        return LookupResult.HIT_PENDING if found == HIT_PENDING else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> ChunkLoad:
        ks = self._named(keys)  # a promotion's BlockStored event names them
        in_cpu = [k for k in ks if self.cpu.is_readable(k)]
        below = [k for k in ks if not self.cpu.is_readable(k)]
        slot_of: dict[int, int] = dict(zip(in_cpu, self.cpu.prepare_load(in_cpu), strict=True))
        refused = False
        if below:
            plan = None
            if self.disk is not None and all(self.disk.is_readable(k) for k in below):
                plan = self.cpu.prepare_store(below, admit_all=True, keep=in_cpu)
            if plan is None or len(plan.keys) != len(below):
                # no CPU room for the promotion (or the chunks left the disk tier since the
                # lookup): the job fails, and vLLM recomputes
                refused = True
                self.metrics.refused += 1
                if plan is not None:
                    self.cpu.complete_store(plan.keys, success=False)
                self.cpu.complete_load(in_cpu)
                in_cpu, below = [], []
            else:
                assert self.disk is not None
                self.disk.prepare_load(below)
                slot_of.update(zip(plan.keys, plan.slots, strict=True))
        self._loads[req_context.req_id] = (in_cpu, below)
        from_disk = set(below)
        return ChunkLoad(
            keys=ks,
            slots=[slot_of.get(k, -1) for k in ks],
            from_disk=[i for i, k in enumerate(ks) if k in from_disk],
            check_sums=self.check_sums,
            refused=refused,
        )

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ks = [raykv_key(key) for key in keys]
        self.cpu.touch(ks)
        if self.disk is not None:
            self.disk.touch(ks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._forget_bad()  # the workers named the chunks a failed load found bad first
        pinned, promoted = self._loads.pop(req_context.req_id, ([], []))
        if promoted:
            bad = self._bad_cpu.intersection(promoted)
            good = [k for k in promoted if k not in bad]
            self.cpu.complete_store(good, success=True)
            self.cpu.complete_store(list(bad), success=False)  # its slot holds nothing sure
            self._bad_cpu.difference_update(bad)
            assert self.disk is not None
            self.disk.complete_load(promoted)
        self.cpu.complete_load(pinned)
        self._discard_bad()  # the bad chunks this load held may go now

    # ---- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        ks = self._named(keys)
        plan = self.cpu.prepare_store(ks)
        if plan is None:
            # no room for all: the prefix there is room for (vLLM does not offer the rest
            # again; refusing all would have it offer every key again, step after step)
            room = self.cpu.room()
            plan = self.cpu.prepare_store(ks[:room]) if room > 0 else None
            if plan is None:
                return None
        to_disk: list[int] = []
        drops: list[int] = []
        if self.disk is not None and plan.keys:
            new = [k for k in plan.keys if k not in self.disk]
            lower = self.disk.prepare_store(new) if new else None
            if lower is not None:
                chosen = set(lower.keys)
                to_disk = [i for i, k in enumerate(plan.keys) if k in chosen]
                drops = list(lower.evicted)
                self._writing_disk.update(lower.keys)
        names = self._names
        spec = ChunkStore(
            keys=list(plan.keys),
            slots=list(plan.slots),
            to_disk=to_disk,
            disk_drops=drops,
            check_sums=self.check_sums,
        )
        return PrepareStoreOutput(
            keys_to_store=[names[k] for k in plan.keys],
            store_spec=spec,
            evicted_keys=[names[k] for k in plan.evicted if k in names],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._forget_bad()
        ks = [raykv_key(key) for key in keys]
        self._complete(self.cpu, ks, success, self._bad_cpu)
        on_disk = [k for k in ks if k in self._writing_disk]
        if on_disk:
            self._writing_disk.difference_update(on_disk)
            assert self.disk is not None
            self._complete(self.disk, on_disk, success, self._bad_disk)

    @staticmethod
    def _complete(tier: Directory, keys: list[int], success: bool, bad: set[int]) -> None:
        failed = bad.intersection(keys) if success else set(keys)
        tier.complete_store([k for k in keys if k not in failed], success=True)
        if failed:
            tier.complete_store(list(failed), success=False)
            bad.difference_update(failed)

    # ---- requests, events, lifecycle ---------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        tiers = [self.cpu] if self.disk is None else [self.cpu, self.disk]
        names = self._names
        for tier in tiers:
            for event in tier.take_events():
                keys = [names[k] for k in event.keys if k in names]
                if keys:
                    yield OffloadingEvent(
                        keys=keys,
                        medium=_MEDIUM.get(event.medium, Medium.STORAGE),
                        removed=not isinstance(event, BlockStored),
                    )

    def _named(self, keys: Collection[OffloadKey]) -> list[int]:
        """raykv's keys of ``keys``, each remembered with vLLM's name for the events."""
        ks = [raykv_key(key) for key in keys]
        self._names.update(zip(ks, keys, strict=True))
        return ks

    def _trim_names(self) -> None:
        # names of keys no tier holds any more are dropped once the map outgrows the tiers
        # (once a step, whether or not vLLM takes events)
        if len(self._names) > 2 * (self.cpu.capacity + (self.disk.capacity if self.disk else 0)):
            cpu, disk = self.cpu, self.disk
            self._names = {
                k: v for k, v in self._names.items() if k in cpu or (disk is not None and k in disk)
            }

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._forget_bad()  # once a step: the lookups of the next step see the bad chunks gone
        self._trim_names()

    def has_pending_work(self) -> bool:
        return False

    def get_stats(self) -> OffloadingConnectorStats | None:
        tiers = {"cpu": self.cpu.stats()}
        if self.disk is not None:
            tiers["disk"] = self.disk.stats()
        return self.metrics.report(tiers)

    def shutdown(self) -> None:
        self.bad_keys.remove()

    def reset_cache(self) -> None:
        # vLLM drops the completions of every job started before a reset: both tiers forget
        # what was in flight (a disk key left "being written" would be HIT_PENDING for ever),
        # and the disk tier what it held (a reset may follow new weights); files left behind
        # are written over as their keys come again
        self.cpu.reset()
        if self.disk is not None:
            self.disk.reset()
        self._writing_disk.clear()
        self._loads.clear()
        self._bad_cpu.clear()
        self._bad_disk.clear()
