"""Async scheduling (``engine.async_scheduling``): each step is planned while the ranks run the
one before, counted as computed when planned, its decodes' input tokens written in once that
step answers. The tokens are the one-step-at-a-time engine's, through preemption, loads,
EOS, aborts in flight and rank deaths. Real engine, real connector, real CPU copies."""

from __future__ import annotations

import pytest

from raykv.config import load_config
from raykv.core.request import Request, RequestStatus
from raykv.core.step import StepPlan, StepReport
from raykv.engine.batch import PENDING_TOKEN
from raykv.engine.core import EngineCore
from raykv.engine.stats import drain_books
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import run_engine
from raykv.workload.requests import make_workload

BASE = [
    "workload.num_requests=30",
    "workload.system_prompt_tokens=40",
    "workload.user_tokens=12",
    "workload.answer_tokens=8",
    "workload.max_tokens=6",
    "model.head_dim=8",
    "cache.num_gpu_blocks=36",  # small: preemption and reuse
    "parallel.tensor_parallel_size=2",
    "model.num_kv_heads=2",
    "offload.take_hits=always",  # loads under planning ahead are the point, not the choice
]


class Recorder:
    """The in-process ranks, with every plan sent and every reply taken written down in order
    (what the ranks saw, and when the engine waited for them)."""

    def __init__(self, workers: LocalWorkerGroup) -> None:
        self.events: list[tuple[str, int]] = []
        self.plans: list[StepPlan] = []
        execute = workers.execute

        def recording(plan: StepPlan) -> list[StepReport]:
            self.events.append(("ran", plan.step))
            self.plans.append(plan)
            return execute(plan)

        workers.execute = recording  # type: ignore[method-assign]
        submit = workers.submit
        events = self.events

        class Handle:
            def __init__(self, plan: StepPlan) -> None:
                self.step, self.handle = plan.step, submit(plan)

            def result(self) -> list[StepReport]:
                events.append(("answered", self.step))
                return self.handle.result()

        workers.submit = Handle  # type: ignore[method-assign,assignment]


def _run(sets: list[str], *, asynchronous: bool) -> tuple[dict, EngineCore, Recorder]:
    cfg = load_config(None, [*sets, f"engine.async_scheduling={str(asynchronous).lower()}"])
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        recorder = Recorder(workers)
        engine = EngineCore(cfg, workers, verify=True)
        schedule = engine.scheduler.schedule

        def recording_schedule(step: int):
            recorder.events.append(("planned", step))
            return schedule(step)

        engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        report = run_engine(engine, make_workload(cfg), check_invariants=True).as_dict()
        assert not any(drain_books(engine).values())
        return report, engine, recorder


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["parallel.tensor_parallel_size=1", "model.eos_every=4"],
        ["offload.load_in_step=false", "cache.block_size=8", "model.eos_every=3"],
        ["engine.short_prefill_alone=32", "engine.schedule_policy=shortest-prefill"],
        ["offload.enabled=false", "engine.max_num_batched_tokens=24"],
    ],
)
def test_planning_ahead_gives_the_tokens_of_one_step_at_a_time(extra: list[str]) -> None:
    sets = [*BASE, *extra]
    sync, _, sync_rec = _run(sets, asynchronous=False)
    ahead, engine, rec = _run(sets, asynchronous=True)
    assert ahead["output_digest"] == sync["output_digest"]
    assert ahead["requests_finished"] == sync["requests_finished"] == 30
    assert ahead["integrity"]["mismatches"] == 0
    if "offload.enabled=false" not in extra:
        assert ahead["cpu_hit_tokens"] > 0
    # one step at a time: step k is planned only after step k-1 ran; ahead: step k is
    # planned before the engine takes step k-1's replies
    planned_ahead = [
        step
        for step in range(1, engine.totals.steps)
        if rec.events.index(("planned", step)) < rec.events.index(("answered", step - 1))
    ]
    assert len(planned_ahead) > engine.totals.steps // 2
    assert all(
        sync_rec.events.index(("planned", s)) > sync_rec.events.index(("ran", s - 1))
        for s in range(1, 20)
    )
    # no placeholder ever reached a rank, and decodes really were planned before their input
    # token existed: the plans carried the same tokens, filled in
    assert not any(PENDING_TOKEN in e.tokens for p in rec.plans for e in p.batch)


@pytest.mark.parametrize("eos_every", [0, 3])
def test_only_an_end_the_plan_could_not_know_wastes_a_token(eos_every: int) -> None:
    # a request's last token by max_tokens is known when the next step is planned: it is not
    # planned again. An EOS is known only once its step answers: the step planned meanwhile
    # computed a token for it, which is thrown away
    sets = [*BASE, f"model.eos_every={eos_every}"]
    sync, engine_sync, _ = _run(sets, asynchronous=False)
    ahead, engine, _ = _run(sets, asynchronous=True)
    assert ahead["output_digest"] == sync["output_digest"]
    assert engine_sync.totals.discarded_samples == 0
    stopped = sum(r.status is RequestStatus.FINISHED_STOPPED for r in engine.requests.values())
    if eos_every == 0:
        assert stopped == 0 and engine.totals.discarded_samples == 0
    else:
        assert stopped > 0 and 0 < engine.totals.discarded_samples <= stopped


def _engine(sets: list[str]) -> tuple[EngineCore, LocalWorkerGroup]:
    cfg = load_config(None, [*sets, "engine.async_scheduling=true"])
    workers = LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False)
    return EngineCore(cfg, workers, verify=True), workers


def _drain(engine: EngineCore, limit: int = 2000) -> list[Request]:
    done: list[Request] = []
    for _ in range(limit):
        if not engine.has_work():
            return done
        done += engine.step()
        engine.check_invariants()
    raise AssertionError("not drained")


def test_a_request_aborted_while_its_step_is_in_flight_takes_nothing_from_it() -> None:
    engine, workers = _engine([*BASE, "offload.enabled=false"])
    with workers:
        a = Request("a", 0, list(range(1, 30)), 8)
        b = Request("b", 1, list(range(40, 60)), 8)
        engine.add_request(a)
        engine.add_request(b)
        while len(a.output) < 2:
            engine.step()
        # the step planned for a's next token is on its way: abort it now
        assert engine._in_flight is not None and a.num_pending == 1
        have = list(a.output)
        engine.abort("a")
        _drain(engine)
        assert a.status is RequestStatus.FINISHED_ABORTED and a.output == have
        assert len(b.output) == 8
        assert engine.pool.num_free == engine.pool.num_usable
    # b's tokens are those of a run where a was never there to abort
    ref, ref_workers = _engine([*BASE, "offload.enabled=false"])
    with ref_workers:
        b2 = Request("b", 1, list(range(40, 60)), 8)
        ref.add_request(b2)
        _drain(ref)
    assert b.output == b2.output


def test_a_rank_death_while_planning_ahead_loses_only_the_unsent_plan() -> None:
    faults = 'faults=["kill-worker:step=9:rank=1", "kill-worker:step=25:rank=0"]'
    sets = [*BASE, "offload.shared_pool=true"]
    sync, _, _ = _run(sets, asynchronous=False)
    ahead, engine, _ = _run([*sets, faults], asynchronous=True)
    assert ahead["rank_restarts"] == 2
    assert ahead["output_digest"] == sync["output_digest"]
    assert ahead["integrity"]["mismatches"] == 0
    assert all(r.num_pending == 0 for r in engine.requests.values())


def _tier_served_tokens(reset_while_loading: bool) -> tuple[list[int], int]:
    from tests.connector.harness import Runner, tokens

    r = Runner(
        block_size=4,
        load_in_step=True,
        max_num_seqs=2,
        settings=("engine.async_scheduling=true",),
    )
    prompt = tokens(13)
    r.offload("a", prompt)
    # c keeps steps going, so b is admitted in a step planned ahead (and in flight between
    # two calls of step)
    r.add("c", tokens(6, 500), max_tokens=12)
    r.step(2)
    b = r.add("b", [*prompt, 99], max_tokens=4)
    resets = 0
    for _ in range(200):
        if not r.engine.has_work():
            break
        in_flight = r.engine._in_flight
        if (
            reset_while_loading
            and not resets
            and in_flight is not None
            and any(s.loading and s.req is b for s in in_flight[0].sched.scheduled)
        ):
            # b's load and the rest of its prompt are on their way: empty the tier under them
            r.engine.reset_offload()
            resets += 1
        r.step()
        r.engine.check_invariants()
    r.drained()
    r.close()
    return b.output, resets


def test_a_load_cancelled_while_its_step_is_in_flight_does_not_count_for_the_readmission() -> None:
    # the reset sends b back to waiting and it is admitted afresh (recomputing) in the step
    # planned while the cancelled load's step runs: that step's tokens beside the cancelled
    # load are not the new admission's
    served, _ = _tier_served_tokens(reset_while_loading=False)
    recomputed, resets = _tier_served_tokens(reset_while_loading=True)
    assert resets == 1
    assert recomputed == served and len(served) == 4
