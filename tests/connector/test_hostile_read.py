"""Regressions for the defects a hostile read of the connector found (issue 10), each named
after what went wrong; every one of them failed before its fix."""

from __future__ import annotations

from tests.connector.harness import Runner, tokens
from tests.connector.test_lifecycle import make_preemption


def outputs_without_offload(prompts: list[tuple[str, list[int], int]], **kwargs) -> list:
    r = Runner(offload=False, **kwargs)
    reqs = [r.add(req_id, prompt, n) for req_id, prompt, n in prompts]
    r.run()
    r.close()
    return [req.output for req in reqs]


def test_a_reused_request_id_never_gets_the_earlier_requests_kv() -> None:
    """Serving forgets finished requests (keep_finished false), so an id comes back. The new
    request must start with its own connector state, not the old one's keys and blocks: here
    the old `q` finished, `other` took its freed blocks, and the new `q` (another prompt) would
    have been handed a load of the old prompt's chunks into `other`'s blocks."""
    r = Runner(block_size=4, num_gpu_blocks=9, keep_finished=False)
    first = r.add("q", tokens(16))
    r.step()
    assert first.finished
    other = r.add("other", tokens(16, 100))
    again = r.add("q", tokens(16, 200))
    r.run()
    assert not any(rec.loaded.get("q") for rec in r.records[1:]), "old q's chunks loaded"
    assert r.engine.totals.transfer.mismatches == 0
    expected = outputs_without_offload(
        [("other", tokens(16, 100), 1), ("q", tokens(16, 200), 1)],
        block_size=4,
        num_gpu_blocks=9,
    )
    assert [other.output, again.output] == expected
    r.drained()


def test_a_reused_id_aborted_while_loading_does_not_take_the_new_requests_place() -> None:
    """The old `q` is aborted while its load is in flight (it keeps its blocks until the load
    lands) and a new `q` is admitted meanwhile: the old load's end must not touch the new one."""
    r = Runner(block_size=4, num_gpu_blocks=32, keep_finished=False)
    shared, other = tokens(16), tokens(16, 300)
    r.offload("seed", shared)
    r.offload("seed2", other)
    r.pause_copies()
    old = r.add("q", [*shared, 1])
    r.step()
    assert r.records[-1].loaded.get("q")
    r.engine.abort("q")
    new = r.add("q", [*other, 2])
    r.step()
    assert r.records[-1].loaded.get("q")
    r.resume_copies()
    r.run()
    assert old.output == [] and len(new.output) == 1
    assert r.engine.totals.transfer.mismatches == 0
    assert not r.engine.scheduler.loading
    r.drained()


def test_reset_with_a_sliding_window_never_stores_blocks_that_left_the_window() -> None:
    """reset_offload rewinds the store cursor of running requests; their sliding-window blocks
    that left the window (and were handed out again) must not be stored again from there."""
    groups = "[{kind: sliding_window, window_tokens: 5}]"
    r = Runner(
        block_size=4, groups=groups, num_gpu_blocks=5, max_num_batched_tokens=4, cpu_slots=64
    )
    prompt = tokens(40)
    a = r.add("a", prompt, max_tokens=2)
    r.step(6)  # chunks 0-5 computed and stored; the early blocks came back at later positions
    r.engine.reset_offload()
    r.run()
    assert a.finished
    checked, bad = r.workers.verify_cpu_tier(r.engine.cpu_tier_contents())
    assert checked > 0
    assert bad == 0, f"{bad} of {checked} blocks in the CPU tier hold another position's KV"
    r.drained()


def test_reset_with_full_and_sliding_groups_keeps_the_tier_byte_exact() -> None:
    groups = "[{kind: full_attention}, {kind: sliding_window, window_tokens: 6}]"
    r = Runner(
        block_size=4, groups=groups, num_gpu_blocks=24, max_num_batched_tokens=4, cpu_slots=64
    )
    a = r.add("a", tokens(40), max_tokens=2)
    b = r.add("b", tokens(40, 100), max_tokens=2)
    r.step(5)
    r.engine.reset_offload()
    r.run()
    assert a.finished and b.finished
    checked, bad = r.workers.verify_cpu_tier(r.engine.cpu_tier_contents())
    assert checked > 0 and bad == 0
    r.drained()


def sliding_hits(groups: str, threshold: int) -> int:
    r = Runner(
        block_size=4,
        groups=groups,
        num_gpu_blocks=32,
        cpu_slots=256,
        store_threshold=threshold,
    )
    prompt = tokens(32)
    for i in range(8):
        r.add(f"r{i}", [*prompt, 1000 + i])
        r.run()
        r.forget_gpu_blocks(prompt)
    hits = r.engine.scheduler.stats.cpu_hit_tokens
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()
    return hits


def test_store_threshold_counts_sliding_window_lookups() -> None:
    """The frequency filter passes keys looked up often enough; the keys the sliding-window
    groups check count as looked up too, or a threshold >= 2 never stores a sliding chunk (and
    with a full group beside it, nothing is ever loaded)."""
    for groups in (
        "[{kind: sliding_window, window_tokens: 8}]",
        "[{kind: full_attention}, {kind: sliding_window, window_tokens: 8}]",
    ):
        assert sliding_hits(groups, 0) > 0
        assert sliding_hits(groups, 2) > 0, groups


def test_a_request_with_jobs_in_flight_defers_its_lookup_past_the_deferral_budget() -> None:
    """DESIGN invariant 3: a request whose own jobs are in flight defers its lookup, also after
    its deferral budget is spent (that budget bounds waiting for other requests' writes; its own
    jobs end by themselves: acked, asked again, or failed with a rank declared dead)."""
    late = ("delay-acks:rank=1:steps=12",)
    r = Runner(block_size=4, num_gpu_blocks=6, tp=2, faults=late, max_wait_s=0)
    make_preemption(r)
    r.resume_copies()
    victim = r.engine.requests["victim"]
    answered_with_jobs = []
    for _ in range(80):
        if not r.engine.has_work():
            break
        if r.in_flight("victim") and victim in r.engine.scheduler.waiting:
            before = r.connector.stats.deferred_lookups
            r.step()
            if victim not in r.engine.scheduler.waiting:
                answered_with_jobs.append(r.engine.totals.steps)
            assert r.connector.stats.deferred_lookups > before or victim.finished
        else:
            r.step()
    assert not answered_with_jobs, f"admitted with jobs in flight at steps {answered_with_jobs}"
    assert victim.finished
    r.drained()
