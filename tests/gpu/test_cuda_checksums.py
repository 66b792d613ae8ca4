"""``offload.verify`` on CUDA ranks (issue 28, finding 10a): a store's pinned pool rows get
their checksum once the copy has landed, a load checks its source rows before any copy from them
is queued, and a row that changed in between fails the load as corrupt, copying nothing. Before,
the CUDA engine ignored ``check_sums``: with a real model, verify checked nothing at all."""

from __future__ import annotations

import torch

from raykv.config import load_config
from raykv.core.step import BlockCopy, TransferSpec
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import run_workload
from raykv.transfer.checksums import NO_CHECKSUM, row_checksum
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows
from raykv.workload.requests import make_workload

DEV = torch.device("cuda", 0)


def setup(blocks: int = 8, bpc: int = 2):
    layout = KVLayout(blocks, 4, 1, 2, 2, 64, "bfloat16", bpc, blocks)
    kv = allocate_kv(layout, DEV)
    kv.copy_(torch.randn(kv.shape, device=DEV).to(kv.dtype))
    pool = allocate_pool(layout, pin=True, zero=True)
    return layout, kv, pool, CudaTransferEngine(kv, pool, layout)


def spec(job: int, store: bool, blocks, slots, subs, check: bool = True) -> TransferSpec:
    copy = BlockCopy(list(blocks), list(slots), list(subs))
    return TransferSpec(job, store, copy, check_sums=check)


def test_a_landed_store_is_vouched_for_and_its_load_checked() -> None:
    layout, kv, pool, engine = setup()
    engine.submit(spec(1, True, [3, 5], [1, 2], [0, 1]))
    engine.flush([1])
    assert engine.poll() == ([1], [])
    rows = pool_rows(pool, layout)
    sums = engine.checksums.sums
    assert int(sums[2]) == row_checksum(rows[2]) and int(sums[5]) == row_checksum(rows[5])
    original = kv[[3, 5]].clone()
    kv.zero_()
    engine.submit(spec(2, False, [3, 5], [1, 2], [0, 1]))
    engine.flush([2])
    assert engine.poll() == ([2], []) and engine.take_corrupt() == []
    assert torch.equal(kv[[3, 5]].view(torch.int16), original.view(torch.int16))
    stats = engine.take_stats()
    assert stats.chunks_checked == 2 and stats.corrupt_detected == 0
    engine.shutdown()


def test_a_row_that_changed_fails_its_load_as_corrupt_and_copies_nothing() -> None:
    _layout, kv, _pool, engine = setup()
    engine.submit(spec(1, True, [0, 1], [0, 0], [0, 1]))
    engine.flush([1])
    assert engine.poll() == ([1], [])
    engine.corrupt_rows(BlockCopy([1], [0], [1]))  # the corrupt-cpu fault: memory that flips
    kv.zero_()
    engine.submit(spec(2, False, [0, 1], [0, 0], [0, 1]))
    engine.flush([2])
    assert engine.poll() == ([], [2]) and engine.take_corrupt() == [2]
    assert not kv.view(torch.int16).any()  # nothing of the load was copied, the good row neither
    stats = engine.take_stats()
    assert stats.chunks_checked == 2 and stats.corrupt_detected == 1
    # without verify nothing is checked: the changed bytes are copied
    engine.submit(spec(3, False, [0, 1], [0, 0], [0, 1], check=False))
    engine.flush([3])
    assert engine.poll() == ([3], []) and engine.take_corrupt() == []
    engine.shutdown()


def test_rows_being_rewritten_vouch_for_nothing_until_the_store_lands() -> None:
    _layout, _kv, _pool, engine = setup()
    engine.submit(spec(1, True, [0], [3], [0]))
    engine.flush([1])
    engine.poll()
    first = int(engine.checksums.sums[6])
    assert first != NO_CHECKSUM
    engine.pause()
    engine.submit(spec(2, True, [4], [3], [0]))  # held on the host: not issued yet
    assert int(engine.checksums.sums[6]) == first
    engine.resume()
    assert int(engine.checksums.sums[6]) == NO_CHECKSUM  # issued, maybe not landed
    engine.flush([2])
    assert engine.poll() == ([2], [])
    assert int(engine.checksums.sums[6]) not in (NO_CHECKSUM, first)
    engine.shutdown()


def test_a_cuda_rank_keeps_its_checksums_in_the_shared_shard() -> None:
    from tests.gpu.conftest import cuda_rank

    layout = KVLayout(8, 4, 1, 2, 2, 64, "float16", 1, 8)
    with cuda_rank(layout) as res:  # on /dev/shm: CUDA page-locks shared files on tmpfs only
        assert res.shared is not None
        assert res.engine.checksums.sums.data_ptr() == res.shared.sums.data_ptr()


def test_verify_on_cuda_ranks_catches_corrupt_chunks_with_the_tokens_unchanged() -> None:
    sets = [
        "workload.num_requests=40",
        "cache.num_gpu_blocks=48",
        "workload.system_prompt_tokens=96",
        "workload.user_tokens=24",
        "workload.answer_tokens=16",
        "workload.max_tokens=8",
        "parallel.device=cuda",
    ]

    def run(faults: str) -> dict:
        cfg = load_config(None, [*sets, f"faults={faults}"])
        with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
            engine = EngineCore(cfg, workers, verify=True)
            return run_workload(engine, make_workload(cfg), check_invariants=True)

    clean, spoilt = run("[]"), run('["corrupt-cpu:rate=0.3:seed=6"]')
    assert clean["integrity"]["checked"] > 0 and clean["integrity"]["corrupt_detected"] == 0
    integrity = spoilt["integrity"]
    assert integrity["corrupt_detected"] > 0 and integrity["mismatches"] == 0
    assert spoilt["output_digest"] == clean["output_digest"]
