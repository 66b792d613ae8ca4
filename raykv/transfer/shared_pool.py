"""A rank's CPU-pool shard in shared memory, so that its death does not take the CPU tier with it.

A rank's shard of the CPU pool is a file in a tmpfs directory (``/dev/shm`` by default) mapped
into the rank's process. When the process dies the file stays; the rank that replaces it maps
the same file and finds every chunk its predecessor finished storing. The scheduler still fails
every job that was in flight (a store the dead rank was writing never becomes readable), so only
finished, fully written chunks are served again.

Where the files live and who removes them: :mod:`raykv.transfer.pool_files`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re

import torch

from raykv.transfer.layout import KVLayout


class SharedPoolUnavailable(RuntimeError):
    """The shard cannot live in shared memory here (no such directory, no room): the rank keeps
    it in private memory instead."""


class SharedPool:
    """One rank's CPU-pool shard mapped from ``path``: ``tensor`` has the shape of
    :func:`~raykv.transfer.layout.allocate_pool`'s pool, ``sums`` one checksum per page row
    (-1: none), and ``attached`` says whether the file already existed with this size (a
    predecessor's shard, contents and checksums kept) or was created now."""

    def __init__(self, path: str, layout: KVLayout) -> None:
        rows, cols = layout.num_slots, layout.page_elems * layout.blocks_per_chunk
        itemsize = torch.empty((), dtype=layout.torch_dtype).element_size()
        pool_bytes = rows * cols * itemsize
        pages = rows * layout.blocks_per_chunk
        # after the pool, one int64 checksum per page row (``CpuTransferEngine``): they must
        # outlive the process with the bytes they vouch for
        nbytes = pool_bytes + pages * 8
        self.path = path
        self._nbytes = nbytes
        self._pinned = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise SharedPoolUnavailable(
                f"cannot create the CPU-pool shard {path!r} (offload.shared_pool_dir): {exc}"
            ) from exc
        try:
            self.attached = os.fstat(fd).st_size == nbytes
            if not self.attached:
                os.ftruncate(fd, 0)
                _reserve(fd, nbytes, path)
            # the mapping outlives the descriptor; the tensor below keeps the mapping alive
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.unlink()  # no half-made shard left behind for a successor to attach
            raise
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=layout.torch_dtype, count=rows * cols).view(
            rows, cols
        )
        self.sums = torch.frombuffer(self._map, dtype=torch.int64, offset=pool_bytes, count=pages)
        if not self.attached:
            self.sums.fill_(-1)  # no row vouched for yet

    def pin(self) -> bool:
        """Page-lock the mapping for asynchronous DMA (``cudaHostRegister``), as a pinned pool
        from torch's allocator would be; False when CUDA refuses. The registration ends with the
        process, or with :meth:`unpin`."""
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self._nbytes, 0)
        except (AttributeError, RuntimeError):  # a torch without the binding, or no driver
            return False
        self._pinned = int(rc) == 0
        if not self._pinned:
            _drain_cuda_error()
        return self._pinned

    def unpin(self) -> None:
        if self._pinned:
            rc = torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
            if int(rc) != 0:
                _drain_cuda_error()

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid until the tensor is dropped)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def filesystem_type(path: str, mount_table: str = "/proc/self/mounts") -> str:
    """The type of the file system ``path`` is on (``tmpfs``, ``ext4``, ...), from the mount
    table; ``unknown`` where that cannot be read. Linux 6.5 and later page-lock a shared file
    for DMA only on tmpfs and hugetlbfs, so this names the cause when CUDA refuses."""
    try:
        with open(mount_table, "rb") as mounts:
            table = [fields[1:3] for fields in map(bytes.split, mounts) if len(fields) > 2]
    except OSError:
        return "unknown"
    real = os.fsencode(os.path.realpath(path))
    best, kind = b"", "unknown"
    for escaped, fstype in table:
        # the table writes a space, tab, newline and backslash in a name as octal escapes
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), escaped)
        inside = real == point or real.startswith(point.rstrip(b"/") + b"/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype.decode(errors="replace")
    return kind


def _drain_cuda_error() -> None:
    """Read and clear CUDA's last error after a refused ``cudaHostRegister`` or
    ``cudaHostUnregister``. Left there, torch reads it after its next kernel launch and raises
    it from that launch, one that did nothing wrong (torch binds no ``cudaGetLastError``; its
    check after a launch is what reads it)."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda").add_(1)


def _reserve(fd: int, nbytes: int, path: str) -> None:
    """Allocate the file's pages now: a tmpfs that fills up later would kill the process with
    SIGBUS on its first write to a page, not raise an error anyone could report."""
    directory = os.path.dirname(path) or "."
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise SharedPoolUnavailable(
            f"offload.shared_pool_dir {directory!r} has {free / 2**20:,.0f} MiB free; this rank's "
            f"CPU-pool shard needs {nbytes / 2**20:,.0f} MiB (give the tmpfs more room, e.g. "
            "docker --shm-size, or point shared_pool_dir at a larger one)"
        )
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise SharedPoolUnavailable(
            f"cannot reserve {nbytes / 2**20:,.0f} MiB for the CPU-pool shard {path!r} "
            f"(offload.shared_pool_dir): {exc}"
        ) from exc
