"""What an engine keeps per request and per token is bounded however long it serves (issue 28,
finding 2): latency values in a bounded sample (exact up to its capacity), the latest
first-token records and refusals of a server, and the KV events nobody takes. The served
replica's whole picture is ``tests/serve/test_hostile_requests.py``."""

from __future__ import annotations

import random
import statistics

from raykv.config import load_config
from raykv.core.kv_events import EventLog
from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.engine.latency import LatencyBook, Samples, percentile
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import REJECTED_KEPT, Driver
from raykv.workload.requests import RequestSpec


def test_issue28_2_samples_are_exact_up_to_their_capacity_then_a_bounded_uniform_sample() -> None:
    rng = random.Random(4)
    values = [rng.expovariate(3.0) for _ in range(200_000)]
    small = Samples(capacity=1000)
    for v in values[:1000]:
        small.add(v)
    assert sorted(small.kept) == sorted(values[:1000])  # every value while they fit
    exact = sorted(values[:1000])
    assert small.summary().p90 == percentile(exact, 90)
    big = Samples(capacity=4096)
    for v in values:
        big.add(v)
    assert len(big.kept) == 4096 and big.count == len(values)
    summary = big.summary()
    assert abs(summary.mean - statistics.fmean(values)) < 1e-9  # the mean stays exact
    ordered = sorted(values)
    for q, got in ((50, summary.p50), (90, summary.p90), (99, summary.p99)):
        want = percentile(ordered, q)
        assert abs(got - want) < 0.08 * want, (q, got, want)


def test_issue28_2_a_server_keeps_only_its_latest_first_token_records() -> None:
    book = LatencyBook(samples=64, max_records=100)
    for i in range(1000):
        req = Request(f"r{i}", i, [1, 2], 3)
        req.arrival_s = float(i)
        book.sampled(req, i + 0.5)
        book.sampled(req, i + 0.75)
    assert len(book.requests) == 100 and book.requests[0].req_id == "r900"
    assert book.record_of("r999").ttft_s == 0.5 and book.record_of("r3") is None
    assert len(book.ttft.kept) == len(book.itl.kept) == 64
    assert book.ttft.count == book.itl.count == 1000
    assert book.report()["ttft_s"]["mean"] == 0.5


def test_issue28_2_events_nobody_takes_are_dropped_and_a_later_reader_sees_the_gap() -> None:
    log = EventLog(max_buffered=100)
    seen_before = log.next_seq
    for key in range(1000):
        (log.stored if key % 2 else log.removed)([key], "GPU")
    assert log.buffered <= 100 and log.dropped > 0
    events = log.take()
    assert events and events[0].seq > seen_before  # a gap: the reader asks for a snapshot
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))


def test_issue28_2_a_server_keeps_its_latest_refusals_and_counts_them_all() -> None:
    cfg = load_config(None, ["engine.keep_finished=false", "cache.num_gpu_blocks=16"])
    bad = cfg.model.vocab_size + 1
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        driver = Driver(EngineCore(cfg, workers))
        count = REJECTED_KEPT + 500
        driver.submit([RequestSpec(f"bad{i}", (bad,), 1, 0) for i in range(count)])
        driver.step()
        taken = driver.take_rejected()
    assert len(taken) == count and driver.rejected_count == count
    assert len(driver.rejected) == REJECTED_KEPT
    assert driver.rejected[-1]["request"] == f"bad{count - 1}"
    assert driver.take_rejected() == []
