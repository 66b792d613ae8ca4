"""``raykv bench step --engine ray``: what the per-step fan-out to the rank actors costs, against
a bare Ray round trip to the same number of actors with a payload of the same size.

The plans are real: recorded from a run of the one-process engine with the same configuration
(their sizes are reported too). Timed, per step: the engine's fan-out exactly as the scheduler
actor does it (``RayWorkerGroup.execute``: the plan pickled once, one call per rank carrying it,
the replies gathered and unpickled), with ranks that return a report without executing the plan, so
only the transport is measured; and, interleaved with it, N calls carrying a ``bytes`` payload of
the plan's pickled size to the same actors, returning nothing.
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raykv.cluster.runtime import connect
from raykv.cluster.worker_group import RayWorkerGroup
from raykv.config import RaykvConfig
from raykv.core.step import StepPlan, StepReport


class _Rank:
    """A rank that takes plans and replies like a real one, without executing them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute(self, plan: StepPlan) -> StepReport:
        samples = [0] * len(plan.batch)
        return StepReport(self.rank, plan.step, samples=samples)

    def execute_blob(self, blob: bytes) -> bytes:
        return pickle.dumps(self.execute(pickle.loads(blob)), protocol=5)

    def echo(self, payload: bytes) -> int:
        return 0


def record_plans(cfg: RaykvConfig, limit: int) -> list[StepPlan]:
    """The plans of a real run of the one-process engine (up to ``limit`` steps)."""
    from raykv.engine.core import EngineCore
    from raykv.engine.run import Driver
    from raykv.engine.workers import LocalWorkerGroup
    from raykv.workload.requests import make_workload

    plans: list[StepPlan] = []
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as group:
        execute = group.execute

        def recording(plan: StepPlan) -> list[StepReport]:
            plans.append(plan)
            return execute(plan)

        group.execute = recording  # type: ignore[method-assign]
        driver = Driver(EngineCore(cfg, group))
        driver.submit(make_workload(cfg))
        while driver.has_work() and len(plans) < limit:
            driver.step()
    return plans


def run_fanout_bench(
    cfg: RaykvConfig, tps: list[int], steps: int = 300, repeat: int = 3, address: str | None = None
) -> dict[str, Any]:
    handle = connect(address, num_cpus=max(tps))
    results: dict[str, Any] = {}
    try:
        for tp in tps:
            tp_cfg = cfg.model_copy(
                update={"parallel": cfg.parallel.model_copy(update={"tensor_parallel_size": tp})}
            )
            if cfg.model.num_kv_heads % tp:
                tp_cfg = tp_cfg.model_copy(
                    update={"model": cfg.model.model_copy(update={"num_kv_heads": 4 * tp})}
                )
            plans = record_plans(tp_cfg, steps)
            sizes = [len(pickle.dumps(p, protocol=5)) for p in plans]
            results[str(tp)] = _time_tp(tp, plans, sizes, repeat) | {
                "plan_bytes": {
                    "mean": statistics.fmean(sizes),
                    "median": statistics.median(sizes),
                    "max": max(sizes),
                },
                "steps": len(plans),
            }
    finally:
        handle.shutdown()
    return {"tensor_parallel": results, "limit": 2.0}


def _time_tp(tp: int, plans: list[StepPlan], sizes: list[int], repeat: int) -> dict[str, Any]:
    pg = placement_group([{"CPU": 1.0}] * tp, "PACK")
    ray.get(pg.ready(), timeout=120)
    actor = ray.remote(_Rank)
    ranks = [
        actor.options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
        ).remote(i)
        for i in range(tp)
    ]
    try:
        ray.get([r.echo.remote(b"") for r in ranks], timeout=120)
        group = RayWorkerGroup(ranks, step_timeout_s=60)
        payloads = [bytes(n) for n in sizes]
        best_fan, best_bare = float("inf"), float("inf")
        for _ in range(repeat):
            fan, bare = [], []
            for plan, payload in zip(plans, payloads, strict=True):
                t0 = time.perf_counter()
                group.execute(plan)
                t1 = time.perf_counter()
                ray.get([r.echo.remote(payload) for r in ranks], timeout=60)
                t2 = time.perf_counter()
                fan.append(t1 - t0)
                bare.append(t2 - t1)
            best_fan = min(best_fan, statistics.median(fan))
            best_bare = min(best_bare, statistics.median(bare))
        return {
            "fanout_us": best_fan * 1e6,
            "bare_us": best_bare * 1e6,
            "ratio": best_fan / best_bare,
        }
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)


def format_fanout_table(result: dict[str, Any]) -> str:
    lines = [
        "fan-out per step vs a bare Ray round trip (same actors, same payload size)",
        f"{'tp':>3} {'fan-out us':>11} {'bare us':>9} {'ratio':>6} {'plan bytes (median/max)':>24}",
    ]
    for tp, r in result["tensor_parallel"].items():
        pb = r["plan_bytes"]
        lines.append(
            f"{tp:>3} {r['fanout_us']:>11.0f} {r['bare_us']:>9.0f} {r['ratio']:>6.2f} "
            f"{pb['median']:>15.0f} / {pb['max']:.0f}"
        )
    ok = all(r["ratio"] <= result["limit"] for r in result["tensor_parallel"].values())
    lines.append(f"limit {result['limit']}: {'ok' if ok else 'EXCEEDED'}")
    return "\n".join(lines)


class RayTTFTEngine:
    """``raykv bench ttft --engine ray``: the deployment (scheduler and rank actors), one
    request at a time through the client."""

    def __init__(self, cfg: RaykvConfig) -> None:
        from raykv.cluster.client import RaykvClient

        self.client = RaykvClient.start(cfg)

    def first_token(self, req_id: str, prompt: list[int]) -> tuple[float, int]:
        from raykv.workload.requests import RequestSpec

        self.client.submit([RequestSpec(req_id, tuple(prompt), 1, 0.0)])
        for _ in self.client.stream():  # returns once it is done and every store has landed
            pass
        found = ray.get(self.client.server.latency_of.remote(req_id), timeout=60)
        if found is None:
            raise RuntimeError(f"request {req_id} finished without a first token")
        return found

    def empty_gpu_cache(self) -> None:
        ray.get(self.client.server.reset_prefix_cache.remote(), timeout=60)

    def close(self) -> None:
        self.client.shutdown()
