"""Slot allocator, key packing and the event log."""

from __future__ import annotations

import pytest

from raykv.offload import BlockRemoved, BlockStored, EventLog, key_group, key_hash, make_key
from raykv.offload.slots import SlotAllocator


def test_fresh_slots_first_in_order_then_last_freed_first() -> None:
    alloc = SlotAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    alloc.release([0])
    # never-used slots are handed out before freed ones
    assert alloc.allocate(3) == [2, 3, 0]
    alloc.release([1, 2, 3])
    assert alloc.allocate(3) == [3, 2, 1]
    assert alloc.num_free == 0


def test_allocator_refuses_more_than_free_and_resets() -> None:
    alloc = SlotAllocator(2)
    alloc.allocate(2)
    with pytest.raises(RuntimeError, match="only 0 free"):
        alloc.allocate(1)
    alloc.reset()
    assert alloc.num_free == 2 and alloc.free_slots() == {0, 1}


def test_held_slots_are_free_only_after_their_time_and_stay_held_through_a_reset() -> None:
    now = [0.0]
    alloc = SlotAllocator(4, clock=lambda: now[0])
    first = alloc.allocate(3)
    alloc.hold(first[:2], 10.0)  # a failed read into them may still land
    assert alloc.num_free == 1 and alloc.num_held == 2
    alloc.reset()
    assert alloc.held_slots() == set(first[:2])
    assert sorted(alloc.allocate(2)) == [2, 3]  # never one of the held
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    now[0] = 10.0
    assert alloc.num_held == 0 and sorted(alloc.allocate(2)) == first[:2]


def test_allocator_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="positive"):
        SlotAllocator(0)


@pytest.mark.parametrize("block_hash,group", [(0, 0), (1, 255), (2**64 - 1, 7), (12345, 3)])
def test_key_roundtrip(block_hash: int, group: int) -> None:
    key = make_key(block_hash, group)
    assert isinstance(key, int)
    assert (key_hash(key), key_group(key)) == (block_hash, group)


def test_keys_of_one_prefix_differ_per_group() -> None:
    assert make_key(99, 0) != make_key(99, 1)


@pytest.mark.parametrize("block_hash,group", [(-1, 0), (1, 256), (1, -1)])
def test_key_rejects_out_of_range(block_hash: int, group: int) -> None:
    with pytest.raises(ValueError):
        make_key(block_hash, group)


def test_event_sequence_numbers_are_gapless_and_survive_take() -> None:
    log = EventLog()
    log.stored([1, 2])
    log.removed([1])
    first = log.take()
    log.stored([])  # nothing happened: no event, no sequence number used
    log.removed([2])
    second = log.take()
    assert [type(e) for e in first] == [BlockStored, BlockRemoved]
    assert [e.seq for e in first + second] == [0, 1, 2]
    assert all(e.medium == "CPU" for e in first + second)
    assert log.take() == []


def test_disabled_event_log_records_nothing() -> None:
    log = EventLog(enabled=False)
    log.stored([1])
    assert log.take() == [] and log.next_seq == 0
