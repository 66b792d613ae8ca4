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
    return not manager.prepare_load(keys[:hits], ReqContext(req_id=request)).refused


def test_a_hit_is_no_larger_than_the_cpu_tier(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=5)
    assert scan(manager, keys, "a") == 2
    assert loaded(manager, keys, "a")


def test_a_hit_waits_for_room_that_loads_and_stores_free(tmp_path) -> None:
    manager, keys = on_disk(tmp_path, cpu_slots=2, chunks=3)
    others = [raykv_key(make_offload_key(bytes([200 + i]) * 32, 0)) for i in range(2)]
    busy = manager.cpu.prepare_store(others)  # every CPU slot being written
    assert busy is not None and len(busy.keys) == 2
    assert scan(manager, keys, "a") is None  # asked again: the room comes back
    manager.room_wait_s = 0.0
    assert scan(manager, keys, "b") == 0  # waited long enough: the prompt is computed
    manager.cpu.complete_store(busy.keys)  # the slots are ready, and may be evicted
    assert scan(manager, keys, "a") == 2
    assert loaded(manager, keys, "a")


def test_a_cpu_hit_kept_leaves_room_for_the_promotions_before_it(tmp_path) -> None:
    # the first chunk on disk, the second in the CPU tier's one slot: keeping the second for
    # the load leaves no slot to promote the first into, so the hit is the first alone
    manager, keys = on_disk(tmp_path, cpu_slots=1, chunks=2)
    plan = manager.cpu.prepare_store([raykv_key(keys[1])])
    assert plan is not None
    manager.cpu.complete_store(plan.keys)
    assert scan(manager, keys, "a") == 1
    assert loaded(manager, keys, "a")
