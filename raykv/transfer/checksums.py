"""Checksums of CPU-pool page rows (``offload.verify``), the same on CPU and CUDA ranks.

A store records the CRC-32 of every pool row it wrote once its copy has landed; a load checks
each source row against it before copying from it, so bytes that changed in host memory in
between (a bit flip, a stray write, a shard file someone else touched) fail the load as corrupt
instead of being read into the KV cache. The checksums are computed on the host from the rows'
raw bytes, so a CUDA rank's pinned pool is checked exactly as a CPU rank's is, and a shard's
checksums mean the same whichever engine wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raykv.core.step import BlockCopy
from raykv.transfer.crc import crc32

NO_CHECKSUM = -1  # a row nothing vouches for (never stored, or being rewritten)


def row_checksum(row: torch.Tensor) -> int:
    """The CRC-32 of one contiguous host-memory row's raw bytes (any dtype)."""
    return crc32(row.view(torch.uint8).numpy().data)


def flip_rows(rows: torch.Tensor, row_ids: Iterable[int]) -> None:
    """Flip one byte in the middle of each listed row: what the ``corrupt-cpu`` fault does to
    chunks that landed, as memory that flips."""
    for row_id in row_ids:
        row = rows[row_id].view(torch.uint8)
        row[len(row) // 2] ^= 0x5A


def flip_copied_rows(rows: torch.Tensor, copy: BlockCopy, blocks_per_chunk: int) -> None:
    """``flip_rows`` on every pool row a store job's ``copy`` wrote (slot, position in chunk)."""
    flip_rows(
        rows,
        (
            slot * blocks_per_chunk + sub
            for slot, sub in zip(copy.cpu_slots, copy.sub_blocks, strict=True)
        ),
    )


class RowChecksums:
    """The checksum each pool row had when a store last finished writing it."""

    def __init__(self, rows: torch.Tensor, sums: torch.Tensor | None = None) -> None:
        """``rows``: the pool page by page, ``[num_rows, ...]`` in host memory. ``sums``: where
        the checksums live (int64, one per row, ``NO_CHECKSUM`` where none); a shared-memory
        shard keeps them in its file, so that a rank replacing a dead one still checks what its
        predecessor stored. Without, a private table that vouches for no row yet."""
        if rows.device.type != "cpu":
            raise ValueError(f"pool rows must be in host memory, got {rows.device}")
        count = rows.shape[0]
        if sums is None:
            sums = torch.full((count,), NO_CHECKSUM, dtype=torch.int64)
        elif tuple(sums.shape) != (count,) or sums.dtype != torch.int64:
            raise ValueError(
                f"sums must be int64 with one entry per pool row ({count}), "
                f"got {sums.dtype} {tuple(sums.shape)}"
            )
        self.rows = rows
        self.sums = sums

    def record(self, row_ids: Iterable[int]) -> None:
        """Remember what the listed rows hold now (call once a store's copy into them landed)."""
        rows, sums = self.rows, self.sums
        for row_id in row_ids:
            sums[row_id] = row_checksum(rows[row_id])

    def forget(self, row_ids: Iterable[int]) -> None:
        """Vouch for the listed rows no longer: a store is about to rewrite them, and until it
        lands (it may never, if the rank dies) their old checksum would vouch for bytes that
        are no longer there."""
        ids = list(row_ids)
        if ids:
            self.sums[ids] = NO_CHECKSUM

    def check(self, row_ids: list[int]) -> tuple[int, list[int]]:
        """``(rows checked, rows whose bytes no longer match)``; a row without a checksum is not
        checked (nothing was recorded to compare with)."""
        if not row_ids:
            return 0, []
        checked, bad = 0, []
        for row_id, recorded in zip(row_ids, self.sums[row_ids].tolist(), strict=True):
            if recorded < 0:  # NO_CHECKSUM
                continue
            checked += 1
            if row_checksum(self.rows[row_id]) != recorded:
                bad.append(row_id)
        return checked, bad
