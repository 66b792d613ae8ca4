"""The CPU engine on a page split into pieces that live elsewhere (vLLM's per-layer views): a
store then a load through the pool gives every piece's bytes back, in their blocks."""

from __future__ import annotations

import pytest
import torch

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer.copy_plan import gather_pages, piece_columns, scatter_pages
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.layout import KVLayout, allocate_pool, pool_rows
from raykv.transfer.rank import piece_copies


@pytest.mark.parametrize("piece_bytes", [[256, 256, 256], [96, 160]], ids=["layers", "odd"])
def test_pieces_round_trip_through_the_pool(piece_bytes) -> None:
    blocks, page = 8, sum(piece_bytes)
    layout = KVLayout(blocks, 1, 1, 1, 1, page // 8, "float32", 2, 4)
    backing = torch.randint(
        -128, 127, (len(piece_bytes) + 1, blocks, max(piece_bytes) + 32), dtype=torch.int8
    )
    pieces = [backing[i, :, :n] for i, n in enumerate(piece_bytes)]  # strided, as vLLM's
    original = [p.clone() for p in pieces]
    engine = CpuTransferEngine(pieces, allocate_pool(layout), layout, threaded=False)
    engine.submit(TransferSpec(1, True, BlockCopy([5, 2, 7], [3, 3, 0], [0, 1, 1]), True))
    engine.flush([1])
    for p in pieces:
        p.zero_()
    engine.submit(TransferSpec(2, False, BlockCopy([0, 1, 4], [3, 3, 0], [0, 1, 1]), True))
    engine.flush([2])
    assert engine.poll() == ([1, 2], [])
    for got, want in zip(pieces, original, strict=True):
        assert torch.equal(got[[0, 1, 4]], want[[5, 2, 7]])
        assert not got[[2, 3]].any()


def test_pieces_that_do_not_make_a_page_are_refused() -> None:
    layout = KVLayout(4, 1, 1, 1, 1, 32, "float32", 1, 2)
    with pytest.raises(ValueError, match="hold 128 bytes, a page 256"):
        CpuTransferEngine([torch.zeros(4, 128, dtype=torch.int8)], allocate_pool(layout), layout)


def test_pages_assembled_on_the_device_are_the_pool_pages_the_cpu_engine_makes() -> None:
    """The CUDA engine assembles a job's pages from the pieces on the device before they cross
    to the host (``gather_pages``) and takes them apart after a load (``scatter_pages``): the
    bytes of a page must be the CPU engine's, or a chunk a CUDA rank stored would be another
    chunk to a CPU rank. Run here on CPU tensors (the same torch calls)."""
    piece_bytes = [96, 160, 64]
    blocks, page = 8, sum(piece_bytes)
    layout = KVLayout(blocks, 1, 1, 1, 1, page // 8, "float32", 1, 8)
    backing = torch.randint(-128, 127, (3, blocks, 192), dtype=torch.int8)
    pieces = [backing[i, :, :n] for i, n in enumerate(piece_bytes)]
    pool = allocate_pool(layout, zero=True)
    engine = CpuTransferEngine(pieces, pool, layout, threaded=False)
    chosen = [5, 2, 7, 0]
    engine.submit(TransferSpec(1, True, BlockCopy(chosen, [0, 1, 2, 3], [0, 0, 0, 0])))
    engine.flush([1])
    columns = piece_columns(pieces, layout)
    staged = torch.empty((len(chosen), page), dtype=torch.uint8)
    gather_pages(columns, torch.tensor(chosen), staged)
    assert torch.equal(staged, pool_rows(pool, layout).view(torch.uint8)[:4])
    original = [p.clone() for p in pieces]
    for p in pieces:
        p.zero_()
    scatter_pages(columns, torch.tensor([1, 3, 4, 6]), staged)
    for got, want in zip(pieces, original, strict=True):
        assert torch.equal(got[[1, 3, 4, 6]], want[chosen])
        assert not got[[0, 2, 5, 7]].any()


def test_a_ranks_copies_of_pages_in_pieces_are_built_for_the_pieces_device() -> None:
    """``piece_copies``: what raykv's worker inside vLLM copies with (the CPU engine and a pool
    faulted in the background here; CUDA's engine and a pinned pool on a GPU, tests/gpu)."""
    layout = KVLayout(8, 1, 1, 1, 1, 32, "float32", 2, 4)
    pieces = [torch.zeros(8, 128, dtype=torch.int8), torch.zeros(8, 128, dtype=torch.int8)]
    made = piece_copies(pieces, layout, threaded=False)
    assert isinstance(made.engine, CpuTransferEngine) and not made.engine.threaded
    assert tuple(made.pool.shape) == (4, layout.page_elems * 2)
    assert made.populator is not None and made.populator.done.wait(30)
    made.engine.shutdown()
    meta = [torch.empty(8, 256, dtype=torch.int8, device="meta")]
    with pytest.raises(RuntimeError, match="on CPU and CUDA devices; this cache is on meta"):
        piece_copies(meta, layout, threaded=False)
