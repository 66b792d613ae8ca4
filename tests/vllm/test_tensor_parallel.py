"""raykv inside vLLM at TP 2 on the CPU platform: vLLM's two workers run in processes of their
own (each bound to one core), each moves its own shard of every chunk (its KV heads) into its
own part of the CPU pool and its own disk directory, and one manager in the scheduler's process
keeps the tiers for both. A hit, from the CPU tier and from the disk after the CPU tier evicted,
answers as the same engine computing the prompt does."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import answer, drain, engine, manager_of, prompt_text
from tests.vllm.test_tiers import same

PROMPT, EVICTOR = prompt_text(21), prompt_text(22)


def test_two_workers_each_keep_their_shard_in_every_tier(
    vllm_model, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's automatic binding wants a NUMA node per worker; one core each here
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    settings = {"cpu_slots": 2, "disk": {"enabled": True, "path": str(tmp_path)}}
    # no GPU prefix cache: every hit is a load from raykv's tiers
    with engine(vllm_model, settings, prefix_caching=False, tensor_parallel_size=2) as llm:
        computed = answer(llm, PROMPT)
        assert computed[2] == 0
        drain(llm)
        loaded = answer(llm, PROMPT)  # from the CPU tier
        assert loaded[2] > 0, "nothing was loaded from the CPU tier"
        same(loaded, computed[:2])
        answer(llm, EVICTOR)  # the CPU tier gives PROMPT's chunks up; the disk keeps them
        drain(llm)
        manager = manager_of(llm)
        assert len(manager.disk) > len(manager.cpu)
        promoted = answer(llm, PROMPT)  # from the disk, through the CPU tier
        assert promoted[2] > 0, "nothing was loaded from the disk tier"
        same(promoted, computed[:2])
    # each rank wrote its own part of every chunk, under its own directory
    files = {rank: sorted(tmp_path.rglob(f"rank-{rank}/**/*.kv")) for rank in (0, 1)}
    assert files[0] and len(files[0]) == len(files[1])
    assert {p.name for p in files[0]} == {p.name for p in files[1]}
    assert files[0][0].read_bytes() != files[1][0].read_bytes()
