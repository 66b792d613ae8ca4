"""Lookups over KV groups: prefix for full attention, rightmost window for sliding windows
(notes 4.3-4.5, 7.8-7.10), driven against a directory whose contents each test sets up."""

from __future__ import annotations

import pytest

from raykv.connector.scheduler import ConnectorScheduler
from raykv.core.hashing import block_hashes
from raykv.core.keys import make_key
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.offload.directory import Directory

BS = 4
FULL = KVGroup(0, GroupKind.FULL_ATTENTION)


def sliding(index: int, window_tokens: int) -> KVGroup:
    return KVGroup(index, GroupKind.SLIDING_WINDOW, window_tokens)


def setup(groups, n_chunks, present, pending=None):
    """A request of n_chunks full chunks (+1 token) and a directory holding, per group, the
    chunks in ``present`` (ready) and ``pending`` (still being written)."""
    pending = pending or {}
    req = Request("r", 0, list(range(1, n_chunks * BS + 2)), max_tokens=1)
    hashes = block_hashes(req.tokens, BS)
    d = Directory(256)
    for g, _group in enumerate(groups):
        keys = [make_key(hashes[c], g) for c in sorted(set(present[g]) | set(pending.get(g, ())))]
        plan = d.prepare_store(keys)
        assert plan is not None
        d.complete_store([make_key(hashes[c], g) for c in present[g]])
    return ConnectorScheduler(d, groups, BS, 1, num_ranks=1), req


@pytest.mark.parametrize(
    "present,expected",
    [
        ({0, 1, 2, 3, 4}, 5),  # everything
        ({0, 1}, 2),  # a prefix
        (set(), 0),
        ({1, 2}, 0),  # a miss first: nothing (a chunk is useless without those before it)
        ({0, 2, 3}, 1),
    ],
)
def test_full_attention_prefix(present, expected) -> None:
    c, req = setup([FULL], 5, [present])
    assert c.lookup(req, 0) == expected * BS


def test_full_attention_pending_chunk_defers() -> None:
    c, req = setup([FULL], 5, [{0}], pending={0: {1}})
    assert c.lookup(req, 0) is None
    assert c.stats.deferred_lookups == 1


def test_full_attention_starts_after_the_gpu_hit() -> None:
    c, req = setup([FULL], 5, [{2, 3}])
    assert c.lookup(req, 2 * BS) == 2 * BS  # chunks 2 and 3 after two chunks on the GPU


@pytest.mark.parametrize(
    "present,window,expected",
    [
        ({0, 1, 3, 4}, 8, 5),  # rightmost full window (chunks 3, 4)
        ({0, 1, 2}, 8, 3),
        ({0, 2, 4}, 8, 1),  # no two in a row: only the prefix fallback at the start
        ({1, 2}, 8, 3),  # window in the middle
        ({0, 1, 3}, 16, 2),  # W=4 chunks never fits: prefix fallback of 2
        (set(), 8, 0),
        ({4}, 4, 5),  # one-chunk window at the very end
    ],
)
def test_sliding_window_rightmost_window(present, window, expected) -> None:
    c, req = setup([sliding(0, window)], 5, [present])
    assert c.lookup(req, 0) == expected * BS


def test_sliding_window_pending_in_the_used_window_defers_but_not_elsewhere() -> None:
    c, req = setup([sliding(0, 8)], 5, [{3, 4}], pending={0: {0}})
    assert c.lookup(req, 0) == 5 * BS  # the pending chunk is outside the window used
    c, req = setup([sliding(0, 8)], 5, [{3}], pending={0: {4}})
    assert c.lookup(req, 0) is None


def test_groups_converge_on_one_boundary() -> None:
    # full attention could resume at 4 chunks, the window group only at 3: both load up to 3
    c, req = setup([FULL, sliding(1, 8)], 5, [{0, 1, 2, 3}, {1, 2}])
    assert c.lookup(req, 0) == 3 * BS


def test_groups_a_window_miss_everywhere_means_no_hit() -> None:
    c, req = setup([FULL, sliding(1, 8)], 5, [{0, 1, 2, 3}, set()])
    assert c.lookup(req, 0) == 0


def test_lookup_touches_the_hit_keys() -> None:
    c, req = setup([FULL], 4, [{0, 1, 2, 3}])
    touched = []
    c.directory.touch = lambda keys: touched.append(list(keys))  # type: ignore[method-assign]
    assert c.lookup(req, 0) == 4 * BS
    assert len(touched) == 1 and len(touched[0]) == 4


@pytest.mark.parametrize(
    ("groups", "present", "num_local", "expected"),
    [
        ([FULL], [{0, 1, 2, 3, 4}], 0, 5 * BS),
        ([FULL], [{0, 2, 3}], 0, 1 * BS),
        ([FULL], [{2, 3}], 2 * BS, 2 * BS),  # after a GPU hit of two chunks
        ([FULL, sliding(1, 2 * BS)], [{0, 1, 2}, {0, 1}], 0, 2 * BS),  # every group's prefix
    ],
)
def test_peek_estimates_the_hit_and_changes_nothing(groups, present, num_local, expected) -> None:
    # the shortest-prefill policy peeks at every waiting request each step: that must not count
    # as lookups (the store-threshold filter and the hit rates read those) nor refresh recency
    c, req = setup(groups, 5, present)
    touched = []
    c.directory.touch = lambda keys: touched.append(list(keys))  # type: ignore[method-assign]
    before = (c.stats.lookups, c.directory.stats().lookups)
    assert c.peek(req, num_local) == expected
    assert (c.stats.lookups, c.directory.stats().lookups) == before
    assert touched == []
