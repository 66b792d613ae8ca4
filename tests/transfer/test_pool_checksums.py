"""``offload.verify``'s checksums of CPU-pool rows, kept on the host so that CPU and CUDA ranks
check the same way (issue 28, finding 10a: a CUDA rank used to ignore ``check_sums``). What the
CUDA engine does with them is in tests/gpu/test_cuda_checksums.py; here the bookkeeping both
engines share, and that a shard's checksums mean the same whichever engine wrote them."""

from __future__ import annotations

import pytest
import torch

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer.checksums import NO_CHECKSUM, RowChecksums, flip_rows, row_checksum
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows
from raykv.transfer.shared_pool import SharedPool


def _layout(dtype: str = "bfloat16", chunk: int = 2) -> KVLayout:
    return KVLayout(8, 4, 1, 2, 2, 8, dtype, chunk, 4)


def _rows(layout: KVLayout) -> torch.Tensor:
    pool = allocate_pool(layout, zero=True)
    rows = pool_rows(pool, layout)
    rows.copy_(torch.randn(rows.shape).to(rows.dtype))
    return rows


def test_a_row_that_changed_after_its_store_is_caught_and_only_that_one() -> None:
    rows = _rows(_layout())
    checksums = RowChecksums(rows)
    checksums.record([0, 1, 2])
    assert checksums.check([0, 1, 2]) == (3, [])
    flip_rows(rows, [1])
    assert checksums.check([2, 1, 0]) == (3, [1])


def test_rows_nothing_vouches_for_are_not_checked() -> None:
    rows = _rows(_layout())
    checksums = RowChecksums(rows)
    assert checksums.check([0, 3]) == (0, [])  # never stored
    checksums.record([0, 3])
    checksums.forget([3])  # a store is rewriting it: the old checksum must not vouch for it
    flip_rows(rows, [3])
    assert checksums.check([0, 3]) == (1, [])
    assert int(checksums.sums[3]) == NO_CHECKSUM
    assert checksums.check([]) == (0, [])


def test_a_successor_checks_what_its_predecessor_stored_in_the_shard(tmp_path) -> None:
    layout = _layout()
    first = SharedPool(str(tmp_path / "shard.pool"), layout)
    rows = pool_rows(first.tensor, layout)
    rows.copy_(torch.randn(rows.shape).to(rows.dtype))
    RowChecksums(rows, first.sums).record([4, 5])
    again = SharedPool(str(tmp_path / "shard.pool"), layout)
    successor = RowChecksums(pool_rows(again.tensor, layout), again.sums)
    assert again.attached and successor.check([4, 5, 6]) == (2, [])
    flip_rows(pool_rows(again.tensor, layout), [5])
    assert successor.check([4, 5]) == (2, [5])


def test_checksums_are_of_raw_bytes_whatever_view_reads_the_rows() -> None:
    # the CPU engine reads the pool through a wide integer view, the CUDA engine in the KV dtype:
    # a shard's checksums must mean the same to both
    layout = _layout("float16", chunk=1)
    kv = allocate_kv(layout)
    kv.copy_(torch.randn(kv.shape).to(kv.dtype))
    pool = allocate_pool(layout, zero=True)
    sums = torch.full((layout.num_slots,), NO_CHECKSUM, dtype=torch.int64)
    engine = CpuTransferEngine(kv, pool, layout, threaded=False, sums=sums)
    try:
        engine.submit(TransferSpec(1, True, BlockCopy([5, 2], [0, 3], [0, 0]), check_sums=True))
        engine.flush([1])
        assert engine.poll() == ([1], [])
    finally:
        engine.shutdown()
    rows = pool_rows(pool, layout)  # float16 rows, as the CUDA engine sees them
    assert int(sums[0]) == row_checksum(rows[0]) and int(sums[3]) == row_checksum(rows[3])
    assert RowChecksums(rows, sums).check([0, 3]) == (2, [])


def test_a_checksum_table_of_the_wrong_shape_is_refused() -> None:
    rows = _rows(_layout())
    with pytest.raises(ValueError, match="one entry per pool row"):
        RowChecksums(rows, torch.full((3,), NO_CHECKSUM, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        RowChecksums(rows, torch.zeros(rows.shape[0], dtype=torch.int32))
