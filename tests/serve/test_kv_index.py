"""The KV-aware router's view of a replica: a mirror fed by the engine's events (through the
feed's ring, as a router reads it) must predict exactly the prompt tokens the engine then takes
from its GPU prefix cache and from its CPU tier. No Ray: a local engine, stepped by hand."""

from __future__ import annotations

import random

import pytest

from raykv.config import load_config
from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver
from raykv.serve.kv_index import (
    EventRing,
    KVLayout,
    PromptKeys,
    ReplicaKV,
    SharedView,
    Snapshot,
    prompt_hit,
    to_wire,
)
from raykv.workload.requests import RequestSpec


def prompts(rng: random.Random) -> list[list[int]]:
    """Conversations that grow turn by turn, interleaved, so early turns fall out of a small
    GPU pool while the CPU tier still holds them; and prompts of no shared prefix between."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 900) for _ in range(n)]

    conversations = [tokens(70 + 9 * i) for i in range(4)]
    out = []
    for _turn in range(4):
        for c, history in enumerate(conversations):
            history += tokens(rng.randrange(5, 40))
            out.append(list(history))
            if c % 2:
                out.append(tokens(rng.randrange(20, 90)))
    return out


def replay(sets: list[str], blocks_per_chunk: int) -> dict[str, int]:
    """The prompts one at a time through a local engine of ``sets``, a mirror following its
    events through a tiny ring: before each prompt, the mirror must equal the engine's own
    state, and its hit must be exactly what the engine then takes from each medium. How many
    prompts hit each medium (and both tiers at once), and the snapshots the reader took."""
    cfg = load_config(
        None,
        [
            "cache.num_gpu_blocks=40",  # a few prompts' worth: older ones leave the GPU
            f"offload.blocks_per_chunk={blocks_per_chunk}",
            *sets,
        ],
    )
    layout = KVLayout(cfg.cache.block_size, blocks_per_chunk)
    ring = EventRing(capacity=2)  # tiny: a reader that falls behind gets a snapshot
    reader = ReplicaKV()
    seen = {"gpu": 0, "cpu": 0, "disk": 0, "shared": 0, "cpu_and_disk": 0, "snapshots": 0}
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers, offload=True)
        driver = Driver(engine)
        for i, prompt in enumerate(prompts(random.Random(3))):
            assert ring.push(to_wire(engine.events.take()))
            what = ring.since(reader.next_seq if reader.synced else -1)
            if isinstance(what, Snapshot):
                seen["snapshots"] += 1
                reader.load(what)
            else:
                assert reader.apply(what)
            mirror = ring.mirror
            assert (reader.gpu, reader.cpu, reader.disk) == (mirror.gpu, mirror.cpu, mirror.disk)
            _, held = engine.kv_state()
            assert reader.gpu == set(held["GPU"]) and reader.cpu == set(held["CPU"])
            assert reader.disk == set(held.get("DISK", ()))
            assert reader.shared == set(held.get("SHARED", ()))
            keys = PromptKeys.of(prompt, layout)
            predicted = prompt_hit(keys, reader, layout, shared=SharedView([reader]))
            driver.submit([RequestSpec(f"r{i}", tuple(prompt), 4, 0)])
            while driver.has_work():  # alone to the end, every store landed
                driver.step()
            (req,) = driver.take_finished()
            taken = (
                req.num_gpu_hit_tokens,
                req.num_cpu_hit_tokens,
                req.num_disk_hit_tokens,
                req.num_shared_hit_tokens,
            )
            assert taken == (
                predicted.gpu_tokens,
                predicted.cpu_tokens,
                predicted.disk_tokens,
                predicted.shared_tokens,
            ), f"prompt {i} of {len(prompt)} tokens"
            assert predicted.computed_tokens == len(prompt) - sum(taken)
            seen["gpu"] += predicted.gpu_tokens > 0
            seen["cpu"] += predicted.cpu_tokens > 0
            seen["disk"] += predicted.disk_tokens > 0
            seen["shared"] += predicted.shared_tokens > 0
            seen["cpu_and_disk"] += predicted.cpu_tokens > 0 and predicted.disk_tokens > 0
    return seen


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_mirror_predicts_the_engines_hits_on_gpu_and_cpu(blocks_per_chunk: int) -> None:
    seen = replay(["offload.cpu_bytes=4000000"], blocks_per_chunk)
    # the run had hits of both kinds, and a reader behind the ring resynced from a snapshot
    assert seen["gpu"] and seen["cpu"] and seen["snapshots"] > 1
    assert not seen["disk"]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_mirror_predicts_the_engines_hits_on_gpu_cpu_and_disk(
    blocks_per_chunk: int, disk_dir: str
) -> None:
    """With a CPU tier too small for the conversations, a disk tier under it: the engine's
    DISK events and snapshots keep the mirror's third set, and a prompt's chunks only the disk
    holds are predicted as promoted from disk, those the CPU tier holds as loaded from it."""
    sets = [
        f"offload.cpu_slots={64 // blocks_per_chunk}",
        "offload.take_hits=always",  # every hit loaded: the hit rule is tested, not the choice
        "offload.disk.enabled=true",
        f"offload.disk.path={disk_dir}",
        "offload.disk.capacity=64MiB",
    ]
    seen = replay(sets, blocks_per_chunk)
    assert seen["gpu"] and seen["cpu"] and seen["disk"] and seen["snapshots"] > 1
    assert seen["cpu_and_disk"]  # prompts whose prefix went through both tiers


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_mirror_predicts_the_engines_hits_from_the_shared_tier(
    blocks_per_chunk: int, shared_store: str
) -> None:
    """With a CPU tier too small for the conversations and the shared tier under it (no disk):
    what the CPU tier evicted is read back from the store, and the mirror's SHARED set, taken
    as the cluster's, predicts those tokens exactly."""
    sets = [
        f"offload.cpu_slots={24 // blocks_per_chunk}",
        "offload.take_hits=always",
        "offload.shared.enabled=true",
        f"offload.shared.master={shared_store}",
        "offload.shared.mount=false",  # the session's segment: it outlives the engines
        "offload.shared.segment=64MiB",
        f"model.head_dim={8 * blocks_per_chunk + 8}",  # a namespace no other test published to
    ]
    seen = replay(sets, blocks_per_chunk)
    assert seen["cpu"] and seen["shared"] and not seen["disk"]


def test_a_gap_unsyncs_the_mirror_until_a_snapshot() -> None:
    kv = ReplicaKV()
    assert not kv.apply([(0, True, "GPU", (1,))])  # never synced: refuses
    kv.load(Snapshot(5, {"GPU": [1, 2], "CPU": [3]}))
    assert kv.apply([(5, True, "CPU", (4,)), (6, False, "GPU", (1,))])
    assert (kv.gpu, kv.cpu, kv.next_seq) == ({2}, {3, 4}, 7)
    assert not kv.apply([(8, True, "GPU", (9,))])  # 7 is missing
    assert not kv.synced and 9 not in kv.gpu
    assert not kv.apply([(7, True, "GPU", (9,))])  # stays refused until a snapshot
    kv.load(Snapshot(9, {"GPU": [9]}))
    assert kv.synced and kv.gpu == {9} and kv.cpu == set()


def test_the_ring_gives_each_reader_what_it_missed() -> None:
    ring = EventRing(capacity=3)
    ring.reset(Snapshot(10, {"GPU": [1]}))
    assert ring.push([(10, True, "GPU", (2,)), (11, True, "CPU", (7,))])
    assert not ring.push([(13, True, "GPU", (3,))])  # a writer's gap: it must reset
    assert isinstance(ring.since(10), Snapshot) and ring.since(10).next_seq == -1
    ring.reset(Snapshot(12, {"GPU": [1, 2], "CPU": [7]}))
    assert ring.push([(12, False, "GPU", (1,)), (13, True, "GPU", (4,))])
    assert ring.since(14) == []
    assert ring.since(13) == [(13, True, "GPU", (4,))]
    assert ring.since(12) == [(12, False, "GPU", (1,)), (13, True, "GPU", (4,))]
    whole = ring.since(3)  # before the ring: the whole state
    assert isinstance(whole, Snapshot) and whole.next_seq == 14
    assert set(whole.held["GPU"]) == {2, 4} and set(whole.held["CPU"]) == {7}
    assert isinstance(ring.since(99), Snapshot)  # a position the stream never had


def test_prompt_keys_stop_short_of_the_last_token_and_chain() -> None:
    layout = KVLayout(block_size=4, blocks_per_chunk=2)
    keys = PromptKeys.of(list(range(17)), layout)
    assert len(keys.gpu) == 4 and len(keys.cpu) == 2  # 16 usable positions of 17
    assert len(PromptKeys.of(list(range(16)), layout).gpu) == 3  # the 16th token is computed
    other = PromptKeys.of([99, *range(1, 17)], layout)
    assert not set(keys.gpu) & set(other.gpu)  # one token differs: every later key differs
    assert keys.cpu[1] == keys.gpu[3]  # a chunk's key is its last block's


def test_a_replicas_load_counts_what_its_gpu_cache_does_not_hold() -> None:
    cfg = load_config(None, ["cache.num_gpu_blocks=40"])
    bs = cfg.cache.block_size
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers, offload=False)
        driver = Driver(engine)
        prompt = list(range(1, 4 * bs + 1))  # four full blocks
        driver.submit([RequestSpec("first", tuple(prompt), 2, 0)])
        assert driver.load() == (len(prompt), 0)  # submitted, not yet in the engine: in full
        while driver.has_work():
            driver.step()
        follow = [*prompt, *range(500, 510)]
        engine.add_request(Request("follow", 1, follow, 2))  # waiting: its first 4 blocks cached
        assert driver.load() == (len(follow) - 4 * bs, 0)


def test_disk_and_shared_events_and_snapshots_go_to_their_sets() -> None:
    kv = ReplicaKV()
    kv.load(Snapshot(3, {"GPU": [1], "CPU": [2], "DISK": [3, 4]}))
    assert (kv.gpu, kv.cpu, kv.disk) == ({1}, {2}, {3, 4})
    # a chunk demoted (out of the CPU tier, onto disk), one evicted from disk, one promoted
    # (read back into the CPU tier, kept on disk too)
    assert kv.apply(
        [
            (3, False, "CPU", (2,)),
            (4, True, "DISK", (2,)),
            (5, False, "DISK", (3,)),
            (6, True, "CPU", (4,)),
        ]
    )
    assert (kv.gpu, kv.cpu, kv.disk) == ({1}, {4}, {2, 4})
    assert kv.apply([(7, True, "REMOTE", (9,))])  # a medium it does not keep: counted nowhere
    assert 9 not in kv.gpu | kv.cpu | kv.disk | kv.shared and kv.next_seq == 8
    assert kv.apply([(8, True, "SHARED", (9,))]) and kv.shared == {9}
    # what a feed's ring hands a reader that fell behind carries the disk and shared sets
    ring = EventRing(capacity=1)
    ring.reset(kv.snapshot())
    assert ring.push([(9, True, "DISK", (5,)), (10, True, "GPU", (6,))])
    whole = ring.since(9)
    assert isinstance(whole, Snapshot) and whole.next_seq == 11
    assert set(whole.held["DISK"]) == {2, 4, 5} and set(whole.held["CPU"]) == {4}
    reader = ReplicaKV()
    reader.load(whole)
    assert (reader.gpu, reader.cpu, reader.disk) == ({1, 6}, {4}, {2, 4, 5})
    assert reader.shared == {9}


def held_by_chunk(keys: PromptKeys, media: str) -> Snapshot:
    """A replica whose chunk ``c`` of the prompt is where ``media[c]`` says: ``g`` its blocks on
    the GPU, ``c`` the CPU tier, ``d`` the disk, ``b`` both tiers, ``-`` nowhere."""
    held: dict[str, list[int]] = {"GPU": [], "CPU": [], "DISK": []}
    bpc = len(keys.gpu) // len(keys.cpu)
    for c, medium in enumerate(media):
        chunk = list(keys.cpu[c])
        if medium == "g":
            held["GPU"] += [k for block in keys.gpu[c * bpc : (c + 1) * bpc] for k in block]
        held["CPU"] += chunk if medium in "cb" else []
        held["DISK"] += chunk if medium in "db" else []
    return Snapshot(0, held)


@pytest.mark.parametrize(
    ("media", "gpu", "cpu", "disk"),
    [
        ("cccc", 0, 32, 0),
        ("dddd", 0, 0, 32),
        ("gdcd", 8, 8, 16),  # on through any medium, each chunk counted for its own
        ("gbdb", 8, 16, 8),  # a chunk on both tiers is loaded from the CPU tier
        ("cd-c", 0, 8, 8),  # a chunk held nowhere ends the hit
        ("-ccc", 0, 0, 0),
    ],
)
def test_a_hit_counts_each_chunk_for_the_fastest_medium_that_holds_it(
    media: str, gpu: int, cpu: int, disk: int
) -> None:
    layout = KVLayout(block_size=4, blocks_per_chunk=2)
    keys = PromptKeys.of(list(range(100, 133)), layout)  # 33 tokens: 4 chunks usable
    kv = ReplicaKV()
    kv.load(held_by_chunk(keys, media))
    hit = prompt_hit(keys, kv, layout)
    assert (hit.gpu_tokens, hit.cpu_tokens, hit.disk_tokens) == (gpu, cpu, disk)
    assert hit.computed_tokens == 33 - gpu - cpu - disk


def test_a_hit_past_a_gpu_prefix_mid_chunk_counts_only_that_chunks_rest() -> None:
    layout = KVLayout(block_size=4, blocks_per_chunk=2, groups=(0, 1))
    keys = PromptKeys.of(list(range(100, 133)), layout)
    kv = ReplicaKV()
    kv.load(held_by_chunk(keys, "-cdd"))
    # the GPU holds the first three blocks (12 tokens): chunk 1's last block comes from the CPU
    # tier; chunk 2 has one group's key in the CPU tier and the other's on disk only, so it
    # waits for a promotion like chunk 3
    kv.gpu.update(k for block in keys.gpu[:3] for k in block)
    kv.cpu.add(keys.cpu[2][0])
    hit = prompt_hit(keys, kv, layout)
    assert (hit.gpu_tokens, hit.cpu_tokens, hit.disk_tokens, hit.computed_tokens) == (
        12,
        4,
        16,
        1,
    )
