"""The step message on the wire (``cluster/wire.py``): every plan of a real run, with the
synthetic model's expected block contents and checksummed loads, and reports with a real
model's logprobs, come back equal to what was sent."""

from __future__ import annotations

import msgspec
import pytest

from raykv.cluster import wire
from raykv.cluster.bench import record_plans
from raykv.config import load_config
from raykv.core.step import (
    ChunkKeys,
    SamplingSpec,
    StepReport,
    TokenLogprobs,
    TransferReport,
    TransferStats,
)


def test_every_plan_of_a_run_with_loads_stores_and_checks_comes_back_equal() -> None:
    cfg = load_config(
        "configs/synthetic.yaml",
        # every hit loaded: the synthetic model recomputes faster than a load lands, and
        # the wire of loads is what is tested here
        ["offload.verify=true", "workload.num_requests=40", "offload.take_hits=always"],
    )
    plans = record_plans(cfg, 400)
    assert any(p.transfers.loads and p.transfers.loads[0].expect for p in plans)
    assert any(p.transfers.stores for p in plans)
    for plan in plans:
        assert wire.decode_plan(wire.encode(plan)) == plan


def test_a_plan_with_sampling_settings_comes_back_equal() -> None:
    plan = record_plans(load_config(None, ["workload.num_requests=4"]), 3)[-1]
    plan.batch[0].sampling = SamplingSpec(temperature=0.7, top_p=0.9, top_k=5, seed=3, logprobs=2)
    back = wire.decode_plan(wire.encode(plan))
    assert back == plan and back.batch[0].sampling == plan.batch[0].sampling


def test_a_report_with_logprobs_acks_and_stats_comes_back_equal() -> None:
    report = StepReport(
        rank=1,
        step=17,
        transfers=TransferReport([3, 4], [5], TransferStats(store_jobs=2, store_seconds=0.25), [5]),
        samples=[101, 0, 2**61 - 2],
        logprobs=[TokenLogprobs(-0.5, {101: -0.5, 7: -1.25}), None, TokenLogprobs(-3.0)],
        busy_s=0.0125,
    )
    back = wire.decode_report(wire.encode(report))
    assert back == report
    assert back.logprobs[0] is not None and back.logprobs[0].top == {101: -0.5, 7: -1.25}


def test_a_report_of_bad_keys_carries_keys_of_every_width() -> None:
    """A key is a 64-bit hash and a group packed into up to 72 bits: a rank that found such a
    chunk's source bad (a shared part gone after its master restarted) reports it (this was an
    OverflowError that ended the run, MessagePack's ints being 64-bit)."""
    from raykv.core.keys import make_key

    keys = [make_key(2**64 - 1, 255), make_key(2**63 + 5, 3), make_key(7)]
    report = StepReport(rank=0, step=3, transfers=TransferReport(failed=[9]))
    report.transfers.bad_keys = {9: ChunkKeys.of(keys)}
    back = wire.decode_report(wire.encode(report))
    assert back == report and back.transfers.bad_keys[9].unpack() == keys


def test_bytes_that_are_not_a_report_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.decode_report(wire.encode(record_plans(load_config(None, []), 1)[0]))


def test_the_bench_rank_keeps_tables_and_answers_a_bare_payload_at_once() -> None:
    from raykv.cluster.bench import BARE, _Rank

    plans = record_plans(load_config(None, ["workload.num_requests=6"]), 30)
    rank = _Rank(0)
    held = []
    for plan in plans:
        blob = wire.encode(plan)
        assert not blob.startswith(BARE)  # a plan is never taken for a bare payload
        assert rank.execute_blob(BARE * len(blob)) == b""
        report = wire.decode_report(rank.execute_blob(blob))
        assert report.step == plan.step and len(report.samples) == len(plan.batch)
        held.append(len(rank.tables))
    # it kept the running requests' tables, as a real rank does, and dropped the finished ones
    assert max(held) > 1 and held[-1] < max(held)
    # a replay without a new tables epoch sends tables whole twice: refused
    again = _Rank(0)
    again.execute_blob(wire.encode(plans[0]))
    with pytest.raises(RuntimeError, match="sent whole twice"):
        again.execute_blob(wire.encode(plans[0]))
