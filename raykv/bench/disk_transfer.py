"""``raykv bench transfer --device disk``: the disk engine's chunk files against plain sequential
I/O of the same bytes on the same path.

For each page size a CPU pool of N pages (``blocks_per_chunk`` to a slot) lives in page-aligned
anonymous memory, as a rank's shared-memory shard does, so that ``O_DIRECT`` reads and writes
the pool's own rows with no bounce buffer (``zero_copy`` in a row). One job of every chunk goes
through :class:`~raykv.transfer.disk.DiskTransferEngine`, timed from submit to flush: direction
``store`` writes the slots to one new file per chunk (a demotion), ``load`` reads the files back
into the slots (a promotion, every page's checksum verified). The limit it is held against is
measured in the same run on the same path, alternating with it: the same bytes written to one
file and read back in large sequential I/Os (``PLAIN_IO_BYTES`` each, one thread) from and into
the same memory, in the same mode. ``ratio`` is the engine's GB/s over the plain file's; both
count the pages' bytes, so the engine's 4 KiB header per file is part of its cost. The disk
tier's goal is a ratio of at least 0.8 cold: a promotion should cost about what the disk costs.

Modes:

- ``cold``: the page cache out of the way, as for a chunk demoted long ago. ``O_DIRECT`` on both
  sides where the file system allows it (``io: direct``); where it does not, buffered I/O whose
  writes are timed up to an ``fsync`` of every file and whose files' cached pages are dropped
  (``fsync`` + ``POSIX_FADV_DONTNEED``) before each read (``io: buffered``, ``cache: dropped``).
- ``warm``: buffered I/O on both sides, the files just written (a load reads the page cache, a
  store writes into it): what is left is the engine's own CPU cost per file against one file's.

Every write round starts from the previous round's chunks dropped, untimed: the engine's go to
its free list and are written over (as in a full tier, which evicts a chunk for every one it
writes), the plain file is deleted and made anew. A run's files live
in a fresh directory under ``path`` (default: the system's temporary directory): each row's are
deleted when it ends, and the directory when the run does, on an error too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence

import torch

from raykv.bench.transfer import bench_layout, best_pair
from raykv.core.keys import make_key
from raykv.core.step import TierMove
from raykv.transfer.disk import DiskTransferEngine, probe_direct_io
from raykv.transfer.disk_files import ChunkFormat, align_up
from raykv.transfer.layout import KVLayout

DISK_DIRECTIONS = ("store", "load")
MODES = ("cold", "warm")
# the plain file's I/O size: large enough that the disk, not the calls, sets its pace
PLAIN_IO_BYTES = 8 * 2**20
DEFAULT_DISK_BLOCKS = 4096
# the pool of one row stays under this (the block count shrinks instead): a row of 256 MiB takes
# about half a second each way on a disk of 500 MB/s, long enough to average the disk's jitter
DEFAULT_DISK_MAX_BYTES = 256 * 2**20
_SEED = 20240601

Row = dict[str, float | int | str | bool]


def directory_problem(path: str) -> str | None:
    """Why the bench cannot put its files under ``path`` (None: it can). A directory is tried
    for real (a subdirectory made and removed): permission bits say nothing to root, and a
    read-only mount says nothing in them."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".raykv-bench-probe-", dir=path))
    except OSError as exc:
        return f"cannot create files there ({exc.strerror or exc})"
    return None


def disk_layout(page_kib: int, blocks: int, blocks_per_chunk: int) -> KVLayout:
    """:func:`~raykv.bench.transfer.bench_layout`'s page of ``page_kib`` KiB, ``blocks`` of them
    in slots of ``blocks_per_chunk`` pages (one file each)."""
    if blocks_per_chunk <= 0 or blocks % blocks_per_chunk:
        raise ValueError(
            f"blocks {blocks} is not a multiple of blocks_per_chunk {blocks_per_chunk}"
        )
    layout = bench_layout(page_kib, blocks)
    return dataclasses.replace(
        layout, blocks_per_chunk=blocks_per_chunk, num_slots=blocks // blocks_per_chunk
    )


def aligned_pool(layout: KVLayout) -> tuple[torch.Tensor, mmap.mmap]:
    """The CPU pool ``[num_slots, chunk elems]`` in anonymous ``mmap`` memory, and the mapping:
    page-aligned, as a shared-memory shard is (``torch.empty`` promises 64 bytes, O_DIRECT needs
    4 KiB). The mapping is rounded up to whole pages, so the plain file may read and write the
    tail O_DIRECT needs (its I/O sizes are multiples of 4 KiB) without leaving it."""
    rows, cols = layout.num_slots, layout.page_elems * layout.blocks_per_chunk
    memory = mmap.mmap(-1, align_up(rows * layout.chunk_bytes))
    pool = torch.frombuffer(memory, dtype=layout.torch_dtype, count=rows * cols).view(rows, cols)
    # distinct words on every page, so no two pages (nor their checksums) match
    words = pool.view(-1).view(torch.int32)
    words.copy_(torch.arange(words.numel(), dtype=torch.int32))
    return pool, memory


class PlainFile:
    """The baseline: the same bytes as one file, written and read in order, ``PLAIN_IO_BYTES``
    an I/O on one thread, from and into the pool's own memory."""

    def __init__(self, path: str, memory: mmap.mmap, nbytes: int, direct: bool) -> None:
        self.path = path
        self._memory = memoryview(memory)
        self._nbytes = align_up(nbytes)  # O_DIRECT moves whole 4 KiB blocks
        self._flags = os.O_CLOEXEC | (os.O_DIRECT if direct else 0)

    def _parts(self) -> list[tuple[int, memoryview]]:
        step = PLAIN_IO_BYTES
        return [
            (at, self._memory[at : min(at + step, self._nbytes)])
            for at in range(0, self._nbytes, step)
        ]

    def write(self, sync: bool) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags, 0o600)
        try:
            for at, part in self._parts():
                if os.pwrite(fd, part, at) != len(part):
                    raise OSError(f"{self.path}: short write at byte {at}")
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | self._flags)
        try:
            for at, part in self._parts():
                if os.preadv(fd, [part], at) != len(part):
                    raise OSError(f"{self.path}: short read at byte {at}")
        finally:
            os.close(fd)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def settle_files(paths: list[str], drop: bool) -> None:
    """``fsync`` each file, and with ``drop`` its pages leave the page cache too (only clean
    pages can: hence the fsync first). Cold mode where O_DIRECT is refused."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bench_mode(
    layout: KVLayout,
    pool: torch.Tensor,
    memory: mmap.mmap,
    keys: list[int],
    mode: str,
    direct_ok: bool,
    directions: list[str],
    repeat: int,
    io_threads: int,
    run_dir: str,
) -> list[Row]:
    """The rows of one page size in one mode: each direction, engine against the plain file.
    Every engine of a run shares one rank directory (making and removing its 256 subdirectories
    took up to a second here); each row's files are deleted when it ends."""
    direct = mode == "cold" and direct_ok
    drop = mode == "cold" and not direct  # cold without O_DIRECT: fsync, then drop the cache
    engine = DiskTransferEngine(
        os.path.join(run_dir, "chunks"),
        pool,
        layout,
        io_threads=io_threads,
        direct_io="on" if direct else "off",
        # a full tier writes each new chunk over an evicted one's file: so do these rounds
        max_free_files=len(keys),
    )
    nbytes = len(keys) * layout.chunk_bytes
    plain = PlainFile(os.path.join(run_dir, "plain.bin"), memory, nbytes, direct)
    files = [engine.files.path(key) for key in keys]
    slots = list(range(len(keys)))
    job_ids = itertools.count(1)

    def run_job(promote: bool) -> None:
        move = TierMove.of(next(job_ids), promote, keys, slots, False)
        engine.submit(move)
        engine.flush([move.job_id])
        completed, failed = engine.poll()
        if failed or completed != [move.job_id]:  # a failed job is fast: never a number
            what = "load" if promote else "store"
            raise RuntimeError(f"the disk engine's {what} of {len(keys)} chunks failed")

    def engine_store() -> None:
        run_job(False)
        if drop:
            settle_files(files, drop=False)  # on the device, as O_DIRECT's would be

    def before_store(which: int) -> None:
        # a full tier's demotion writes over an evicted chunk's file; the plain file is new
        if which == 0:
            engine.drop(keys)
        else:
            plain.remove()

    def before_load(which: int) -> None:
        if drop:
            settle_files(files if which == 0 else [plain.path], drop=True)

    timed: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[int], None]]] = {
        "store": (engine_store, lambda: plain.write(sync=drop), before_store),
        "load": (lambda: run_job(True), plain.read, before_load),
    }
    rows: list[Row] = []
    try:
        for direction in directions:
            if direction == "load" and not os.path.exists(plain.path):
                run_job(False)  # files to read, untimed
                plain.write(sync=drop)
            engine_fn, plain_fn, before = timed[direction]
            engine_s, plain_s = best_pair(engine_fn, plain_fn, repeat, before)
            gbps, base = nbytes / engine_s / 1e9, nbytes / plain_s / 1e9
            rows.append(
                {
                    "page_kib": layout.page_bytes // 1024,
                    "direction": direction,
                    "mode": mode,
                    "io": engine.io_mode,
                    "cache": "bypassed" if direct else ("dropped" if drop else "kept"),
                    "blocks": len(keys) * layout.blocks_per_chunk,
                    "blocks_per_chunk": layout.blocks_per_chunk,
                    "chunks": len(keys),
                    "io_threads": io_threads,
                    "bytes": nbytes,
                    "gbps": gbps,
                    "baseline_gbps": base,
                    "ratio": gbps / base,
                    # the pool's own rows go to the disk (no bounce buffer): O_DIRECT needs
                    # 4 KiB-aligned rows; buffered I/O always can
                    "zero_copy": bool(engine.chunks.zero_copy),
                }
            )
    finally:
        engine.shutdown()
        engine.drop(keys)  # the next row's room
        plain.remove()
    return rows


def _chunk_keys(count: int, seed: int) -> list[int]:
    """``count`` distinct keys spread like real ones (a 64-bit hash, group 0), so the files
    spread over the rank directory's 256 subdirectories as a real tier's do."""
    rng = random.Random(seed)
    keys: dict[int, None] = {}
    while len(keys) < count:
        keys[make_key(rng.getrandbits(64))] = None
    return list(keys)


def run_disk_bench(
    page_kib: list[int],
    blocks: int,
    directions: list[str],
    modes: Sequence[str] = MODES,
    repeat: int = 3,
    path: str | None = None,
    blocks_per_chunk: int = 1,
    io_threads: int = 4,
    max_bytes: int | None = DEFAULT_DISK_MAX_BYTES,
) -> dict[str, object]:
    """Measure the disk engine's write and read GB/s per page size, direction and mode against
    a plain sequential write and read of the same bytes on the same path.

    Returns ``{"device": "disk", "path", "direct_io", "cold_io", "io_threads",
    "blocks_per_chunk", "plain_io_bytes", "repeat", "results": [{"page_kib", "direction",
    "mode", "io", "cache", "blocks", "blocks_per_chunk", "chunks", "io_threads", "bytes",
    "gbps", "baseline_gbps", "ratio", "zero_copy"}, ...]}`` (GB = 10^9 bytes). ``blocks`` is
    capped per page size so the pool stays within ``max_bytes`` (None: no cap), at least one
    chunk. ``path``: where the files go (a fresh directory under it, removed at the end)."""
    for direction in directions:
        if direction not in DISK_DIRECTIONS:
            raise ValueError(
                f"direction must be one of {DISK_DIRECTIONS} on the disk, got {direction!r}"
            )
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    if blocks_per_chunk < 1 or blocks < blocks_per_chunk:
        raise ValueError(f"blocks ({blocks}) must be >= blocks_per_chunk ({blocks_per_chunk}) >= 1")
    root = path if path is not None else tempfile.gettempdir()
    problem = directory_problem(root)
    if problem:
        raise ValueError(f"path {root}: {problem}")

    sizes: list[tuple[int, int]] = []  # (page KiB, chunks)
    for kib in page_kib:
        pages = blocks if max_bytes is None else min(blocks, max_bytes // (kib * 1024))
        sizes.append((kib, max(1, pages // blocks_per_chunk)))
    run_dir = tempfile.mkdtemp(prefix="raykv-bench-disk-", dir=root)
    try:
        direct_ok = probe_direct_io(run_dir)
        if "cold" in modes and not direct_ok and not hasattr(os, "posix_fadvise"):
            raise ValueError(f"path {root}: no O_DIRECT and no posix_fadvise here: no cold reads")
        _check_space(run_dir, root, sizes, blocks_per_chunk)
        rows: list[Row] = []
        for kib, chunks in sizes:
            layout = disk_layout(kib, chunks * blocks_per_chunk, blocks_per_chunk)
            pool, memory = aligned_pool(layout)
            keys = _chunk_keys(chunks, _SEED + kib)
            for mode in modes:
                rows.extend(
                    _bench_mode(
                        layout,
                        pool,
                        memory,
                        keys,
                        mode,
                        direct_ok,
                        directions,
                        repeat,
                        io_threads,
                        run_dir,
                    )
                )
            del pool, memory
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "device": "disk",
        "path": root,
        "direct_io": direct_ok,
        "cold_io": "O_DIRECT" if direct_ok else "fsync + POSIX_FADV_DONTNEED",
        "io_threads": io_threads,
        "blocks_per_chunk": blocks_per_chunk,
        "plain_io_bytes": PLAIN_IO_BYTES,
        "repeat": repeat,
        "results": rows,
    }


def _check_space(run_dir: str, root: str, sizes: list[tuple[int, int]], pages: int) -> None:
    """Refuse a run whose largest row (its chunk files and the plain file, side by side) does
    not fit, before writing anything, rather than ending in ENOSPC halfway."""
    need = 0
    for kib, chunks in sizes:
        fmt = ChunkFormat(kib * 1024, pages)
        need = max(need, chunks * fmt.file_bytes + align_up(chunks * fmt.data_bytes))
    stat = os.statvfs(run_dir)
    free = stat.f_bavail * stat.f_frsize
    if need > free:
        raise ValueError(
            f"path {root}: {free / 2**20:,.0f} MiB free, the largest row needs "
            f"{need / 2**20:,.0f} MiB (fewer --blocks or smaller pages)"
        )


def format_disk_table(result: dict[str, object]) -> str:
    """The disk bench's result as a plain-text table."""
    chunk = result["blocks_per_chunk"]
    title = (
        f"transfer bench on disk under {result['path']} (cold: {result['cold_io']}; "
        f"{result['io_threads']} I/O threads, {chunk} block{'s' if chunk != 1 else ''} a "
        f"chunk file; plain: one file, {PLAIN_IO_BYTES // 2**20} MiB I/Os)"
    )
    header = (
        f"{'page KiB':>9} {'direction':>9} {'mode':>5} {'io':>8} {'blocks':>7} {'GB/s':>8} "
        f"{'plain GB/s':>10} {'ratio':>6} {'zero copy':>9}"
    )
    lines = [title, header]
    rows = result["results"]
    assert isinstance(rows, list)
    for row in rows:
        lines.append(
            f"{row['page_kib']:>9} {row['direction']:>9} {row['mode']:>5} {row['io']:>8} "
            f"{row['blocks']:>7} {row['gbps']:>8.2f} {row['baseline_gbps']:>10.2f} "
            f"{row['ratio']:>6.2f} {'yes' if row['zero_copy'] else 'no':>9}"
        )
    return "\n".join(lines)
