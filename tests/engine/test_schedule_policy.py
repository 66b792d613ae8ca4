"""The admission order (``engine.schedule_policy``).

shortest-prefill admits the waiting request with the least prompt left to compute first, once
the GPU prefix cache and the CPU tier have supplied theirs, and a request passed over for
``engine.max_bypass_steps`` steps first after that. Real engine, real connector, real CPU copies
(the connector harness).
"""

from __future__ import annotations

import pytest

from tests.connector.harness import Runner, tokens


def _runner(policy: str, **kwargs) -> Runner:
    settings = [f"engine.schedule_policy={policy}"]
    if "max_bypass_steps" in kwargs:
        settings.append(f"engine.max_bypass_steps={kwargs.pop('max_bypass_steps')}")
    return Runner(block_size=4, load_in_step=True, settings=tuple(settings), **kwargs)


def _finish_order(r: Runner, max_steps: int = 200) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not r.engine.has_work():
            return order
        order += [req.req_id for req in r.step()]
    raise AssertionError("not drained")


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prefill"])
def test_a_request_the_cpu_tier_serves_goes_before_a_longer_one_that_came_first(
    policy: str,
) -> None:
    r = _runner(policy, max_num_seqs=1)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.add("long", tokens(30, 500))
    b = r.add("cached", [*prompt, 99])
    order = _finish_order(r)
    assert order == (["long", "cached"] if policy == "fcfs" else ["cached", "long"])
    assert b.num_cpu_hit_tokens == 12
    r.drained()
    r.close()


@pytest.mark.parametrize(
    ("policy", "bypass", "expected"),
    [
        ("fcfs", 16, ["long", "s0", "s1", "s2", "s3"]),
        ("shortest-prefill", 16, ["s0", "s1", "s2", "s3", "long"]),
        # after 2 steps everyone waiting counts as starved: arrival order from then on
        ("shortest-prefill", 2, ["s0", "s1", "long", "s2", "s3"]),
    ],
)
def test_a_request_passed_over_for_max_bypass_steps_goes_first(
    policy: str, bypass: int, expected: list[str]
) -> None:
    r = _runner(policy, max_num_seqs=1, max_bypass_steps=bypass, offload=False)
    r.add("long", tokens(30, 500))
    for i in range(4):
        r.add(f"s{i}", tokens(2, 100 * i))
    assert _finish_order(r) == expected
    r.close()
