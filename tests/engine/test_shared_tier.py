"""The shared tier end to end in one process per engine: two engines with CPU tiers of their own
and one real Mooncake Store between them (a master on loopback, real segments). What one engine
computed, the other loads from the store; the synthetic model checks every byte it loaded, and
the outputs are those of the run without any tier."""

from __future__ import annotations

import pytest

from raykv.config import load_config
from raykv.engine.core import EngineCore
from tests.engine.test_disk_tier import run  # a workload to its drained books, every byte checked

SMALL = [
    "workload.num_requests=24",
    "workload.seed=5",
    "cache.num_gpu_blocks=48",
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=6",
    "workload.concurrent_conversations=6",
    "parallel.tensor_parallel_size=2",
    "model.head_dim=8",
    "offload.cpu_slots=64",
    "offload.take_hits=always",  # every hit loaded: the protocol, not the choice, is tested
]


def shared(address: str) -> list[str]:
    return [
        "offload.shared.enabled=true",
        f"offload.shared.master={address}",
        "offload.shared.segment=64MiB",
    ]


@pytest.fixture(scope="module")
def baseline() -> dict:
    """The run without any tier."""
    report, _ = run(SMALL, offload=False)
    return report


def test_what_one_engine_computed_another_loads_from_the_store(
    shared_store: str, baseline: dict
) -> None:
    first, books = run([*SMALL, *shared(shared_store)])
    assert first["output_digest"] == baseline["output_digest"]
    assert first["tiers"]["shared"]["published_chunks"] > 0
    assert not any(books.values()), books
    second, books = run([*SMALL, *shared(shared_store)])
    assert second["output_digest"] == baseline["output_digest"]
    s = second["tiers"]["shared"]
    assert second["shared_hit_tokens"] > 0 and s["promoted_chunks"] > 0 and s["found_chunks"] > 0
    assert second["integrity"]["mismatches"] == 0 and second["integrity"]["blocks_verified"] > 0
    assert not any(books.values()), books
    # another KV layout (the namespace names it) finds none of the first one's chunks (what it
    # loads from the store, it published itself)
    other, _ = run([*SMALL, *shared(shared_store), "model.head_dim=16"])
    assert other["tiers"]["shared"]["asked_chunks"] > 0
    assert other["tiers"]["shared"]["found_chunks"] == 0


@pytest.mark.parametrize("engine_kind", ["ray"])
def test_the_ray_engine_refuses_the_shared_tier_by_name(engine_kind: str) -> None:
    del engine_kind  # the one-process engine only, so far: the Ray engine's workers offer no store
    from raykv.config import ConfigError

    cfg = load_config(
        None, [*SMALL, "offload.shared.enabled=true", "offload.shared.master=127.0.0.1:1"]
    )

    class NoStore:
        num_ranks = 2

    with pytest.raises(ConfigError, match=r"offload\.shared\.enabled"):
        EngineCore(cfg, NoStore())  # type: ignore[arg-type]


def test_the_master_killed_mid_run_ends_with_the_fault_free_outputs(baseline: dict) -> None:
    """An embedded master of the run's own, killed at step 10: publishes and promotions fail,
    the requests recompute, and the run finishes with the outputs of the run without tiers."""
    from raykv.transfer.shared_store import mooncake_problem

    if mooncake_problem():
        pytest.skip(f"the shared tier's store cannot start here: {mooncake_problem()}")
    sets = [
        *SMALL,
        "offload.shared.enabled=true",
        "offload.shared.segment=64MiB",
        "offload.shared.retry_steps=16",
        'faults=["kill-shared-master:step=10"]',
    ]
    report, books = run(sets)
    assert report["output_digest"] == baseline["output_digest"]
    s = report["tiers"]["shared"]
    assert s["published_chunks"] > 0  # before the kill
    assert s["publishes_failed"] + s["promotions_failed"] > 0 or s["unavailable_events"] > 0
    assert not any(books.values()), books
