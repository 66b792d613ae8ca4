"""Time to first token and inter-token latency: the book's arithmetic on a clock the test
drives (a fake clock, to give exact times), and the run report's latency fields from a real
run, checked against the run's own counts."""

from __future__ import annotations

import statistics

from raykv.core.request import Request
from raykv.engine.latency import LatencyBook, LatencySummary, percentile
from tests.engine.test_engine_core import SMALL, run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ttft_counts_from_arrival_and_each_later_token_adds_one_itl_sample() -> None:
    clock = Clock()
    book = LatencyBook(clock=clock)
    a, b = Request("a", 0, [1, 2, 3], 3), Request("b", 1, [4, 5], 2)
    clock.now = 101.0
    book.arrived(a)
    clock.now = 101.5
    book.arrived(b)
    for now, reqs in ((102.0, [a]), (102.25, [a, b]), (103.0, [a, b])):
        for req in reqs:
            book.sampled(req, now)
    assert list(book.ttft.kept) == [1.0, 0.75]  # a: 102 - 101; b: 102.25 - 101.5
    assert list(book.itl.kept) == [0.25, 0.75, 0.75]  # a: 0.25 then 0.75; b: 0.75
    first = book.requests[0]
    assert (first.req_id, first.arrival_s, first.prompt_tokens) == ("a", 1.0, 3)
    assert book.report()["ttft_s"]["mean"] == 0.875


def test_percentiles_interpolate_as_the_inclusive_method_does() -> None:
    values = sorted([0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.05])
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (50, 90, 99):
        assert abs(percentile(values, q) - cuts[q - 1]) < 1e-12
    summary = LatencySummary.of(values)
    assert summary is not None and summary.p50 == 0.3 and LatencySummary.of([]) is None


def test_the_run_report_has_a_ttft_per_request_and_itl_per_later_token() -> None:
    report = run(SMALL, offload=True)
    finished = report["requests_finished"]
    assert len(report["requests"]) == finished
    ids = {r["req_id"] for r in report["requests"]}
    assert len(ids) == finished
    ttft, itl = report["ttft_s"], report["itl_s"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert 0 < itl["p50"] <= itl["p99"]
    per_request = [r["ttft_s"] for r in report["requests"]]
    assert abs(ttft["mean"] - sum(per_request) / len(per_request)) < 1e-9
    prefill = report["prefill_tokens"]
    assert prefill["gpu_cache"] == report["gpu_hit_tokens"]
    assert prefill["cpu_tier"] == report["cpu_hit_tokens"] > 0
    assert sum(prefill.values()) == report["admitted_tokens"]
    hits = sum(r["cpu_hit_tokens"] for r in report["requests"])
    assert 0 < hits <= report["cpu_hit_tokens"]  # first admissions only
    rate = report["throughput"]["generated_tokens_per_s"]
    assert abs(rate * report["wall_seconds"] - report["generated_tokens"]) < 1e-6 * rate + 1e-6


def test_a_trace_replayed_at_its_timestamps_arrives_on_the_wall_clock(mooncake_trace) -> None:
    from raykv.config import load_config
    from raykv.engine.core import EngineCore
    from raykv.engine.workers import LocalWorkerGroup
    from raykv.runs.driver import run_workload
    from raykv.workload.requests import make_workload
    from raykv.workload.trace import read_trace

    base = ["workload.kind=trace", f"workload.trace={mooncake_trace}", "workload.num_requests=20"]
    base += ["workload.trace_tokens_per_block=16", "workload.max_tokens=4"]
    scale = 0.002  # the first 20 requests' 1.9 s of trace in about 4 ms per recorded second
    reports = []
    for extra in ([], [f"workload.trace_time_scale={scale}"]):
        cfg = load_config(None, [*base, *extra])
        with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
            reports.append(run_workload(EngineCore(cfg, workers), make_workload(cfg)))
    by_steps, by_clock = reports
    assert by_clock["output_digest"] == by_steps["output_digest"]  # timing changes no token
    stamps = [r.timestamp for r in read_trace(mooncake_trace, limit=20)]
    arrivals = {r["req_id"]: r["arrival_s"] for r in by_clock["requests"]}
    for i, stamp in enumerate(stamps):
        due = (stamp - stamps[0]) / 1000 * scale
        # arrival is the scheduled time, measured from the first submission, not the moment a
        # busy engine got round to it
        assert abs(arrivals[f"trace-{i}"] - arrivals["trace-0"] - due) < 1e-6
