"""A chunk raykv's tiers hold that is not what was stored (a flipped byte, another chunk's file
under its name, a CPU page changed in memory) is recomputed by vLLM, never served: the answer
is vLLM's own, and the chunk leaves its tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from tests.vllm.conftest import answer, answers, drain, engine, manager_of, prompt_text, worker_of
from tests.vllm.test_tiers import same

PROMPT, EVICTOR = prompt_text(5), prompt_text(6)


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if p.parent.name != "free")


def flip_a_byte(files: list[Path]) -> None:
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))


def swap_contents(files: list[Path]) -> None:
    """Each file gets the next one's bytes: valid chunks, checksums and all, of other keys."""
    contents = [p.read_bytes() for p in files]
    for path, data in zip(files, contents[1:] + contents[:1], strict=True):
        path.write_bytes(data)


def every_report(manager):
    """Keep every report vLLM takes from the manager; the returned call sums them with a last."""
    taken = []
    report = manager.get_stats

    def keep():
        taken.append(report())
        return taken[-1]

    manager.get_stats = keep

    def total():
        summed = OffloadingConnectorStats()
        for one in [*taken, report()]:
            summed.aggregate(one)
        return summed

    return total


@pytest.fixture(scope="module")
def reference(vllm_model) -> tuple[list[int], list[float]]:
    with engine(vllm_model, None) as llm:
        return answer(llm, PROMPT)[:2]


@pytest.mark.parametrize("spoil", [flip_a_byte, swap_contents], ids=["corrupt", "forged"])
def test_a_bad_disk_chunk_is_recomputed(vllm_model, reference, tmp_path, spoil) -> None:
    settings = {"cpu_slots": 2, "disk": {"enabled": True, "path": str(tmp_path)}}
    with engine(vllm_model, settings) as llm:
        reports = every_report(manager_of(llm))
        answer(llm, PROMPT)
        drain(llm)
        answer(llm, EVICTOR)  # the CPU tier gives PROMPT's chunks up; the disk keeps them
        drain(llm)
        drain(llm)
        manager = manager_of(llm)
        files = chunk_files(tmp_path)
        assert len(files) >= 4
        spoil(files)
        held = len(manager.disk)
        llm.reset_prefix_cache()
        # with a request beside it, so the failed loads' reports and the next lookups interleave
        got, _ = answers(llm, [PROMPT, EVICTOR])
        same(got, reference)
        llm.reset_prefix_cache()
        same(answer(llm, PROMPT), reference)  # recomputed again or loaded: never the bad bytes
        drain(llm)
        assert len(manager.disk) < held, "the bad chunks stayed in the disk tier"
        reported = reports().reduce()
        assert reported["raykv:bad_chunks:('disk',)"] >= held - len(manager.disk)
        # the CPU copies a failed promotion was writing are failed stores, not bad chunks
        assert "raykv:bad_chunks:('cpu',)" not in reported


@pytest.mark.parametrize("verify", [False, True], ids=["unverified", "verified"])
def test_a_cpu_page_changed_in_memory_is_recomputed_where_loads_are_verified(
    vllm_model, reference, verify
) -> None:
    # one engine per test: an engine still referenced when the next starts tears the next's
    # process groups down when it is collected
    with engine(vllm_model, {"cpu_bytes": "16MiB", "verify": verify}) as llm:
        answer(llm, PROMPT)
        drain(llm)
        pool = worker_of(llm).copies.pool
        pool.view(-1)[::97] += 1.0  # every stored page changed
        llm.reset_prefix_cache()
        got = answer(llm, PROMPT)
        if verify:
            same(got, reference)
            assert len(manager_of(llm).cpu) == 0, "the changed chunks stayed in the tier"
        else:  # the load was used: without the check, the change shows in the answer
            assert got[1] != reference[1]
