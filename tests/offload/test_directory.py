"""The directory's contract: states, lookups, stores, loads, eviction, filter, events, reset."""

from __future__ import annotations

import pytest

from raykv.offload import (
    HIT,
    HIT_PENDING,
    MISS,
    BlockStored,
    Directory,
    StorePlan,
)


def stored(directory: Directory, keys: list[int]) -> StorePlan:
    """prepare + complete at once; fails the test if the store cannot be planned."""
    plan = directory.prepare_store(keys)
    assert plan is not None
    directory.complete_store(plan.keys)
    return plan


# ---- lookup and states -------------------------------------------------------------------------


def test_lookup_reports_miss_pending_hit() -> None:
    d = Directory(4)
    assert d.lookup(1) is MISS
    plan = d.prepare_store([1])
    assert plan is not None and plan.keys == [1]
    assert d.lookup(1) is HIT_PENDING
    d.complete_store([1])
    assert d.lookup(1) is HIT
    s = d.stats()
    assert (s.lookups, s.misses, s.hit_pending, s.hits) == (3, 1, 1, 1)


def test_match_prefix_scans_past_pending_and_stops_at_miss() -> None:
    d = Directory(8)
    stored(d, [1, 2])
    assert d.prepare_store([3]) is not None  # 3 is being written
    stored(d, [4])
    assert d.match_prefix([1, 2, 3, 4, 5, 6]) == (4, 1)
    assert d.match_prefix([9, 1]) == (0, 0)
    assert d.match_prefix([]) == (0, 0)
    # examined keys: 5 (1,2,3,4 and the miss 5) + 1 + 0
    assert d.stats().lookups == 6


def test_prepare_load_requires_ready_keys_and_changes_nothing_on_error() -> None:
    d = Directory(4)
    stored(d, [1])
    assert d.prepare_store([2]) is not None
    with pytest.raises(KeyError, match="still being written"):
        d.prepare_load([1, 2])
    with pytest.raises(KeyError, match="absent"):
        d.prepare_load([1, 3])
    assert d.stats().reading == 0  # key 1 was not pinned by the failed calls
    assert d.prepare_load([1]) == [d.slot_of(1)]


def test_keys_being_read_are_not_evictable_until_last_reader_leaves() -> None:
    d = Directory(2)
    stored(d, [1, 2])
    d.prepare_load([1])
    d.prepare_load([1])  # two concurrent loads of one chunk
    d.prepare_load([2])
    assert d.prepare_store([3]) is None  # nothing evictable
    d.complete_load([1])
    assert d.prepare_store([3]) is None  # 1 still has a reader
    d.complete_load([2])
    plan = d.prepare_store([3])
    assert plan is not None and plan.evicted == [2]
    d.complete_load([1])
    with pytest.raises(KeyError, match="not being read"):
        d.complete_load([1])
    d.check_invariants()


# ---- stores ------------------------------------------------------------------------------------


def test_slot_order_example() -> None:
    """Fresh slots in order, then freed ones last-freed first (notes 3.5's example)."""
    d = Directory(4, "lru")
    assert stored(d, [1, 2]).slots == [0, 1]
    d.touch([2])  # make 1 the least recent (a prefix's head is otherwise kept longest)
    plan = stored(d, [3, 4, 5])
    assert plan.evicted == [1] and plan.slots == [2, 3, 0]
    for key in (3, 4, 5):  # make the LRU order 2, 3, 4, 5
        d.touch([key])
    plan = stored(d, [6, 7, 8])
    assert plan.evicted == [2, 3, 4]
    assert plan.slots == [3, 2, 1]
    d.check_invariants()


def test_already_stored_sibling_is_never_evicted_to_make_room() -> None:
    """Regression: the protected set includes keys dropped as already present."""
    d = Directory(2, "lru")
    stored(d, [1])
    stored(d, [2])
    d.touch([2])  # LRU order: 1 (oldest), 2
    plan = stored(d, [1, 3])
    assert plan.keys == [3]
    assert plan.evicted == [2]
    assert d.is_readable(1) and d.is_readable(3) and 2 not in d


def test_empty_plan_is_not_a_failure() -> None:
    d = Directory(2)
    stored(d, [1, 2])
    plan = d.prepare_store([1, 2])
    assert plan is not None and (plan.keys, plan.slots, plan.evicted) == ([], [], [])
    assert d.stats().keys_deduped == 2


def test_keys_being_written_are_deduplicated_not_stored_twice() -> None:
    d = Directory(4)
    first = d.prepare_store([1, 2])
    second = d.prepare_store([2, 3, 3])
    assert first is not None and second is not None
    assert second.keys == [3]
    assert len(d) == 3
    d.check_invariants()


def test_eviction_is_atomic_when_room_cannot_be_made() -> None:
    d = Directory(3, "lru")
    stored(d, [1])
    assert d.prepare_store([2, 3]) is not None  # being written: not evictable
    before = (sorted(d.readable_keys()), len(d), d.stats().evictions)
    assert d.prepare_store([4, 5]) is None  # would need 2 victims, only key 1 is evictable
    assert (sorted(d.readable_keys()), len(d), d.stats().evictions) == before
    assert d.stats().allocation_failures == 1
    d.check_invariants()


def test_eviction_fails_atomically_when_evictable_keys_are_protected() -> None:
    d = Directory(2, "lru")
    stored(d, [1, 2])
    assert d.prepare_store([1, 2, 3]) is None  # both candidates are inputs, so protected
    assert d.readable_keys() == {1, 2}


def test_failed_store_frees_slots_and_never_becomes_readable() -> None:
    d = Directory(2)
    plan = d.prepare_store([1, 2])
    assert plan is not None
    d.take_events()
    d.complete_store([1, 2], success=False)
    assert len(d) == 0 and d.lookup(1) is MISS
    assert d.take_events() == []  # never announced, so nothing to remove either
    assert d.stats().store_failures == 2
    assert stored(d, [3, 4]).slots == [1, 0]  # the freed slots are reused
    d.check_invariants()


def test_complete_store_leaves_ready_and_unknown_keys_alone() -> None:
    d = Directory(4)
    stored(d, [1])
    d.complete_store([1, 99])  # already ready, unknown: no change
    d.complete_store([1], success=False)  # must not drop a ready key
    assert d.is_readable(1)


def test_frequency_filter_stores_only_keys_looked_up_often_enough() -> None:
    d = Directory(4, store_threshold=2)
    d.lookup(1)
    d.lookup(2)
    d.lookup(2)
    plan = d.prepare_store([1, 2])
    assert plan is not None and plan.keys == [2]
    assert d.stats().keys_filtered == 1
    d.match_prefix([1])  # second lookup of 1
    plan = d.prepare_store([1])
    assert plan is not None and plan.keys == [1]


def test_frequency_tracker_is_bounded() -> None:
    d = Directory(4, store_threshold=2, max_tracker_size=2)
    for key in (1, 1, 2, 3):  # key 1's count is forgotten once 2 and 3 push it out
        d.lookup(key)
    plan = d.prepare_store([1])
    assert plan is not None and plan.keys == []


# ---- events and reset --------------------------------------------------------------------------


def test_events_on_store_eviction_and_reset_with_sequence_numbers() -> None:
    d = Directory(2, "lru")
    stored(d, [1, 2])
    stored(d, [3])
    assert d.prepare_store([4]) is not None  # pending at reset: never announced
    d.reset()
    events = d.take_events()
    kinds = [(type(e).__name__, e.keys) for e in events]
    assert kinds == [
        ("BlockStored", (1, 2)),
        ("BlockRemoved", (2,)),  # LRU keeps the prefix head and gives up its tail first
        ("BlockStored", (3,)),
        # room for 4, then the reset: only announced keys, not 4 (still being written); one
        # event, as removals one after the other join
        ("BlockRemoved", (1, 3)),
    ]
    assert [e.seq for e in events] == list(range(len(events)))
    assert all(e.medium == "CPU" for e in events)
    assert isinstance(events[0], BlockStored)


def test_reset_forgets_everything() -> None:
    d = Directory(4, store_threshold=2)
    d.lookup(1)
    d.lookup(1)
    stored(d, [1])
    d.prepare_load([1])
    d.reset()
    assert len(d) == 0 and not d.has_pending_work()
    assert d.prepare_store([1]) == StorePlan([], [], [])  # lookup counts were forgotten too
    d.check_invariants()


def test_has_pending_work_tracks_writes_and_reads() -> None:
    d = Directory(2)
    assert not d.has_pending_work()
    assert d.prepare_store([1]) is not None
    assert d.has_pending_work()
    d.complete_store([1])
    assert not d.has_pending_work()
    d.prepare_load([1])
    assert d.has_pending_work()
    d.complete_load([1])
    assert not d.has_pending_work()


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        Directory(2, "nope")


def test_custom_policy_by_import_path() -> None:
    d = Directory(2, "raykv.offload.policies.lru:LRUPolicy")
    assert d.stats().policy == "lru"
    with pytest.raises(ValueError, match="not a CachePolicy"):
        Directory(2, "raykv.offload.directory:Directory")
    with pytest.raises(ValueError, match="cannot load policy"):
        Directory(2, "raykv.no_such_module:Thing")


def test_stats_gauges() -> None:
    d = Directory(4)
    stored(d, [1, 2])
    assert d.prepare_store([3]) is not None
    d.prepare_load([1])
    s = d.stats()
    assert (s.used, s.ready_idle, s.writing, s.reading) == (3, 1, 1, 1)
    assert s.usage == 0.75
    assert s.as_dict()["policy"] == d.stats().policy


# ---- leaving for the tier below, and a warm start's adoption -------------------------------------


def test_a_chunk_leaving_stays_readable_until_its_copy_ends_and_its_last_reader_leaves() -> None:
    d = Directory(4, "lru", events=True)
    stored(d, [1, 2, 3])
    d.take_events()
    read, gone = d.start_leaving(2)  # the coldest two, in the policy's order
    assert d.is_readable(read) and d.num_leaving == 2 and d.num_free == 1
    assert d.prepare_load([read]) == [d.slot_of(read)]  # a load may still read it
    d.finish_leaving([read, gone])  # the copies ended: one goes, one waits for its reader
    assert gone not in d and read in d and d.num_free == 2
    d.check_invariants()
    d.complete_load([read])
    assert read not in d and d.num_free == 3 and d.num_leaving == 0
    assert [k for e in d.take_events() for k in e.keys] == [gone, read]  # removed, in order
    assert d.stats().left == 2
    d.check_invariants()


def test_leaving_never_takes_a_chunk_being_read_or_written() -> None:
    d = Directory(4, "lru")
    stored(d, [1, 2])
    d.prepare_load([1])
    assert d.prepare_store([3]) is not None  # 3 being written
    assert d.start_leaving(4) == [2]
    with pytest.raises(KeyError, match="not leaving"):
        d.finish_leaving([1])
    d.check_invariants()


def test_adopt_takes_the_newest_ready_chunks_up_to_the_free_slots_and_announces_them() -> None:
    """Keys come oldest first (a warm start's files by age): past the room, the newest stay."""
    d = Directory(3, "lru", medium="DISK")
    stored(d, [9])
    d.take_events()
    assert d.adopt([1, 9, 2, 3, 4]) == [3, 4]
    assert all(d.is_readable(k) for k in (3, 4, 9)) and 1 not in d and 2 not in d
    (event,) = d.take_events()
    assert event.keys == (3, 4) and event.medium == "DISK"
    assert d.start_leaving(1) == [9]  # the oldest goes first (the tier's own chunk was first)
    d.check_invariants()


def test_a_promotion_bypasses_the_frequency_filter() -> None:
    d = Directory(4, "lru", store_threshold=3)
    plan = d.prepare_store([5])
    assert plan is not None and plan.keys == []  # never looked up: filtered
    plan = d.prepare_store([5], admit_all=True)
    assert plan is not None and plan.keys == [5]
