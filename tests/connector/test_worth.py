"""The crossover (``connector/worth.py``): which tier hits are worth loading, from the measured
costs, and how an unmeasured tier is priced."""

from __future__ import annotations

import pytest

from raykv.connector.worth import MIN_SAMPLES, PROBE_EVERY, Candidate, TierCosts

PER_TOKEN = 1e-4  # the model's seconds per prompt token
PERIOD = 0.03  # a busy step, end to end


def measured_model(load_in_step: bool = False, ack_steps: int = 1) -> TierCosts:
    """Costs whose model is measured (``MIN_SAMPLES`` busy steps of 100 tokens, 10 ms of model
    each, each 30 ms from plan to replies) and whose tiers are not."""
    costs = TierCosts(step_tokens=512, load_in_step=load_in_step, ack_steps=ack_steps)
    for _ in range(MIN_SAMPLES):
        costs.observe_step(100, 0.0, 100 * PER_TOKEN, PERIOD)
        costs.observe_duration(PERIOD)
    return costs


def test_before_the_model_is_measured_every_hit_is_taken() -> None:
    costs = TierCosts(step_tokens=512)
    decision = costs.choose(0, 150, [Candidate(128, cpu_blocks=8)])
    assert decision.end == 128 and decision.predicted_s is None


def test_an_unmeasured_tier_whose_load_waits_for_acks_costs_a_step() -> None:
    costs = measured_model()
    assert costs.step_period_s == pytest.approx(PERIOD)
    assert costs.move_s("cpu", 8) == pytest.approx(PERIOD)
    # 128 tokens of prefill (12.8 ms) are cheaper than a step's wait: recomputed, and counted
    short = costs.choose(0, 150, [Candidate(128, cpu_blocks=8)])
    assert short.end == 0 and short.predicted_s == pytest.approx(short.recompute_s)
    assert short.recompute_s == pytest.approx(costs.step_s + 150 * PER_TOKEN)
    assert costs.skipped_slower["cpu"] == 1
    # 1,920 tokens (192 ms, four steps of prefill) are not: loaded
    long = costs.choose(0, 2000, [Candidate(1920, cpu_blocks=120)])
    assert long.end == 1920 and long.predicted_s is not None
    assert long.predicted_s == pytest.approx(costs.step_s + 80 * PER_TOKEN + PERIOD)
    assert long.predicted_s < long.recompute_s


def test_an_unmeasured_load_that_lands_in_its_own_step_is_taken() -> None:
    costs = measured_model(load_in_step=True)
    assert costs.move_s("cpu", 8) == 0.0
    assert costs.choose(0, 150, [Candidate(128, cpu_blocks=8)]).end == 128
    # a promotion from an unmeasured disk tier still waits a step before its load
    assert costs.move_s("disk", 8) == pytest.approx(PERIOD)


def test_a_measured_tier_is_priced_by_its_fit_and_probed_when_passed_over() -> None:
    costs = measured_model()
    for blocks in (4, 8, 16, 32):
        costs.observe_load(blocks, 0.002 + 0.001 * blocks)
    assert costs.measured("cpu")
    assert costs.move_s("cpu", 8) == pytest.approx(0.010)
    # 10 ms for 8 blocks beats 12.8 ms of prefill: what the prior would have recomputed loads
    assert costs.choose(0, 150, [Candidate(128, cpu_blocks=8)]).end == 128
    # a hit of 16 tokens (1 block, 3 ms to load, 1.6 ms to compute) is passed over, but one in
    # PROBE_EVERY of those is loaded anyway
    ends = [costs.choose(0, 40, [Candidate(16, cpu_blocks=1)]).end for _ in range(PROBE_EVERY)]
    assert ends.count(16) == 1 and ends[-1] == 16
    assert costs.probes["cpu"] == 1 and costs.skipped_slower["cpu"] == PROBE_EVERY - 1


def test_a_disk_option_pays_for_its_promotion_and_its_load() -> None:
    costs = measured_model()
    for blocks in (4, 8, 16, 32):
        costs.observe_load(blocks, 0.001 * blocks)
        costs.observe_promotion(blocks, 0.05 + 0.001 * blocks)
    option = Candidate(1920, cpu_blocks=60, disk_blocks=60)
    priced = costs.cost(0, 2000, option)
    assert priced == pytest.approx(costs.step_s + 80 * PER_TOKEN + 0.120 + 0.05 + 0.060)


def test_no_step_timed_yet_prices_nothing() -> None:
    # the model measured, but no step timed: a prior of nothing would take every hit with a
    # prediction that looks measured, so nothing is predicted
    costs = TierCosts(step_tokens=512)
    for _ in range(MIN_SAMPLES):
        costs.observe_step(100, 0.0, 100 * PER_TOKEN, PERIOD)
    decision = costs.choose(0, 150, [Candidate(128, cpu_blocks=8)])
    assert decision.end == 128 and decision.predicted_s is None
    assert costs.skipped_slower["cpu"] == 0


def test_the_prior_is_a_typical_step_and_two_where_acks_come_a_step_late() -> None:
    costs = measured_model()
    costs.observe_duration(2.5)  # a cold first step, or one a dead rank stalled
    assert costs.move_s("cpu", 8) == pytest.approx(PERIOD)
    late = measured_model(ack_steps=2)
    assert late.move_s("cpu", 8) == pytest.approx(2 * PERIOD)
    assert late.move_s("shared", 8) == pytest.approx(2 * PERIOD)
