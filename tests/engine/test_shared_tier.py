"""The shared tier end to end in one process per engine: two engines with CPU tiers of their own
and one real Mooncake Store between them (a master on loopback, real segments). What one engine
computed, the other loads from the store; the synthetic model checks every byte it loaded, and
the outputs are those of the run without any tier."""

from __future__ import annotations

import os

import pytest

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
    """The session's store (its master and segment): an engine's run gives no segment of its
    own, whose objects would go with it."""
    return [
        "offload.shared.enabled=true",
        f"offload.shared.master={address}",
        "offload.shared.mount=false",
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


@pytest.mark.parametrize(
    "fault",
    [
        # an embedded master of the run's own: publishes and promotions fail, the tier pauses
        "kill-shared-master:step=10",
        # the run's own segment process (what a store actor is on Ray): what the pool held
        # there is gone, reads of it fail
        "kill-store-actor:step=12",
    ],
)
def test_the_store_killed_mid_run_ends_with_the_fault_free_outputs(
    baseline: dict, fault: str
) -> None:
    """The requests recompute what cannot be loaded, and the run finishes with the outputs of
    the run without tiers, its books drained."""
    from raykv.transfer.shared_store import mooncake_problem

    if mooncake_problem():
        pytest.skip(f"the shared tier's store cannot start here: {mooncake_problem()}")
    sets = [
        *SMALL,
        "offload.shared.enabled=true",
        "offload.shared.segment=64MiB",
        "offload.shared.retry_steps=16",
        f'faults=["{fault}"]',
    ]
    report, books = run(sets)
    assert report["output_digest"] == baseline["output_digest"]
    s = report["tiers"]["shared"]
    # the tier was in use before the kill (publishes started; whether one landed first
    # depends on how long the store's first transfers take: 1 run in 10 none had)
    assert s["publishes"] > 0
    assert s["publishes_failed"] + s["promotions_failed"] > 0 or s["unavailable_events"] > 0
    assert not any(books.values()), books


# each case in a namespace of its own (head_dim), so no other test's chunks answer for it;
# which of the two engines suffers it
STORE_FAULTS = [
    ("fail-shared:rate=0.3:seed=3", 12, "first"),
    ("corrupt-shared:rate=1.0:seed=4", 20, "first"),
    ("lose-shared:rate=1.0:rank=1:seed=5", 24, "first"),
    ("full-shared:after=3", 28, "first"),
    ("slow-shared:ms=20", 32, "both"),
]


@pytest.mark.parametrize(("fault", "head_dim", "who"), STORE_FAULTS)
def test_store_faults_end_with_the_fault_free_outputs(
    shared_store: str, baseline: dict, fault: str, head_dim: int, who: str
) -> None:
    """One engine publishes, a second one loads what it finds, under the fault: failed,
    spoiled and missing parts and a full pool end in recompute, never in other bytes, and both
    runs' outputs are those of the run without tiers (with this head_dim)."""
    dims = f"model.head_dim={head_dim}"
    faulty = f'faults=["{fault}"]'
    reference, _ = run([*SMALL, dims], offload=False)
    first, books = run([*SMALL, dims, *shared(shared_store), faulty])
    assert first["output_digest"] == reference["output_digest"]
    assert not any(books.values()), books
    second_sets = [*SMALL, dims, *shared(shared_store)] + ([faulty] if who == "both" else [])
    second, books = run(second_sets)
    assert second["output_digest"] == reference["output_digest"]
    assert second["integrity"]["mismatches"] == 0
    assert not any(books.values()), books
    f, s = first["tiers"]["shared"], second["tiers"]["shared"]
    kind = fault.split(":")[0]
    if kind == "fail-shared":
        assert f["publishes_failed"] > 0 and f["published_chunks"] > 0
    elif kind == "corrupt-shared":  # every part spoiled: found, read, caught, removed (what
        # the second engine promotes later is what it published itself, put back whole)
        assert s["found_chunks"] > 0 and s["gone"] > 0 and s["promotions_failed"] > 0
        assert second["tiers"]["shared"]["corrupt_parts"] > 0
    elif kind == "lose-shared":  # rank 1's part of every chunk gone: no chunk is whole
        assert f["published_chunks"] > 0
        assert s["asked_chunks"] > 0 and s["found_chunks"] == 0
    elif kind == "full-shared":
        assert f["full_events"] > 0 and f["publishes_failed"] > 0
    else:  # slow on both sides, and all of it landed
        assert f["published_chunks"] > 0 and s["promoted_chunks"] > 0


@pytest.mark.parametrize("disk", [False, True], ids=["alone", "under-disk"])
def test_write_back_publishes_as_chunks_leave_the_cpu_tier(
    shared_store: str, baseline: dict, disk: bool, tmp_path
) -> None:
    """``publish: back``: a CPU tier that never evicts publishes nothing; a small one publishes
    what leaves it (given up by its own reserve, or by the disk's demotions), and a second
    engine loads that from the store, every byte checked. Each case has a model of its own:
    the session's store outlives a case, and a chunk the other case published is found there,
    not published again."""
    model = f"model.head_dim={14 if disk else 12}"
    back = [*SMALL, *shared(shared_store), "offload.shared.publish=back", model]
    if disk:
        back += ["offload.disk.enabled=true", f"offload.disk.path={tmp_path}"]
    reference, _ = run([*SMALL, model], offload=False)
    roomy, books = run([*back, "offload.cpu_slots=4096"])
    assert roomy["output_digest"] == reference["output_digest"]
    assert roomy["tiers"]["shared"]["published_chunks"] == 0
    assert not any(books.values()), books
    first, books = run([*back, "offload.cpu_slots=16"])
    assert first["output_digest"] == reference["output_digest"]
    assert first["tiers"]["shared"]["published_chunks"] > 0
    assert not any(books.values()), books
    second, books = run([*back, "offload.cpu_slots=16", "offload.disk.enabled=false"])
    assert second["output_digest"] == reference["output_digest"]
    assert second["shared_hit_tokens"] > 0 and second["integrity"]["mismatches"] == 0
    assert not any(books.values()), books


def test_a_one_process_run_with_the_shared_tier_listens_on_loopback_only(
    shared_store: str,
) -> None:
    """Mooncake's clients (the ranks' in this process, the segment's child, the scheduler's
    index) listened on 0.0.0.0 and ``*``, three plus three sockets here and two in the
    segment's process; only the master bound 127.0.0.1. An embedded master, the default."""
    from raykv.config import load_config
    from raykv.engine.core import EngineCore
    from raykv.engine.workers import LocalWorkerGroup
    from raykv.runs.driver import run_workload
    from raykv.workload.requests import make_workload
    from tests.listeners import exposed_listeners, listening_pids

    cfg = load_config(None, [*SMALL, "offload.shared.enabled=true", "offload.shared.segment=64MiB"])
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers)
        run_workload(engine, make_workload(cfg))
        holder = workers.shared_runtime.holder
        # the clients are up and listening: this process's and the segment's
        assert {os.getpid(), holder.pid} <= listening_pids()
        exposed = exposed_listeners()
    assert not exposed, f"listening beyond loopback: {exposed}"
