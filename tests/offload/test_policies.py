"""Eviction policies: LRU, ARC and recall, driven through the CachePolicy interface."""

from __future__ import annotations

import random

import pytest

from raykv.offload import Directory
from raykv.offload.policies import (
    ARCPolicy,
    LRUPolicy,
    RecallPolicy,
    make_policy,
    policy_names,
)
from raykv.offload.policies.history import SeenFilter

NOTHING: frozenset[int] = frozenset()


def add_ready(policy, keys: list[int]) -> None:
    policy.insert(keys)
    policy.ready(keys)


def test_registry_lists_builtins() -> None:
    assert policy_names()[:3] == ["lru", "arc", "recall"]
    assert isinstance(make_policy("recall", 8), RecallPolicy)


# ---- LRU ---------------------------------------------------------------------------------------


def test_lru_ready_and_touch_keep_a_prefix_head_most_recent() -> None:
    lru = LRUPolicy(8)
    add_ready(lru, [1, 2, 3])
    assert lru.evict(1, NOTHING) == [3]  # the tail goes first
    add_ready(lru, [4])
    lru.touch([1, 2])
    # order now (oldest first): 4, 2, 1
    assert lru.evict(3, NOTHING) == [4, 2, 1]


def test_lru_busy_keys_are_not_evictable_and_return_as_most_recent() -> None:
    lru = LRUPolicy(8)
    lru.insert([1])  # being written
    add_ready(lru, [2, 3])
    lru.pin([3])
    assert lru.evict(2, NOTHING) is None
    lru.ready([1])
    lru.unpin([3])
    assert lru.evict(3, NOTHING) == [2, 1, 3]


def test_lru_evict_skips_protected_and_is_atomic() -> None:
    lru = LRUPolicy(8)
    add_ready(lru, [1])
    add_ready(lru, [2])
    assert lru.evict(1, {1}) == [2]
    assert lru.evict(2, NOTHING) is None
    assert lru.evict(1, NOTHING) == [1]
    assert lru.evict(0, NOTHING) == []


# ---- ARC ---------------------------------------------------------------------------------------


def lists(arc: ARCPolicy) -> tuple[list[int], list[int], list[int], list[int]]:
    return list(arc._t1), list(arc._t2), list(arc._b1), list(arc._b2)


def test_arc_new_keys_enter_t1() -> None:
    arc = ARCPolicy(4)
    add_ready(arc, [1, 2])
    t1, t2, _, _ = lists(arc)
    assert set(t1) == {1, 2} and t2 == []


def test_arc_touch_promotes_ready_keys_only() -> None:
    arc = ARCPolicy(4)
    add_ready(arc, [1])
    arc.insert([2])  # prepared for store, not yet written: not a second access
    arc.touch([1, 2])
    t1, t2, _, _ = lists(arc)
    assert t1 == [2] and t2 == [1]
    arc.ready([2])
    arc.touch([2])
    assert lists(arc)[1] == [1, 2]


def test_arc_touch_order_leaves_prefix_head_most_recent() -> None:
    arc = ARCPolicy(8)
    add_ready(arc, [1, 2, 3])
    arc.touch([1, 2, 3])
    assert lists(arc)[1] == [3, 2, 1]


def test_arc_keys_being_loaded_or_written_are_not_evictable() -> None:
    arc = ARCPolicy(4)
    add_ready(arc, [1, 2])
    arc.pin([1])
    arc.insert([3])
    assert arc.evict(1, NOTHING) == [2]
    assert arc.evict(1, NOTHING) is None
    arc.unpin([1])
    assert arc.evict(1, NOTHING) == [1]


def test_arc_restore_of_b1_ghost_grows_target_and_goes_to_t2() -> None:
    arc = ARCPolicy(4)
    add_ready(arc, [1, 2])
    assert arc.evict(1, NOTHING) == [2]
    assert lists(arc)[2] == [2]
    add_ready(arc, [2])
    assert arc.target == 1.0
    _t1, t2, b1, _ = lists(arc)
    assert 2 in t2 and b1 == []


def test_arc_restore_of_b2_ghost_shrinks_target() -> None:
    arc = ARCPolicy(4)
    add_ready(arc, [1])
    arc.touch([1])  # T2
    arc.target = 3.0
    assert arc.evict(1, NOTHING) == [1]  # T1 is empty: from T2, into B2
    assert lists(arc)[3] == [1]
    add_ready(arc, [1])
    assert arc.target == 2.0
    assert lists(arc)[1] == [1]


def test_arc_target_chooses_the_list_to_evict_from() -> None:
    arc = ARCPolicy(8)
    add_ready(arc, [1, 2])
    arc.touch([1, 2])  # T2: 2, 1
    add_ready(arc, [3, 4])  # T1
    arc.target = 0.0  # T1 is over its target: take from T1 first
    assert arc.evict(1, NOTHING) == [4]
    arc.target = 4.0  # T1 (one key) is under target: take from T2
    assert arc.evict(1, NOTHING) == [2]
    assert arc.evict(5, NOTHING) is None  # atomic: only 2 keys left
    assert set(lists(arc)[0] + lists(arc)[1]) == {1, 3}


def test_arc_ghost_lists_stay_bounded() -> None:
    arc = ARCPolicy(4)
    for start in range(0, 200, 4):
        batch = list(range(start, start + 4))
        add_ready(arc, batch)
        if start % 8 == 0:
            arc.touch(batch)
        assert arc.evict(4, NOTHING) is not None
        t1, t2, b1, b2 = lists(arc)
        assert len(b1) <= 4 and len(b2) <= 4
        assert len(t1) + len(t2) == 0
    assert 0.0 <= arc.target <= 4.0


def test_arc_remove_forgets_without_ghost() -> None:
    arc = ARCPolicy(4)
    arc.insert([1])
    arc.remove([1])
    assert lists(arc) == ([], [], [], [])


# ---- recall -----------------------------------------------------------------------------------


def test_recall_sends_a_key_returning_after_a_long_gap_to_t2() -> None:
    capacity = 4
    arc, recall = ARCPolicy(capacity), RecallPolicy(capacity)
    for policy in (arc, recall):
        add_ready(policy, [1])
        # push 1 out and then far out of the ghost lists with one-shot keys
        for key in range(100, 140):
            policy.evict(1, NOTHING) if len(policy._t1) + len(policy._t2) >= capacity else None
            add_ready(policy, [key])
        assert 1 not in policy._b1 and 1 not in policy._t1
        policy.evict(1, NOTHING)
        add_ready(policy, [1])
    assert 1 in arc._t1  # ARC forgot it: looks brand new
    assert 1 in recall._t2  # recall remembers it came back
    add_ready(recall, [999])
    assert 999 in recall._t1  # a never-seen key still starts in T1


def test_recall_touch_of_an_absent_key_does_not_make_it_returning() -> None:
    recall = RecallPolicy(4)
    recall.touch([7])
    add_ready(recall, [7])
    assert 7 in recall._t1


def test_recall_clear_forgets_history() -> None:
    recall = RecallPolicy(4)
    add_ready(recall, [1])
    recall.clear()
    add_ready(recall, [1])
    assert 1 in recall._t1


# ---- SeenFilter ---------------------------------------------------------------------------------


def test_seen_filter_has_no_false_negatives_within_span() -> None:
    seen = SeenFilter(1000)
    keys = [random.Random(1).getrandbits(72) for _ in range(1000)]
    for i in range(0, 1000, 10):
        seen.add(keys[i : i + 10])
    # the last span/2 keys are always in the current or previous generation
    assert all(k in seen for k in keys[500:])


def test_seen_filter_forgets_beyond_two_generations_and_has_few_false_positives() -> None:
    seen = SeenFilter(1000)
    for start in range(0, 1000, 10):
        seen.add(range(start, start + 10))
    for start in range(10_000, 11_000, 10):  # two more half-spans: the first keys are gone
        seen.add(range(start, start + 10))
    forgotten = sum(1 for k in range(0, 500) if k in seen)
    assert forgotten < 25
    rng = random.Random(7)
    fresh = [rng.getrandbits(64) for _ in range(20_000)]
    # two generations at 16 bits per key: about 2 x 1.4% false positives
    assert seen.check_and_add(fresh[:100], add=False) <= set(fresh[:100])
    assert sum(1 for k in fresh if k in seen) / len(fresh) < 0.04


def test_seen_filter_rejects_tiny_span() -> None:
    with pytest.raises(ValueError):
        SeenFilter(1)


# ---- every policy through the directory --------------------------------------------------------


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_keeps_the_directory_consistent_under_churn(name: str) -> None:
    rng = random.Random(3)
    d = Directory(16, name)
    for step in range(400):
        base = rng.randrange(40)
        keys = [base * 100 + i for i in range(rng.randint(1, 6))]
        hit, _ = d.match_prefix(keys)
        if hit:
            d.touch(keys[:hit])
        plan = d.prepare_store(keys)
        if plan is not None and plan.keys:
            d.complete_store(plan.keys, success=step % 13 != 0)
        d.check_invariants()
        assert len(d) <= 16
