"""The one-process engine end to end: equivalence with and without the CPU tier, the run
report, and requests the engine must refuse by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.cli import main
from raykv.config import load_config
from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.engine.scheduler import RequestTooLarge
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import run_workload
from raykv.workload.requests import make_workload

SMALL = [
    "workload.num_requests=60",
    "cache.num_gpu_blocks=64",
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=8",
    "parallel.tensor_parallel_size=2",
    # every hit loaded: the synthetic model recomputes faster than a load lands, and what these
    # tests check is where KV comes from, not the choice (test_worth, and the test at the end)
    "offload.take_hits=always",
]


def run(sets: list[str], offload: bool) -> dict:
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:  # real background copies
        engine = EngineCore(cfg, workers, offload=offload, verify=True)
        report = run_workload(engine, make_workload(cfg), check_invariants=True)
        if offload:
            assert len(engine.connector.jobs) == 0 and not engine.connector.fence
    return report


def test_offloading_changes_nothing_but_where_kv_comes_from() -> None:
    on, off = run(SMALL, True), run(SMALL, False)
    assert on["output_digest"] == off["output_digest"]
    assert on["requests_finished"] == off["requests_finished"] == 60
    assert on["cpu_hit_tokens"] > 0
    assert on["flushes"]["reuse"] > 0
    assert on["integrity"]["blocks_verified"] > 0 and on["integrity"]["mismatches"] == 0
    assert off["cpu_hit_tokens"] == 0 and off["stores"]["jobs"] == 0


def test_sliding_window_groups_are_equivalent_too() -> None:
    sets = [
        *SMALL,
        "model.num_layers=4",
        "cache.groups=[{kind: full_attention}, {kind: sliding_window, window_tokens: 40}]",
    ]
    on, off = run(sets, True), run(sets, False)
    assert on["output_digest"] == off["output_digest"]
    assert on["cpu_hit_tokens"] > 0 and on["integrity"]["mismatches"] == 0


def test_run_command_writes_the_report(tmp_path: Path) -> None:
    base = [
        "run",
        "--engine",
        "local",
        "--config",
        "configs/synthetic.yaml",
        "--num-requests",
        "30",
    ]
    base += ["--verify"]
    sets = ["--set", "cache.num_gpu_blocks=48", "--set", "workload.max_tokens=6"]
    out, plain = tmp_path / "on.json", tmp_path / "off.json"
    assert main([*base, *sets, "--json-report", str(out)]) == 0
    assert main([*base, *sets, "--no-offload", "--json-report", str(plain)]) == 0
    on, off = json.loads(out.read_text()), json.loads(plain.read_text())
    for key in (
        "requests_finished",
        "prompt_tokens",
        "generated_tokens",
        "admitted_tokens",
        "gpu_hit_tokens",
        "cpu_hit_tokens",
        "recomputed_tokens",
        "preemptions",
        "rank_restarts",
        "tier_kept_restarts",
        "output_digest",
        "steps",
        "wall_seconds",
    ):
        assert key in on, key
    assert set(on["loads"]) >= {"jobs", "blocks", "bytes"}
    assert set(on["stores"]) >= {"jobs", "blocks", "bytes"}
    assert set(on["flushes"]) >= {"reuse", "preemption"}
    assert set(on["integrity"]) == {"blocks_verified", "mismatches", "checked", "corrupt_detected"}
    assert on["integrity"]["checked"] > 0 and on["integrity"]["corrupt_detected"] == 0
    assert on["requests_finished"] == 30 and on["integrity"]["mismatches"] == 0
    assert on["output_digest"] == off["output_digest"]


def test_trace_workload_runs(mooncake_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["run", "--config", "configs/synthetic.yaml", "--workload", f"trace:{mooncake_trace}"]
    argv += ["--num-requests", "12", "--verify"]
    argv += ["--set", "workload.trace_tokens_per_block=16", "--set", "workload.max_tokens=4"]
    assert main([*argv, "--json-report", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests_finished"] == 12


def test_requests_the_engine_cannot_serve_are_refused_by_name() -> None:
    cfg = load_config(None, ["cache.num_gpu_blocks=8", "cache.block_size=4"])
    with LocalWorkerGroup(cfg, 4, threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        with pytest.raises(RequestTooLarge, match=r"request big: .* need 9 GPU blocks"):
            engine.add_request(Request("big", 0, list(range(30)), max_tokens=7))
        with pytest.raises(ValueError, match="request bad: token id 40000"):
            engine.add_request(Request("bad", 1, [1, 40000], max_tokens=1))
        engine.add_request(Request("ok", 2, [1, 2, 3], max_tokens=2))
        with pytest.raises(ValueError, match="duplicate request id 'ok'"):
            engine.add_request(Request("ok", 3, [1], max_tokens=1))
        report = run_workload(engine, [])
        assert report["requests_admitted"] == 0


def test_a_rejected_request_does_not_stop_the_run() -> None:
    from raykv.workload.requests import RequestSpec

    cfg = load_config(None, ["cache.num_gpu_blocks=8", "cache.block_size=4"])
    specs = [
        RequestSpec("a", tuple(range(1, 9)), 2, 0.0),
        RequestSpec("huge", tuple(range(1, 200)), 2, 0.0),
        RequestSpec("b", tuple(range(1, 6)), 2, 1.0),
    ]
    with LocalWorkerGroup(cfg, 8, threaded=False) as workers:
        report = run_workload(EngineCore(cfg, workers), specs)
    assert report["requests_finished"] == 2
    assert [r["request"] for r in report["rejected"]] == ["huge"]


@pytest.mark.parametrize(
    ("sets", "load_in_step", "ack_steps"),
    [
        ([], False, 1),  # copies on a thread: a load waits for its acks
        (["engine.async_scheduling=true"], False, 2),  # ... which come a step late
        (["offload.load_in_step=true"], True, 1),  # copies at the step's transfer points
    ],
)
def test_the_crossover_knows_how_a_load_waits_and_times_the_busy_steps(
    sets: list[str], load_in_step: bool, ack_steps: int
) -> None:
    cfg = load_config(None, [*SMALL, "workload.num_requests=8", "offload.take_hits=faster", *sets])
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers, offload=True)
        costs = engine.connector.costs
        assert (costs.load_in_step, costs.ack_steps) == (load_in_step, ack_steps)
        report = run_workload(engine, make_workload(cfg))
    # the steps that computed tokens were timed for the prior, the idle ones were not
    busy = report["steps"] - report["idle_steps"]
    assert 0 < len(costs.durations) <= busy
    assert report["tier_costs"]["step_period_s"] > 0
