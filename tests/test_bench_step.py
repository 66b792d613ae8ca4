"""``raykv bench step``: the documented shape, and that it really drives the connector (no timing
assertions: CI machines are noisy)."""

from __future__ import annotations

import pytest

from raykv.bench.step import MIN_CACHED, _StepSim, format_step_table, run_step_bench


def test_step_bench_shape() -> None:
    result = run_step_bench([MIN_CACHED, 500], steps=30, repeat=2, warmup=10, check=True)
    assert result["policy"] == "lru"
    assert (result["steps"], result["repeat"], result["warmup"]) == (30, 2, 10)
    assert set(result["cached"]) == {str(MIN_CACHED), "500"}
    for c, row in result["cached"].items():
        assert row["us_per_step"] > 0 and row["median_us"] > 0 and row["mean_us"] > 0
        assert row["capacity"] > int(c) and row["resident"] == row["capacity"]  # full tier
        assert 0 < row["max_tracked"] <= 8  # bounded by requests in flight, not by C
    lo, hi = result["cached"][str(MIN_CACHED)], result["cached"]["500"]
    assert result["ratio"] == pytest.approx(hi["us_per_step"] / lo["us_per_step"])
    assert result["mean_ratio"] == pytest.approx(hi["mean_us"] / lo["mean_us"])
    assert result["within_limit"] == (result["ratio"] <= result["limit"])
    assert result["same_work"] is True
    table = format_step_table(result)
    assert "ratio" in table and str(MIN_CACHED) in table


def test_step_bench_exercises_the_connector() -> None:
    result = run_step_bench([MIN_CACHED], steps=40, repeat=1, warmup=20, policy="recall")
    work = result["cached"][str(MIN_CACHED)]["work"]
    # per step: one lookup, a hit (and a load) every other step, four stores, each evicting one
    assert work["lookups"] == 1 and work["deferred_lookups"] == 0
    assert work["load_jobs"] == pytest.approx(0.5) and work["load_blocks"] > 0
    assert work["dir_hits"] > 0 and work["dir_loads"] > 0
    assert work["store_jobs"] == pytest.approx(4) and work["dir_stored"] == pytest.approx(4)
    assert work["dir_evictions"] == pytest.approx(4)
    assert work["finished"] > 0 and work["acks"] > 0 and work["flushes"] == 0


def test_step_sim_keeps_the_connector_consistent() -> None:
    sim = _StepSim(MIN_CACHED, "lru")
    for _ in range(60):
        assert sim.step() > 0
        sim.connector.check_invariants()
        sim.directory.check_invariants()
    stats = sim.directory.stats()
    assert stats.keys_stored > MIN_CACHED and stats.loads > 0 and stats.evictions > 0
    assert sim.connector.tracked() <= 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cached": [10]}, "cached counts"),
        ({"cached": []}, "at least one"),
        ({"steps": 0}, "steps"),
        ({"policy": "nope"}, "unknown policy"),
    ],
)
def test_step_bench_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_step_bench(**{"steps": 5, "repeat": 1, "warmup": 0, **kwargs})  # type: ignore[arg-type]
