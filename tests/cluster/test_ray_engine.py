"""raykv on a local Ray: scheduler and rank actors give the same tokens as the one-process
engine and as a run without offloading, acks may arrive late and out of order, outputs and KV
events stream to the client."""

from __future__ import annotations

import ipaddress

import msgspec
import psutil
import pytest

from raykv.cluster.client import RaykvClient
from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.offload.events import BlockStored
from raykv.runs.driver import run_workload
from raykv.workload.requests import make_workload

pytestmark = pytest.mark.timeout(600)

SMALL = [
    "workload.num_requests=40",
    "workload.system_prompt_tokens=64",
    "workload.user_tokens=20",
    "workload.answer_tokens=12",
    "workload.max_tokens=6",
    "model.head_dim=8",
]


def local_digest(sets: list[str], offload: bool) -> str:
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers, offload=offload)
        return run_workload(engine, make_workload(cfg))["output_digest"]


def ray_run(sets: list[str]) -> dict:
    cfg = load_config(None, sets)
    with RaykvClient.start(cfg, verify=True, check_invariants=True) as client:
        return client.run(make_workload(cfg), timeout_s=400)


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def test_embedded_ray_listens_on_loopback_only(ray_session) -> None:
    ray_pids = {
        p.pid
        for p in psutil.process_iter(["name", "cmdline"])
        if any("ray" in part for part in (p.info["cmdline"] or []) + [p.info["name"] or ""])
    }
    listening = [
        c
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in ray_pids
    ]
    assert listening, "found no Ray listener to check"
    exposed = [f"{c.laddr.ip}:{c.laddr.port}" for c in listening if not _loopback(c.laddr.ip)]
    assert not exposed, f"Ray listens beyond loopback: {exposed}"


def test_tp2_gives_the_tokens_of_the_local_engine_and_of_no_offload(ray_session) -> None:
    sets = [*SMALL, "parallel.tensor_parallel_size=2", "cache.num_gpu_blocks=48"]
    report = ray_run(sets)
    assert report["requests_finished"] == 40
    assert report["cpu_hit_tokens"] > 0
    assert report["integrity"]["mismatches"] == 0 and report["integrity"]["blocks_verified"] > 0
    assert report["output_digest"] == local_digest(sets, True) == local_digest(sets, False)
    assert len(report["ranks"]) == 2 and all(r["store_blocks"] > 0 for r in report["ranks"])


def test_tp4_tiny_pool_forces_reuse_flushes_and_preemptions(ray_session) -> None:
    sets = [
        *SMALL,
        "parallel.tensor_parallel_size=4",
        "cache.num_gpu_blocks=24",
        "cache.block_size=8",
        "workload.num_requests=50",
    ]
    report = ray_run(sets)
    assert report["flushes"]["reuse"] > 0 and report["preemptions"] > 0
    assert report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(sets, False)


def test_late_and_out_of_order_acks_across_ranks(ray_session) -> None:
    sets = [*SMALL, "parallel.tensor_parallel_size=3", "model.num_kv_heads=6"]
    sets += ["cache.num_gpu_blocks=32", "cache.block_size=8"]
    # rank 1 reports about every other job 3 steps late, rank 2 about every third job 1 step
    # late: each job completes only at full count, in a different order on every rank; the
    # engine checks its books after every step and every rank checks the fence before every write
    late = [
        "delay-acks:rank=1:steps=3:rate=0.5:seed=1",
        "delay-acks:rank=2:steps=1:rate=0.34:seed=2",
    ]
    report = ray_run([*sets, "faults=[" + ",".join(f'"{f}"' for f in late) + "]"])
    assert report["acks"]["duplicate"] == 0 and report["acks"]["unknown"] == 0
    assert report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(sets, False)


def test_chunks_found_bad_below_the_cpu_tier_leave_it_over_the_wire(ray_session, disk_dir):
    """A rank that finds a chunk's file spoiled reports its key to the scheduler, which drops
    just that chunk from the tier; on Ray the key crosses the wire (a 72-bit key there ended
    the run with an OverflowError, as a shared part missing after its master restarted did)."""
    sets = [
        *SMALL,
        "parallel.tensor_parallel_size=2",
        "cache.num_gpu_blocks=48",
        "offload.cpu_slots=24",  # the CPU tier churns: promotions from the disk
        "offload.take_hits=always",
        "offload.disk.enabled=true",
        f"offload.disk.path={disk_dir}",
        "offload.disk.capacity=8MiB",
    ]
    report = ray_run([*sets, 'faults=["corrupt-disk:rate=0.5:seed=2"]'])
    assert report["tiers"]["disk"]["corrupt"] > 0, report["tiers"]["disk"]
    assert report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(sets, False)


def test_serving_streams_outputs_and_kv_events(ray_session) -> None:
    sets = [*SMALL, "parallel.tensor_parallel_size=2", "cache.num_gpu_blocks=48"]
    cfg = load_config(None, sets)
    specs = make_workload(cfg)
    with RaykvClient.start(cfg) as client:
        client.submit(specs[:20])
        client.submit(specs[20:])
        outputs = {req_id: tokens for req_id, tokens, _status in client.stream(timeout_s=300)}
        events = client.events()
    assert set(outputs) == {s.req_id for s in specs}
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        run_workload(engine, specs)
        expected = {r.req_id: r.output for r in engine.requests.values()}
    assert outputs == expected
    assert any(isinstance(e, BlockStored) for e in events)
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))


def test_fanout_bench_reports_ratio_and_plan_sizes(ray_session) -> None:
    from raykv.cluster.bench import format_fanout_table, run_fanout_bench

    cfg = load_config(None, SMALL)
    result = run_fanout_bench(cfg, [2], steps=20, repeat=1)
    (row,) = result["results"]
    assert row["tp"] == 2 and row["steps"] == 20
    for way in ("graph_us", "plain_us", "bare_graph_us", "bare_plain_us"):
        assert row[way] > 0
    assert row["graph_over_bare"] == row["graph_us"] / row["bare_graph_us"]
    assert row["graph_over_plain"] == row["graph_us"] / row["plain_us"]
    assert row["plan_bytes_max"] >= row["plan_bytes_median"] > 0
    assert "graph/plain" in format_fanout_table(result)
    import ray

    assert ray.is_initialized()  # the bench used the session's Ray and left it running


class Recorded:
    """Stands in for a ``ray.util.metrics`` metric: keeps every value it is given, by tags."""

    made: dict[str, Recorded] = {}

    def __init__(self, name: str, description: str, *rest: object) -> None:
        self.name, self.description = name, description
        self.calls: list[tuple[str, float, dict[str, str]]] = []
        Recorded.made[name] = self

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("inc", value, dict(tags or {})))

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("observe", value, dict(tags or {})))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("set", value, dict(tags or {})))

    def values(self, **tags: str) -> list[float]:
        return [v for _, v, t in self.calls if all(t.get(k) == w for k, w in tags.items())]

    def total(self, **tags: str) -> float:
        return sum(self.values(**tags))


def recorded_metrics(monkeypatch):
    """``raykv.cluster.metrics`` with ``Recorded`` in place of Ray's metric classes."""
    import raykv.cluster.metrics as m

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(m, kind, Recorded)
    Recorded.made = {}
    return m


def test_metrics_export_what_the_run_report_counts(monkeypatch) -> None:
    """What the engine hands Ray's metrics API, per metric and tag, against the run report's
    own numbers (and per-rank, per-step copies the test samples itself): a metric that is not
    exported, or exported under another convention, fails here. The config is one where every
    counter moves (reuse, preemption and reset flushes; unknown, stale and duplicate acks;
    allocation failures, evictions, pending hits, deferred lookups), so none compares 0 to 0."""
    m = recorded_metrics(monkeypatch)
    sets = [
        *SMALL,
        "parallel.tensor_parallel_size=2",
        "cache.num_gpu_blocks=32",
        "cache.block_size=8",
        "workload.num_requests=50",
        "offload.cpu_slots=20",
        "offload.take_hits=always",  # loads whatever they cost: every counter moves
        # rank 1 reports about every third job 3 steps late
        'faults=["dup-acks:rate=0.05:seed=3","kill-worker:step=20:rank=1",'
        '"fail-copy:rate=0.05:seed=2","delay-acks:rank=1:steps=3:rate=0.34:seed=4"]',
    ]
    cfg = load_config(None, sets)
    exec_delays = {0: lambda job: 4 if job % 2 == 0 else 0}  # rank 0: every other copy pending
    steps: list[dict] = []
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), exec_delays=exec_delays, threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        metrics = m.EngineMetrics(engine)

        def after_step(_progress: dict) -> None:
            metrics.update()
            c = engine.connector
            per_rank = [msgspec.structs.asdict(r) for r in engine.totals.per_rank]
            steps.append({"ranks": per_rank, "jobs": len(c.jobs)})

        report = run_workload(engine, make_workload(cfg), progress=after_step)
        lookups = engine.connector.directory.stats()
        assert engine.connector.take_delays() == ([], [])  # drained by the metrics
    got = {name.removeprefix("raykv_kv_offload_"): r for name, r in Recorded.made.items()}
    approx = pytest.approx

    # bytes and seconds: counters summed over all ranks
    for direction, key in (("store", "stores"), ("load", "loads")):
        assert report[key]["bytes"] > 0
        assert got["bytes"].total(direction=direction) == report[key]["bytes"]
        assert got["seconds"].total(direction=direction) == approx(report[key]["seconds"])
        ranks_bytes = sum(r[f"{direction}_bytes"] for r in report["ranks"])
        assert ranks_bytes == report[key]["bytes"]
        # histograms: one observation per rank and step that copied, that rank's own amount
        for hist, field in (("transfer_size_bytes", "bytes"), ("transfer_time_seconds", "seconds")):
            name = f"{direction}_{field}"
            want, prev = [], [0] * len(report["ranks"])
            for step in steps:
                for rank, stats in enumerate(step["ranks"]):
                    if stats[name] - prev[rank] > 0:
                        want.append(stats[name] - prev[rank])
                    prev[rank] = stats[name]
            assert sorted(got[hist].values(direction=direction)) == approx(sorted(want)), hist
    flush_s = sum(r["flush_seconds"] for r in report["ranks"])
    assert flush_s > 0 and got["flush_seconds"].total() == approx(flush_s)

    # tokens by tier; everything admitted and found nowhere was computed
    assert report["cpu_hit_tokens"] > 0 and report["gpu_hit_tokens"] > 0
    assert got["hit_tokens"].total(tier="cpu") == report["cpu_hit_tokens"]
    assert got["hit_tokens"].total(tier="gpu") == report["gpu_hit_tokens"]
    missed = report["admitted_tokens"] - report["gpu_hit_tokens"] - report["cpu_hit_tokens"]
    assert missed > 0 and got["miss_tokens"].total() == missed

    for cause in ("reuse", "preemption", "reset"):
        assert report["flushes"][cause] > 0, cause
        assert got["flushes"].total(cause=cause) == report["flushes"][cause], cause
    for kind in ("acks", "unknown", "stale", "duplicate"):
        assert report["acks"][kind] > 0, kind
        assert got["acks"].total(kind=kind) == report["acks"][kind], kind
    for metric, want in (
        ("allocation_failure", report["allocation_failures"]),
        ("deferred_lookups", report["deferred_lookups"]),
        ("evictions", report["cpu_tier"]["evictions"]),
    ):
        assert want > 0 and got[metric].total() == want, metric
    for result, want in (
        ("hit", lookups.hits),
        ("hit_pending", lookups.hit_pending),
        ("miss", lookups.misses),
    ):
        assert want > 0 and got["lookups"].total(result=result) == want, result
    assert len(got["lookup_sync_delay_seconds"].values()) > 0
    assert len(got["lookup_async_delay_seconds"].values()) > 0

    # gauges: the value after every step
    jobs = got["jobs_in_flight"].values()
    assert jobs == [s["jobs"] for s in steps] and max(jobs) > 0 and jobs[-1] == 0
    used = 100.0 * report["cpu_tier"]["used"] / report["cpu_tier"]["slots"]
    assert got["cpu_cache_usage_perc"].values(state="used")[-1] == approx(used)
    for state in ("writing", "reading"):
        series = got["cpu_cache_usage_perc"].values(state=state)
        assert len(series) == len(steps) and max(series) > 0 and series[-1] == 0, state


def test_the_disk_tier_s_metrics_export_what_the_run_report_counts(monkeypatch, disk_dir) -> None:
    """The disk tier's metrics (its I/O bytes and seconds each way, the chunks moved, the hits
    by tier and the prefill by source) against the run report's own numbers; each compared
    value is checked to be non-zero first."""
    m = recorded_metrics(monkeypatch)
    sets = [
        *SMALL,
        "parallel.tensor_parallel_size=2",
        "cache.num_gpu_blocks=48",
        "workload.num_requests=48",
        "offload.cpu_slots=24",
        "offload.take_hits=always",
        "offload.disk.enabled=true",
        f"offload.disk.path={disk_dir}",
        "offload.disk.capacity=8MiB",
    ]
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers)
        metrics = m.EngineMetrics(engine)
        report = run_workload(engine, make_workload(cfg), progress=lambda _p: metrics.update())
        metrics.update()
    got = {name.removeprefix("raykv_kv_offload_"): r for name, r in Recorded.made.items()}
    disk = report["tiers"]["disk"]
    assert report["disk_hit_tokens"] > 0
    assert got["hit_tokens"].total(tier="disk") == report["disk_hit_tokens"]
    assert got["raykv_prefill_tokens"].total(source="disk_tier") == report["disk_hit_tokens"]
    for direction in ("read", "write"):
        assert disk[direction + "_bytes"] > 0
        assert got["disk_bytes"].total(direction=direction) == disk[direction + "_bytes"]
    assert disk["promoted_chunks"] > 0 and disk["demoted_chunks"] > 0
    assert got["tier_moves"].total(kind="promoted") == disk["promoted_chunks"]
    assert got["tier_moves"].total(kind="demoted") == disk["demoted_chunks"]
    assert got["disk_cache_usage_perc"].values()[-1] == pytest.approx(
        100 * disk["used_chunks"] / disk["capacity_chunks"]
    )


def test_metrics_reach_the_embedded_instances_prometheus_endpoint(ray_session) -> None:
    import re
    import time
    import urllib.request

    assert ray_session.metrics_url and ray_session.metrics_url.startswith("http://127.0.0.1:")
    sets = [*SMALL, "parallel.tensor_parallel_size=2", "cache.num_gpu_blocks=48"]
    cfg = load_config(None, sets)
    with RaykvClient.start(cfg) as client:
        report = client.run(make_workload(cfg), timeout_s=300)
        assert report["cpu_hit_tokens"] > 0
        # counters are exact (a histogram's _sum is not: Ray 2.60 rebuilds it from bucket
        # midpoints)
        series = {
            ("ray_raykv_kv_offload_hit_tokens_total", 'tier="cpu"'): report["cpu_hit_tokens"],
            ("ray_raykv_kv_offload_bytes_total", 'direction="store"'): report["stores"]["bytes"],
            ("ray_raykv_prefill_tokens_total", 'source="computed"'): (
                report["prefill_tokens"]["computed"]
            ),
            ("ray_raykv_prefill_tokens_total", 'source="cpu_tier"'): report["cpu_hit_tokens"],
            # one TTFT observation per finished request
            ("ray_raykv_time_to_first_token_seconds_count", ""): report["requests_finished"],
        }
        found: dict[tuple[str, str], list[float]] = {}
        deadline = time.monotonic() + 90  # Ray exports every ~10 s
        # one series per scheduler actor (this session's other tests run their own): this
        # run's final count must show up among them
        while time.monotonic() < deadline:
            time.sleep(2)
            body = urllib.request.urlopen(ray_session.metrics_url, timeout=10).read().decode()
            for name, tag in series:
                pattern = re.compile(rf"^{name}\{{[^}}]*{tag}[^}}]*\}} (\S+)$")
                found[name, tag] = [
                    float(m[1]) for line in body.splitlines() if (m := pattern.match(line))
                ]
            if all(float(want) in found[key] for key, want in series.items()):
                break
    for key, want in series.items():
        assert float(want) in found[key], f"{key} series {found[key]}, want {want}"
