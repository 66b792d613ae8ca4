"""The KV-cache manager: block-table arithmetic, and the one feed of allocations and releases
that the fence depends on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from raykv.core.arith import cdiv
from raykv.core.block_pool import NULL_BLOCK, BlockPool
from raykv.core.kv_cache import KVCacheManager
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.core.step import ModelEntry

FULL = KVGroup(0, GroupKind.FULL_ATTENTION)


class Recorder:
    """Keeps what the manager reports (the engine scheduler forwards the same calls)."""

    def __init__(self) -> None:
        self.allocated: list[tuple[str, list[list[int]], list[int]]] = []
        self.released: list[tuple[str, int, list[int]]] = []

    def on_allocated(
        self, req: Request, new_entries: Sequence[Sequence[int]], fresh: Sequence[int]
    ) -> None:
        self.allocated.append((req.req_id, [list(e) for e in new_entries], list(fresh)))

    def on_released(self, req: Request, group: int, positions: Sequence[int]) -> None:
        self.released.append((req.req_id, group, list(positions)))


def manager(groups: list[KVGroup], blocks: int = 32, budget: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockPool(blocks), groups, 4, budget, Recorder())


def request(req_id: str, n: int, groups: int = 1) -> Request:
    req = Request(req_id, 0, list(range(1, n + 1)), 4)
    req.reset_blocks(groups)
    return req


@pytest.mark.parametrize(("a", "b", "want"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2)])
def test_cdiv(a: int, b: int, want: int) -> None:
    assert cdiv(a, b) == want


def test_admission_is_reported_with_its_fresh_blocks_and_is_all_or_nothing() -> None:
    kv = manager([FULL], blocks=4)  # 3 usable
    rec = kv.listener
    a = request("a", 12)
    assert kv.admit(a, [[]], 0, 12)
    assert rec.allocated == [("a", [a.block_tables[0]], a.block_tables[0])]
    b = request("b", 8)
    assert not kv.admit(b, [[]], 0, 8)  # needs 2 of the 0 left: nothing taken, nothing told
    assert b.block_tables == [[]] and len(rec.allocated) == 1
    assert kv.pool.num_free == 0


def test_a_prefix_hit_revives_cached_blocks_which_are_not_fresh() -> None:
    kv = manager([FULL])
    a = request("a", 9)
    assert kv.admit(a, [[]], 0, 9)
    a.num_computed = 9
    kv.publish(a)
    kv.free(a)
    b = request("b", 9)  # the same tokens
    hit, local = kv.local_hit(b)
    a_blocks = local[0]
    assert hit == 8 and len(local) == 1 and len(a_blocks) == 2
    assert kv.admit(b, local, hit, 9)
    _, entries, fresh = kv.listener.allocated[-1]
    assert entries[0][:2] == a_blocks and set(fresh).isdisjoint(a_blocks) and len(fresh) == 1


def test_sliding_window_blocks_that_leave_the_window_are_reported_before_reuse() -> None:
    sliding = KVGroup(0, GroupKind.SLIDING_WINDOW, window_tokens=5)
    kv = manager([sliding], blocks=8, budget=4)
    rec = kv.listener
    a = request("a", 20)
    assert kv.admit(a, [[]], 0, 4)
    for end in range(8, 21, 4):
        a.num_computed = end - 4
        assert kv.grow(a, end)
    # a token at 12 reads 8..12: blocks 0 and 1 left the window on the way
    released = [p for _, _, positions in rec.released for p in positions]
    assert released == [0, 1, 2]
    assert a.block_tables[0][:3] == [NULL_BLOCK] * 3
    assert kv.pool.num_free == 7 - 2  # two blocks held: the window and the newest


def test_max_blocks_needed_bounds_a_sliding_window_by_window_and_budget() -> None:
    sliding = KVGroup(1, GroupKind.SLIDING_WINDOW, window_tokens=5)
    kv = manager([FULL, sliding], budget=8)
    # full: every block; sliding: W - 1 + budget positions, one block more for the offset
    assert kv.max_blocks_needed(100) == 25 + cdiv(5 - 1 + 8, 4) + 1


def test_read_blocks_skip_what_a_window_no_longer_reads() -> None:
    sliding = KVGroup(1, GroupKind.SLIDING_WINDOW, window_tokens=5)
    kv = manager([FULL, sliding], budget=16)
    a = request("a", 16, groups=2)
    assert kv.admit(a, [[], []], 0, 16)
    full, window = a.block_tables
    # the token at 15 reads 11..15 of the window: blocks 2 and 3
    assert kv.read_from(16) == [0, 2]
    entry = ModelEntry(0, 0, 0, [1] * 16, [full, window], read_from=kv.read_from(16))
    assert entry.samples and entry.read_blocks() == [*full, *window[2:]]
    # a null entry inside the window's reach (dropped earlier) is not read
    tables = [full, [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, window[3]]]
    entry = ModelEntry(0, 0, 0, [1] * 16, tables, read_from=[0, 2])
    assert entry.read_blocks() == [*full, window[3]]
    assert not ModelEntry(0, 0, 0, [1] * 16, [full, window]).samples


def test_cached_blocks_before_a_later_window_are_not_counted_against_the_pool() -> None:
    # A GPU hit of 16 tokens (a window of 9 tokens keeps blocks 2-3 cached for it), then a load
    # to 24 tokens: the window resuming at 24 reads from block 4 on, so blocks 2-3 are dropped,
    # not revived. Counting them as taken from the free pool refused an admission that fits
    # (found by the fuzzer: a request whose every admission failed, with nothing running, waited
    # for ever).
    sliding = KVGroup(0, GroupKind.SLIDING_WINDOW, window_tokens=9)
    kv = manager([sliding], blocks=9, budget=8)  # 8 usable
    a = request("a", 16)
    assert kv.admit(a, [[]], 0, 16)
    kv.pool.allocate(4)  # the rest of the pool: only a's blocks will be free
    a.num_computed = 16
    kv.publish(a)
    kv.free(a)
    b = request("b", 40)  # starts with a's 16 tokens
    hit, local = kv.local_hit(b)
    assert hit == 16 and [x != NULL_BLOCK for x in local[0]] == [False, False, True, True]
    assert kv.pool.num_free == 4
    assert kv.admit(b, local, 24, 32)  # blocks 4-7: the window at 24 and 8 tokens after it
    assert b.block_tables[0][:4] == [NULL_BLOCK] * 4
    assert NULL_BLOCK not in b.block_tables[0][4:8]
