"""The KV-aware router's price of a replica (``RouteWeights.cost``) for a prompt it holds on
each medium, from mirrors fed the way a feed feeds them: a snapshot, then events. No Ray
session: the cost and the mirror are plain Python."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from raykv.config import RouterWeightsConfig
from raykv.serve.kv_feed import Load
from raykv.serve.kv_index import (
    KVLayout,
    PromptKeys,
    ReplicaKV,
    SharedView,
    Snapshot,
    prompt_hit,
)
from raykv.serve.kv_router import RouteWeights

LAYOUT = KVLayout(block_size=4, blocks_per_chunk=2)
PROMPT = list(range(100, 133))  # 33 tokens: 4 chunks usable, the last token always computed


def weights(**other: float) -> RouteWeights:
    """The weights these tests price with (``other``: those that differ)."""
    given: dict = dict(
        cpu_hit_cost=0.02, disk_hit_cost=0.25, decode_cost=4.0, imbalance=2.0, imbalance_tokens=8
    )
    return RouteWeights(**{**given, **other})


WEIGHTS = weights()


def mirror(medium: str | None, by_events: bool) -> ReplicaKV:
    """A replica holding the prompt's four chunks on ``medium`` (None: nothing), learnt from
    its first snapshot or from the events after an empty one."""
    keys = PromptKeys.of(PROMPT, LAYOUT)
    chunks = [k for chunk in keys.cpu for k in chunk]
    kv = ReplicaKV()
    if by_events:
        kv.load(Snapshot(0, {}))
        assert kv.apply([(0, True, medium, tuple(chunks))] if medium else [])
    else:
        kv.load(Snapshot(0, {medium: chunks} if medium else {}))
    return kv


def price(kv: ReplicaKV, load: Load | None = None) -> float:
    hit = prompt_hit(PromptKeys.of(PROMPT, LAYOUT), kv, LAYOUT)
    return WEIGHTS.cost(hit, load or Load(), 0)


@pytest.mark.parametrize("by_events", [False, True])
def test_a_prefix_on_disk_is_priced_between_one_on_cpu_and_none_by_the_weights(
    by_events: bool,
) -> None:
    on_cpu = price(mirror("CPU", by_events))
    on_disk = price(mirror("DISK", by_events))
    nothing = price(mirror(None, by_events))
    assert on_cpu == pytest.approx(1 + 0.02 * 32)
    assert on_disk == pytest.approx(1 + 0.25 * 32)
    assert nothing == 33
    assert on_cpu < on_disk < nothing
    # with both tiers holding it, the CPU tier's copy is the one loaded
    both = mirror("DISK", by_events)
    both.cpu |= both.disk
    assert price(both) == pytest.approx(on_cpu)


def test_decoding_and_a_spilled_queue_add_to_a_disk_hit_as_to_any() -> None:
    spilling = weights(step_tokens=16)
    hit = prompt_hit(PromptKeys.of(PROMPT, LAYOUT), mirror("DISK", True), LAYOUT)
    # 1 computed + 2 decoding leave 13 of the step's 16 tokens: 20 queued spill 7
    cost = spilling.cost(hit, Load(prefill_tokens=20, decoding=2), 0)
    assert cost == pytest.approx(1 + 0.25 * 32 + 7 + 4.0 * 2)


def test_the_default_weights_rank_the_media_gpu_cpu_disk_compute() -> None:
    defaults = RouterWeightsConfig()
    assert 0 < defaults.cpu_hit_cost < defaults.disk_hit_cost < 1
    assert defaults.cpu_hit_cost < defaults.shared_hit_cost < 1
    default = RouteWeights(**defaults.model_dump())
    keys = PromptKeys.of(PROMPT, LAYOUT)
    on_gpu = ReplicaKV()
    on_gpu.load(Snapshot(0, {"GPU": [k for block in keys.gpu for k in block]}))
    costs = [
        default.cost(prompt_hit(keys, kv, LAYOUT), Load(), 0)
        for kv in (on_gpu, mirror("CPU", True), mirror("DISK", True), mirror(None, True))
    ]
    assert costs == sorted(costs) and len(set(costs)) == 4


def test_a_prefix_in_the_shared_tier_is_priced_alike_on_every_replica() -> None:
    """One replica published the prompt's chunks to the shared tier (its SHARED events): every
    replica can read them, so each is priced with ``shared_hit_cost``, not as computing them,
    and the publisher's own CPU-tier copy stays cheaper."""
    pricey = weights(shared_hit_cost=0.5)
    keys = PromptKeys.of(PROMPT, LAYOUT)
    publisher = mirror("CPU", True)
    assert publisher.apply([(1, True, "SHARED", tuple(publisher.cpu))])
    other = mirror(None, True)
    shared = SharedView([publisher, other])
    on_other = pricey.cost(prompt_hit(keys, other, LAYOUT, shared=shared), Load(), 0)
    on_publisher = pricey.cost(prompt_hit(keys, publisher, LAYOUT, shared=shared), Load(), 0)
    alone = pricey.cost(prompt_hit(keys, other, LAYOUT), Load(), 0)
    assert on_other == pytest.approx(1 + 0.5 * 32)
    assert on_publisher == pytest.approx(1 + 0.02 * 32)
    assert alone == 33  # without the view: nothing cached anywhere for it
    # one chunk missing from the store ends the hit there
    publisher.shared.discard(keys.cpu[1][0])
    partial = prompt_hit(keys, other, LAYOUT, shared=SharedView([publisher]))
    assert (partial.shared_tokens, partial.computed_tokens) == (8, 25)
