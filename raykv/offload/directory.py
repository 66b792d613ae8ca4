"""The CPU-tier directory: which chunks the CPU tier holds, in which slot, in which state.

Plain Python with no knowledge of GPU blocks or jobs. One directory serves all tensor-parallel
ranks: a slot id names the same position in every rank's CPU pool shard.

Every resident key has a slot. Its state is one of:

- being written: not readable (``lookup`` answers HIT_PENDING), not evictable;
- ready: readable and evictable;
- being read by n loads: readable, not evictable.

Keys being written sit in the ``_writing`` set and keys being read in the ``_readers`` table (key
-> reader count); a resident key in neither is ready. Most keys are ready most of the time, so the
common paths touch one table, and the busy ones use C-level set operations in bulk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raykv.offload.events import MEDIUM_CPU, EventLog, KVEvent
from raykv.offload.filter import FrequencyFilter
from raykv.offload.policies import CachePolicy, make_policy
from raykv.offload.records import (
    HIT,
    HIT_PENDING,
    MISS,
    DirectoryStats,
    LookupResult,
    StorePlan,
)
from raykv.offload.slots import SlotAllocator

__all__ = ["HIT", "HIT_PENDING", "MISS", "Directory", "DirectoryStats", "LookupResult", "StorePlan"]

_NOTHING: frozenset[int] = frozenset()


class Directory:
    """The CPU tier's directory of chunks (the "offloading manager").

    Args:
        num_slots: CPU slots, each holding one chunk of one KV group on every rank.
        policy: a registered policy name, ``module:Class``, or a ready ``CachePolicy``.
        store_threshold: when >= 2, store only keys looked up at least this many times.
        max_tracker_size: how many keys the lookup-frequency tracker remembers.
        events: record ``BlockStored``/``BlockRemoved`` events for ``take_events``; or the
            engine's ``EventLog`` to record into, beside the GPU prefix cache's.
        medium: the tier's name in those events (``CPU``, ``DISK``).

    Keys *leaving* (``start_leaving``) were given up by the policy to be copied to the tier
    below: they stay readable, and a load may still read them, until ``finish_leaving`` says
    the copy ended and their last reader has left; then their slots are free.
    """

    def __init__(
        self,
        num_slots: int,
        policy: str | CachePolicy = "lru",
        *,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        events: bool | EventLog = True,
        medium: str = MEDIUM_CPU,
    ) -> None:
        self.medium = medium
        self._slots = SlotAllocator(num_slots)
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self._filter = (
            FrequencyFilter(store_threshold, max_tracker_size) if store_threshold >= 2 else None
        )
        self._events = events if isinstance(events, EventLog) else EventLog(events)
        self._slot: dict[int, int] = {}  # every resident key -> its slot
        self._writing: set[int] = set()
        self._readers: dict[int, int] = {}
        self._leaving: set[int] = set()  # given up by the policy, copied below; being read
        self._admits = type(self.policy).admit is not CachePolicy.admit
        self._lookups = self._hits = self._pending = 0
        self._offered = self._stored = self._deduped = self._filtered = self._not_admitted = 0
        self._evictions = self._alloc_failures = self._store_failures = self._loads = 0
        self._left = 0  # of the evictions, chunks given up to the tier below

    # ---- queries ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def num_free(self) -> int:
        """Slots free now (not counting those that keys leaving will free)."""
        return self._slots.num_free

    @property
    def num_pinned(self) -> int:
        """Keys being written or read (not evictable)."""
        return len(self._writing) + len(self._readers)

    @property
    def num_held(self) -> int:
        """Slots out of use for a while (``complete_store``'s ``hold_s``)."""
        return self._slots.num_held

    def room(self, keep: Iterable[int] = ()) -> int:
        """At most how many new keys a store could take now: free slots, and ready keys
        nobody writes or reads outside ``keep`` (what eviction may take, if the policy does)."""
        busy = len(self._writing.union(self._readers))
        kept = sum(1 for k in set(keep) if self.is_idle(k))
        return self._slots.num_free + len(self._slot) - busy - kept

    def room_beside(self, keep: Iterable[int] = ()) -> int:
        """At most how many new keys the tier could ever hold at once beside those of ``keep``
        it holds: its slots, less those out of use for a while and ``keep``'s (a promotion
        larger than this never fits, however much is evicted)."""
        beside = sum(1 for k in set(keep) if k in self._slot)
        return self._slots.capacity - self._slots.num_held - beside

    @property
    def num_leaving(self) -> int:
        return len(self._leaving)

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: int) -> bool:
        return key in self._slot

    def lookup(self, key: int) -> LookupResult:
        """HIT if readable, HIT_PENDING if still being written, MISS if absent. Counts towards
        the frequency filter."""
        self._lookups += 1
        if self._filter is not None:
            self._filter.bump(key)
        if key not in self._slot:
            return MISS
        if key in self._writing:
            self._pending += 1
            return HIT_PENDING
        self._hits += 1
        return HIT

    def match_prefix(self, keys: Sequence[int], *, count: bool = True) -> tuple[int, int]:
        """Look keys up in order until the first MISS. The scan goes on past keys still being
        written, so one call tells a caller the whole reachable prefix.

        Returns ``(present, pending)``: how many leading keys are present, and how many of those
        are still being written (the caller must wait for them before loading). Each key examined
        counts as one ``lookup`` (towards the hit rates and the frequency filter) unless
        ``count`` is false: a peek that decides nothing about loading or storing."""
        slot, writing = self._slot, self._writing
        present = pending = 0
        if writing:
            for key in keys:
                if key not in slot:
                    break
                present += 1
                if key in writing:
                    pending += 1
        else:  # nothing in flight: no key can be pending
            for key in keys:
                if key not in slot:
                    break
                present += 1
        if not count:
            return present, pending
        examined = present + (present < len(keys))
        self._lookups += examined
        self._hits += present - pending
        self._pending += pending
        if self._filter is not None:
            bump = self._filter.bump
            for key in keys[:examined]:
                bump(key)
        return present, pending

    def count_lookups(self, keys: Iterable[int]) -> None:
        """Count keys a caller examined by membership alone (``in``) as looked up, as ``lookup``
        would: towards the frequency filter and the lookup counters. A sliding-window group's
        check of the window before a boundary is such a lookup."""
        slot, writing = self._slot, self._writing
        bump = self._filter.bump if self._filter is not None else None
        for key in keys:
            self._lookups += 1
            if bump is not None:
                bump(key)
            if key in slot:
                if key in writing:
                    self._pending += 1
                else:
                    self._hits += 1

    def note_asked(self, keys: Iterable[int]) -> None:
        """Count these keys as asked for towards the frequency filter only (a tier above
        served them; whether this tier admits them later depends on how often they were
        asked for, wherever they were found)."""
        if self._filter is not None:
            bump = self._filter.bump
            for key in keys:
                bump(key)

    def is_readable(self, key: int) -> bool:
        """True if the key is ready; unlike ``lookup`` it counts nothing."""
        return key in self._slot and key not in self._writing

    def is_idle(self, key: int) -> bool:
        """True if the key is ready and nobody writes or reads it (an eviction may take it)."""
        return key in self._slot and key not in self._writing and key not in self._readers

    def slot_of(self, key: int) -> int:
        return self._slot[key]

    def readable_keys(self) -> set[int]:
        return self._slot.keys() - self._writing

    # ---- loads -----------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[int]) -> list[int]:
        """Pin the keys for reading (not evictable until ``complete_load``) and return their
        slots. Every key must be ready; otherwise nothing changes and KeyError names the key."""
        slot, writing, readers = self._slot, self._writing, self._readers
        for key in keys:
            if key not in slot or key in writing:
                state = "absent" if key not in slot else "still being written"
                raise KeyError(f"cannot load key {key:#x}: {state}")
        first: list[int] = []
        for key in keys:
            n = readers.get(key, 0)
            if n == 0:
                first.append(key)
            readers[key] = n + 1
        if first:
            self.policy.pin(first)
        self._loads += len(keys)
        return [slot[k] for k in keys]

    def complete_load(self, keys: Sequence[int]) -> None:
        """Release the read pins taken by ``prepare_load``."""
        readers = self._readers
        for key in keys:
            if key not in readers:
                raise KeyError(f"complete_load for key {key:#x} that is not being read")
        self._unread(keys)

    def _unread(self, keys: Sequence[int]) -> None:
        """One reader of each key left; a key's last one unpins it, or frees it if leaving."""
        readers, leaving = self._readers, self._leaving
        last: list[int] = []
        gone: list[int] = []
        for key in keys:
            n = readers[key] - 1
            if n:
                readers[key] = n
                continue
            del readers[key]
            if leaving and key in leaving:
                leaving.discard(key)
                gone.append(key)
            else:
                last.append(key)
        if last:
            self.policy.unpin(last)
        if gone:
            slot_pop = self._slot.pop
            self._slots.release([slot_pop(k) for k in gone])
            self._events.removed(gone, self.medium)

    # ---- leaving for the tier below ---------------------------------------------------------

    def start_leaving(self, n: int) -> list[int]:
        """Up to ``n`` ready chunks nobody reads, the coldest by the policy, given up to be
        copied to the tier below: each stays readable (a load may still read it) and holds its
        slot until ``finish_leaving``. Returns them (fewer when fewer are idle)."""
        idle = len(self._slot) - len(self._writing) - len(self._readers)
        n = min(n, idle)
        if n <= 0:
            return []
        victims = self.policy.evict(n, _NOTHING) or []
        for key in victims:
            self._readers[key] = 1
        self._leaving.update(victims)
        self._evictions += len(victims)
        self._left += len(victims)
        return victims

    def finish_leaving(self, keys: Sequence[int]) -> None:
        """The copies of these leaving keys ended (done or failed): each one's slot is freed as
        soon as no load reads it any more."""
        leaving = self._leaving
        for key in keys:
            if key not in leaving:
                raise KeyError(f"finish_leaving for key {key:#x} that is not leaving")
        self._unread(keys)

    def adopt(self, keys: Iterable[int]) -> list[int]:
        """Take in ready chunks found where this tier keeps them (a warm restart), oldest
        first: as many as there are free slots, the newest where there are more (the policy
        then evicts the oldest of them first); returns those taken (one ``BlockStored``
        announces them)."""
        fresh = [k for k in dict.fromkeys(keys) if k not in self._slot]
        fresh = fresh[max(0, len(fresh) - self._slots.num_free) :]
        if not fresh:
            return []
        slots = self._slots.allocate(len(fresh))
        self._slot.update(zip(fresh, slots, strict=True))
        self.policy.insert(fresh)
        self.policy.ready(fresh)
        self._stored += len(fresh)
        self._events.stored(fresh, self.medium)
        return fresh

    def touch(self, keys: Sequence[int]) -> None:
        """Mark keys (in prefix order) as used now; absent keys are ignored."""
        self.policy.touch(keys)

    # ---- stores ----------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[int], admit_all: bool = False, keep: Iterable[int] = ()
    ) -> StorePlan | None:
        """Allocate slots for the keys (prefix order) that need storing.

        Keys already present (ready or not) are dropped, as are keys the frequency filter or the
        policy's admission rejects (unless ``admit_all``: a promotion from the tier below, which
        a lookup asked for). Every input key, including the dropped ones, and every key of
        ``keep`` (what the caller is about to load beside them) is protected from the eviction
        that makes room. Eviction is atomic: returns None, with nothing changed, when
        enough room cannot be made. The new keys are being written until ``complete_store``.
        """
        self._offered += len(keys)
        slot = self._slot
        candidates: Sequence[int] = keys
        if self._filter is not None and not admit_all:
            candidates = self._filter.passes(candidates)
            self._filtered += len(keys) - len(candidates)
        missing = [k for k in candidates if k not in slot]
        if len(missing) > 1:
            missing = list(dict.fromkeys(missing))  # a key listed twice is stored once
        self._deduped += len(candidates) - len(missing)
        if not missing:
            return StorePlan([], [], [])
        free = self._slots.num_free
        protected = set(keys).union(keep) if len(missing) > free else _NOTHING
        to_store = missing
        if self._admits and not admit_all:
            to_store = self.policy.admit(missing, free, protected)
            self._not_admitted += len(missing) - len(to_store)
            if not to_store:
                return StorePlan([], [], [])
        need = len(to_store) - free
        evicted: list[int] = []
        if need > 0:
            idle = len(slot) - len(self._writing) - len(self._readers)
            victims = self.policy.evict(need, protected) if need <= idle else None
            if victims is None:
                self._alloc_failures += 1
                return None
            slot_pop = slot.pop
            self._slots.release([slot_pop(k) for k in victims])
            self._evictions += len(victims)
            self._events.removed(victims, self.medium)
            evicted = victims
        slots = self._slots.allocate(len(to_store))
        slot.update(zip(to_store, slots, strict=True))
        self._writing.update(to_store)
        self._stored += len(to_store)
        self.policy.insert(to_store)
        return StorePlan(to_store, slots, evicted)

    def complete_store(
        self, keys: Iterable[int], success: bool = True, hold_s: float = 0.0
    ) -> None:
        """Finish writes started by ``prepare_store``. On success the keys become readable and
        evictable (one ``BlockStored`` event); on failure they are dropped and their slots freed,
        never having been readable (``hold_s``: free only that many seconds from now, for a
        write that failed but may still land). Keys not being written are left alone."""
        writing = self._writing
        keys = list(keys)
        if writing.issuperset(keys):  # the usual case: one job's keys, all still being written
            before = len(writing)
            writing.difference_update(keys)
            done = keys if before - len(writing) == len(keys) else list(dict.fromkeys(keys))
        else:
            done = list(dict.fromkeys(k for k in keys if k in writing))
            if not done:
                return
            writing.difference_update(done)
        if success:
            self.policy.ready(done)
            self._events.stored(done, self.medium)
        else:
            self._store_failures += len(done)
            slot_pop = self._slot.pop
            slots = [slot_pop(k) for k in done]
            if hold_s > 0:
                self._slots.hold(slots, hold_s)
            else:
                self._slots.release(slots)
            self.policy.remove(done)

    def discard(self, keys: Iterable[int]) -> None:
        """Drop readable keys nobody is reading (a chunk found corrupt): their slots are freed
        and one ``BlockRemoved`` announces them. Keys absent, being written or still read by
        another load are left alone (that load finds the corruption too)."""
        gone = [
            k
            for k in dict.fromkeys(keys)
            if k in self._slot and k not in self._writing and k not in self._readers
        ]
        if not gone:
            return
        slot_pop = self._slot.pop
        self._slots.release([slot_pop(k) for k in gone])
        self.policy.remove(gone)
        self._events.removed(gone, self.medium)

    # ---- lifecycle -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything. Announced keys get one ``BlockRemoved``. The caller guarantees no
        completion for earlier work arrives afterwards (the connector's reset epoch)."""
        writing = self._writing
        self._events.removed([k for k in self._slot if k not in writing], self.medium)
        self._slot.clear()
        writing.clear()
        self._readers.clear()
        self._leaving.clear()
        self._slots.reset()
        self.policy.clear()
        if self._filter is not None:
            self._filter.clear()

    def take_events(self) -> list[KVEvent]:
        """Drain the buffered events, oldest first."""
        return self._events.take()

    @property
    def events(self) -> EventLog:
        """The log this directory records into."""
        return self._events

    def has_pending_work(self) -> bool:
        """True while any write or read is in flight."""
        return bool(self._writing) or bool(self._readers)

    def stats(self) -> DirectoryStats:
        writing, reading = len(self._writing), len(self._readers)
        return DirectoryStats(
            capacity=self.capacity,
            used=len(self._slot),
            ready_idle=len(self._slot) - writing - reading,
            writing=writing,
            reading=reading,
            lookups=self._lookups,
            hits=self._hits,
            hit_pending=self._pending,
            misses=self._lookups - self._hits - self._pending,
            keys_offered=self._offered,
            keys_stored=self._stored,
            keys_deduped=self._deduped,
            keys_filtered=self._filtered,
            keys_not_admitted=self._not_admitted,
            evictions=self._evictions,
            allocation_failures=self._alloc_failures,
            store_failures=self._store_failures,
            loads=self._loads,
            policy=self.policy.name or type(self.policy).__name__,
            leaving=len(self._leaving),
            left=self._left,
            held=self.num_held,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the directory's books disagree (used by tests and fuzzers)."""
        slot, writing, readers = self._slot, self._writing, self._readers
        assert writing <= slot.keys(), "a key being written has no slot"
        assert readers.keys() <= slot.keys(), "a key being read has no slot"
        assert not writing & readers.keys(), "a key is written and read at once"
        assert all(n > 0 for n in readers.values()), "a reader count is not positive"
        assert self._leaving <= readers.keys(), "a key leaving is not held by its copy or a load"
        slots = list(slot.values())
        assert len(set(slots)) == len(slots), "a slot is owned by two keys"
        assert all(0 <= s < self.capacity for s in slots), "slot id out of range"
        free, held = self._slots.free_slots(), self._slots.held_slots()
        assert len(slot) + len(free) + len(held) == self.capacity, "slots leaked or double-freed"
        assert not free & set(slots), "a slot is both free and owned"
        assert not held & (free | set(slots)), "a held slot is free or owned"
