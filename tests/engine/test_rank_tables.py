"""The ranks' kept block tables: a step sends only what changed, every rank holds what the
scheduler means (through preemption, sliding windows, failed loads and rank deaths), nothing is
kept past its request, and a change that does not follow on is refused."""

from __future__ import annotations

import msgspec
import pytest

from raykv.config import load_config
from raykv.core.arith import cdiv
from raykv.core.block_pool import NULL_BLOCK
from raykv.core.request import Request
from raykv.core.step import ModelEntry, StepPlan
from raykv.engine.core import EngineCore
from raykv.engine.rank_runner import RankRunner
from raykv.engine.rank_tables import RankTables, TableMismatch
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver
from raykv.workload.requests import make_workload

SETS = [
    "workload.num_requests=40",
    "cache.num_gpu_blocks=40",  # small: requests are preempted and admitted again
    "workload.system_prompt_tokens=64",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=12",
    "parallel.tensor_parallel_size=2",
    "model.num_layers=4",
    "cache.groups=[{kind: full_attention}, {kind: sliding_window, window_tokens: 24}]",
]


def entry(key: int, tables: list[list[int]], start: int = 0) -> ModelEntry:
    return ModelEntry(0, key, 0, [], tables, start)


def rank_tables(group: LocalWorkerGroup) -> list[RankTables]:
    out = []
    for worker in group.workers:
        runner = worker.runner
        inner = getattr(runner, "inner", runner)  # FaultyRank wraps the runner
        assert isinstance(inner, RankRunner)
        out.append(inner.tables)
    return out


def check_ranks_hold_what_the_scheduler_means(engine: EngineCore, group: LocalWorkerGroup) -> int:
    """Every live table, on every rank, equals the scheduler's entries it was sent, except
    where the scheduler has since nulled a block that left a window (never read); no rank keeps
    a table the scheduler has not queued for dropping. Returns the live tables checked."""
    kv = engine.scheduler.kv
    live: dict[int, Request] = {
        req.table_key: req for req in engine.requests.values() if req.table_key >= 0
    }
    queued = set(kv._forgotten)
    for tables in rank_tables(group):
        if tables.epoch < kv.tables_epoch:
            continue  # a recovery has just ended: the next plan empties it (or it is new)
        assert tables.epoch == kv.tables_epoch
        assert set(tables.tables) <= set(live) | queued, "a rank keeps a dropped table"
        for key, req in live.items():
            held = tables.tables[key]
            for mine, theirs in zip(held, req.block_tables, strict=True):
                assert len(mine) == req.tables_sent
                for a, b in zip(mine, theirs, strict=False):
                    assert a == b or b == NULL_BLOCK
    return len(live)


def run(sets: list[str], check: bool, offload: bool = True) -> tuple[str, int, int, int]:
    """(output digest, preemptions, rank restarts, live tables checked)."""
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as group:
        engine = EngineCore(cfg, group, offload=offload, verify=True)
        driver = Driver(engine)
        driver.submit(make_workload(cfg))
        checked = 0
        while driver.has_work():
            driver.step()
            if check:
                checked += check_ranks_hold_what_the_scheduler_means(engine, group)
        report = driver.report()
    assert report.requests_finished == 40
    return report.output_digest, report.preemptions, report.rank_restarts, checked


@pytest.fixture(scope="module")
def reference_digest() -> str:
    return run(SETS, check=False, offload=False)[0]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["engine.async_scheduling=true"],
        ["faults=['kill-worker:rate=0.03:seed=5', 'drop-acks:rate=0.1:seed=2']"],
    ],
    ids=["sync", "async", "faults"],
)
def test_every_rank_holds_the_tables_the_scheduler_means(
    extra: list[str], reference_digest: str
) -> None:
    digest, preemptions, restarts, checked = run([*SETS, *extra], check=True)
    assert digest == reference_digest
    assert checked > 0 and preemptions > 0
    assert restarts > 0 or "faults" not in " ".join(extra)


def test_a_decode_step_sends_no_more_table_than_it_adds() -> None:
    # long prompts: their tables are sent whole once, then each decode step adds at most one
    # entry per group (a whole table is 7 or more entries here)
    cfg = load_config(
        None,
        [
            "workload.num_requests=4",
            "workload.system_prompt_tokens=160",
            "workload.user_tokens=32",
            "workload.max_tokens=20",
            "parallel.tensor_parallel_size=1",
            "cache.num_gpu_blocks=128",
        ],
    )
    plans: list[StepPlan] = []
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as group:
        execute = group.execute
        group.execute = lambda plan: (plans.append(plan), execute(plan))[1]  # type: ignore[method-assign]
        driver = Driver(EngineCore(cfg, group))
        driver.submit(make_workload(cfg))
        while driver.has_work():
            driver.step()
    seen: set[int] = set()
    decode_entries = 0
    for plan in plans:
        for e in plan.batch:
            sent = sum(len(t) for t in e.block_tables)
            if e.table_key in seen:
                assert e.table_from > 0 or not sent
                if len(e.tokens) == 1:
                    decode_entries += 1
                    assert sent <= len(e.block_tables), "a decode step resent old entries"
            else:
                # whole, the first time: every block up to the step's last position
                assert e.table_from == 0 and sent == cdiv(e.end, 16)
                seen.add(e.table_key)
    assert decode_entries >= 4 * 15


def test_changes_splice_in_and_the_plan_is_left_as_it_came() -> None:
    tables = RankTables(0)
    first = StepPlan(0, batch=[entry(7, [[1, 2], [0, 3]])])
    [whole] = tables.apply(first)
    assert whole.block_tables == [[1, 2], [0, 3]]
    grown = StepPlan(1, batch=[entry(7, [[4], [5]], start=2)])
    [whole] = tables.apply(grown)
    assert whole.block_tables == [[1, 2, 4], [0, 3, 5]]
    assert grown.batch[0].block_tables == [[4], [5]]  # another rank of this process reads it next
    # a request that went back (a failed load recomputes): entries from there are replaced
    [whole] = tables.apply(StepPlan(2, batch=[entry(7, [[8], [9]], start=1)]))
    assert whole.block_tables == [[1, 8], [0, 9]]
    # the same plan through the wire and a second rank: the same whole tables
    other = RankTables(1)
    for plan in (first, grown):
        [again] = other.apply(msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan))
    assert again.block_tables == [[1, 2, 4], [0, 3, 5]]


def test_forget_and_a_new_epoch_drop_tables() -> None:
    tables = RankTables(0)
    tables.apply(StepPlan(0, batch=[entry(1, [[1]]), entry(2, [[2]])]))
    tables.apply(StepPlan(1, forget=[1, 99]))  # 99: sent before this rank joined
    assert set(tables.tables) == {2}
    tables.apply(StepPlan(2, tables_epoch=1))  # a recovery: every table is dropped
    assert len(tables) == 0
    with pytest.raises(TableMismatch, match="does not hold"):
        tables.apply(StepPlan(3, batch=[entry(2, [[5]], start=1)], tables_epoch=1))


@pytest.mark.parametrize(
    ("plans", "match"),
    [
        ([[entry(1, [[1]])], [entry(1, [[1]])]], "sent whole twice"),
        ([[entry(1, [[1]])], [entry(2, [[3]], start=1)]], "does not hold"),
        ([[entry(1, [[1]])], [entry(1, [[3]], start=2)]], "holds 1 entries, changes start at 2"),
        ([[entry(1, [[1], [2]])], [entry(1, [[3]], start=1)]], "2 groups"),
    ],
    ids=["twice", "unknown", "gap", "groups"],
)
def test_a_change_that_does_not_follow_on_is_refused(
    plans: list[list[ModelEntry]], match: str
) -> None:
    tables = RankTables(0)
    tables.apply(StepPlan(0, batch=plans[0]))
    with pytest.raises(TableMismatch, match=match):
        tables.apply(StepPlan(1, batch=plans[1]))
