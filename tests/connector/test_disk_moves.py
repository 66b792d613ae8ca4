"""The disk tier's moves at the scheduler, without ranks: what a lookup that reaches the disk
starts, what a demotion admits, and what a move that ends or is abandoned leaves readable."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from raykv.connector.jobs import JobTable
from raykv.connector.lookup import PrefixLookup
from raykv.connector.state import RequestOffloadState
from raykv.connector.stats import ConnectorStats
from raykv.connector.tier_moves import WAIT, DiskMoves
from raykv.connector.worth import MIN_SAMPLES, TierCosts
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.offload.directory import Directory

BLOCK = 4
MAX_WAIT_S = 2.0


class Clock:
    """A test's clock: time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Tiers:
    cpu: Directory
    disk: Directory
    jobs: JobTable
    moves: DiskMoves
    lookup: PrefixLookup
    clock: Clock


def setup(cpu_slots: int = 8, reserve: int = 1, **disk_options: object) -> Tiers:
    cpu = Directory(cpu_slots, "lru")
    disk = Directory(16, "lru", **disk_options)
    jobs = JobTable(2)
    moves = DiskMoves(cpu, disk, jobs, reserve)
    full = [KVGroup(0, GroupKind.FULL_ATTENTION)]
    clock = Clock()
    lookup = PrefixLookup(cpu, full, BLOCK, 1, MAX_WAIT_S, ConnectorStats(), clock)
    lookup.moves = moves
    return Tiers(cpu, disk, jobs, moves, lookup, clock)


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


def test_a_request_waiting_for_room_takes_the_cpu_tiers_hit_once_its_wait_is_over() -> None:
    """Found by review: a promotion waiting for room (none is made while the disk takes no
    writes) waited the whole deferral budget and then recomputed the CPU tier's hit too. The
    wait is the clock's: any number of lookups within it wait."""
    t = setup(cpu_slots=4, reserve=1)
    state = request(4)
    keys = state.groups[0].keys
    store(t.cpu, keys[:2])  # two of four slots, none on disk
    store(t.cpu, request(2, tag=9).groups[0].keys)  # the other two
    t.disk.adopt(keys[2:])
    answers = [t.lookup.lookup(state, 0, {}) for _ in range(50)]
    assert answers == [None] * 50  # waits for room, however many (quick) steps go by
    t.clock.now += MAX_WAIT_S
    assert t.lookup.lookup(state, 0, {}) == 2 * BLOCK  # then loads what the CPU tier holds


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


def test_a_hit_larger_than_the_cpu_tier_promotes_the_longest_prefix_that_fits() -> None:
    """Found by a restart on a small CPU tier: a promotion the tier could never hold whole was
    refused, and the request recomputed every chunk the disk held for it. The reserve the
    demotions keep free is no bar: what a promotion reads is on disk already."""
    t = setup(cpu_slots=4, reserve=2)
    state = request(10)
    keys = state.groups[0].keys
    t.disk.adopt(keys)
    assert t.lookup.lookup(state, 0, {}) is None  # the promotion is under way
    (move,), _ = t.moves.plan(0)
    assert move.promote and move.chunks.unpack() == keys[:4]
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.lookup.lookup(state, 0, {}) == 4 * BLOCK  # what fits; the rest is computed


def test_an_idle_engines_request_waits_for_its_promotion_by_the_clock_not_by_steps() -> None:
    """Found by a restart on raykv's own engine: the wait was counted in steps, an idle engine's
    steps are short, and the first request after a restart gave up on its disk hit."""
    t = setup(cpu_slots=16)
    state = request(6)
    keys = state.groups[0].keys
    t.disk.adopt(keys)
    answers = [t.lookup.lookup(state, 0, {}) for _ in range(500)]  # 500 empty steps
    assert answers == [None] * 500
    (move,), _ = t.moves.plan(0)
    t.clock.now += MAX_WAIT_S / 2
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.lookup.lookup(state, 0, {}) == 6 * BLOCK


def priced(t: Tiers, disk_s: float) -> TierCosts:
    """Costs whose model is measured (4 steps of 64 tokens, 64 ms each), whose CPU tier loaded
    4 times (a millisecond each) and whose disk tier promoted 4 times, ``disk_s`` each."""
    costs = TierCosts(step_tokens=64)
    for _ in range(MIN_SAMPLES):
        costs.observe_step(64, 0.0, 0.064, 0.070)
        costs.observe_duration(0.070)
        costs.observe_promotion(6, disk_s)
        costs.observe_load(6, 0.001)
    t.lookup.costs = costs
    return costs


@pytest.mark.parametrize("lands", [True, False])
def test_a_promotion_is_waited_for_while_it_is_worth_it_and_given_up_after(lands: bool) -> None:
    """The wait is bounded by the choice too (on a test clock): a promotion that lands within
    what recomputing would cost is loaded; one still running after that is given up, and the
    request recomputes (its promotion lands for the next ones)."""
    t = setup(cpu_slots=16)
    costs = priced(t, disk_s=0.001)
    state = request(12)
    keys = state.groups[0].keys
    t.disk.adopt(keys)
    assert t.lookup.lookup(state, 0, {}) is None
    limit = state.wait_limit_s
    recompute = state.req.predicted_recompute_s
    assert limit is not None and recompute is not None
    # worth waiting for most of a recompute: the promotion was priced at a millisecond
    assert costs.move_s("disk", 12) < limit <= recompute
    (move,), _ = t.moves.plan(0)
    t.clock.now += 0.9 * limit
    assert t.lookup.lookup(state, 0, {}) is None
    if lands:
        t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
        assert t.lookup.lookup(state, 0, {}) == 12 * BLOCK
        assert t.lookup.stats.deferral_timeouts == 0
        return
    t.clock.now += 0.2 * limit
    assert t.lookup.lookup(state, 0, {}) == 0  # recomputed: the disk is slower than priced
    assert t.lookup.stats.deferral_timeouts == 1
    assert t.lookup.lookup(state, 0, {}) == 0  # and it does not wait again


def test_a_promotion_given_up_leaves_the_request_what_the_cpu_tier_holds() -> None:
    """Its wait over, a request takes the CPU tier's readable prefix (its own promotion's chunks,
    still being written there, end it), not nothing."""
    t = setup(cpu_slots=16)
    state = request(6)
    keys = state.groups[0].keys
    store(t.cpu, keys[:2])
    t.disk.adopt(keys[2:])
    assert t.lookup.lookup(state, 0, {}) is None  # promoting the other four
    t.clock.now += MAX_WAIT_S
    assert t.lookup.lookup(state, 0, {}) == 2 * BLOCK
    assert t.lookup.stats.deferral_timeouts == 1
