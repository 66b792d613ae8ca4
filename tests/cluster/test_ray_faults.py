"""Dead ranks on Ray: a killed rank's actor really exits; the scheduler notices the failed step
call, fails what was in flight, replaces the rank (which maps the CPU-pool shard its predecessor
left in shared memory), and every request still produces its fault-free tokens, with nothing
left in the books and no lost bytes served."""

from __future__ import annotations

import os

import pytest
import ray

from raykv.cluster.client import RaykvClient
from raykv.config import load_config
from raykv.workload.requests import make_workload
from tests.cluster.test_ray_engine import SMALL, local_digest

pytestmark = pytest.mark.timeout(900)

SETS = [*SMALL, "parallel.tensor_parallel_size=2", "cache.num_gpu_blocks=40"]


@pytest.mark.parametrize(
    "fault",
    [
        "kill-worker:step=2:rank=0",  # the first stores of the first prefills in flight
        "kill-worker:step=30:rank=1",  # loads and stores in flight, flushes pending
        "kill-worker:rate=0.03:seed=7",
    ],
)
def test_killed_ranks_are_replaced_and_outputs_match_the_fault_free_run(ray_session, fault):
    cfg = load_config(None, [*SETS, f'faults=["{fault}"]'])
    with RaykvClient.start(cfg, verify=True, check_invariants=True) as client:
        report = client.run(make_workload(cfg), timeout_s=600)
        books = ray.get(client.server.books.remote(), timeout=60)
        checked, bad = ray.get(client.server.verify_cpu_tier.remote(), timeout=300)
    assert report["rank_restarts"] >= 1
    # each killed process really exited, so its replacement mapped the shard it left behind
    assert report["tier_kept_restarts"] == report["rank_restarts"]
    assert report["requests_finished"] == 40 and report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(SETS, False)
    assert books["jobs"] == books["fence"] == books["tracked"] == 0
    assert books["writing"] == books["reading"] == 0
    assert books["gpu_blocks_leaked"] == books["loading"] == 0
    assert bad == 0 and checked > 0


def test_a_silent_rank_is_killed_and_its_successor_maps_its_shard_once_it_exited(ray_session):
    # rank 1 answers every step but holds back every ack (its first incarnation only): it
    # counts as dead after rank_timeout_steps and is killed. It was alive when killed, so its
    # replacement waits for the old process to exit before it maps the old shard.
    silent = "delay-acks:rank=1:steps=1000000:incarnation=0"
    cfg = load_config(None, [*SETS, "engine.rank_timeout_steps=20", f'faults=["{silent}"]'])
    with RaykvClient.start(cfg, verify=True, check_invariants=True) as client:
        report = client.run(make_workload(cfg), timeout_s=600)
        _, bad = ray.get(client.server.verify_cpu_tier.remote(), timeout=300)
        files = client._pool_files
        shards = sorted(s for s in os.listdir(files.directory) if files.owner in s)
    assert report["rank_restarts"] == report["tier_kept_restarts"] == 1
    assert report["output_digest"] == local_digest(SETS, False)
    assert report["integrity"]["mismatches"] == 0 and bad == 0
    assert shards == [os.path.basename(files.path(r)) for r in (0, 1)]  # no new generation
    assert not [s for s in os.listdir(files.directory) if files.owner in s]  # shutdown cleaned


def expected_outputs(cfg, specs) -> dict[str, list[int]]:
    from raykv.engine.core import EngineCore
    from raykv.engine.workers import LocalWorkerGroup
    from raykv.runs.driver import run_workload

    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        run_workload(engine, specs)
        return {r.req_id: r.output for r in engine.requests.values()}


def test_a_dead_scheduler_is_replaced_and_every_request_still_streams_once(ray_session):
    # 120 requests arriving 2 per step: when the first has streamed, most have not arrived
    cfg = load_config(None, [*SETS, "workload.num_requests=120"])
    specs = make_workload(cfg)
    outputs: dict[str, list[int]] = {}
    with RaykvClient.start(cfg) as client:
        client.submit(specs)
        for req_id, tokens, _status in client.stream(timeout_s=600):
            assert req_id not in outputs, f"{req_id} streamed twice"
            outputs[req_id] = tokens
            if len(outputs) == 1:
                ray.kill(client.server, no_restart=True)  # the scheduler actor dies mid-stream
        restarts = client.scheduler_restarts
    assert restarts == 1
    assert outputs == expected_outputs(cfg, specs)


def test_a_dead_scheduler_mid_run_runs_the_workload_again(ray_session):
    # the scheduler actor's process exits after step 30 (injected); the client deploys anew
    sets = [*SETS, 'faults=["kill-scheduler:step=30"]']
    with RaykvClient.start(load_config(None, sets), verify=True) as client:
        report = client.run(make_workload(load_config(None, sets)), timeout_s=600)
    assert report["scheduler_restarts"] == 1
    assert report["requests_finished"] == 40 and report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(SETS, False)
