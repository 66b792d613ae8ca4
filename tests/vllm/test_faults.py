"""raykv's faults inside vLLM, through the same specs as ``raykv run`` (``raykv_faults``): a
failed copy, a CPU page that goes bad, a disk that fails or spoils what it holds, an embedded
master killed mid-run. Every answer is vLLM's own; each fault is seen to strike."""

from __future__ import annotations

import pytest

from raykv.vllm import shared
from tests.vllm.conftest import answer, answers, drain, engine, manager_of, prompt_text, worker_of
from tests.vllm.test_tiers import same

PROMPT, EVICTOR = prompt_text(11), prompt_text(12)


@pytest.fixture(scope="module")
def reference(vllm_model) -> tuple[list[int], list[float]]:
    with engine(vllm_model, None) as llm:
        return answer(llm, PROMPT)[:2]


def faulty(*faults: str) -> dict:
    """The connector config's part that asks for ``faults``."""
    return {"raykv_faults": list(faults)}


@pytest.mark.parametrize(
    "fault", ["fail-copy:rate=0.5:seed=4", "corrupt-cpu:rate=1"], ids=["fail-copy", "corrupt-cpu"]
)
def test_a_failed_copy_or_a_page_gone_bad_is_recomputed(vllm_model, reference, fault) -> None:
    with engine(vllm_model, {"cpu_bytes": "16MiB", "verify": True}, connector=faulty(fault)) as llm:
        for _ in range(4):  # stores and loads, each drawn against the fault
            same(answer(llm, PROMPT), reference)
            drain(llm)
            llm.reset_prefix_cache()  # the next answer reads raykv's tier, not vLLM's cache
        records = list(worker_of(llm).records)
        assert any(not r.ok for r in records), "no job failed"
        if fault.startswith("corrupt-cpu"):  # every chunk spoiled once stored: none is kept
            assert not any(r.ok and not r.is_store for r in records), "a spoiled load counted"
            assert len(manager_of(llm).cpu) == 0


@pytest.mark.parametrize("fault", ["fail-disk:rate=1", "corrupt-disk:rate=1"])
def test_a_disk_that_fails_or_spoils_its_files_is_recomputed(
    vllm_model, reference, tmp_path, fault
) -> None:
    settings = {"cpu_slots": 2, "disk": {"enabled": True, "path": str(tmp_path)}}
    with engine(vllm_model, settings, connector=faulty(fault)) as llm:
        same(answer(llm, PROMPT), reference)
        drain(llm)
        answer(llm, EVICTOR)  # the CPU tier gives PROMPT's chunks up to the disk alone
        drain(llm)
        llm.reset_prefix_cache()
        got, _ = answers(llm, [PROMPT, EVICTOR])
        same(got, reference)
        drain(llm)
        same(answer(llm, PROMPT), reference)
        disk = manager_of(llm).disk.stats()
        if fault.startswith("fail-disk"):  # no file written: nothing in the tier
            assert disk.store_failures > 0 and disk.used == 0
        else:  # written, then found spoiled by the promotion: gone from the tier
            assert disk.keys_stored > 0
            assert any(not r.ok and r.promoted for r in worker_of(llm).records)


def test_a_killed_embedded_master_pauses_the_shared_tier(vllm_model, reference) -> None:
    settings = {
        "cpu_slots": 2,
        "shared": {"enabled": True, "master": "embedded", "segment": "64MiB"},
    }
    with engine(vllm_model, settings, connector=faulty("kill-shared-master:step=4")) as llm:
        manager = manager_of(llm)
        for prompt in (PROMPT, EVICTOR, PROMPT):
            llm.reset_prefix_cache()
            got = answer(llm, prompt)
            if prompt == PROMPT:
                same(got, reference)
        assert manager._step > 4
        assert not manager._shared_usable(), "the shared tier did not pause"
        assert manager.shared.stats().hits == 0  # nothing was loaded from a dead store
        # up again before the engine stops (Mooncake's clients retry their goodbyes to a dead
        # master for 15 s each, with the interpreter's lock held)
        (master,) = shared._masters.values()
        master.restart()
