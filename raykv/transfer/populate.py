"""A CPU pool's pages faulted in ahead of use, in the background.

A pool is allocated untouched (``layout.allocate_pool``): the kernel gives it a page only when
something first writes there. That first write is then paid by whoever makes it: a store's copy
on the step's path, the shared tier's transport receiving a promotion, a disk read landing. On
the VMs raykv was measured on a fault costs about as much as copying the page ten times over (a
94 MB copy into fresh memory 260 ms, into touched memory 8 ms), so a tier's first loads ran at
a fraction of their speed until its slots had all been used once (a 2,048-token load from the
shared tier 180-250 ms against 110-140 ms into touched slots).

So a pool's pages are faulted in at start by a thread of the lowest priority, with Linux's
``MADV_POPULATE_WRITE`` (5.14 and later), which maps every page writable without changing a
byte: it may run while copies already write into the pool. It goes a few MiB a call, so that
the address space's lock it holds meanwhile never keeps the model's own allocations waiting
long. A kernel without it leaves the pages to fault as before. A pinned pool (CUDA's
page-locked memory) is resident already.

The pool is then resident from the start, as a pinned one is, not paid for as its slots are
first written: where that is more than the memory this process may still take (the machine's
available memory, and its cgroup's limit where it has one), the pool is left to fault as
before, and a warning says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

from raykv.transfer.chunk_jobs import lower_priority

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
STEP_BYTES = 4 << 20  # one call's share: a stop, or an mmap of the model's, waits for one at most
HEADROOM = 0.9  # of the memory left, the most a pool may take to be populated


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (None where this process has no such symbol)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages of ``[address, address + nbytes)``: where they start and their bytes
    (partial pages at the ends are left to fault as before)."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def populate_range(start: int, nbytes: int) -> bool:
    """Fault in ``[start, start + nbytes)`` (whole pages) writable, their bytes unchanged;
    False where the kernel cannot (too old, or not a mapping it populates)."""
    madvise = _madvise()
    if madvise is None:
        return False
    return nbytes == 0 or madvise(start, nbytes, MADV_POPULATE_WRITE) == 0


def memory_left() -> int | None:
    """Bytes this process may still take: the machine's available memory, or less where its
    cgroup has a limit (v2 or v1); None where neither can be read."""
    left: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                left.append(int(line.split()[1]) * 1024)
    cgroup = _cgroup_left()
    if cgroup is not None:
        left.append(cgroup)
    return min(left) if left else None


def _cgroup_left() -> int | None:
    """What this process's memory cgroups still allow: the least room under any limit on the
    way to the root (v2, or v1's memory controller), reclaimable file pages not counted as
    used. None: no limit, or none readable."""
    try:
        with open("/proc/self/cgroup") as table:
            lines = [line.strip().split(":", 2) for line in table]
    except OSError:
        return None
    rooms: list[int] = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":
            root, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root = "/sys/fs/cgroup/memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # the cgroup's own directory and its ancestors; in a container with a namespace of its
        # own, the mount's root is the container's cgroup
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            room = _room(os.path.join(root, *parts[:depth]), *names)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _room(directory: str, limit_name: str, usage_name: str, inactive_name: str) -> int | None:
    """The room left under ``directory``'s memory limit (None: none, or unreadable)."""
    try:
        with open(os.path.join(directory, limit_name)) as limit_file:
            limit = limit_file.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        with open(os.path.join(directory, usage_name)) as usage_file:
            usage = int(usage_file.read().strip())
    except (OSError, ValueError):
        return None
    with (
        contextlib.suppress(OSError, ValueError),
        open(os.path.join(directory, "memory.stat")) as stat,
    ):
        for line in stat:
            name, _, value = line.partition(" ")
            if name == inactive_name:  # page cache the kernel takes back before failing
                usage -= int(value)
                break
    return int(limit) - max(0, usage)


class PagePopulator:
    """Faults ``tensor``'s pages in on a thread of the lowest priority, ``STEP_BYTES`` a call;
    :meth:`stop` ends it between two calls. ``done`` is set when it has ended (every page in,
    stopped, or refused by the kernel); ``seconds`` is how long it took."""

    def __init__(self, tensor: torch.Tensor, name: str = "raykv-populate") -> None:
        self._tensor = tensor  # the memory stays mapped while the thread works on it
        self._stop = threading.Event()
        self.done = threading.Event()
        self.populated = 0  # bytes
        self.refused = False
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_priority()  # the model's threads first, whatever it costs this one
        began = time.perf_counter()
        tensor = self._tensor
        start, nbytes = whole_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        try:
            offset = 0
            while offset < nbytes and not self._stop.is_set():
                size = min(STEP_BYTES, nbytes - offset)  # whole pages: STEP_BYTES is some
                if not populate_range(start + offset, size):
                    self.refused = True
                    log.debug("the kernel does not populate the CPU pool ahead of use")
                    break
                offset += size
                self.populated = offset
        finally:
            self.seconds = time.perf_counter() - began
            self._tensor = None  # type: ignore[assignment]
            self.done.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread after its current call (waits at most ``timeout_s``)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout_s)


def populate_in_background(pool: torch.Tensor, sharers: int = 1) -> PagePopulator | None:
    """A :class:`PagePopulator` for ``pool``, or None where there is nothing to do (a pinned
    pool, resident already; an empty one) or it would take more memory than is left, shared
    with ``sharers`` processes populating pools of the same size at the same time (a node's
    tensor-parallel ranks)."""
    if pool.numel() == 0 or pool.is_pinned():
        return None
    nbytes = pool.numel() * pool.element_size()
    left = memory_left()
    if left is not None and nbytes * max(1, sharers) > left * HEADROOM:
        log.warning(
            "the CPU pool (%d MiB) is more than this process may still take (%d MiB left): its "
            "pages are not faulted in ahead of use, and each slot's first copy pays for them",
            nbytes >> 20,
            max(0, left) >> 20,
        )
        return None
    return PagePopulator(pool)
