"""The driver behind the scheduler actor holds a finished request's output only until the
output digest can take it in request order: serving with ``engine.keep_finished: false`` keeps
memory flat however many requests have been served, and the digest is the same as ever."""

from __future__ import annotations

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver, output_digest
from raykv.workload.requests import RequestSpec, make_workload
from tests.cluster.test_ray_engine import SMALL


def serve(keep_finished: bool, specs: list[RequestSpec]) -> tuple[dict, list[int], Driver]:
    """Serve ``specs`` the way the scheduler actor does (step, hand the finished over)."""
    cfg = load_config(None, [*SMALL, f"engine.keep_finished={str(keep_finished).lower()}"])
    outputs, held = {}, []
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        driver = Driver(EngineCore(cfg, workers))
        driver.submit(specs)
        while driver.has_work():
            driver.step()
            for req in driver.take_finished():
                outputs[req.index] = (req.req_id, tuple(req.output))
            held.append(driver.outputs_held)
        driver.report()  # what a report mid-serving costs: nothing kept for it
    return outputs, held, driver


def test_serving_without_keeping_finished_requests_holds_no_outputs() -> None:
    cfg = load_config(None, SMALL)
    specs = make_workload(cfg)
    # a refused request (token id out of range) in the middle: the digest skips its index
    specs.insert(5, RequestSpec("bad", (cfg.model.vocab_size + 1,), max_tokens=2, arrival=0))
    outputs, held, driver = serve(False, specs)
    assert len(outputs) == len(specs) - 1 == driver.finished_count
    # only outputs that finished ahead of an earlier request still running wait for it
    assert held[-1] == 0
    assert max(held) <= cfg.engine.max_num_seqs < len(specs)
    report = driver.report()
    assert report.requests_finished == len(specs) - 1
    assert report.output_digest == output_digest(outputs)
    # the same tokens and digest as when every finished request is kept
    kept_outputs, _, kept = serve(True, specs)
    assert kept_outputs == outputs
    assert kept.report().output_digest == report.output_digest


def test_a_report_mid_run_covers_every_request_finished_so_far() -> None:
    cfg = load_config(None, SMALL)
    specs = make_workload(cfg)
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        driver = Driver(EngineCore(cfg, workers))
        driver.submit(specs)
        outputs = {}
        while driver.has_work():
            driver.step()
            for req in driver.take_finished():
                outputs[req.index] = (req.req_id, tuple(req.output))
            if driver.outputs_held:  # some finished ahead of an earlier one
                break
        assert driver.report().output_digest == output_digest(outputs)
