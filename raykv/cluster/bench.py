"""``raykv bench step --engine ray``: what the per-step fan-out to the rank actors costs, through
the compiled graph and through plain calls, each against a bare round trip of the same kind to
the same actors with a payload of the same size.

The plans are real: recorded from a run of the one-process engine with the same configuration
(their sizes are reported too). Timed step by step, each plan's engine round trip followed at
once by its bare one, so both meet the same moment of a machine whose speed drifts: the
engine's fan-out exactly as the scheduler actor does it (``CompiledWorkerGroup.execute`` /
``RayWorkerGroup.execute``: the plan encoded once, sent, the replies gathered and decoded), with
ranks that keep the block tables and reply without executing the plan, so only the step
message's cost counts; and a bare round trip of a payload of the plan's encoded size whose node
returns empty bytes at once. The bare graph round trip goes through the engine's own graph (the
same channels, the same actors; an actor takes part in one graph at a time): its payload is
zeros, which no encoded plan starts with, and the rank answers it before anything else.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raykv.cluster import wire
from raykv.cluster.compiled_group import CompiledWorkerGroup
from raykv.cluster.runtime import connect
from raykv.cluster.worker_group import RayWorkerGroup
from raykv.config import RaykvConfig
from raykv.core.step import StepPlan, StepReport
from raykv.engine.rank_tables import RankTables

# The targets, same run: the graph's fan-out within this of a bare graph round trip...
GRAPH_OVER_BARE_LIMIT = 1.3
# ... and at most this share of the plain calls' fan-out.
GRAPH_OVER_PLAIN_LIMIT = 0.3
# A bare payload's first byte: an encoded plan (a MessagePack array) never starts with it
BARE = b"\0"


class _Rank:
    """A rank that takes plans and replies like a real one, without executing them: it keeps
    the block tables as a real rank does (that is the step message's to carry), nothing else."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tables = RankTables(rank)

    def execute(self, plan: StepPlan) -> StepReport:
        samples = [0] * len(self.tables.apply(plan))
        return StepReport(self.rank, plan.step, samples=samples)

    def execute_blob(self, blob: bytes) -> bytes:
        if blob[:1] == BARE:  # the bare round trip through the engine's graph
            return b""
        return wire.encode(self.execute(wire.decode_plan(blob)))

    def reply_to(self, step: int) -> bytes | None:
        return None

    def echo(self, payload: bytes) -> bytes:
        # bytes, as a report travels: an int reply goes through Ray's general serializer and
        # measured slower than the engine's whole round trip, which flattered the ratio
        return b""

    def ready(self) -> None:
        return None


def record_plans(cfg: RaykvConfig, limit: int) -> list[StepPlan]:
    """The plans of a real run of the one-process engine (up to ``limit`` steps)."""
    from raykv.engine.core import EngineCore
    from raykv.engine.workers import LocalWorkerGroup
    from raykv.runs.driver import Driver
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
    """``{"results": [{"tp", "graph_us", "plain_us", "bare_graph_us", "bare_plain_us",
    "plan_bytes_median", ...}], "limits": ...}``: the median per step of each way, the best of
    ``repeat`` rounds."""
    handle = connect(address, num_cpus=max(tps))
    results: list[dict[str, Any]] = []
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
            sizes = [len(wire.encode(p)) for p in plans]
            row = {"tp": tp, **_time_tp(tp, plans, sizes, repeat)}
            row["graph_over_bare"] = row["graph_us"] / row["bare_graph_us"]
            row["graph_over_plain"] = row["graph_us"] / row["plain_us"]
            row["plain_over_bare"] = row["plain_us"] / row["bare_plain_us"]
            row["plan_bytes_median"] = statistics.median(sizes)
            row["plan_bytes_max"] = max(sizes)
            row["steps"] = len(plans)
            results.append(row)
    finally:
        handle.shutdown()
    return {
        "results": results,
        "limits": {
            "graph_over_bare": GRAPH_OVER_BARE_LIMIT,
            "graph_over_plain": GRAPH_OVER_PLAIN_LIMIT,
        },
    }


def _paired_medians_us(
    engine: Callable[[Any], object],
    plans: list[Any],
    bare: Callable[[bytes], object],
    payloads: list[bytes],
) -> tuple[float, float]:
    """The median us of ``engine(plan)`` and of ``bare(payload)``, each plan's bare round trip
    timed right after its own."""
    engine_times, bare_times = [], []
    for plan, payload in zip(plans, payloads, strict=True):
        started = time.perf_counter()
        engine(plan)
        middle = time.perf_counter()
        bare(payload)
        bare_times.append(time.perf_counter() - middle)
        engine_times.append(middle - started)
    return statistics.median(engine_times) * 1e6, statistics.median(bare_times) * 1e6


def _time_tp(tp: int, plans: list[StepPlan], sizes: list[int], repeat: int) -> dict[str, float]:
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
        plain = RayWorkerGroup(ranks, step_timeout_s=60)
        payloads = [BARE * n for n in sizes]
        best = dict.fromkeys(("graph_us", "bare_graph_us", "plain_us", "bare_plain_us"), 1e18)
        epochs = itertools.count(1)

        def keep(key: str, value: float) -> None:
            best[key] = min(best[key], value)

        def replay() -> list[StepPlan]:
            """The recorded plans in a tables epoch of their own: the ranks' kept tables start
            empty, as at the recorded run's start (a replay sends its tables whole again)."""
            epoch = next(epochs)
            return [msgspec.structs.replace(p, tables_epoch=epoch) for p in plans]

        def bare_plain(payload: bytes) -> object:
            return ray.get([r.echo.remote(payload) for r in ranks], timeout=60)

        for _ in range(repeat):
            group = CompiledWorkerGroup(ranks, step_timeout_s=60)
            graph = group.graph
            if graph is None:
                raise RuntimeError("the step graph could not be compiled (see the log)")

            def bare_graph(payload: bytes, graph: Any = graph) -> object:
                return [ref.get(timeout=60) for ref in graph.execute(payload)]

            group.execute(replay()[0])  # the first execution sets the channels up
            timed = _paired_medians_us(group.execute, replay(), bare_graph, payloads)
            keep("graph_us", timed[0])
            keep("bare_graph_us", timed[1])
            group.shutdown()
            timed = _paired_medians_us(plain.execute, replay(), bare_plain, payloads)
            keep("plain_us", timed[0])
            keep("bare_plain_us", timed[1])
        return best
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)


def format_fanout_table(result: dict[str, Any]) -> str:
    limits = result["limits"]
    lines = [
        "fan-out per step: the engine's (graph / plain calls) against bare round trips of the "
        "same kind (same actors, same payload size), median us",
        f"{'tp':>3} {'graph':>7} {'bare graph':>11} {'plain':>7} {'bare plain':>11} "
        f"{'graph/bare':>11} {'graph/plain':>12} {'plan bytes':>11}",
    ]
    ok = True
    for r in result["results"]:
        ok &= r["graph_over_bare"] <= limits["graph_over_bare"]
        ok &= r["graph_over_plain"] <= limits["graph_over_plain"]
        lines.append(
            f"{r['tp']:>3} {r['graph_us']:>7.0f} {r['bare_graph_us']:>11.0f} "
            f"{r['plain_us']:>7.0f} {r['bare_plain_us']:>11.0f} {r['graph_over_bare']:>11.2f} "
            f"{r['graph_over_plain']:>12.2f} {r['plan_bytes_median']:>11.0f}"
        )
    lines.append(
        f"targets: graph/bare <= {limits['graph_over_bare']}, graph/plain <= "
        f"{limits['graph_over_plain']}: {'met' if ok else 'NOT met'}"
    )
    return "\n".join(lines)


def run_model_share(
    cfg: RaykvConfig,
    tps: list[int],
    batch: int = 16,
    max_tokens: int = 48,
    address: str | None = None,
) -> list[dict[str, Any]]:
    """A real model's decode steps on the Ray engine, through the graph and through plain
    calls, each one step at a time and planned ahead (``engine.async_scheduling``): ``batch``
    requests of 4 prompt tokens decoding ``max_tokens`` tokens each (so every step but the
    first is a decode batch of ``batch``); per step, the engine's wall time and the slowest
    rank's own work (copies and model), the share of the step outside it, and the tokens per
    second of stepping (startup excluded)."""
    from raykv.cluster.client import RaykvClient
    from raykv.model.checkpoint import configure
    from raykv.workload.requests import RequestSpec

    rows = []
    for tp in tps:
        for plane in ("graph", "calls"):
            for ahead in (False, True):
                run_cfg = cfg.model_copy(
                    update={
                        "parallel": cfg.parallel.model_copy(
                            update={"tensor_parallel_size": tp, "control_plane": plane}
                        ),
                        "engine": cfg.engine.model_copy(
                            update={
                                "max_num_seqs": max(batch, cfg.engine.max_num_seqs),
                                "async_scheduling": ahead,
                            }
                        ),
                    }
                )
                run_cfg, _, _ = configure(run_cfg)
                vocab = run_cfg.model.vocab_size
                specs = [
                    RequestSpec(
                        f"decode-{i}", tuple((7 * i + k) % vocab for k in range(4)), max_tokens, 0
                    )
                    for i in range(batch)
                ]
                with RaykvClient.start(run_cfg, address=address, offload=False) as client:
                    report = client.run(specs, timeout_s=1800)
                t = report["step_time"]
                stepping_s = t["step_s"] * report["steps"]
                rows.append(
                    {
                        "tp": tp,
                        "control_plane": report["control_plane"],
                        "async_scheduling": ahead,
                        "batch": batch,
                        "steps": report["steps"],
                        "step_ms": t["step_s"] * 1e3,
                        "ranks_busy_ms": t["ranks_busy_s"] * 1e3,
                        "outside_share": t["outside_share"],
                        "tokens_per_s": report["generated_tokens"] / stepping_s,
                        "output_digest": report["output_digest"],
                    }
                )
    for row in rows:  # planned ahead against one step at a time, same TP and plane
        base = next(
            r
            for r in rows
            if (r["tp"], r["control_plane"], r["async_scheduling"])
            == (row["tp"], row["control_plane"], False)
        )
        row["tokens_per_s_over_sync"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["same_tokens_as_sync"] = row["output_digest"] == base["output_digest"]
    return rows


def format_model_share_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "a real model's decode step: the engine's wall time, the slowest rank's own work "
        "(copies and model), the share outside it (scheduling and the control plane), and "
        "tokens/s one step at a time and planned ahead (async)",
        f"{'tp':>3} {'plane':>6} {'async':>6} {'batch':>6} {'steps':>6} {'step ms':>8} "
        f"{'ranks ms':>9} {'outside':>8} {'tok/s':>7} {'vs sync':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['tp']:>3} {r['control_plane']:>6} {'yes' if r['async_scheduling'] else 'no':>6} "
            f"{r['batch']:>6} {r['steps']:>6} {r['step_ms']:>8.2f} {r['ranks_busy_ms']:>9.2f} "
            f"{r['outside_share']:>8.1%} {r['tokens_per_s']:>7.1f} "
            f"{r['tokens_per_s_over_sync']:>8.2f}"
        )
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

    def spill_to_disk(self) -> None:
        ray.get(self.client.server.spill_to_disk.remote(), timeout=600)

    def close(self) -> None:
        self.client.shutdown()
