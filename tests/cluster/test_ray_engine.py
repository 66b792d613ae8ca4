"""raykv on a local Ray: scheduler and rank actors give the same tokens as the one-process
engine and as a run without offloading, acks may arrive late and out of order, outputs and KV
events stream to the client."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from raykv.cluster.client import RaykvClient
from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.run import run_workload
from raykv.engine.workers import LocalWorkerGroup
from raykv.offload.events import BlockStored
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


def ray_run(sets: list[str], hold=()) -> dict:
    cfg = load_config(None, sets)
    with RaykvClient.start(cfg, verify=True, check_invariants=True) as client:
        for rank, steps, every, offset in hold:
            client.hold_acks(rank, steps, every, offset)
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
    # rank 1 reports every other job 3 steps late, rank 2 every third job 1 step late: each job
    # completes only at full count, in a different order on every rank; the engine checks its
    # books after every step and every rank checks the fence before every write
    report = ray_run(sets, hold=[(1, 3, 2, 0), (2, 1, 3, 1)])
    assert report["acks"]["duplicate"] == 0 and report["acks"]["unknown"] == 0
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
    from raykv.cluster.bench import run_fanout_bench

    cfg = load_config(None, SMALL)
    result = run_fanout_bench(cfg, [2], steps=20, repeat=1)
    row = result["tensor_parallel"]["2"]
    assert row["steps"] == 20 and row["fanout_us"] > 0 and row["bare_us"] > 0
    assert row["plan_bytes"]["max"] >= row["plan_bytes"]["median"] > 0
    import ray

    assert ray.is_initialized()  # the bench used the session's Ray and left it running


def test_metrics_follow_the_engine(ray_session) -> None:
    from raykv.metrics import EngineMetrics

    sets = [*SMALL, "cache.num_gpu_blocks=32", "workload.num_requests=20"]
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        metrics = EngineMetrics(engine)
        run_workload(engine, make_workload(cfg), progress=lambda _: metrics.update())
    # every cumulative counter was turned into increments up to the engine's totals
    assert metrics._last["b_store"] == engine.totals.transfer.store_bytes
    assert metrics._last["hit_cpu"] == engine.scheduler.stats.cpu_hit_tokens
    assert engine.connector.take_delays() == ([], [])  # drained by the metrics


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
        name = "ray_raykv_kv_offload_hit_tokens_total"
        pattern = re.compile(rf'^{name}\{{[^}}]*tier="cpu"[^}}]*\}} (\S+)$')
        want = float(report["cpu_hit_tokens"])
        values: list[float] = []
        deadline = time.monotonic() + 90  # Ray exports every ~10 s
        # one series per scheduler actor (this session's other tests run their own): this
        # run's final count must show up among them
        while want not in values and time.monotonic() < deadline:
            time.sleep(2)
            body = urllib.request.urlopen(ray_session.metrics_url, timeout=10).read().decode()
            values = [float(m[1]) for line in body.splitlines() if (m := pattern.match(line))]
    assert want in values, f"{name} cpu series {values}, want {want}"
