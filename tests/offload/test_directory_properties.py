"""Property test: random operation sequences against a model of the directory.

After every call the directory's books must balance (no slot owned twice, counters consistent,
capacity never exceeded) and the readable keys must be exactly the ones whose store completed
successfully and that were not evicted or reset since.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from raykv.offload import HIT, HIT_PENDING, MISS, Directory

CAPACITY = 6
KEYS = st.integers(min_value=0, max_value=14)
KEY_LISTS = st.lists(KEYS, min_size=0, max_size=8)


class DirectoryMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.d = Directory(CAPACITY, self.policy)
        self.ready: set[int] = set()  # readable keys (including those being read)
        self.batches: list[list[int]] = []  # prepared, not yet completed
        self.loads: list[list[int]] = []  # prepared loads, not yet completed
        self.readers: Counter[int] = Counter()

    def writing(self) -> set[int]:
        return {k for batch in self.batches for k in batch}

    def resident(self) -> set[int]:
        return self.ready | self.writing()

    @rule(keys=KEY_LISTS)
    def store(self, keys: list[int]) -> None:
        resident_before = self.resident()
        idle = {k for k in self.ready if self.readers[k] == 0}
        plan = self.d.prepare_store(keys)
        missing = set(keys) - resident_before
        if plan is None:
            free = CAPACITY - len(resident_before)
            assert len(missing) - free > len(idle - set(keys)), "refused though room existed"
            assert self.resident() == resident_before
            return
        assert len(plan.keys) == len(set(plan.keys)) == len(plan.slots)
        assert set(plan.keys) == missing  # built-in policies admit every missing key
        assert set(plan.evicted) <= idle - set(keys), "evicted a busy or protected key"
        self.ready -= set(plan.evicted)
        if plan.keys:
            self.batches.append(plan.keys)

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), success=st.booleans())
    def complete(self, data: st.DataObject, success: bool) -> None:
        batch = self.batches.pop(data.draw(st.integers(0, len(self.batches) - 1)))
        self.d.complete_store(batch, success)
        if success:
            self.ready |= set(batch)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=4))
        keys = list(dict.fromkeys(keys))
        slots = self.d.prepare_load(keys)
        assert slots == [self.d.slot_of(k) for k in keys]
        self.readers.update(keys)
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.d.complete_load(keys)
        self.readers.subtract(keys)

    @rule(keys=KEY_LISTS)
    def touch(self, keys: list[int]) -> None:
        self.d.touch(keys)

    @rule(key=KEYS)
    def lookup(self, key: int) -> None:
        expected = HIT if key in self.ready else HIT_PENDING if key in self.writing() else MISS
        assert self.d.lookup(key) is expected

    @rule(keys=KEY_LISTS)
    def match_prefix(self, keys: list[int]) -> None:
        resident, writing = self.resident(), self.writing()
        present = pending = 0
        for key in keys:
            if key not in resident:
                break
            present += 1
            pending += key in writing
        assert self.d.match_prefix(keys) == (present, pending)

    @rule()
    def reset(self) -> None:
        self.d.reset()
        self.ready.clear()
        self.batches.clear()
        self.loads.clear()
        self.readers.clear()

    @invariant()
    def books_balance(self) -> None:
        self.d.check_invariants()
        assert len(self.d) <= CAPACITY
        assert self.d.readable_keys() == self.ready
        assert len(self.d) == len(self.resident())
        stats = self.d.stats()
        assert stats.writing == len(self.writing())
        assert stats.reading == sum(1 for n in self.readers.values() if n > 0)


class ARCMachine(DirectoryMachine):
    policy = "arc"


class RecallMachine(DirectoryMachine):
    policy = "recall"


TestLRUDirectory = DirectoryMachine.TestCase
TestARCDirectory = ARCMachine.TestCase
TestRecallDirectory = RecallMachine.TestCase
for _case in (TestLRUDirectory, TestARCDirectory, TestRecallDirectory):
    _case.settings = settings(_case.settings, max_examples=60, stateful_step_count=40)
