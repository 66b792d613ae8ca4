"""Hits from raykv's tiers inside vLLM give what vLLM computes itself: the same greedy tokens and
logprobs within 1e-4 of the same engine without offloading, with vLLM's GPU prefix cache on and
off, from each tier: CPU, disk (after the CPU tier evicted, and in a second process) and shared
(Mooncake Store: published by one engine, loaded by another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raykv.transfer.chunk_jobs import THROUGH_WRITE_NICENESS
from tests.vllm.conftest import (
    BLOCK_TOKENS,
    answer,
    answers,
    drain,
    engine,
    manager_of,
    prompt_text,
    worker_of,
)

TOLERANCE = 1e-4
PROMPTS = [prompt_text(seed) for seed in range(3)]


@pytest.fixture(scope="module")
def reference(vllm_model) -> dict[str, tuple[list[int], list[float]]]:
    """What vLLM answers without offloading."""
    with engine(vllm_model, None) as llm:
        return {prompt: answer(llm, prompt)[:2] for prompt in PROMPTS}


def same(got: tuple[list[int], list[float], int], want: tuple[list[int], list[float]]) -> None:
    tokens, logprobs, _ = got
    assert tokens == want[0]
    assert max(abs(a - b) for a, b in zip(logprobs, want[1], strict=True)) <= TOLERANCE


@pytest.mark.parametrize(
    ("prefix_caching", "copy_thread"),
    [(True, None), (False, True)],
    ids=["gpu-prefix-cache", "no-prefix-cache-copy-thread"],
)
def test_cpu_tier_hits_answer_as_vllm_does(
    vllm_model, reference, prefix_caching, copy_thread
) -> None:
    """The copies run in vLLM's step (the default) or on raykv's thread beside it."""
    settings = {"cpu_bytes": "64MiB", "copy_thread": copy_thread}
    with engine(vllm_model, settings, prefix_caching) as llm:
        assert worker_of(llm).copies.threaded is bool(copy_thread)
        for prompt in PROMPTS:
            same(answer(llm, prompt), reference[prompt])
        drain(llm)
        loads_before = manager_of(llm).cpu.stats().loads
        for prompt in PROMPTS:
            if prefix_caching:
                llm.reset_prefix_cache()  # the GPU copies gone: only raykv's tier has them
            got = answer(llm, prompt)
            assert got[2] >= BLOCK_TOKENS, "nothing was loaded from the CPU tier"
            same(got, reference[prompt])
        assert manager_of(llm).cpu.stats().loads > loads_before


def evicted_then_loaded(model, reference, settings: dict, tier: str) -> None:
    """With four CPU slots each prompt (three chunks) evicts the one before, which ``tier``
    keeps: all prompts again (the GPU copies gone) load from it, and answer as vLLM does."""
    with engine(model, {"cpu_slots": 4, **settings}) as llm:
        for prompt in PROMPTS:
            answer(llm, prompt)
            drain(llm)
        # written through: a store completes only when its writes do (``chunk_jobs``)
        assert worker_of(llm).lower[tier].write_niceness == THROUGH_WRITE_NICENESS
        manager = manager_of(llm)
        assert manager.cpu.stats().evictions > 0
        llm.reset_prefix_cache()
        lower = getattr(manager, tier)
        loads = lower.stats().loads
        # all at once: their lookups, promotions and loads interleave in vLLM's steps
        for prompt, got in zip(PROMPTS, answers(llm, PROMPTS), strict=True):
            assert got[2] >= BLOCK_TOKENS
            same(got, reference[prompt])
        assert lower.stats().loads > loads, f"no hit came from the {tier} tier"


def test_disk_tier_hits_after_the_cpu_tier_evicted(vllm_model, reference, tmp_path) -> None:
    settings = {"disk": {"enabled": True, "path": str(tmp_path)}}
    evicted_then_loaded(vllm_model, reference, settings, "disk")


WARM_RESTART = """
import sys
from pathlib import Path
from tests.vllm.conftest import answer, drain, engine
settings = {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": sys.argv[2]}}
with engine(Path(sys.argv[1]), settings) as llm:
    answer(llm, sys.argv[3])
    drain(llm)
"""


def test_a_second_vllm_process_loads_the_first_ones_disk_tier(
    vllm_model, reference, tmp_path
) -> None:
    prompt = PROMPTS[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", WARM_RESTART, str(vllm_model), str(tmp_path), prompt],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    settings = {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": str(tmp_path)}}
    with engine(vllm_model, settings) as llm:
        manager = manager_of(llm)
        got = answer(llm, prompt)  # its first request: the namespace agreed on meanwhile
        assert len(manager.disk) >= 2, "the first process left nothing on disk"
        assert got[2] >= BLOCK_TOKENS
        assert manager.disk.stats().loads > 0
        same(got, reference[prompt])


def stepped_answer(llm, prompt: str, max_steps: int = 200) -> tuple[list[int], list[float], int]:
    """``answer``, stepping vLLM's engine by hand: an AssertionError, not a hang, where the
    request has not finished within ``max_steps`` steps."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    llm.llm_engine.add_request("stepped", prompt, params)
    for _ in range(max_steps):
        for out in llm.llm_engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
                steps = out.outputs[0].logprobs
                logprobs = [step[t].logprob for step, t in zip(steps, tokens, strict=True)]
                return tokens, logprobs, out.num_cached_tokens or 0
    raise AssertionError(f"the request did not finish in {max_steps} steps")


def stored_on_disk(model, path: str, prompt: str) -> int:
    """An engine with room for every chunk answers ``prompt``: the chunks on its disk."""
    with engine(model, {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": path}}) as llm:
        answer(llm, prompt)
        drain(llm)
        return len(manager_of(llm).disk)


def test_a_hit_larger_than_the_cpu_tier_loads_what_fits_and_computes_the_rest(
    vllm_model, reference, tmp_path
) -> None:
    # a chunk on disk is loaded through a CPU slot: a hit on more chunks than the CPU tier has
    # slots failed its load, and vLLM looked the request up again, found the same hit, and
    # never ran it (seen with `vllm serve`). The hit is now what the CPU tier has room for
    prompt = PROMPTS[2]
    assert stored_on_disk(vllm_model, str(tmp_path), prompt) >= 2
    settings = {"cpu_slots": 1, "disk": {"enabled": True, "path": str(tmp_path)}}
    with engine(vllm_model, settings) as llm:  # a warm start: the disk holds every chunk
        got = stepped_answer(llm, prompt)
        same(got, reference[prompt])
        assert got[2] == BLOCK_TOKENS  # the one that fits was loaded
        assert manager_of(llm).disk.stats().loads > 0
        # now the first chunk on disk and the second in the CPU tier's one slot (LRU evicted
        # the first): keeping the second would leave no slot to promote the first into, so
        # the hit is the first alone, and no load is refused
        drain(llm)
        llm.reset_prefix_cache()
        got = stepped_answer(llm, prompt)
        same(got, reference[prompt])
        assert got[2] == BLOCK_TOKENS
        assert all(r.ok for r in worker_of(llm).records if not r.is_store), "a load failed"


SECRET = "raykv-test-cluster-secret-0123456789"


def publish(model, settings: dict, prompt: str) -> int:
    """One engine answers ``prompt`` and its stores land; the chunks it published. (An engine
    per function: a caller's name still bound to a shut-down ``LLM`` frees it, and vLLM's
    process-global state with it, only when the next engine takes the name.)"""
    with engine(model, settings) as llm:
        answer(llm, prompt)
        drain(llm)
        return manager_of(llm).shared.stats().keys_stored


def load(model, settings: dict, prompt: str) -> tuple[tuple[list[int], list[float], int], int]:
    """A fresh engine (its CPU tier empty) answers ``prompt``: the answer, and the chunks it
    loaded from the shared tier."""
    with engine(model, settings) as llm:
        got = answer(llm, prompt)
        return got, manager_of(llm).shared.stats().loads


def test_a_second_engine_loads_what_the_first_published_to_the_shared_tier(
    vllm_model, reference, shared_store, monkeypatch
) -> None:
    # the store's master and its pool's memory are this session's: neither engine gives any
    monkeypatch.setenv("RAYKV_SHARED_SECRET", SECRET)
    settings = {
        "cpu_bytes": "16MiB",
        "shared": {"enabled": True, "master": shared_store, "mount": False, "segment": "64MiB"},
    }
    prompt = PROMPTS[2]
    assert publish(vllm_model, settings, prompt) >= 2, "nothing was published"
    # an engine with another secret never sees the parts (its namespace is another), so it
    # neither serves them nor takes them from the others
    monkeypatch.setenv("RAYKV_SHARED_SECRET", "another-secret-of-sixteen-bytes-or-more")
    got, loads = load(vllm_model, settings, prompt)
    assert got[2] == 0 and loads == 0
    same(got, reference[prompt])
    monkeypatch.setenv("RAYKV_SHARED_SECRET", SECRET)
    got, loads = load(vllm_model, settings, prompt)
    assert got[2] >= BLOCK_TOKENS and loads > 0, "nothing was loaded from the shared tier"
    same(got, reference[prompt])


def test_an_engine_s_own_master_serves_what_its_cpu_tier_evicted(vllm_model, reference) -> None:
    # the store: a master and a segment of the engine's own
    settings = {"shared": {"enabled": True, "segment": "32MiB"}}
    evicted_then_loaded(vllm_model, reference, settings, "shared")


def test_requests_preempted_for_want_of_kv_blocks_answer_as_vllm_does(
    vllm_model, monkeypatch
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    # room for ten blocks, where the three requests grow to five each: vLLM preempts, and a
    # preempted request computes again what it lost, loading what raykv's CPU tier holds
    config = json.loads((vllm_model / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 32 * 4
    small = {"kv_cache_memory_bytes": 10 * BLOCK_TOKENS * per_token, "max_model_len": 1024}
    preempted: list[str] = []
    preempt = Scheduler._preempt_request

    def counted(self, request, *args, **kwargs):  # observes vLLM's preemptions, changes none
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counted)

    def run(raykv: dict | None) -> tuple[list, int]:  # an engine per call (see ``publish``)
        with engine(vllm_model, raykv, **small) as llm:
            found = answers(llm, PROMPTS, max_tokens=80)
            return found, 0 if raykv is None else manager_of(llm).cpu.stats().loads

    want, _ = run(None)
    assert preempted, "vLLM alone preempted nothing: the cache is not small enough"
    preempted.clear()
    got, loads = run({"cpu_bytes": "16MiB"})
    assert preempted, "nothing was preempted with raykv's spec"
    for mine, theirs in zip(got, want, strict=True):
        same(mine, theirs[:2])
    assert loads > 0, "no preempted request loaded from the CPU tier"


def test_a_killed_master_costs_hits_never_answers(vllm_model, reference) -> None:
    from raykv.vllm import shared

    # the store's master dies mid-run (its process killed, as a node's failure would): lookups,
    # publishes and promotions from the store fail, vLLM recomputes, and the engine serves on
    settings = {"cpu_slots": 4, "shared": {"enabled": True, "segment": "32MiB", "timeout_s": 2}}
    with engine(vllm_model, settings) as llm:
        for prompt in PROMPTS:
            answer(llm, prompt)
            drain(llm)
        manager = manager_of(llm)
        assert len(manager.shared) >= 6, "the store holds too little for the test"
        (master,) = shared._masters.values()
        master.kill()
        llm.reset_prefix_cache()
        for prompt, got in zip(PROMPTS, answers(llm, PROMPTS), strict=True):
            same(got, reference[prompt])
        for prompt in PROMPTS:  # and again, once the tier has paused
            same(answer(llm, prompt), reference[prompt])
        # up again before the engine stops: Mooncake's clients retry their goodbyes to a dead
        # master for 15 s each, with the interpreter's lock held
        master.restart()


def disk_files(path) -> list:
    return [p for p in path.rglob("rank-0/*/*.kv") if p.parent.name != "free"]


def stored_all(model, settings: dict) -> None:
    with engine(model, settings) as llm:
        for prompt in PROMPTS:
            answer(llm, prompt)
            drain(llm)


def restarted_smaller(model, settings: dict) -> tuple[int, int]:
    """A fresh engine on the path with a smaller capacity, after its first request: the
    chunks its disk tier took, and its capacity."""
    with engine(model, settings) as llm:
        answer(llm, PROMPTS[0])
        disk = manager_of(llm).disk
        return len(disk), disk.capacity


def test_a_restart_with_a_smaller_disk_capacity_keeps_that_many_files(vllm_model, tmp_path) -> None:
    """Found by an audit: restarted with 4 MiB, the tier took what fitted and left 12 MiB of
    files on disk for ever; now the newest are kept and the others' files deleted."""
    settings = {"cpu_slots": 4, "disk": {"enabled": True, "path": str(tmp_path)}}
    stored_all(vllm_model, settings)
    before = len(disk_files(tmp_path))
    smaller = {**settings, "disk": {**settings["disk"], "capacity": "600KiB"}}
    taken, capacity = restarted_smaller(vllm_model, smaller)
    assert 0 < taken == capacity < before
    assert len(disk_files(tmp_path)) == capacity
