"""Preemption, acks across ranks, reset, and the request lifecycle (notes 7.5-7.7, 2.9-2.10)."""

from __future__ import annotations

from raykv.connector.jobs import JobTable
from raykv.core.request import Request, RequestStatus
from raykv.core.step import StepReport, TransferReport
from tests.connector.harness import Runner, tokens


def make_preemption(r: Runner) -> None:
    """'long' runs first and keeps growing; 'victim' (admitted after it) is preempted when the
    pool runs dry while its stores are still in flight."""
    r.add("long", tokens(8), max_tokens=12)
    r.step()
    r.pause_copies()
    r.add("victim", tokens(8, 100), max_tokens=6)
    for _ in range(20):
        r.step()
        if r.engine.scheduler.stats.preemptions:
            return
    raise AssertionError("no preemption happened")


def test_preemption_flushes_in_flight_stores_and_the_request_reloads_them() -> None:
    r = Runner(block_size=4, num_gpu_blocks=6)  # 5 usable blocks for two requests
    make_preemption(r)
    victim = r.engine.requests["victim"]
    assert victim.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    flushed = r.all("flushed", "victim")
    assert flushed and flushed <= r.all("stored", "victim")
    assert r.connector.stats.flushes_preemption >= 1
    r.resume_copies()
    r.run()
    assert r.all("loaded", "victim")  # it came back from the CPU tier, not by recomputing all
    assert victim.finished and r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_job_finishes_only_when_every_rank_acked_it_once() -> None:
    table = JobTable(num_ranks=3)
    job = table.create("r", [1, 2], is_store=True)
    assert table.ack(job.job_id, 0) is None
    assert job.pending_count == 2
    assert table.ack(job.job_id, 0) is None  # a duplicate counts nothing
    assert table.stats.duplicate == 1 and job.pending_count == 2
    assert table.ack(job.job_id, 1) is None
    assert table.ack(job.job_id, 2, ok=False) is job  # final, and failed
    assert job.failed and job.job_id not in table.jobs
    assert table.ack(job.job_id, 2) is None and table.stats.unknown == 1
    assert table.ack(99, 7) is None and table.stats.bad_rank == 1
    table.create("r", [3], is_store=False)
    stale = table.reset()
    assert [j.job_id for j in stale] == [1]
    assert table.ack(1, 0) is None and table.stats.stale == 1


def test_engine_completes_a_job_only_after_the_slow_rank_reports() -> None:
    r = Runner(block_size=4, tp=3, faults=("delay-acks:rank=2:steps=3",))
    r.add("a", tokens(8))
    r.step()
    job_id = r.records[0].plan.stores[0].job_id
    for _ in range(3):
        job = r.connector.jobs.jobs[job_id]
        assert job.pending_count == 1 and job.acked_ranks == 0b011
        assert not r.connector.directory.is_readable(next(iter(job.keys)))
        r.step()
    assert job_id not in r.connector.jobs.jobs
    r.run()
    r.drained()


def test_unknown_and_duplicate_reports_are_counted_and_ignored() -> None:
    r = Runner(block_size=4, tp=2)
    r.add("a", tokens(8))
    r.run()
    bogus = StepReport(0, 99, TransferReport(completed=[12345], failed=[]))
    assert r.connector.process_reports([bogus, bogus]) == []
    assert r.connector.jobs.stats.unknown == 2
    r.drained()


def load_and_store_in_flight() -> tuple[Runner, Request, Request]:
    """Request a's chunks are in the CPU tier (not on the GPU); b is loading them and c storing
    its own, with the copies really pending."""
    r = Runner(block_size=4, num_gpu_blocks=32)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.pause_copies()
    b = r.add("b", [*prompt, 1])
    c = r.add("c", tokens(9, 200), max_tokens=8)
    r.step()
    return r, b, c


def test_reset_flushes_everything_in_flight_and_ignores_late_acks() -> None:
    r, b, c = load_and_store_in_flight()
    in_flight = set(r.connector.jobs.jobs)
    assert b.load_job is not None and in_flight
    r.engine.reset_offload()
    assert len(r.connector.jobs) == 0 and not r.connector.fence
    assert len(r.connector.directory) == 0
    # its load was abandoned: it gave its blocks back and waits to recompute
    assert b.status is RequestStatus.PREEMPTED and not any(b.block_tables)
    r.step()
    assert set(r.records[-1].plan.flush) == in_flight  # the next step drains old work first
    r.resume_copies()
    r.run()
    assert r.connector.jobs.stats.stale >= len(in_flight)
    assert b.finished and c.finished
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_a_restart_with_shards_intact_fails_only_what_was_in_flight() -> None:
    r, b, c = load_and_store_in_flight()
    d = r.connector.directory
    readable = d.readable_keys()
    writing = d.stats().writing
    assert readable and writing and b.load_job is not None
    in_flight = set(r.connector.jobs.jobs)
    r.engine.recover([0])  # a real replacement rank, mapping its predecessor's pool file
    assert r.engine.totals.tier_kept_restarts == 1
    assert d.readable_keys() == readable  # what was written stays readable
    assert d.stats().writing == 0 and d.stats().reading == 0  # what was in flight is gone
    assert len(r.connector.jobs) == 0 and not r.connector.fence
    r.step()
    assert set(r.records[-1].plan.flush) == in_flight
    r.resume_copies()
    r.run()
    assert b.finished and c.finished
    assert r.engine.scheduler.stats.cpu_hit_tokens >= 12  # b loaded a's chunks again
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_a_finished_request_is_forgotten_only_after_its_last_job() -> None:
    r = Runner(block_size=4)
    r.pause_copies()
    a = r.add("a", tokens(8))
    r.step(3)
    assert a.finished and r.connector.tracked() == 1
    r.resume_copies()
    r.step(2)
    assert r.connector.tracked() == 0
    r.drained()


def test_steps_go_on_without_blocking_while_only_transfers_remain() -> None:
    r = Runner(block_size=4, faults=("delay-acks:rank=0:steps=5",))
    r.add("a", tokens(8))
    r.step()
    assert r.engine.requests["a"].finished
    idle_before = r.engine.totals.idle_steps
    r.run()
    assert r.engine.totals.idle_steps - idle_before >= 4  # polled, never blocked
    r.drained()
