"""The admission order (``engine.schedule_policy``) and short first-token steps.

shortest-prefill admits the waiting request with the least prompt left to compute first, once
the GPU prefix cache and the CPU tier have supplied theirs, and a request passed over for
``engine.max_bypass_steps`` steps first after that. ``engine.short_prefill_alone`` runs a step
whose prompt work is short and gives a first token without the decodes. Real engine, real
connector, real CPU copies (the connector harness).
"""

from __future__ import annotations

import pytest

from tests.connector.harness import Runner, tokens


def _runner(policy: str, **kwargs) -> Runner:
    settings = [f"engine.schedule_policy={policy}"]
    for key in ("max_bypass_steps", "short_prefill_alone"):
        if key in kwargs:
            settings.append(f"engine.{key}={kwargs.pop(key)}")
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


def _decode_steps(r: Runner, decoding, cached, steps: int) -> list[tuple[int, int]]:
    """(tokens ``decoding`` has generated, tokens ``cached`` has) after each of ``steps``."""
    seen = []
    for _ in range(steps):
        r.step()
        seen.append((len(decoding.output), len(cached.output)))
    return seen


@pytest.mark.parametrize("alone", [0, 4, 16])
def test_a_short_first_token_step_leaves_the_decodes_to_the_next_step(alone: int) -> None:
    r = _runner("fcfs", short_prefill_alone=alone)
    prompt = tokens(13)
    r.offload("a", prompt)
    decoding = r.add("d", tokens(6, 300), max_tokens=12)
    r.step(2)
    before = len(decoding.output)
    assert before == 2
    # 12 tokens from the CPU tier, 2 computed beside the load in the step that admits it
    cached = r.add("cached", [*prompt, 98, 99], max_tokens=3)
    seen = _decode_steps(r, decoding, cached, 3)
    assert cached.num_cpu_hit_tokens == 12
    if alone >= 2:  # its first token in a step of its own; the decode goes on the next step
        assert seen == [(2, 1), (3, 2), (4, 3)]
    else:
        assert seen == [(3, 1), (4, 2), (5, 3)]
    r.run()
    assert len(decoding.output) == 12
    r.drained()
    r.close()


def test_a_long_prompt_and_back_to_back_short_ones_keep_the_decodes() -> None:
    r = _runner("fcfs", short_prefill_alone=4)
    decoding = r.add("d", tokens(6, 300), max_tokens=12)
    r.step(2)
    long = r.add("long", tokens(9, 500), max_tokens=1)  # 9 computed tokens: more than 4
    assert _decode_steps(r, decoding, long, 1) == [(3, 1)]
    # two short prompts, admitted in consecutive steps: only the first step leaves the decode
    first = r.add("s0", tokens(2, 700), max_tokens=1)
    r.step()
    assert (len(decoding.output), len(first.output)) == (3, 1)
    second = r.add("s1", tokens(2, 800), max_tokens=1)
    r.step()
    assert (len(decoding.output), len(second.output)) == (4, 1)
    r.run()
    r.close()


def test_the_decodes_are_kept_while_a_request_is_left_waiting() -> None:
    r = _runner("fcfs", short_prefill_alone=16, max_num_seqs=2)
    decoding = r.add("d", tokens(6, 300), max_tokens=12)
    r.step(2)
    short = r.add("s0", tokens(2, 700), max_tokens=3)
    r.add("queued", tokens(2, 800), max_tokens=1)  # no seat left for it this step
    assert _decode_steps(r, decoding, short, 1) == [(3, 1)]
    r.run()
    r.close()
