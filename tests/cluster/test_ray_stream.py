"""Serving on Ray: ``RaykvClient.stream`` yields every submitted request exactly once, a refused
one (bad token id, too long, duplicate id) with status ``rejected`` and the reason; a refused
request never overwrites another's spec and is never resubmitted after a scheduler restart."""

from __future__ import annotations

import dataclasses

import pytest
import ray

from raykv.cluster.client import RaykvClient
from raykv.config import load_config
from raykv.workload.requests import RequestSpec, make_workload
from tests.cluster.test_ray_faults import SETS, expected_outputs

pytestmark = pytest.mark.timeout(900)


def refused_specs(cfg, specs: list[RequestSpec]) -> tuple[RequestSpec, RequestSpec, RequestSpec]:
    """A bad token id, a prompt longer than the GPU pool, and a duplicate of the last request
    (its own prompt, arriving first) while that one is still waiting to arrive."""
    vocab = cfg.model.vocab_size
    bad = RequestSpec("bad-token", (1, vocab + 5, 2), max_tokens=4, arrival=0)
    pool_tokens = cfg.cache.num_gpu_blocks * cfg.cache.block_size
    huge = RequestSpec("too-long", tuple([3] * (pool_tokens + 8)), max_tokens=4, arrival=0)
    dup = dataclasses.replace(specs[-1], prompt=(7, 7, 7, 7), arrival=0)
    return bad, huge, dup


def test_stream_yields_refused_requests_once_with_the_reason(ray_session) -> None:
    cfg = load_config(None, [*SETS, "workload.num_requests=30"])
    specs = make_workload(cfg)
    bad, huge, dup = refused_specs(cfg, specs)
    items = []
    with RaykvClient.start(cfg) as client:
        client.submit(specs)
        client.submit([bad, huge, dup])
        items = list(client.stream(timeout_s=600))
    rejected = {item[0]: item for item in items if item[2] == "rejected"}
    finished = {req_id: tokens for req_id, tokens, status in items if status != "rejected"}
    # every submission comes out once: each good request finished, each refused one rejected
    assert len(items) == len(specs) + 3
    assert sorted(rejected) == sorted([bad.req_id, huge.req_id, dup.req_id])
    assert "token id" in rejected[bad.req_id].reason
    assert rejected[huge.req_id].reason
    assert dup.req_id in rejected[dup.req_id].reason and "duplicate" in rejected[dup.req_id].reason
    assert rejected[bad.req_id][1] == []
    # the duplicate did not replace the first request with that id: it ran its own prompt
    assert finished == expected_outputs(cfg, specs)


def test_refused_requests_are_not_resubmitted_after_a_scheduler_restart(ray_session) -> None:
    # 120 requests arriving 2 per step: when the refused ones and a first output have
    # streamed, most have not arrived; the scheduler dies then and the client resubmits what it
    # has not yielded
    cfg = load_config(None, [*SETS, "workload.num_requests=120"])
    specs = make_workload(cfg)
    bad, huge, dup = refused_specs(cfg, specs)
    seen: list[tuple[str, str]] = []
    outputs: dict[str, list[int]] = {}
    with RaykvClient.start(cfg) as client:
        client.submit([bad, huge, *specs])
        client.submit([dup])
        killed = False
        for req_id, tokens, status in client.stream(timeout_s=600):
            seen.append((req_id, "rejected" if status == "rejected" else status[:8]))
            if status != "rejected":
                outputs[req_id] = tokens
            refused = {r for r, st in seen if st == "rejected"}
            if not killed and outputs and refused == {bad.req_id, huge.req_id, dup.req_id}:
                # every refusal and a first output have streamed: the scheduler actor dies
                ray.kill(client.server, no_restart=True)
                killed = True
        restarts = client.scheduler_restarts
        after = client.progress()  # the replacement scheduler's own counts
    assert restarts == 1
    # every submission streamed once: each request finished, each refused one rejected
    assert sorted(seen) == sorted(
        [(s.req_id, "finished") for s in specs] + [(r.req_id, "rejected") for r in (bad, huge, dup)]
    )
    # the replacement scheduler was given no refused request again, and the request whose id
    # was duplicated was resubmitted with its own prompt
    assert after["rejected"] == 0
    assert after["submitted"] < len(specs)
    assert outputs == expected_outputs(cfg, specs)
