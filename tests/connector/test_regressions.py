"""Regression tests named after the bug shapes of vLLM's offloading connector (notes section 8).

Each recreates the interleaving that broke vLLM and checks raykv's design rules it out.
"""

from __future__ import annotations

from tests.connector.harness import Runner, tokens
from tests.connector.test_fence import finish_with_stores_pending
from tests.connector.test_lifecycle import make_preemption
from tests.connector.test_store_path import ScriptedDirectory


def test_vllm_42761_a_block_never_appears_twice_in_one_job() -> None:
    """#42761: a store listing one GPU block twice crashed the fence cleanup. Here a sliding-
    window block leaves the window unstored and returns to the same request at a later position
    while its old position is still in the not-yet-stored range."""
    d = ScriptedDirectory(64, "lru", answers=["none", "none", "none"])
    groups = "[{kind: sliding_window, window_tokens: 5}]"
    r = Runner(block_size=4, groups=groups, num_gpu_blocks=4, max_num_batched_tokens=4, directory=d)
    r.add("a", tokens(16))
    r.run()
    specs = [s for rec in r.records for s in rec.plan.stores]
    assert specs
    for spec in specs:
        assert len(set(spec.copy.gpu_blocks)) == len(spec.copy.gpu_blocks)
    r.drained()


def test_vllm_48596_final_block_filled_at_eos_is_stored() -> None:
    """#48596: the block the last computed token fills was never offloaded."""
    r = Runner(block_size=4)
    a = r.add("a", tokens(6), max_tokens=3)  # KV for 6 + 2 positions: block 1 fills at the end
    r.run()
    assert a.finished and r.blocks("stored", "a") == {0, 1}
    assert len(r.connector.directory.readable_keys()) == 2
    r.drained()


def test_vllm_42959_stale_sliding_window_block_is_never_stored() -> None:
    """vLLM #42959 / #42761: a sliding-window block leaves the window before it could be stored,
    is handed out again, and must not be stored under its old position's key (nor appear twice
    in one job)."""
    d = ScriptedDirectory(64, "lru", answers=["none", "none", "none"])
    groups = "[{kind: sliding_window, window_tokens: 5}]"
    r = Runner(block_size=4, groups=groups, num_gpu_blocks=4, max_num_batched_tokens=4, directory=d)
    r.add("a", tokens(16))
    r.step()
    ids = r.state("a").groups[0].block_ids
    first = ids[0]
    r.step(3)  # block 0 leaves the window in step 2 and comes back for position 12 in step 3
    assert ids[3] == first and ids[0] == 0  # the stale position was zeroed, not stored
    r.run()
    assert r.blocks("stored", "a") == {1, 2, 3}
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_vllm_48596_last_chunk_is_stored_after_finish() -> None:
    """vLLM #48596: the final chunk's store comes after the request finished; its blocks are
    free by then, so if they are handed out in that very step the job is flushed first."""
    d = ScriptedDirectory(64, "lru", answers=["none"])  # the store at finish time fails once
    r = Runner(block_size=4, num_gpu_blocks=3, directory=d)
    a = r.add("a", tokens(8))
    r.step()
    assert a.finished and not r.all("stored", "a")
    assert r.connector.tracked() == 1  # state kept for the store after finish
    r.add("b", tokens(8, 100))  # takes a's freed blocks in the same step
    r.step()
    assert r.records[1].stored["a"] == [(0, 0), (0, 1)]
    assert sorted(r.records[1].flushed["a"]) == [(0, 0), (0, 1)]
    r.run()
    assert r.connector.directory.stats().keys_stored >= 2
    r.drained()


def test_vllm_46951_every_allocation_path_feeds_the_fence() -> None:
    """The allocation seen by the load path must reach the fence (vLLM #46951's lesson)."""
    r = Runner(block_size=4, num_gpu_blocks=4)  # 3 usable blocks: b must reuse a's
    shared = tokens(8)
    r.offload("c", shared)  # the CPU tier holds c's two chunks, the GPU cache none
    a_blocks = finish_with_stores_pending(r, "a", tokens(8, 100))
    r.resume_copies()  # copies may run again, but only after this step's flush decision
    b = r.add("b", [*shared, 7])
    r.step()
    rec = r.records[-1]
    assert rec.loaded["b"]
    assert set(b.block_tables[0]) & a_blocks
    assert rec.flushed["a"] and set(rec.flushed["a"]) <= r.all("stored", "a")
    r.run()
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_preempt_then_readmit_before_the_flush_is_acked_is_deferred() -> None:
    # rank 1 reports every completion four steps late: the preempted request's stores stay
    # unfinished in the scheduler's books after the flush, and its lookup must wait for them
    r = Runner(block_size=4, num_gpu_blocks=6, tp=2, faults=("delay-acks:rank=1:steps=4",))
    make_preemption(r)
    r.resume_copies()
    deferred = r.connector.stats.deferred_lookups
    victim_loads = []
    for _ in range(60):
        if not r.engine.has_work():
            break
        pending = bool(r.in_flight("victim"))
        r.step()
        if r.records[-1].loaded.get("victim"):
            victim_loads.append(pending)
    assert r.connector.stats.deferred_lookups > deferred
    assert victim_loads and not any(victim_loads)  # never loaded while its stores were pending
    r.drained()
