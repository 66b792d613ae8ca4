"""The rank runner: one rank's step in the protocol's order, with the fence checked where a
write happens (real CPU copies, the unthreaded engine, so a paused copy stays really pending)."""

from __future__ import annotations

import itertools

import pytest

from raykv.connector.worker import ConnectorWorker, FenceViolation
from raykv.core.step import (
    BlockCopy,
    ModelEntry,
    StepPlan,
    TransferPlan,
    TransferSpec,
)
from raykv.engine.rank_runner import RankRunner
from raykv.model.synthetic import SyntheticModel
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows


def runner() -> tuple[RankRunner, CpuTransferEngine]:
    layout = KVLayout(8, 4, 1, 1, 2, 4, "float16", 1, 4)
    kv, pool = allocate_kv(layout), allocate_pool(layout)
    engine = CpuTransferEngine(kv, pool, layout, threaded=False)
    model = SyntheticModel(layout)
    transfers = ConnectorWorker(0, engine, lambda block, content: model.verify(kv, block, content))
    return RankRunner(0, transfers, model, kv, layout.block_size), engine


_table_keys = itertools.count()


def write(block: int, tokens: list[int]) -> ModelEntry:
    """A one-block request, new to the rank (its table sent whole under a fresh key)."""
    key = next(_table_keys)
    return ModelEntry(0, key, 0, tokens, [[block]], read_from=[0], parent_hashes=[7])


def store(job: int, block: int, slot: int) -> TransferSpec:
    return TransferSpec(job, True, BlockCopy([block], [slot], [0]))


def test_a_step_writes_before_its_stores_copy_and_reports_what_landed() -> None:
    rank, engine = runner()
    plan = StepPlan(0, TransferPlan(stores=[store(1, 3, 2)]), [write(3, [5, 6, 7, 8])])
    report = rank.execute(plan)
    assert report.transfers.completed == [1] and len(report.samples) == 1
    # the store ran after the model step: the slot holds what the step wrote
    rows = pool_rows(engine.pool, engine.layout)
    assert rows[2].equal(engine.kv[3]) and bool(rows[2].abs().sum() > 0)
    engine.shutdown()


def test_the_model_may_not_write_a_block_an_unfinished_store_reads() -> None:
    rank, engine = runner()
    engine.pause()
    rank.execute(StepPlan(0, TransferPlan(stores=[store(1, 3, 2)]), [write(3, [1, 2, 3, 4])]))
    with pytest.raises(FenceViolation, match="blocks \\[3\\]"):
        rank.execute(StepPlan(1, TransferPlan(), [write(3, [9, 9, 9, 9])]))
    engine.resume()
    engine.shutdown()


def test_a_flush_in_the_plan_finishes_the_store_before_the_model_writes() -> None:
    rank, engine = runner()
    engine.pause()
    rank.execute(StepPlan(0, TransferPlan(stores=[store(1, 3, 2)]), [write(3, [1, 2, 3, 4])]))
    before = engine.kv[3].clone()
    report = rank.execute(StepPlan(1, TransferPlan(flush=[1]), [write(3, [9, 9, 9, 9])]))
    assert report.transfers.completed == [1]
    assert pool_rows(engine.pool, engine.layout)[2].equal(before)  # the old KV was saved
    engine.resume()
    engine.shutdown()
