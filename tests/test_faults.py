"""Fault specs, and the engine recovering from every kind of fault with fault-free tokens."""

from __future__ import annotations

import time

import pytest

from raykv.config import load_config
from raykv.connector.scheduler import ConnectorScheduler
from raykv.core.step import (
    BlockCopy,
    StepPlan,
    StepReport,
    TransferPlan,
    TransferReport,
    TransferSpec,
)
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.faults import (
    FaultSpecError,
    FaultyBackend,
    FaultyRank,
    RankDied,
    RankFaults,
    parse_fault,
)
from raykv.runs.driver import run_workload
from raykv.workload.requests import make_workload

BASE = [
    # every tier hit is loaded: the faults must meet loads in flight, whatever they cost here
    "offload.take_hits=always",
    "workload.num_requests=50",
    "cache.num_gpu_blocks=48",
    "parallel.tensor_parallel_size=2",
    "workload.max_tokens=6",
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "model.head_dim=8",
]


@pytest.mark.parametrize(
    "spec,kind",
    [
        ("kill-worker:rate=0.02", "kill-worker"),
        ("kill-worker:step=5:rank=1:seed=3", "kill-worker"),
        ("delay-acks:rank=0:steps=4", "delay-acks"),
        ("drop-acks:rate=0.5", "drop-acks"),
        ("dup-acks:rate=1", "dup-acks"),
        ("fail-copy:rate=0.1:seed=9", "fail-copy"),
        ("corrupt-cpu:rate=0.5", "corrupt-cpu"),
        ("kill-scheduler:step=40", "kill-scheduler"),
        ("stall-worker:step=3:rank=1:seconds=2.5", "stall-worker"),
    ],
)
def test_good_specs(spec: str, kind: str) -> None:
    assert parse_fault(spec).kind == kind


@pytest.mark.parametrize(
    "spec,message",
    [
        ("explode:rate=1", "unknown kind 'explode'"),
        ("kill-worker", "takes rate=P or step=N"),
        ("kill-worker:rate=0.1:step=3", "takes rate=P or step=N"),
        ("kill-worker:step=3", "needs rank=R"),
        ("drop-acks:rate=1.5", r"rate must be within \[0, 1\]"),
        ("drop-acks:rate=x", "rate='x' is not a number"),
        ("drop-acks", "needs rate=P"),
        ("delay-acks:rank=1", "needs rank=R and steps=K"),
        ("fail-copy:rate=0.1:color=red", "bad parameter 'color=red'"),
        ("dup-acks:rate", "bad parameter 'rate'"),
        ("kill-scheduler", "needs step=N"),
        ("kill-scheduler:step=3:rank=0", "bad parameter 'rank=0'"),
        ("stall-worker:step=3:rank=0", "needs step=N, rank=R and seconds=S"),
        ("stall-worker:step=3:rank=0:seconds=-1", "seconds must be >= 0"),
        ("stall-worker:step=3:rank=0:seconds=-0.5", "seconds must be >= 0"),
    ],
)
def test_bad_specs_quote_the_spec(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message) as info:
        parse_fault(spec)
    assert repr(spec) in str(info.value)


def test_fault_draws_are_reproducible_per_rank_and_incarnation() -> None:
    faults = [parse_fault("drop-acks:rate=0.5:seed=4")]
    a = [RankFaults(0, faults).drops() for _ in range(1)]
    draws = lambda r, inc: [RankFaults(r, faults, inc).drops() for _ in range(1)]  # noqa: E731
    first = RankFaults(0, faults)
    again = RankFaults(0, faults)
    seq1 = [first.drops() for _ in range(64)]
    assert seq1 == [again.drops() for _ in range(64)]
    other = RankFaults(1, faults)
    assert seq1 != [other.drops() for _ in range(64)]
    assert a == draws(0, 0)
    once = RankFaults(0, [parse_fault("kill-worker:step=3:rank=0")])
    assert once.dies_at(3) and not once.dies_at(4)
    assert not RankFaults(0, once.faults, incarnation=1).dies_at(3)  # a replacement lives


def check_cpu_tier(engine, workers) -> int:
    """Every readable key's bytes, on every rank, are what recomputing the chunk gives."""
    checked, bad = workers.verify_cpu_tier(engine.cpu_tier_contents())
    assert bad == 0, f"{bad} of {checked} CPU-tier blocks hold the wrong bytes"
    return checked


def run(
    faults: list[str],
    extra: tuple[str, ...] = (),
    threaded: bool = False,
    exec_delays: dict | None = None,
    check_tier: bool = True,
):
    cfg = load_config(None, [*BASE, *extra, f"faults={faults!r}".replace("'", '"')])
    workers = LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=threaded, exec_delays=exec_delays)
    engine = EngineCore(cfg, workers, verify=True)
    report = run_workload(engine, make_workload(cfg), check_invariants=True, max_idle_steps=5000)
    c = engine.connector
    assert len(c.jobs) == 0 and not c.fence and c.tracked() == 0
    assert engine.pool.num_free == engine.pool.num_usable
    checked = check_cpu_tier(engine, workers) if check_tier else 0
    workers.shutdown()
    # hits are a share of what admissions needed, re-admissions included (the report's basis)
    hits = report["gpu_hit_tokens"] + report["cpu_hit_tokens"]
    assert hits <= report["admitted_tokens"]
    assert report["admitted_tokens"] >= report["prompt_tokens"]  # every request got in once
    return report, engine, checked


@pytest.fixture(scope="module")
def fault_free():
    report, _, checked = run([])
    assert checked > 0
    return report


@pytest.mark.parametrize(
    "faults",
    [
        ["kill-worker:rate=0.03:seed=1"],
        ["kill-worker:step=3:rank=0"],  # early: stores of the first prefills in flight
        ["kill-worker:step=40:rank=1"],
        ["drop-acks:rate=0.3:seed=2"],
        ["dup-acks:rate=0.5:seed=3"],
        ["fail-copy:rate=0.3:seed=4"],
        ["delay-acks:rank=1:steps=6"],
        [
            "kill-worker:rate=0.02:seed=5",
            "drop-acks:rate=0.1",
            "dup-acks:rate=0.1",
            "fail-copy:rate=0.1",
        ],
    ],
)
def test_every_fault_ends_with_fault_free_tokens_and_an_intact_cpu_tier(faults, fault_free):
    report, _engine, _ = run(faults)
    assert report["output_digest"] == fault_free["output_digest"]
    assert report["requests_finished"] == 50
    assert report["integrity"]["mismatches"] == 0
    if any(f.startswith("kill") for f in faults):
        assert report["rank_restarts"] > 0
    if any(f.startswith("drop") for f in faults):
        assert report["flushes"]["timeout"] > 0  # lost acks were asked for again


def test_corrupt_cpu_chunks_are_caught_at_load_never_read_and_leave_the_tier(fault_free):
    # chunks corrupted after they landed stay in the tier until a load checks them, so the
    # tier is not byte-checked here; the synthetic model's own check of every loaded block
    # (mismatches) shows that no corrupt byte was read
    report, engine, _ = run(["corrupt-cpu:rate=0.3:seed=6"], check_tier=False)
    integrity = report["integrity"]
    assert (
        integrity["corrupt_detected"] > 0 and integrity["checked"] > integrity["corrupt_detected"]
    )
    assert integrity["mismatches"] == 0 and integrity["blocks_verified"] > 0
    assert engine.connector.stats.corrupt_loads > 0
    assert report["output_digest"] == fault_free["output_digest"]
    assert report["requests_finished"] == 50


def test_a_kill_while_loads_and_stores_are_in_flight(fault_free, monkeypatch):
    # the survivor's copies stay really pending for 3 steps (its unthreaded engine runs them
    # late), so at the kill loads and stores are in flight there. A spy on the connector's reset
    # (the real one runs) records what the recovery abandoned.
    abandoned: list[set[bool]] = []
    reset = ConnectorScheduler.reset

    def spying_reset(self: ConnectorScheduler, keep_tier: bool = False) -> list:
        abandoned.append({job.is_store for job in self.jobs.jobs.values()})
        return reset(self, keep_tier)

    monkeypatch.setattr(ConnectorScheduler, "reset", spying_reset)
    report, _engine, _ = run(["kill-worker:step=25:rank=0"], exec_delays={1: lambda job: 3})
    assert abandoned == [{True, False}], "the kill did not find both loads and stores in flight"
    assert report["output_digest"] == fault_free["output_digest"]
    assert report["rank_restarts"] == 1


def test_a_rank_that_never_acks_is_declared_dead_and_replaced(fault_free):
    report, _, _ = run(["drop-acks:rate=1:rank=1"], extra=("engine.rank_timeout_steps=20",))
    assert report["rank_restarts"] > 0
    assert report["output_digest"] == fault_free["output_digest"]


def test_a_request_stops_waiting_for_a_write_that_never_finishes(fault_free):
    # rank 1 holds every completion for ever (well, 10**6 steps): lookups that reach those
    # chunks are deferred until the request's bound (by the clock), then it recomputes; at the
    # end the jobs still unacked make rank 1 count as silent, and its replacement lets the run
    # drain
    extra = ("engine.max_wait_s=0.05", "engine.rank_timeout_steps=300")
    report, _, _ = run(["delay-acks:rank=1:steps=1000000"], extra=extra)
    assert report["deferral_timeouts"] > 0
    assert report["output_digest"] == fault_free["output_digest"]


def test_a_restarted_rank_finds_the_cpu_tier_in_shared_memory(fault_free):
    # the same death with the shards in shared memory (default) and in private memory: only
    # the first keeps the tier, serves more CPU hits afterwards, and its bytes still verify
    # (run() checks every readable chunk on every rank)
    kill = ["kill-worker:step=40:rank=1"]
    kept, _, checked = run(kill)
    lost, _, _ = run(kill, extra=("offload.shared_pool=false",))
    assert kept["rank_restarts"] == lost["rank_restarts"] == 1
    assert kept["tier_kept_restarts"] == 1 and lost["tier_kept_restarts"] == 0
    assert kept["output_digest"] == lost["output_digest"] == fault_free["output_digest"]
    assert kept["cpu_hit_tokens"] > lost["cpu_hit_tokens"]
    assert checked > 0


def test_a_fault_with_an_incarnation_strikes_only_that_instance_of_the_rank() -> None:
    faults = [parse_fault("drop-acks:rate=1:rank=1:incarnation=0")]
    assert RankFaults(1, faults, incarnation=0).drops()
    assert not RankFaults(1, faults, incarnation=1).active  # the replacement acks normally
    assert not RankFaults(0, faults, incarnation=0).active


def test_delay_acks_with_a_rate_holds_back_only_some_completions() -> None:
    some = RankFaults(0, [parse_fault("delay-acks:rank=0:steps=3:rate=0.5:seed=2")])
    delays = [some.ack_delay() for _ in range(200)]
    assert set(delays) == {0, 3} and 60 < delays.count(3) < 140
    every = RankFaults(0, [parse_fault("delay-acks:rank=0:steps=3")])
    assert {every.ack_delay() for _ in range(20)} == {3}


class _Rank:
    """A rank that reports, each step, the jobs it is told to (a stand-in for the real rank's
    step, so the wrapper's own holds, losses and copies are what the test sees)."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def execute(self, plan: StepPlan) -> StepReport:
        report = StepReport(0, plan.step, TransferReport(list(self.done)))
        self.done = []
        return report


def test_a_faulty_rank_holds_reports_back_and_answers_a_reack_at_once() -> None:
    inner = _Rank()
    rank = FaultyRank(inner, RankFaults(0, [parse_fault("delay-acks:rank=0:steps=2")]))
    inner.done = [7]
    assert rank.execute(StepPlan(0)).transfers.completed == []
    assert rank.held_jobs() == [7]
    assert rank.execute(StepPlan(1)).transfers.completed == []
    assert rank.execute(StepPlan(2)).transfers.completed == [7]
    inner.done = [8]
    rank.execute(StepPlan(3))
    inner.done = [8]  # asked again (the real rank re-reports what it reported before)
    asked = rank.execute(StepPlan(4, TransferPlan(reack=[8])))
    assert asked.transfers.completed == [8] and rank.held_jobs() == []


def test_a_faulty_rank_dies_at_its_step() -> None:
    rank = FaultyRank(_Rank(), RankFaults(0, [parse_fault("kill-worker:step=2:rank=0")]))
    rank.execute(StepPlan(1))
    with pytest.raises(RankDied, match="step 2"):
        rank.execute(StepPlan(2))


def test_a_stalled_rank_hangs_in_its_step_only_and_only_in_its_first_incarnation() -> None:
    fault = parse_fault("stall-worker:step=2:rank=0:seconds=0.3")
    rank = FaultyRank(_Rank(), RankFaults(0, [fault]))
    took = []
    for step in (1, 2, 3):
        started = time.perf_counter()
        rank.execute(StepPlan(step))
        took.append(time.perf_counter() - started)
    assert took[1] >= 0.3 and took[0] < 0.3 and took[2] < 0.3
    assert RankFaults(0, [fault], incarnation=1).stall_at(2) == 0.0
    assert RankFaults(1, [fault]).stall_at(2) == 0.0


def test_a_failed_copy_holds_no_block_and_is_reported_failed_by_the_next_poll() -> None:
    class Backend:  # records what reaches the real engine
        def __init__(self) -> None:
            self.submitted: list[int] = []
            self.flushed: list[int] = []

        def submit(self, spec: TransferSpec) -> None:
            self.submitted.append(spec.job_id)

        def flush(self, job_ids) -> None:
            self.flushed += list(job_ids)

        def poll(self) -> tuple[list[int], list[int]]:
            return list(self.submitted), []

        def pending_reads(self) -> set[int]:
            return set()

    inner = Backend()
    backend = FaultyBackend(inner, RankFaults(0, [parse_fault("fail-copy:rate=1")]))
    backend.submit(TransferSpec(5, True, BlockCopy([1], [0], [0])))
    backend.flush([5])
    assert inner.submitted == [] and inner.flushed == [] and backend.pending_reads() == set()
    assert backend.poll() == ([], [5])
    assert backend.poll() == ([], [])
