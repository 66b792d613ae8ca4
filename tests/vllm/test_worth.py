"""``take_hits: faster`` inside vLLM: the manager loads a hit only where that is sooner than
computing the same tokens, priced by raykv's cost model from what vLLM shows the manager (a
request's lookup to the offer of its computed chunks; a load's prepare to its completion)."""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from raykv.offload.directory import Directory
from raykv.vllm.failures import BadKeys
from raykv.vllm.keys import raykv_key
from raykv.vllm.manager import RaykvOffloadingManager
from raykv.vllm.worth import LoadChoice
from tests.vllm.conftest import answers, drain, engine, manager_of, prompt_text
from tests.vllm.test_tiers import same

CHUNK = 128  # tokens per chunk (one block)
CHUNKS = 8


def a_manager(tmp_path) -> tuple[RaykvOffloadingManager, list]:
    """A manager whose CPU tier holds the eight chunks of one prompt, with the choice."""
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(CHUNKS)]
    cpu = Directory(16)
    plan = cpu.prepare_store([raykv_key(k) for k in keys])
    assert plan is not None
    cpu.complete_store(plan.keys)
    choice = LoadChoice(chunk_tokens=CHUNK, blocks_per_chunk=1)
    manager = RaykvOffloadingManager(cpu, None, BadKeys(str(tmp_path), 1), False, choice=choice)
    return manager, keys


def looked_up(manager: RaykvOffloadingManager, keys: list, request: str) -> int:
    """Chunks vLLM's maximal-prefix lookup would load for a request of these keys."""
    context = ReqContext(req_id=request)
    for i, key in enumerate(keys):
        context.set_offload_key_position(key, (i + 1) * CHUNK)
    hits = 0
    for key in keys:
        if manager.lookup(key, context) != LookupResult.HIT:
            break
        hits += 1
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    return hits


def measured(choice: LoadChoice, prefill_s_per_token: float, load_s_per_block: float) -> None:
    """What vLLM would have shown the manager of the model's and the CPU tier's speeds."""
    for tokens in (256, 512, 768, 1024):
        choice.costs.prefill.add(tokens, tokens * (tokens - 1) / 2, prefill_s_per_token * tokens)
        choice.costs.observe_load(tokens // CHUNK, 0.001 + load_s_per_block * tokens // CHUNK)
        choice.costs.observe_duration(0.01)


@pytest.mark.parametrize(
    ("prefill_s_per_token", "load_s_per_block", "loaded"),
    [(1e-3, 1e-4, CHUNKS), (1e-7, 0.05, 0), (None, None, CHUNKS)],
    ids=["dear-model-loads", "cheap-model-recomputes", "unmeasured-loads"],
)
def test_a_hit_is_loaded_only_where_that_is_sooner(
    tmp_path, prefill_s_per_token, load_s_per_block, loaded
) -> None:
    manager, keys = a_manager(tmp_path)
    assert manager.choice is not None
    if prefill_s_per_token is not None:
        measured(manager.choice, prefill_s_per_token, load_s_per_block)
    assert looked_up(manager, keys, "r1") == loaded
    if loaded == 0:  # counted, and on vLLM's metrics
        assert manager.choice.skipped["cpu"] == 1
        assert manager.get_stats().reduce()["raykv:skipped_slower:('cpu',)"] == 1


def test_a_long_prefix_is_loaded_where_a_short_one_is_not(tmp_path) -> None:
    """A load's fixed cost pays off over enough chunks: the whole prefix is looked at first."""
    manager, keys = a_manager(tmp_path)
    assert manager.choice is not None
    costs = manager.choice.costs
    for tokens in (256, 512, 768, 1024):
        costs.prefill.add(tokens, 0.0, 1e-4 * tokens)  # 12.8 ms a chunk
        costs.observe_load(tokens // CHUNK, 0.05 + 1e-4 * tokens // CHUNK)  # 50 ms fixed
        costs.observe_duration(0.01)
    assert looked_up(manager, keys[:2], "short") == 0
    assert looked_up(manager, keys, "long") == CHUNKS


def test_a_step_s_prefill_is_timed_by_its_own_forward() -> None:
    """vLLM offers a step's chunks for storing after that step's schedule end; the next schedule
    end comes after its forward: the offer is timed by that forward, not by a later step's."""
    import time

    choice = LoadChoice(chunk_tokens=CHUNK, blocks_per_chunk=1)
    choice.schedule_ended()  # the engine's first forward: its lazy start is not kept
    choice.stored("cold", 4 * CHUNK, chunks=4)
    time.sleep(0.2)
    choice.schedule_ended()  # step 1 scheduled: a request's two chunks computed in it
    choice.stored("r", 2 * CHUNK, chunks=2)
    time.sleep(0.05)  # its forward
    choice.schedule_ended()  # step 2 (a decode: nothing offered)
    time.sleep(0.005)
    choice.schedule_ended()
    ((tokens, _, seconds),) = choice.costs.prefill.points
    assert tokens == 2 * CHUNK and seconds >= 0.05


REPEATED = [prompt_text(30 + i) for i in range(3)]
FRESH = [prompt_text(40 + i) for i in range(6)]


@pytest.fixture(scope="module")
def reference(vllm_model) -> dict[str, tuple[list[int], list[float]]]:
    with engine(vllm_model, None) as llm:
        prompts = REPEATED + FRESH
        return {p: got[:2] for p, got in zip(prompts, answers(llm, prompts), strict=True)}


def test_inside_vllm_the_choice_measures_and_answers_as_vllm_does(vllm_model, reference) -> None:
    with engine(vllm_model, {"cpu_bytes": "16MiB", "take_hits": "faster"}) as llm:
        choice = manager_of(llm).choice
        assert choice is not None
        for fresh in FRESH:  # the repeated prompts hit; the fresh one measures the recompute
            batch = [*REPEATED, fresh]
            for prompt, got in zip(batch, answers(llm, batch), strict=True):
                same(got, reference[prompt])
            drain(llm)
            llm.reset_prefix_cache()
        costs = choice.costs
        # vLLM showed it the recompute (the chunks each step filled) and the steps, and each
        # hit was loaded (and measured) or passed over as slower
        assert len(costs.prefill) >= 4 and costs.durations
        assert len(costs.cpu) + choice.skipped["cpu"] > 0


def test_while_the_recompute_is_not_priced_every_other_hit_is_recomputed(tmp_path) -> None:
    """Traffic where every request hits offers no chunk for storing: the prefill is never
    timed, and a tier slower than recomputing was loaded for ever. Every other hit is
    computed until the prefill is priced."""
    manager, keys = a_manager(tmp_path)
    assert manager.choice is not None
    loaded = [looked_up(manager, keys, f"r{i}") for i in range(4)]
    assert loaded == [CHUNKS, 0, CHUNKS, 0]
    assert manager.choice.recompute_probes == 2
    measured(manager.choice, 1e-3, 1e-4)  # priced now: a dear model's hits are all loaded
    assert [looked_up(manager, keys, f"s{i}") for i in range(3)] == [CHUNKS] * 3


SLOW = [prompt_text(60 + i) for i in range(8)]


def vllm_alone(model) -> dict[str, tuple[list[int], list[float]]]:
    with engine(model, None) as llm:
        return {p: answers(llm, [p])[0][:2] for p in SLOW}


def warm_disk(model, path: str) -> None:
    with engine(model, {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": path}}) as llm:
        answers(llm, SLOW)
        drain(llm)


def restarted(model, path: str) -> tuple[list, dict[str, int], int]:
    """A fresh engine on the disk path, its disk 300 ms a load, asked each prompt in turn: the
    answers, the hits passed over, the recomputes that priced the prefill."""
    settings = {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": path}}
    slow = {"raykv_faults": ["slow-disk:ms=300"]}
    with engine(model, {**settings, "take_hits": "faster"}, connector=slow) as llm:
        got = [answers(llm, [prompt])[0] for prompt in SLOW]  # one at a time, as they come
        choice = manager_of(llm).choice
        assert choice is not None
        return got, choice.skipped, choice.recompute_probes


def test_a_warm_restart_from_a_slow_disk_passes_the_disk_over_within_a_few_requests(
    vllm_model, tmp_path
) -> None:
    """Found by an audit: a warm restart whose every request hit a disk that took 800 ms a load
    loaded them all (10.8x vLLM's time to first token; ``skipped_slower`` stayed 0)."""
    want = vllm_alone(vllm_model)
    warm_disk(vllm_model, str(tmp_path))
    got, skipped, probes = restarted(vllm_model, str(tmp_path))
    for prompt, answer in zip(SLOW, got, strict=True):
        same(answer, want[prompt])
    assert skipped["disk"] > 0 and probes > 0
    assert [cached for _, _, cached in got[-3:]] == [0, 0, 0]  # recomputed: sooner
