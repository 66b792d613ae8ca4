"""The engine's KV events, GPU prefix cache and CPU tier in one stream: a mirror built from the
events alone must equal what the engine holds after every step, with gapless sequence numbers.
This is what the KV-aware router relies on."""

from __future__ import annotations

import pytest

from raykv.config import load_config
from raykv.core.block_pool import BlockPool
from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, EventLog
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver
from raykv.workload.requests import make_workload

SMALL = [
    "workload.num_requests=40",
    "cache.num_gpu_blocks=48",  # small enough that cached GPU blocks get handed out again
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=8",
]


def apply(mirror: dict[str, set[int]], events: list, expected_seq: int) -> int:
    for event in events:
        assert event.seq == expected_seq, "a gap in the sequence numbers"
        expected_seq += 1
        held = mirror.setdefault(event.medium, set())
        if isinstance(event, BlockStored):
            assert not held & set(event.keys), f"{event}: announced twice"
            held |= set(event.keys)
        else:
            assert set(event.keys) <= held, f"{event}: removes keys never announced"
            held -= set(event.keys)
    return expected_seq


@pytest.mark.parametrize("offload", [True, False])
def test_a_mirror_of_the_events_equals_the_engine_after_every_step(offload: bool) -> None:
    cfg = load_config(None, SMALL)
    kinds: set[tuple[type, str]] = set()
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers, offload=offload)
        driver = Driver(engine)
        driver.submit(make_workload(cfg))
        mirror: dict[str, set[int]] = {}
        seq = 0
        while driver.has_work():
            driver.step()
            events = engine.events.take()
            kinds |= {(type(e), e.medium) for e in events}
            seq = apply(mirror, events, seq)
            next_seq, held = engine.kv_state()
            assert next_seq == seq
            for medium, keys in held.items():
                assert mirror.get(medium, set()) == set(keys), medium
        engine.reset_prefix_cache()
        seq = apply(mirror, engine.events.take(), seq)
        assert mirror[MEDIUM_GPU] == set()
    # the run exercised both kinds on the GPU (blocks reused after being cached), and the CPU
    # tier's events only with offloading
    assert {(BlockStored, MEDIUM_GPU), (BlockRemoved, MEDIUM_GPU)} <= kinds
    assert ((BlockStored, MEDIUM_CPU) in kinds) == offload


def test_the_pool_announces_a_key_once_and_its_removal_when_the_block_is_handed_out() -> None:
    log = EventLog()
    pool = BlockPool(4, log)
    a, b = pool.allocate(2)
    pool.cache(a, 11)
    pool.cache(b, 11)  # the key is cached by a already: b is not published, no event
    pool.cache(b, 12)
    pool.free([a, b])
    assert pool.allocate(3)[:2] == [3, a]  # the never-cached block first, then a (and b)
    events = log.take()
    assert [(type(e), e.keys, e.medium) for e in events] == [
        (BlockStored, (11, 12), MEDIUM_GPU),  # one event for consecutive publications
        (BlockRemoved, (11, 12), MEDIUM_GPU),
    ]
    assert [e.seq for e in events] == [0, 1]


def test_events_of_different_media_or_kinds_stay_apart_in_order() -> None:
    log = EventLog()
    log.stored([1], MEDIUM_GPU)
    log.stored([2], MEDIUM_CPU)
    log.removed([1], MEDIUM_GPU)
    log.stored([3], MEDIUM_GPU)
    events = log.take()
    assert [(type(e).__name__, e.keys, e.medium, e.seq) for e in events] == [
        ("BlockStored", (1,), "GPU", 0),
        ("BlockStored", (2,), "CPU", 1),
        ("BlockRemoved", (1,), "GPU", 2),
        ("BlockStored", (3,), "GPU", 3),
    ]
