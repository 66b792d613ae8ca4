"""Hits from raykv's tiers inside vLLM give what vLLM computes itself: the same greedy tokens and
logprobs within 1e-4 of the same engine without offloading, with vLLM's GPU prefix cache on and
off; a chunk found bad is recomputed, never served."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.vllm.conftest import (
    BLOCK_TOKENS,
    answer,
    answers,
    drain,
    engine,
    manager_of,
    prompt_text,
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
    "prefix_caching", [True, False], ids=["gpu-prefix-cache", "no-prefix-cache"]
)
def test_cpu_tier_hits_answer_as_vllm_does(vllm_model, reference, prefix_caching) -> None:
    with engine(vllm_model, {"cpu_bytes": "64MiB"}, prefix_caching) as llm:
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


def test_disk_tier_hits_after_the_cpu_tier_evicted(vllm_model, reference, tmp_path) -> None:
    # four CPU slots: each prompt (three chunks) evicts the one before, which the disk keeps
    settings = {"cpu_slots": 4, "disk": {"enabled": True, "path": str(tmp_path)}}
    with engine(vllm_model, settings) as llm:
        for prompt in PROMPTS:
            answer(llm, prompt)
            drain(llm)
        manager = manager_of(llm)
        assert manager.cpu.stats().evictions > 0
        llm.reset_prefix_cache()
        disk_loads = manager.disk.stats().loads
        # all at once: their lookups, promotions and loads interleave in vLLM's steps
        for prompt, got in zip(PROMPTS, answers(llm, PROMPTS), strict=True):
            assert got[2] >= BLOCK_TOKENS
            same(got, reference[prompt])
        assert manager.disk.stats().loads > disk_loads, "no hit came from the disk tier"


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
        assert len(manager.disk) >= 2, "the first process left nothing on disk"
        got = answer(llm, prompt)
        assert got[2] >= BLOCK_TOKENS
        assert manager.disk.stats().loads > 0
        same(got, reference[prompt])
