"""The shared tier's moves at the scheduler, without ranks: what a lookup that reaches past the
local tiers asks the store and starts, what a publish pins, and what a move that ends, fails or
is abandoned leaves readable. The store's answers come from a list here (``Answers``): a test
says what the store holds, as a real store cannot be made to lose a chunk between the lookup
that found it and the read that misses it."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.connector.jobs import JobTable
from raykv.connector.lookup import PrefixLookup
from raykv.connector.shared_moves import FETCH, PUBLISH, SharedMoves
from raykv.connector.state import RequestOffloadState
from raykv.connector.stats import ConnectorStats
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.core.step import TIER_SHARED, TierMove
from raykv.offload.directory import Directory
from tests.connector.test_disk_moves import ack_all  # every rank acks a job

BLOCK = 4


@dataclass
class Answers:
    """What the store holds, as the test says (every rank's part, or none)."""

    held: set[int] = field(default_factory=set)
    asked: list[list[int]] = field(default_factory=list)

    def present(self, keys: list[int]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.held for k in keys]


@dataclass
class Tiers:
    cpu: Directory
    shared: Directory
    jobs: JobTable
    moves: SharedMoves
    lookup: PrefixLookup
    store: Answers


def setup(cpu_slots: int = 8) -> Tiers:
    cpu = Directory(cpu_slots, "lru")
    shared = Directory(64, "lru")
    jobs = JobTable(2)
    store = Answers()
    moves = SharedMoves(cpu, shared, jobs, store, retry_steps=4)
    lookup = PrefixLookup(
        cpu, [KVGroup(0, GroupKind.FULL_ATTENTION)], BLOCK, 1, 64, ConnectorStats()
    )
    lookup.shared_moves = moves
    return Tiers(cpu, shared, jobs, moves, lookup, store)


def request(n_chunks: int, tag: int = 0) -> RequestOffloadState:
    tokens = [tag * 1000 + i for i in range(n_chunks * BLOCK + 1)]
    state = RequestOffloadState.new(Request(f"r{tag}", tag, tokens, 4), 1)
    state.update_keys(BLOCK, 1)
    return state


def stored(cpu: Directory, keys: list[int]) -> None:
    plan = cpu.prepare_store(keys)
    assert plan is not None
    cpu.complete_store(plan.keys)


def promotion_planned(cpu_slots: int = 4) -> tuple[Tiers, TierMove]:
    """Tiers whose lookup of a two-chunk prompt, held only by the store, planned one promotion
    (its request waits for it)."""
    t = setup(cpu_slots=cpu_slots)
    state = request(2)
    t.store.held = set(state.groups[0].keys[:2])
    assert t.lookup.lookup(state, 0, {}) is None
    (move,), _ = t.moves.plan()
    return t, move


def test_a_publish_pins_its_cpu_slots_until_every_rank_acked() -> None:
    t = setup(cpu_slots=16)
    keys = request(3).groups[0].keys[:3]
    stored(t.cpu, keys)
    t.moves.publish(keys)
    (move,), _ = t.moves.plan()
    assert move.tier == TIER_SHARED and not move.promote
    assert t.cpu.stats().reading == 3  # pinned: not evictable while the ranks read them
    assert not any(t.shared.is_readable(k) for k in keys)  # being written
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.cpu.stats().reading == 0
    assert all(t.shared.is_readable(k) for k in keys)
    t.moves.publish(keys)  # held already: not published again
    moves, _ = t.moves.plan()
    assert moves == []


def test_a_failed_publish_leaves_nothing_readable_and_a_full_store_pauses_publishing() -> None:
    t = setup()
    keys = request(2).groups[0].keys[:2]
    stored(t.cpu, keys)
    t.moves.publish(keys)
    (move,), _ = t.moves.plan()
    t.moves.finalize(ack_all(t.jobs, move.job_id, ok=False), corrupt=False, full=True)
    assert not any(k in t.shared for k in keys) and t.cpu.stats().reading == 0
    t.moves.publish(keys)
    assert t.moves.plan()[0] == []  # paused for retry_steps
    t.moves.step += 4
    t.moves.publish(keys)
    assert len(t.moves.plan()[0]) == 1


def test_a_lookup_asks_the_store_once_and_promotes_what_only_it_holds() -> None:
    t = setup()
    state = request(4)
    keys = state.groups[0].keys[:4]
    stored(t.cpu, keys[:1])
    t.store.held = set(keys[1:3])  # the store has chunks 1 and 2, not 3
    assert t.lookup.lookup(state, 0, {}) is None  # waits for the promotion
    assert t.store.asked == [keys[1:4]]
    (move,), _ = t.moves.plan()
    assert move.promote and move.tier == TIER_SHARED and move.chunks.unpack() == keys[1:3]
    assert t.lookup.lookup(state, 0, {}) is None  # still being written: asks again, not the store
    assert len(t.store.asked) == 1
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.lookup.lookup(state, 0, {}) == 3 * BLOCK
    assert state.fetched == set(keys[1:3])


def test_a_chunk_the_store_lost_fails_its_promotion_and_the_request_recomputes() -> None:
    t = setup()
    state = request(3)
    keys = state.groups[0].keys[:3]
    t.store.held = set(keys[:2])
    assert t.lookup.lookup(state, 0, {}) is None
    (move,), _ = t.moves.plan()
    # evicted by the store between the lookup and the read: the ranks say so (corrupt)
    job = ack_all(t.jobs, move.job_id, ok=False)
    assert job.move == FETCH
    t.moves.finalize(job, corrupt=True, full=False)
    assert not any(k in t.cpu for k in keys[:2])  # nothing readable that was not
    assert not any(k in t.shared for k in keys[:2])  # out of the index
    # a rank removes the parts it found spoiled; no other engine's readable part is removed
    assert t.moves.plan()[1].unpack() == []
    assert t.lookup.lookup(state, 0, {}) == 0  # it recomputes, and asks no more


def test_only_the_chunk_a_rank_found_missing_leaves_the_index() -> None:
    """Every chunk of a failed promotion left the index, whichever part was missing."""
    t = setup()
    state = request(4)
    keys = state.groups[0].keys[:4]
    t.store.held = set(keys[:3])
    assert t.lookup.lookup(state, 0, {}) is None
    (move,), _ = t.moves.plan()
    job = ack_all(t.jobs, move.job_id, ok=False)
    t.moves.finalize(job, corrupt=True, full=False, bad={keys[1]})
    assert keys[1] not in t.shared
    assert keys[0] in t.shared and keys[2] in t.shared
    assert t.moves.stats.gone == 1


def test_the_slots_of_a_failed_promotion_are_not_reused_while_its_read_may_land() -> None:
    """The store's client gives up on a read without cancelling it (a rank says
    ``unsettled``): the slots it was reading into are held (not free, not owned) and never
    handed to the next store, even with every other slot in use. A promotion that failed
    because a part was missing (nothing in transit) frees its slots at once."""
    t, move = promotion_planned()
    job = ack_all(t.jobs, move.job_id, ok=False)
    t.moves.finalize(job, corrupt=False, full=False, unsettled=True)
    assert t.cpu.stats().held == 2 and t.cpu.num_free == 2
    other = request(4, tag=1).groups[0].keys[:4]
    stored(t.cpu, other[:2])  # every free slot taken, then two more stores evict them
    plan = t.cpu.prepare_store(other[2:])
    assert plan is not None and not set(plan.slots) & set(move.cpu_slots)
    t.cpu.check_invariants()
    # a part missing: no hold
    t2, move2 = promotion_planned()
    t2.moves.finalize(ack_all(t2.jobs, move2.job_id, ok=False), corrupt=True, full=False)
    assert t2.cpu.stats().held == 0 and t2.cpu.num_free == 4


def test_an_abandoned_promotion_holds_its_slots_through_the_cpu_tier_emptied() -> None:
    """A reset that empties the CPU tier abandons a promotion whose read is under way: its
    outcome is never heard, so its slots stay out of use through the reset."""
    t, move = promotion_planned()
    job = t.jobs.jobs[move.job_id]
    t.jobs.reset()
    t.moves.abandon(job, keep_cpu=False)
    t.cpu.reset()
    assert t.cpu.num_held == 2 and t.cpu.num_free == 2
    plan = t.cpu.prepare_store(request(2, tag=3).groups[0].keys[:2])
    assert plan is not None and not set(plan.slots) & set(move.cpu_slots)
    t.cpu.check_invariants()


def test_an_abandoned_move_releases_what_it_held() -> None:
    t = setup()
    keys = request(2).groups[0].keys[:2]
    stored(t.cpu, keys)
    t.moves.publish(keys)
    (publish,), _ = t.moves.plan()
    job = t.jobs.jobs[publish.job_id]
    assert job.move == PUBLISH
    t.jobs.reset()
    t.moves.abandon(job, keep_cpu=True)
    assert t.cpu.stats().reading == 0 and not any(k in t.shared for k in keys)
    t.cpu.check_invariants()
    t.shared.check_invariants()


def test_a_store_that_keeps_failing_is_left_alone_for_a_while() -> None:
    t = setup()

    class Down:
        def present(self, keys: list[int]) -> list[bool]:
            raise ConnectionError("master unreachable")

    t.moves.index = Down()
    for tag in range(8):
        t.moves.discover(request(2, tag).groups[0].keys)
    assert not t.moves.readable() and t.moves.stats.unavailable_events == 1
    t.moves.step += 4
    assert t.moves.readable()


def test_an_abandoned_publish_is_never_sent() -> None:
    """Found by review: a publish made when a store's acks came in waited for the next plan; a
    reset between the two released its CPU slots, and the plan still sent it: the ranks put
    whatever the slots held by then under the chunk's key."""
    t = setup()
    keys = request(2).groups[0].keys[:2]
    stored(t.cpu, keys)
    t.moves.publish(keys)
    (job,) = t.jobs.reset()
    t.moves.abandon(job, keep_cpu=True)
    moves, _ = t.moves.plan()
    assert moves == []


def test_a_promotion_never_evicts_what_its_request_loads_beside_it() -> None:
    """Found by review: the room for a promotion was made by evicting the coldest CPU chunks,
    which could be the very chunks the same lookup then loaded (a KeyError at the load)."""
    t = setup(cpu_slots=4)
    mine = request(4, tag=1).groups[0].keys
    others = request(2, tag=2).groups[0].keys[:2]
    stored(t.cpu, mine[:2])
    stored(t.cpu, others)
    stored(t.shared, mine[2:4])
    t.cpu.touch(others)  # the request's own chunks are the coldest
    job = t.moves.promote(mine[2:4], keep=mine[:2])
    assert job is not None and job != -1
    assert all(k in t.cpu for k in mine) and not any(k in t.cpu for k in others)


def test_write_back_publishes_what_leaves_the_cpu_tier_and_frees_its_slot_after() -> None:
    """Write-back without a disk tier: a store publishes nothing; keeping the reserve gives up
    the coldest chunks, publishes those the store lacks, and frees each slot only when every
    rank has put it (one the index holds already leaves at once)."""
    t = setup(cpu_slots=4)
    t.moves = SharedMoves(t.cpu, t.shared, t.jobs, t.store, retry_steps=4, write_back=True,
                          reserve_slots=2)  # fmt: skip
    keys = request(4).groups[0].keys[:4]
    stored(t.cpu, keys)  # the CPU tier full: two must leave
    t.moves.publish(keys)  # write-back: a store is no reason to publish
    # the coldest are a prefix's last chunks; the store holds the second coldest already
    t.shared.adopt(keys[2:3])
    (move,), _ = t.moves.plan()
    assert move.tier == TIER_SHARED and move.chunks.unpack() == [keys[3]]
    assert t.cpu.num_free == 1  # the held one left at once; the published one waits
    assert t.cpu.is_readable(keys[3])  # leaving, still readable (a load may read it)
    assert not t.moves.plan()[0]  # no second publish of what is leaving already
    t.moves.finalize(ack_all(t.jobs, move.job_id), corrupt=False, full=False)
    assert t.cpu.num_free == 2 and keys[3] not in t.cpu
    assert t.shared.is_readable(keys[3])
    t.cpu.check_invariants()
    t.shared.check_invariants()


def test_write_back_with_a_disk_tier_publishes_what_its_demotions_give_up() -> None:
    """With a disk tier, its demotions pick the chunks that leave: each is written to disk and
    put into the store, and its CPU slot is freed only when both moves ended, whichever ends
    first (a failed publish frees it too, and leaves the store's index without it)."""
    from raykv.connector.lower_tiers import LowerTiers

    cpu = Directory(4, "lru")
    disk = Directory(16, "lru")
    shared = Directory(16, "lru")
    jobs = JobTable(2)
    tiers = LowerTiers.build(cpu, jobs, False, 2, (disk, 4), (shared, Answers(), 4, True))
    keys = request(4).groups[0].keys[:4]
    stored(cpu, keys)
    tiers.stored(keys)  # write-back: nothing yet
    moves, _, _ = tiers.plan(0)
    by_tier = {m.tier: m for m in moves}
    assert len(moves) == 2 and TIER_SHARED in by_tier
    demotion = next(m for m in moves if m.tier != TIER_SHARED)
    publish = by_tier[TIER_SHARED]
    leaving = keys[2:]  # the coldest: the prefix's last chunks
    assert sorted(demotion.chunks.unpack()) == sorted(publish.chunks.unpack()) == sorted(leaving)
    tiers.finalize(ack_all(jobs, demotion.job_id), corrupt=False, full=False)
    assert cpu.num_free == 0 and all(cpu.is_readable(k) for k in leaving)  # still published
    tiers.finalize(ack_all(jobs, publish.job_id, ok=False), corrupt=False, full=False)
    assert cpu.num_free == 2 and all(disk.is_readable(k) for k in leaving)
    assert not any(k in shared for k in leaving)
    tiers.check_invariants()
    cpu.check_invariants()


def test_write_back_gives_up_no_more_than_the_store_index_can_take() -> None:
    """An index of the store smaller than the reserve: only as many chunks leave the CPU tier
    as can be published (one given up unpublished would be lost early)."""
    cpu = Directory(16, "lru")
    shared = Directory(4, "lru")
    jobs = JobTable(2)
    moves = SharedMoves(cpu, shared, jobs, Answers(), retry_steps=4, write_back=True,
                        reserve_slots=8)  # fmt: skip
    keys = request(16).groups[0].keys[:16]
    stored(cpu, keys)
    (move,), _ = moves.plan()
    assert len(move.chunks) == 4 and cpu.num_free == 0 and cpu.num_leaving == 4
    assert moves.stats.not_published == 0
    moves.finalize(ack_all(jobs, move.job_id), corrupt=False, full=False)
    assert cpu.num_free == 4 and all(shared.is_readable(k) for k in move.chunks.unpack())
    cpu.check_invariants()


def test_write_back_keeps_the_reserve_itself_while_the_disk_takes_no_demotions() -> None:
    from raykv.connector.lower_tiers import LowerTiers

    cpu = Directory(8, "lru")
    disk = Directory(16, "lru")
    shared = Directory(16, "lru")
    jobs = JobTable(2)
    tiers = LowerTiers.build(cpu, jobs, False, 2, (disk, 4), (shared, Answers(), 4, True))
    assert tiers.disk is not None
    tiers.disk._on_full("demotions")  # the disk is full: demotions stop for a while
    keys = request(8).groups[0].keys[:8]
    stored(cpu, keys)
    moves, _, _ = tiers.plan(0)
    assert [m.tier for m in moves] == [TIER_SHARED] and len(moves[0].chunks) == 2
    tiers.check_invariants()
