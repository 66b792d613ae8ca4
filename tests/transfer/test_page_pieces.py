"""The CPU engine on a page split into pieces that live elsewhere (vLLM's per-layer views): a
store then a load through the pool gives every piece's bytes back, in their blocks."""

from __future__ import annotations

import pytest
import torch

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.layout import KVLayout, allocate_pool


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
