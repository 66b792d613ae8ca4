"""The manager half of raykv inside vLLM (vLLM's scheduler process): which chunks each tier
holds, in which slot, and what a load or a store must do. It never touches a byte: the workers
move them, each its own shard, and ack each job to vLLM, which counts every rank's ack.

The tiers are raykv's own directories (``offload/directory.py``): the CPU tier's slots, with
its policy and frequency filter, and, under it, the disk tier's files and the shared tier's
index of Mooncake Store. Both are written through: a chunk the CPU tier stores is written to its
file and put into the store in the same job (where each tier admits it), so the CPU tier evicts
without a copy, a later vLLM on the same path finds every chunk (a warm restart), and every
other engine on the same store can load it. A chunk found only on disk or in the store is
promoted into a CPU slot by the load that needs it, in the same job. The store is asked (one
round trip) for a chunk no tier of this engine knows: what another engine published.

The disk and shared tiers are used only under a namespace the workers agreed on
(``namespace.py``): what they run, model and weights. Until then (a step or two at start, and
after a reset) a lookup of a chunk the CPU tier lacks is asked again (vLLM's ``RETRY``, for a
bounded time), so the first request after a restart still finds what the disk holds; a reset
forgets what every tier held and has the namespace agreed on again, from the weights the
workers hold then.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
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

from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_SHARED, BlockStored
from raykv.offload.directory import HIT, HIT_PENDING, MISS, Directory
from raykv.transfer.shared_store import SharedStoreError
from raykv.vllm.failures import CPU_TIER, DISK_TIER, EVERY_TIER, HELD_SLOT, SHARED_TIER, BadKeys
from raykv.vllm.jobs import ChunkLoad, ChunkStore
from raykv.vllm.keys import raykv_key
from raykv.vllm.load_report import LoadReport, LoadReporter
from raykv.vllm.metrics import TierMetrics
from raykv.vllm.namespace import NamespaceAgreement
from raykv.vllm.room import PromotionRoom
from raykv.vllm.shared import StoreView, kill_embedded, stop_embedded
from raykv.vllm.worth import LoadChoice

log = logging.getLogger(__name__)

# how long the slot of a read that may still land stays out of use (raykv's engine's hold)
LATE_READ_HOLD_S = 120.0
# each tier as vLLM's KV events name it (medium, locality, ownership): the CPU tier is vLLM's
# CPU; the disk tier STORAGE on this machine; the shared tier STORAGE in the cluster's store,
# which any replica loads from (a consumer credits it to every replica). The ownership names
# the tier for consumers that tell two STORAGE tiers apart (raykv's router does).
OWNER_DISK = "raykv-disk"
OWNER_SHARED = "raykv-shared"
_MEDIUM: dict[str, tuple[Medium, Locality | None, str | None]] = {
    MEDIUM_CPU: (Medium.CPU, None, None),
    MEDIUM_DISK: (Medium.STORAGE, Locality.LOCAL, OWNER_DISK),
    MEDIUM_SHARED: (Medium.STORAGE, Locality.REMOTE, OWNER_SHARED),
}
# which tiers a worker's report of a bad chunk concerns
_LEAVES = {
    EVERY_TIER: ("cpu", "disk", "shared"),
    CPU_TIER: ("cpu",),
    HELD_SLOT: ("cpu",),
    DISK_TIER: ("disk",),
    SHARED_TIER: ("shared",),
}


class RaykvOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` on raykv's tier directories.

    Args:
        cpu: the CPU tier's directory (one slot: one chunk on every rank).
        disk: the disk tier's directory, or None without a disk tier.
        bad_keys: where the workers say which chunks they found bad.
        check_sums: loads check each CPU page's checksum (``offload.verify``).
        shared: the shared tier's index of the store, or None without a shared tier.
        store: asks the store what it holds (another engine's chunks); None: never asked.
        retry_steps: steps the shared tier stays out of use after the store failed.
        kill_master_at: the steps at which the embedded master is killed
            (``kill-shared-master``).
        choice: the choice between a load and a recompute (``take_hits: faster``); None:
            every hit is loaded (``always``).
        namespace: the agreement on the disk and shared tiers' namespace; None: they are
            used as given, at once.
    """

    def __init__(
        self,
        cpu: Directory,
        disk: Directory | None,
        bad_keys: BadKeys,
        check_sums: bool,
        shared: Directory | None = None,
        store: StoreView | None = None,
        retry_steps: int = 512,
        kill_master_at: Collection[int] = (),
        choice: LoadChoice | None = None,
        namespace: NamespaceAgreement | None = None,
    ) -> None:
        self.cpu = cpu
        # the tiers below the CPU tier, in use (None: absent, or no namespace agreed on yet)
        self.disk = disk
        self.shared = shared
        self.store = store
        self.namespace = namespace
        # ... and as built, whether in use or not
        self._built_tiers, self._store_view = (disk, shared), store
        self._agreed_step = -1  # the step whose lookups last asked for the namespace
        if namespace is not None:
            self.disk = self.shared = self.store = None
        self.retry_steps = retry_steps
        # where each completed load's tokens per tier go (a raykv serve replica), if anywhere
        self.reporter: LoadReporter | None = None
        self.tokens_per_chunk = 0  # set by the spec with the reporter
        self._load_tokens: dict[str, tuple[int, int, int]] = {}
        self._reported: dict[str, bool] = {}  # requests whose load was reported, until they end
        self.kill_master_at = set(kill_master_at)
        self.choice = choice
        self.bad_keys = bad_keys
        self.check_sums = check_sums
        # vLLM's key of every key a tier holds that this process saw (events and evictions
        # name vLLM's keys; chunks found on disk at start are known by raykv's key only)
        self._names: dict[int, OffloadKey] = {}
        # keys whose store writes their file, or puts their parts, too (until complete_store)
        self._writing_disk: set[int] = set()
        self._writing_shared: set[int] = set()
        self._step = 0
        self._shared_paused_until = 0  # the store failed: no questions, no puts, until then
        self._absent: set[int] = set()  # asked of the store this step and not there
        # chunks found bad in the store, by the step until which it is not asked for them
        # again (their parts may stay there: another reader's lease keeps them from removal)
        self._shunned: dict[int, int] = {}
        # what each request's load pinned and promoted (vLLM runs one load per request at a
        # time): complete_load undoes exactly that, whatever else happened to the keys since
        self._loads: dict[str, tuple[list[int], list[int], list[int]]] = {}
        # keys found bad that could not leave their tier yet (being written or read): kept
        # until they can, and a store or promotion of one completes as failed
        self._bad_cpu: set[int] = set()
        self._bad_disk: set[int] = set()
        self._bad_shared: set[int] = set()
        self._late_reads: set[int] = set()  # promoted keys whose slots must be held
        self.room = PromotionRoom(cpu)  # the CPU slots a hit's load needs
        self.metrics = TierMetrics()

    # ---- lookups and loads -------------------------------------------------------------------

    def _tiers(self) -> list[tuple[str, Directory, set[int]]]:
        """Each tier this engine has: its name, directory and bad chunks waiting to leave."""
        found = [("cpu", self.cpu, self._bad_cpu)]
        if self.disk is not None:
            found.append(("disk", self.disk, self._bad_disk))
        if self.shared is not None:
            found.append(("shared", self.shared, self._bad_shared))
        return found

    def _forget_bad(self) -> None:
        """Take the workers' new reports of bad chunks, then let go what can go."""
        counts = self.metrics.bad
        tiers = self._tiers()
        for marker, key in self.bad_keys.take():
            if marker == SHARED_TIER:  # a put failed: the store is full or not answering
                self._pause_shared("a publish failed")
            elif marker == HELD_SLOT:
                self._late_reads.add(key)
            for name, tier, pending in tiers:
                if name not in _LEAVES.get(marker, ()):
                    continue
                if name == "shared":
                    self._shunned[key] = self._step + self.retry_steps
                # a chunk once readable, counted once: a store or promotion still writing
                # it is a failed store (counted as that), not a bad chunk
                if tier.is_readable(key) and key not in pending:
                    counts[name] = counts.get(name, 0) + 1
                pending.add(key)
        self._discard_bad()

    def _discard_bad(self) -> None:
        """Bad chunks nobody reads or writes any more leave their tier."""
        for _, tier, bad in self._tiers():
            if not bad:
                continue
            tier.discard(bad)
            # what left (or was never there) is done with; the rest waits for its readers
            bad.intersection_update(k for k in bad if k in tier)

    def _shared_usable(self) -> bool:
        return self.shared is not None and self._step >= self._shared_paused_until

    def _pause_shared(self, why: str) -> None:
        if self._step >= self._shared_paused_until:
            log.warning("raykv: the shared tier pauses for %d steps: %s", self.retry_steps, why)
        self._shared_paused_until = self._step + self.retry_steps

    def _find_in_store(self, key: int) -> bool:
        """Whether another engine published ``key`` (every rank's part is in the store); if so
        the shared tier's index takes it in."""
        if self.store is None or self.shared is None or key in self._absent:
            return False
        if self._shunned.get(key, -1) > self._step:
            return False
        if not self._shared_usable():
            return False
        try:
            there = self.store.present([key])[0]
        except SharedStoreError as exc:
            self._pause_shared(f"the store did not say what it holds ({exc})")
            return False
        if not there:
            self._absent.add(key)
            return False
        plan = self.shared.prepare_store([key], admit_all=True)
        if plan is None or not plan.keys:
            return False
        self.shared.complete_store(plan.keys, success=True)
        self.metrics.found += 1
        return True

    def _epoch(self) -> int:
        """The namespace epoch a job is made in: a worker moves its chunks below the CPU tier
        only under that epoch's engines (a job made before a reset never writes into, or reads
        from, the namespace after it)."""
        return self.namespace.epoch if self.namespace is not None else 0

    def _agreed(self) -> bool:
        """Whether the tiers below the CPU tier are in use under an agreed namespace (asked of
        the workers' files at most once a step until they are)."""
        agreement = self.namespace
        if agreement is None or self.disk is not None or self.shared is not None:
            return True
        if self._agreed_step == self._step:
            return False
        self._agreed_step = self._step
        (disk, shared), store = self._built_tiers, self._store_view
        try:
            parts = agreement.poll()
            if parts is None:
                return False
            found = agreement.open_tiers(parts, store, agreement.disk_roots)
        except (OSError, SharedStoreError) as exc:
            log.error("raykv: the disk and shared tiers stay out of use: %s", exc)
            agreement.parts = None  # composed again, and tried again, next step
            return False
        if disk is not None:
            disk.adopt(found)
        self.disk, self.shared, self.store = disk, shared, store
        return True

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = raykv_key(key)
        # every tier counts the lookup (its frequency filter admits on asks, hits or not)
        found = self.cpu.lookup(k)
        if found == MISS and not self._agreed():
            # the workers are agreeing on the namespace (a step or two): ask again rather
            # than compute what the disk or the store may hold
            waiting = self.namespace is not None and self.namespace.waiting()
            return LookupResult.RETRY if waiting else LookupResult.MISS
        if found == MISS and self.disk is not None:
            found = self.disk.lookup(k)
        # a paused shared tier offers nothing: its store failed, and a load from it would fail
        # too (vLLM then recomputes the whole prompt, its GPU prefix-cache hit included)
        if found == MISS and self.shared is not None and self._shared_usable():
            found = self.shared.lookup(k)
            if found == MISS and self._find_in_store(k):
                found = HIT
        # a hit past where loading stops paying misses, as does a key being written there (a
        # pending one would hold the request back for a load it will not take)
        choice = self.choice
        asks = choice is not None and (found != HIT_PENDING or choice.deciding(req_context.req_id))
        if asks and self._beyond_choice(key, req_context):
            return LookupResult.MISS
        if found != HIT:
            return LookupResult.HIT_PENDING if found == HIT_PENDING else LookupResult.MISS
        result = self.room.offer(k, req_context.req_id)
        if result == LookupResult.MISS and choice is not None:
            # no room to load it: the request computes from here, whatever the choice priced
            position = req_context.get_offload_key_position(key)
            if position is not None:
                choice.cut(req_context.req_id, position - choice.chunk_tokens)
        return result

    def _beyond_choice(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether ``key`` lies beyond where loading stops being faster than recomputing
        (``worth.py``; asked at a miss too: the request's recompute is measured from it)."""
        assert self.choice is not None
        position = req_context.get_offload_key_position(key)
        # vLLM's chunk boundaries of the request, as its scheduler made its keys
        known = getattr(req_context, "_offload_key_positions", None)
        if position is None or not isinstance(known, dict):
            return False
        chunk = self.choice.chunk_tokens
        group = key[-4:]  # this key's KV group's chunk boundaries only, whole chunks only
        end = self.choice.limit(
            req_context.req_id,
            position,
            lambda: sorted(
                (end, name)
                for name, end in known.items()
                if name[-4:] == group and end % chunk == 0
            ),
            self._ready_tier,
        )
        return end is not None and position > end

    def _ready_tier(self, key: OffloadKey) -> str | None:
        """The tier that holds ``key`` ready to load (the CPU tier first), or None."""
        k = raykv_key(key)
        if self.cpu.is_readable(k):
            return "cpu"
        if self.disk is not None and self.disk.is_readable(k):
            return "disk"
        if (
            self.shared is not None
            and self._shared_usable()
            and (self.shared.is_readable(k) or self._find_in_store(k))
        ):
            return "shared"
        return None

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> ChunkLoad:
        ks = self._named(keys)  # a promotion's BlockStored event names them
        cpu, disk, shared = self.cpu, self.disk, self.shared
        in_cpu = [k for k in ks if cpu.is_readable(k)]
        below = [k for k in ks if not cpu.is_readable(k)]
        on_disk = [k for k in below if disk is not None and disk.is_readable(k)]
        taken = set(on_disk)
        in_store = [
            k for k in below if k not in taken and shared is not None and shared.is_readable(k)
        ]
        slot_of: dict[int, int] = dict(zip(in_cpu, cpu.prepare_load(in_cpu), strict=True))
        refused = False
        if below:
            plan = None
            if len(on_disk) + len(in_store) == len(below):
                plan = cpu.prepare_store(below, admit_all=True, keep=in_cpu)
            if plan is None or len(plan.keys) != len(below):
                # no CPU room for the promotion (or the chunks left their tier since the
                # lookup): the job fails, and vLLM recomputes
                refused = True
                self.metrics.refused += 1
                if plan is not None:
                    cpu.complete_store(plan.keys, success=False)
                cpu.complete_load(in_cpu)
                in_cpu, on_disk, in_store = [], [], []
            else:
                if disk is not None:
                    disk.prepare_load(on_disk)
                if shared is not None:
                    shared.prepare_load(in_store)
                slot_of.update(zip(plan.keys, plan.slots, strict=True))
        self._loads[req_context.req_id] = (in_cpu, on_disk, in_store)
        if self.reporter is not None and not refused:
            self._load_tokens[req_context.req_id] = _tier_tokens(
                self.tokens_per_chunk, ks, (set(in_cpu), set(on_disk), set(in_store))
            )
        self.room.loading(req_context.req_id, refused)
        if self.choice is not None and not refused:
            ends = [req_context.get_offload_key_position(key) for key in keys]
            end = max((e for e in ends if e is not None), default=None)
            self.choice.loading(
                req_context.req_id, len(in_cpu), len(on_disk), len(in_store), end=end
            )
        from_disk, from_shared = set(on_disk), set(in_store)
        return ChunkLoad(
            keys=ks,
            slots=[slot_of.get(k, -1) for k in ks],
            from_disk=[i for i, k in enumerate(ks) if k in from_disk],
            from_shared=[i for i, k in enumerate(ks) if k in from_shared],
            check_sums=self.check_sums,
            refused=refused,
            epoch=self._epoch(),
        )

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ks = [raykv_key(key) for key in keys]
        for _, tier, _ in self._tiers():
            tier.touch(ks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._forget_bad()  # the workers named the chunks a failed load found bad first
        pinned, from_disk, from_shared = self._loads.pop(req_context.req_id, ([], [], []))
        promoted = from_disk + from_shared
        went_bad = self._bad_cpu.intersection([*pinned, *promoted])
        if self.choice is not None:
            self.choice.loaded(req_context.req_id, ok=not went_bad)
        tokens = self._load_tokens.pop(req_context.req_id, None)
        if self.reporter is not None and tokens is not None:
            self.reporter.report(LoadReport(req_context.req_id, *tokens, ok=not went_bad))
            self._reported[req_context.req_id] = True
        if promoted:
            bad = self._bad_cpu.intersection(promoted)
            good = [k for k in promoted if k not in bad]
            late = bad.intersection(self._late_reads)
            self.cpu.complete_store(good, success=True)
            # its slot holds nothing sure; where a read may still land there, not for a while
            self.cpu.complete_store(list(bad - late), success=False)
            self.cpu.complete_store(list(late), success=False, hold_s=LATE_READ_HOLD_S)
            self._bad_cpu.difference_update(bad)
            self._late_reads.difference_update(promoted)
        if from_disk:
            assert self.disk is not None
            self.disk.complete_load(from_disk)
        if from_shared:
            assert self.shared is not None
            self.shared.complete_load(from_shared)
        self.cpu.complete_load(pinned)
        self._discard_bad()  # the bad chunks this load held may go now

    # ---- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        ks = self._named(keys)
        if self.choice is not None:
            ends = [req_context.get_offload_key_position(key) for key in keys]
            end = max((e for e in ends if e), default=0)
            self.choice.stored(req_context.req_id, end, len(ks))
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
        to_shared: list[int] = []
        if self.shared is not None and plan.keys and self._shared_usable():
            new = [k for k in plan.keys if k not in self.shared]
            # the index's evictions stay in the store (it evicts on its own, and other
            # engines may read them): only this engine's index forgets them
            published = self.shared.prepare_store(new) if new else None
            if published is not None:
                chosen = set(published.keys)
                to_shared = [i for i, k in enumerate(plan.keys) if k in chosen]
                self._writing_shared.update(published.keys)
        names = self._names
        spec = ChunkStore(
            keys=list(plan.keys),
            slots=list(plan.slots),
            to_disk=to_disk,
            to_shared=to_shared,
            disk_drops=drops,
            check_sums=self.check_sums,
            epoch=self._epoch(),
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
        for tier, writing, bad in (
            (self.disk, self._writing_disk, self._bad_disk),
            (self.shared, self._writing_shared, self._bad_shared),
        ):
            written = [k for k in ks if k in writing]
            if written:
                writing.difference_update(written)
                assert tier is not None
                self._complete(tier, written, success, bad)

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

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.reporter is not None and not self._reported.pop(req_context.req_id, False):
            self.reporter.report(LoadReport(req_context.req_id, 0, 0, 0))  # loaded nothing
        self.room.finished(req_context.req_id)
        if self.choice is not None:
            self.choice.finished(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        names = self._names
        for _, tier, _ in self._tiers():
            for event in tier.take_events():
                keys = [names[k] for k in event.keys if k in names]
                if keys:
                    medium, locality, owner = _MEDIUM[event.medium]
                    stored = isinstance(event, BlockStored)
                    yield OffloadingEvent(
                        keys=keys,
                        medium=medium,
                        removed=not stored,
                        locality=locality,
                        ownership=owner,
                        # each store is removed again one day: vLLM's self-describing events
                        # keep the chunk's tokens and hashes until then
                        removal_expected=stored,
                    )

    def _named(self, keys: Collection[OffloadKey]) -> list[int]:
        """raykv's keys of ``keys``, each remembered with vLLM's name for the events."""
        ks = [raykv_key(key) for key in keys]
        self._names.update(zip(ks, keys, strict=True))
        return ks

    def _trim_names(self) -> None:
        if any(tier.events.buffered for _, tier, _ in self._tiers()):
            return  # an eviction not yet taken still needs its key's name
        # names of keys no tier holds any more are dropped once the map outgrows the tiers
        # (once a step, whether or not vLLM takes events: not while events wait to be taken)
        tiers = [tier for _, tier, _ in self._tiers()]
        if len(self._names) > 2 * sum(tier.capacity for tier in tiers):
            self._names = {k: v for k, v in self._names.items() if any(k in t for t in tiers)}

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._agreed()
        self._forget_bad()  # once a step: the lookups of the next step see the bad chunks gone
        self._trim_names()
        self._step += 1
        self.room.step_ended()
        if self.choice is not None:
            self.choice.schedule_ended()
        if self._step in self.kill_master_at:
            log.warning("raykv: fault: killing the shared tier's embedded master")
            kill_embedded(self.bad_keys.directory)
        if self.shared is not None and len(self._shunned) > self.shared.capacity:
            self._shunned = {k: s for k, s in self._shunned.items() if s > self._step}
        self._absent.clear()  # the next step asks the store again: another engine may publish

    def has_pending_work(self) -> bool:
        return False

    def get_stats(self) -> OffloadingConnectorStats | None:
        skipped = self.choice.skipped if self.choice is not None else None
        return self.metrics.report({name: tier.stats() for name, tier, _ in self._tiers()}, skipped)

    def shutdown(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
        if self._store_view is not None:
            self._store_view.close()
        self.store = None
        stop_embedded(self.bad_keys.directory)  # where this process started the master
        if self.namespace is not None:
            self.namespace.board.remove()
        self.bad_keys.remove()

    def reset_cache(self) -> None:
        # vLLM drops the completions of every job started before a reset: every tier forgets
        # what was in flight (a disk key left "being written" would be HIT_PENDING for ever),
        # and what it held (a reset may follow new weights); files left behind are written
        # over as their keys come again, and the store's parts stay for the other engines
        for _, tier, bad in self._tiers():
            tier.reset()
            bad.clear()
        for tier in self._built_tiers:  # built, not in use yet: nothing in them must outlive it
            if tier is not None and tier is not self.disk and tier is not self.shared:
                tier.reset()
        self._writing_disk.clear()
        self._writing_shared.clear()
        self._late_reads.clear()
        self._loads.clear()
        self._absent.clear()
        self._shunned.clear()
        if self.namespace is not None:
            # the weights may be new: the namespace is agreed on again, from what the workers
            # hold now (the old one's files and parts stay, for the engines still on it)
            self.disk = self.shared = self.store = None
            self.namespace.next_epoch()
            self._agreed_step = -1


def _tier_tokens(
    tokens_per_chunk: int, ks: list[int], tiers: tuple[set[int], set[int], set[int]]
) -> tuple[int, int, int]:
    """Prompt tokens a load of chunks ``ks`` takes from the CPU tier, the disk and the store
    (a first chunk that overlaps the GPU hit counts whole here: the replica cuts it)."""
    counts = [0, 0, 0]
    for k in ks:
        for tier, held in enumerate(tiers):
            if k in held:
                counts[tier] += tokens_per_chunk
                break
    return counts[0], counts[1], counts[2]
