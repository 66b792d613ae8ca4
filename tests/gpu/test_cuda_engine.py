"""The CUDA transfer engine: exact bytes, FIFO completion, held jobs, and the ordering hazards
that corrupt KV silently when a copy is not ordered after the compute stream."""

from __future__ import annotations

import random

import pytest
import torch

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer import cuda as cuda_module
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows

DEV = torch.device("cuda", 0)


def setup(blocks: int = 16, bpc: int = 1, page_elems_dim: int = 64):
    layout = KVLayout(blocks, 4, 1, 2, 2, page_elems_dim, "float16", bpc, blocks)
    kv = allocate_kv(layout, DEV)
    pool = allocate_pool(layout, pin=True, zero=True)
    kv.copy_(torch.randn(kv.shape, device=DEV).to(kv.dtype))
    return layout, kv, pool, CudaTransferEngine(kv, pool, layout)


def spec(job: int, store: bool, blocks, slots, subs) -> TransferSpec:
    return TransferSpec(job, store, BlockCopy(list(blocks), list(slots), list(subs)))


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered-gpu", "scattered-both"])
def test_store_then_load_moves_exact_bytes(bpc: int, pattern: str) -> None:
    layout, kv, pool, engine = setup(blocks=18, bpc=bpc)
    gpu = list(range(12))
    positions = list(range(12))
    if pattern != "contiguous":
        random.Random(1).shuffle(gpu)
    if pattern == "scattered-both":
        random.Random(2).shuffle(positions)
    slots = [p // bpc for p in positions]
    subs = [p % bpc for p in positions]
    original = kv.clone()
    engine.submit(spec(1, True, gpu, slots, subs))
    engine.flush([1])
    rows = pool_rows(pool, layout)
    for g, p in zip(gpu, positions, strict=True):
        assert torch.equal(rows[p].view(torch.int16), original[g].cpu().view(torch.int16))
    kv.zero_()
    engine.submit(spec(2, False, gpu, slots, subs))
    engine.flush([2])
    assert torch.equal(kv[:12].view(torch.int16), original[:12].view(torch.int16))
    assert engine.poll() == ([1, 2], [])
    stats = engine.take_stats()
    assert stats.store_blocks == stats.load_blocks == 12 and stats.store_seconds > 0
    engine.shutdown()


def test_paused_jobs_stay_on_the_host_until_flushed_and_complete_in_order() -> None:
    _layout, _kv, pool, engine = setup()
    engine.pause()
    engine.submit(spec(1, True, [1, 2], [0, 1], [0, 0]))
    engine.submit(spec(2, True, [3], [2], [0]))
    assert engine.pending_reads() == {1, 2, 3}
    torch.cuda.synchronize()
    assert float(pool.abs().sum()) == 0.0  # really not copied
    assert engine.poll() == ([], [])
    engine.flush([1])  # issues job 1 only (job 2 is behind it)
    assert engine.pending_reads() == {3}
    engine.resume()
    engine.flush([2])
    assert engine.poll() == ([1, 2], [])
    engine.submit(spec(3, False, [99], [0], [0]))  # out of range: failed, engine still works
    engine.submit(spec(4, False, [5], [0], [0]))
    engine.flush([4])
    assert engine.poll() == ([4], [3])
    engine.shutdown()


def test_wait_returns_once_the_oldest_job_lands() -> None:
    _layout, _kv, _pool, engine = setup(blocks=64)
    engine.wait(5.0)  # nothing queued: returns at once
    engine.submit(spec(1, True, range(64), range(64), [0] * 64))
    engine.wait(5.0)
    assert engine.poll() == ([1], [])
    engine.shutdown()


def test_a_store_never_reads_a_block_before_the_model_wrote_it() -> None:
    layout, kv, pool, engine = setup()
    fresh = torch.full((layout.page_elems,), 3.0, dtype=kv.dtype, device=DEV)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy for a while
    kv[4].copy_(fresh)  # "the model step": queued behind the sleep
    engine.submit(spec(1, True, [4], [0], [0]))  # submitted at once, must run after the write
    engine.flush([1])
    assert torch.equal(pool_rows(pool, layout)[0], fresh.cpu())
    engine.shutdown()


def test_a_load_never_overwrites_a_block_a_kernel_is_still_reading() -> None:
    layout, kv, pool, engine = setup()
    before = kv[6].clone()
    pool_rows(pool, layout)[0].fill_(-2.0)
    torch.cuda._sleep(50_000_000)
    snapshot = kv[6].clone()  # a read queued on the compute stream behind the sleep
    engine.submit(spec(1, False, [6], [0], [0]))  # the block's new owner's load
    engine.flush([1])
    torch.cuda.synchronize()
    assert torch.equal(snapshot, before)  # the read saw the old contents
    assert float(kv[6].float().mean()) == -2.0
    engine.shutdown()


def test_jobs_of_one_direction_land_in_submission_order() -> None:
    layout, kv, pool, engine = setup()
    kv[1].fill_(1.0)
    kv[2].fill_(2.0)
    # Hold back the stream the first store will run on (a direction's streams are taken in
    # turn): the second store, on the other stream, writes the same slot and would land first,
    # then be overwritten by the first, if jobs were not chained by their end events.
    first_stream = engine._streams[True][0]
    with torch.cuda.stream(first_stream):
        torch.cuda._sleep(50_000_000)
    engine.submit(spec(1, True, [1], [0], [0]))
    engine.submit(spec(2, True, [2], [0], [0]))  # the slot, evicted and reused
    engine.flush([1, 2])
    assert float(pool_rows(pool, layout)[0].float().mean()) == 2.0
    assert engine.poll() == ([1, 2], [])
    engine.shutdown()


def pieces_engine(blocks: int = 24):
    piece_bytes = [512, 512, 256, 768]
    page = sum(piece_bytes)
    layout = KVLayout(blocks, 1, 1, 1, 1, page // 8, "float32", 2, blocks // 2)
    backing = torch.randint(-128, 127, (4, blocks, 1024), dtype=torch.int8, device=DEV)
    pieces = [backing[i, :, :n] for i, n in enumerate(piece_bytes)]
    pool = allocate_pool(layout, pin=True, zero=True)
    return layout, backing, pieces, pool, CudaTransferEngine(pieces, pool, layout)


@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_pages_in_pieces_of_several_tensors_move_exact_bytes(
    pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's canonical views on CUDA: a page is one byte view per layer, cut from wider rows.
    A store then a load through the pinned pool gives every piece's bytes back, and the pool's
    pages are the pieces' bytes in order (what a CPU rank stores). Staged three pages at a
    time, so a job takes several stages, and scattered pool rows several runs in each."""
    monkeypatch.setattr(cuda_module, "STAGE_BYTES", 3 * 2048)
    layout, backing, pieces, pool, engine = pieces_engine()
    gpu = list(range(10))
    positions = list(range(10))
    if pattern == "scattered":
        random.Random(3).shuffle(gpu)
        positions = random.Random(4).sample(range(24), 10)
    slots, subs = [p // 2 for p in positions], [p % 2 for p in positions]
    original = [p.clone() for p in pieces]
    engine.submit(spec(1, True, gpu, slots, subs))
    engine.flush([1])
    rows = pool_rows(pool, layout).view(torch.uint8)
    for g, p in zip(gpu, positions, strict=True):
        want = torch.cat([piece[g].view(torch.uint8).cpu() for piece in original])
        assert torch.equal(rows[p], want)
    backing.zero_()
    targets = [g + 12 for g in gpu]
    engine.submit(spec(2, False, targets, slots, subs))
    engine.flush([2])
    for got, want in zip(pieces, original, strict=True):
        assert torch.equal(got[targets], want[gpu])
        assert not got[:12].any()
    assert engine.poll() == ([1, 2], [])
    engine.shutdown()


def test_a_job_the_device_has_no_memory_for_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose staging the device cannot allocate (forced here: a real OOM cannot be had on
    demand) fails as a job; the engine goes on with the next one."""
    _layout, _backing, _pieces, _pool, engine = pieces_engine()
    real = cuda_module.gather_pages

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (forced by the test)")

    monkeypatch.setattr(cuda_module, "gather_pages", no_memory)
    engine.submit(spec(1, True, [0, 1], [0, 0], [0, 1]))
    monkeypatch.setattr(cuda_module, "gather_pages", real)
    engine.submit(spec(2, True, [2, 3], [1, 1], [0, 1]))
    engine.flush([1, 2])
    assert engine.poll() == ([2], [1])
    assert engine.pending_reads() == set()
    engine.shutdown()
