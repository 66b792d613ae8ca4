"""A hit below the CPU tier is loaded through a CPU slot: the manager offers no more of it than
the CPU tier can ever take, asks again later where the room is only busy now, and has the rest
computed once it waited long enough. No engine: the lookups are made as vLLM's maximal-prefix
scan makes them (RETRY: not a hit, the scan goes on, the request is asked again next step)."""

from __future__ import annotations

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from raykv.offload.directory import Directory
from raykv.vllm.failures import BadKeys
from raykv.vllm.keys import raykv_key
from raykv.vllm.manager import RaykvOffloadingManager
from raykv.vllm.worth import LoadChoice

CHUNK = 128  # tokens per chunk


def on_disk(tmp_path, cpu_slots: int, chunks: int) -> tuple[RaykvOffloadingManager, list]:
    """A manager whose disk tier holds one prompt's ``chunks`` and whose CPU tier is empty."""
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(chunks)]
    disk = Directory(16)
    plan = disk.prepare_store([raykv_key(k) for k in keys])
    assert plan is not None
    disk.complete_store(plan.keys)
    manager = RaykvOffloadingManager(Directory(cpu_slots), disk, BadKeys(str(tmp_path), 1), False)
    return manager, keys


def scan(manager: RaykvOffloadingManager, keys: list, request: str) -> int | None:
    """The chunks vLLM would load, or None where it asks again at a later step."""
    context = ReqContext(req_id=request)
    hits, deferred = 0, False
    for key in keys:
        result = manager.lookup(key, context)
        if result == LookupResult.MISS:
            break
        if result == LookupResult.RETRY:
            deferred = True
        else:
            hits += 1
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    return None if deferred else hits


def loaded(manager: RaykvOffloadingManager, keys: list, request: str) -> bool:
    """Whether the load of the hit ``scan`` found was taken (not refused)."""
    hits = scan(manager, keys, request)
    assert hits, "nothing to load"
    return loaded_as_scanned(manager, keys[:hits], request)


def loaded_as_scanned(manager: RaykvOffloadingManager, keys: list, request: str) -> bool:
    """Whether the load of ``keys`` was taken (not refused), without looking them up again."""
    return not manager.prepare_load(keys, ReqContext(req_id=request)).refused


def test_a_hit_is_no_larger_than_the_cpu_tier(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=5)
    assert scan(manager, keys, "a") == 2
    assert loaded(manager, keys, "a")
    assert not manager.room._waiting


def test_slots_held_for_minutes_are_no_room_to_wait_for(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=3)
    writing = busy(manager, 1)
    manager.cpu.complete_store(writing, success=False, hold_s=120.0)  # a late read's slot
    assert manager.cpu.num_held == 1
    assert scan(manager, keys, "a") == 1  # the one slot left, at once


class Clock:
    """A test's clock: the wait for room is timed by it, not by the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def busy(manager: RaykvOffloadingManager, slots: int, first: int = 200) -> list[int]:
    """``slots`` CPU slots being written (by chunks of no prompt here, from ``first`` on)."""
    others = [raykv_key(make_offload_key(bytes([first + i]) * 32, 0)) for i in range(slots)]
    plan = manager.cpu.prepare_store(others, admit_all=True)
    assert plan is not None and len(plan.keys) == slots
    return plan.keys


def test_a_hit_waits_for_room_that_loads_and_stores_free(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=3)
    manager.room.clock = clock = Clock()
    writing = busy(manager, 2)
    assert scan(manager, keys, "a") is None  # asked again: the room comes back
    clock.now = 1.9
    assert scan(manager, keys, "a") is None
    manager.cpu.complete_store(writing)  # the slots are ready, and may be evicted
    assert scan(manager, keys, "a") == 2
    assert loaded(manager, keys, "a")


def test_a_hit_waits_for_room_no_longer_than_its_bound(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=3)
    manager.room.clock = clock = Clock()
    writing = busy(manager, 2)
    assert scan(manager, keys, "a") is None
    clock.now = 2.1
    assert scan(manager, keys, "a") == 0  # waited long enough: the prompt is computed
    clock.now = 500.0  # preempted much later, say: its wait is timed afresh
    assert scan(manager, keys, "a") is None
    # a later wait (the request was looked up without one in between) is timed afresh
    manager.cpu.complete_store(writing)
    assert scan(manager, keys, "a") == 2
    busy(manager, 2, first=210)
    clock.now = 503.0
    assert scan(manager, keys, "a") is None
    manager.on_request_finished(ReqContext(req_id="a"))
    assert not manager.room._waiting, "a finished request is still remembered"


def test_a_request_refused_a_load_is_offered_only_cpu_hits(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=3)
    assert scan(manager, keys, "a") == 2
    busy(manager, 2)  # the room went between the lookup and the load
    assert not loaded_as_scanned(manager, keys[:2], "a")
    manager.room.clock = clock = Clock()
    clock.now = 100.0  # however long it waited: no second offer of the same hit
    assert scan(manager, keys, "a") == 0


def test_a_cpu_hit_kept_leaves_room_for_the_promotions_before_it(tmp_path) -> None:
    # the first chunk on disk, the second in the CPU tier's one slot: keeping the second for
    # the load leaves no slot to promote the first into, so the hit is the first alone
    manager, keys = on_disk(tmp_path, cpu_slots=1, chunks=2)
    plan = manager.cpu.prepare_store([raykv_key(keys[1])])
    assert plan is not None
    manager.cpu.complete_store(plan.keys)
    assert scan(manager, keys, "a") == 1
    assert loaded(manager, keys, "a")


def in_cpu(manager: RaykvOffloadingManager, key) -> None:
    """``key``'s chunk stored in the CPU tier."""
    plan = manager.cpu.prepare_store([raykv_key(key)], admit_all=True)
    assert plan is not None and plan.keys
    manager.cpu.complete_store(plan.keys)


def test_a_cpu_hit_kept_is_room_the_promotions_lose_unless_another_load_pins_it(
    tmp_path,
) -> None:
    # first chunk on disk, second in the CPU tier, the other slot being written: keeping the
    # second leaves the promotion no slot until the write lands
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=2)
    in_cpu(manager, keys[1])
    writing = busy(manager, 1)
    assert scan(manager, keys, "a") is None
    manager.cpu.complete_store(writing)
    # the second being read by another request's load is room nobody had: the free slot is
    # the promotion's
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=2)
    in_cpu(manager, keys[1])
    manager.cpu.prepare_load([raykv_key(keys[1])])
    assert scan(manager, keys, "a") == 2
    assert loaded(manager, keys, "a")
    # the CPU hit first, the chunk on disk after it: the same (as vLLM's LRU evicts a prompt's
    # tail first)
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=2)
    in_cpu(manager, keys[0])
    busy(manager, 1)
    assert scan(manager, keys, "a") is None


def test_the_choice_prices_the_recompute_from_where_the_room_cut_the_hit(tmp_path) -> None:
    # the choice priced loading all five chunks; the CPU tier's two slots took two: the
    # steps' prefill is timed from there (else the tokens computed are undercounted)
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=5)
    manager.choice = choice = LoadChoice(chunk_tokens=CHUNK, blocks_per_chunk=1)
    context = ReqContext(req_id="a")
    for i, key in enumerate(keys):
        context.set_offload_key_position(key, (i + 1) * CHUNK)
    results = [manager.lookup(key, context) for key in keys[:3]]
    assert results == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    assert choice._computed["a"] == 2 * CHUNK
    manager.prepare_load(keys[:1], context)  # vLLM took less still: its load ends there
    assert choice._computed["a"] == CHUNK
