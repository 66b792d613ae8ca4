"""Copy planning: which bulk copy operations move a job's (source row, destination row) pairs.

Pure planning, no copying: the transfer engines turn these plans into torch calls.

The CPU engine (measured on the 2-core CI machine kind, see ``raykv bench transfer``) wants one
torch call per job wherever possible, never an allocation per copy. :func:`plan_copies` splits a
job's pairs into segments whose destination rows are consecutive (one
``index_select(out=destination slice)`` each) or whose source rows are consecutive (one
``index_copy_`` from the source slice each), whichever needs fewer calls; a segment consecutive on
both sides is a plain slice ``copy_``. Pages are copied through a 16-byte element view
(:func:`wide_dtype`: ``complex128`` when the page size and alignment allow): torch's indexed copy
kernels move one element per inner-loop step, and on float16 pages they run at half the memcpy
rate, while the wide view runs them at the rate of one large ``copy_``. The views only move bytes;
no arithmetic touches the values, so copies are bit-exact.

The CUDA engine sorts a job's pairs by host row and copies each run of consecutive host rows
(:func:`host_runs`) with one host<->device ``copy_``, gathering or scattering the device side
when its rows are not consecutive too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raykv.transfer.layout import KVLayout

# widest first: fewer, larger elements make torch's indexed copies run at memcpy speed
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def wide_dtype(page_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest dtype every page of ``tensors`` can be viewed as without a copy."""
    for dtype in _WIDE_DTYPES:
        size = dtype.itemsize
        if page_bytes % size:
            continue
        if all(
            t.data_ptr() % size == 0 and (t.storage_offset() * t.element_size()) % size == 0
            for t in tensors
        ):
            return dtype
    return torch.uint8


@dataclass(slots=True)
class Slice:
    """``dst[d0:d0+n] <- src[s0:s0+n]``."""

    src: int
    dst: int
    n: int


@dataclass(slots=True)
class Gather:
    """``dst[d0:d0+n] <- src[idx[lo:lo+n]]`` (destination consecutive)."""

    lo: int
    dst: int
    n: int


@dataclass(slots=True)
class Scatter:
    """``dst[idx[lo:lo+n]] <- src[s0:s0+n]`` (source consecutive)."""

    lo: int
    src: int
    n: int


CopyOp = Slice | Gather | Scatter


def _segments(order: Sequence[int], key: Sequence[int]) -> list[tuple[int, int]]:
    """Split ``order`` (positions into ``key``) into maximal ``[lo, hi)`` ranges where
    ``key[order[i]]`` increases by exactly one per step."""
    segs: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(order)):
        if key[order[i]] != key[order[i - 1]] + 1:
            segs.append((lo, i))
            lo = i
    segs.append((lo, len(order)))
    return segs


def plan_copies(src: list[int], dst: list[int]) -> tuple[list[CopyOp], list[int]]:
    """Turn row pairs ``dst[i] <- src[i]`` into few bulk copy operations.

    Returns the operations and the index values they read (``Gather``/``Scatter`` refer to
    ranges of it), to be made into ONE index tensor per job. When destinations are distinct the
    pairs commute, so they are sorted to lengthen consecutive runs; with duplicate destinations
    the given order is kept, so the last pair still wins as in a sequential copy.
    """
    n = len(src)
    if n == 0:
        return [], []
    # fast paths first (list comparisons run at C speed): the common jobs are consecutive on at
    # least one side, and sorting would cost more than the copy plan saves
    dst_run = dst == list(range(dst[0], dst[0] + n))
    src_run = src == list(range(src[0], src[0] + n))
    if dst_run and src_run:
        return [Slice(src[0], dst[0], n)], []
    if dst_run:
        return [Gather(0, dst[0], n)], list(src)
    unique_dst = len(set(dst)) == n
    if src_run and unique_dst:
        return [Scatter(0, src[0], n)], list(dst)

    identity = list(range(n))
    if unique_dst:
        by_dst = sorted(identity, key=dst.__getitem__)
        by_src = sorted(identity, key=src.__getitem__)
        src_segs = _segments(by_src, src)
    else:
        # index_copy_ leaves the winner among duplicate indices unspecified: no scatters then
        by_dst = by_src = identity
        src_segs = [(i, i + 1) for i in identity]
    dst_segs = _segments(by_dst, dst)
    ops: list[CopyOp] = []
    index: list[int] = []
    # ties go to gathers: index_select(out=) is the fastest indexed copy torch has on the CPU
    if len(dst_segs) <= len(src_segs):
        for lo, hi in dst_segs:
            pairs = by_dst[lo:hi]
            first = pairs[0]
            if all(src[p] == src[first] + k for k, p in enumerate(pairs)):
                ops.append(Slice(src[first], dst[first], hi - lo))
            else:
                ops.append(Gather(len(index), dst[first], hi - lo))
                index.extend(src[p] for p in pairs)
    else:
        for lo, hi in src_segs:
            pairs = by_src[lo:hi]
            first = pairs[0]
            if all(dst[p] == dst[first] + k for k, p in enumerate(pairs)):
                ops.append(Slice(src[first], dst[first], hi - lo))
            else:
                ops.append(Scatter(len(index), src[first], hi - lo))
                index.extend(dst[p] for p in pairs)
    return ops, index


def check_range(what: str, values: list[int], limit: int) -> None:
    """Raise ``IndexError`` unless every value lies in ``[0, limit)``."""
    low, high = min(values), max(values)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise IndexError(f"{what} {bad} out of range [0, {limit})")


def host_runs(host: list[int], dev: list[int]) -> list[tuple[int, int, bool]]:
    """Split pairs (sorted by host row) into runs of consecutive host rows: (lo, hi, dev rows
    consecutive too)."""
    if not host:
        return []
    return [
        (lo, hi, all(dev[k] == dev[lo] + (k - lo) for k in range(lo, hi)))
        for lo, hi in _segments(range(len(host)), host)
    ]


def run_copies(
    ops: list[CopyOp], index: torch.Tensor | None, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Carry out ``plan_copies``' operations from the rows of ``src`` into those of ``dst``
    (``index``: the plan's index list as a tensor on ``src``'s device)."""
    if index is not None and index.device != src.device:
        index = index.to(src.device)
    for op in ops:
        if isinstance(op, Slice):
            dst[op.dst : op.dst + op.n].copy_(src[op.src : op.src + op.n])
        elif isinstance(op, Gather):
            assert index is not None
            torch.index_select(src, 0, index[op.lo : op.lo + op.n], out=dst[op.dst : op.dst + op.n])
        else:
            assert index is not None
            dst.index_copy_(0, index[op.lo : op.lo + op.n], src[op.src : op.src + op.n])


def piece_columns(pieces: list[torch.Tensor], layout: KVLayout) -> list[tuple[torch.Tensor, int]]:
    """Each piece of a page that lives elsewhere (a byte view ``[num_blocks, n]`` per layer, as
    vLLM's canonical views are) with the offset in the page where its bytes go, in order.
    Raises ``ValueError`` where the pieces do not make exactly one page of ``layout``."""
    page_bytes, num_blocks = layout.page_bytes, layout.num_gpu_blocks
    out: list[tuple[torch.Tensor, int]] = []
    offset = 0
    for number, piece in enumerate(pieces):
        if piece.dim() != 2 or piece.element_size() != 1 or piece.stride(1) != 1:
            raise ValueError(
                f"page piece {number}: expected a byte view [num_blocks, bytes] with "
                f"contiguous rows, got {tuple(piece.shape)} {piece.dtype}"
            )
        if piece.shape[0] != num_blocks:
            raise ValueError(
                f"page piece {number} has {piece.shape[0]} blocks, the layout {num_blocks}"
            )
        if piece.device != pieces[0].device:
            raise ValueError(
                f"page piece {number} is on {piece.device}, piece 0 on {pieces[0].device}"
            )
        out.append((piece.view(torch.uint8), offset))
        offset += piece.shape[1]
    if offset != page_bytes:
        raise ValueError(f"the page pieces hold {offset} bytes, a page {page_bytes}")
    return out


def page_pieces(
    pieces: list[torch.Tensor], pool_rows: torch.Tensor, layout: KVLayout
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each piece of a page (:func:`piece_columns`) with the columns of the pool's page
    rows it fills, both viewed through the widest element the two allow."""
    rows = pool_rows.view(torch.uint8)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for piece, offset in piece_columns(pieces, layout):
        size = piece.shape[1]
        columns = rows[:, offset : offset + size]
        wide = wide_dtype(size, piece, columns)
        if any(t.stride(0) % wide.itemsize for t in (piece, columns)):
            wide = torch.uint8
        pairs.append((piece.view(wide), columns.view(wide)))
    return pairs


def gather_pages(
    pieces: list[tuple[torch.Tensor, int]], index: torch.Tensor, out: torch.Tensor
) -> None:
    """Assemble the pages of blocks ``index`` into the rows of ``out`` (``[len(index),
    page_bytes]`` bytes, on the pieces' device): each piece's rows into its columns."""
    for piece, offset in pieces:
        out[:, offset : offset + piece.shape[1]].copy_(piece.index_select(0, index))


def scatter_pages(
    pieces: list[tuple[torch.Tensor, int]], index: torch.Tensor, pages: torch.Tensor
) -> None:
    """Write the rows of ``pages`` (``[len(index), page_bytes]`` bytes) into blocks ``index``
    of every piece (the inverse of :func:`gather_pages`; ``index`` without repeats)."""
    for piece, offset in pieces:
        piece.index_copy_(0, index, pages[:, offset : offset + piece.shape[1]])
