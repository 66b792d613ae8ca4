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
byte: it may run while copies already write into the pool. A kernel without it leaves the pages
to fault as before. A pinned pool (CUDA's page-locked memory) is resident already.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import threading
import time
from collections.abc import Callable

import torch

from raykv.transfer.chunk_jobs import lower_priority

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
STEP_BYTES = 64 << 20  # one call's share: a stop waits for at most one of them

_libc: ctypes.CDLL | None = None


def _madvise() -> Callable[[int, int, int], int] | None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            return None
    call = _libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def populate_range(address: int, nbytes: int) -> bool:
    """Fault in the whole pages of ``[address, address + nbytes)`` writable, their bytes
    unchanged; False where the kernel cannot (too old, or not a mapping it populates)."""
    madvise = _madvise()
    if madvise is None:
        return False
    page = mmap.PAGESIZE
    start = -(-address // page) * page  # partial pages at the ends fault as before
    end = (address + nbytes) // page * page
    if end <= start:
        return True
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


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
        start = time.perf_counter()
        tensor = self._tensor
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        try:
            offset = 0
            while offset < nbytes and not self._stop.is_set():
                size = min(STEP_BYTES, nbytes - offset)
                if not populate_range(address + offset, size):
                    self.refused = True
                    log.debug("the kernel does not populate the CPU pool ahead of use")
                    break
                offset += size
                self.populated = offset
        finally:
            self.seconds = time.perf_counter() - start
            self._tensor = None  # type: ignore[assignment]
            self.done.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread after its current call (waits at most ``timeout_s``)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout_s)


def populate_in_background(pool: torch.Tensor) -> PagePopulator | None:
    """A :class:`PagePopulator` for ``pool``, or None where there is nothing to do (a pinned
    pool, resident already; an empty one)."""
    if pool.numel() == 0 or pool.is_pinned():
        return None
    return PagePopulator(pool)
