"""The disk tier's files: where a rank keeps its chunks, and what one chunk's file holds.

A rank keeps its shard of every chunk the disk tier holds in a directory of its own,
``<offload.disk.path>/<namespace>/rank-<r>/``, one file per chunk named by its key, in 256
subdirectories by the key's hash (``ab/00ab12...cd00.kv``) so that no directory grows past a few
thousand entries at a million chunks. The namespace (``engine/tier_namespace.py``) names the
model, dtype, KV layout, block and chunk sizes, TP size and this format's version: a run reads
only files whose bytes mean the same to it.

One file::

    header (a multiple of 4 KiB; one block holds it up to 998 pages a chunk)
        magic "RAYKVDSK", format version, header size, the key (16 bytes), page bytes, pages,
        what the bytes are (``ChunkIdentity``: the namespace's digest, the rank, the TP size),
        the CRC-32 of every page, a seal (32 bytes: a keyed hash of all of it and the pages
        where the tier has a secret, the shared tier's; zeros on disk), the CRC-32 of the
        header itself
    the chunk's pages, back to back, then zeros up to the next 4 KiB

Every size is a multiple of 4 KiB so the same file can be read and written with ``O_DIRECT``. A file
is written under a temporary name that carries the writer's pid and renamed when complete, so a
crash mid-write leaves only a temporary file, never a torn ``.kv``; every temporary file but the
indexing engine's own is swept when a rank indexes its directory (only the holder of its lock writes
there). An evicted chunk's file is not deleted but moved to ``free/`` and written over by a later
chunk (then renamed into place as a new one is): making a file costs about a millisecond of the
kernel's time on ext4, measured here, more than writing 700 KB, and a full tier evicts one file for
each it writes. A file in ``free/`` is never read as a chunk; the list is bounded, the rest deleted.
Only regular files are indexed, recycled or written over: a link, a FIFO, a device, a socket or a
directory under a chunk's name (something raykv never makes) is counted, logged once and taken away,
never opened as a chunk. A chunk file carries no seal: its directory is the boundary, so every
directory raykv makes under the path must be this user's alone (``check_private``), and a file is
read only where it is this user's with one link. A read checks the size, the header (its checksum,
the key, the sizes, the namespace, rank and TP size it was written for) and every page's CRC-32
before the bytes count: a file torn, truncated, rewritten, or replaced behind raykv's back (by
another rank's file of the key, or another namespace's of the same geometry) is never served.

No torch here: what the engine writes and reads are buffers.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from raykv.transfer.crc import crc32

FORMAT_VERSION = 2  # 2: the header names the namespace, rank and TP size, and has a seal
MAGIC = b"RAYKVDSK"
ALIGN = 4096  # O_DIRECT's alignment on every file system raykv meets (and a page)
NAMESPACE_BYTES = 16
SEAL_BYTES = 32
NO_SEAL = bytes(SEAL_BYTES)
# magic, version, header bytes, key (two u64 halves: keys are up to 72 bits), page bytes, pages,
# namespace digest, rank, TP size
_FIXED = struct.Struct(f"<8sIIQQQI{NAMESPACE_BYTES}sII")
_SUFFIX = ".kv"
_TMP_RE = re.compile(r"^\.(?P<key>[0-9a-f]+)\.(?P<pid>\d+)\.(?P<n>[0-9a-f]+-\d+)\.tmp$")
_NAME_RE = re.compile(r"^(?P<key>[0-9a-f]+)\.kv$")
FREE_DIR = "free"  # evicted chunks' files, written over by later chunks

log = logging.getLogger(__name__)


class ChunkFileError(ValueError):
    """A chunk's file is not what it should be (torn, truncated, another key's, bytes changed)."""


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class ChunkIdentity:
    """What a rank's part of a chunk is, besides its key: the digest of the namespace it was
    computed under (model, dtype, layout, block and chunk sizes, TP size, device,
    ``engine/tier_namespace.py``), the rank whose heads it holds and the TP size. A part is
    served only to the same namespace, rank and TP size."""

    namespace: bytes = bytes(NAMESPACE_BYTES)
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError(f"a namespace digest of {len(self.namespace)} bytes")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} of a TP size of {self.tp_size}")


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """The geometry of one rank's chunk files (``pages`` pages of ``page_bytes`` each) and what
    its parts are (``identity``)."""

    page_bytes: int
    pages: int
    identity: ChunkIdentity = ChunkIdentity()

    @property
    def data_bytes(self) -> int:
        return self.page_bytes * self.pages

    @property
    def sealed_bytes(self) -> int:
        """The header's bytes a seal covers (with the pages): all but the seal and the CRC."""
        return _FIXED.size + 4 * self.pages

    @property
    def header_bytes(self) -> int:
        return align_up(self.sealed_bytes + SEAL_BYTES + 4)

    @property
    def file_bytes(self) -> int:
        """The whole file: header, pages and the padding to 4 KiB."""
        return self.header_bytes + align_up(self.data_bytes)

    def sealed_part(self, key: int, crcs: list[int]) -> bytes:
        """The part of ``key``'s header a seal covers: what the chunk is and its pages'
        CRC-32s."""
        if len(crcs) != self.pages:
            raise ValueError(f"{len(crcs)} page checksums for a chunk of {self.pages} pages")
        who = self.identity
        return _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            self.header_bytes,
            key & (2**64 - 1),
            key >> 64,
            self.page_bytes,
            self.pages,
            who.namespace,
            who.rank,
            who.tp_size,
        ) + struct.pack(f"<{self.pages}I", *crcs)

    def header(self, key: int, crcs: list[int], seal: bytes = NO_SEAL) -> bytes:
        """The header of ``key``'s file whose pages have these CRC-32s, with ``seal`` (padded
        to its size)."""
        return self.header_of(self.sealed_part(key, crcs), seal)

    def header_of(self, sealed: bytes, seal: bytes = NO_SEAL) -> bytes:
        """The whole header from its sealed part (``sealed_part``) and its seal."""
        if len(seal) != SEAL_BYTES:
            raise ValueError(f"a seal of {len(seal)} bytes")
        body = sealed + seal
        body += struct.pack("<I", crc32(body))
        return body.ljust(self.header_bytes, b"\0")

    def parse_header(self, key: int, header: bytes | memoryview) -> list[int]:
        """The page CRC-32s a header of ``key``'s file records; ``ChunkFileError`` naming what
        is wrong when it is not intact, or not this geometry's header of that key for this
        identity (another rank's part, another namespace's or TP size's)."""
        header = bytes(header[: self.header_bytes])
        if len(header) < self.header_bytes:
            raise ChunkFileError(f"header of {len(header)} bytes, {self.header_bytes} expected")
        if header[:8] != MAGIC:
            raise ChunkFileError("not a raykv chunk file (bad magic)")
        (version,) = struct.unpack_from("<I", header, 8)
        if version != FORMAT_VERSION:
            raise ChunkFileError(f"format version {version}, this raykv reads {FORMAT_VERSION}")
        _, _, size, low, high, page_bytes, pages, space, rank, tp_size = _FIXED.unpack_from(header)
        if (size, page_bytes, pages) != (self.header_bytes, self.page_bytes, self.pages):
            raise ChunkFileError(
                f"a chunk of {pages} pages of {page_bytes} bytes (header {size}), "
                f"{self.pages} of {self.page_bytes} (header {self.header_bytes}) expected"
            )
        end = self.sealed_bytes + SEAL_BYTES
        (recorded,) = struct.unpack_from("<I", header, end)
        if crc32(header[:end]) != recorded:
            raise ChunkFileError("header checksum mismatch")
        if (high << 64) | low != key:
            raise ChunkFileError(f"holds key {(high << 64) | low:#x}, not {key:#x}")
        who = self.identity
        if space != who.namespace:
            raise ChunkFileError(
                f"written under namespace {space.hex()}, not {who.namespace.hex()}"
            )
        if (rank, tp_size) != (who.rank, who.tp_size):
            raise ChunkFileError(
                f"rank {rank}'s part at TP {tp_size}, not rank {who.rank}'s at TP {who.tp_size}"
            )
        return list(struct.unpack_from(f"<{pages}I", header, _FIXED.size))

    def seal_of(self, header: bytes | memoryview) -> bytes:
        """The seal a header carries."""
        return bytes(header[self.sealed_bytes : self.sealed_bytes + SEAL_BYTES])


ANONYMOUS = ChunkIdentity()  # a part of no namespace (benches, tests of the format)


class RankDirectory:
    """One rank's directory of chunk files: the path of each key's file and temporary file, the
    index of what is there, the sweep of what crashed writers left, and the files kept for
    reuse (at most ``max_free``)."""

    def __init__(self, root: str, max_free: int = 256) -> None:
        self.root = root
        self.free_dir = os.path.join(root, FREE_DIR)
        self.max_free = max_free
        self._pid = os.getpid()
        # names this instance makes: its pid, a token of its own (two instances in one process,
        # or a pid the system gave again, never make the same name) and a counter whose next()
        # is one C call, safe from any thread
        self._stem = f"{self._pid}.{secrets.token_hex(4)}"
        self._names = itertools.count(1)
        self._free: list[str] = []
        self._free_lock = threading.Lock()
        # subdirectories known to exist: made on a key's first write, not all 256 up front (a
        # small tier, or a test's many engines, would pay for 256 directories each)
        self._made: set[str] = set()
        # names of chunks found to be no regular file of this user's (taken away)
        self.special_files = 0
        self._said_special = False
        self._said_gone = False
        # the descriptor whose lock holds the directory for its engine (``claim_directory``)
        self.lock_fd: int | None = None

    def path(self, key: int) -> str:
        name = f"{key:018x}"
        return os.path.join(self.root, name[-4:-2], name + _SUFFIX)

    def temporary(self, key: int) -> str:
        """A fresh temporary name beside ``key``'s file, this process's own (each name is
        made once: pid, this instance's token, a counter); its subdirectory made if new."""
        name = f"{key:018x}"
        tmp = f".{name}.{self._stem}-{next(self._names)}.tmp"
        return os.path.join(self.subdirectory(key), tmp)

    def subdirectory(self, key: int) -> str:
        """The subdirectory ``key``'s file goes in, made where this instance has not made or
        seen it yet (safe from any thread: makedirs tolerates a racing twin)."""
        sub = f"{key:018x}"[-4:-2]
        path = os.path.join(self.root, sub)
        if sub not in self._made:
            self._real_directory(path)  # never through a link to elsewhere
            self._made.add(sub)
        return path

    def make(self) -> None:
        """Create the directory and ``free/`` (where missing, only this user's: a link or
        anything else in ``free/``'s place is taken away first); the 256 subdirectories come
        with their first files."""
        self._real_directory(self.free_dir)

    def make_again(self) -> None:
        """The directory went while this rank held it (``rm -rf`` of the tier's path): make it
        again, its parents with it, and its lock taken again (the old one locks a file that is
        gone: another engine could claim the name); forget which subdirectories were made; said
        once in the log. Its files went with it (their reads fail, their chunks leave the
        tier)."""
        with self._free_lock:
            self._made.clear()
            self._free.clear()
            if not self._said_gone:
                self._said_gone = True
                log.warning(
                    "disk tier: the directory %s was removed while in use; made again (the "
                    "chunks in it are gone and will be recomputed)",
                    self.root,
                )
        make_private_dirs(self.root)
        self.make()
        if self.lock_fd is not None:
            fd = _try_lock(self.root)
            if fd is None:  # another engine took the name meanwhile: both write it now
                log.warning("disk tier: another engine took %s while it was gone", self.root)
            else:
                os.close(self.lock_fd)
                self.lock_fd = fd

    def _real_directory(self, path: str) -> None:
        """``path`` a directory of this user's alone, made where missing; something else there
        (a link, a file) taken away first (``UntrustedDirectory`` where it cannot be)."""
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
            self._special(path)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        check_private(path)

    def recycle(self, key: int) -> None:
        """Move ``key``'s file to the free list (deleted when the list is full or the file is
        gone already; something that is no regular file is taken away, never kept)."""
        path = self.path(key)
        if not _regular(path):
            if os.path.lexists(path):
                self._special(path)
            return
        with self._free_lock:
            full = len(self._free) >= self.max_free
        spare = (
            None if full else os.path.join(self.free_dir, f".free-{self._stem}-{next(self._names)}")
        )
        if spare is None:
            self.remove(key)
            return
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            return
        with self._free_lock:
            self._free.append(spare)

    def take_free(self) -> str | None:
        """A file to write a chunk over (then to rename into place), or None."""
        with self._free_lock:
            return self._free.pop() if self._free else None

    def take_away(self, path: str) -> None:
        """Take away what is at ``path`` (a chunk's name, or a free file's) and was found to be
        no regular file of this user's."""
        self._special(path)

    def place(self, tmp: str, key: int) -> None:
        """Rename the finished file ``tmp`` into ``key``'s place; something that is no regular
        file there (a directory a rename cannot replace) is taken away first."""
        target = self.path(key)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if _regular(target) or not os.path.lexists(target):
                raise
            self._special(target)
            if os.path.lexists(target):
                raise OSError(exc.errno, f"{target!r} is no regular file and stays") from None
            os.rename(tmp, target)

    def _adopt_free(self) -> None:
        """The free files an earlier run left, taken up to ``max_free`` (the rest deleted;
        anything not a regular file taken away)."""
        try:
            entries = sorted(os.scandir(self.free_dir), key=lambda e: e.name)
        except FileNotFoundError:
            return
        with self._free_lock:
            known = set(self._free)
            for entry in entries:
                path = entry.path
                if path in known:
                    continue
                if not entry.is_file(follow_symlinks=False):
                    self._special(path)
                elif len(self._free) < self.max_free:
                    self._free.append(path)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def _special(self, path: str) -> None:
        """Take away what is no regular file at ``path`` (counted; logged the first time): a
        name unlinked, a directory removed with what it holds (it sits under a chunk's name in
        a directory only this user can write: nothing raykv made, nothing anyone else
        could have)."""
        self.special_files += 1
        if not self._said_special:
            self._said_special = True
            log.warning(
                "disk tier %s: %s is no regular file: not a chunk, taken away (counted as "
                "special files from now on)",
                self.root,
                path,
            )
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)  # never follows a link inside
            else:
                os.unlink(path)
        except OSError:
            pass

    def scan(self) -> tuple[list[int], int]:
        """The keys whose files are here, oldest file first, and how many stale temporary
        files were removed on the way: every one this instance did not make. Only the holder
        of the directory's lock writes here (``claim_directory``), so a temporary file of any
        other writer is an earlier holder's, left by a crash, whether or not its pid runs now
        (a pid the system gave again, or an engine of this process that came before). Names
        raykv did not write are left alone."""
        self._adopt_free()
        keys: list[tuple[int, int]] = []
        swept = 0
        for entry in self._entries():
            m = _NAME_RE.match(entry.name)
            if m is not None:
                if entry.is_file(follow_symlinks=False):
                    keys.append((_mtime(entry), int(m["key"], 16)))
                else:
                    self._special(entry.path)
                continue
            t = _TMP_RE.match(entry.name)
            if t is not None and f"{t['pid']}.{t['n']}".rsplit("-", 1)[0] != self._stem:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    swept += 1
        return [key for _, key in sorted(keys)], swept

    def listing(self) -> list[int]:
        """The keys whose files are here, oldest file first, by name and age alone: nothing is
        opened, swept or taken away (for a process that only plans, such as vLLM's scheduler;
        the rank that holds the directory checks each file when it reads it)."""
        keys: list[tuple[int, int]] = []
        for entry in self._entries():
            m = _NAME_RE.match(entry.name)
            if m is not None and entry.is_file(follow_symlinks=False):
                keys.append((_mtime(entry), int(m["key"], 16)))
        return [key for _, key in sorted(keys)]

    def absorb(self, other: str) -> int:
        """Take in the chunk files of ``other``, a directory of the same namespace and rank that
        another engine on the node wrote (``base.1``, ...) and no live engine holds: each key's
        file moved here where this directory lacks it (the bytes mean the same), the rest
        deleted with ``other``. How many were moved."""
        moved = 0
        foreign = RankDirectory(other)
        for entry in foreign._entries():
            m = _NAME_RE.match(entry.name)
            if m is None or not entry.is_file(follow_symlinks=False):
                continue
            key = int(m["key"], 16)
            if os.path.lexists(self.path(key)):
                continue
            try:
                self.subdirectory(key)
                os.rename(entry.path, self.path(key))
                moved += 1
            except OSError:
                continue  # left with the rest of ``other``
        return moved

    def _entries(self) -> Iterator[os.DirEntry[str]]:
        try:
            subdirs = [
                e
                for e in os.scandir(self.root)
                if e.is_dir(follow_symlinks=False) and e.name != FREE_DIR
            ]
        except FileNotFoundError:
            return
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as it:
                yield from it

    def remove(self, key: int) -> None:
        """Delete ``key``'s file (nothing if it is already gone; what is there but no regular
        file is taken away as such)."""
        path = self.path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except (IsADirectoryError, PermissionError):
            self._special(path)  # a directory (unlink says EISDIR, or EPERM on some)

    def used_bytes(self) -> int:
        """Bytes the chunk files here take (their sizes)."""
        total = 0
        for entry in self._entries():
            if _NAME_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_size
        return total


def _regular(path: str) -> bool:
    """A regular file is at ``path`` (not through a link)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def probe_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` (tmpfs and some network
    file systems refuse it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, f".direct-probe.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag | os.O_CLOEXEC, 0o600)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


LOCK_NAME = ".lock"
MAX_DIRECTORIES = 64  # engines on one node that can share a path


def claim_directory(base: str, wait_s: float = 0.0) -> tuple[str, int]:
    """A rank's directory under ``base`` (``<path>/<namespace>/rank-<r>``) that no live engine
    uses: ``base`` itself or, while other engines hold it, ``base.1``, ``base.2``, ... (their
    files mean the same: the namespace says so, so whichever an engine's ranks claim, a chunk
    found under all of them is sound). ``wait_s``: how long to wait for ``base`` first (a rank
    replacing one whose process may still be exiting). Returns the directory and the descriptor
    whose exclusive lock holds it until it is closed or the process ends; ``OSError`` when the
    directories cannot be made or all are held."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = _try_lock(base)
        if fd is not None:
            return base, fd
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for k in range(1, MAX_DIRECTORIES):
        root = f"{base}.{k}"
        fd = _try_lock(root)
        if fd is not None:
            return root, fd
    raise OSError(f"{MAX_DIRECTORIES} engines hold every directory of {base!r}")


class UntrustedDirectory(OSError):
    """A tier's directory that is not this user's own (another user's, writable by others, or a
    link): its files could be anyone's."""


def make_private_dirs(path: str) -> None:
    """Make ``path`` and its missing parents readable by this user only (0700: a tier's file
    names are hashes of prompts' tokens, which a guess can be checked against); ``path``
    itself, where it is this user's already, is made so too."""
    missing: list[str] = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(made, 0o700)
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if (
            stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.geteuid()
            and stat.S_IMODE(info.st_mode) & 0o077
        ):
            os.chmod(path, 0o700)


def check_private(path: str) -> None:
    """``UntrustedDirectory`` unless ``path`` is a directory (not a link) of this user's that
    nobody else can write into: the directories raykv makes under ``offload.disk.path`` (a
    namespace's, a rank's, its ``free/`` and subdirectories). A chunk file on disk carries no
    seal: its directory is the boundary."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedDirectory(f"{path!r} is a link (raykv makes this directory itself)")
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedDirectory(f"{path!r} is not a directory")
    if info.st_uid != os.geteuid():
        raise UntrustedDirectory(f"{path!r} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedDirectory(f"{path!r} can be written by others")


def private_directory(path: str) -> None:
    """Make ``path`` (0700, where missing) and check it is this user's alone
    (``UntrustedDirectory`` otherwise)."""
    make_private_dirs(path)
    check_private(path)


def reclaim_siblings(base: str, mine: RankDirectory) -> int:
    """Take the files of ``base``'s other directories (``base``, ``base.1``, ``base.2``, ...:
    those other engines on the node took while ``base`` was held) that no live engine holds
    into ``mine``, and remove those directories: a later engine reads and reclaims what a
    concurrent one wrote. How many files were taken."""
    moved = 0
    for k in range(MAX_DIRECTORIES):
        other = base if k == 0 else f"{base}.{k}"
        if other == mine.root or not os.path.isdir(other) or os.path.islink(other):
            continue
        try:
            fd = _try_lock(other, make=False)
        except OSError:
            continue  # not this user's alone: never read
        if fd is None:
            continue  # a live engine's
        try:
            moved += mine.absorb(other)
            # out of every later engine's way at once, then removed: an engine that claims
            # the name from now on makes a new directory
            trash = f"{other}.reclaimed-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(other, trash)
        except OSError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
    return moved


def _try_lock(root: str, make: bool = True) -> int | None:
    """The lock of ``root`` (None: another engine holds it). ``make``: make it where missing;
    either way it and the namespace's directory must be this user's alone."""
    namespace = os.path.dirname(root)
    if make:
        make_private_dirs(namespace)
    check_private(namespace)  # before anything is made through it
    if make:
        make_private_dirs(root)
    check_private(root)
    fd = os.open(
        os.path.join(root, LOCK_NAME),
        os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
        0o600,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # a lock taken on a directory another engine moved away meanwhile (``reclaim_siblings``) is
    # no lock on the name: only the lock file that is there now counts
    try:
        held, there = os.fstat(fd), os.lstat(os.path.join(root, LOCK_NAME))
    except OSError:
        there = None
    if there is None or (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
        os.close(fd)
        return None
    return fd


def _mtime(entry: os.DirEntry[str]) -> int:
    """When a chunk's file was written (0 where it went meanwhile): a warm start that finds
    more than the tier's capacity keeps the newest."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0
