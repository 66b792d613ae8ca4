"""One chunk's file written from its CPU slot, or read into it, on the calling thread.

A write builds the header (the key, the sizes, the CRC-32 of every page, ``transfer/crc.py``),
writes header and pages in one ``pwritev`` from the pool's own memory (through this thread's
aligned bounce buffer where ``O_DIRECT`` needs alignment the pool's rows lack) over a free file
or a new temporary one, and renames it into place once complete. A read checks the size, the
header and every page's checksum before the bytes count, deletes a file that fails and raises
``SourceCorrupt``; a demotion whose CPU bytes no longer match the checksums their store recorded
raises it too and writes nothing. ``DiskFull`` is a write that found no room. The disk engine
(``transfer/disk.py``) runs these on its I/O threads.

Only regular files are ever read or written over: every open refuses a link (``O_NOFOLLOW``)
and never waits for a peer (``O_NONBLOCK``: a FIFO put in a file's place would otherwise hold
an I/O thread in ``open`` for good), then ``fstat`` must say a regular file. Anything else
under a chunk's name (or a file of another user's, or one linked in from elsewhere) is never
served, and is taken away (``RankDirectory.take_away``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import threading

import torch

from raykv.transfer.checksums import NO_CHECKSUM, RowChecksums
from raykv.transfer.crc import crc32
from raykv.transfer.disk_files import ALIGN, ChunkFileError, ChunkFormat, RankDirectory


class SourceCorrupt(Exception):
    """A chunk's source bytes are bad (the file, or the CPU slot a demotion would write)."""


class DiskFull(Exception):
    """The disk had no room for a chunk's file."""


# never through a link, never waiting for a FIFO's other end
SAFE_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def open_regular(path: str, flags: int) -> int:
    """A descriptor of the regular file at ``path`` (opened with ``flags`` and the safe ones);
    ``ChunkFileError`` where something else is there (a link, a FIFO, a device, a directory,
    a socket); ``FileNotFoundError`` where nothing is. ``O_DIRECT`` in ``flags`` is set once
    the file is known to be regular (a FIFO opened with it fails with a bare EINVAL)."""
    direct = flags & getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, (flags & ~direct) | SAFE_OPEN)
    except OSError as exc:
        # a link (ELOOP), a FIFO nobody reads (ENXIO), a directory (EISDIR), a socket
        # (ENXIO/EOPNOTSUPP), a device that refuses
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise ChunkFileError(f"not a regular file ({exc.strerror})") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ChunkFileError(f"not a regular file (mode {stat.filemode(info.st_mode)})")
    if info.st_uid != os.geteuid() or info.st_nlink != 1:
        # another user's file, or one linked in from elsewhere: not a file raykv wrote here
        os.close(fd)
        raise ChunkFileError(f"not this user's own file (uid {info.st_uid}, {info.st_nlink} links)")
    # blocking I/O for the reads and writes of a regular file, O_DIRECT where asked
    try:
        status = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (status & ~os.O_NONBLOCK) | direct)
    except OSError:
        os.close(fd)
        raise
    return fd


class ChunkIO:
    """Chunk files in ``files`` against the slots of ``pool`` (``[num_slots, chunk elems]``),
    with ``O_DIRECT`` where ``direct``. ``fsync``: each file reaches the device before it is
    renamed into place; ``sums``: the CPU pool's row checksums (``offload.verify``)."""

    def __init__(
        self,
        files: RankDirectory,
        fmt: ChunkFormat,
        pool: torch.Tensor,
        direct: bool,
        fsync: bool,
        sums: RowChecksums | None,
    ) -> None:
        self.files = files
        self.format = fmt
        self.fsync = fsync
        self.sums = sums
        self._slots = pool.view(torch.uint8).numpy()  # [num_slots, chunk bytes], shared memory
        if self._slots.shape[1] != fmt.data_bytes:
            raise ValueError(f"pool rows of {self._slots.shape[1]} bytes, not one chunk each")
        self._open_flags = os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        # the pool's own rows can be read and written directly where O_DIRECT's alignment holds
        base = pool.data_ptr()
        self.zero_copy = not direct or (base % ALIGN == 0 and fmt.data_bytes % ALIGN == 0)
        self._local = threading.local()
        self._pad = bytes(fmt.file_bytes - fmt.header_bytes - fmt.data_bytes)

    def _buffers(self) -> tuple[mmap.mmap, mmap.mmap | None]:
        """This thread's aligned header buffer, and its bounce buffer for a whole file where
        O_DIRECT cannot use the pool's rows."""
        local = self._local
        if not hasattr(local, "header"):
            local.header = mmap.mmap(-1, self.format.header_bytes)
            local.whole = None if self.zero_copy else mmap.mmap(-1, self.format.file_bytes)
        return local.header, local.whole

    def _page_crcs(self, data: memoryview) -> list[int]:
        pb = self.format.page_bytes
        return [crc32(data[i * pb : (i + 1) * pb]) for i in range(self.format.pages)]

    def _rows(self, slot: int) -> list[int]:
        pages = self.format.pages
        return list(range(slot * pages, (slot + 1) * pages))

    def write(self, key: int, slot: int, check: bool) -> None:
        """Slot ``slot`` to ``key``'s file (``check``: against the pool's recorded checksums
        first)."""
        fmt = self.format
        data = memoryview(self._slots[slot])
        crcs = self._page_crcs(data)
        if check and self.sums is not None:
            recorded = self.sums.sums[self._rows(slot)].tolist()
            if any(r != NO_CHECKSUM and r != c for r, c in zip(recorded, crcs, strict=True)):
                raise SourceCorrupt(f"CPU slot {slot} changed since its store (key {key:#x})")
        header, whole = self._buffers()
        header[:] = fmt.header(key, crcs)
        tmp: str | None = None
        try:
            try:
                fd, tmp = self._open_temporary(key)
            except FileNotFoundError:  # the directory went behind raykv's back
                self.files.make_again()  # the free files with it
                fd, tmp = self._open_temporary(key)
            try:
                if whole is None:
                    parts = [header, data] + ([self._pad] if self._pad else [])
                    written = os.pwritev(fd, parts, 0)
                else:
                    whole[: fmt.header_bytes] = header
                    end = fmt.header_bytes + fmt.data_bytes
                    whole[fmt.header_bytes : end] = data
                    whole[end:] = self._pad
                    written = os.pwrite(fd, whole, 0)
                if written != fmt.file_bytes:
                    raise OSError(errno.EIO, f"short write: {written} of {fmt.file_bytes} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.files.place(tmp, key)
            if self.fsync:
                self._sync_dir(os.path.dirname(tmp))
        except OSError as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(str(exc)) from exc
            raise

    def _open_temporary(self, key: int) -> tuple[int, str]:
        """The file ``key``'s bytes are written into before it is renamed into place (its
        descriptor and path): a free file where there is one (no file to make), else a new
        temporary one. ``FileNotFoundError`` where the directory is gone."""
        tmp = self.files.take_free()
        if tmp is not None:
            self.files.subdirectory(key)  # the rename's destination
            try:
                return open_regular(tmp, os.O_WRONLY | self._open_flags), tmp
            except (ChunkFileError, FileNotFoundError):
                self.files.take_away(tmp)  # replaced behind raykv's back: not written over
        tmp = self.files.temporary(key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._open_flags | SAFE_OPEN
        return os.open(tmp, flags, 0o600), tmp

    def read(self, key: int, slot: int, check: bool) -> None:
        """``key``'s file into slot ``slot``, checked (``check``: recording the checksums it
        verified for the CPU tier's loads)."""
        fmt = self.format
        path = self.files.path(key)
        data = memoryview(self._slots[slot])
        header, whole = self._buffers()
        try:
            fd = open_regular(path, os.O_RDONLY | self._open_flags)
        except FileNotFoundError:
            raise SourceCorrupt(f"the file of key {key:#x} is gone") from None
        except ChunkFileError as exc:
            self.files.take_away(path)
            raise SourceCorrupt(f"the file of key {key:#x}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size != fmt.file_bytes:
                raise ChunkFileError(f"{size} bytes, {fmt.file_bytes} expected")
            if whole is None:
                pad = bytearray(len(self._pad))
                got = os.preadv(fd, [header, data, pad] if pad else [header, data], 0)
                head, body = memoryview(header), data
            else:
                got = os.preadv(fd, [whole], 0)
                head = memoryview(whole)[: fmt.header_bytes]
                body = memoryview(whole)[fmt.header_bytes : fmt.header_bytes + fmt.data_bytes]
            if got != fmt.file_bytes:
                raise ChunkFileError(f"short read: {got} of {fmt.file_bytes} bytes")
            crcs = fmt.parse_header(key, head)
            if self._page_crcs(body) != crcs:
                raise ChunkFileError("page checksum mismatch")
        except ChunkFileError as exc:
            self.files.remove(key)  # never served again, whatever the scheduler learns
            raise SourceCorrupt(f"the file of key {key:#x}: {exc}") from None
        finally:
            os.close(fd)
        if whole is not None:
            data[:] = body
        if check and self.sums is not None:
            self.sums.sums[self._rows(slot)] = torch.tensor(crcs, dtype=torch.int64)

    @staticmethod
    def _sync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
