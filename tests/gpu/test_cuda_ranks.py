"""The engine with CUDA ranks: integrity, equivalence with CPU ranks, hazards under pressure."""

from __future__ import annotations

import pytest

from raykv.bench.transfer import run_transfer_bench
from raykv.config import load_config
from raykv.core.step import BlockCopy, TransferSpec
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import run_workload
from raykv.workload.requests import make_workload

SETS = [
    "workload.num_requests=60",
    "cache.num_gpu_blocks=48",
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=8",
    "parallel.tensor_parallel_size=2",  # two ranks share the one GPU
]


def run(device: str, offload: bool = True, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [*SETS, f"parallel.device={device}", *extra])
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers, offload=offload, verify=True)
        report = run_workload(engine, make_workload(cfg), check_invariants=True)
        if offload:
            assert len(engine.connector.jobs) == 0 and not engine.connector.fence
    return report


def test_cuda_ranks_produce_the_tokens_of_cpu_ranks() -> None:
    # rank 1's acks come 4 steps late (a fault), so stores stay in flight as the scheduler sees
    # them and the fence flushes blocks handed out again: on an idle GPU every store would
    # have landed before its block is reused
    late = ('faults=["delay-acks:rank=1:steps=4"]',)
    gpu, cpu = run("cuda", extra=late), run("cpu")
    assert gpu["integrity"]["mismatches"] == 0 and gpu["integrity"]["blocks_verified"] > 0
    assert gpu["cpu_hit_tokens"] > 0 and gpu["flushes"]["reuse"] > 0
    assert (
        gpu["output_digest"] == cpu["output_digest"] == run("cuda", offload=False)["output_digest"]
    )


def test_cuda_ranks_under_heavy_reuse_and_sliding_windows() -> None:
    extra = (
        "cache.num_gpu_blocks=24",
        "cache.block_size=8",
        "model.num_layers=4",
        "cache.groups=[{kind: full_attention}, {kind: sliding_window, window_tokens: 24}]",
    )
    gpu = run("cuda", extra=extra)
    assert gpu["integrity"]["mismatches"] == 0
    assert gpu["output_digest"] == run("cuda", offload=False, extra=extra)["output_digest"]


def test_cuda_ranks_page_lock_their_shared_memory_shard() -> None:
    from raykv.engine.workers import make_layout
    from tests.gpu.conftest import cuda_rank

    cfg = load_config(None, [*SETS, "parallel.device=cuda"])
    with cuda_rank(make_layout(cfg, 16)) as res:
        assert res.shared is not None and res.pool.is_pinned()


def test_a_shard_cuda_cannot_page_lock_leaves_no_error_behind(tmp_path) -> None:
    """A pool file on a disk file system (Linux 6.5 and later refuse long-term pins of such
    pages): the rank pins a private pool instead, and the refused ``cudaHostRegister`` must not
    stay CUDA's last error, which torch would raise from its next kernel launch, one that did
    nothing wrong (seen on the lent H200: the rank's first copy failed)."""
    from raykv.engine.workers import make_layout
    from raykv.transfer.layout import pool_rows
    from raykv.transfer.shared_pool import filesystem_type
    from tests.gpu.conftest import cuda_rank

    if filesystem_type(str(tmp_path)) in ("tmpfs", "hugetlbfs"):
        pytest.skip(f"{tmp_path} is on tmpfs, where CUDA page-locks a shared file")
    cfg = load_config(None, [*SETS, "parallel.device=cuda"])
    layout = make_layout(cfg, 16)
    with cuda_rank(layout, str(tmp_path)) as res:
        if res.shared is not None:
            pytest.skip("this kernel page-locks shared files here: no refusal to recover from")
        assert res.pool.is_pinned()
        res.kv.fill_(1.0)  # a kernel launch, after which torch reads CUDA's last error
        res.engine.submit(TransferSpec(1, True, BlockCopy([0, 1], [0, 1], [0, 0])))
        res.engine.flush([1])
        assert res.engine.poll() == ([1], [])
        rows = pool_rows(res.pool, layout)
        assert bool((rows[0] == 1.0).all()) and bool((rows[layout.blocks_per_chunk] == 1.0).all())


def test_a_dead_cuda_rank_is_replaced_and_finds_the_cpu_tier() -> None:
    extra = ('faults=["kill-worker:step=30:rank=1"]',)
    gpu = run("cuda", extra=extra)
    assert gpu["rank_restarts"] == gpu["tier_kept_restarts"] == 1
    assert gpu["integrity"]["mismatches"] == 0
    assert gpu["output_digest"] == run("cuda", offload=False)["output_digest"]


def test_transfer_bench_on_cuda_reports_sane_numbers() -> None:
    result = run_transfer_bench("cuda", [64, 1024], 64, ["store", "load", "both"], repeat=1)
    assert result["device"] == "cuda"
    for row in result["results"]:
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0 and row["ratio"] > 0
