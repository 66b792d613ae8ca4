"""The disk tier's moves at the scheduler, without ranks: what a lookup that reaches the disk
starts, what a demotion admits, and what a move that ends or is abandoned leaves readable."""

from __future__ import annotations

from dataclasses import dataclass

from raykv.connector.jobs import JobTable
from raykv.connector.lookup import PrefixLookup
from raykv.connector.state import RequestOffloadState
from raykv.connector.stats import ConnectorStats
from raykv.connector.tier_moves import WAIT, DiskMoves
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.offload.directory import Directory

BLOCK = 4


@dataclass
class Tiers:
    cpu: Directory
    disk: Directory
    jobs: JobTable
    moves: DiskMoves
    lookup: PrefixLookup


def setup(cpu_slots: int = 8, reserve: int = 1, **disk_options: object) -> Tiers:
    cpu = Directory(cpu_slots, "lru")
    disk = Directory(16, "lru", **disk_options)
    jobs = JobTable(2)
    moves = DiskMoves(cpu, disk, jobs, reserve)
    full = [KVGroup(0, GroupKind.FULL_ATTENTION)]
    lookup = PrefixLookup(cpu, full, BLOCK, 1, 64, ConnectorStats())
    lookup.moves = moves
    return Tiers(cpu, disk, jobs, moves, lookup)


def request(n_chunks: int, tag: int = 0) -> RequestOffloadState:
    tokens = [tag * 1000 + i for i in range(n_chunks * BLOCK + 1)]
    state = RequestOffloadState.new(Request(f"r{tag}", tag, tokens, 4), 1)
    state.update_keys(BLOCK, 1)
    return state


def store(directory: Directory, keys: list[int]) -> None:
    plan = directory.prepare_store(keys)
    assert plan is not None
    directory.complete_store(plan.keys)


def ack_all(jobs: JobTable, job_id: int, ok: bool = True):
    job = None
    for rank in range(jobs.num_ranks):
        job = jobs.ack(job_id, rank, ok) or job
    assert job is not None
    return job


def test_chunks_the_cpu_tier_served_count_towards_the_disk_tiers_filter() -> None:
    t = setup(cpu_slots=4, reserve=4, store_threshold=2)
    state = request(3)
    keys = state.groups[0].keys
    store(t.cpu, keys)
    for _ in range(2):  # two lookups the CPU tier answers in full
        assert t.lookup.lookup(state, 0, {}) == 3 * BLOCK
    moves_now, _ = t.moves.plan(0)  # the reserve wants every slot: all three leave for disk
    written = [k for m in moves_now for k in m.chunks.unpack()]
    assert sorted(written) == sorted(keys)


def test_a_lookup_that_reaches_past_the_cpu_tier_promotes_and_waits() -> None:
    t = setup()
    state = request(3)
    keys = state.groups[0].keys
    store(t.cpu, keys[:1])
    t.disk.adopt(keys[1:])
    assert t.lookup.lookup(state, 0, {}) is None  # deferred: the promotion is under way
    (move,), _ = t.moves.plan(0)
    assert move.promote and move.chunks.unpack() == keys[1:]
    assert t.lookup.lookup(state, 0, {}) is None  # still being written into the CPU tier
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.lookup.lookup(state, 0, {}) == 3 * BLOCK  # now one CPU hit, a load of all three
    assert all(k in t.disk for k in keys[1:])  # a promoted chunk stays on disk too


def test_a_promotion_evicts_nothing_it_waits_for_demotions_to_make_room() -> None:
    t = setup(cpu_slots=4, reserve=1)
    other = request(3, tag=1)
    store(t.cpu, other.groups[0].keys)  # three of four slots, none of them on disk
    state = request(2)
    t.disk.adopt(state.groups[0].keys)
    assert t.moves.promote(state.groups[0].keys) == WAIT
    assert len(t.cpu) == 3  # nothing evicted
    (move,), _ = t.moves.plan(0)  # a demotion for the room the promotion wants
    assert not move.promote and len(move.chunks) >= 1


def test_a_failed_corrupt_promotion_frees_its_slots_and_deletes_the_files() -> None:
    t = setup()
    state = request(2)
    keys = state.groups[0].keys
    t.disk.adopt(keys)
    assert t.lookup.lookup(state, 0, {}) is None
    (move,), _ = t.moves.plan(0)
    t.moves.finalize(ack_all(t.jobs, move.job_id, ok=False), corrupt=True, full=False)
    assert not any(k in t.cpu for k in keys) and not any(k in t.disk for k in keys)
    _, drops = t.moves.plan(1)
    assert sorted(drops.unpack()) == sorted(keys)
    t.cpu.check_invariants()
    t.disk.check_invariants()


def test_an_abandoned_demotion_leaves_nothing_readable_on_disk() -> None:
    t = setup(cpu_slots=4, reserve=4)
    state = request(2)
    keys = state.groups[0].keys
    store(t.cpu, keys)
    assert len(t.moves.plan(0)[0]) == 1
    (job,) = t.jobs.reset()
    t.moves.abandon(job, keep_cpu=True)
    assert not any(t.disk.is_readable(k) for k in keys) and t.cpu.num_leaving == 0
    _, drops = t.moves.plan(1)
    assert set(keys) <= set(drops.unpack())  # a survivor may have renamed its file in place
    t.cpu.check_invariants()
    t.disk.check_invariants()


def test_a_request_waiting_for_room_takes_the_cpu_tiers_hit_after_a_few_lookups() -> None:
    """Found by review: a promotion waiting for room (none is made while the disk takes no
    writes) waited the whole deferral budget and then recomputed the CPU tier's hit too."""
    t = setup(cpu_slots=4, reserve=1)
    state = request(4)
    keys = state.groups[0].keys
    store(t.cpu, keys[:2])  # two of four slots, none on disk
    store(t.cpu, request(2, tag=9).groups[0].keys)  # the other two
    t.disk.adopt(keys[2:])
    answers = [t.lookup.lookup(state, 0, {}) for _ in range(6)]
    assert answers[0] is None  # waits for room at first
    assert answers[-1] == 2 * BLOCK  # then loads what the CPU tier holds, not nothing


def test_a_disk_whose_moves_keep_failing_is_taken_out_of_use_for_a_while() -> None:
    from raykv.connector.lower_moves import FAILURES_TO_PAUSE

    t = setup()
    state = request(2)
    keys = state.groups[0].keys
    t.disk.adopt(keys)
    for step in range(FAILURES_TO_PAUSE):
        t.disk.adopt(keys)  # each failed promotion drops them: put them back
        assert t.lookup.lookup(state, 0, {}) is None
        (move,), _ = t.moves.plan(step)
        t.moves.step = step
        t.moves.finalize(ack_all(t.jobs, move.job_id, ok=False), False, False)
        state.disk_failed = False
    assert not t.moves.readable()
    t.disk.adopt(keys)
    assert t.lookup.lookup(state, 0, {}) == 0  # the disk is not asked: recompute
    assert t.moves.stats.unavailable_events == 1
    t.moves.step = 10_000  # retried later
    assert t.moves.readable()
