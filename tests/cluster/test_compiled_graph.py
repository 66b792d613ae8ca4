"""The control plane on a Ray Compiled Graph (``parallel.control_plane``): the same tokens as
plain calls and as the one-process engine; ranks that die or hang are found through the graph,
replaced, and the graph compiled again; where a graph cannot be compiled the group says so and
goes on with plain calls. Real rank actors, real graphs."""

from __future__ import annotations

import time

import pytest
import ray

from raykv.cluster import wire
from raykv.cluster.client import RaykvClient
from raykv.cluster.compiled_group import CompiledWorkerGroup
from raykv.config import load_config
from raykv.core.step import StepPlan, StepReport
from raykv.engine.ranks import RankFailed
from raykv.workload.requests import make_workload
from tests.cluster.test_ray_engine import SMALL, local_digest

pytestmark = pytest.mark.timeout(900)

SETS = [*SMALL, "parallel.tensor_parallel_size=2", "cache.num_gpu_blocks=40"]


def _run(sets: list[str]) -> dict:
    cfg = load_config(None, sets)
    with RaykvClient.start(cfg, verify=True, check_invariants=True) as client:
        return client.run(make_workload(cfg), timeout_s=600)


@pytest.mark.parametrize("plane", ["graph", "calls"])
def test_both_control_planes_give_the_one_process_engines_tokens(ray_session, plane) -> None:
    report = _run([*SETS, f"parallel.control_plane={plane}"])
    assert report["control_plane"] == plane
    assert report["requests_finished"] == 40 and report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(SETS, True)
    assert report["cpu_hit_tokens"] > 0


@pytest.mark.parametrize("plane", ["graph", "calls"])
def test_planning_ahead_on_rank_actors_survives_a_death_with_the_same_tokens(
    ray_session, plane
) -> None:
    # engine.async_scheduling: each step planned while the rank actors run the one before;
    # rank 1 dies in step 10, with the step after it already planned (and lost)
    faults = 'faults=["kill-worker:step=10:rank=1"]'
    sets = [*SETS, f"parallel.control_plane={plane}", "engine.async_scheduling=true", faults]
    report = _run(sets)
    assert report["control_plane"] == plane
    assert report["rank_restarts"] == 1
    assert report["requests_finished"] == 40 and report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(SETS, True)


@pytest.mark.parametrize("plane", ["graph", "calls"])
def test_a_rank_that_hangs_past_the_step_timeout_is_replaced(ray_session, plane) -> None:
    # rank 1 sleeps 60 s in step 12; at a 4 s step timeout it is dead long before it wakes
    faults = 'faults=["stall-worker:step=12:rank=1:seconds=60"]'
    sets = [*SETS, f"parallel.control_plane={plane}", "parallel.step_timeout_s=4", faults]
    started = time.monotonic()
    report = _run(sets)
    assert time.monotonic() - started < 60  # nobody waited for the sleeper
    assert report["rank_restarts"] == 1
    assert report["control_plane"] == plane  # the graph was compiled again for the new rank
    assert report["requests_finished"] == 40 and report["integrity"]["mismatches"] == 0
    assert report["output_digest"] == local_digest(SETS, True)


class _Echo:
    """A rank that replies to every plan, one that dies on request, or one that hangs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.last: tuple[int, bytes] | None = None

    def execute_blob(self, blob: bytes) -> bytes:
        plan: StepPlan = wire.decode_plan(blob)
        if plan.step == 3 and self.rank == 1:
            time.sleep(30)  # hangs past the group's 2 s step timeout
        reply = wire.encode(StepReport(self.rank, plan.step))
        self.last = (plan.step, reply)
        return reply

    def reply_to(self, step: int) -> bytes | None:
        return self.last[1] if self.last is not None and self.last[0] == step else None

    def ready(self) -> None:
        return None


def test_the_graph_reports_the_silent_rank_and_keeps_the_survivors_replies(ray_session) -> None:
    actors = [ray.remote(_Echo).options(num_cpus=0).remote(r) for r in range(2)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=60)
        group = CompiledWorkerGroup(actors, step_timeout_s=2)
        assert group.control_plane == "graph"
        for step in range(3):
            assert [r.rank for r in group.execute(StepPlan(step))] == [0, 1]
        with pytest.raises(RankFailed) as failed:
            group.execute(StepPlan(3))
        assert failed.value.dead == [1]
        assert [(r.rank, r.step) for r in failed.value.reports] == [(0, 3)]
    finally:
        for a in actors:
            ray.kill(a)
        group.shutdown()


def test_a_graph_that_cannot_be_compiled_leaves_plain_calls(ray_session, monkeypatch) -> None:
    # a fake, said so: a Ray whose compiled graphs do not work here (compiling raises), which a
    # real install cannot be made to be on demand
    from ray.dag import MultiOutputNode

    def refuse(self, **kwargs):
        raise RuntimeError("compiled graphs are not available")

    actors = [ray.remote(_Echo).options(num_cpus=0).remote(r) for r in range(2)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=60)
        monkeypatch.setattr(MultiOutputNode, "experimental_compile", refuse)
        group = CompiledWorkerGroup(actors, step_timeout_s=30)
        assert group.control_plane == "calls"
        assert [(r.rank, r.step) for r in group.execute(StepPlan(0))] == [(0, 0), (1, 0)]
    finally:
        for a in actors:
            ray.kill(a)


@pytest.mark.parametrize(
    ("device", "plane", "expected"),
    [("cpu", "auto", "calls"), ("cuda", "auto", "graph"), ("cpu", "graph", "graph")],
)
def test_auto_takes_the_graph_for_cuda_ranks_only(device, plane, expected) -> None:
    from raykv.cluster.control_plane import resolved_control_plane

    cfg = load_config(None, [f"parallel.device={device}", f"parallel.control_plane={plane}"])
    assert resolved_control_plane(cfg) == expected
