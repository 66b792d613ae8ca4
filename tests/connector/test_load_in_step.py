"""A loaded request computes in the step that loads it (``offload.load_in_step``).

Every rank finishes such a load before its model step (the harness's unthreaded CPU engine copies
only at a poll or a flush, so a rank that did not finish it first would read blocks a load still
writes, and the fence check raises). The tokens computed beside a load count only if every rank
acked the load in that very step's reports; a failed, corrupt or late load voids them and the
request computes them again. In every case the tokens equal those of a run without offloading.
"""

from __future__ import annotations

import pytest

from raykv.faults import parse_fault
from tests.connector.harness import Runner, tokens


def _load_step(r: Runner, req_id: str) -> int:
    """Index of the (only) step whose plan loads for ``req_id``."""
    steps = [i for i, rec in enumerate(r.records) if rec.loaded.get(req_id)]
    assert len(steps) == 1, f"{req_id} loaded in steps {steps}"
    return steps[0]


def _reference(prompt: list[int], max_tokens: int, **runner) -> list[int]:
    r = Runner(offload=False, **runner)
    req = r.add("ref", prompt, max_tokens)
    r.run()
    r.close()
    return req.output


@pytest.mark.parametrize("in_step", [True, False])
def test_the_first_token_comes_in_the_loading_step_or_one_step_later(in_step: bool) -> None:
    r = Runner(block_size=4, load_in_step=in_step)
    prompt = tokens(13)
    r.offload("a", prompt)
    b = r.add("b", [*prompt, 99, 98, 97, 96], max_tokens=3)
    first_output_step = None
    while r.engine.has_work():
        r.step()
        if b.output and first_output_step is None:
            first_output_step = len(r.records) - 1
    load = _load_step(r, "b")
    assert [s.same_step for s in r.records[load].plan.loads] == [in_step]
    assert first_output_step == (load if in_step else load + 1)
    assert (b.num_gpu_hit_tokens, b.num_cpu_hit_tokens) == (0, 12)
    assert r.engine.totals.transfer.blocks_verified == 3
    assert r.engine.totals.transfer.mismatches == 0
    assert b.output == _reference([*prompt, 99, 98, 97, 96], 3, block_size=4)
    r.drained()
    r.close()


def test_what_a_request_computes_beside_its_load_is_stored_by_a_later_step() -> None:
    # one load xor stores: the 8 tokens computed beside the load fill two more blocks, which
    # a later plan stores
    r = Runner(block_size=4, load_in_step=True)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.add("b", [*prompt[:12], *tokens(9, 200)], max_tokens=1)
    r.run()
    load = _load_step(r, "b")
    assert not r.records[load].stored.get("b")
    assert r.blocks("stored", "b") == {3, 4}
    r.drained()
    r.close()


def test_a_load_beside_a_chunked_prefill_goes_on_in_later_steps() -> None:
    r = Runner(block_size=4, load_in_step=True, max_num_batched_tokens=4)
    prompt = tokens(13)
    r.offload("a", prompt)
    rest = tokens(10, 300)
    b = r.add("b", [*prompt[:12], *rest], max_tokens=2)
    r.run()
    assert b.num_cpu_hit_tokens == 12
    assert b.output == _reference([*prompt[:12], *rest], 2, block_size=4)
    r.drained()
    r.close()


@pytest.mark.parametrize(
    "fault",
    [
        "fail-copy:rate=1:rank=1",  # the load fails on one rank: its compute read garbage there
        "delay-acks:rank=1:steps=3",  # the load landed, but one rank's ack comes late
        "corrupt-cpu:rate=1:rank=1",  # the stored chunk went bad: the checksum fails the load
    ],
)
def test_a_load_not_acked_by_every_rank_in_its_step_voids_the_tokens_beside_it(
    fault: str,
) -> None:
    prompt = tokens(13)
    # rank 1 is built with a fault that does nothing, so that its fault wrappers exist; the
    # real fault is switched on once the first request's chunks are in the CPU tier (a fake
    # schedule of faults, to aim them at the second request's load alone)
    r = Runner(block_size=4, tp=2, load_in_step=True, faults=("fail-copy:rate=0:rank=1",))
    r.engine.connector.check_sums = True  # what offload.verify turns on for a real model
    r.offload("a", prompt)
    worker = r.workers.workers[1]
    if fault.startswith("corrupt-cpu"):  # spoil what is already stored
        for spec in (spec for rec in r.records for spec in rec.plan.stores):
            worker.engine.corrupt_rows(spec.copy)
    else:
        worker.faults.faults[:] = [parse_fault(fault)]
    b = r.add("b", [*prompt, 99, 98, 97, 96], max_tokens=3)
    load = None
    while r.engine.has_work():
        r.step()
        if load is None and r.records[-1].loaded.get("b"):
            load = len(r.records) - 1
            assert not b.output, "tokens computed beside an unacked load were kept"
    assert load is not None
    assert b.output == _reference([*prompt, 99, 98, 97, 96], 3, block_size=4, tp=2)
    r.drained()
    r.close()
