"""The fence: when it is populated, when a reused block forces a flush, stale sliding-window
blocks (notes 7.4 and the bug shapes of section 8)."""

from __future__ import annotations

import pytest

from raykv.connector.fence import Fence, FenceError
from tests.connector.harness import Runner, tokens


def finish_with_stores_pending(r: Runner, req_id: str, prompt: list[int]) -> set[int]:
    """Run ``req_id`` to the end with its copies held back; return the blocks it held."""
    r.pause_copies()
    req = r.add(req_id, prompt)
    r.step()
    assert req.finished and r.in_flight(req_id)
    return set(r.state(req_id).groups[0].block_ids)


def test_fence_is_populated_when_a_request_with_stores_in_flight_finishes() -> None:
    r = Runner(block_size=4)
    r.pause_copies()
    a = r.add("a", tokens(9), max_tokens=6)
    r.step()
    assert r.in_flight("a") and not r.connector.fence  # running: its blocks are safe
    r.step(5)
    assert a.finished
    fenced = r.connector.fence.blocks()
    assert fenced and fenced <= set(r.state("a").groups[0].block_ids)
    r.resume_copies()
    r.run()
    r.drained()


def test_a_fresh_prefill_into_a_block_with_a_pending_store_flushes_it() -> None:
    r = Runner(block_size=4, num_gpu_blocks=3)
    a_blocks = finish_with_stores_pending(r, "a", tokens(8))
    r.resume_copies()
    r.add("b", tokens(8, 100))
    r.step()
    assert r.records[-1].gpu_blocks["b"] == a_blocks  # b stores from the blocks it reused
    assert sorted(r.records[-1].flushed["a"]) == r.records[0].stored["a"]
    r.run()
    r.drained()


def test_every_in_flight_store_of_a_request_is_flushed_when_its_blocks_are_reused() -> None:
    r = Runner(block_size=4, num_gpu_blocks=4)
    r.pause_copies()
    a = r.add("a", tokens(4), max_tokens=9)  # KV for 4 + 8 positions: a block per job
    while not a.finished:
        r.step()
    assert len(r.in_flight("a")) == 3
    r.add("b", tokens(12, 100))
    r.step()  # b takes all three blocks at once: every job on them is flushed
    assert set(r.records[-1].flushed["a"]) == r.all("stored", "a") == {(0, 0), (0, 1), (0, 2)}
    r.resume_copies()
    r.run()
    r.drained()


def test_sliding_window_blocks_are_fenced_at_creation_full_attention_at_finish() -> None:
    groups = "[{kind: full_attention}, {kind: sliding_window, window_tokens: 8}]"
    r = Runner(block_size=4, groups=groups)
    r.pause_copies()
    r.add("a", tokens(12), max_tokens=3)
    r.step()
    jobs = [r.connector.jobs.jobs[j] for j in r.in_flight("a")]
    assert jobs and all(j.fenced_block_ids and j.deferred_fence_block_ids for j in jobs)
    swa = {b for j in jobs for b in j.fenced_block_ids}
    full = {b for j in jobs for b in j.deferred_fence_block_ids}
    assert r.connector.fence.blocks() == swa  # the running request still protects the rest
    r.step(3)
    assert r.connector.fence.blocks() >= swa | full
    r.resume_copies()
    r.run()
    r.drained()


def test_fence_books_are_strict() -> None:
    fence = Fence()
    fence.add(1, [10, 11])
    with pytest.raises(FenceError, match="twice"):
        fence.add(1, [11])
    with pytest.raises(FenceError, match="never registered"):
        fence.remove(2, [10])
    assert fence.jobs_on([10, 12]) == {1}
    fence.remove(1, [10, 11])
    assert not fence
