"""The soak's drain check reads the live engine's books and can fail: books read while jobs are
in flight, a leaked GPU block, a slot left being written, or books with keys missing (what the
check once took for drained) are all reported; the books after a whole run are drained."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver
from raykv.workload.requests import make_workload
from tests.cluster.test_ray_engine import SMALL

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_books_read_while_jobs_are_in_flight_are_not_drained_and_after_the_run_they_are(
    soak,
) -> None:
    # rank 1 reports every job 3 steps late: jobs stay in the table, stores keep their slots
    late = 'faults=["delay-acks:rank=1:steps=3"]'
    cfg = load_config(None, [*SMALL, "parallel.tensor_parallel_size=2", late])
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        driver = Driver(engine)
        driver.submit(make_workload(cfg))
        mid: dict[str, int] | None = None
        while driver.has_work():
            driver.step()
            driver.take_finished()
            if mid is None and engine.connector.jobs and engine.totals.steps > 5:
                mid = soak.books_of(engine)
        after = soak.books_of(engine)
        assert mid is not None, "no step had jobs in flight"
        problems = soak.drain_problems(mid)
        assert any(p.startswith("jobs = ") for p in problems), problems
        assert any(p.startswith("tracked = ") for p in problems), problems
        assert any(p.startswith("gpu_blocks_leaked = ") for p in problems), problems
        assert soak.drain_problems(after) == []
        # a GPU block nobody frees, and a CPU-tier slot left being written, are found
        leaked = engine.pool.allocate(1)
        assert soak.drain_problems(soak.books_of(engine)) == ["gpu_blocks_leaked = 1"]
        engine.pool.free(leaked)
        directory = engine.connector.directory
        plan = directory.prepare_store([2**40 + 1])
        assert plan is not None
        assert soak.drain_problems(soak.books_of(engine)) == ["writing = 1"]
        directory.complete_store([2**40 + 1], success=False)
        assert soak.drain_problems(soak.books_of(engine)) == []


def test_books_that_say_nothing_are_not_drained(soak) -> None:
    assert set(soak.drain_problems({})) == {f"{key} missing from the books" for key in soak.DRAINED}
    books = dict.fromkeys(soak.DRAINED, 0)
    assert soak.drain_problems(books) == []
    books["reading"] = 2
    assert soak.drain_problems(books) == ["reading = 2"]
    del books["fence"]
    assert soak.drain_problems(books) == ["fence missing from the books", "reading = 2"]


def test_ray_books_are_read_in_the_same_keys(soak, ray_session) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Server:  # answers like EngineServer.books, with two GPU blocks leaked
        def books(self) -> dict[str, int]:
            keys = ("jobs", "fence", "tracked", "writing", "reading", "loading")
            return {**dict.fromkeys(keys, 0), "gpu_blocks_leaked": 2}

    server = Server.remote()
    try:
        assert soak.drain_problems(soak.ray_books(server)) == ["gpu_blocks_leaked = 2"]
    finally:
        ray.kill(server)
