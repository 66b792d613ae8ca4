"""CpuTransferEngine: exact bytes, FIFO order, pause/flush hazards, failures, shutdown."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer.copy_plan import Gather, Scatter, Slice, plan_copies
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows


def make_layout(bpc: int = 1, blocks: int = 16, slots: int = 8) -> KVLayout:
    return KVLayout(
        num_gpu_blocks=blocks,
        block_size=4,
        num_groups=1,
        layers_per_group=2,
        kv_heads=2,
        head_dim=8,
        dtype="float16",
        blocks_per_chunk=bpc,
        num_slots=slots,
    )


def random_bits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float16 tensor of arbitrary bit patterns (NaN payloads, -0.0, subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int32, generator=g)
    return raw.to(torch.int16).view(torch.float16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def store(
    job: int, gpu: list[int], slots: list[int], subs: list[int] | None = None
) -> TransferSpec:
    return TransferSpec(job, True, BlockCopy(gpu, slots, subs or [0] * len(gpu)))


def load(job: int, gpu: list[int], slots: list[int], subs: list[int] | None = None) -> TransferSpec:
    return TransferSpec(job, False, BlockCopy(gpu, slots, subs or [0] * len(gpu)))


@dataclass(slots=True)
class Rig:
    lay: KVLayout
    kv: torch.Tensor
    pool: torch.Tensor
    engine: CpuTransferEngine

    @property
    def rows(self) -> torch.Tensor:
        return pool_rows(self.pool, self.lay)


@pytest.fixture
def rig() -> Iterator[Rig]:
    lay = make_layout()
    kv = random_bits((lay.num_gpu_blocks, lay.page_elems), seed=1)
    pool = allocate_pool(lay, zero=True)
    engine = CpuTransferEngine(kv, pool, lay)
    yield Rig(lay, kv, pool, engine)
    engine.shutdown()


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("gpu_order", ["scattered", "consecutive"])
def test_round_trip_exact_bytes(bpc: int, gpu_order: str) -> None:
    lay = make_layout(bpc=bpc, blocks=16, slots=6)
    kv = random_bits((lay.num_gpu_blocks, lay.page_elems), seed=2)
    original = kv.clone()
    pool = allocate_pool(lay, zero=True)
    rows = pool_rows(pool, lay)
    gpu = [9, 2, 14, 5, 0, 7] if gpu_order == "scattered" else [3, 4, 5, 6, 7, 8]
    if bpc == 1:
        slots, subs = [4, 3, 1, 5, 0, 2], [0] * 6
    else:  # two blocks share slot 4; sub-block offsets out of order
        slots, subs = [4, 4, 1, 5, 0, 2], [0, 2, 1, 1, 2, 0]
    with CpuTransferEngine(kv, pool, lay) as engine:
        # the wide view is the fast path; these random bit patterns prove it moves bytes exactly
        assert engine._kv_rows.dtype == torch.complex128
        engine.submit(store(1, gpu, slots, subs))
        engine.flush([1])
        for g, s, b in zip(gpu, slots, subs, strict=True):
            assert torch.equal(bits(rows[s * bpc + b]), bits(original[g]))
        # exactly those rows were written
        written = {s * bpc + b for s, b in zip(slots, subs, strict=True)}
        for r in set(range(rows.shape[0])) - written:
            assert not bits(rows[r]).any()
        kv.zero_()
        targets = [1, 15, 10, 11, 12, 13]
        engine.submit(load(2, targets, slots, subs))
        engine.flush([2])
        assert engine.poll() == ([1, 2], [])
    for g, t in zip(gpu, targets, strict=True):
        assert torch.equal(bits(kv[t]), bits(original[g]))
    for t in set(range(16)) - set(targets):
        assert not bits(kv[t]).any()


def apply_sequentially(src: list[int], dst: list[int], size: int) -> list[int | None]:
    out: list[int | None] = [None] * size
    for s, d in zip(src, dst, strict=True):
        out[d] = s
    return out


def apply_plan(src: list[int], dst: list[int], size: int) -> list[int | None]:
    ops, index = plan_copies(src, dst)
    out: list[int | None] = [None] * size
    for op in ops:
        if isinstance(op, Slice):
            for k in range(op.n):
                out[op.dst + k] = op.src + k
        elif isinstance(op, Gather):
            for k in range(op.n):
                out[op.dst + k] = index[op.lo + k]
        else:
            assert isinstance(op, Scatter)
            targets = index[op.lo : op.lo + op.n]
            assert len(set(targets)) == op.n  # index_copy_ must never see duplicates
            for k, d in enumerate(targets):
                out[d] = op.src + k
    return out


@given(pairs=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=0, max_size=30))
def test_plan_copies_equals_sequential_copy(pairs: list[tuple[int, int]]) -> None:
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    assert apply_plan(src, dst, 21) == apply_sequentially(src, dst, 21)


def test_plan_copies_coalesces() -> None:
    assert plan_copies([4, 5, 6], [0, 1, 2]) == ([Slice(4, 0, 3)], [])
    assert plan_copies([9, 2, 5], [3, 4, 5]) == ([Gather(0, 3, 3)], [9, 2, 5])
    assert plan_copies([3, 4, 5], [9, 2, 7]) == ([Scatter(0, 3, 3)], [9, 2, 7])
    # listed out of order but consecutive once sorted: one slice
    assert plan_copies([6, 4, 5], [2, 0, 1]) == ([Slice(4, 0, 3)], [])
    # two chunks on scattered slots: one gather per chunk
    ops, _ = plan_copies([7, 1, 3, 8, 2, 9], [30, 31, 32, 12, 13, 14])
    assert len(ops) == 2 and all(isinstance(op, Gather) for op in ops)


def test_fifo_completion_and_nonblocking_poll(rig: Rig) -> None:
    pool, engine = rig.pool, rig.engine
    engine.pause()
    for job in range(10, 16):
        engine.submit(store(job, [job - 10], [job - 10]))
    # paused: nothing ran, and poll returns at once
    start = time.perf_counter()
    assert engine.poll() == ([], [])
    assert time.perf_counter() - start < 0.5
    assert not pool.any()
    engine.resume()
    engine.flush(range(10, 16))
    assert engine.poll() == ([10, 11, 12, 13, 14, 15], [])
    assert engine.poll() == ([], [])


def test_wait_returns_when_a_job_lands_and_never_waits_for_nothing(rig: Rig) -> None:
    engine = rig.engine
    start = time.perf_counter()
    engine.wait(5.0)  # nothing outstanding
    engine.pause()
    engine.submit(store(1, [3, 4], [0, 1]))
    engine.wait(5.0)  # paused: no copy can land while it waits
    assert time.perf_counter() - start < 2.0
    assert engine.poll() == ([], [])
    engine.resume()
    engine.wait(5.0)
    assert engine.poll() == ([1], [])
    assert time.perf_counter() - start < 4.0


def test_pause_really_holds_copies(rig: Rig) -> None:
    lay, kv, pool, engine = rig.lay, rig.kv, rig.pool, rig.engine
    engine.pause()
    engine.submit(store(1, [3, 4], [0, 1]))
    time.sleep(0.05)  # the copy thread would have run it by now if it were not paused
    assert not pool.any()
    assert engine.pending_reads() == {3, 4}
    # a hazard: the source block changes before the queued store has read it
    kv[3] = 0.5
    engine.resume()
    engine.flush([1])
    rows = pool_rows(pool, lay)
    assert torch.all(rows[0] == 0.5)
    assert torch.equal(bits(rows[1]), bits(kv[4]))


def test_flush_runs_paused_jobs_up_to_the_needed_one(rig: Rig) -> None:
    lay, kv, pool, engine = rig.lay, rig.kv, rig.pool, rig.engine
    rows = pool_rows(pool, lay)
    engine.pause()
    engine.submit(store(1, [0], [0]))
    engine.submit(load(2, [8], [7]))
    engine.submit(store(3, [5], [2]))
    engine.submit(store(4, [6], [3]))
    assert engine.pending_reads() == {0, 5, 6}
    assert engine.pending_writes() == {8}
    engine.flush([2, 99])  # 99 is unknown: ignored
    assert torch.equal(bits(rows[0]), bits(kv[0]))
    assert not bits(kv[8]).any()  # the load of an empty slot wrote zeros
    assert not rows[2].any() and not rows[3].any()  # later jobs still queued
    assert engine.pending_reads() == {5, 6}
    assert engine.pending_writes() == set()
    assert engine.poll() == ([1, 2], [])
    engine.flush([1, 2])  # already finished: returns at once
    engine.flush([3])
    assert torch.equal(bits(rows[2]), bits(kv[5]))
    assert not rows[3].any()
    assert engine.poll() == ([3], [])
    engine.resume()
    engine.flush([4])
    assert engine.poll() == ([4], [])
    assert engine.pending_reads() == set()


@pytest.mark.parametrize(
    "bad",
    [
        store(7, [0], [8]),  # slot out of range
        store(7, [16], [0]),  # gpu block out of range
        store(7, [-1], [0]),  # negative: would wrap silently in a slice
        store(7, [0], [0], [1]),  # sub block past the chunk
        TransferSpec(7, False, BlockCopy([0, 1], [0], [0])),  # ragged lists
    ],
)
def test_failed_job_does_not_kill_the_engine(rig: Rig, bad: TransferSpec) -> None:
    lay, kv, pool, engine = rig.lay, rig.kv, rig.pool, rig.engine
    engine.submit(store(6, [1], [1]))
    engine.submit(bad)
    engine.submit(store(8, [2], [2]))
    engine.flush([6, 7, 8])
    assert engine.poll() == ([6, 8], [7])
    errors = engine.take_errors()
    assert list(errors) == [7] and errors[7]
    rows = pool_rows(pool, lay)
    assert torch.equal(bits(rows[2]), bits(kv[2]))
    stats = engine.take_stats()
    assert stats.store_jobs == 2 and stats.store_blocks == 2
    # the engine still works afterwards
    engine.submit(load(9, [10], [2]))
    engine.flush([9])
    assert engine.poll() == ([9], [])


def test_stats(rig: Rig) -> None:
    lay, engine = rig.lay, rig.engine
    engine.submit(store(1, [0, 1, 2], [0, 1, 2]))
    engine.submit(load(2, [9], [0]))
    engine.flush([2])
    stats = engine.take_stats()
    assert (stats.store_jobs, stats.store_blocks, stats.store_bytes) == (1, 3, 3 * lay.page_bytes)
    assert (stats.load_jobs, stats.load_blocks, stats.load_bytes) == (1, 1, lay.page_bytes)
    assert stats.store_seconds > 0 and stats.load_seconds > 0
    assert stats.flushes <= 1
    assert engine.take_stats().store_jobs == 0


def test_flush_counts_only_when_it_waits(rig: Rig) -> None:
    engine = rig.engine
    engine.pause()
    engine.submit(store(1, [0], [0]))
    engine.flush([1])
    engine.flush([1])
    engine.flush([])
    stats = engine.take_stats()
    assert stats.flushes == 1 and stats.flush_seconds > 0


def test_duplicate_queued_job_id_rejected(rig: Rig) -> None:
    engine = rig.engine
    engine.pause()
    engine.submit(store(1, [0], [0]))
    with pytest.raises(ValueError, match="already queued"):
        engine.submit(store(1, [1], [1]))
    engine.flush([1])
    engine.submit(store(1, [1], [1]))  # finished ids may be reused
    engine.flush([1])
    assert engine.poll() == ([1, 1], [])


def test_many_jobs_in_flight_match_sequential_execution() -> None:
    lay = make_layout(bpc=2, blocks=16, slots=8)
    kv = random_bits((16, lay.page_elems), seed=3)
    pool = allocate_pool(lay, zero=True)
    ref_kv, ref_rows = kv.clone(), pool_rows(pool.clone(), lay)
    g = torch.Generator().manual_seed(4)
    specs = []
    for job in range(200):
        n = int(torch.randint(1, 6, (1,), generator=g))
        gpu = torch.randperm(16, generator=g)[:n].tolist()
        rows = torch.randperm(16, generator=g)[:n].tolist()
        specs.append(
            TransferSpec(
                job, job % 3 != 0, BlockCopy(gpu, [r // 2 for r in rows], [r % 2 for r in rows])
            )
        )
    for spec in specs:
        rows = [s * 2 + b for s, b in zip(spec.copy.cpu_slots, spec.copy.sub_blocks, strict=True)]
        for gb, r in zip(spec.copy.gpu_blocks, rows, strict=True):
            if spec.is_store:
                ref_rows[r] = ref_kv[gb]
            else:
                ref_kv[gb] = ref_rows[r]
    with CpuTransferEngine(kv, pool, lay) as engine:
        for spec in specs:
            engine.submit(spec)
        engine.flush([199])
        completed, failed = engine.poll()
    assert completed == list(range(200)) and failed == []
    assert torch.equal(bits(kv), bits(ref_kv))
    assert torch.equal(bits(pool_rows(pool, lay)), bits(ref_rows))


def test_shutdown_drains_idempotent_and_blocks_submit() -> None:
    lay = make_layout()
    kv = random_bits((lay.num_gpu_blocks, lay.page_elems), seed=5)
    pool = allocate_pool(lay, zero=True)
    engine = CpuTransferEngine(kv, pool, lay)
    engine.pause()
    engine.submit(store(1, [3], [3]))
    engine.shutdown()  # runs the queued job even though paused
    assert torch.equal(bits(pool_rows(pool, lay)[3]), bits(kv[3]))
    assert engine.poll() == ([1], [])
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(store(2, [0], [0]))
    assert not engine._thread.is_alive()


def test_shutdown_without_wait_drops_queued_jobs() -> None:
    lay = make_layout()
    kv = random_bits((lay.num_gpu_blocks, lay.page_elems), seed=6)
    pool = allocate_pool(lay, zero=True)
    with CpuTransferEngine(kv, pool, lay) as engine:
        engine.pause()
        engine.submit(store(1, [3], [3]))
        engine.submit(store(2, [4], [4]))
        engine.shutdown(wait=False)
        assert engine.poll() == ([], [1, 2])
        assert not pool.any()
    assert not engine._thread.is_alive()


def test_constructor_checks_tensors() -> None:
    lay = make_layout()
    kv = allocate_kv(lay)
    pool = allocate_pool(lay, zero=True)
    with pytest.raises(ValueError, match="kv shape"):
        CpuTransferEngine(kv[:3], pool, lay)
    with pytest.raises(ValueError, match="must both be"):
        CpuTransferEngine(kv.float(), pool, lay)
    with pytest.raises(ValueError, match="pool shape"):
        CpuTransferEngine(kv, pool[:2], lay)


def test_misaligned_tensors_use_narrow_views() -> None:
    # kv starts 2 bytes into its storage: only a 2-byte view fits; copies must still be exact
    lay = make_layout(blocks=6, slots=6)
    flat = random_bits((6 * lay.page_elems + 1,), seed=7)
    kv = flat[1:].view(6, lay.page_elems)
    pool = allocate_pool(lay, zero=True)
    with CpuTransferEngine(kv, pool, lay) as engine:
        assert engine._kv_rows.dtype == torch.int16
        engine.submit(store(1, [5, 0, 3], [1, 2, 0]))
        engine.submit(load(2, [1, 2], [1, 2]))
        engine.flush([2])
        assert engine.poll() == ([1, 2], [])
    for g, s in [(5, 1), (0, 2), (3, 0)]:
        assert torch.equal(bits(pool[s]), bits(kv[g]))
    assert torch.equal(bits(kv[1]), bits(kv[5]))
    assert torch.equal(bits(kv[2]), bits(kv[0]))


# ---- unthreaded engine with delayed copies (the deterministic test mode) ----------------------


def test_unthreaded_engine_copies_at_poll_after_the_delay() -> None:
    from raykv.core.step import BlockCopy, TransferSpec
    from raykv.transfer.cpu import CpuTransferEngine
    from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool

    layout = KVLayout(8, 4, 1, 1, 1, 4, "float32", 1, 8)
    kv = allocate_kv(layout)
    pool = allocate_pool(layout, zero=True)
    kv[3] = 7.0
    delays = {0: 2, 1: 0}
    engine = CpuTransferEngine(
        kv, pool, layout, threaded=False, exec_delay=lambda j: delays.get(j, 0)
    )
    engine.submit(TransferSpec(0, True, BlockCopy([3], [5], [0])))
    engine.submit(TransferSpec(1, True, BlockCopy([3], [6], [0])))
    assert engine.poll() == ([], [])  # job 0 waits one more poll and holds job 1 back
    assert engine.pending_reads() == {3}
    assert float(pool[5].sum()) == 0.0  # really not copied
    assert engine.poll() == ([0, 1], [])
    assert float(pool[5].sum()) == float(pool[6].sum()) == 7.0 * layout.page_elems
    engine.submit(TransferSpec(2, True, BlockCopy([3], [7], [0])))
    engine.pause()
    assert engine.poll() == ([], [])  # paused: nothing runs at poll
    engine.flush([2])  # but a flush does
    assert engine.poll() == ([2], [])
    engine.shutdown()
